"""``python -m interlace.bench.model``: a stack of Llama-3-8B-shaped decoder layers (random
weights), prefill forward and a training step (forward + backward), interlace's
tensor-parallel layers (``interlace.nn.parallelize``) against the plain model.

* One GPU: the stack made "parallel" over a one-rank group against the same stack
  unchanged: records op ``model`` with ``t_ms`` (interlace) and ``t_ref_ms`` (plain),
  ``as_world`` 1. Over one rank each interlace linear is ``nn.Linear`` (``F.linear``, the
  same aten ops), and the fused QKV and gate/up weights run one GEMM per projection
  (``ColumnParallelLinear.forward_parts``), as the plain model's separate projections do;
  what differs is the interlace modules' own Python and the input gradients of those
  projections, summed inside their GEMMs.
* Two or more GPUs (one process per GPU, NCCL): interlace at TP = W (sequence parallel,
  overlapped fused GEMMs) against torch tensor parallelism (DTensor ``parallelize_module``,
  the torchtitan plan with sequence parallelism) and torch's async TP (the same model under
  ``torch.compile`` with the symmetric-memory micro-pipeline pass), and interlace's model
  under ``torch.compile`` (``interlace_compiled``), same run: ``t_ms``,
  ``t_torch_tp_ms``, ``t_torch_async_tp_ms``, ``t_interlace_compiled_ms``, each a step
  started alone (device idle, ranks aligned: its host time exposed), and the same with
  ``_pipelined`` (steps back to back, as a training loop runs them: host work overlaps
  the previous step's GPU work).

Every variant takes the whole sequence ``[1, T, H]`` on each rank and returns it whole:
the parallel ones slice their share before the first layer and all-gather after the last.
The plain decoder here (:class:`DecoderStack`) is shaped like transformers' Llama (module
names included), so ``parallelize`` and the tests use it where transformers is absent.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .cli import add_several_only
from .records import DEFAULT_OUT, device_name, write_records


# ---------------------------------------------------------------------------- plain model
@dataclass(frozen=True)
class DecoderConfig:
    """Shapes of a Llama-style decoder stack."""

    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    layers: int = 2
    rope_theta: float = 500000.0
    eps: float = 1e-5


LLAMA3_8B = DecoderConfig()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.head_dim, self.scaling = c.head_dim, c.head_dim**-0.5
        self.q_proj = nn.Linear(c.hidden, c.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kw):
        from ..nn.attention import apply_rotary

        b, s, _ = hidden_states.shape
        d = self.head_dim
        q = self.q_proj(hidden_states).view(b, s, -1, d).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, s, -1, d).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, s, -1, d).transpose(1, 2)
        q, k = apply_rotary(q, k, *position_embeddings)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, is_causal=attention_mask is None,
            scale=self.scaling, enable_gqa=q.shape[1] != k.shape[1],
        )  # fmt: skip
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1)), None


class MLP(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.up_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.down_proj = nn.Linear(c.intermediate, c.hidden, bias=False)
        self.act_fn = F.silu

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.self_attn, self.mlp = Attention(c), MLP(c)
        self.input_layernorm = RMSNorm(c.hidden, c.eps)
        self.post_attention_layernorm = RMSNorm(c.hidden, c.eps)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kw):
        h = self.input_layernorm(hidden_states)
        h, _ = self.self_attn(h, position_embeddings=position_embeddings,
                              attention_mask=attention_mask)  # fmt: skip
        hidden_states = hidden_states + h
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DecoderStack(nn.Module):
    """``config.layers`` Llama decoder layers and a final norm on ``[B, S, H]`` hidden
    states, rotary positions ``0 .. S - 1``, causal attention."""

    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.config_ = c
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden, c.eps)
        inv = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def rotary(self, s: int, dtype, device):
        t = torch.arange(s, device=device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.to(device))
        emb = torch.cat([freqs, freqs], dim=-1)[None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, hidden_states):
        pos = self.rotary(hidden_states.shape[1], hidden_states.dtype, hidden_states.device)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings=pos, attention_mask=None)
        return self.norm(hidden_states)


def build_stack(c: DecoderConfig, dtype, device, seed: int = 0) -> DecoderStack:
    """The stack with random weights (the same on every rank for the same seed)."""
    torch.manual_seed(seed)
    model = DecoderStack(c)
    for p in model.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    return model.to(dtype=dtype, device=device)


# ---------------------------------------------------------------------------- timing
def _step_fns(model, x, grad):
    """(prefill forward, training step) of ``model`` on ``x``."""

    def prefill():
        with torch.no_grad():
            model(x)

    def train():
        for p in model.parameters():
            p.grad = None
        model(x).backward(grad)

    return prefill, train


def _records(c: DecoderConfig, tokens: int, mode: str, **fields) -> dict:
    rec = {
        "op": "model", "strategy": "auto", "model": "llama3-8b", "dtype": "bfloat16",
        "layers": c.layers, "tokens": tokens, "hidden": c.hidden, "mode": mode,
        "train": mode == "train",
    }  # fmt: skip
    rec.update(fields)
    return rec


def one_gpu(c: DecoderConfig, tokens_list, iters: int) -> list[dict]:
    """W = 1: the interlace layers against the plain model, same process, same run."""
    import torch.distributed as dist

    import interlace
    from interlace.nn import parallelize

    from .timing import paired_median_ms

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    group = interlace.Group()
    dev = group.device
    plain = build_stack(c, torch.bfloat16, dev)
    ours = parallelize(copy.deepcopy(plain), group)
    records = []
    for tokens in tokens_list:
        gen = torch.Generator(device=dev).manual_seed(tokens)
        x = torch.randn(1, tokens, c.hidden, device=dev, generator=gen, dtype=torch.bfloat16)
        g = torch.randn(1, tokens, c.hidden, device=dev, generator=gen, dtype=torch.bfloat16)
        err = _rel(ours(x), plain(x))
        for mode, (f_plain, f_ours) in zip(
            ("prefill", "train"), zip(_step_fns(plain, x, g), _step_fns(ours, x, g))
        ):
            t_ours, t_plain = paired_median_ms(None, [f_ours, f_plain], iters=iters)
            records.append(_records(
                c, tokens, mode, as_world=1, t_ms=round(t_ours, 4), t_ref_ms=round(t_plain, 4),
                ref="torch", rel_err=round(err, 5), tokens_per_s=round(tokens / t_ours * 1e3),
                tokens_per_s_ref=round(tokens / t_plain * 1e3),
            ))  # fmt: skip
    return records


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- several GPUs
def _torch_tp(model: DecoderStack, group, compile_async: bool):
    """``model`` under torch tensor parallelism (DTensor, the torchtitan plan with sequence
    parallelism); with ``compile_async``, compiled with the async-TP micro-pipeline."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    w, r = group.world_size, group.rank
    mesh = DeviceMesh(group.device.type, list(range(w)))
    to_whole = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(**to_whole),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(**to_whole),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }  # fmt: skip
    for layer in model.layers:
        parallelize_module(layer, mesh, plan)

    def scatter(module, args, kwargs):
        x = args[0]
        s = x.shape[1] // w
        return (x[:, r * s : (r + 1) * s].contiguous(), *args[1:]), kwargs

    def gather(module, args, kwargs, out):  # (backward: the local slice, as interlace's)
        whole = DTensor.from_local(out, mesh, [Shard(1)]).redistribute(mesh, [Replicate()])
        return whole.to_local()

    model.layers[0].register_forward_pre_hook(scatter, with_kwargs=True)
    model.layers[-1].register_forward_hook(gather, with_kwargs=True)
    if compile_async:
        import torch._inductor.config as inductor_config
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        inductor_config._micro_pipeline_tp = True
        enable_symm_mem_for_group(mesh.get_group().group_name)
        # static shapes: each token count compiles its own graph (a recompile with dynamic
        # shapes fails on DTensor's ``float()`` in torch 2.11)
        model = torch.compile(model, fullgraph=False, dynamic=False)
    return model


def several_gpus_body(group, c_dict: dict, tokens_list, iters: int) -> list[dict]:
    """One rank of the W-GPU comparison: interlace vs torch TP vs torch async TP."""
    from interlace.nn import parallelize

    from .timing import max_over_ranks, paired_median_ms, pipelined_median_ms

    c = DecoderConfig(**c_dict)
    dev = group.device
    plain = build_stack(c, torch.bfloat16, dev)
    variants = {"interlace": parallelize(copy.deepcopy(plain), group)}
    builders = {
        "interlace_compiled": lambda m: torch.compile(parallelize(m, group), dynamic=False),
        "torch_tp": lambda m: _torch_tp(m, group, False),
        "torch_async_tp": lambda m: _torch_tp(m, group, True),
    }
    # a baseline that cannot be built, or whose first steps fail (a compile error), is
    # reported and left out on every rank alike (the timed steps run collectives)
    failed = {}
    for name, build in builders.items():
        try:
            variants[name] = build(copy.deepcopy(plain))
        except Exception as e:  # noqa: BLE001 - a variant that cannot run is reported
            print(f"rank {group.rank}: {name} unavailable: {type(e).__name__}: {e}", flush=True)
            failed[name] = 1
    del plain
    x0 = torch.randn(1, tokens_list[0], c.hidden, device=dev, dtype=torch.bfloat16)
    for name in variants:
        try:
            for fn in _step_fns(variants[name], x0, x0):
                fn()
            torch.cuda.synchronize()
            failed[name] = 0
        except Exception as e:  # noqa: BLE001
            if name == "interlace":
                raise
            print(f"rank {group.rank}: {name} left out: {type(e).__name__}: {e}", flush=True)
            failed[name] = 1
    failed = max_over_ranks(group, failed)
    variants = {name: v for name, v in variants.items() if not failed[name]}
    records = []
    for tokens in tokens_list:
        gen = torch.Generator(device=dev).manual_seed(tokens)
        x = torch.randn(1, tokens, c.hidden, device=dev, generator=gen, dtype=torch.bfloat16)
        g = torch.randn(1, tokens, c.hidden, device=dev, generator=gen, dtype=torch.bfloat16)
        for i, mode in enumerate(("prefill", "train")):
            names = list(variants)
            fns = [_step_fns(variants[n], x, g)[i] for n in names]
            times = dict(zip(names, paired_median_ms(group, fns, iters=iters)))
            # back to back, as a training loop or a server runs steps: host work overlaps
            for n, fn in zip(names, fns):
                times[f"{n}_pipelined"] = pipelined_median_ms(group, fn, iters=iters)
            times = max_over_ranks(group, times)
            t = times["interlace"]
            rec = _records(c, tokens, mode, t_ms=round(t, 4), tokens_per_s=round(tokens / t * 1e3))
            rec["t_pipelined_ms"] = round(times["interlace_pipelined"], 4)
            for n in ("interlace_compiled", "torch_tp", "torch_async_tp"):
                tn, tp = times.get(n), times.get(f"{n}_pipelined")
                rec[f"t_{n}_ms"] = None if tn is None else round(tn, 4)
                rec[f"t_{n}_pipelined_ms"] = None if tp is None else round(tp, 4)
                if n != "interlace_compiled":
                    rec[f"speedup_vs_{n}"] = None if tn is None else round(tn / t, 3)
            records.append(rec)
            if group.rank == 0:
                print(f"W={group.world_size} {mode} tokens {tokens}: " + ", ".join(
                    f"{n} {times[n]:.3f} ms (back to back {times[n + '_pipelined']:.3f})"
                    for n in names), flush=True)  # fmt: skip
    return records


# ---------------------------------------------------------------------------- entry point
def _table(records: list[dict]) -> str:
    lines = [f"{'mode':8} {'tokens':>6} {'layers':>6} {'t_ms':>9} {'ref_ms':>9} {'ratio':>6}"]
    for r in records:
        ref = r.get("t_ref_ms") or r.get("t_torch_tp_ms")
        ratio = f"{r['t_ms'] / ref:6.3f}" if ref else "     -"
        ref_s = f"{ref:9.3f}" if ref else "        -"
        lines.append(
            f"{r['mode']:8} {r['tokens']:>6} {r['layers']:>6} {r['t_ms']:9.3f} {ref_s} {ratio}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m interlace bench model", description=__doc__)
    p.add_argument("--out", default=DEFAULT_OUT, help="results folder")
    p.add_argument("--quick", action="store_true", help="fewer tokens, layers and runs")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 2)")
    p.add_argument("--tokens", type=int, nargs="*", default=None, help="tokens per sequence")
    p.add_argument("--iters", type=int, default=None, help="timed runs (median)")
    p.add_argument("--world-size", type=int, default=None, help="GPUs (default: all)")
    add_several_only(p)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench model: needs a GPU (the plain model is the reference; nothing to time)")
        return 0
    c = DecoderConfig(layers=args.layers or (1 if args.quick else 2))
    tokens = args.tokens or ([2048] if args.quick else [2048, 8192])
    iters = args.iters or (10 if args.quick else 20)
    gpus = torch.cuda.device_count()
    world = args.world_size or gpus
    if world < 2:
        records = one_gpu(c, tokens, iters)
        path = write_records(args.out, device_name(), 1, records)
        print("several-GPU comparison (vs torch TP and async TP) needs 2+ GPUs; ran W = 1")
    else:
        from interlace.testing import World

        with World(world, "cuda", timeout=1800) as w:
            records = w.run(several_gpus_body, asdict(c), tokens, iters)[0]
        path = write_records(args.out, device_name(), world, records)
    print(f"wrote {path}")
    print(_table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
