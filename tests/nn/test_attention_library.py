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
from interlace.errors import InterlaceTypeError, InterlaceValueError
from interlace.ops import library
from interlace.ops.attention import library as attn_library
from interlace.ops.attention import zigzag_shard
from tests.nn._models import TOL, leaf, rel, seeded, worlds
from tests.ops._helpers import expect_error, recording

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
    compiled = torch.compile(block, fullgraph=True, backend=recording(backend, graphs))
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


# ---------------------------------------------------------------------------- flash-decode
#: decode heads: 4 query heads on 2 K/V heads; each rank's shard length (ragged, not a
#: multiple of the emulation's 16-row KV block)
DEC_HQ, DEC_HKV = 4, 2


def _shard_lens(world: int) -> list[int]:
    return [19 + 6 * r for r in range(world)]


def _decode_inputs(group, batch: int, seed: int, ragged: bool):
    """``q`` (the same on every rank), every rank's K/V shard (each a slice of a longer
    cache: strided) and the valid rows of every (rank, sequence); ``kv_lens`` of this rank
    (None unless ``ragged``; then rank 0 holds nothing of sequence 0)."""
    dev, w = group.device, group.world_size
    q = seeded(seed, batch, DEC_HQ, D, device=dev)
    shards = []
    for r, n in enumerate(_shard_lens(w)):
        cache = seeded(seed + 1 + r, 2, batch, DEC_HKV, n + 5, D, device=dev)
        shards.append((cache[0, :, :, :n], cache[1, :, :, :n]))
    valid = [[n] * batch for n in _shard_lens(w)]
    kv_lens = None
    if ragged:
        valid = [[(n * (b + 1)) // (batch + 1) for b in range(batch)] for n in _shard_lens(w)]
        valid[0][0] = 0
        kv_lens = torch.tensor(valid[group.rank], dtype=torch.int32, device=dev)
    return q, shards, valid, kv_lens


def _decode_reference(q, shards, valid, scale: float):
    """float32 attention of ``q`` over every rank's valid K/V rows, concatenated."""
    g = q.shape[1] // shards[0][0].shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    for b in range(q.shape[0]):
        k, v = (
            torch.cat(
                [s[i][b, :, : valid[r][b]].float().cpu() for r, s in enumerate(shards)], 1
            ).repeat_interleave(g, 0)
            for i in (0, 1)
        )  # [heads, rows, d]
        p = torch.softmax((q[b].float().cpu()[:, None, :] @ k.transpose(1, 2)) * scale, -1)
        out[b] = (p @ v)[:, 0]
    return out


def _decode_body(group, strategy, route):
    """Four calls through the custom op (``route="op"``) or ``decode()`` (``"entry"``):
    batch 1, then batch 3 with ragged valid lengths (grows the cached context), then
    batch 2 twice (the same launch shape with another scale); every rank's output against
    the float32 reference."""
    h = library.register_group(group)
    for call, (batch, ragged) in enumerate([(1, False), (3, True), (2, False), (2, False)]):
        q, shards, valid, kv_lens = _decode_inputs(group, batch, 100 * call, ragged)
        k, v = shards[group.rank]
        scale = 0.2 + 0.05 * call  # not 1/sqrt(d), and changing: it must reach the kernels
        with torch.no_grad():
            if route == "op":
                out = ops.flash_decode(q, k, v, kv_lens, h, strategy, scale)
            else:
                out = attn_library.decode(q, k, v, h, strategy, kv_lens, scale)
        what = f"{strategy} {route} call {call} batch {batch}"
        assert out.shape == q.shape and out.dtype == q.dtype, what
        assert torch.isfinite(out.float()).all(), f"{what}: not finite"
        err = rel(out, _decode_reference(q, shards, valid, scale))
        assert err < TOL, f"{what}: rel err {err:.2e}"
    resolved = "fused" if strategy == "auto" else strategy
    key = ("flash_decode", h, torch.bfloat16, resolved, DEC_HQ, DEC_HKV, D)
    cached = [c for k, c in library.contexts().items() if k[0] == "flash_decode"]
    assert len(cached) == 1 and library.contexts()[key].max_batch >= 3  # grown by call 1
    library.clear_cache(group)
    return True


@pytest.mark.parametrize("world", WORLDS, indirect=True)
@pytest.mark.parametrize("strategy", ["auto", "none"])
def test_flash_decode_op(world, strategy):
    """The custom op: GQA, ragged shard lengths and valid lengths, a growing batch."""
    world.run(_decode_body, strategy, "op")


@pytest.mark.parametrize("world", worlds(cpu=(2,), gpu=()), indirect=True)
def test_flash_decode_entry_point(world):
    """``decode()`` outside a trace: the cached context's own call."""
    world.run(_decode_body, "fused", "entry")


def _decode_opcheck_body(group):
    h = library.register_group(group)
    for strategy, ragged in (("auto", False), ("auto", True), ("none", True)):
        q, shards, _, kv_lens = _decode_inputs(group, 2, 7, ragged)
        k, v = shards[group.rank]
        torch.library.opcheck(ops.flash_decode.default, (q, k, v, kv_lens, h, strategy, 0.25))
    library.clear_cache(group)
    return True


@pytest.mark.parametrize("world", WORLDS, indirect=True)
def test_flash_decode_opcheck(world):
    world.run(_decode_opcheck_body)


class _DecodeStep(nn.Module):
    """One decode step's attention: project the token to queries, flash-decode them over
    the KV cache shard, project the output."""

    def __init__(self, handle: int, strategy: str, hidden: int, dev):
        super().__init__()
        kw = dict(bias=False, dtype=torch.bfloat16, device=dev)
        self.q_proj = nn.Linear(hidden, DEC_HQ * D, **kw)
        self.o_proj = nn.Linear(DEC_HQ * D, hidden, **kw)
        self.handle, self.strategy = handle, strategy

    def forward(self, x, k, v, kv_lens):
        q = self.q_proj(x).view(x.shape[0], DEC_HQ, D)
        out = attn_library.decode(q, k, v, self.handle, self.strategy, kv_lens)
        return x + self.o_proj(out.flatten(1))


def _decode_compile_body(group, strategy, backend):
    dev, hidden = group.device, 32
    h = library.register_group(group)
    torch.manual_seed(7)  # the same weights on every rank
    step = _DecodeStep(h, strategy, hidden, dev)
    graphs: list = []
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=recording(backend, graphs))
    for call, ragged in enumerate([False, True]):
        _, shards, _, kv_lens = _decode_inputs(group, 2, 50 * call, ragged)
        k, v = shards[group.rank]
        x = seeded(60 + call, 2, hidden, device=dev)
        with torch.no_grad():
            eager = step(x, k, v, kv_lens)
            traced = compiled(x, k, v, kv_lens)
        assert torch.isfinite(traced.float()).all(), f"{strategy}: call {call} not finite"
        err = rel(traced, eager)
        assert err < TOL, f"{strategy}: call {call} compiled vs eager rel err {err:.2e}"
    # one graph per kv_lens variant (None, a tensor); fullgraph: no breaks, or it raised
    assert 1 <= len(graphs) <= 2, f"{len(graphs)} graphs"
    assert all(any("interlace.flash_decode" in t for t in g) for g in graphs), graphs
    library.clear_cache(group)
    return True


@pytest.mark.parametrize("world", WORLDS, indirect=True)
@pytest.mark.parametrize("strategy", ["auto", "none"])
def test_compile_fullgraph_flash_decode(world, strategy):
    """A decode step calling ``decode()`` under ``torch.compile(fullgraph=True)`` against
    the same step run eagerly (``aot_eager`` on the CPU emulation, inductor on GPUs)."""
    world.run(_decode_compile_body, strategy, "aot_eager" if world.backend == "cpu" else "inductor")


def _decode_bad_body(group):
    dev = group.device
    h = library.register_group(group)
    q, shards, _, _ = _decode_inputs(group, 2, 3, False)
    k, v = shards[group.rank]
    op = ops.flash_decode
    expect_error(InterlaceValueError, "strategy", op, q, k, v, None, h, "ring", 0.1)
    expect_error(InterlaceValueError, "no interlace group", op, q, k, v, None, 999, "auto", 0.1)
    expect_error(InterlaceValueError, "3-D", op, q[0], k, v, None, h, "auto", 0.1)
    expect_error(InterlaceValueError, "4-D", op, q, k[0], v, None, h, "auto", 0.1)
    expect_error(InterlaceTypeError, "dtype", op, q.float(), k.float(), v.float(), None, h,
                 "auto", 0.1)  # fmt: skip
    expect_error(InterlaceValueError, "kv_len", op, q, k[:1], v[:1], None, h, "auto", 0.1)
    expect_error(InterlaceTypeError, "int32", op, q, k, v, torch.ones(2, device=dev), h,
                 "auto", 0.1)  # fmt: skip
    out = op(q, k, v, None, h, "auto", 0.1)  # still usable
    assert torch.isfinite(out.float()).all() and out.shape == q.shape
    qg = leaf(q)  # an inference op: its backward raises
    out = attn_library.decode(qg, k, v, h)
    expect_error(InterlaceValueError, "inference op", out.float().sum().backward)
    library.clear_cache(group)
    return True


@pytest.mark.parametrize("world", worlds(cpu=(2,), gpu=()), indirect=True)
def test_flash_decode_bad_inputs_raise_on_every_rank(world):
    assert world.run(_decode_bad_body) == [True] * world.world_size
