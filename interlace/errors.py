"""The one exception hierarchy of interlace.

Every error interlace raises on purpose derives from :class:`InterlaceError`, so callers
can catch the library's failures without catching unrelated ones. Bad arguments raise the
builtin ``ValueError`` / ``TypeError`` (subclassed here so both spellings can be caught);
a wrong dtype is always an :class:`InterlaceTypeError`.

A call that fails *across ranks* (a wait that ran out of time, ranks that called an op
differently, a rank that aborted a call) raises a :class:`CrossRankError` on every rank of
the group: the first rank that detects the fault records it in the group's fault word,
every rank's waits see it and stop, and every rank raises the same class with the same
description (op, the rank that detected it, the cause). The context that saw it then
refuses further calls with :class:`ContextFailedError`: close it and build a new one on
every rank.
"""

from __future__ import annotations


class InterlaceError(RuntimeError):
    """Base class of every error raised by interlace."""


class InterlaceValueError(InterlaceError, ValueError):
    """An argument has the wrong shape, size, device or layout."""


class InterlaceTypeError(InterlaceError, TypeError):
    """An argument has the wrong type or dtype."""


class ContextClosedError(InterlaceError):
    """A context (or symmetric buffer) was used after ``close()``."""


class ContextFailedError(InterlaceError):
    """A context whose earlier call failed across ranks refuses every later call: its
    signals and buffers are in an unknown state on some rank. ``cause`` is the original
    error."""

    def __init__(self, op: str, cause: BaseException):
        self.op, self.cause = op, cause
        super().__init__(
            f"{op}: this context failed in an earlier call ({cause}); close() it and build "
            f"a new one on every rank"
        )


class CrossRankError(InterlaceError):
    """A call failed across ranks; raised on every rank of the group.

    ``op``: the op; ``rank``: the rank that detected the fault; ``seen_on``: the rank
    raising (None where only the local rank is involved); ``cause``: the description."""

    def __init__(self, op: str, rank: int, cause: str, seen_on: int | None = None):
        self.op, self.rank, self.cause, self.seen_on = op, rank, cause, seen_on
        where = "" if seen_on is None or seen_on == rank else f" (raised on rank {seen_on})"
        super().__init__(f"{op}: {cause}{where}")


class WaitTimeoutError(CrossRankError):
    """A device-side wait gave up after its time bound (``INTERLACE_WAIT_TIMEOUT_S``).

    The kernel recorded which rank timed out waiting on which signal; every rank raises
    this with that information instead of letting the GPU hang.
    """

    def __init__(
        self, op: str, rank: int, signal: str, observed: int, seen_on: int | None = None
    ):  # fmt: skip
        self.signal, self.observed = signal, observed
        super().__init__(
            op, rank,
            f"rank {rank} timed out waiting on signal {signal} (last value seen: {observed}); "
            f"a peer never arrived, or ranks called the op with different arguments",
            seen_on,
        )  # fmt: skip


class CallMismatchError(CrossRankError, InterlaceValueError):
    """Ranks called one op of one context with different arguments (shapes, strategy,
    buffer set, or a different number of calls); detected on the device from the call
    fingerprints the ranks' signals carry, before any data of the call is used."""

    def __init__(self, op: str, rank: int, cause: str, seen_on: int | None = None):
        super().__init__(op, rank, cause, seen_on)


class PeerAbortError(CrossRankError):
    """A rank aborted a call (an exception inside it, or ``interlace.abort()``) while its
    peers were in it."""
