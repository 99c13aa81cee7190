"""The sequence-parallel attention custom ops (``torch.ops.interlace.sp_attention`` /
``sp_attention_backward``, ``interlace.ops.attention.library``): output, log-sum-exp and
every input gradient against float32 attention of the whole sequence built on every rank
from shared seeds (causal zigzag and full attention, GQA, packed documents, ragged token
counts against the emulation's 16-token tiles, a second larger call on the cached
context), for every strategy and through the eager entry point; ``torch.library.opcheck``
on both ops; a ``torch.compile(fullgraph=True)`` trace of a block around
``interlace.nn.ContextParallelAttention`` through forward and backward against the same
block run eagerly; bad arguments raising on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import interlace.nn as inn
from interlace.errors import InterlaceValueError
from interlace.ops import library
from interlace.ops.attention import library as attn_library
from interlace.ops.attention import zigzag_shard
from tests.nn._models import TOL, leaf, rel, seeded, worlds
from tests.ops._helpers import expect_error

ops = torch.ops.interlace
D = 64  # the kernels' smallest head dim
#: gradients: dS and P are rounded to 16 bits before their products (as in
#: tests/ops/test_sp_attention.py)
TOL_GRAD = 2 * TOL
#: CPU ranks, and the same two ranks sharing one GPU (INTERLACE_TEST_SHARE_GPU=1) or on two
WORLDS = worlds(cpu=(2,), gpu=(2,))


def _shard(x, world: int, rank: int, causal: bool):
    """Rank ``rank``'s tokens (dim 2) of a whole sequence: zigzag when ``causal``."""
    if causal:
        return zigzag_shard(x, world, rank, dim=2)
    return x.chunk(world, dim=2)[rank].contiguous()


def _cu(total: int):
    """Three packed documents of ragged lengths (int32, on the host)."""
    return torch.tensor([0, total // 3 + 1, total - 3, total], dtype=torch.int32)


def _reference(q, k, v, causal: bool, cu, scale: float):
    """float32 attention of the whole sequence (positions in order): ``(out, lse)``, the
    natural-log log-sum-exp of each query row's scaled logits."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    logits = (q @ k.transpose(-1, -2)) * scale
    s = q.shape[2]
    pos = torch.arange(s)
    ok = torch.ones(s, s, dtype=torch.bool)
    if causal:
        ok &= pos[None, :] <= pos[:, None]
    if cu is not None:
        doc = torch.repeat_interleave(torch.arange(cu.numel() - 1), (cu[1:] - cu[:-1]).long())
        ok &= doc[None, :] == doc[:, None]
    logits = logits.masked_fill(~ok.to(q.device), float("-inf"))
    return torch.softmax(logits, -1) @ v, torch.logsumexp(logits, -1)


def _op_body(group, strategy, causal, heads, kv_heads, docs, route):
    """Two calls of growing size through the custom op (``route="op"``) or the eager entry
    point (``"entry"``); the output, lse and dq / dk / dv of this rank's tokens against the
    float32 reference's, sharded alike."""
    w, r, dev = group.world_size, group.rank, group.device
    h = library.register_group(group)
    scale = 0.3  # not the default 1/sqrt(d): the scale must reach the kernels
    for call, (b, s_loc) in enumerate([(1, 6), (2, 10)]):
        total = w * s_loc
        cu = _cu(total) if docs else None
        seed = 1000 * call
        whole = [
            seeded(seed + 1, b, heads, total, D, device=dev),
            seeded(seed + 2, b, kv_heads, total, D, device=dev),
            seeded(seed + 3, b, kv_heads, total, D, device=dev),
        ]
        dout_full = seeded(seed + 4, b, heads, total, D, device=dev)
        q, k, v = (leaf(_shard(t, w, r, causal)) for t in whole)
        dout = _shard(dout_full, w, r, causal)
        if route == "op":
            out, lse = ops.sp_attention(q, k, v, h, strategy, causal, scale, cu)
        else:
            out = attn_library.attention(q, k, v, h, strategy, causal, scale, cu)
            lse = None
        out.backward(dout)
        ref = [leaf(t.float()) for t in whole]
        ref_out, ref_lse = _reference(*ref, causal, cu, scale)
        ref_out.backward(dout_full.float())
        what = f"{strategy} causal={causal} docs={docs} call {call}"
        checks = [("out", out, ref_out)]
        checks += [(f"d{n}", t.grad, f.grad) for n, t, f in zip("qkv", (q, k, v), ref)]
        for name, got, want in checks:
            assert got is not None and got.shape == _shard(want, w, r, causal).shape, what
            assert torch.isfinite(got.float()).all(), f"{what}: {name} not finite"
            err = rel(got, _shard(want, w, r, causal))
            tol = TOL if name == "out" else TOL_GRAD
            assert err < tol, f"{what}: {name} rel err {err:.2e}"
        if lse is not None:
            assert not lse.requires_grad and lse.dtype == torch.float32
            if strategy == "none":
                assert lse.numel() == 0  # no statistics: its backward recomputes
            else:
                want = _shard(ref_lse.detach()[..., None], w, r, causal)[..., 0]
                assert (lse - want.to(lse.device)).abs().max() < 2e-2, f"{what}: lse"
    resolved = "fused" if strategy == "auto" else strategy
    key = ("sp_attention", h, q.dtype, resolved)
    cached = [c for k, c in library.contexts().items() if k[:4] == key]
    assert len(cached) == 1 and cached[0].max_tokens >= 2 * 10  # grown by the second call
    library.clear_cache(group)
    return True


@pytest.mark.parametrize("world", WORLDS, indirect=True)
@pytest.mark.parametrize("strategy", ["fused", "ring", "none"])
def test_op_causal_gqa(world, strategy):
    """Zigzag causal, 4 query heads on 2 K/V heads."""
    world.run(_op_body, strategy, True, 4, 2, False, "op")


@pytest.mark.parametrize("world", WORLDS, indirect=True)
@pytest.mark.parametrize("strategy", ["fused", "ring"])
def test_op_full_attention_documents(world, strategy):
    """Non-causal over three packed documents, 2 heads on 1 K/V head."""
    world.run(_op_body, strategy, False, 2, 1, True, "op")


@pytest.mark.parametrize("world", worlds(cpu=(2,), gpu=()), indirect=True)
def test_eager_entry_point(world):
    """``attention()`` outside a trace: the cached context's own call (``auto``)."""
    world.run(_op_body, "auto", True, 2, 2, True, "entry")


def _opcheck_body(group):
    w, r, dev = group.world_size, group.rank, group.device
    h = library.register_group(group)
    s_loc, scale = 8, D**-0.5
    cu = _cu(w * s_loc)
    q = leaf(seeded(10 + r, 1, 2, s_loc, D, device=dev))
    k = leaf(seeded(20 + r, 1, 1, s_loc, D, device=dev))
    v = leaf(seeded(30 + r, 1, 1, s_loc, D, device=dev))
    dout = seeded(40 + r, 1, 2, s_loc, D, device=dev)
    for strategy, causal, docs in (("fused", True, None), ("fused", False, cu),
                                   ("ring", True, cu), ("none", True, None)):  # fmt: skip
        args = (h, strategy, causal, scale, docs)
        torch.library.opcheck(ops.sp_attention.default, (q, k, v, *args))
        with torch.no_grad():
            out, lse = ops.sp_attention(q, k, v, *args)
        saved = (q.detach(), k.detach(), v.detach(), out, lse)
        torch.library.opcheck(ops.sp_attention_backward.default, (dout, *saved, *args))
    library.clear_cache(group)
    return True


@pytest.mark.parametrize("world", WORLDS, indirect=True)
def test_opcheck(world):
    world.run(_opcheck_body)


class _Block(nn.Module):
    """A residual pre-norm attention block: ``x + attention(norm(x))``."""

    def __init__(self, attn: inn.ContextParallelAttention):
        super().__init__()
        self.norm = nn.LayerNorm(attn.hidden_size, dtype=attn.q_proj.weight.dtype,
                                 device=attn.q_proj.weight.device)  # fmt: skip
        self.attn = attn

    def forward(self, x, cos, sin):
        return x + self.attn(self.norm(x), position_embeddings=(cos, sin))[0]


def _recording(name: str, graphs: list):
    """A compile backend that keeps each graph's call targets, then compiles with
    ``name``."""
    inner = torch._dynamo.lookup_backend(name)

    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return inner(gm, example_inputs)

    return backend


def _compile_body(group, strategy, backend):
    w, dev = group.world_size, group.device
    hidden, heads, kv_heads, b, s_loc = 32, 4, 2, 2, 6
    torch.manual_seed(7)  # the same weights on every rank
    attn = inn.ContextParallelAttention(hidden, heads, kv_heads, D, group, causal=True,
                                        qkv_bias=True, strategy=strategy)  # fmt: skip
    block = _Block(attn)
    total = w * s_loc
    x = seeded(1, b, total, hidden, device=dev)
    g = seeded(2, b, total, hidden, device=dev)
    pos = torch.arange(total, dtype=torch.float32)[:, None]
    freqs = pos * (1e-2 * torch.arange(1, D // 2 + 1, dtype=torch.float32))[None]
    emb = torch.cat([freqs, freqs], -1)[None].to(dev)
    cos, sin = (inn.shard_sequence(t, group, True) for t in (emb.cos(), emb.sin()))
    x_local, g_local = (inn.shard_sequence(t, group, True).detach() for t in (x, g))
    graphs: list = []
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend=_recording(backend, graphs))
    results = []
    for fn in (block, compiled, compiled):  # eager, then the compiled graph twice
        xl = leaf(x_local)
        y = fn(xl, cos, sin)
        y.backward(g_local)
        grads = [p.grad.clone() for p in block.parameters()]
        results.append([y, xl.grad, *grads])
        block.zero_grad(set_to_none=True)
    assert len(graphs) == 1, f"{len(graphs)} graphs"  # (fullgraph: one, or it raised)
    assert any("interlace.sp_attention" in t for t in graphs[0]), graphs[0]
    names = ["out", "dx"] + [n for n, _ in block.named_parameters()]
    # a parameter gradient near zero (the key bias: softmax ignores a shift shared by every
    # key, up to the rotary embedding) is compared on the scale of the largest one
    floor = 0.05 * max(float(t.float().norm()) for t in results[0][2:])
    for run in results[1:]:
        for i, (name, eager, traced) in enumerate(zip(names, results[0], run)):
            assert torch.isfinite(traced.float()).all(), f"{strategy}: {name} not finite"
            scale = float(eager.float().norm())
            if i >= 2:  # (a parameter)
                scale = max(scale, floor)
            err = float((traced.float() - eager.float()).norm()) / scale
            assert err < TOL, f"{strategy}: {name} compiled vs eager rel err {err:.2e}"
    attn.close()
    library.clear_cache(group)
    return True


@pytest.mark.parametrize("world", WORLDS, indirect=True)
@pytest.mark.parametrize("strategy", ["auto", "ring", "none"])
def test_compile_fullgraph_context_parallel_attention(world, strategy):
    """fullgraph=True fails on any graph break; the graph holds the custom op. (The CPU
    emulation compiles with ``aot_eager``; GPUs with inductor.)"""
    world.run(_compile_body, strategy, "aot_eager" if world.backend == "cpu" else "inductor")


def _bad_body(group):
    dev = group.device
    h = library.register_group(group)
    q = seeded(0, 1, 2, 8, D, device=dev)
    k = seeded(1, 1, 1, 8, D, device=dev)
    expect_error(InterlaceValueError, "strategy", ops.sp_attention, q, k, k, h, "bogus", True, 0.1)
    expect_error(InterlaceValueError, "no interlace group", ops.sp_attention, q, k, k, 999,
                 "fused", True, 0.1)  # fmt: skip
    expect_error(InterlaceValueError, "4-D", ops.sp_attention, q[0], k, k, h, "fused", True, 0.1)
    expect_error(InterlaceValueError, "must be even", ops.sp_attention, q[:, :, :7],
                 k[:, :, :7], k[:, :, :7], h, "fused", True, 0.1)  # fmt: skip
    out, lse = ops.sp_attention(q, k, k, h, "fused", True, 0.1)  # still usable
    assert torch.isfinite(out.float()).all() and lse.shape == (1, 2, 8)
    expect_error(InterlaceValueError, "q's shape", ops.sp_attention_backward, q[:, :1], q, k,
                 k, out, lse, h, "fused", True, 0.1)  # fmt: skip
    library.clear_cache(group)
    return True


@pytest.mark.parametrize("world", worlds(cpu=(2,), gpu=()), indirect=True)
def test_bad_inputs_raise_on_every_rank(world):
    assert world.run(_bad_body) == [True] * world.world_size
