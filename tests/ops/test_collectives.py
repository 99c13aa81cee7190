"""Standalone collectives against torch.distributed, on every method, with ragged sizes,
repeated calls, poisoned outputs, bad inputs and (on GPUs) CUDA-graph replay."""

from __future__ import annotations

import time

import pytest
import torch

import interlace
from interlace.errors import InterlaceTypeError, InterlaceValueError, WaitTimeoutError
from interlace.runtime.graphs import EagerGraph
from tests.ops._helpers import (
    capture,
    counting,
    gathered,
    reduced,
    rel_err,
    replay,
    run_on_gpus,
    sync,
)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _poison(t):
    return t.fill_(float("nan"))


# ----------------------------------------------------------------------------- all-gather
def _all_gather_body(group, method, dtype_name, rows, cols, calls):
    dtype = DTYPES[dtype_name]
    ctx = interlace.AllGather(group, max_numel=max(rows) * cols, dtype=dtype, method=method)
    gen = torch.Generator().manual_seed(1000 + group.rank)
    try:
        for i in range(calls):
            n = rows[i % len(rows)]
            x = torch.randn(n, cols, generator=gen).to(dtype).to(group.device)
            use_out = i % 2 == 1
            out = _poison(torch.empty(group.world_size * n, cols, dtype=dtype, device=group.device))
            y = ctx(x, out=out) if use_out else ctx(x)
            sync(group)
            ref = gathered(x, group)
            assert y.shape == ref.shape, (y.shape, ref.shape)
            assert torch.equal(y, ref), f"call {i}: all-gather differs from torch.distributed"
            if use_out:
                assert y.data_ptr() == out.data_ptr()
    finally:
        ctx.close()
    return True


@pytest.mark.parametrize("method", interlace.AllGather.METHODS)
def test_all_gather_matches_torch(world, method):
    # ragged: rows not multiples of anything; repeated calls with varying sizes
    world.run(_all_gather_body, method, "bf16", [37, 5, 64], 33, 4)


def test_all_gather_fp32(world):
    world.run(_all_gather_body, "ce_push", "fp32", [9], 7, 2)


# ----------------------------------------------------------------------------- reduce-scatter
def _reduce_scatter_body(group, method, dtype_name, rows, cols, calls, pieces):
    dtype = DTYPES[dtype_name]
    w = group.world_size
    ctx = interlace.ReduceScatter(
        group, max_numel=max(rows) * cols, dtype=dtype, method=method, pieces=pieces
    )
    gen = torch.Generator().manual_seed(2000 + group.rank)
    try:
        for i in range(calls):
            m = rows[i % len(rows)]
            x = torch.randn(w * m, cols, generator=gen).to(dtype).to(group.device)
            out = _poison(torch.empty(m, cols, dtype=dtype, device=group.device))
            y = ctx(x, out=out) if i % 2 else ctx(x)
            sync(group)
            ref = reduced(x, group)[group.rank * m : (group.rank + 1) * m]
            assert y.shape == ref.shape
            assert not torch.isnan(y).any(), f"call {i}: unwritten output"
            err = rel_err(y, ref)
            assert err <= (1e-2 if dtype == torch.bfloat16 else 1e-5), f"call {i}: rel err {err}"
    finally:
        ctx.close()
    return True


@pytest.mark.parametrize(
    "method,pieces", [("ce_scatter", 3), ("ce_scatter", None), ("sm_pull", None)]
)
def test_reduce_scatter_matches_torch(world, method, pieces):
    world.run(_reduce_scatter_body, method, "bf16", [1500, 77], 3, 3, pieces)


def test_reduce_scatter_fp32(world):
    world.run(_reduce_scatter_body, "ce_scatter", "fp32", [50], 5, 2, 2)


# ----------------------------------------------------------------------------- back to back
def _back_to_back_body(group, calls):
    """Calls issued without any synchronisation, the ranks pushed out of step by device
    sleeps of different lengths before some calls: the copy-engine methods run without a
    device barrier when eager (alternating buffer sets), so a rank that runs ahead must
    still never overwrite data a peer has not consumed."""
    w, r, dev = group.world_size, group.rank, group.device
    rows, cols = 96, 40
    ag = interlace.AllGather(group, max_numel=rows * cols, dtype=torch.bfloat16)
    rs = interlace.ReduceScatter(group, max_numel=rows * cols, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(4000 + r)
    xs_ag = [torch.randn(rows, cols, generator=gen).bfloat16().to(dev) for _ in range(calls)]
    xs_rs = [torch.randn(w * rows, cols, generator=gen).bfloat16().to(dev) for _ in range(calls)]

    def lag(i):  # this rank falls behind its peers here on some calls
        if (i + r) % 3 == 0:
            if group.backend == "cuda":
                torch.cuda._sleep(200_000 * (1 + (i * (r + 1)) % 4))  # 0.1-0.4 ms
            else:
                time.sleep(0.05)

    try:
        ys_ag, ys_rs = [], []
        for i in range(calls):
            lag(i)
            y = ag(xs_ag[i])  # a view of the context's buffer: valid until the next call
            lag(i + 1)  # ... even while peers run ahead into that call
            ys_ag.append(y.clone())
        for i in range(calls):
            lag(i)
            ys_rs.append(rs(xs_rs[i]))
        sync(group)
        for i in range(calls):
            assert torch.equal(ys_ag[i], gathered(xs_ag[i], group)), f"all-gather call {i}"
            ref = reduced(xs_rs[i], group)[r * rows : (r + 1) * rows]
            assert rel_err(ys_rs[i], ref) < 1e-2, f"reduce-scatter call {i}"
        if group.backend == "cuda":  # later calls replayed graphs (one per buffer set)
            for ctx in (ag, rs):
                replayed = [g for g in ctx._graphs.values() if isinstance(g, EagerGraph)]
                assert len(replayed) == 2, (ctx.op_name, ctx._graphs)
    finally:
        ag.close()
        rs.close()
    return True


def test_back_to_back_calls_with_ranks_out_of_step(world):
    world.run(_back_to_back_body, 12)


# ----------------------------------------------------------------------------- all-reduce
def _all_reduce_body(group, method, dtype_name, shapes, calls):
    dtype = DTYPES[dtype_name]
    cap = max(a * b for a, b in shapes)
    ctx = interlace.AllReduce(group, max_numel=cap, dtype=dtype, method=method)
    gen = torch.Generator().manual_seed(3000 + group.rank)
    results = []
    try:
        for i in range(calls):
            shape = shapes[i % len(shapes)]
            x = torch.randn(*shape, generator=gen).to(dtype).to(group.device)
            out = _poison(torch.empty(shape, dtype=dtype, device=group.device))
            y = ctx(x, out=out) if i % 2 else ctx(x)
            sync(group)
            err = rel_err(y, reduced(x, group))
            assert err <= (1e-2 if dtype == torch.bfloat16 else 1e-5), f"call {i}: rel err {err}"
            results.append(y.float().cpu())
    finally:
        ctx.close()
    return results


@pytest.mark.parametrize("method", interlace.AllReduce.METHODS)
def test_all_reduce_matches_torch_and_is_identical_on_every_rank(world, method):
    per_rank = world.run(_all_reduce_body, method, "bf16", [(13, 29), (3, 1), (40, 8)], 3)
    for r in range(1, len(per_rank)):
        for a, b in zip(per_rank[0], per_rank[r]):
            assert torch.equal(a, b), "all-reduce results differ between ranks"


# ----------------------------------------------------------------------------- bad inputs
def _bad_inputs_body(group):
    dev, w = group.device, group.world_size
    ag = interlace.AllGather(group, max_numel=64, dtype=torch.bfloat16)
    rs = interlace.ReduceScatter(group, max_numel=64, dtype=torch.bfloat16)
    raised = []

    def expect(exc, fn, *args, **kwargs):
        with pytest.raises(exc) as info:
            fn(*args, **kwargs)
        raised.append(type(info.value).__name__)
        return str(info.value)

    good = torch.randn(4, 4, device=dev).to(torch.bfloat16)
    msg = expect(InterlaceTypeError, ag, good.float())
    assert "dtype" in msg and "x" in msg
    msg = expect(InterlaceValueError, ag, torch.empty(4, 4, dtype=torch.bfloat16, device="meta"))
    assert "device" in msg or "is on" in msg
    msg = expect(InterlaceValueError, ag, torch.randn(4, 8, device=dev).to(torch.bfloat16)[:, ::2])
    assert "contiguous" in msg
    msg = expect(InterlaceValueError, ag, torch.randn(100, device=dev).to(torch.bfloat16))
    assert "capacity" in msg
    msg = expect(
        InterlaceValueError, ag, good, out=torch.empty(3, 4, dtype=torch.bfloat16, device=dev)
    )
    assert "out" in msg and "shape" in msg
    expect(InterlaceTypeError, ag, "not a tensor")
    msg = expect(InterlaceValueError, rs, torch.randn(w * 2 + 1, device=dev).to(torch.bfloat16))
    assert "divisible" in msg
    expect(InterlaceValueError, interlace.AllGather, group, 64, torch.bfloat16, method="nope")
    expect(InterlaceTypeError, interlace.AllGather, group, 64, torch.int64)
    msg = expect(InterlaceValueError, interlace.AllReduce, group, 0, torch.bfloat16)
    assert "max_numel" in msg
    expect(InterlaceValueError, interlace.ReduceScatter, group, 64, torch.bfloat16, pieces=0)
    # The contexts still work after rejecting bad input: nothing was launched.
    y = ag(good)
    sync(group)
    assert torch.equal(y, gathered(good, group))
    ag.close()
    rs.close()
    with pytest.raises(interlace.InterlaceError):
        ag(good)
    return raised


def test_bad_inputs_raise_on_every_rank(world):
    per_rank = world.run(_bad_inputs_body)
    assert all(r == per_rank[0] for r in per_rank)


def _one_rank_misbehaves_body(group):
    """Rank 0 passes a bad shape (and raises before launching); the others enter the op and
    must get a WaitTimeoutError naming the rank and the signal instead of hanging. Rank 0's
    bad call comes first (a host barrier orders it): called later, it would find the
    peers' recorded timeout and raise that instead, as every call of a failed group does."""
    ctx = interlace.AllGather(group, max_numel=16, dtype=torch.float32, max_spins=2000)
    x = torch.randn(4, device=group.device)
    try:
        if group.rank == 0:
            with pytest.raises(InterlaceValueError):
                ctx(torch.randn(17, device=group.device))
        group.host_barrier()
        if group.rank == 0:
            return "value-error"
        with pytest.raises(WaitTimeoutError) as info:
            ctx(x)
            ctx.check()
        msg = str(info.value)
        # no barrier in an eager call: the wait for rank 0's shard gives up
        assert f"rank {group.rank}" in msg and "arrival[0]" in msg and "all_gather" in msg, msg
        return "timeout"
    finally:
        group.host_barrier()
        ctx.close()


def test_one_bad_rank_gives_timeout_errors_not_a_hang(world):
    assert world.run(_one_rank_misbehaves_body) == ["value-error"] + ["timeout"] * (
        world.world_size - 1
    )


# ----------------------------------------------------------------------------- lifecycle
def _many_contexts_body(group, count):
    from interlace.runtime import symmetric

    def used():
        if group.backend == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def cycle():
        with interlace.ReduceScatter(group, max_numel=1 << 16, dtype=torch.bfloat16) as ctx:
            ctx(torch.randn(group.world_size * 8, device=group.device).to(torch.bfloat16))

    for _ in range(3):  # warm-up: compile kernels, create streams
        cycle()
    baseline_buffers = len(symmetric._open_buffers)
    before = used()
    for _ in range(count):
        cycle()
    growth = used() - before
    assert len(symmetric._open_buffers) == baseline_buffers
    assert growth < 32 << 20, f"memory grew by {growth / 2**20:.1f} MiB over {count} contexts"
    return growth


@pytest.mark.own_gpu
def test_hundred_contexts_do_not_grow_memory(world):
    world.run(_many_contexts_body, 100 if world.backend == "cuda" else 30)


# ----------------------------------------------------------------------------- CUDA graphs
def _replayed_body(group, op, method):
    """Eager calls that replay their graph directly (``OpContext._armed``): fresh inputs
    each call (all-gather ``ce_push``: the result a view of the context's buffer of the
    call's set), every result against torch.distributed's, all but each buffer set's first
    two calls replayed directly; then other rows (a new kind), a fresh poisoned ``out=``
    each call (reduce-scatter, all-reduce: each set's first call goes the whole way and
    arms a key with ``out``'s, the rest replay into their ``out``; all-gather copies into
    ``out`` outside its graph: the whole way), and the short path again."""
    w, dev, dtype = group.world_size, group.device, torch.bfloat16
    cls = {"ag": interlace.AllGather, "rs": interlace.ReduceScatter, "ar": interlace.AllReduce}
    cols, rows = 24, 8 * w
    gen = torch.Generator().manual_seed(50 + group.rank)

    def reference(x):
        if op == "ag":
            return gathered(x, group)
        ref = reduced(x, group)
        m = x.shape[0] // w
        return ref[group.rank * m : (group.rank + 1) * m] if op == "rs" else ref

    def shape_of(n):
        return {"ag": (w * n, cols), "rs": (n // w, cols), "ar": (n, cols)}[op]

    ctx = cls[op](group, max_numel=rows * cols, dtype=dtype, method=method)
    with ctx, counting(ctx, "_replay") as replayed:

        def calls(count, n=rows, out=False):
            before, sets = len(replayed), set()
            for _ in range(count):
                x = torch.randn(n, cols, generator=gen).to(dtype).to(dev)
                sets.add(ctx._next_set)
                given = _poison(torch.empty(shape_of(n), dtype=dtype, device=dev)) if out else None
                y = ctx(x, out=given)
                sync(group)
                assert rel_err(y, reference(x)) < 1e-2, (op, method)
            return len(replayed) - before, 2 * len(sets)

        got, whole = calls(6)
        assert got == 6 - whole > 0, (got, whole)
        got, whole = calls(6, n=rows // 2)
        assert got == 6 - whole, (got, whole)
        got, whole = calls(6, out=True)
        assert got == (0 if op == "ag" else 6 - whole // 2), (got, whole)
        assert calls(3)[0] == 3
        ctx.check()
    return True


@pytest.mark.gpu
@pytest.mark.parametrize(
    "op, method",
    [("ag", m) for m in interlace.AllGather.METHODS]
    + [("rs", m) for m in interlace.ReduceScatter.METHODS]
    + [("ar", m) for m in interlace.AllReduce.METHODS],
)
def test_replayed_calls(world, op, method):
    run_on_gpus(world, _replayed_body, op, method, why="eager graphs need a GPU")


def _graph_body(group):
    w, dtype = group.world_size, torch.bfloat16
    ag = interlace.AllGather(group, max_numel=4096 * 3, dtype=dtype)
    rs = interlace.ReduceScatter(group, max_numel=4096, dtype=dtype, pieces=2)
    ar = interlace.AllReduce(group, max_numel=5000, dtype=dtype)
    x_ag = torch.randn(4096, 3, device=group.device).to(dtype)
    x_rs = torch.randn(w * 4096, device=group.device).to(dtype)
    x_ar = torch.randn(5000, device=group.device).to(dtype)
    out_ag = torch.empty(w * 4096, 3, device=group.device, dtype=dtype)

    def call():
        ag(x_ag, out=out_ag)
        return rs(x_rs), ar(x_ar)

    graph, (y_rs, y_ar) = capture(call, side_stream=True)  # warm-up (compiles) on a side stream
    for step in range(4):
        for t in (x_ag, x_rs, x_ar):
            t.copy_(torch.randn(t.shape, device=group.device).to(dtype))
        replay(graph, out_ag, y_rs, y_ar)
        assert torch.equal(out_ag, gathered(x_ag, group)), f"replay {step}: all-gather"
        ref_rs = reduced(x_rs, group)[group.rank * 4096 : (group.rank + 1) * 4096]
        assert rel_err(y_rs, ref_rs) < 1e-2, f"replay {step}: reduce-scatter"
        assert rel_err(y_ar, reduced(x_ar, group)) < 1e-2, f"replay {step}: all-reduce"
    for ctx in (ag, rs, ar):
        ctx.check()
        ctx.close()
    return True


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay(world):
    run_on_gpus(world, _graph_body, why="CUDA graphs need the cuda backend")


# ----------------------------------------------------------------------------- 8 ranks
def _eight_rank_body(group):
    _all_gather_body(group, "ce_push", "bf16", [13], 5, 2)
    _reduce_scatter_body(group, "ce_scatter", "bf16", [16 * 2048 + 5], 1, 3, 16)  # 8 x 16 flags
    _all_reduce_body(group, "two_shot", "bf16", [(9, 7)], 2)
    return True


def test_eight_ranks_cpu_emulation():
    """Nothing is hard-coded for 4 ranks: the collectives with 8 (CPU emulation)."""
    from tests.conftest import get_world

    get_world("cpu", 8).run(_eight_rank_body)


# ----------------------------------------------------------------------------- zero-copy input
def _input_buffer_body(group):
    w, dev, dtype = group.world_size, group.device, torch.bfloat16
    gen = torch.Generator().manual_seed(4000 + group.rank)
    contexts = [
        interlace.AllGather(group, 30 * w, dtype, method="sm_pull"),
        interlace.ReduceScatter(group, 30, dtype, method="sm_pull"),
        interlace.AllReduce(group, 30 * w, dtype, method="one_shot"),
        interlace.ReduceScatter(group, 30, dtype, method="ce_scatter"),  # no staging
    ]
    try:
        for _ in range(2):
            for ctx in contexts:
                buf = ctx.input_buffer((w * 6, 5))
                buf.copy_(torch.randn(w * 6, 5, generator=gen).to(dtype).to(dev))
                expected = buf.clone()
                y = ctx(buf)
                sync(group)
                if ctx.op_name == "all_gather":
                    assert torch.equal(y, gathered(expected, group))
                    continue
                ref = reduced(expected, group)
                if ctx.op_name == "reduce_scatter":
                    ref = ref[group.rank * 6 : (group.rank + 1) * 6]
                assert rel_err(y, ref) <= 1e-2, ctx.op_name
        if hasattr(contexts[0], "staging"):
            assert contexts[0].input_buffer((4,)).data_ptr() == contexts[0].staging.local.data_ptr()
        with pytest.raises(InterlaceValueError, match="input_buffer"):
            contexts[0].input_buffer((30 * w + 1,))
    finally:
        for ctx in contexts:
            ctx.close()
    return True


def test_input_buffer_is_read_without_copy(world):
    world.run(_input_buffer_body)
