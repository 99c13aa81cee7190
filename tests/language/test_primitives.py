"""Device primitives across ranks: notify (set/add), wait (>= and ==), consume, put_flag,
the device barrier, timeouts reported through the error word, tile push/pull through
remote pointers, and guard."""

from __future__ import annotations

import time

import pytest
import torch
import triton
import triton.language as tl

from interlace.errors import InterlaceError, WaitTimeoutError
from interlace.language.primitives import (
    barrier_kernel,
    consume,
    guard,
    notify_kernel,
    put_flag,
    remote_base,
    rounded,
    tile_pull,
    tile_push,
    to_peer,
    wait,
    wait_inline,
    wait_kernel,
)
from interlace.runtime import ErrorWord, SignalPad, default_max_spins, symm_empty
from interlace.runtime.signals import ERROR_WORDS
from tests.conftest import WITH_ONE_GPU

SHORT_SPINS = 200  # a wait that is meant to time out


def _sync(group) -> None:
    if group.backend == "cuda":
        torch.cuda.synchronize(group.device)


def _pad_values(pad, region=None) -> list[int]:
    t = pad.buffer.local[: pad.size] if region is None else pad.local(region)
    return t.cpu().tolist()


def _expect_timeout(group, err, pad, op, signal, observed=None):
    """The error word holds a timeout: raise_if_set raises it once, then the word is clear."""
    _sync(group)
    with pytest.raises(WaitTimeoutError) as info:
        err.raise_if_set(op, pad.describe)
    e = info.value
    msg = str(e)
    assert isinstance(e, InterlaceError)
    assert e.op == op and e.rank == group.rank and e.signal == signal, (e.op, e.rank, e.signal)
    assert op in msg and f"rank {group.rank}" in msg and signal in msg, msg
    if observed is not None:
        assert e.observed == observed and str(observed) in msg, msg
    assert err.tensor.tolist() == [0, 0, 0, 0]
    err.raise_if_set(op, pad.describe)  # cleared: no second raise


# --------------------------------------------------------------------------------------
# test kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _wait_token_kernel(sig_ptr, slot, expected, err, rank, max_spins, out, EQUAL: tl.constexpr):
    tok = wait(sig_ptr + slot, expected, err, rank, slot, max_spins, EQUAL)
    tl.store(out, tok)


@triton.jit
def _wait_inline_kernel(sig_ptr, slot, expected, needed, err, rank, max_spins, out, count=1):
    token = wait_inline(sig_ptr + slot, expected, needed, err, rank, slot, max_spins, count)
    tl.store(out, token)


@triton.jit
def _consume_kernel(sig_ptr, slot, expected, err, rank, max_spins, out):
    tl.store(out, consume(sig_ptr + slot, expected, err, rank, slot, max_spins))


@triton.jit
def _put_flag_kernel(sig_ptr, slot, err, rank, max_spins):
    put_flag(sig_ptr + slot, err, rank, slot, max_spins)


@triton.jit
def _push_block_kernel(
    src,
    dst,
    table,
    rank,
    peer,
    M,
    N,
    stride_src,
    stride_dst,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    """Push src[:M, :N] (local) into the block at ``dst`` of a symmetric tensor on ``peer``:
    ``dst`` points into this rank's copy, ``to_peer`` moves it to the peer's."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    src_ptrs = src + offs_m[:, None] * stride_src + offs_n[None, :]
    dst_ptrs = to_peer(dst + offs_m[:, None] * stride_dst + offs_n[None, :], table, rank, peer)
    tile_push(src_ptrs, dst_ptrs, mask)


@triton.jit
def _pull_block_kernel(
    table,
    peer,
    src_offset,
    out,
    M,
    N,
    stride_src,
    stride_out,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    """Pull the M x N block at element ``src_offset`` of ``peer``'s symmetric tensor
    (found through ``remote_base``) into the local ``out``."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    base = remote_base(table, peer, out)
    src_ptrs = base + src_offset + offs_m[:, None] * stride_src + offs_n[None, :]
    out_ptrs = out + offs_m[:, None] * stride_out + offs_n[None, :]
    tile_pull(src_ptrs, out_ptrs, mask)


@triton.jit
def _guard_kernel(token, expected, src, out, n, other, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(src + offs, mask=guard(inside, token, expected), other=other)
    tl.store(out + offs, x, mask=inside)


@triton.jit
def _wait_guarded_load_kernel(
    sig_ptr, slot, expected, err, rank, max_spins, src, out, n, other, BLOCK: tl.constexpr
):
    tok = wait(sig_ptr + slot, expected, err, rank, slot, max_spins)
    offs = tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(src + offs, mask=guard(inside, tok, expected), other=other)
    tl.store(out + offs, x, mask=inside)


def _wait_slots(pad, err, rank, first, count, expected, spins, reset):
    """One wait_kernel launch over ``count`` slots of the whole pad from ``first``."""
    wait_kernel[(1,)](
        pad.buffer.local, first, count, expected, err.address, rank, spins, RESET=reset
    )


# --------------------------------------------------------------------------------------
# bodies
# --------------------------------------------------------------------------------------


def _notify_set_body(group, seed):
    """Set mode: each rank stores a value into its right neighbour's slot; the neighbour
    waits for exactly that value (EQUAL) and the token is that value. An EQUAL wait on a
    smaller value times out where a >= wait passes."""
    rank, world = group.rank, group.world_size
    right, left = (rank + 1) % world, (rank - 1) % world
    pad = SignalPad(group, {"pre": 2, "set": world, "post": 2})
    err = ErrorWord(group)
    spins = default_max_spins(group)
    out = torch.full((1,), -1, dtype=torch.int32, device=group.device)
    value = lambda r: 1000 + 37 * r + seed % 500  # noqa: E731
    try:
        # set twice: the second store replaces the first (not added to it)
        notify_kernel[(1,)](pad.ptrs, right, pad.offset("set") + rank, 5, ADD=False)
        notify_kernel[(1,)](pad.ptrs, right, pad.offset("set") + rank, value(rank), ADD=False)
        slot = pad.offset("set") + left
        _wait_token_kernel[(1,)](
            pad.buffer.local, slot, value(left), err.address, rank, spins, out, EQUAL=True
        )
        _sync(group)
        err.raise_if_set("notify_set", pad.describe)
        assert int(out[0]) == value(left)
        vals = _pad_values(pad, "set")
        assert vals == [value(left) if r == left else 0 for r in range(world)], vals
        assert _pad_values(pad, "pre") == [0, 0] and _pad_values(pad, "post") == [0, 0]
        # >= passes on a smaller target, returning the value seen
        out.fill_(-1)
        _wait_token_kernel[(1,)](
            pad.buffer.local, slot, value(left) - 1, err.address, rank, spins, out, EQUAL=False
        )
        _sync(group)
        err.raise_if_set("notify_set", pad.describe)
        assert int(out[0]) == value(left)
        # == does not
        _wait_token_kernel[(1,)](
            pad.buffer.local,
            slot,
            value(left) - 1,
            err.address,
            rank,
            SHORT_SPINS,
            out,
            EQUAL=True,
        )
        _expect_timeout(group, err, pad, "equal_wait", f"set[{left}]", observed=value(left))
        # a timed-out wait returns expected - 1, so that guard() masks the data off
        assert int(out[0]) == value(left) - 2
        group.host_barrier()
    finally:
        pad.close()
    return True


def _notify_add_body(group, rounds):
    """Add mode: every rank but 0 adds (rank + 1) to rank 0's slot from 3 programs; rank 0
    waits for the total (wait_kernel, RESET=False) and the slot holds exactly the total."""
    rank, world = group.rank, group.world_size
    pad = SignalPad(group, {"x": 1, "count": 4})
    err = ErrorWord(group)
    spins = default_max_spins(group)
    k = 2  # the slot used inside the region
    try:
        total = 0
        for _ in range(rounds):
            total += 3 * sum(r + 1 for r in range(1, world))
            if rank != 0:
                notify_kernel[(3,)](pad.ptrs, 0, pad.offset("count") + k, rank + 1, ADD=True)
                _sync(group)
                vals, want = _pad_values(pad), [0] * 5  # nobody adds to this rank
            else:
                _wait_slots(pad, err, rank, pad.offset("count") + k, 1, total, spins, False)
                _sync(group)
                err.raise_if_set("notify_add", pad.describe)
                # read before the barrier: after it the next round's adds may land
                vals, want = _pad_values(pad), [0, 0, 0, total, 0]
            group.host_barrier()
            assert vals == want, vals
        # the classic form: every other rank adds 1, rank 0 waits for >= world - 1
        if rank == 0:
            pad.buffer.local.zero_()
            _sync(group)
        group.host_barrier()
        if rank != 0:
            notify_kernel[(1,)](pad.ptrs, 0, pad.offset("count"), 1, ADD=True)
        else:
            _wait_slots(pad, err, rank, pad.offset("count"), 1, world - 1, spins, False)
            _sync(group)
            err.raise_if_set("notify_add", pad.describe)
            assert _pad_values(pad, "count") == [world - 1, 0, 0, 0]
        group.host_barrier()
    finally:
        pad.close()
    return True


def _consume_body(group):
    """consume waits for an exact value and resets it to 0; a wrong value times out and is
    left in place; wait_kernel(RESET=True) consumes a run of slots."""
    rank, world = group.rank, group.world_size
    right, left = (rank + 1) % world, (rank - 1) % world
    pad = SignalPad(group, {"head": 1, "flag": world, "run": 3})
    err = ErrorWord(group)
    spins = default_max_spins(group)
    out = torch.full((1,), -1, dtype=torch.int32, device=group.device)
    try:
        notify_kernel[(1,)](pad.ptrs, right, pad.offset("flag") + rank, 7, ADD=False)
        slot = pad.offset("flag") + left
        # wrong expected value: times out, the value stays
        _consume_kernel[(1,)](pad.buffer.local, slot, 8, err.address, rank, SHORT_SPINS, out)
        _sync(group)
        # the first wait may run before the left rank's notify lands: observed is 0 or 7
        with pytest.raises(WaitTimeoutError, match=f"flag\\[{left}\\]"):
            err.raise_if_set("consume_wrong", pad.describe)
        _consume_kernel[(1,)](pad.buffer.local, slot, 7, err.address, rank, spins, out)
        _sync(group)
        err.raise_if_set("consume", pad.describe)
        assert int(out[0]) == 7
        assert _pad_values(pad) == [0] * pad.size, _pad_values(pad)
        # the slot now holds 0: consuming 7 again times out, observing 0
        _consume_kernel[(1,)](pad.buffer.local, slot, 7, err.address, rank, SHORT_SPINS, out)
        _expect_timeout(group, err, pad, "consume_again", f"flag[{left}]", observed=0)
        # wait_kernel(RESET=True) over a run of slots set to 3 by the left rank
        group.host_barrier()
        for j in range(3):
            notify_kernel[(1,)](pad.ptrs, right, pad.offset("run") + j, 3, ADD=False)
        _wait_slots(pad, err, rank, pad.offset("run"), 3, 3, spins, True)
        _sync(group)
        err.raise_if_set("consume_run", pad.describe)
        assert _pad_values(pad) == [0] * pad.size
        # put_flag: 0 -> 1 on a free flag, and a timeout on a flag still raised
        _put_flag_kernel[(1,)](pad.buffer.local, 0, err.address, rank, spins)
        _sync(group)
        err.raise_if_set("put_flag", pad.describe)
        assert _pad_values(pad, "head") == [1]
        _put_flag_kernel[(1,)](pad.buffer.local, 0, err.address, rank, SHORT_SPINS)
        _expect_timeout(group, err, pad, "put_flag_busy", "head[0]", observed=1)
        group.host_barrier()
    finally:
        pad.close()
    return True


def _barrier_body(group, seed, rounds):
    """barrier_kernel many times in a row on the same slots; around it each rank writes
    fresh data into its right neighbour, which reads it after the barrier. Rank 0 is slow
    to write, so a barrier that let ranks through early would be caught."""
    rank, world = group.rank, group.world_size
    right, left = (rank + 1) % world, (rank - 1) % world
    pad = SignalPad(group, {"misc": 2, "barrier": world})
    err = ErrorWord(group)
    spins = default_max_spins(group)
    buf = symm_empty((5, 3), torch.float32, group)
    base = pad.offset("barrier")
    buf.local.fill_(float("nan"))
    _sync(group)
    group.host_barrier()

    def data(r, i):
        gen = torch.Generator().manual_seed(seed * 7919 + i * 97 + r)
        return torch.randn(5, 3, generator=gen)

    try:
        for i in range(rounds):
            if rank == 0:
                time.sleep(0.05 if group.backend == "cpu" else 0.01)
            buf.peers[right].copy_(data(rank, i).to(group.device))
            barrier_kernel[(1,)](pad.ptrs, base, rank, world, err.address, spins)
            got = buf.local.clone()
            # nobody writes the next round before everyone has read this one
            barrier_kernel[(1,)](pad.ptrs, base, rank, world, err.address, spins)
            _sync(group)
            err.raise_if_set("barrier", pad.describe)
            assert torch.equal(got.cpu(), data(left, i)), f"round {i}: read before the write"
        _sync(group)
        assert _pad_values(pad) == [0] * pad.size, _pad_values(pad)  # self-resetting
        group.host_barrier()
    finally:
        buf.close()
        pad.close()
    return True


def _timeout_body(group):
    """A wait that nobody satisfies records [2, rank, slot, seen]; the host raises a
    WaitTimeoutError naming op, rank and signal, and the word is clear afterwards. With
    several timeouts the first one is reported."""
    rank = group.rank
    pad = SignalPad(group, {"barrier": group.world_size, "data": 6})
    err = ErrorWord(group)
    try:
        err.raise_if_set("nothing")  # clear word: no error
        pad.local("data")[3] = 5
        _sync(group)
        _wait_slots(pad, err, rank, pad.offset("data") + 3, 1, 6, SHORT_SPINS, False)
        _expect_timeout(group, err, pad, "probe_op", "data[3]", observed=5)
        assert pad.describe(pad.offset("data") + 3) == "data[3]"
        assert pad.describe(pad.size + 4) == "fault[4]"  # the reserved regions follow
        assert pad.describe(pad.size + 100) == f"slot {pad.size + 100}"
        # first timeout wins: data[1] and data[2] both time out, data[1] is reported
        _wait_slots(pad, err, rank, pad.offset("data") + 1, 2, 1, SHORT_SPINS, True)
        _expect_timeout(group, err, pad, "second_probe", "data[1]", observed=0)
        assert _pad_values(pad, "data") == [0, 0, 0, 5, 0, 0]
        group.host_barrier()
    finally:
        pad.close()
    return True


def _push_pull_body(group, seed, dtype_name, M, N, BM, BN):
    """Each rank pushes a ragged M x N block of its local data into its right neighbour's
    symmetric tensor (to_peer), then pulls the left neighbour's source block
    (remote_base); both are compared with torch, and what lies outside the block stays
    poisoned."""
    dtype = getattr(torch, dtype_name)
    rank, world = group.rank, group.world_size
    right, left = (rank + 1) % world, (rank - 1) % world
    R, C = M + 3, N + 5  # the symmetric tensors are larger than the block
    r0, c0 = 2, 1  # where the block sits inside them

    def data(r):
        gen = torch.Generator().manual_seed(seed * 613 + r)
        return (torch.randn(R, C, generator=gen) * 4).to(dtype)

    dst = symm_empty((world, R, C), dtype, group)
    src = symm_empty((R, C), dtype, group)
    pad = SignalPad(group, {"barrier": world})
    err = ErrorWord(group)
    spins = default_max_spins(group)
    try:
        poison = torch.tensor(-777.0, dtype=dtype)
        dst.local.fill_(poison.item())
        src.local.copy_(data(rank).to(group.device))
        _sync(group)
        group.host_barrier()
        grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
        mine = data(rank).to(group.device)  # an ordinary (non-symmetric) local tensor
        block = dst.local[rank, r0:, c0:]  # this rank's row of the symmetric destination
        _push_block_kernel[grid](
            mine,
            block,
            dst.ptrs,
            rank,
            right,
            M,
            N,
            mine.stride(0),
            block.stride(0),
            BM=BM,
            BN=BN,
        )
        # pull: left neighbour's src[r0:r0+M, c0:c0+N] via its base address
        out = torch.full((M + 1, N + 2), -555.0, dtype=dtype, device=group.device)
        _pull_block_kernel[grid](
            src.ptrs, left, r0 * C + c0, out, M, N, C, out.stride(0), BM=BM, BN=BN
        )
        barrier_kernel[(1,)](pad.ptrs, 0, rank, world, err.address, spins)
        _sync(group)
        err.raise_if_set("push_pull", pad.describe)
        # push: my row `left` of dst holds the left neighbour's block, the rest is poison
        want = torch.full((world, R, C), poison.item(), dtype=dtype)
        want[left, r0 : r0 + M, c0 : c0 + N] = data(left)[:M, :N]
        got = dst.local.cpu()
        assert torch.equal(got, want), (got - want).abs().max()
        # pull
        want_out = torch.full((M + 1, N + 2), -555.0, dtype=dtype)
        want_out[:M, :N] = data(left)[r0 : r0 + M, c0 : c0 + N]
        assert torch.equal(out.cpu(), want_out)
        group.host_barrier()
    finally:
        dst.close()
        src.close()
        pad.close()
    return True


def _guard_body(group, seed):
    """guard masks the load off (value from ``other``) when the token is below expected,
    directly and after a timed-out wait; after a satisfied wait the data comes through."""
    rank, world = group.rank, group.world_size
    right, left = (rank + 1) % world, (rank - 1) % world
    n, block = 11, 16
    gen = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(n, generator=gen).to(group.device)
    out = torch.full((n,), float("nan"), device=group.device)
    for token, expected, passes in ((4, 5, False), (5, 5, True), (9, 5, True), (-1, 0, False)):
        out.fill_(float("nan"))
        _guard_kernel[(1,)](token, expected, x, out, n, -3.5, BLOCK=block)
        _sync(group)
        want = x.cpu() if passes else torch.full((n,), -3.5)
        assert torch.equal(out.cpu(), want), (token, expected, out)

    # across ranks: the left neighbour fills my buffer, then raises my flag to 2
    pad = SignalPad(group, {"ready": 1})
    err = ErrorWord(group)
    buf = symm_empty((n,), torch.float32, group)
    spins = default_max_spins(group)
    try:
        buf.local.fill_(float("nan"))
        _sync(group)
        group.host_barrier()
        buf.peers[right].copy_(x)
        _sync(group)
        notify_kernel[(1,)](pad.ptrs, right, 0, 2, ADD=False)
        out.fill_(float("nan"))
        _wait_guarded_load_kernel[(1,)](
            pad.buffer.local,
            0,
            2,
            err.address,
            rank,
            spins,
            buf.local,
            out,
            n,
            -1.0,
            BLOCK=block,
        )
        _sync(group)
        err.raise_if_set("guard", pad.describe)
        left_x = torch.randn(n, generator=torch.Generator().manual_seed(seed + left))
        assert torch.equal(out.cpu(), left_x)
        # a wait for 3 times out: everything is masked off, nothing read
        out.fill_(float("nan"))
        _wait_guarded_load_kernel[(1,)](
            pad.buffer.local,
            0,
            3,
            err.address,
            rank,
            SHORT_SPINS,
            buf.local,
            out,
            n,
            -1.0,
            BLOCK=block,
        )
        _expect_timeout(group, err, pad, "guard_timeout", "ready[0]", observed=2)
        assert torch.equal(out.cpu(), torch.full((n,), -1.0))
        group.host_barrier()
    finally:
        buf.close()
        pad.close()
    return True


# --------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------


def _seed() -> int:
    return int(torch.randint(0, 2**20, ()).item())


def test_notify_set_and_equal_wait(world):
    assert all(world.run(_notify_set_body, _seed()))


def test_notify_add(world):
    assert all(world.run(_notify_add_body, 2))


def test_consume_resets_and_put_flag(world):
    assert all(world.run(_consume_body))


def test_barrier_repeated_and_synchronising(world):
    assert all(world.run(_barrier_body, _seed(), 10))


def test_timeout_raises_wait_timeout_error(world):
    assert all(world.run(_timeout_body))


@pytest.mark.parametrize(
    "dtype_name,M,N,BM,BN",
    [("float32", 13, 21, 8, 16), ("float16", 5, 9, 4, 8), ("bfloat16", 3, 17, 4, 8)],
)
def test_tile_push_pull(world, dtype_name, M, N, BM, BN):
    assert all(world.run(_push_pull_body, _seed(), dtype_name, M, N, BM, BN))


def test_guard(world):
    assert all(world.run(_guard_body, _seed()))


def _bail_out_body(group):
    """Once a wait has recorded a timeout, every later wait gives up within ERROR_POLL
    spins instead of spinning its whole bound (which here would take hours)."""
    pad = SignalPad(group, {"never": 1})
    err = ErrorWord(group)
    out = torch.full((1,), -7, dtype=torch.int32, device=group.device)
    try:
        err.tensor[0], err.tensor[2] = 2, 12345  # an earlier wait failed
        _wait_token_kernel[(1,)](
            pad.buffer.local, 0, 1, err.address, group.rank, 1 << 30, out, EQUAL=False
        )
        _sync(group)
        assert int(out[0]) == 0  # expected - 1: the guard masks data off
        with pytest.raises(WaitTimeoutError) as info:
            err.raise_if_set("bail", pad.describe)
        assert "slot 12345" in str(info.value)  # the first failure is kept, not overwritten
    finally:
        group.host_barrier()
        pad.close()
    return True


def test_waits_give_up_early_after_a_timeout(world):
    world.run(_bail_out_body)


def test_remote_slots_are_named_with_their_rank():
    from interlace.language.primitives import REMOTE_SLOT

    class _Pad(SignalPad):
        def __init__(self):  # no buffer: only the naming is under test
            self.regions = {"barrier": (0, 4), "data": (4, 2)}

    assert _Pad().describe(5) == "data[1]"
    assert _Pad().describe(2 + 3 * REMOTE_SLOT.value) == "barrier[2] on rank 2"


def _barrier_clears_body(group):
    """barrier_kernel zeroes the requested run of local slots (more than one block of
    them) before arriving, and nothing outside it."""
    pad = SignalPad(group, {"barrier": group.world_size, "flags": 200})
    err = ErrorWord(group)
    try:
        pad.local("flags").fill_(1)
        _sync(group)
        barrier_kernel[(1,)](
            pad.ptrs, pad.offset("barrier"), group.rank, group.world_size, err.address,
            default_max_spins(group), pad.offset("flags") + 3, 150,
        )  # fmt: skip
        _sync(group)
        err.raise_if_set("barrier_clear", pad.describe)
        flags = _pad_values(pad, "flags")
        assert flags == [1] * 3 + [0] * 150 + [1] * 47, flags
    finally:
        group.host_barrier()
        pad.close()
    return True


def test_barrier_clears_flags(world):
    world.run(_barrier_clears_body)


def _wait_inline_body(group):
    """``wait_inline`` (inline PTX on a GPU, ``wait`` in the interpreter) keeps ``wait``'s
    protocol: a met signal returns the value seen (of several consecutive ones, the
    smallest); ``needed = 0`` returns ``expected`` without looking; an unmet one records
    ``[2, rank, slot, seen]`` (the first unmet of several) and returns ``expected - 1``;
    after an earlier timeout it gives up within ``ERROR_POLL`` spins (its bound here
    would take hours) and keeps the first report."""
    pad = SignalPad(group, {"data": 4})
    err = ErrorWord(group)
    out = torch.full((1,), -7, dtype=torch.int32, device=group.device)
    base = pad.offset("data")

    def run(slot, expected, needed, spins, count=1):
        out.fill_(-7)
        _wait_inline_kernel[(1,)](
            pad.buffer.local, base + slot, expected, needed, err.address, group.rank, spins,
            out, count,
        )  # fmt: skip
        _sync(group)
        return int(out[0])

    try:
        pad.local("data")[1] = 5
        _sync(group)
        assert run(1, 3, 1, default_max_spins(group)) == 5
        err.raise_if_set("inline_met", pad.describe)
        assert run(2, 3, 0, SHORT_SPINS) == 3  # not needed: no look, no timeout
        err.raise_if_set("inline_skip", pad.describe)
        assert run(1, 6, 1, SHORT_SPINS) == 5  # expected - 1
        _expect_timeout(group, err, pad, "inline_timeout", "data[1]", observed=5)
        pad.local("data")[:3] = torch.tensor([7, 5, 6], dtype=torch.int32)
        _sync(group)
        assert run(0, 3, 1, default_max_spins(group), count=3) == 5  # the smallest seen
        err.raise_if_set("inline_three", pad.describe)
        assert run(0, 3, 1, SHORT_SPINS, count=4) == 2  # data[3] is 0
        _expect_timeout(group, err, pad, "inline_fourth", "data[3]", observed=0)
        err.tensor[0], err.tensor[2] = 2, 12345  # an earlier wait failed
        assert run(3, 1, 1, 1 << 30) == 0
        with pytest.raises(WaitTimeoutError) as info:
            err.raise_if_set("inline_bail", pad.describe)
        assert "slot 12345" in str(info.value)
    finally:
        group.host_barrier()
        pad.close()
    return True


@pytest.mark.parametrize("world", WITH_ONE_GPU, indirect=True)
def test_wait_inline(world):
    assert all(world.run(_wait_inline_body))


@pytest.mark.gpu
def test_wait_inline_sees_a_late_signal():
    """A one-program kernel spins in ``wait_inline`` while, from another stream, the copy
    engine raises its signal some 20 ms later: the wait returns the new value, and no
    timeout is recorded (its polls are not served from a stale cache)."""
    if torch.cuda.device_count() < 1:
        pytest.skip("needs a GPU")
    dev = torch.device("cuda", 0)
    sig = torch.zeros(4, dtype=torch.int32, device=dev)
    err = torch.zeros(ERROR_WORDS, dtype=torch.int32, device=dev)  # no group word, no call slot
    out = torch.full((1,), -7, dtype=torch.int32, device=dev)
    raised = torch.full((1,), 3, dtype=torch.int32).pin_memory()
    waiter, raiser = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    # the raiser's kernels loaded first: a kernel's first launch (CUDA's lazy loading)
    # would wait for the spinning one to end
    torch.cuda._sleep(1)
    sig[3:4].copy_(raised, non_blocking=True)
    torch.cuda.synchronize(dev)
    with torch.cuda.stream(waiter):
        _wait_inline_kernel[(1,)](sig, 2, 3, 1, err.data_ptr(), 0, 1 << 26, out)
    with torch.cuda.stream(raiser):
        torch.cuda._sleep(40_000_000)  # GPU cycles: ~20 ms
        sig[2:3].copy_(raised, non_blocking=True)
    torch.cuda.synchronize(dev)
    assert int(out[0]) == 3 and not any(err.tolist()), (out.tolist(), err.tolist())


@triton.jit
def _rounded_kernel(x, y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y + i, rounded(tl.load(x + i), tl.bfloat16))


def _rounded_body(group):
    """``rounded`` converts float32 to bfloat16 as torch does (round to nearest even; the
    interpreter's own conversion truncates), NaN and infinities kept."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1024, generator=gen) * 3
    x[:5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, 1.0 + 2.0**-8])
    y = torch.empty(1024, dtype=torch.bfloat16, device=group.device)
    _rounded_kernel[(1,)](x.to(group.device), y, N=1024)
    got, want = y.cpu(), x.to(torch.bfloat16)
    assert torch.isnan(got[0]) and torch.equal(got[1:], want[1:]), (got - want).abs().max()
    return True


def test_rounded_to_nearest_even(world):
    assert all(world.run(_rounded_body))
