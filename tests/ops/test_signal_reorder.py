"""The ``signal_reorder`` strategy (FlashOverlap): mapping tables and partitions on the
host, then GEMM + all-reduce / reduce-scatter / all-to-all against float32 references built
with torch.distributed (ragged shapes, TMA and plain loads, bias, fused RMSNorm, poisoned
outputs, repeated calls with varying M and partitions, counters back at zero), bad inputs,
and on GPUs CUDA-graph replay and the kernel's software pipelining."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from interlace.errors import InterlaceError, InterlaceTypeError, InterlaceValueError
from interlace.ops.signal_reorder import (
    MAX_GROUPS,
    Layout,
    SignalReorderGemmA2A,
    SignalReorderGemmAR,
    SignalReorderGemmRS,
    check_partition,
    default_partition,
    mapping_tables,
    rms_norm,
    strips_for,
    tile_coords,
    wave_groups,
)
from tests.conftest import GPU_SIZES
from tests.ops._helpers import check_graph_replays, expect_error, nans, rand, rel_err, sync

CLASSES = {"ar": SignalReorderGemmAR, "rs": SignalReorderGemmRS, "a2a": SignalReorderGemmA2A}
OP_NAMES = {"ar": "all_reduce", "rs": "reduce_scatter", "a2a": "all_to_all"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOL = 1e-2
EPS = 1e-6


# ----------------------------------------------------------------------------- host tables
@pytest.mark.parametrize("tiles_m,tiles_n,group_m", [(1, 1, 8), (3, 2, 2), (7, 5, 2), (9, 4, 8)])
def test_tile_coords_visit_every_tile_once(tiles_m, tiles_n, group_m):
    seen = [tile_coords(t, tiles_m, tiles_n, group_m) for t in range(tiles_m * tiles_n)]
    assert sorted(seen) == list(itertools.product(range(tiles_m), range(tiles_n)))
    # grouped order: the first group_m row blocks are finished before the next start
    first = seen[: min(group_m, tiles_m) * tiles_n]
    assert {pm for pm, _ in first} == set(range(min(group_m, tiles_m)))


def _layouts():
    for op, world, m, n, programs in [
        ("all_reduce", 2, 70, 40, 3),
        ("all_reduce", 4, 33, 100, 5),
        ("reduce_scatter", 2, 74, 40, 2),
        ("reduce_scatter", 3, 111, 33, 4),
        ("reduce_scatter", 4, 148, 70, 3),
        ("all_to_all", 3, 27, 64, 2),
        ("all_to_all", 4, 36, 40, 7),
    ]:
        yield Layout(op, m, n, world, 32, 32, programs)


@pytest.mark.parametrize("lay", list(_layouts()), ids=lambda lay: f"{lay.op}-w{lay.world}")
def test_mapping_tables(lay):
    """Every stored unit has one place; each group's units are one contiguous range; for
    sub-tiles, pool k of a group holds strips of share k only; the row kernel's table points
    at the unit where each (row block, column tile) lands after the collective."""
    assert lay.strips == strips_for(lay.op, lay.world)
    assert lay.strips * lay.sub_m == 32 and lay.strips >= (1 if lay.op == "all_reduce" else 2)
    for partition in {tuple(default_partition(lay.n_waves)), (lay.n_waves,)}:
        groups = wave_groups(partition, lay.n_tiles, lay.programs)
        assert sum(c for _, c in groups) == lay.n_tiles
        tile_map, slots = mapping_tables(lay, groups, group_m=2)
        where = {}  # unit -> (tile, strip)
        for g, (slot, stride, gid) in enumerate(tile_map):
            first, count = groups[gid]
            assert first <= g < first + count
            for k in range(lay.parts):
                unit = slot + k * stride
                assert unit not in where
                where[unit] = (g, k)
                lo = first * lay.parts
                assert lo <= unit < lo + count * lay.parts  # inside its group's range
                if lay.parts > 1:
                    assert lo + k * count <= unit < lo + (k + 1) * count  # pool k
        assert sorted(where) == list(range(lay.n_tiles * lay.parts))
        assert len(slots) == lay.sources * lay.tiles_m
        for blk, row in enumerate(slots):
            src, pid_m = divmod(blk, lay.tiles_m)
            for pid_n, unit in enumerate(row):
                g = next(
                    t
                    for t in range(lay.n_tiles)
                    if tile_coords(t, lay.tiles_m, lay.tiles_n, 2) == (pid_m, pid_n)
                )
                if lay.op == "all_to_all":  # received where source `src` sent its pool
                    assert where[unit] == (g, src)
                else:
                    assert unit == g


def test_partitions_and_groups():
    for n in range(1, 20):
        p = default_partition(n)
        assert sum(p) == n and min(p) >= 1
        if n >= 3:
            assert p[0] == 1 and p[-1] == 1
    assert wave_groups([1, 2, 1], n_tiles=10, programs=3) == [(0, 3), (3, 6), (9, 1)]
    assert check_partition([2, 1], 3) == (2, 1)
    for bad, exc in [
        ([2, 2], InterlaceValueError),
        ([0, 3], InterlaceValueError),
        ([], InterlaceValueError),
        ("xy", InterlaceTypeError),
        ([1] * (MAX_GROUPS + 1), InterlaceValueError),
    ]:
        with pytest.raises(exc, match="partition"):
            check_partition(bad, 3 if len(bad) <= 3 else len(bad))


# ----------------------------------------------------------------------------- rank bodies
def _norm_ref(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.float()


def _reference(group, op, a, b, bias):
    """The op in float32 from this rank's data."""
    w, r = group.world_size, group.rank
    c = a.float() @ b.float()
    if op == "a2a":
        if bias is not None:
            c += bias.float()
        out = torch.empty_like(c)
        dist.all_to_all_single(out, c)
        return out
    dist.all_reduce(c)
    if bias is not None:
        c += bias.float()
    return c.chunk(w)[r].contiguous() if op == "rs" else c


def _shapes(group):
    """(rows per rank, n, k): ragged rows; TMA-aligned and unaligned n / k."""
    if group.backend == "cuda":
        return [(300, 520, 264), (520, 200, 72), (700, 33, 20)]
    return [(37, 40, 24), (21, 33, 20)]


def _gpu_programs_kw(group):
    """On a GPU, few GEMM programs (many SMs left free) so small shapes have many waves."""
    if group.backend != "cuda":
        return {}
    from interlace.ops._context import sm_count

    return {"comm_sms": sm_count(group.device.index) - 6}


def _op_body(group, op, dtype_name):
    dtype, w, dev = DTYPES[dtype_name], group.world_size, group.device
    gen = torch.Generator().manual_seed(17 + group.rank)
    shared = torch.Generator().manual_seed(5)  # bias and norm weight: the same on all ranks
    overlapped = 0
    for m_loc, n, k in _shapes(group):
        kw = _gpu_programs_kw(group)
        ctx = CLASSES[op](group, max_m=w * (m_loc + 1), n=n + 3, k=k, dtype=dtype, **kw)
        try:
            for i in range(4):
                m = w * (m_loc if i % 2 == 0 else m_loc // 2 + 1)
                if op == "ar" and i == 2:
                    m += 1  # all-reduce takes any M
                waves = ctx.waves(m, n)
                partition = [None, [1] * waves, [waves], None][i]
                a = rand(gen, m, k, dtype=dtype, device=dev)
                b = rand(gen, k, n, dtype=dtype, device=dev, scale=0.2)
                bias = rand(shared, n, dtype=dtype, device=dev) if i in (0, 2) else None
                weight = rand(shared, n, dtype=dtype, device=dev).abs() if i % 2 else None
                ref = _reference(group, op, a, b, bias)
                if weight is not None:
                    ref = _norm_ref(ref, weight)
                out = None
                if i < 2:
                    out = nans(*ref.shape, dtype=dtype, device=dev)
                y = ctx(a, b, bias=bias, out=out, norm_weight=weight, partition=partition)
                sync(group)
                what = f"{op} {(m, n, k)} call {i} partition {ctx.last_partition}"
                assert y.shape == ref.shape, what
                err = rel_err(y, ref)
                assert err < TOL, f"{what}: rel err {err:.2e}"
                if out is not None:
                    assert y.data_ptr() == out.data_ptr()
                if partition is not None:
                    assert list(ctx.last_partition) == partition
                assert int(ctx.counters.abs().sum()) == 0, f"{what}: counters not reset"
                overlapped += len(ctx.last_partition) > 1
        finally:
            ctx.close()
    assert overlapped >= 2, "the shapes should exercise the overlapped path"
    return True


@pytest.mark.own_gpu  # the process group's collectives on CUDA tensors
@pytest.mark.parametrize("op", list(CLASSES))
def test_signal_reorder_matches_reference(world, op):
    world.run(_op_body, op, "bf16")


@pytest.mark.own_gpu  # the process group's collectives on CUDA tensors
def test_signal_reorder_fp16(world):
    world.run(_op_body, "ar", "fp16")


def _rmsnorm_body(group):
    """The plain row kernel (the baseline of the fused one) against torch, one and two
    passes."""
    gen = torch.Generator().manual_seed(3)
    for rows, n in [(5, 40), (3, 70000)]:
        x = rand(gen, rows, n, dtype=torch.bfloat16, device=group.device)
        w = rand(gen, n, dtype=torch.bfloat16, device=group.device)
        y = rms_norm(x, w, EPS)
        sync(group)
        assert rel_err(y, _norm_ref(x.float(), w)) < TOL
    return True


def test_rms_norm_kernel(world):
    world.run(_rmsnorm_body)


def _bad_inputs_body(group):
    w, dev, bf = group.world_size, group.device, torch.bfloat16
    ar = SignalReorderGemmAR(group, max_m=4 * w, n=16, k=8)
    rs = SignalReorderGemmRS(group, max_m=4 * w, n=16, k=8)
    try:
        a = torch.randn(4, 8, device=dev).to(bf)
        b = torch.randn(8, 16, device=dev).to(bf)
        cases = [
            (ar, (a.float(), b), {}, InterlaceTypeError, "bfloat16"),
            (ar, (torch.randn(4, 9, device=dev).to(bf), torch.randn(9, 16, device=dev).to(bf)),
             {}, InterlaceValueError, "k = 8"),
            (ar, (a, torch.randn(8, 17, device=dev).to(bf)), {}, InterlaceValueError, "n = 16"),
            (ar, (torch.randn(4 * w + 1, 8, device=dev).to(bf), b), {}, InterlaceValueError,
             "rows"),
            (ar, (a.t().contiguous().t(), b), {}, InterlaceValueError, "contiguous"),
            (ar, (a, b), {"norm_weight": torch.ones(15, device=dev).to(bf)},
             InterlaceValueError, "norm_weight"),
            (ar, (a, b), {"partition": [99]}, InterlaceValueError, "partition"),
            (ar, (a, b, torch.randn(15, device=dev).to(bf)), {}, InterlaceValueError, "bias"),
            (rs, (torch.randn(w + 1, 8, device=dev).to(bf), b), {}, InterlaceValueError,
             "multiple"),
        ]  # fmt: skip
        for ctx, args, kw, exc, text in cases:
            expect_error(exc, text, ctx, *args, **kw)
        for bad, exc in [
            (lambda: SignalReorderGemmRS(group, max_m=4 * w + 1, n=16, k=8), InterlaceValueError),
            (lambda: SignalReorderGemmAR(group, max_m=8, n=16, k=8, dtype=torch.float32),
             InterlaceTypeError),
            (lambda: SignalReorderGemmAR(group, max_m=0, n=16, k=8), InterlaceValueError),
            (lambda: SignalReorderGemmAR("group", max_m=8, n=16, k=8), InterlaceTypeError),
        ]:  # fmt: skip
            with pytest.raises(exc):
                bad()
        if group.backend == "cuda":
            with pytest.raises(InterlaceValueError, match="comm_sms"):
                SignalReorderGemmAR(group, max_m=8, n=16, k=8, comm_sms=0)
    finally:
        ar.close()
        rs.close()
    with pytest.raises(InterlaceError, match="closed"):
        ar(a, b)
    return True


def test_bad_inputs_raise_on_every_rank(world):
    world.run(_bad_inputs_body)


# ----------------------------------------------------------------------------- GPU only
def _graph_body(group, op):
    w, dev, dtype = group.world_size, group.device, torch.bfloat16
    m_loc, n, k = 384, 512, 256
    gen = torch.Generator().manual_seed(3 + group.rank)
    ctx = CLASSES[op](group, max_m=w * m_loc, n=n, k=k, **_gpu_programs_kw(group))
    a = rand(gen, w * m_loc, k, dtype=dtype, device=dev)
    b = rand(gen, k, n, dtype=dtype, device=dev, scale=0.2)
    try:
        assert len(ctx.partition_for(w * m_loc)) > 1
        check_graph_replays(ctx, a, b, gen, lambda a: _reference(group, op, a, b, None), TOL)
    finally:
        ctx.close()
    return True


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(CLASSES))
@pytest.mark.parametrize("size", GPU_SIZES)
def test_cuda_graph_replay(op, size):
    from tests.conftest import get_world

    get_world("cuda", size, own_gpu=True).run(_graph_body, op)


def _eager_graph_body(group, op):
    """``eager_graphs=True``: repeated eager calls with fresh inputs, new outputs, the
    fused RMSNorm on every other call; every result against the reference, and the
    overlapped calls end up replayed from graphs."""
    dev, dtype = group.device, torch.bfloat16
    m_loc, n, k = 384, 512, 256
    gen = torch.Generator().manual_seed(3 + group.rank)
    shared = torch.Generator().manual_seed(5)  # bias and norm weight: the same on all ranks
    kw = _gpu_programs_kw(group)
    m = 4 * m_loc  # several waves at any world size
    ctx = CLASSES[op](group, max_m=m, n=n, k=k, eager_graphs=True, **kw)
    try:
        assert len(ctx.partition_for(m)) > 1
        b = rand(gen, k, n, dtype=dtype, device=dev, scale=0.2)
        bias = rand(shared, n, dtype=dtype, device=dev)
        weight = rand(shared, n, dtype=dtype, device=dev).abs()
        for i in range(6):
            a = rand(gen, m, k, dtype=dtype, device=dev)
            norm = weight if i % 2 else None
            ref = _reference(group, op, a, b, bias)
            ref = _norm_ref(ref, norm) if norm is not None else ref
            out = nans(*ref.shape, dtype=dtype, device=dev)
            y = ctx(a, b, bias=bias, out=out, norm_weight=norm)
            sync(group)
            assert y.data_ptr() == out.data_ptr()
            assert rel_err(y, ref) < TOL, (op, i, rel_err(y, ref))
        ctx.check()
        assert any(not isinstance(g, str) for g in ctx._graphs.values()), ctx._graphs
    finally:
        ctx.close()
    return True


def _gloo_eager_graphs_body(group):
    """Ranks sharing a GPU: the collectives run on gloo, which a CUDA graph cannot capture,
    so eager calls are not graph-backed by default and ``eager_graphs=True`` raises."""
    assert group.shared_device
    ctx = SignalReorderGemmAR(group, max_m=256, n=128, k=64)
    try:
        assert not ctx.eager_graphs
    finally:
        ctx.close()
    expect_error(
        InterlaceValueError, "NCCL process group",
        SignalReorderGemmAR, group, max_m=256, n=128, k=64, eager_graphs=True,
    )  # fmt: skip
    return True


@pytest.mark.gpu
def test_eager_graphs_need_a_capturable_group():
    from interlace.testing import World

    with World(2, "cuda", timeout=120, share_device=True) as world:
        assert all(world.run(_gloo_eager_graphs_body))


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(CLASSES))
@pytest.mark.parametrize("size", [1, *GPU_SIZES])
def test_eager_graphs(op, size):
    from tests.conftest import get_world

    get_world("cuda", size, own_gpu=True).run(_eager_graph_body, op)


@pytest.mark.parametrize("strips", [1, 4])
def test_signal_gemm_is_software_pipelined(strips):
    """The per-tile counter release must not stop Triton from pipelining the persistent
    loop (a CTA barrier in it does, in Triton 3.6): the compiled loop keeps one wgmma in
    flight and prefetches both operands into shared memory. The all-reduce layout stores
    its tiles by TMA and each warp counts them (a ``red.release``); the strip layouts
    store with plain stores and every thread releases with its own atomic."""
    from interlace.testing.codegen import compile_for_hopper, cuda_compile_unavailable

    reason = cuda_compile_unavailable()
    if reason is not None:
        pytest.skip(reason)
    from interlace.kernels.signal_gemm import signal_gemm_kernel as kernel

    tma_store = strips == 1
    sig = {name: "i32" for name in kernel.arg_names}
    sig.update(a="*bf16", b="*bf16", buf="*bf16", bias="*bf16", tile_map="*i32",
               counters="*i32")  # fmt: skip
    consts = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, STRIPS=strips, USE_TMA=True,
                  HAS_BIAS=False, LANES=8 if tma_store else 256, SIGNAL=True,
                  TMA_STORE=tma_store, SUBTILE=False, TRACE=False, tbuf=None)  # fmt: skip
    for name in consts:
        sig.pop(name)
    out = compile_for_hopper(kernel, sig, consts, aligned=("a", "b", "buf", "N", "K",
                             "rows_per_rank"), num_warps=8, num_stages=3)  # fmt: skip
    ttgir, ptx = out["ttgir"], out["ptx"]
    tma = ttgir.count("ttng.async_tma_copy_global_to_local")  # prologue + loop
    gathers = ttgir.count("ttg.async_copy_global_to_local")
    if strips == 1:
        assert tma >= 4  # A and B by TMA
    else:
        assert tma >= 2 and gathers >= 2  # B by TMA, A's strips gathered by cp.async
    assert "pendings = 1" in ttgir  # one wgmma in flight while the next is issued
    if tma_store:
        assert "ttng.async_tma_copy_local_to_global" in ttgir
        assert "red.release.gpu.global.add" in ptx and "atom.global.gpu.release" not in ptx
    else:
        assert "atom.global.gpu.release.add" in ptx


# ----------------------------------------------------------------------------- benchmark
def test_bench_shape_table():
    from interlace.bench.signal_reorder import shapes

    table = shapes(4)
    assert len(table) == 6 and ("llama3-70b", 8192, 8192, 7168) in table
    assert ("llama-7b", 2048, 4096, 2752) in table
    assert shapes(2, ["llama3-8b"], [8192]) == [("llama3-8b", 8192, 4096, 7168)]


def test_bench_body_on_cpu(world):
    """The benchmark's CPU mode: one correctness record per shape, no timings (on GPUs the
    benchmark itself is the check)."""
    from interlace.bench.signal_reorder import run_signal_reorder_bench

    if world.backend != "cpu":
        pytest.skip("CPU mode of the benchmark")
    w = world.world_size
    recs = world.run(run_signal_reorder_bench, shape_list=[("tiny", 37 * w, 40, 24)])
    assert recs[0] == recs[-1]
    (rec,) = recs[0]
    assert rec["op"] == "gemm_ar" and rec["strategy"] == "signal_reorder" and rec["ok"]
    assert len(rec["partition"]) > 1 and rec["t_ms"] is None
