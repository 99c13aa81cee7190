"""Timeline traces of the overlapped ops, and what tracing costs.

``python -m interlace trace OP --shape ... [--world-size W]`` runs W ranks (on their own
GPUs, sharing one GPU where there are fewer, or in the CPU emulation with ``--cpu`` or
without GPUs), warms the op up, records ``--calls`` calls and writes
``<out>/<name>.json`` (Chrome / Perfetto), ``<name>.png`` and ``<name>-summary.json``,
then prints the summary. OP and its ``--shape`` fields:

* ``ag_gemm``, ``gemm_rs``, ``gemm_ar``: ``M,N,K``, the GEMM each rank runs, as in the
  results files (``M`` the gathered rows); ``gemm_rs`` / ``gemm_ar`` with ``--strategy
  signal_reorder``: FlashOverlap's signalling GEMM and the comm stream's wave-group waits
  and collectives (the GEMM is traced where the shape has more than one wave group; the
  collectives move CUDA tensors, so a GPU per rank, or ``--cpu``);
* ``ag_moe``: ``tokens,hidden,inter,experts,topk``: gathered tokens (``tokens / W`` per
  rank), hidden size, this rank's intermediate columns, experts, experts per token
  (random routing, SwiGLU);
* ``sp_attention``: ``batch,heads,S,d[,kv_heads]``: the forward over a sequence of ``S``
  tokens (``S / W`` per rank; ``--causal``: the zigzag layout), ``d`` 64 or 128;
* ``moe_rs``: ``tokens,hidden,inter,experts,topk`` as ``ag_moe``: ``MoERS`` on the
  activations and routing of one untraced ``AGMoE`` call (which ``fused`` needs: the
  padded routing); only ``MoERS`` is traced;
* ``flash_decode``: ``batch,heads,L,d[,kv_heads]``: one decode step over a KV cache of
  ``L`` rows per sequence (``L / W`` per rank), every rank merging;
* ``ep_dispatch``: ``tokens,hidden,experts,topk``: ``EPAllToAll``'s dispatch of
  ``tokens / W`` tokens per rank (random routing), then its combine of the received rows
  (the experts left out: their output is their input);
* ``ep_low_latency``: ``tokens,hidden,experts,topk`` as ``ep_dispatch``, for
  ``EPLowLatency`` (``tokens / W`` at most 256); ``--strategy`` names its protocol
  (``flag_in_data``, ``token_flag``; the default: ``auto``);
* ``all_gather``, ``reduce_scatter``, ``all_reduce``: ``numel``, the elements in all (the
  gathered result, each rank's reduce-scatter input, the all-reduced tensor);
  ``--strategy`` names the method (the default: the context's); the copy engine's
  transfers and their flags are what these record (the load-based methods run one kernel
  with no per-tile events);
* ``p2p_ring``: ``M,N,K`` as ``ag_gemm`` / ``gemm_rs``, for ``P2PRing`` with the ``symm``
  transport; ``--strategy`` names the ring op (``ag_gemm`` or ``gemm_rs``, the default);
  its transfers are what it records.

``python -m interlace bench trace [--quick]``: on a GPU, the overhead of tracing: the
per-rank kernel of AG+GEMM ``fused`` and GEMM+RS ``ce_fused`` as rank 0 of 4 with its
waits met, ``TRACE`` on against off, on the dense benchmark shapes (CUDA graphs of
launches, interleaved medians; records ``op: trace_overhead``); then the example trace of
AG+GEMM with 4 ranks sharing the GPU. Without a GPU: the example trace in the CPU
emulation (2 ranks, tiny), no timings.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_OUT = "benchmarks/results"
OPS = {
    "ag_gemm": "AGGemm", "gemm_rs": "GemmRS", "gemm_ar": "GemmAR", "ag_moe": "AGMoE",
    "sp_attention": "SPAttention", "moe_rs": "MoERS", "flash_decode": "FlashDecode",
    "ep_dispatch": "EPAllToAll", "ep_low_latency": "EPLowLatency", "all_gather": "AllGather",
    "reduce_scatter": "ReduceScatter", "all_reduce": "AllReduce", "p2p_ring": "P2PRing",
}  # fmt: skip


@dataclass(frozen=True)
class ShapeSpec:
    """An op's ``--shape`` fields: their names (the last ``optional`` may be left out), the
    one that is split over the ranks (a multiple of W, of 2 W where ``--causal``), and the
    defaults for a world of ``w`` ranks."""

    fields: tuple[str, ...]
    split: str
    cpu: Callable[[int], tuple[int, ...]]
    gpu: Callable[[int], tuple[int, ...]]
    optional: int = 0


_GEMM = ShapeSpec(("M", "N", "K"), "M", lambda w: (w * 37, 40, 32), lambda w: (4096, 3584, 4096))
_MOE = ShapeSpec(
    ("tokens", "hidden", "inter", "experts", "topk"), "tokens",
    lambda w: (w * 11, 32, 16, 4, 2), lambda w: (w * 2048, 2048, 384, 32, 2),
)  # fmt: skip
#: the collectives: ``numel`` elements in all (all-gather: the gathered result; reduce-
#: scatter: each rank's input; all-reduce: the tensor), split over the ranks
_NUMEL = ShapeSpec(("numel",), "numel", lambda w: (w * 96,), lambda w: (w * (1 << 24),))
SHAPES = {
    "ag_gemm": _GEMM, "gemm_rs": _GEMM, "gemm_ar": _GEMM, "ag_moe": _MOE, "moe_rs": _MOE,
    "sp_attention": ShapeSpec(
        ("batch", "heads", "S", "d", "kv_heads"), "S",
        lambda w: (1, 2, w * 20, 64, 1), lambda w: (1, 32, w * 4096, 128, 8), optional=1,
    ),
    "flash_decode": ShapeSpec(
        ("batch", "heads", "L", "d", "kv_heads"), "L",
        lambda w: (1, 4, w * 37, 16, 2), lambda w: (4, 32, w * 32768, 128, 8), optional=1,
    ),
    "ep_dispatch": ShapeSpec(
        ("tokens", "hidden", "experts", "topk"), "tokens",
        lambda w: (w * 7, 48, 2 * w, 2), lambda w: (w * 4096, 7168, 256, 8),
    ),
    "ep_low_latency": ShapeSpec(
        ("tokens", "hidden", "experts", "topk"), "tokens",
        lambda w: (w * 7, 48, 2 * w, 2), lambda w: (w * 128, 7168, 256, 8),
    ),
    "all_gather": _NUMEL, "reduce_scatter": _NUMEL, "all_reduce": _NUMEL, "p2p_ring": _GEMM,
}  # fmt: skip


def parse_shape(op: str, text: str) -> tuple[int, ...]:
    """``--shape`` of ``op`` (``SHAPES``) as integers; optional fields left out take
    their defaults (``sp_attention``, ``flash_decode``: ``kv_heads = heads``)."""
    spec = SHAPES[op]
    try:
        vals = tuple(int(x) for x in text.split(","))
    except ValueError as e:
        want = ",".join(spec.fields)
        raise SystemExit(f"trace {op}: --shape must be {want}, got {text!r}") from e
    lo, hi = len(spec.fields) - spec.optional, len(spec.fields)
    if not lo <= len(vals) <= hi or min(vals) <= 0:
        raise SystemExit(f"trace {op}: --shape must be {','.join(spec.fields)} (positive; the "
                         f"last {spec.optional} optional), got {text!r}")  # fmt: skip
    if op in ("sp_attention", "flash_decode") and len(vals) == 4:
        vals = (*vals, vals[1])
    return vals


def _op_call(group, op, strategy, shape, causal):
    """``(ctx, call)``: ``op``'s context on ``group`` for ``shape`` and a call on fresh
    random inputs (``call()`` runs it; ``moe_rs``: ``ctx`` holds ``AGMoE`` too, called
    once here for the routing)."""
    import torch

    import interlace
    from interlace.ops._context import ContextSet

    w, dev, dtype = group.world_size, group.device, torch.bfloat16
    torch.manual_seed(100 + group.rank)
    if op in ("ag_moe", "moe_rs"):
        tokens, hidden, inter, experts, topk = shape
        m = tokens // w
        sizes = dict(max_tokens=tokens, hidden=hidden, inter=inter, experts=experts, topk=topk)
        first = "none" if op == "moe_rs" and strategy == "none" else strategy
        ctx = interlace.AGMoE(group, strategy=first, **sizes)
        x = torch.randn(m, hidden, device=dev).to(dtype)
        ids = torch.rand(m, experts, device=dev).argsort(dim=1)[:, :topk].contiguous()
        weights = torch.softmax(torch.randn(m, topk, device=dev), dim=-1)
        wg = (torch.randn(experts, hidden, 2 * inter, device=dev) / math.sqrt(hidden)).to(dtype)
        if op == "ag_moe":
            return ctx, lambda: ctx(x, ids, weights, wg)
        rs = interlace.MoERS(group, strategy=strategy, **sizes)
        h, routing = ctx(x, ids, weights, wg)
        wd = (torch.randn(experts, inter, hidden, device=dev) / math.sqrt(inter)).to(dtype)
        return _Contexts(ContextSet(ctx, rs), rs), lambda: rs(h, routing, wd)
    if op in ("ep_dispatch", "ep_low_latency"):
        tokens, hidden, experts, topk = shape
        m = tokens // w
        sizes = dict(max_tokens=m, hidden=hidden, experts=experts, topk=topk, dtype=dtype)
        if op == "ep_dispatch":
            ctx = interlace.EPAllToAll(group, **sizes)
        else:  # ``strategy`` names the protocol (the default ``fused``: ``auto``)
            protocol = "auto" if strategy == "fused" else strategy
            ctx = interlace.EPLowLatency(group, protocol=protocol, **sizes)
        x = torch.randn(m, hidden, device=dev).to(dtype)
        ids = torch.rand(m, experts, device=dev).argsort(dim=1)[:, :topk].contiguous()
        weights = torch.softmax(torch.randn(m, topk, device=dev), dim=-1)

        def dispatch_combine():
            handle = ctx.dispatch(x, ids, weights)
            return ctx.combine(handle.recv_x, handle)

        return ctx, dispatch_combine
    if op in ("all_gather", "reduce_scatter", "all_reduce"):
        (numel,) = shape
        method = {} if strategy == "fused" else {"method": strategy}  # ``fused``: the default
        cls = getattr(interlace, OPS[op])
        per_rank = numel if op == "all_reduce" else numel // w
        ctx = cls(group, max_numel=per_rank, dtype=dtype, **method)
        x = torch.randn(per_rank if op == "all_gather" else numel, device=dev).to(dtype)
        return ctx, lambda: ctx(x)
    if op == "p2p_ring":  # ``strategy`` names the ring op (``fused``: gemm_rs)
        m, n, k = shape
        ring_op = "gemm_rs" if strategy == "fused" else strategy
        if ring_op not in ("ag_gemm", "gemm_rs"):
            raise SystemExit(f"trace p2p_ring: --strategy must be ag_gemm or gemm_rs, got "
                             f"{strategy!r}")  # fmt: skip
        ctx = interlace.P2PRing(group, dtype, transport="symm")  # its copies are recorded
        rows = m // w if ring_op == "ag_gemm" else m
        a = torch.randn(rows, k, device=dev).to(dtype)
        b = (torch.randn(k, n, device=dev) / math.sqrt(k)).to(dtype)
        return ctx, lambda: getattr(ctx, ring_op)(a, b)
    if op == "flash_decode":
        batch, heads, length, d, kv_heads = shape
        ctx = interlace.FlashDecode(group, batch, heads, kv_heads, d, strategy=strategy)
        gen = torch.Generator().manual_seed(100)  # the same query on every rank
        q = torch.randn(batch, heads, d, generator=gen).to(dev, dtype)
        k, v = (torch.randn(batch, kv_heads, length // w, d, device=dev).to(dtype) for _ in "kv")
        return ctx, lambda: ctx(q, k, v)
    if op == "sp_attention":
        batch, heads, s, d, kv_heads = shape
        s_loc = s // w
        ctx = interlace.ops.attention.SPAttention(
            group, heads, kv_heads, d, max_tokens=batch * s_loc, strategy=strategy
        )
        q = torch.randn(batch, heads, s_loc, d, device=dev).to(dtype)
        k, v = (torch.randn(batch, kv_heads, s_loc, d, device=dev).to(dtype) for _ in "kv")
        return ctx, lambda: ctx(q, k, v, causal=causal)
    m, n, k = shape
    if op == "ag_gemm":
        ctx = interlace.AGGemm(group, max_m=m, n=n, k=k, strategy=strategy)
        a = torch.randn(m // w, k, device=dev).to(dtype)
    else:
        cls = getattr(interlace, OPS[op])
        ctx = cls(group, max_m=m, n=n, k=k, strategy=strategy)
        a = torch.randn(m, k, device=dev).to(dtype)
    b = (torch.randn(k, n, device=dev) / math.sqrt(k)).to(dtype)
    return ctx, lambda: ctx(a, b)


class _Contexts:
    """Several contexts closed and checked as one (``ContextSet``), with the strategy of
    the traced one (``last_strategy``)."""

    def __init__(self, contexts, traced):
        self.contexts, self.traced = contexts, traced

    @property
    def last_strategy(self):
        return self.traced.last_strategy

    def check(self) -> None:
        self.contexts.check()

    def close(self) -> None:
        self.contexts.close()


# ---------------------------------------------------------------------- one traced call
def trace_body(group, op, strategy, shape, calls, warmup, prefix, label, meta, causal=False):
    """On every rank: build ``op``'s context for ``shape`` (``SHAPES``), make ``warmup``
    untraced calls, record ``calls`` calls; rank 0 writes the trace files at ``prefix``.
    Returns (rank 0) the summary and what was written."""
    import torch

    import interlace

    from ..trace import summarize

    ctx, call = _op_call(group, op, strategy, shape, causal)
    try:
        for _ in range(warmup):
            call()
        if group.backend == "cuda":
            torch.cuda.synchronize()
        group.host_barrier()
        with interlace.trace.record(group, label=label, meta=meta) as rec:
            for _ in range(calls):
                call()
        if group.backend == "cuda":
            torch.cuda.synchronize()
        ctx.check()
        trace = rec.trace()
        ran = getattr(ctx, "last_strategy", None) or getattr(ctx, "protocol", None) or strategy
    finally:
        ctx.close()
    if group.rank != 0:
        return None
    paths = trace.save(prefix, quiet=True)
    summary = summarize(trace)
    summary["meta"]["strategy_ran"] = ran
    return dict(paths=paths, summary=summary)


def run_trace(op, strategy, shape, world, calls=1, warmup=2, out=DEFAULT_OUT, cpu=False,
              name=None, timeout=600, causal=False):  # fmt: skip
    """Trace ``op`` on ``world`` ranks (see the module docstring; ``shape``: its
    ``SHAPES`` fields); returns rank 0's ``{"paths", "summary"}``."""
    import torch

    from ..testing import World
    from ..trace import format_summary

    gpus = 0 if cpu else torch.cuda.device_count()
    backend = "cuda" if gpus else "cpu"
    share = backend == "cuda" and gpus < world
    spec = SHAPES[op]
    fields = dict(zip(spec.fields, shape))
    unit = 2 * world if causal and op == "sp_attention" else world
    if fields[spec.split] % unit:
        twice = "2 x " if unit != world else ""
        raise SystemExit(f"trace: {spec.split} = {fields[spec.split]} must be a multiple of "
                         f"{unit} ({twice}the world size {world})")  # fmt: skip
    if share and strategy == "signal_reorder":
        raise SystemExit(f"trace: {op} signal_reorder runs the process group's collectives on "
                         f"CUDA tensors: it needs a GPU per rank ({world} ranks, {gpus} GPUs), "
                         f"or --cpu")  # fmt: skip
    device = torch.cuda.get_device_name(0) if gpus else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower().replace("nvidia", "")).strip("-")
    where = "shared" if share else backend
    dims = "x".join(str(x) for x in shape) + ("-causal" if causal else "")
    name = name or (
        f"{datetime.date.today().isoformat()}-{slug}-w{world}-{where}-trace-{op}-{strategy}-{dims}"
    )
    meta = dict(op=op, strategy=strategy, **fields, device=device, world=world,
                shared_gpu=share, backend=backend, calls=calls)  # fmt: skip
    if op == "sp_attention":
        meta["causal"] = causal
    with World(world, backend, timeout=timeout, share_device=share) as ranks:
        res = ranks.run(
            trace_body, op, strategy, shape, calls, warmup, os.path.join(out, name),
            f"{op} {strategy} {dims} W={world}" + (" (one GPU shared)" if share else ""),
            meta, causal,
        )[0]  # fmt: skip
    print(format_summary(res["summary"]))
    for what, path in res["paths"].items():
        print(f"{what}: {path}")
    return res


# ---------------------------------------------------------------------- overhead
def traced_launch(prepared, grid_tiles: int, device):
    """``prepared`` (a segment-GEMM ``PreparedLaunch``) with ``TRACE`` on, writing into a
    buffer of its own on ``device``: ``(launch, buffer)``; the same launch path as
    ``prepared``."""
    import torch

    from ..language.trace import buffer_stride
    from ..ops._launch import PreparedLaunch

    grid = prepared.grid
    per = -(-grid_tiles // grid)
    stride = buffer_stride(per)
    buf = torch.zeros(1 + grid * stride, 4, dtype=torch.int64, device=device)
    buf[0, :3] = torch.tensor([stride, grid, per])
    names = prepared.kernel.arg_names
    operands = tuple(names[i] for i in prepared._where)
    kwargs = dict(prepared.kwargs, TRACE=True, tbuf=buf)
    return PreparedLaunch(prepared.kernel, grid, prepared.args, kwargs, operands), buf


def _events_written(buf) -> dict:
    from ..language.trace import EV_TILE_END, EV_WAIT_END

    kinds = buf[:, 1]
    return dict(
        tiles=int((kinds == EV_TILE_END.value).sum()), waits=int((kinds == EV_WAIT_END.value).sum())
    )


#: overhead cases: op -> (``testing.emulated`` mode, the op's strategy it stands for)
OVERHEAD_CASES = {"ag_gemm": ("ag", "fused"), "gemm_rs": ("rs", "ce_fused")}


class OverheadCase:
    """One rank's kernel of ``op`` (``OVERHEAD_CASES``) with its waits met
    (``testing.emulated.Emulated``, rank 0 of ``world``), untraced (``plain``) and traced
    (``traced``, events into ``buf``), each checked once against float32 by
    :meth:`check`."""

    def __init__(self, op, world, m, n, k, device, one_loop=None):
        from ..ops import segment_gemm
        from ..testing.emulated import Emulated

        mode, self.strategy = OVERHEAD_CASES[op]
        # ``one_loop=None``: the one-loop mode where the op takes it on a GPU
        self.kern = Emulated(world, 0, m, n, k, mode, device=device, one_loop=one_loop)
        kern = self.kern
        self.plain = kern.run.prepared
        self.operands = kern.run._operands(kern.a, kern.b, kern.out, None, kern.a_own)
        self.tiles = segment_gemm.total_tiles(kern.segments, n, kern.cfg)
        self.one_loop = bool(self.plain.kwargs.get("ONE_LOOP"))
        self.traced, self.buf = traced_launch(self.plain, self.tiles, device)

    def check(self) -> tuple[float, dict]:
        """Each launch once (outputs poisoned, chunk counters zeroed by ``Emulated.check``):
        the larger relative error and the events the traced launch wrote."""
        kern, errs = self.kern, []
        for launch in (self.plain, self.traced):
            kern.run.prepared = launch
            try:
                errs.append(kern.check())
            finally:
                kern.run.prepared = self.plain
        return max(errs), _events_written(self.buf.cpu())


def overhead(quick: bool, iters: int, reps: int = 10, as_world: int = 4, save=None) -> list[dict]:
    """TRACE on vs off for the per-rank kernels with waits met (see the module docstring);
    ``save(records)`` after each shape."""
    import torch

    from .dense import MODELS, model_shape
    from .timing import graph_of, paired_median_ms

    dev = torch.device("cuda", torch.cuda.current_device())
    models = ["llama3-8b"] if quick else list(MODELS)
    ms = [8192] if quick else [2048, 8192]
    records = []
    for model in models:
        for m in ms:
            for op in OVERHEAD_CASES:
                shape = model_shape(op, model, m, as_world)
                case = OverheadCase(op, as_world, shape.M, shape.N, shape.K, dev)
                err, written = case.check()
                tiles, launches = case.tiles, (case.plain, case.traced)
                graphs = [
                    graph_of(None, lambda p=p, o=case.operands: p(*o), reps) for p in launches
                ]
                t_off, t_on = (
                    t / reps for t in paired_median_ms(None, [g.replay for g in graphs], iters)
                )  # fmt: skip
                rec = dict(
                    op="trace_overhead", strategy=case.strategy, model=model, dtype="bfloat16",
                    M=shape.M, N=shape.N, K=shape.K, as_world=as_world, waits_met=True,
                    one_loop=case.one_loop, ref="untraced", t_ms=round(t_on, 5),
                    t_ref_ms=round(t_off, 5), overhead_pct=round((t_on / t_off - 1) * 100, 2),
                    rel_err=err, tiles=tiles, tiles_traced=written["tiles"],
                )  # fmt: skip
                for tag, launch in (("off", case.plain), ("on", case.traced)):
                    for key, value in launch.resources(*case.operands).items():
                        rec[f"{key}_{tag}"] = value
                print(f"{op:8s} {model:11s} M={m:5d}: off {t_off:.4f} ms, on {t_on:.4f} ms "
                      f"({rec['overhead_pct']:+.2f} %), err {err:.1e}, tiles "
                      f"{written['tiles']}/{tiles}, regs {rec.get('n_regs_off')}/"
                      f"{rec.get('n_regs_on')}, spills {rec.get('n_spills_off')}/"
                      f"{rec.get('n_spills_on')}",
                      flush=True)  # fmt: skip
                records.append(rec)
                if save is not None:  # after every shape: a time-out keeps what was measured
                    save([rec])
                del graphs
    return records


def bench(args) -> int:
    import torch

    out = args.out
    if not torch.cuda.is_available():
        print("bench trace: no GPU: the example trace in the CPU emulation (no timings)")
        run_trace("ag_gemm", "fused", (2 * 37, 40, 32), 2, out=out, cpu=True, warmup=1)
        return 0
    from .records import device_name, write_records

    device = device_name()
    world = 4
    res = run_trace("ag_gemm", "fused", tuple(args.example_shape), world, out=out,
                    calls=1, warmup=3)  # fmt: skip
    records = overhead(
        args.quick, args.iters, save=lambda r: write_records(out, device, 1, r, False)
    )
    path = write_records(out, device, 1, records)
    print(f"wrote {path}")
    if torch.cuda.device_count() < 2:
        print("several-GPU overlap (each rank on its own GPU) needs 2+ GPUs; the example "
              "trace above ran its ranks on one shared GPU")  # fmt: skip
    print(f"{'op':9s} {'model':11s} {'M':>5s} {'off ms':>8s} {'on ms':>8s} {'overhead':>9s} tiles")
    for r in records:
        print(f"{r['strategy']:9s} {r['model']:11s} {r['M']:5d} "
              f"{r['t_ref_ms']:8.4f} {r['t_ms']:8.4f} {r['overhead_pct']:+8.2f}% "
              f"{r['tiles_traced']}/{r['tiles']}")  # fmt: skip
    op = res["summary"]["op"]
    print(f"example trace: T {op['t_ms']:.3f} ms, overlap ratio {op['overlap_ratio']}, "
          f"longest wait chain {op['longest_wait_chain_us']} us")  # fmt: skip
    return 0


def _shape(text: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(x) for x in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not M,N,K: {text!r}") from e
    return m, n, k


def main(argv: list[str] | None = None) -> int:
    """``python -m interlace bench trace`` (no OP) or ``python -m interlace trace OP ...``."""
    p = argparse.ArgumentParser(prog="python -m interlace trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("op", nargs="?", choices=list(OPS), help="trace this op (else: the benchmark)")
    p.add_argument("--shape", default=None,
                   help="the op's shape: M,N,K (ag_gemm, gemm_rs, gemm_ar); "
                        "tokens,hidden,inter,experts,topk (ag_moe, moe_rs); "
                        "batch,heads,S,d[,kv_heads] (sp_attention); batch,heads,L,d[,kv_heads] "
                        "(flash_decode); tokens,hidden,experts,topk (ep_dispatch, "
                        "ep_low_latency); numel (all_gather, reduce_scatter, all_reduce); "
                        "M,N,K (p2p_ring); see above")  # fmt: skip
    p.add_argument("--causal", action="store_true", help="sp_attention: causal (zigzag)")
    p.add_argument("--strategy", default="fused",
                   help="the op's strategy (gemm_rs, gemm_ar: signal_reorder too); "
                        "ep_low_latency: its protocol; the collectives: their method; "
                        "p2p_ring: its op, ag_gemm or gemm_rs")  # fmt: skip
    p.add_argument("--world-size", type=int, default=None, help="ranks (default: GPUs, >= 2)")
    p.add_argument("--calls", type=int, default=1, help="traced calls")
    p.add_argument("--warmup", type=int, default=2, help="untraced calls first")
    p.add_argument("--cpu", action="store_true", help="the CPU emulation")
    p.add_argument("--name", default=None, help="file name (without extension)")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--quick", action="store_true", help="benchmark: one shape")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--example-shape", type=_shape, default=(4096, 3584, 4096),
                   help="benchmark: M,N,K of the example AG+GEMM trace (W = 4)")  # fmt: skip
    args = p.parse_args(argv)
    if args.op is None:
        return bench(args)
    import torch

    world = args.world_size or max(2, 0 if args.cpu else torch.cuda.device_count())
    spec = SHAPES[args.op]
    if args.shape is not None:
        shape = parse_shape(args.op, args.shape)
    elif args.cpu or not torch.cuda.is_available():
        shape = spec.cpu(world)
    else:
        shape = spec.gpu(world)
    run_trace(args.op, args.strategy, shape, world, calls=args.calls, warmup=args.warmup,
              out=args.out, cpu=args.cpu, name=args.name, causal=args.causal)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
