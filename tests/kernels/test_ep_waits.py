"""The expert-parallel kernels' own polling loops (``kernels.ep._wait_below``,
``kernels.ep_low_latency._poll_word`` / ``_poll_row``) follow the waits' rules: bounded
in time (``max_spins`` microseconds), stopped at once by a fault any rank of the group
recorded, and the fault recorded in this rank's error word; ``record_check`` records in
this rank's word only (the op raises its own error; nobody's waits stop).

Each loop spins in a one-program kernel on a slot nobody satisfies; CPU world of 2 ranks.
"""

from __future__ import annotations

import time

import pytest
import torch
import triton
import triton.language as tl

from interlace.kernels.ep import _wait_below
from interlace.kernels.ep_low_latency import _poll_row, _poll_word
from interlace.language.primitives import record_check
from interlace.runtime import ErrorWord, SignalPad
from interlace.runtime.signals import CAUSE_CHECK, CAUSE_PEER, CAUSE_TIMEOUT

#: The bound of the loops meant to run out of time (0.3 s).
SHORT_US = 300_000
#: A bound no loop stopped by a fault may come near (60 s).
LONG_US = 60_000_000


@triton.jit
def _below_kernel(sig, bound, err, rank, slot, max_spins):
    _wait_below(sig, bound, err, rank, slot, max_spins)


@triton.jit
def _word_kernel(ptr, epoch, err, rank, slot, max_spins, out):
    tl.store(out, _poll_word(ptr, epoch, err, rank, slot, max_spins))


@triton.jit
def _row_kernel(ptr, n, epoch, err, rank, slot, max_spins, out, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out + offs, _poll_row(ptr + offs, mask, epoch, err, rank, slot, max_spins), mask=mask)


@triton.jit
def _check_kernel(err, rank, slot, seen):
    record_check(err, rank, slot, seen)


def _word_ref(payload: int, epoch: int) -> int:
    """The int64 word ``(epoch << 32) | payload``."""
    return (epoch << 32) | payload


def _local(err: ErrorWord) -> list[int]:
    return [int(v) for v in err.words[:6].tolist()]


def _clear_faults(group, pad, err) -> None:
    """Every rank's error word and the group's fault word back to zero."""
    group.host_barrier()
    err.words[:6].zero_()
    if group.rank == 0:
        pad.local("fault").zero_()
    group.host_barrier()


def _loops_body(group):
    rank, dev = group.rank, group.device
    pad = SignalPad(group, {"data": 4})
    err = ErrorWord(group)
    err.attach(pad, "ep_probe")
    slot = pad.offset("data") + 1
    sig = pad.local("data")[1:2]
    words = torch.full((6,), 5 << 32, dtype=torch.int64, device=dev)  # epoch 5 everywhere
    out = torch.zeros(6, dtype=torch.int64, device=dev)
    seen = {}

    def loops():
        # each spins on what never comes: a count that stays at the bound, an epoch never
        # reached (word, then a row of 5 words)
        sig.fill_(3)
        yield "below", lambda s: _below_kernel[(1,)](sig, 3, err.address, rank, slot, s), 3
        yield "word", lambda s: _word_kernel[(1,)](words, 7, err.address, rank, slot, s, out), 5
        yield (
            "row",
            lambda s: _row_kernel[(1,)](words, 5, 7, err.address, rank, slot, s, out, BLOCK=8),
            5,  # words missing
        )

    try:
        for name, launch, value in loops():
            # out of time (rank 0 alone): [2, rank, slot, value, timeout] after the bound,
            # not long after, and the group's fault word claimed for every rank
            if rank == 0:
                t0 = time.monotonic()
                launch(SHORT_US)
                dt = time.monotonic() - t0
                state, r, s, v, cause, _ = _local(err)
                assert (state, r, s, v, cause) == (2, 0, slot, value, CAUSE_TIMEOUT), _local(err)
                assert SHORT_US / 1e6 <= dt < SHORT_US / 1e6 + 30, (name, dt)
                if name == "word":
                    assert int(out[0]) == _word_ref(0, 7), "a stopped poll returns payload 0"
            group.host_barrier()
            record = err.group_record()
            assert record is not None and record[1:3] == [0, CAUSE_TIMEOUT], record
            _clear_faults(group, pad, err)
            # a peer's fault stops the loop at once (the time bound is a minute)
            if rank == 1:
                err.report()  # an abort, recorded in the group's fault word
            group.host_barrier()
            t0 = time.monotonic()
            launch(LONG_US)
            dt = time.monotonic() - t0
            state, r, s, v, cause, _ = _local(err)
            assert (state, r, s, cause) == (2, rank, slot, CAUSE_PEER), _local(err)
            assert dt < LONG_US / 2e6, (name, dt)
            seen[name] = round(dt, 3)
            _clear_faults(group, pad, err)
        # a device-side check: this rank's word only, the group's fault word untouched
        _check_kernel[(1,)](err.address, 1 - rank, slot, 42)
        assert _local(err)[:5] == [2, 1 - rank, slot, 42, CAUSE_CHECK], _local(err)
        group.host_barrier()
        assert err.group_record() is None
        _clear_faults(group, pad, err)
    finally:
        err.detach()
        pad.close()
    return seen


@pytest.mark.parametrize("world", [pytest.param(("cpu", 2), id="cpu2")], indirect=True)
def test_ep_polling_loops_are_bounded_in_time_and_stop_on_a_group_fault(world):
    results = world.run(_loops_body)
    assert all(set(r) == {"below", "word", "row"} for r in results), results
