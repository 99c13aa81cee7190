"""The overlapped GEMMs (AG+GEMM, GEMM+RS, GEMM+AR) against a float32 reference built with
torch.distributed, for every strategy: ragged shapes (rows not multiples of the tile, rows
per rank not multiples of 128, unaligned N/K for the non-TMA path), bias, ``out=``,
poisoned outputs, repeated calls on one context, bad inputs, and (on GPUs) CUDA-graph
capture and replay."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

import interlace
from interlace.errors import InterlaceTypeError, InterlaceValueError
from tests.conftest import GPU_SIZES, WITH_ONE_GPU
from tests.ops._helpers import (
    capture,
    check_graph_replays,
    counting,
    expect_error,
    gathered,
    nans,
    rand,
    reduced,
    rel_err,
    replay,
    run_on_gpus,
    sync,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOL = 1e-2


def _shapes(group):
    """(rows per rank, n, k): ragged rows, TMA-aligned and unaligned N/K."""
    if group.backend == "cuda":
        return [(300, 520, 264), (1000, 1024, 512), (77, 200, 72), (129, 33, 20)]
    return [(37, 40, 24), (5, 33, 20)]


# ----------------------------------------------------------------------------- AG + GEMM
def _ag_body(group, strategy, dtype_name, calls, **options):
    dtype, w = DTYPES[dtype_name], group.world_size
    gen = torch.Generator().manual_seed(7 + group.rank)
    wgen = torch.Generator().manual_seed(99)  # b: the rank's own column shard
    for m_loc, n, k in _shapes(group):
        ctx = interlace.AGGemm(
            group, max_m=w * m_loc, n=n, k=k, dtype=dtype, strategy=strategy, **options
        )
        try:
            for i in range(calls):
                rows = m_loc if i % 2 == 0 else max(1, m_loc // 2 + 1)  # varying M per call
                a = rand(gen, rows, k, dtype=dtype, device=group.device)
                b = rand(wgen, k, n, dtype=dtype, device=group.device, scale=0.2)
                bias = rand(gen, n, dtype=dtype, device=group.device) if i == 1 else None
                out = nans(w * rows, n, dtype=dtype, device=group.device)
                c = ctx(a, b, bias=bias, out=out) if i != 2 else ctx(a, b, bias=bias)
                sync(group)
                ref = gathered(a, group).float() @ b.float()
                if bias is not None:
                    ref += bias.float()
                assert c.shape == (w * rows, n)
                err = rel_err(c, ref)
                assert err < TOL, f"{strategy} shape {(rows, n, k)} call {i}: rel err {err:.2e}"
                if i != 2:
                    assert c.data_ptr() == out.data_ptr()
            if strategy != "auto":
                assert ctx.last_strategy == strategy
        finally:
            ctx.close()
    return True


@pytest.mark.parametrize("strategy", interlace.AGGemm.STRATEGIES)
def test_ag_gemm_matches_reference(world, strategy):
    world.run(_ag_body, strategy, "bf16", 3)


def test_ag_gemm_fp16(world):
    world.run(_ag_body, "fused", "fp16", 1)


@pytest.mark.parametrize("strategy", ["fused", "sm_pull"])
def test_ag_gemm_swizzled_split(world, strategy):
    world.run(_ag_body, strategy, "bf16", 2, schedule="swizzled", split=3)


def _ag_one_loop_body(group, strategy, split):
    """Rows per rank a multiple of the GEMM's tile rows: the consumer GEMM runs its
    one-loop mode (every segment's tiles in one pipelined loop, each tile waiting for its
    chunk in inline PTX); repeated calls, with and without bias, against float32."""
    w, dev = group.world_size, group.device
    m_loc, n, k = (256, 512, 256) if group.backend == "cuda" else (64, 40, 24)
    gen = torch.Generator().manual_seed(31 + group.rank)
    b = rand(torch.Generator().manual_seed(3), k, n, dtype=torch.bfloat16, device=dev, scale=0.2)
    ctx = interlace.AGGemm(group, max_m=w * m_loc, n=n, k=k, strategy=strategy, split=split)
    try:
        for i in range(3):
            a = rand(gen, m_loc, k, dtype=torch.bfloat16, device=dev)
            bias = rand(gen, n, dtype=torch.bfloat16, device=dev) if i == 1 else None
            out = ctx(a, b, bias=bias, out=nans(w * m_loc, n, dtype=torch.bfloat16, device=dev))
            ctx.check()  # a wait that timed out is reported as such, not as wrong numbers
            ref = gathered(a, group).float() @ b.float()
            if bias is not None:
                ref += bias.float()
            assert rel_err(out, ref) < TOL, f"call {i}: rel err {rel_err(out, ref):.2e}"
        plans = [*ctx._plans.values()]
        if w * split > 1:  # (one segment: the plain loop)
            assert plans and all(p.tiles.one_loop is not None for p in plans), (
                "one-loop mode not taken"
            )
    finally:
        ctx.close()
    return True


@pytest.mark.parametrize("world", WITH_ONE_GPU, indirect=True)
@pytest.mark.parametrize("strategy, split", [("fused", 1), ("fused", 2), ("sm_pull", 2)])
def test_ag_gemm_one_loop(world, strategy, split):
    world.run(_ag_one_loop_body, strategy, split)


def _ag_back_to_back_body(group, calls):
    """Fused AG+GEMM calls issued with no synchronisation while ranks fall out of step
    (device sleeps / host sleeps): eager calls alternate buffer sets and run no barrier, so
    a rank that runs ahead must still never overwrite rows a peer's GEMM has not read."""
    w, r, dev = group.world_size, group.rank, group.device
    m_loc, n, k = _shapes(group)[0]
    gen = torch.Generator().manual_seed(21 + r)
    b = rand(torch.Generator().manual_seed(5), k, n, dtype=torch.bfloat16, device=dev, scale=0.2)
    shards = [rand(gen, m_loc, k, dtype=torch.bfloat16, device=dev) for _ in range(calls)]
    outs = [nans(w * m_loc, n, dtype=torch.bfloat16, device=dev) for _ in range(calls)]
    ctx = interlace.AGGemm(group, max_m=w * m_loc, n=n, k=k, strategy="fused")
    try:
        for i in range(calls):
            if (i + r) % 3 == 0:
                if group.backend == "cuda":
                    torch.cuda._sleep(200_000 * (1 + (i * (r + 1)) % 4))
                else:
                    time.sleep(0.05)
            ctx(shards[i], b, out=outs[i])
        sync(group)
        for i in range(calls):
            ref = gathered(shards[i], group).float() @ b.float()
            assert rel_err(outs[i], ref) < TOL, f"call {i}"
    finally:
        ctx.close()
    return True


def test_ag_gemm_back_to_back_ranks_out_of_step(world):
    world.run(_ag_back_to_back_body, 8)


# ----------------------------------------------------------------------------- GEMM + RS / AR
def _scatter_body(group, op, strategy, dtype_name, calls, split, shapes=None, **options):
    dtype, w, r = DTYPES[dtype_name], group.world_size, group.rank
    cls = {"rs": interlace.GemmRS, "ar": interlace.GemmAR}[op]
    gen = torch.Generator().manual_seed(11 + r)
    # The ring forwards running sums in the output dtype, one rounding per hop (as NCCL's
    # ring does): its error grows with the world size. The others round once.
    tol = 5e-3 * (1 + math.sqrt(w - 1)) if strategy == "ring" else TOL
    for m_loc, n, k in shapes or _shapes(group):
        kw = dict(options) if split is None else {"split": split, **options}
        ctx = cls(group, max_m=w * m_loc, n=n, k=k, dtype=dtype, strategy=strategy, **kw)
        try:
            for i in range(calls):
                m = w * (m_loc if i % 2 == 0 else max(1, m_loc // 3))
                a = rand(gen, m, k, dtype=dtype, device=group.device)
                b = rand(gen, k, n, dtype=dtype, device=group.device, scale=0.2)
                bias = rand(torch.Generator().manual_seed(5), n, dtype=dtype, device="cpu")
                bias = bias.to(group.device) if i == 1 else None
                full = reduced(a.float() @ b.float(), group)
                if bias is not None:
                    full += bias.float()
                rows = m // w if op == "rs" else m
                ref = full[r * rows : (r + 1) * rows] if op == "rs" else full
                out = nans(rows, n, dtype=dtype, device=group.device)
                c = ctx(a, b, bias=bias, out=out) if i != 2 else ctx(a, b, bias=bias)
                sync(group)
                assert c.shape == (rows, n)
                err = rel_err(c, ref)
                assert err < tol, f"{op} {strategy} {(m, n, k)} call {i}: rel err {err:.2e}"
                if op == "ar" and strategy in ("fused", "ce_fused", "ce_scatter"):
                    # every rank holds the same bits
                    first = c.clone()
                    dist.broadcast(first, 0)
                    assert torch.equal(first, c), "all-reduce results differ across ranks"
        finally:
            ctx.close()
    return True


def _strategy_params(strategies):
    """``signal_reorder`` runs the process group's collectives on CUDA tensors: it needs a
    GPU per rank (``own_gpu``)."""
    return [
        pytest.param(s, marks=pytest.mark.own_gpu) if s == "signal_reorder" else s
        for s in strategies
    ]


@pytest.mark.parametrize("strategy", _strategy_params(interlace.GemmRS.STRATEGIES))
def test_gemm_rs_matches_reference(world, strategy):
    world.run(_scatter_body, "rs", strategy, "bf16", 3, None)


@pytest.mark.parametrize("strategy", _strategy_params(interlace.GemmAR.STRATEGIES))
def test_gemm_ar_matches_reference(world, strategy):
    world.run(_scatter_body, "ar", strategy, "bf16", 3, None)


@pytest.mark.parametrize(
    "op, strategy",
    [
        ("rs", "fused"), ("ar", "fused"), ("rs", "ce_fused"), ("ar", "ce_fused"),
        ("rs", "ce_scatter"), ("ar", "ce_scatter"), ("rs", "ring"),
    ],
)  # fmt: skip
def test_scatter_split_and_fp16(world, op, strategy):
    world.run(_scatter_body, op, strategy, "fp16", 1, 3)


def _ce_fused_one_loop_body(group, op, m_loc=256, n=512, k=384):
    """GEMM+RS / GEMM+AR ``ce_fused`` on shapes whose chunks are whole tile rows: the
    GEMM runs its one-loop mode (push tiles, then reduce tiles, each counted per warp);
    repeated calls, bias and ``out=``, against float32; the plans must have taken it."""
    from interlace.ops.gemm_rs import CeFusedPlan

    w, r, dev = group.world_size, group.rank, group.device
    cls = {"rs": interlace.GemmRS, "ar": interlace.GemmAR}[op]
    gen = torch.Generator().manual_seed(41 + r)
    b = rand(torch.Generator().manual_seed(4), k, n, dtype=torch.bfloat16, device=dev, scale=0.2)
    bias = rand(torch.Generator().manual_seed(6), n, dtype=torch.bfloat16, device=dev)
    ctx = cls(group, max_m=w * m_loc, n=n, k=k, strategy="ce_fused")
    try:
        for i in range(4):
            a = rand(gen, w * m_loc, k, dtype=torch.bfloat16, device=dev)
            with_bias = bias if i % 2 else None
            rows = m_loc if op == "rs" else w * m_loc
            out = nans(rows, n, dtype=torch.bfloat16, device=dev)
            c = ctx(a, b, bias=with_bias, out=out) if i < 3 else ctx(a, b, bias=with_bias)
            sync(group)
            full = reduced(a.float() @ b.float(), group)
            if with_bias is not None:
                full += with_bias.float()
            ref = full[r * m_loc : (r + 1) * m_loc] if op == "rs" else full
            assert rel_err(c, ref) < TOL, f"{op} call {i}: rel err {rel_err(c, ref):.2e}"
        ctx.check()
        plans = [p for p in ctx._plans.values() if isinstance(p, CeFusedPlan)]
        assert plans and all(p.one_loop is not None for p in plans), "one-loop mode not taken"
    finally:
        ctx.close()
    return True


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rs", "ar"])
@pytest.mark.parametrize("size", [1, *GPU_SIZES])
@pytest.mark.parametrize("tiles", ["few", "many"])
def test_ce_fused_one_loop(op, size, tiles):
    """``few``: fewer tiles than programs. ``many``: more tiles than an H100 or H200 has
    SMs, so programs run push tiles and then reduce tiles, whose waits need every
    program's push tiles counted first (on every rank)."""
    from tests.conftest import get_world

    shape = (256, 512, 384) if tiles == "few" else (2048, 2048, 256)
    get_world("cuda", size).run(_ce_fused_one_loop_body, op, *shape)


@pytest.mark.parametrize("gather", interlace.GemmAR.GATHERS)
def test_ar_ce_fused_gathers_between_rounds(world, gather):
    """GEMM+AR ``ce_fused`` with four chunks per owner (CPU tiles are 32 rows): own chunks
    reduced between the peers' rounds, their rows gathered (by copies, or from the
    epilogue) while later rounds compute, rows not a multiple of the chunk; and the
    default split on the usual shapes, bias and ``out=`` included."""
    world.run(_scatter_body, "ar", "ce_fused", "bf16", 2, 4, [(120, 40, 24)], gather=gather)
    world.run(_scatter_body, "ar", "ce_fused", "bf16", 3, None, gather=gather)


def test_gather_order_reduces_each_own_chunk_one_round_late():
    from interlace.ops.gemm_rs import gather_order

    w, rank, split = 4, 1, 3
    sched = interlace.schedule.partition_all_reduce(w, 96, split, align=32)
    chunks = [c for c, _ in interlace.schedule.chunk_order(sched, rank)]
    order = gather_order(chunks, rank, w)
    assert sorted(c.id for c in order) == sorted(c.id for c in chunks)

    def piece(c):  # the chunk's index among its owner's chunks
        return sorted(x.lo for x in chunks if x.owner == c.owner).index(c.lo)

    where = {(c.owner, piece(c)): i for i, c in enumerate(order)}
    for j in range(split):
        peers = [where[((rank + d) % w, j)] for d in range(1, w)]
        assert peers == sorted(peers), "peers rank-rotated within a round"
        assert max(peers) < where[(rank, j)], "own chunk after every peer's"
        if j + 1 < split:
            later = [where[((rank + d) % w, j + 1)] for d in range(1, w)]
            assert max(later) < where[(rank, j)], "own chunk a round late"
        if j + 2 < split:
            assert where[(rank, j)] < min(where[((rank + d) % w, j + 2)] for d in range(1, w))
    assert order[-1].owner == rank


# ----------------------------------------------------------------------------- auto
def _auto_choice_body(group):
    """``auto`` falls back to cuBLAS + NCCL when the estimated overlap is below the op's
    floor, and overlaps above it (a function of the shape only: every rank agrees)."""
    w, choices = group.world_size, {}
    for name, cls, k, n in (
        ("ag", interlace.AGGemm, 4096, 11008 // w),
        ("rs", interlace.GemmRS, 11008 // w, 4096),
        ("ar", interlace.GemmAR, 11008 // w, 4096),
    ):
        ctx = cls(group, max_m=8 * w, n=n, k=k, strategy="auto")
        try:
            choices[name] = [ctx._resolve(m, n, k) for m in (16, 2048, 8192)]
        finally:
            ctx.close()
    return choices


def _big_pick(op: str, w: int) -> str:
    """What ``auto`` overlaps LLaMA-7B at M 8192 with: ``ce_fused`` when the GEMM,
    estimated at 650 TFLOP/s, reaches the op's floor for this world size."""
    from interlace.ops.policy import lookup

    floor = lookup(op, w).ce_fused_min_gemm_us
    gemm_us = 2.0 * 8192 * 4096 * (11008 // w) / 650e6
    return "ce_fused" if floor is not None and gemm_us >= floor else "fused"


def test_auto_falls_back_below_the_floor(world):
    w = world.world_size
    big = {"ag": "fused", "rs": _big_pick("gemm_rs", w), "ar": _big_pick("gemm_ar", w)}
    if w == 4:  # the GEMM+RS / AR floors as measured on 4 x H200
        assert big == {"ag": "fused", "rs": "ce_fused", "ar": "ce_fused"}
    for choices in world.run(_auto_choice_body):
        for op, picks in choices.items():
            assert picks[0] == "none" and picks[2] == big[op], (op, picks)
        if world.world_size == 2:  # LLaMA-7B at M 2048: every op overlaps (eager floor 30 us)
            assert all(picks[1] == "fused" for picks in choices.values()), choices
        if world.world_size == 4:  # there GEMM+RS / AR at M 2048 lost to cuBLAS + NCCL
            assert choices["rs"][1] == choices["ar"][1] == "none", choices


def _auto_switch_body(group, calls):
    """GEMM+RS ``auto`` moving between ``fused`` (smaller calls) and ``ce_fused`` (larger
    ones) on one context: every call right, whatever ran before it (the two share
    buffers and signal slots; a switch runs a barrier first)."""
    from interlace.ops.policy import lookup

    w, r = group.world_size, group.rank
    m_loc, n, k = _shapes(group)[0]
    gen = torch.Generator().manual_seed(17 + r)
    small, big = w * max(1, m_loc // 3), w * m_loc
    # overlap every size here; ce_fused from a GEMM between the two sizes
    policy = replace(
        lookup("gemm_rs", w), min_overlap_eager_us=0.0, min_overlap_graph_us=0.0,
        ce_fused_min_gemm_us=2.0 * (small + big) / 2 * n * k / 650e6,
    )  # fmt: skip
    ctx = interlace.GemmRS(group, max_m=w * m_loc, n=n, k=k, strategy="auto", policy=policy)
    ran = []
    try:
        for i in range(calls):
            m = big if i % 3 else small
            a = rand(gen, m, k, dtype=torch.bfloat16, device=group.device)
            b = rand(gen, k, n, dtype=torch.bfloat16, device=group.device, scale=0.2)
            ref = reduced(a.float() @ b.float(), group)[r * (m // w) : (r + 1) * (m // w)]
            out = ctx(a, b)
            sync(group)
            assert rel_err(out, ref) < TOL, f"call {i} ({ctx.last_strategy})"
            ran.append(ctx.last_strategy)
    finally:
        ctx.close()
    return ran


def test_auto_switches_between_fused_and_ce_fused(world):
    for ran in world.run(_auto_switch_body, 7):
        assert ran == ["fused", "ce_fused", "ce_fused"] * 2 + ["fused"], ran


# ----------------------------------------------------------------------------- bad inputs
def _bad_inputs_body(group):
    w, dev = group.world_size, group.device
    bf = torch.bfloat16
    ag = interlace.AGGemm(group, max_m=4 * w, n=16, k=8, strategy="fused")
    rs = interlace.GemmRS(group, max_m=4 * w, n=16, k=8, strategy="fused")
    try:
        a = torch.randn(4, 8, device=dev).to(bf)
        b = torch.randn(8, 16, device=dev).to(bf)
        cases = [
            (ag, (a.float(), b), InterlaceTypeError, "bfloat16"),
            (
                ag,
                (torch.randn(4, 9, device=dev).to(bf), torch.randn(9, 16, device=dev).to(bf)),
                InterlaceValueError,
                "k = 8",
            ),  # fmt: skip
            (ag, (a, b[:7]), InterlaceValueError, "inner dimensions"),
            (ag, (torch.randn(5, 8, device=dev).to(bf), b), InterlaceValueError, "rows"),
            (ag, (a, torch.randn(8, 17, device=dev).to(bf)), InterlaceValueError, "n = 16"),
            (ag, (a.t(), b), InterlaceValueError, "contiguous"),
            (rs, (torch.randn(w + 1, 8, device=dev).to(bf), b), InterlaceValueError, "multiple"),
            (rs, (a, b, torch.randn(15, device=dev).to(bf)), InterlaceValueError, "bias"),
        ]
        for ctx, args, exc, text in cases:
            expect_error(exc, text, ctx, *args)
        for bad in (
            lambda: interlace.AGGemm(group, max_m=4 * w + 1, n=16, k=8),
            lambda: interlace.GemmRS(group, max_m=4 * w, n=16, k=8, strategy="fast"),
            lambda: interlace.GemmAR(group, max_m=4 * w, n=16, k=8, split=99),
            lambda: interlace.GemmAR(group, max_m=4 * w, n=16, k=8, gather="nccl"),
        ):
            with pytest.raises(InterlaceValueError):
                bad()
        with pytest.raises(InterlaceTypeError):  # dtype errors have one class
            interlace.GemmAR(group, max_m=4 * w, n=16, k=8, dtype=torch.float32)
    finally:
        ag.close()
        rs.close()
    with pytest.raises(interlace.InterlaceError, match="closed"):
        ag(a, b)
    return True


def test_bad_inputs_raise_on_every_rank(world):
    world.run(_bad_inputs_body)


def _offset_view(x, elements=1):
    """``x``'s values in a view that starts ``elements`` past a 16-byte boundary."""
    flat = torch.empty(x.numel() + elements, dtype=x.dtype, device=x.device)
    view = flat[elements:].view(x.shape)
    view.copy_(x)
    return view


def _alignment_body(group):
    """Operands that TMA reads must be 16-byte aligned (a clear error, on every rank, before
    any launch); a misaligned bias (plain loads) is fine, also after aligned calls (the
    prepared launch binds the kernel again when an operand's alignment changes)."""
    w, dev, dtype = group.world_size, group.device, torch.bfloat16
    m_loc, n, k = (256, 512, 256) if group.backend == "cuda" else (37, 40, 24)
    gen = torch.Generator().manual_seed(21 + group.rank)
    rs = interlace.GemmRS(group, max_m=w * m_loc, n=n, k=k, strategy="fused")
    ag = interlace.AGGemm(group, max_m=w * m_loc, n=n, k=k, strategy="fused")
    try:
        a = rand(gen, w * m_loc, k, dtype=dtype, device=dev)
        b = rand(torch.Generator().manual_seed(4), k, n, dtype=dtype, device=dev, scale=0.2)
        bias = rand(torch.Generator().manual_seed(5), n, dtype=dtype, device=dev)
        full = reduced(a.float() @ b.float(), group) + bias.float()
        ref = full[group.rank * m_loc : (group.rank + 1) * m_loc]
        for bias_in in (bias, bias, _offset_view(bias), bias):
            out = rs(a, b, bias=bias_in)
            sync(group)
            assert rel_err(out, ref) < TOL
        expect_error(InterlaceValueError, "16-byte", rs, _offset_view(a), b)
        expect_error(InterlaceValueError, "16-byte", ag, _offset_view(a[:m_loc]), b)
        out = _offset_view(torch.empty(w * m_loc, n, dtype=dtype, device=dev))
        expect_error(InterlaceValueError, "16-byte", ag, a[:m_loc], b, out=out)
    finally:
        rs.close()
        ag.close()
    return True


def test_tma_alignment(world):
    world.run(_alignment_body)


# ----------------------------------------------------------------------------- CUDA graphs
def _graph_body(group, op, strategy="fused", **options):
    w, dev, dtype = group.world_size, group.device, torch.bfloat16
    m_loc, n, k = 384, 512, 256
    gen = torch.Generator().manual_seed(3 + group.rank)
    if op == "ag":
        ctx = interlace.AGGemm(group, max_m=w * m_loc, n=n, k=k, strategy=strategy)
        a = rand(gen, m_loc, k, dtype=dtype, device=dev)
    else:
        cls = interlace.GemmRS if op == "rs" else interlace.GemmAR
        ctx = cls(group, max_m=w * m_loc, n=n, k=k, strategy=strategy, **options)
        a = rand(gen, w * m_loc, k, dtype=dtype, device=dev)
    b = rand(gen, k, n, dtype=dtype, device=dev, scale=0.2)

    def reference(a):
        if op == "ag":
            return gathered(a, group).float() @ b.float()
        full = reduced(a.float() @ b.float(), group)
        return full[group.rank * m_loc : (group.rank + 1) * m_loc] if op == "rs" else full

    try:
        check_graph_replays(ctx, a, b, gen, reference, TOL)
    finally:
        ctx.close()
    return True


@pytest.mark.gpu
@pytest.mark.parametrize(
    "op, strategy",
    [
        ("ag", "fused"),
        ("ag", "sm_pull"),
        ("rs", "fused"),
        ("rs", "ce_fused"),
        ("rs", "ce_scatter"),
        ("rs", "ring"),
        ("ar", "fused"),
        ("ar", "ce_fused"),
        ("ar", "ce_fused:gather=copy"),
        ("ar", "ce_scatter"),
    ],  # fmt: skip
)
@pytest.mark.parametrize("size", GPU_SIZES)
def test_cuda_graph_replay(op, strategy, size):
    from interlace.bench.dense import split_variant
    from tests.conftest import get_world

    get_world("cuda", size).run(_graph_body, op, *split_variant(strategy)[:1],
                                **split_variant(strategy)[1])  # fmt: skip


# ----------------------------------------------------------------------------- eager graphs
def _eager_graph_body(group, op, strategy, calls=7, **options):
    """``eager_graphs=True``: repeated eager calls of one shape, each with fresh inputs and
    a new output (other addresses than the captured call's), every result against the
    float32 reference; a bias on every other call (a second kind of call). The context must
    end up replaying graphs (a path that never graphs fails here)."""
    w, dev, dtype = group.world_size, group.device, torch.bfloat16
    m_loc, n, k = 384, 512, 256
    gen = torch.Generator().manual_seed(5 + group.rank)
    bgen = torch.Generator().manual_seed(3)  # a bias is the same on every rank
    rows = m_loc if op == "ag" else w * m_loc
    if op == "ag":
        ctx = interlace.AGGemm(group, w * m_loc, n, k, strategy=strategy, eager_graphs=True)
    else:
        cls = interlace.GemmRS if op == "rs" else interlace.GemmAR
        ctx = cls(group, w * m_loc, n, k, strategy=strategy, eager_graphs=True, **options)
    try:
        b = rand(gen, k, n, dtype=dtype, device=dev, scale=0.2)
        for i in range(calls):
            a = rand(gen, rows, k, dtype=dtype, device=dev)
            bias = rand(bgen, n, dtype=dtype, device=dev) if i % 2 else None
            shape = {"ag": (w * m_loc, n), "rs": (m_loc, n), "ar": (w * m_loc, n)}[op]
            out = nans(*shape, dtype=dtype, device=dev)
            c = ctx(a, b, bias=bias, out=out)
            sync(group)
            ref = _reference(op, a, b, bias, group, m_loc)
            assert c.data_ptr() == out.data_ptr()
            assert rel_err(c, ref) < TOL, (op, strategy, i, rel_err(c, ref))
        ctx.check()
        replayed = [g for g in ctx._graphs.values() if not isinstance(g, str)]
        assert replayed, f"{op} {strategy}: no call was replayed from a graph: {ctx._graphs}"
    finally:
        ctx.close()
    return True


@pytest.mark.gpu
@pytest.mark.parametrize(
    "op, strategy",
    [("ag", "fused"), ("rs", "fused"), ("rs", "ce_fused"), ("ar", "fused"), ("ar", "ce_fused")],
)
@pytest.mark.parametrize("size", [1, *GPU_SIZES])
def test_eager_graphs(op, strategy, size):
    from tests.conftest import get_world

    get_world("cuda", size).run(_eager_graph_body, op, strategy)


def _reference(op, a, b, bias, group, m_loc):
    """float32 reference of one AG+GEMM / GEMM+RS / GEMM+AR call."""
    if op == "ag":
        ref = gathered(a, group).float() @ b.float()
    else:
        ref = reduced(a.float() @ b.float(), group)
        if op == "rs":
            ref = ref[group.rank * m_loc : (group.rank + 1) * m_loc]
    return ref if bias is None else ref + bias.float()


def _replayed_body(group, op, strategy):
    """Eager calls that replay their graph directly (``OpContext._armed``): with fresh
    inputs each call, every result against the float32 reference (GEMM+AR's the context's
    own result buffer), all but each buffer set's first two calls replayed directly; then
    calls that leave the short path, each still right: a bias (a new kind), ``out=`` given
    (a fresh NaN-filled one each call: its key holds ``out``'s, then each replay re-points
    the graph), fewer rows (a new kind), a call captured in a user's CUDA graph."""
    w, dev, dtype = group.world_size, group.device, torch.bfloat16
    m_loc, n, k = 256, 384, 256
    gen = torch.Generator().manual_seed(7 + group.rank)
    bias = rand(torch.Generator().manual_seed(3), n, dtype=dtype, device=dev)
    cls = {"ag": interlace.AGGemm, "rs": interlace.GemmRS, "ar": interlace.GemmAR}[op]
    ctx = cls(group, w * m_loc, n, k, strategy=strategy)
    with ctx, counting(ctx, "_replay") as replayed:
        b = rand(gen, k, n, dtype=dtype, device=dev, scale=0.2)

        def calls(count, m=m_loc, **kw):
            before, sets = len(replayed), set()
            for _ in range(count):
                a = rand(gen, m if op == "ag" else w * m, k, dtype=dtype, device=dev)
                sets.add(ctx._next_set)
                c = ctx(a, b, **{key: v() if callable(v) else v for key, v in kw.items()})
                sync(group)
                err = rel_err(c, _reference(op, a, b, kw.get("bias"), group, m))
                assert err < TOL, (op, strategy, err)
                if op == "ar" and "out" not in kw:
                    assert c.data_ptr() == ctx.result.local.data_ptr()
            return len(replayed) - before, 2 * len(sets)

        got, whole = calls(8)
        assert got == 8 - whole > 0, (got, whole)
        got, whole = calls(6, bias=bias)
        assert got == 6 - whole, (got, whole)
        shape = (m_loc, n) if op == "rs" else (w * m_loc, n)
        got, whole = calls(6, out=lambda: nans(*shape, dtype=dtype, device=dev))
        # each set's first call with out= goes the whole way (replaying the graph of the
        # calls without it and arming the key with out's), GEMM+AR's first two (its graph
        # with out= also copies the result into it: another kind)
        assert got == 6 - (whole if op == "ar" else whole // 2), (got, whole)
        got, whole = calls(6, m=m_loc - 64)
        assert got == 6 - whole, (got, whole)
        a = rand(gen, m_loc if op == "ag" else w * m_loc, k, dtype=dtype, device=dev)
        graph, c = capture(lambda: ctx(a, b))
        replay(graph, c)
        assert rel_err(c, _reference(op, a, b, None, group, m_loc)) < TOL
        # after a capture the call slot's fields are the graph's: the next call goes the
        # whole way (rewriting them), every call after it replays directly
        assert calls(6)[0] == 5
        ctx.check()
    return True


@pytest.mark.gpu
@pytest.mark.parametrize(
    "op, strategy",
    [("ag", "fused"), ("rs", "fused"), ("rs", "ce_fused"), ("ar", "fused"), ("ar", "ce_fused")],
)
def test_replayed_calls(world, op, strategy):
    run_on_gpus(world, _replayed_body, op, strategy, why="eager graphs need a GPU")


class _CopyingGraph:
    """Stands in for ``EagerGraph`` on the CPU backend: the "capture" runs the call (the
    interpreter cannot defer it) and a replay copies the new inputs into the captured
    operands, runs the captured call again and copies its output back, so the results
    show whether ``_enqueue`` replays the right capture with the right operands."""

    made = 0

    def __init__(self, run, operands):
        _CopyingGraph.made += 1
        self.run, self.operands, self.fresh = run, operands, True
        run()

    def launch(self, operands, ptrs=None):
        if self.fresh:  # the capture's own call: it ran in __init__
            self.fresh = False
            return
        for held, new in zip(self.operands[:-1], operands[:-1]):
            if held is not None:
                held.copy_(new)
        self.run()
        operands[-1].copy_(self.operands[-1])


def _eager_graph_logic_body(group, op, strategy):
    from interlace.runtime import graphs

    real, graphs.EagerGraph = graphs.EagerGraph, _CopyingGraph  # this rank's process only
    try:
        return _eager_graph_logic_calls(group, op, strategy)
    finally:
        graphs.EagerGraph = real


def _eager_graph_logic_calls(group, op, strategy):
    _CopyingGraph.made = 0
    w = group.world_size
    cls = {"ag": interlace.AGGemm, "rs": interlace.GemmRS, "ar": interlace.GemmAR}[op]
    m_loc, n, k = 37, 40, 24
    ctx = cls(group, w * m_loc, n, k, strategy=strategy)
    assert ctx.eager_graphs is False  # no graphs on the CPU backend, whatever the default
    ctx.eager_graphs = True  # the logic is what is tested here
    gen = torch.Generator().manual_seed(11 + group.rank)
    bgen = torch.Generator().manual_seed(3)  # a bias is the same on every rank
    sets = []
    try:
        b = rand(gen, k, n, dtype=torch.bfloat16, device=group.device, scale=0.2)
        for i in range(6):
            rows = m_loc if op == "ag" else w * m_loc
            a = rand(gen, rows, k, dtype=torch.bfloat16, device=group.device)
            bias = rand(bgen, n, dtype=torch.bfloat16, device=group.device) if i % 2 else None
            shape = (m_loc, n) if op == "rs" else (w * m_loc, n)
            out = nans(*shape, dtype=torch.bfloat16, device=group.device)
            c = ctx(a, b, bias=bias, out=out)
            sets.append(getattr(ctx, "_next_set", None))
            ref = gathered(a, group).float() @ b.float() if op == "ag" else None
            if op != "ag":
                ref = reduced(a.float() @ b.float(), group)
                ref = ref[group.rank * m_loc : (group.rank + 1) * m_loc] if op == "rs" else ref
            if bias is not None:
                ref += bias.float()
            assert rel_err(c, ref) < TOL, (op, strategy, i)
        kinds = {key: type(g).__name__ for key, g in ctx._graphs.items()}
    finally:
        ctx.close()
    return _CopyingGraph.made, sets, kinds


@pytest.mark.parametrize("op, strategy", [("ag", "fused"), ("rs", "ce_fused"), ("ar", "ce_fused")])
def test_eager_graph_logic(op, strategy):
    """``_enqueue``: each kind of call (strategy, buffer set, operand shapes) runs eagerly
    once, is captured on its second call and replayed after; buffer sets alternate as in
    eager calls; every result right (CPU backend, ``EagerGraph`` replaced by a copying
    stand-in)."""
    from tests.conftest import get_world

    for made, sets, kinds in get_world("cpu", 2).run(_eager_graph_logic_body, op, strategy):
        # six calls, two kinds (bias or not; the buffer set follows the call's parity, so
        # with alternating sets the two coincide): each kind eager, captured, replayed
        assert made == 2, kinds
        assert set(kinds.values()) == {"_CopyingGraph"}
        if sets[0] is not None:
            assert sets == [1, 0, 1, 0, 1, 0]


# ----------------------------------------------------------------------------- 8 ranks
def _eight_rank_body(group):
    _ag_body(group, "fused", "bf16", 1)
    _scatter_body(group, "rs", "fused", "bf16", 1, None)
    _scatter_body(group, "rs", "ring", "bf16", 1, None)
    _scatter_body(group, "ar", "fused", "bf16", 1, None)
    _scatter_body(group, "rs", "ce_fused", "bf16", 1, None)
    _scatter_body(group, "ar", "ce_fused", "bf16", 1, None)
    return True


def test_eight_ranks_cpu_emulation():
    """Nothing is hard-coded for 2 or 4 ranks: the overlapped GEMMs with 8 (TP 8)."""
    from tests.conftest import get_world

    get_world("cpu", 8).run(_eight_rank_body)
