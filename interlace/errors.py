"""The one exception hierarchy of interlace.

Every error interlace raises on purpose derives from :class:`InterlaceError`, so callers
can catch the library's failures without catching unrelated ones. Bad arguments raise the
builtin ``ValueError`` / ``TypeError`` (subclassed here so both spellings can be caught).
"""

from __future__ import annotations


class InterlaceError(RuntimeError):
    """Base class of every error raised by interlace."""


class InterlaceValueError(InterlaceError, ValueError):
    """An argument has the wrong shape, size, device or layout."""


class InterlaceTypeError(InterlaceError, TypeError):
    """An argument has the wrong type or dtype."""


class WaitTimeoutError(InterlaceError):
    """A device-side wait gave up after its spin bound.

    The kernel recorded which rank timed out waiting on which signal; the host raises this
    with that information instead of letting the GPU hang forever.
    """

    def __init__(self, op: str, rank: int, signal: str, observed: int):
        self.op, self.rank, self.signal, self.observed = op, rank, signal, observed
        super().__init__(
            f"{op}: rank {rank} timed out waiting on signal {signal} "
            f"(last value seen: {observed}); a peer never arrived, or ranks called "
            f"the op with different arguments"
        )
