"""Sequence-parallel attention (``interlace.ops.attention.SPAttention``) against a float32
torch reference of the whole sequence: forward and gradients of the ``fused`` strategy,
the ``none`` and ``ring`` baselines, causal (zigzag layout) and not, GQA, packed
documents (``cu_seqlens``), S_loc not a multiple of the kernels' blocks, repeated calls on
one context, poisoned outputs, bad inputs raising on every rank, and (on GPUs) d 128,
fp16, eager calls replayed from CUDA graphs and CUDA-graph capture of the forward.

Every rank draws the same whole-sequence tensors from one seed and takes its own shard, so
the reference needs no communication."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from interlace.errors import InterlaceTypeError, InterlaceValueError
from interlace.kernels.attention import _query_program
from interlace.ops.attention import SPAttention, zigzag_shard, zigzag_unshard
from interlace.ops.attention.layout import segment_ids
from tests.conftest import get_world
from tests.ops._helpers import capture, counting, expect_error, rel_err, replay, sync

TOL_FWD = 1e-2
TOL_GRAD = 2e-2  # dS and P are rounded to 16 bits before their products (as flash attention)

W23 = [pytest.param(("cpu", 2), id="cpu2"), pytest.param(("cpu", 3), id="cpu3")]
W34 = [W23[1], pytest.param(("cpu", 4), id="cpu4")]
GPU2 = [pytest.param(("cuda", 2), id="cuda2", marks=pytest.mark.gpu)]


def _shard(x, group, causal):
    if causal:
        return zigzag_shard(x, group.world_size, group.rank)
    return x.chunk(group.world_size, dim=2)[group.rank].contiguous()


def _reference(q, k, v, causal, cu, scale):
    """float32 attention of the whole sequence (GQA by repeating K/V heads)."""
    h, s = q.shape[1], q.shape[2]
    k, v = (x.repeat_interleave(h // x.shape[1], dim=1) for x in (k, v))
    logits = (q @ k.transpose(-1, -2)) * scale
    pos = torch.arange(s)
    ok = torch.ones(s, s, dtype=torch.bool)
    if causal:
        ok &= pos[None, :] <= pos[:, None]
    if cu is not None:
        seg = segment_ids(cu, s)
        ok &= seg[:, None] == seg[None, :]
    return torch.softmax(logits.masked_fill(~ok, float("-inf")), -1) @ v


def _case(group, seed, batch, heads, kv_heads, d, s_loc, causal, docs, dtype):
    """Whole-sequence inputs (same on every rank), their float32 reference output and
    gradients, and this rank's shards."""
    gen = torch.Generator().manual_seed(seed)
    s = group.world_size * s_loc
    full = [
        torch.randn(batch, n, s, d, generator=gen).to(dtype).float()
        for n in (heads, kv_heads, kv_heads, heads)
    ]
    q, k, v, do = full
    cu = None
    if docs:
        cuts = torch.randperm(s - 1, generator=gen)[: docs - 1].add(1).sort().values
        cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([s])]).to(torch.int32)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _reference(*leaves, causal, cu, 1.0 / math.sqrt(d))
    (ref * do).sum().backward()
    dev = group.device
    mine = [_shard(x, group, causal).to(dtype).to(dev) for x in (q, k, v, do)]
    refs = [_shard(x.detach(), group, causal) for x in (ref, *[t.grad for t in leaves])]
    return mine, refs, cu


def _fwd_bwd_body(group, causal, docs, heads, kv_heads, d, dtype_name, strategy, backward,
                  sizes=None):  # fmt: skip
    dtype = getattr(torch, dtype_name)
    gpu = group.backend == "cuda"
    if sizes is None:
        sizes = [(1, 40), (2, 22)] if not gpu else [(1, 300), (2, 130)]  # ragged S_loc
    with SPAttention(
        group, heads, kv_heads, d, max_tokens=max(b * s for b, s in sizes), dtype=dtype,
        strategy=strategy,
    ) as ctx:  # fmt: skip
        for i, (batch, s_loc) in enumerate(sizes):
            (q, k, v, do), refs, cu = _case(
                group, 100 + i, batch, heads, kv_heads, d, s_loc, causal, docs, dtype
            )
            if backward:
                q, k, v = (x.requires_grad_() for x in (q, k, v))
            o = ctx(q, k, v, causal=causal, cu_seqlens=cu)
            sync(group)
            err = rel_err(o.detach().cpu(), refs[0])
            assert o.shape == q.shape and err < TOL_FWD, f"call {i}: forward rel err {err:.2e}"
            if backward:
                o.backward(do)
                sync(group)
                for name, t, ref in zip("qkv", (q, k, v), refs[1:]):
                    assert torch.isfinite(t.grad).all(), f"call {i}: d{name} not finite"
                    err = rel_err(t.grad.cpu(), ref)
                    assert err < TOL_GRAD, f"call {i}: d{name} rel err {err:.2e}"
        if strategy == "fused":
            ctx.check()
    return True


@pytest.mark.parametrize("world", W34 + GPU2, indirect=True)
def test_causal_gqa_forward_backward(world):
    """Zigzag causal, GQA (4 query heads on 2 K/V heads), two shapes on one context."""
    world.run(_fwd_bwd_body, True, 0, 4, 2, 64, "bfloat16", "fused", True)


@pytest.mark.parametrize("world", W23 + GPU2, indirect=True)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_forward_backward(world, causal):
    """Packed documents (three, boundaries anywhere in the shards)."""
    world.run(_fwd_bwd_body, causal, 3, 4, 2, 64, "bfloat16", "fused", True)


def _hopper_body(group, causal, docs, d, dtype_name):
    """Shapes the Hopper forward takes (``sp_attention.hopper_forward``: S_loc a multiple
    of 128; 384 puts a zigzag half boundary inside a 128-row program), forward and the
    backward reading its ``lse``; its launches counted (every call on a Hopper GPU, none
    elsewhere)."""
    from interlace.ops.attention import sp_attention as sp

    with counting(sp, "_launch_fwd_hopper") as calls:
        _fwd_bwd_body(group, causal, docs, 4, 2, d, dtype_name, "fused", True,
                      sizes=[(1, 384), (2, 256)])  # fmt: skip
    hopper = sp.KH is not None and torch.cuda.get_device_capability()[0] == 9
    assert len(calls) == (2 if hopper else 0), calls
    return True


@pytest.mark.parametrize("world", GPU2, indirect=True)
@pytest.mark.parametrize(
    "causal,docs,d,dtype_name",
    [(False, 0, 128, "bfloat16"), (True, 0, 128, "bfloat16"), (True, 3, 64, "bfloat16"),
     (False, 3, 128, "bfloat16"), (True, 0, 128, "float16")],
    ids=["full", "causal", "causal-docs-d64", "full-docs", "causal-fp16"],
)  # fmt: skip
def test_hopper_forward(world, causal, docs, d, dtype_name):
    world.run(_hopper_body, causal, docs, d, dtype_name)


def _side_dq_body(group, side):
    """The backward with its dQ kernel beside the dK / dV kernel (a second stream, the
    arrival flags cleared by a kernel of their own once both are done) or after it."""
    before = SPAttention.SIDE_DQ
    SPAttention.SIDE_DQ = side
    try:
        return _fwd_bwd_body(group, True, 0, 4, 2, 64, "bfloat16", "fused", True)
    finally:
        SPAttention.SIDE_DQ = before


@pytest.mark.parametrize("world", GPU2, indirect=True)
@pytest.mark.parametrize("side", [True, False], ids=["side", "serial"])
def test_backward_dq_beside_or_after_dkdv(world, side):
    world.run(_side_dq_body, side)


@pytest.mark.parametrize("world", W23[:1] + GPU2, indirect=True)
def test_full_attention_fp16(world):
    world.run(_fwd_bwd_body, False, 0, 4, 2, 64, "float16", "fused", True)


@pytest.mark.parametrize("world", GPU2, indirect=True)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_dim_128_gpu(world, causal):
    world.run(_fwd_bwd_body, causal, 0, 4, 2, 128, "bfloat16", "fused", True)


def _config_body(group, fields, causal, dtype_name, docs=3):
    """``_fwd_bwd_body`` with ``fields`` set in every kernel config on this rank."""
    import dataclasses

    from interlace.ops.attention import sp_attention as sp

    tables = (sp.GPU_CONFIGS, sp.GPU_CONFIGS_LONG)
    saved = [dict(t) for t in tables], sp.CPU_CONFIG
    sp.CPU_CONFIG = dataclasses.replace(sp.CPU_CONFIG, **fields)
    for table in tables:
        for key, cfg in table.items():
            table[key] = dataclasses.replace(cfg, **fields)
    try:
        return _fwd_bwd_body(group, causal, docs, 4, 2, 64, dtype_name, "fused", True)
    finally:
        for table, old in zip(tables, saved[0]):
            table.update(old)
        sp.CPU_CONFIG = saved[1]


@pytest.mark.parametrize("world", W23[:1] + GPU2, indirect=True)
@pytest.mark.parametrize("fast_exp", [1, 2], ids=["f16x2", "bf16x2"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fast_exponential(world, fast_exp, causal):
    """The packed 16-bit exponentials (``AttnConfig.fast_exp``) in the forward, dK / dV and
    dQ kernels, with packed documents (masked and unmasked blocks), within the same
    tolerances; fp16 inputs with the bfloat16 exponential too."""
    world.run(_config_body, {"fast_exp": fast_exp}, causal, "bfloat16")
    if fast_exp == 2 and not causal:
        world.run(_config_body, {"fast_exp": fast_exp}, causal, "float16")


@pytest.mark.parametrize("world", W23 + GPU2, indirect=True)
@pytest.mark.parametrize("strategy", ["none", "ring"])
def test_baselines(world, strategy):
    """``none`` and ``ring``, forward and every rank's dq, dk, dv: causal with GQA, full
    attention with packed documents, and (``ring``: its masks per block differ) causal
    with packed documents and full attention with GQA and no documents."""
    world.run(_fwd_bwd_body, True, 0, 4, 2, 64, "bfloat16", strategy, True)
    world.run(_fwd_bwd_body, False, 2, 2, 1, 64, "bfloat16", strategy, True)
    if strategy == "ring":
        world.run(_fwd_bwd_body, True, 3, 4, 2, 64, "bfloat16", strategy, True)
        world.run(_fwd_bwd_body, False, 0, 4, 1, 64, "bfloat16", strategy, True)


def _repeat_body(group):
    """Several forward calls back to back (alternating buffer sets) before any backward,
    then the backwards in reverse order, as a multi-layer model runs: each result stays
    right (no flag or buffer leaks from one call into another). On a GPU the later calls
    of each kind are replayed from CUDA graphs (eager graphs), which must have been taken."""
    dtype, causal = torch.bfloat16, True
    gpu = group.backend == "cuda"
    with SPAttention(group, 4, 2, 64, max_tokens=24, dtype=dtype) as ctx:
        runs = []
        for i in range(5 if gpu else 3):
            (q, k, v, do), refs, cu = _case(group, 7 + i, 1, 4, 2, 64, 24, causal, 0, dtype)
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            runs.append((q, k, v, do, refs, ctx(q, k, v, causal=True)))
        for q, k, v, do, refs, o in reversed(runs):
            assert rel_err(o.detach().cpu(), refs[0]) < TOL_FWD
            o.backward(do)
            sync(group)
            for t, ref in zip((q, k, v), refs[1:]):
                assert rel_err(t.grad.cpu(), ref) < TOL_GRAD
        ctx.check()
        if gpu and ctx.eager_graphs:
            replayed = [key[0][0] for key, g in ctx._graphs.items() if not isinstance(g, str)]
            assert sorted(replayed) == ["bwd", "bwd", "fwd", "fwd"], ctx._graphs
    return True


@pytest.mark.parametrize("world", W23[:1] + GPU2, indirect=True)
def test_repeated_calls(world):
    world.run(_repeat_body)


def _zigzag_body(group):
    x = torch.arange(2 * 3 * group.world_size * 4).reshape(2, 3, -1)
    parts = [zigzag_shard(x, group.world_size, r, dim=2) for r in range(group.world_size)]
    assert torch.equal(zigzag_unshard(parts, dim=2), x)
    return True


@pytest.mark.parametrize("world", W23[:1], indirect=True)
def test_zigzag_layout_round_trip(world):
    world.run(_zigzag_body)


def _bad_inputs_body(group):
    w, r, dev = group.world_size, group.rank, group.device
    bf = torch.bfloat16
    cls, bf16_only, vexc = SPAttention, torch.float32, InterlaceValueError
    for bad, exc, text in (
        (lambda: SPAttention(group, 6, 4, 64, 16), InterlaceValueError, "multiple of kv_heads"),
        (lambda: SPAttention(group, 4, 2, 96, 16), InterlaceValueError, "head_dim"),
        (lambda: cls(group, 4, 2, 64, 16, dtype=bf16_only), InterlaceTypeError, "dtype"),
        (lambda: cls(group, 4, 2, 64, 16, strategy="fast"), vexc, "strategy"),
    ):  # fmt: skip
        expect_error(exc, text, bad)
    with SPAttention(group, 4, 2, 64, max_tokens=16) as ctx:
        q = torch.randn(1, 4, 8, 64).to(bf).to(dev)
        k = torch.randn(1, 2, 8, 64).to(bf).to(dev)
        # dtype mismatch, wrong head count, K/V shape off, capacity, odd causal S_loc
        expect_error(InterlaceTypeError, "dtype", ctx, q.half(), k, k)
        expect_error(InterlaceValueError, "heads", ctx, q[:, :2].contiguous(), k, k)
        expect_error(InterlaceValueError, "expected", ctx, q, k[:, :1].contiguous(), k)
        big = torch.randn(1, 4, 18, 64).to(bf).to(dev)
        kb = torch.randn(1, 2, 18, 64).to(bf).to(dev)
        expect_error(InterlaceValueError, "takes 1 to", ctx, big, kb, kb)
        q7, k7 = q[:, :, :7].contiguous(), k[:, :, :7].contiguous()
        expect_error(InterlaceValueError, "even", ctx, q7, k7, k7, causal=True)
        bad_cu = torch.tensor([0, 5, 5, 8 * w], dtype=torch.int32)
        expect_error(InterlaceValueError, "cu_seqlens", ctx, q, k, k, cu_seqlens=bad_cu)
        # a different S_loc on one rank: every rank raises
        s = 6 if r == w - 1 else 8
        qs, ks = q[:, :, :s].contiguous(), k[:, :, :s].contiguous()
        expect_error(InterlaceValueError, "different shapes", ctx, qs, ks, ks)
        # and the context still works afterwards
        o = ctx(q, k, k)
        sync(group)
        assert torch.isfinite(o.float()).all()
        ctx.check()
    return True


@pytest.mark.parametrize("world", W23 + GPU2, indirect=True)
def test_bad_inputs_raise_on_every_rank(world):
    world.run(_bad_inputs_body)


def _graph_body(group):
    """The forward captured in a CUDA graph (after an eager call) and replayed on fresh
    inputs with the output poisoned."""
    dtype, causal = torch.bfloat16, True
    with SPAttention(group, 4, 2, 128, max_tokens=256, dtype=dtype) as ctx:
        (q, k, v, _), refs, _ = _case(group, 3, 1, 4, 2, 128, 256, causal, 0, dtype)
        graph, o = capture(lambda: ctx(q, k, v, causal=True))
        for i in range(3):
            (q2, k2, v2, _), refs, _ = _case(group, 50 + i, 1, 4, 2, 128, 256, causal, 0, dtype)
            q.copy_(q2), k.copy_(k2), v.copy_(v2)
            replay(graph, o)
            assert rel_err(o.cpu(), refs[0]) < TOL_FWD, f"replay {i}"
        ctx.check()
    return True


@pytest.mark.parametrize("world", GPU2, indirect=True)
def test_forward_graph_replay(world):
    world.run(_graph_body)


def test_copies_enqueued_before_waiting_kernels(monkeypatch):
    """Host order of a call on a GPU: every copy to a peer (and its flag) is enqueued
    before the kernels that wait for the peers' copies, since the first launch of a kernel
    blocks the host while a kernel spins (a waiting kernel enqueued first deadlocked the
    backward); a captured call's barrier comes before the fork, not beside the kernels.
    Pure host logic: the stream calls are recorded, nothing runs."""
    from types import SimpleNamespace

    from interlace.ops.attention import sp_attention as sp

    log = []
    monkeypatch.setattr(sp, "fork", lambda group: log.append("fork") or "comm")
    monkeypatch.setattr(sp, "join", lambda group, stream: log.append(("join", stream)))

    def copy(dst, src, signal=None, index=0, stream=None):
        log.append(("copy", src.data_ptr(), index if signal is not None else None, stream))

    monkeypatch.setattr(sp, "copy_and_signal", copy)
    w = 3
    ctx = SPAttention.__new__(SPAttention)
    ctx.world_size, ctx.rank = w, 1
    ctx.group = SimpleNamespace(backend="cuda")
    ctx.gathered = SimpleNamespace(peers=[torch.zeros(3, 2 * w * 8) for _ in range(w)])
    ctx.pad = SimpleNamespace(buffer=SimpleNamespace(peers=[torch.zeros(4, dtype=torch.int32)] * w))
    ctx._barrier = lambda: log.append("barrier")
    k, v = torch.ones(8), torch.ones(8)
    for s in (0, sp.GRAPH_SET):
        log.clear()
        ctx._gather(s, k, v, 5, lambda: log.append("consumer"))
        copies = [(src, idx) for kind, src, idx, stream in log[:-2][-2 * (w - 1) :]]
        barrier = ["barrier"] if s == sp.GRAPH_SET else []
        assert log[: len(barrier) + 1] == [*barrier, "fork"]
        assert log[-2:] == ["consumer", ("join", "comm")]
        # peer by peer (rank + 1, rank + 2): K, then V with the flag ``arrival + rank``
        assert copies == [(k.data_ptr(), None), (v.data_ptr(), 6)] * (w - 1)
        assert all(e[3] == "comm" for e in log if e[0] == "copy")


def _unseen_chunks_body(group, causal):
    """Rank 0 of two, with the peer's chunk never arriving: every document lies inside one
    rank's chunk, so no query of rank 0 sees a key of rank 1 and no key of rank 1 is seen
    by rank 0's queries. The forward, dQ and dK/dV kernels must then neither wait for the
    peer's arrival flag (a short bound would record a timeout) nor read its chunk
    (poisoned with NaN); their results match a float32 reference of the local chunk."""
    from interlace.ops.attention import sp_attention as sp
    from interlace.runtime.signals import ERROR_WORDS

    world, heads, d, s_loc = 2, 2, 16, 64
    gen = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(1, heads, s_loc, d, generator=gen).to(torch.bfloat16)
                   for _ in range(4))  # fmt: skip
    # rank 0's chunk holds documents [0, 24) and [24, 64) (causal: the zigzag layout puts
    # sequence chunks 0 and 3 there, [0, 32) and [96, 128), one document each; no query
    # block of the interpreter's 16 rows straddles the seam, as a block's window would
    # then cover the documents between its halves)
    cu_list = [0, 32, 96, 128] if causal else [0, 24, 64, 128]
    cu = torch.tensor(cu_list, dtype=torch.int32)
    seg = segment_ids(cu, world * s_loc).to(torch.int32)
    sig = torch.zeros(4 * (world + 1), dtype=torch.int32)
    err = torch.zeros(ERROR_WORDS, dtype=torch.int32)
    a = sp.KernelArgs(0, world, heads, heads, d, s_loc, causal, True, 1 / math.sqrt(d), seg, cu,
                      sig, err.data_ptr(), 2000, "cpu")  # fmt: skip
    nan = torch.full((world * heads, s_loc, d), float("nan"), dtype=torch.bfloat16)
    k_all, v_all = nan.clone(), nan.clone()
    o, lse = torch.empty_like(q), torch.empty(heads, s_loc)
    sp.launch_fwd(a, q, k, v, k_all, v_all, o, lse, 0, wait=True, clear=False)
    delta = torch.empty(heads, s_loc)
    sp.launch_delta(a, o, do, delta)
    dq = torch.empty_like(q)
    sp.launch_dq(a, q, k, v, k_all, v_all, do, lse, delta, dq, 0, wait=True, clear=False)
    recvs = [torch.full((2 * world * heads * s_loc * d,), 7.0, dtype=torch.bfloat16)
             for _ in range(world)]  # fmt: skip
    recv_table = torch.tensor([r.data_ptr() for r in recvs], dtype=torch.int64)
    sig_table = torch.full((world,), sig.data_ptr(), dtype=torch.int64)
    sp.launch_dkdv(a, q, k, v, k_all, v_all, do, lse, delta, recvs[0], recv_table, sig_table, 0,
                   world + 1, wait=True)  # fmt: skip
    assert not err.any(), err.tolist()  # no wait for the peer's flag timed out
    # float32 reference: rank 0's queries against its own chunk, documents as above
    if causal:
        half = s_loc // 2
        gpos = torch.cat([torch.arange(half), torch.arange(3 * half, 4 * half)])
    else:
        gpos = torch.arange(s_loc)
    qf, kf, vf, dof = (x.float().requires_grad_() for x in (q, k, v, do))
    ok = seg.long()[gpos][:, None] == seg.long()[gpos][None, :]
    if causal:
        ok &= gpos[None, :] <= gpos[:, None]
    p = torch.softmax((qf @ kf.transpose(-1, -2) / math.sqrt(d)).masked_fill(~ok, -math.inf), -1)
    ref = p @ vf
    gq, gk, gv = torch.autograd.grad(ref, (qf, kf, vf), dof)
    assert rel_err(o, ref) < TOL_FWD and rel_err(dq, gq) < TOL_GRAD
    # the partials rank 0 computed for its own chunk (slot 0 of its own recv buffer) are
    # the whole dK / dV; those for rank 1's chunk are zero
    n = heads * s_loc * d
    parts = recvs[0].view(2, world, n)
    assert rel_err(parts[0, 0].view_as(k), gk) < TOL_GRAD
    assert rel_err(parts[1, 0].view_as(v), gv) < TOL_GRAD
    peer = recvs[1].view(2, world, n)[:, 0]
    assert torch.equal(peer, torch.zeros_like(peer)), "a partial for an unseen chunk"
    return True


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_unseen_chunk_is_neither_waited_for_nor_read(causal):
    assert all(get_world("cpu", 1).run(_unseen_chunks_body, causal))


@triton.jit
def _order_kernel(out, half, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr):
    """Writes each program's ``(query block, head)`` at its place in launch order."""
    pid_m, bh = _query_program(half, BLOCK_M, CAUSAL, VARLEN)
    linear = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
    tl.store(out + 2 * linear, pid_m)
    tl.store(out + 2 * linear + 1, bh)


def _program_order_body(group, n_mb, n_bh, half, block, causal, varlen):
    out = torch.full((n_mb * n_bh, 2), -1, dtype=torch.int32)
    _order_kernel[(n_mb, n_bh)](out, half, BLOCK_M=block, CAUSAL=causal, VARLEN=varlen)
    return [tuple(r) for r in out.tolist()]


@pytest.mark.parametrize(
    "n_mb, half, block", [(8, 64, 16), (9, 70, 16), (3, 20, 16), (1, 4, 16)],
    ids=["aligned", "straddling", "small", "one-block"],
)  # fmt: skip
@pytest.mark.parametrize("causal, varlen", [(True, False), (True, True), (False, False)])
def test_query_program_order(n_mb, half, block, causal, varlen):
    """The forward's and dQ's programs, in launch order: every (query block, head) once;
    causal without documents, every head's second-half blocks (the zigzag layout's later,
    heavier positions) before any first-half block, each head's blocks of a half together,
    last first; otherwise each head's blocks together, last first."""
    n_bh = 3
    order = get_world("cpu", 1).run(
        _program_order_body, n_mb, n_bh, half, block, causal, varlen
    )[0]  # fmt: skip
    assert sorted(order) == [(m, h) for m in range(n_mb) for h in range(n_bh)]
    if causal and not varlen:
        hi = [m for m in range(n_mb) if (m + 1) * block > half]
        lo = [m for m in range(n_mb) if (m + 1) * block <= half]
        groups = [sorted(hi, reverse=True), sorted(lo, reverse=True)]
    else:
        groups = [list(range(n_mb - 1, -1, -1))]
    want = [(m, h) for g in groups for h in range(n_bh) for m in g]
    assert order == want
