"""Signal pads, error words and the group's fault word: the host half of device-side
synchronisation and of cross-rank failure reports.

A :class:`SignalPad` is a zeroed symmetric int32 tensor cut into named regions, so that a
slot index recorded by a failed wait can be turned back into a readable name. Behind the
op's regions every pad has two reserved ones:

* ``fault`` (:data:`FAULT_WORDS` words): rank 0's copy is the group's *fault word*,
  ``[state, rank, cause, slot, seen, expected]`` (state 0 = fine, 1 = being written,
  2 = written). The first rank that detects a fault (a wait out of time, a call
  fingerprint that differs from its own, an aborted call) claims it; every rank's waits
  poll it and stop; every rank's host reads it and raises the same error.
* ``call`` (:data:`CALL_WORDS` words): this rank's current call: ``[fingerprint,
  n_fields, field values...]``, written in stream order before the call's kernels. Device
  barriers carry the fingerprint (``language.primitives.barrier_all``); the host reads
  every rank's copy to name what differs when ranks called differently.

An :class:`ErrorWord` is :data:`ERROR_WORDS` int32 words that a rank's own waits write
when they stop: ``[state, rank, slot, seen, cause, expected]``, then (int64) the address
of the group's fault word and (int64) the address of this rank's ``call`` slot, so that
device code finds both through the one ``err`` argument every wait already takes. On the
``cuda`` backend it lives in pinned host memory, which the GPU writes through unified
addressing, so the host reads it without synchronising the device.

Waits are bounded in *time*: :func:`default_wait_bound_us` (``INTERLACE_WAIT_TIMEOUT_S``,
default :data:`DEFAULT_WAIT_TIMEOUT_S` seconds) on both backends, measured with the GPU's
global timer on device and the host clock in the interpreter.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import weakref

import torch

from ..errors import (
    CallMismatchError,
    CrossRankError,
    InterlaceValueError,
    PeerAbortError,
    WaitTimeoutError,
)
from .group import Group
from .symmetric import symm_zeros

#: The environment variable that sets the wait bound, in seconds (a float).
WAIT_TIMEOUT_ENV = "INTERLACE_WAIT_TIMEOUT_S"
#: Default time bound of a device wait: long enough for a peer's first call to compile
#: its kernels, short enough that a hang ends in an error while the user still watches.
DEFAULT_WAIT_TIMEOUT_S = 10.0
#: Mirrors ``language.primitives.REMOTE_SLOT`` (the runtime layer cannot import it).
REMOTE_SLOT = 1 << 16

# Causes recorded by device waits and host reports (mirrored in language.primitives).
CAUSE_TIMEOUT, CAUSE_MISMATCH, CAUSE_PEER, CAUSE_ABORT = 1, 2, 3, 4
#: A device-side argument check every rank makes alike (``primitives.record_check``):
#: recorded in the rank's own error word only; the op raises its own error for it.
CAUSE_CHECK = 5
FAULT_WORDS = 8  # [state, rank, cause, slot, seen, expected, -, -]
CALL_WORDS = 16  # [fingerprint, n_fields, fields...]
MAX_CALL_FIELDS = CALL_WORDS - 2
#: How long a rank describing a call mismatch waits for every peer's ``call`` slot to be
#: written (a peer that has not started its call yet writes it soon after), so that every
#: rank names the same difference.
CALL_SLOT_WAIT_S = 2.0
#: How long a rank reading the group's fault record waits for the rank that claimed it
#: to finish writing it (microseconds of work for that rank).
RECORD_WAIT_S = 1.0
ERROR_WORDS = 16  # [state, rank, slot, seen, cause, expected, group(i64), call(i64), ...]


def default_wait_bound_us(group: Group | None = None) -> int:
    """The time bound of device waits in microseconds, from ``INTERLACE_WAIT_TIMEOUT_S``
    (seconds, default :data:`DEFAULT_WAIT_TIMEOUT_S`)."""
    env = os.environ.get(WAIT_TIMEOUT_ENV)
    try:
        seconds = float(env) if env else DEFAULT_WAIT_TIMEOUT_S
    except ValueError:
        raise InterlaceValueError(
            f"{WAIT_TIMEOUT_ENV} must be a number of seconds, got {env!r}"
        ) from None
    if not 0 < seconds <= 2000:
        raise InterlaceValueError(f"{WAIT_TIMEOUT_ENV} must be in (0, 2000] seconds, got {env!r}")
    return max(1, int(seconds * 1e6))


#: The wait bound every kernel takes as its ``max_spins`` argument is a time in µs.
default_max_spins = default_wait_bound_us


class SignalPad:
    """A zeroed symmetric int32 tensor with named regions of slots, and the reserved
    ``fault`` and ``call`` regions after them (see the module docstring). ``size`` counts
    the op's regions only: an op may clear slots up to it without touching the reserved
    ones."""

    def __init__(self, group: Group, regions: dict[str, int]):
        self.group = group
        self.regions: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in regions.items():
            self.regions[name] = (offset, int(size))
            offset += int(size)
        self.size = offset
        self.regions["fault"] = (offset, FAULT_WORDS)
        self.regions["call"] = (offset + FAULT_WORDS, CALL_WORDS)
        self.buffer = symm_zeros((offset + FAULT_WORDS + CALL_WORDS,), torch.int32, group)

    def offset(self, region: str) -> int:
        return self.regions[region][0]

    def local(self, region: str) -> torch.Tensor:
        self.buffer.check_open("signal pad")
        start, size = self.regions[region]
        return self.buffer.local[start : start + size]

    def peer(self, region: str, rank: int) -> torch.Tensor:
        self.buffer.check_open("signal pad")
        start, size = self.regions[region]
        return self.buffer.peers[rank][start : start + size]

    def address(self, region: str, rank: int) -> int:
        """Address (in this process) of rank ``rank``'s copy of ``region``."""
        return self.peer(region, rank).data_ptr()

    @property
    def ptrs(self) -> torch.Tensor:
        return self.buffer.ptrs

    def describe(self, slot: int) -> str:
        """Readable name of a slot recorded by a failed wait (``REMOTE_SLOT`` encoded
        slots live on another rank's pad)."""
        if slot >= REMOTE_SLOT:
            peer, slot = divmod(slot, REMOTE_SLOT)
            return f"{self.describe(slot)} on rank {peer - 1}"
        for name, (start, size) in self.regions.items():
            if start <= slot < start + size:
                return f"{name}[{slot - start}]"
        return f"slot {slot}"

    def close(self) -> None:
        self.buffer.close()


_open_words: weakref.WeakSet[ErrorWord] = weakref.WeakSet()
_fence = threading.Lock()  # acquiring it is a full memory fence on the host


class ErrorWord:
    """Where this rank's waits report why they stopped; with :meth:`attach`, also the
    door to the group's fault word and this rank's call slot. See the module docstring."""

    def __init__(self, group: Group):
        self.group = group
        pinned = group.backend == "cuda"
        self.words = torch.zeros(ERROR_WORDS, dtype=torch.int32, pin_memory=pinned)
        self.tensor = self.words[:4]  # [state, rank, slot, seen]
        self.address = self.words.data_ptr()
        self._state = ctypes.c_int32.from_address(self.address)  # read on every call
        self.pad: SignalPad | None = None
        self._group_state = None  # host view of the group's fault state (cpu backend)
        self.in_call = False  # set by an op between the start and the end of a call
        self.op = "op"
        _open_words.add(self)

    def attach(self, pad: SignalPad, op: str = "op") -> None:
        """Make ``pad``'s reserved regions this word's group fault word (rank 0's copy)
        and call slot (this rank's copy): every wait given this word then stops when any
        rank of the group records a fault."""
        self.pad, self.op = pad, op
        addresses = self.words[6:10].view(torch.int64)
        addresses[0] = pad.address("fault", 0)
        addresses[1] = pad.address("call", self.group.rank)
        if self.group.backend == "cpu":  # /dev/shm: the host reads it directly
            self._group_state = ctypes.c_int32.from_address(pad.address("fault", 0))

    def detach(self) -> None:
        """Forget the pad (it is being freed): waits then report only into this word."""
        self.words[6:10].zero_()
        self.pad, self._group_state = None, None

    # ---------------------------------------------------------------- host side
    def fault_pending(self) -> bool:
        """A wait of this rank stopped, or (cpu backend, where the host can read it
        directly) some rank recorded a fault in the group's fault word. No device sync."""
        if self._state.value != 0:
            return True
        return self._group_state is not None and self._group_state.value != 0

    def group_record(self, sync: bool = True) -> list[int] | None:
        """The group's fault record ``[state, rank, cause, slot, seen, expected]`` (None
        without a pad or while nothing is recorded). On ``cuda`` this reads device memory:
        it waits for the current stream."""
        if self.pad is None or self.pad.buffer.closed:
            return None
        if self._group_state is not None and self._group_state.value == 0:
            return None
        record = [int(v) for v in self.pad.peer("fault", 0).tolist()]
        # state 1: a rank has claimed the word and is writing its fields (state 2 when
        # done): read again until they are all there, so that no rank reads half a record
        deadline = time.monotonic() + RECORD_WAIT_S
        while record[0] == 1 and time.monotonic() < deadline:
            time.sleep(0.0005)
            record = [int(v) for v in self.pad.peer("fault", 0).tolist()]
        return record if record[0] != 0 else None

    def raise_if_set(self, op: str, describe=str) -> None:
        """Raise the fault a wait recorded (no device sync while there is none); see
        :meth:`error`."""
        if not self.fault_pending():  # the common case
            return
        raise self.error(op, describe)

    def error(self, op: str, describe=str, sync: bool = True) -> CrossRankError:
        """The error to raise for what is recorded: the group's record where there is one
        (every rank builds the same error from it), else this rank's own. Clears this
        rank's word (the group's record stays: the context is failed)."""
        local = [int(v) for v in self.words[:6].tolist()]
        record = self.group_record(sync) if sync or self._group_state is not None else None
        self.words[:6].zero_()
        me = self.group.rank
        if record is None:
            _, rank, slot, seen, cause, expected = local
            if cause in (0, CAUSE_TIMEOUT, CAUSE_PEER):
                return WaitTimeoutError(op, rank, describe(slot), seen)
            record = [2, rank, cause, slot, seen, expected]
        _, rank, cause, slot, seen, expected = record[:6]
        if cause == CAUSE_CHECK:  # (an op that records checks raises its own error first)
            return CrossRankError(
                op, rank, f"rank {rank} failed a device-side check at {describe(slot)} "
                f"(value {seen})", me,
            )  # fmt: skip
        if cause == CAUSE_MISMATCH:
            return CallMismatchError(op, rank, self._mismatch_text(op, rank, seen, expected), me)
        if cause == CAUSE_ABORT:
            return PeerAbortError(op, rank, f"rank {rank} aborted the call", me)
        return WaitTimeoutError(op, rank, describe(slot), seen, seen_on=me)

    def _mismatch_text(self, op: str, rank: int, seen: int, expected: int) -> str:
        """Name what differs between the ranks' calls, from their ``call`` slots (read
        again until every rank's is written, for at most ``CALL_SLOT_WAIT_S``)."""
        calls = describe_calls(self.pad) if self.pad is not None else None
        deadline = time.monotonic() + CALL_SLOT_WAIT_S
        while calls is not None and not calls.complete() and time.monotonic() < deadline:
            time.sleep(0.002)
            calls = describe_calls(self.pad)
        if calls:
            text = calls.difference(op)
            if text:
                return text
        return (
            f"rank {rank} waited for a peer's call fingerprint {expected:#x} and saw "
            f"{seen:#x}: ranks called {op} with different arguments"
        )

    # ---------------------------------------------------------------- reports
    def report(self, cause: int = CAUSE_ABORT, slot: int = 0) -> None:
        """Record a fault found on the host (``cause``) in the group's fault word, so that
        every rank's waits stop and every rank raises. First wins; best effort (a host
        report does not claim the word atomically against a device one)."""
        if self.pad is None or self.pad.buffer.closed:
            return
        me = self.group.rank
        fields = [me, cause, slot, 0, 0]
        if self.group.backend == "cpu":
            state = self._group_state
            with _fence:
                if state.value != 0:
                    return
                state.value = 1
            base = self.pad.address("fault", 0)
            for i, v in enumerate(fields):
                ctypes.c_int32.from_address(base + 4 * (i + 1)).value = v
            with _fence:
                state.value = 2
            return
        from .streams import stream_write_value32

        word = self.pad.peer("fault", 0).view(torch.uint32)
        stream = torch.cuda.Stream(self.group.device)  # not behind this rank's stuck work
        with torch.cuda.stream(stream):
            for i, v in enumerate(fields):
                stream_write_value32(word, i + 1, v)
            stream_write_value32(word, 0, 2)
        stream.synchronize()


def abort_open_calls(every: bool = False) -> int:
    """Report an abort in the group fault word of every context of this process that is in
    the middle of a call (``ErrorWord.in_call``; with ``every``, of every open context), so
    their peers stop waiting at once instead of running out of time; those contexts then
    refuse further calls on every rank. For an exception handler around a rank's step:
    the rank is giving up, its peers should too. Returns how many were reported."""
    n = 0
    for word in list(_open_words):
        if (word.in_call or every) and word.pad is not None:
            word.report(CAUSE_ABORT)
            word.in_call = False
            n += 1
    return n


class CallRecord:
    """Every rank's last call descriptor of one context (see :func:`describe_calls`)."""

    def __init__(
        self, names: tuple[str, ...] | None, fingerprints: list[int], per_rank: list[list[int]]
    ):  # fmt: skip
        self.names, self.fingerprints, self.per_rank = names, fingerprints, per_rank

    def complete(self) -> bool:
        """Every rank's slot holds a call (a rank that has not begun one has fingerprint
        0)."""
        return all(fp != 0 for fp in self.fingerprints)

    def difference(self, op: str) -> str | None:
        """``"rank 1 called gemm_rs with M = 256, rank 0 with M = 128"`` for the first
        pair of ranks whose descriptors differ (ranks without a call left out), or
        None."""
        called = [r for r, fp in enumerate(self.fingerprints) if fp != 0]
        if not called:
            return None
        first = called[0]
        base = self.per_rank[first]
        for r in called[1:]:
            fields = self.per_rank[r]
            if fields == base:
                mine, theirs = self.fingerprints[r] & 0xFF, self.fingerprints[first] & 0xFF
                if mine != theirs:  # the same arguments, not the same call
                    return (
                        f"rank {r} is at call {mine} of this {op} context, rank {first} at "
                        f"call {theirs} (counted modulo 256): a rank skipped or added a call"
                    )
                continue
            if len(fields) != len(base) or self.names is None:
                return f"rank {r} called {op} differently from rank {first} ({fields} vs {base})"
            diffs = [(n, a, b) for n, a, b in zip(self.names, fields, base, strict=True) if a != b]
            parts_r = ", ".join(f"{n} = {_show(n, a)}" for n, a, _ in diffs)
            parts_0 = ", ".join(f"{n} = {_show(n, b)}" for n, _, b in diffs)
            return f"rank {r} called {op} with {parts_r}, rank {first} with {parts_0}"
        return None


_names_of_hash: dict[int, str] = {}


def field_value(value) -> int:
    """A call field as the int32 stored in a call slot (strings by a stable hash)."""
    if isinstance(value, bool) or value is None:
        return int(bool(value)) if value is not None else -1
    if isinstance(value, int):
        return value if -(1 << 31) <= value < (1 << 31) else hash_text(str(value))
    text = str(value)
    return hash_text(text)


def hash_text(text: str) -> int:
    import zlib

    h = zlib.crc32(text.encode()) & 0x7FFFFFFF
    _names_of_hash[h] = text
    return h


def _show(name: str, value: int):
    return _names_of_hash.get(value, value) if value > 1 << 20 else value


def describe_calls(pad: SignalPad, names: tuple[str, ...] | None = None) -> CallRecord | None:
    """Read every rank's ``call`` slot (on ``cuda``: a device read that waits for the
    current stream) and decode it with the field ``names`` of the local call."""
    try:
        slots = [pad.peer("call", r).tolist() for r in range(pad.group.world_size)]
    except Exception:  # noqa: BLE001 - a diagnostic: never raise a second error here
        return None
    names = names or getattr(pad, "call_names", None)
    per_rank = [list(s[2 : 2 + max(0, min(int(s[1]), MAX_CALL_FIELDS))]) for s in slots]
    return CallRecord(names, [int(s[0]) for s in slots], per_rank)
