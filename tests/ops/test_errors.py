"""Cross-rank faults end in one clear error on every rank (issue 22).

Each fault body runs on every rank and returns what happened there: the error class, its
message and how long the failing call took. The tests assert that every rank raised (none
returned a result), that all raised the same class, within the time bound (a mismatch or
an abort long before it: it is detected, not waited out), and that the context then
refuses calls with ContextFailedError, closes idempotently and refuses calls after close.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import torch
import triton
import triton.language as tl

import interlace
from interlace.errors import (
    CallMismatchError,
    ContextClosedError,
    ContextFailedError,
    CrossRankError,
    InterlaceTypeError,
    InterlaceValueError,
    PeerAbortError,
    WaitTimeoutError,
)
from interlace.ops import library
from interlace.ops.attention import FlashDecode, SPAttention
from interlace.ops.ep import EPAllToAll, EPLowLatency, EPMoE
from interlace.ops.moe import AGMoE, MoERS
from interlace.runtime import signals, symmetric
from tests.conftest import GPU_SIZES

#: W = 2 and 3 on the CPU emulation; the GPU worlds (shared GPU where there is one)
PARAMS = [pytest.param(("cpu", w), id=f"cpu{w}") for w in (2, 3)] + [
    pytest.param(("cuda", w), id=f"cuda{w}", marks=pytest.mark.gpu) for w in GPU_SIZES
]
#: The CPU emulation only: the ops whose call checks exist on the CPU backend alone.
CPU_PARAMS = PARAMS[:2]
#: A bound no mismatch or abort may come near: they are detected, not timed out.
LONG_BOUND_US = 60_000_000
#: The bound of the timeout tests.
SHORT_BOUND_US = 1_000_000


def _outcome(ctx, fn):
    """Run ``fn()`` (a call, then ``ctx.check()`` for the asynchronous GPU backend) and
    return ``(error class name, message, seconds)``; ``("returned", ...)`` if it did not
    raise."""
    t0 = time.monotonic()
    try:
        fn()
        ctx.check()
    except CrossRankError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e), time.monotonic() - t0
    return "returned", "", time.monotonic() - t0


def _after_failure(ctx, call) -> list[str]:
    """A failed context refuses calls (every rank), then closes twice and refuses again."""
    seen = []
    try:
        call()
    except ContextFailedError as e:
        seen.append("refused" if "close() it and build a new one" in str(e) else str(e))
    ctx.close()
    ctx.close()  # idempotent
    try:
        call()
    except ContextClosedError:
        seen.append("closed")
    return seen


def _call_then_refused(group, ctx, call, late_s: float = 0.0):
    """``_outcome`` of the call on this rank (the last rank ``late_s`` later), then, once
    every rank is done, ``_after_failure``."""
    if group.rank == group.world_size - 1:
        time.sleep(late_s)
    out = _outcome(ctx, call)
    group.host_barrier()
    return (*out, _after_failure(ctx, call))


def _rand(group, *shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16).to(group.device)


def _check(results, cls, bound_s=None, text=()):
    names = [r[0] for r in results]
    assert all(n == cls.__name__ for n in names), "\n".join(
        f"rank {i}: {r[0]}: {r[1]}" for i, r in enumerate(results)
    )
    for _, msg, dt, *_ in results:
        for t in text:
            assert t in msg, (t, msg)
        if bound_s is not None:
            assert dt < bound_s, (dt, msg)


# --------------------------------------------------------------------------------------
# mismatched calls
# --------------------------------------------------------------------------------------


COLLECTIVES = {"all_gather": interlace.AllGather, "reduce_scatter": interlace.ReduceScatter,
               "all_reduce": interlace.AllReduce}  # fmt: skip


def _mismatch_body(group, op, strategy, field, late_s=0.0):
    """``late_s``: the last rank starts its call that much later, after its peers have
    found the difference."""
    w, r = group.world_size, group.rank
    k, n = 8, 16
    if op == "ag_gemm":
        ctx = interlace.AGGemm(group, max_m=4 * w, n=n, k=k, strategy=strategy,
                               max_spins=LONG_BOUND_US)  # fmt: skip
        m = 2 if r == 0 else 4  # gathered M = 2w on rank 0, 4w elsewhere
        a, b = _rand(group, m, k, seed=r), _rand(group, k, n, seed=9)
        call = lambda: ctx(a, b)  # noqa: E731
    elif op in COLLECTIVES:  # ``strategy``: the method; another length on rank 0
        ctx = COLLECTIVES[op](group, 8 * w, torch.bfloat16, method=strategy,
                              max_spins=LONG_BOUND_US)  # fmt: skip
        numel = (2 if r == 0 else 4) * (w if op == "reduce_scatter" else 1)
        x = _rand(group, numel, seed=r)
        call = lambda: ctx(x)  # noqa: E731
    else:
        cls = interlace.GemmRS if op == "gemm_rs" else interlace.GemmAR
        ctx = cls(group, max_m=4 * w, n=n, k=k, strategy=strategy, max_spins=LONG_BOUND_US)
        m = 2 * w if (r == 0 or field != "M") else 4 * w
        cols = n if (r == 0 or field != "N") else n - 2
        a, b = _rand(group, m, k, seed=r), _rand(group, k, cols, seed=9)
        call = lambda: ctx(a, b)  # noqa: E731
    return _call_then_refused(group, ctx, call, late_s)


@pytest.mark.parametrize("world", PARAMS, indirect=True)
@pytest.mark.parametrize(
    "op, strategy, field",
    [("ag_gemm", "fused", "M"), ("gemm_rs", "fused", "M"), ("gemm_ar", "fused", "N"),
     ("gemm_rs", "ce_fused", "M"), ("gemm_ar", "ce_fused", "N"), ("gemm_rs", "ce_scatter", "M"),
     ("gemm_ar", "ce_scatter", "M"), ("all_gather", "ce_push", "numel"),
     ("all_gather", "sm_pull", "numel"), ("reduce_scatter", "ce_scatter", "numel"),
     ("all_reduce", "two_shot", "numel")],
)  # fmt: skip
def test_mismatched_calls_raise_on_every_rank(world, op, strategy, field):
    """AG+GEMM with another M on rank 0 (silently wrong before), GEMM+RS with another M,
    GEMM+AR with another N: every rank raises CallMismatchError naming the field and the
    ranks, at once, then refuses calls until rebuilt."""
    results = world.run(_mismatch_body, op, strategy, field)
    _check(results, CallMismatchError, bound_s=LONG_BOUND_US / 2e6, text=(op, f"{field} = "))
    # every rank describes the same difference
    assert len({msg.split(" (raised on")[0] for _, msg, *_ in results}) == 1, results
    assert "rank 0 with" in results[0][1], results[0][1]
    assert all(r[3] == ["refused", "closed"] for r in results), results


@pytest.mark.parametrize("world", [pytest.param(("cpu", 3), id="cpu3")], indirect=True)
@pytest.mark.parametrize("op, strategy, field", [("all_gather", "ce_push", "numel"),
                                                 ("gemm_rs", "fused", "M")])  # fmt: skip
def test_a_rank_that_calls_after_the_fault_names_the_same_difference(world, op, strategy, field):
    """Ranks 0 and 1 differ; rank 2 begins its call only after they have recorded the
    mismatch: it raises the same CallMismatchError, naming the field, as they do."""
    results = world.run(_mismatch_body, op, strategy, field, 1.0)
    _check(results, CallMismatchError, bound_s=LONG_BOUND_US / 2e6, text=(op, f"{field} = "))
    assert len({msg.split(" (raised on")[0] for _, msg, *_ in results}) == 1, results


def _ring_mismatch_body(group, op, transport, field):
    """A P2PRing call whose ``field`` differs on the last rank."""
    w, r = group.world_size, group.rank
    ctx = interlace.P2PRing(group, torch.bfloat16, transport=transport, max_spins=LONG_BOUND_US)
    odd = r == w - 1
    k, n = 8, 16
    if op == "gemm_rs":
        m = 4 * w if (odd and field == "M") else 2 * w
        x, wt = _rand(group, m, k, seed=r), _rand(group, k, n, seed=9)
        call = lambda: ctx.gemm_rs(x, wt)  # noqa: E731
    elif op == "ag_gemm":
        kk = k + 2 if (odd and field == "K") else k
        x, wt = _rand(group, 2, kk, seed=r), _rand(group, kk, n, seed=9)
        call = lambda: ctx.ag_gemm(x, wt)  # noqa: E731
    else:  # attn_a2a: another sequence length
        s = 4 * w if (odd and field == "S") else 2 * w
        q = _rand(group, 1, 2, s, 8, seed=r)
        call = lambda: ctx.attn_a2a(q, q, q)  # noqa: E731
    return _call_then_refused(group, ctx, call)


@pytest.mark.parametrize("world", PARAMS, indirect=True)
@pytest.mark.parametrize(
    "op, transport, field",
    [("gemm_rs", "p2p", "M"), ("gemm_rs", "symm", "M"), ("ag_gemm", "p2p", "K"),
     ("attn_a2a", "symm", "S")],
)  # fmt: skip
def test_p2p_ring_mismatches_raise_on_every_rank(world, op, transport, field):
    """P2PRing fingerprints its calls and checks them at a barrier before any message
    moves: a different M, K or sequence length on one rank raises CallMismatchError on
    every rank (none returns), naming the field, at once. (On a GPU the ``p2p`` transport
    runs over NCCL without a check: see the P2PRing docstring.)"""
    if world.backend == "cuda" and transport == "p2p" and not world.share_device:
        pytest.skip("p2p over NCCL does not check calls (NCCL's own timeout)")
    results = world.run(_ring_mismatch_body, op, transport, field)
    _check(results, CallMismatchError, LONG_BOUND_US / 2e6, ("p2p_ring", f"{field} = "))
    assert len({msg.split(" (raised on")[0] for _, msg, *_ in results}) == 1, results
    assert all(r[3] == ["refused", "closed"] for r in results), results


def _signal_reorder_mismatch_body(group, op, field, late_s=0.0):
    """A signal_reorder call whose ``field`` (M or the partition) differs on the last
    rank; with ``late_s``, on rank 0 instead, and the last rank starts ``late_s`` later."""
    w, r = group.world_size, group.rank
    cls = {"gemm_rs": interlace.SignalReorderGemmRS, "gemm_ar": interlace.SignalReorderGemmAR}
    ctx = cls[op](group, max_m=40 * w, n=40, k=24, max_spins=LONG_BOUND_US)
    odd = r == (0 if late_s else w - 1)
    m = 40 * w if field == "partition" else (8 * w if odd else 4 * w)  # several waves
    a, b = _rand(group, m, 24, seed=r), _rand(group, 24, 40, seed=9)
    partition = None
    if field == "partition":
        waves = ctx.waves(m)
        assert waves >= 2, waves
        partition = [waves] if odd else [1] * waves
    call = lambda: ctx(a, b, partition=partition)  # noqa: E731
    return _call_then_refused(group, ctx, call, late_s)


@pytest.mark.parametrize("world", CPU_PARAMS, indirect=True)
@pytest.mark.parametrize("op, field", [("gemm_rs", "M"), ("gemm_ar", "partition")])
def test_signal_reorder_mismatches_raise_on_every_rank(world, op, field):
    """signal_reorder on the CPU backend checks its calls at a barrier before the first
    collective: another M or partition on one rank raises CallMismatchError on every rank,
    naming the field. (On a GPU it has no signal pad and does not check: documented.)"""
    results = world.run(_signal_reorder_mismatch_body, op, field)
    _check(results, CallMismatchError, LONG_BOUND_US / 2e6, (op, f"{field} = "))
    assert all(r[3] == ["refused", "closed"] for r in results), results


@pytest.mark.parametrize("world", [pytest.param(("cpu", 3), id="cpu3")], indirect=True)
def test_signal_reorder_rank_calling_after_the_fault_names_the_difference(world):
    """Rank 0 calls with another M than ranks 1 and 2; rank 2 calls 1 s later, after
    ranks 0 and 1 have raised at their barrier: rank 2 raises at the start of its call (a
    signal_reorder call may run the partition search's collectives before its
    fingerprint) and names M, as they do."""
    results = world.run(_signal_reorder_mismatch_body, "gemm_rs", "M", 1.0)
    _check(results, CallMismatchError, LONG_BOUND_US / 2e6, ("gemm_rs", "M = "))
    assert len({msg.split(" (raised on")[0] for _, msg, *_ in results}) == 1, results


# --------------------------------------------------------------------------------------
# the custom ops' cached contexts are rebuilt after a fault
# --------------------------------------------------------------------------------------


def _library_rebuild_body(group):
    """A GEMM+RS call through the custom op with another M on the last rank fails on every
    rank; the cached context is then failed on every rank, and the next correct call
    rebuilds it and returns the right result on every rank."""
    w, r = group.world_size, group.rank
    h = library.register_group(group)
    n, k = 24, 12  # a cache key no other test uses
    key = ("gemm_rs", h, torch.bfloat16, "fused", n, k)
    m = 2 * w

    def inputs(rows, seed):
        a = [_rand(group, rows, k, seed=seed + q) for q in range(w)]
        b = [_rand(group, k, n, seed=seed + 50 + q) for q in range(w)]
        return a, b

    def run(a, b):
        y = torch.ops.interlace.gemm_rs(a[r], b[r], None, h, "fused")
        ref = sum(a[q].float() @ b[q].float() for q in range(w))
        rows = ref[r * (y.shape[0]) : (r + 1) * y.shape[0]]
        return float((y.float() - rows).norm() / rows.norm())

    errs = [run(*inputs(2 * m, 0))]  # builds the context, large enough for both calls below
    first = library.contexts()[key]
    a, b = inputs(2 * m if r == w - 1 else m, 100)
    try:
        run(a, b)
        raised = "returned"
    except CrossRankError as e:
        raised = type(e).__name__
    failed = first.failed  # recorded on every rank, at the same call
    library.check(group)  # collective; a context already failed is left to be rebuilt
    errs.append(run(*inputs(m, 200)))  # rebuilt, then correct
    rebuilt = library.contexts()[key]
    errs.append(run(*inputs(2 * m, 300)))
    library.clear_cache(group)
    return raised, failed, rebuilt is not first, first._closed, max(errs)


@pytest.mark.parametrize("world", CPU_PARAMS, indirect=True)
def test_library_rebuilds_a_failed_context(world):
    results = world.run(_library_rebuild_body)
    for raised, failed, rebuilt, closed, err in results:
        assert (raised, failed, rebuilt, closed) == ("CallMismatchError", True, True, True)
        assert err < 1e-2, results


# --------------------------------------------------------------------------------------
# a rank that never arrives, a rank that aborts
# --------------------------------------------------------------------------------------


def _absent_rank_body(group, op):
    """Rank 0 never calls; its peers time out within the bound. Rank 0's next call then
    raises the same WaitTimeoutError (the group's fault word), and the context refuses."""
    w, r = group.world_size, group.rank
    if op == "all_gather":
        ctx = interlace.AllGather(group, max_numel=16, dtype=torch.float32,
                                  max_spins=SHORT_BOUND_US)  # fmt: skip
        x = torch.randn(8, device=group.device)
        call = lambda: ctx(x)  # noqa: E731
    elif op == "gemm_rs":
        ctx = interlace.GemmRS(group, max_m=2 * w, n=16, k=8, strategy="fused",
                               max_spins=SHORT_BOUND_US)  # fmt: skip
        a, b = _rand(group, 2 * w, 8, seed=r), _rand(group, 8, 16, seed=1)
        call = lambda: ctx(a, b)  # noqa: E731
    else:  # the low-latency kernels' own polling loops (count words of every source)
        ctx = EPLowLatency(group, 4, 16, 2 * w, 2, max_spins=SHORT_BOUND_US)
        x, wts = _rand(group, 4, 16, seed=r), torch.rand(4, 2, device=group.device)
        idx = torch.tensor([[0, 2 * w - 1]] * 4, device=group.device)
        call = lambda: ctx.dispatch(x, idx, wts)  # noqa: E731
    if r == 0:
        group.host_barrier()  # the peers have given up
        out = _outcome(ctx, call)
    else:
        out = _outcome(ctx, call)
        group.host_barrier()
    group.host_barrier()
    return (*out, _after_failure(ctx, call))


@pytest.mark.parametrize("world", PARAMS, indirect=True)
@pytest.mark.parametrize("op", ["all_gather", "gemm_rs", "ep_low_latency"])
def test_absent_rank_times_out_on_every_rank(world, op):
    results = world.run(_absent_rank_body, op)
    _check(results, WaitTimeoutError, text=(op, "timed out waiting on signal"))
    bound_s = SHORT_BOUND_US / 1e6
    for _, msg, dt, _ in results[1:]:  # the peers: at the bound, not much later
        assert bound_s * 0.9 <= dt < bound_s + 20, (dt, msg)
    assert all(r[3] == ["refused", "closed"] for r in results), results


def _abort_body(group):
    """The last rank raises inside its call after the call began (a crash mid-call): its
    peers stop at once with PeerAbortError naming it, instead of running out of time."""
    w, r = group.world_size, group.rank
    ctx = interlace.AGGemm(group, max_m=2 * w, n=16, k=8, strategy="fused",
                           max_spins=LONG_BOUND_US)  # fmt: skip
    a, b = _rand(group, 2, 8, seed=r), _rand(group, 8, 16, seed=1)
    if r == w - 1:

        def crash(*args, **kwargs):
            raise RuntimeError("boom")

        ctx._enqueue = crash
    out = _outcome(ctx, lambda: ctx(a, b))
    group.host_barrier()
    ctx.__dict__.pop("_enqueue", None)
    return (*out, _after_failure(ctx, lambda: ctx(a, b)))


@pytest.mark.parametrize("world", PARAMS, indirect=True)
def test_a_rank_that_aborts_stops_its_peers_at_once(world):
    results = world.run(_abort_body)
    w = world.world_size
    assert results[-1][0] == "RuntimeError" and "boom" in results[-1][1], results[-1]
    _check(results[:-1], PeerAbortError, bound_s=LONG_BOUND_US / 2e6, text=(f"rank {w - 1}",))
    assert all(r[3] == ["refused", "closed"] for r in results), results


class _HostFails(interlace.ops._context.OpContext):
    """A context whose one call (``step``, named in ``CALLS``) begins on the device and
    then fails in its host code, as a call whose peers called differently can."""

    op_name = "host_fails"
    CALLS = ("step",)

    def __init__(self, group):
        super().__init__(group, torch.float32, 16, {})

    def step(self, record: int = 0):
        self._begin()
        self._begin_call(call="step")
        if record:  # as a device wait of the call would record it
            self.error.report(record)
        raise RuntimeError("host code failed")


class _Steps(interlace.ops._context.OpContext):
    """A context whose call does nothing on the device but fingerprint itself."""

    op_name = "steps"

    def __init__(self, group):
        super().__init__(group, torch.float32, 16, {})

    def step(self, **fields) -> int:
        self._begin()
        fp = self._begin_call(**fields)
        self._end()
        return fp


def _call_slot_body(group):
    """The call slot: the fingerprint on every call; the field values only when the kind
    of call changed (a repeated call leaves a value planted in the slot alone; a call of
    another kind, and a return to the first, rewrite them)."""
    ctx = _Steps(group)
    slot = ctx.pad.local("call").view(torch.int32)

    def read():
        if group.backend == "cuda":
            torch.cuda.synchronize()
        return slot[:4].tolist()

    def plant():
        slot[3] = -7
        if group.backend == "cuda":
            torch.cuda.synchronize()

    seen = []
    fp = ctx.step(n=5, strategy="a")
    seen.append(read() == [fp, 2, 5, slot[3].item()])
    plant()
    fp2 = ctx.step(n=5, strategy="a")
    seen.append(read() == [fp2, 2, 5, -7] and fp2 >> 8 == fp >> 8 and fp2 != fp)
    fp3 = ctx.step(n=6, strategy="a")
    seen.append(read()[:3] == [fp3, 2, 6] and read()[3] != -7)
    plant()
    fp4 = ctx.step(n=5, strategy="a")
    seen.append(read()[:3] == [fp4, 2, 5] and read()[3] != -7 and fp4 >> 8 == fp >> 8)
    ctx.close()
    return seen


@pytest.mark.parametrize("world", PARAMS[:1] + PARAMS[2:3], indirect=True)
def test_call_slot_rewrites_field_values_only_when_the_kind_changes(world):
    results = world.run(_call_slot_body)
    assert all(r == [True] * 4 for r in results), results


@triton.jit
def _add_one(x):
    tl.store(x, tl.load(x) + 1)


class _GraphedSteps(_Steps):
    """A context whose call adds 1 to its operand through ``_enqueue`` (eager graphs on: a
    graph replay from the second call on) after a graphed ``_begin_call``."""

    def __init__(self, group):
        super().__init__(group)
        self._init_eager_graphs(True)

    def step(self, x, **fields) -> int:
        self._begin()
        fp = self._begin_call(graphed=True, **fields)
        self._enqueue("add", lambda: _add_one[(1,)](x), x)
        self._end()
        return fp


def _device_count_body(group):
    """With eager graphs the call count is kept on the device: eager first calls, graph
    replays, a user-captured graph's replays (each replay is a call) and a return to eager
    calls advance it by one per call on every rank alike; the slot then holds
    ``base << 8 | calls mod 256`` and every call's work ran once."""
    ctx = _GraphedSteps(group)
    slot = ctx.pad.local("call").view(torch.int32)
    x = torch.zeros(1, device=group.device)
    fps = [ctx.step(x, n=5) for _ in range(4)]  # eager, capture + replay, replays
    torch.cuda.synchronize()
    seen = [slot[0].item() == fps[-1], len(ctx._graphs) == 1]
    user = torch.cuda.CUDAGraph()
    with torch.cuda.graph(user):
        ctx.step(x, n=5)
    for _ in range(3):
        user.replay()
    fps.append(ctx.step(x, n=6))  # another kind: eager
    fps.append(ctx.step(x, n=6))
    torch.cuda.synchronize()
    calls = 4 + 3 + 2
    got = slot[0].item()
    seen += [got & 0xFF == calls, got >> 8 == fps[-1] >> 8, x.item() == calls]
    ctx.close()
    return seen, got


@pytest.mark.parametrize("world", PARAMS[2:3], indirect=True)
def test_device_kept_call_count_advances_once_per_call_on_every_path(world):
    results = world.run(_device_count_body)
    assert all(seen == [True] * 5 for seen, _ in results), results
    assert len({got for _, got in results}) == 1, results


def _host_failure_body(group):
    """Rank 0's call fails in its host code. Once with a mismatch recorded for the call
    (rank 0 raises that, chained to its own exception); once without (rank 0 reports an
    abort). Every other rank's ``check()`` then raises the recorded fault at once, and rank
    0's context refuses later calls."""
    r = group.rank
    seen = []
    for record in (signals.CAUSE_MISMATCH, 0):
        ctx = _HostFails(group)
        if r == 0:
            try:
                ctx.step(record)
            except Exception as e:  # noqa: BLE001 - reported to the test
                cause = type(e.__cause__).__name__ if e.__cause__ is not None else None
                seen.append((type(e).__name__, cause, ctx.failed))
        group.host_barrier()
        if r != 0:
            try:
                ctx.check()
                seen.append("returned")
            except CrossRankError as e:
                seen.append((type(e).__name__, "rank 0" in str(e)))
        group.host_barrier()
        ctx.close()
    return seen


@pytest.mark.parametrize("world", PARAMS, indirect=True)
def test_a_host_failure_raises_the_recorded_fault(world):
    results = world.run(_host_failure_body)
    assert results[0] == [
        ("CallMismatchError", "RuntimeError", True),
        ("RuntimeError", None, True),
    ], results[0]
    for seen in results[1:]:
        assert seen == [("CallMismatchError", True), ("PeerAbortError", True)], seen


def _recovers_after_local_errors_body(group):
    """Bad arguments raised alike on every rank before launch leave the context usable."""
    w = group.world_size
    ctx = interlace.GemmRS(group, max_m=2 * w, n=16, k=8, strategy="fused")
    a, b = _rand(group, 2 * w, 8), _rand(group, 8, 16, seed=1)
    with pytest.raises(InterlaceTypeError):
        ctx(a.float(), b)
    for _ in range(2):
        y = ctx(a, b)
    ctx.check()
    ref = (a.float() @ b.float()) * w
    rows = slice(group.rank * 2, group.rank * 2 + 2)
    err = (y.float() - ref[rows]).norm() / ref[rows].norm()
    ctx.close()
    return float(err)


@pytest.mark.parametrize("world", PARAMS, indirect=True)
def test_local_argument_errors_do_not_fail_the_context(world):
    assert all(e < 1e-2 for e in world.run(_recovers_after_local_errors_body))


# --------------------------------------------------------------------------------------
# construction: group first, dtype one class, capacity
# --------------------------------------------------------------------------------------

_CONSTRUCTORS = [
    lambda g: interlace.AGGemm(g, max_m=8, n=8, k=8),
    lambda g: interlace.GemmRS(g, max_m=8, n=8, k=8),
    lambda g: interlace.GemmAR(g, max_m=8, n=8, k=8),
    lambda g: interlace.AllGather(g, max_numel=8),
    lambda g: interlace.ReduceScatter(g, max_numel=8),
    lambda g: interlace.AllReduce(g, max_numel=8),
    lambda g: interlace.P2PRing(g),
    lambda g: interlace.SignalReorderGemmRS(g, max_m=8, n=8, k=8),
    lambda g: interlace.SignalReorderGemmAR(g, max_m=8, n=8, k=8),
    lambda g: interlace.SignalReorderGemmA2A(g, max_m=8, n=8, k=8),
    lambda g: interlace.symm_empty((8,), torch.float32, g),
    lambda g: AGMoE(g, max_tokens=8, hidden=8, inter=8, experts=2, topk=1),
    lambda g: MoERS(g, max_tokens=8, hidden=8, inter=8, experts=2, topk=1),
    lambda g: EPAllToAll(g, 8, 16, 2, 1),
    lambda g: EPLowLatency(g, 8, 16, 2, 1),
    lambda g: EPMoE(g, 8, 16, 2, 1),
    lambda g: SPAttention(g, 4, 2, 64, 16),
    lambda g: FlashDecode(g, 2, heads=4, kv_heads=2, head_dim=16),
]


@pytest.mark.parametrize("make", _CONSTRUCTORS)
def test_every_constructor_checks_its_group_first(make):
    for bad in (None, "group", object()):
        with pytest.raises(InterlaceTypeError, match="group must be an interlace Group"):
            make(bad)


def _capacity_body(group):
    """A buffer beyond /dev/shm (or GPU memory) is an InterlaceValueError on every rank at
    construction, naming the rank; the world stays usable."""
    huge = 1 << 44  # 16 TiB
    try:
        interlace.symm_empty((huge,), torch.uint8, group)
    except InterlaceValueError as e:
        msg = str(e)
    else:
        msg = "allocated"
    small = interlace.symm_zeros((4,), torch.float32, group)
    small.close()
    return msg


@pytest.mark.parametrize("world", PARAMS, indirect=True)
def test_capacity_beyond_memory_is_a_clear_error(world):
    msgs = world.run(_capacity_body)
    assert len(set(msgs)) == 1 and "could not allocate" in msgs[0] and "rank " in msgs[0], msgs


def test_stale_shm_files_of_dead_processes_are_removed():
    proc = subprocess.Popen(["true"])
    proc.wait()  # its pid is now free: a dead creator
    prefix = f"interlace-stale-{os.getpid()}"
    dead = os.path.join(symmetric.SHM_DIR, f"{prefix}-abc-0-r1-p{proc.pid}")
    alive = os.path.join(symmetric.SHM_DIR, f"{prefix}-abc-1-r0-p{os.getpid()}")
    for path in (dead, alive):
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        removed = symmetric.clean_stale_shm(prefix)
        assert os.path.basename(dead) in removed
        assert not os.path.exists(dead) and os.path.exists(alive)
    finally:
        for path in (dead, alive):
            if os.path.exists(path):
                os.unlink(path)


def test_wait_bound_comes_from_one_variable(monkeypatch):
    monkeypatch.delenv(signals.WAIT_TIMEOUT_ENV, raising=False)
    assert signals.default_wait_bound_us() == int(signals.DEFAULT_WAIT_TIMEOUT_S * 1e6)
    monkeypatch.setenv(signals.WAIT_TIMEOUT_ENV, "0.25")
    assert signals.default_wait_bound_us() == 250_000
    for bad in ("soon", "0", "-1"):
        monkeypatch.setenv(signals.WAIT_TIMEOUT_ENV, bad)
        with pytest.raises(InterlaceValueError, match=signals.WAIT_TIMEOUT_ENV):
            signals.default_wait_bound_us()


def _torn_record_body(group):
    """Rank 0 claims the group's fault word and writes its fields 0.1 s later (as a rank
    in the middle of recording a fault); reading the record meanwhile waits for them."""
    import ctypes
    import threading

    ctx = interlace.AllGather(group, 8, torch.bfloat16)
    got = None
    if group.rank == 0:
        words = (ctypes.c_int32 * 6).from_address(ctx.pad.address("fault", 0))
        words[1], words[0] = 0, 1  # claimed: the rank written, not yet the rest

        def finish():
            time.sleep(0.1)
            words[2], words[3], words[4], words[5] = signals.CAUSE_MISMATCH, 5, 7, 9
            words[0] = 2

        writer = threading.Thread(target=finish)
        writer.start()
        got = ctx.error.group_record()
        writer.join()
        ctypes.memset(ctypes.addressof(words), 0, 24)
    group.host_barrier()
    ctx.close()
    return got


@pytest.mark.parametrize("world", CPU_PARAMS[:1], indirect=True)
def test_a_fault_record_being_written_is_read_whole(world):
    """A rank reading the group's fault record while another writes it reads every field
    (a half-written record read as a timeout of slot 0 on one rank while the others raised
    the mismatch it was)."""
    got = world.run(_torn_record_body)[0]
    assert got[:6] == [2, 0, signals.CAUSE_MISMATCH, 5, 7, 9], got


def test_mismatch_text_names_fields_and_ranks():
    signals.hash_text("fused")
    signals.hash_text("ce_fused")
    rec = signals.CallRecord(
        ("M", "N", "strategy"),
        [0x101, 0x101],
        [[128, 16, signals.field_value("fused")], [256, 16, signals.field_value("ce_fused")]],
    )
    text = rec.difference("gemm_rs")
    assert text == "rank 1 called gemm_rs with M = 256, strategy = ce_fused, rank 0 with " \
        "M = 128, strategy = fused", text  # fmt: skip
    same = signals.CallRecord(("M",), [0x105, 0x106], [[8], [8]])
    assert "rank 1 is at call 6" in same.difference("ag_gemm")
    # a rank that has not begun its call yet (an empty slot) is not named as the odd one
    late = signals.CallRecord(("M",), [0x101, 0, 0x201], [[8], [], [16]])
    assert not late.complete()
    assert late.difference("gemm_rs") == "rank 2 called gemm_rs with M = 16, rank 0 with M = 8"
    first_late = signals.CallRecord(("M",), [0, 0x101, 0x201], [[], [8], [16]])
    assert first_late.difference("gemm_rs") == (
        "rank 2 called gemm_rs with M = 16, rank 1 with M = 8"
    )
    assert signals.CallRecord(("M",), [0, 0], [[], []]).difference("gemm_rs") is None
