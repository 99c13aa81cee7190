"""The pieces a trace is made of: spans (something that took time on a track) and
instants (something that happened at a moment), every time in ns on rank 0's clock, and
the track ids of the tracks that are not programs."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Chrome thread ids of the tracks that are not programs
TID_STREAM = 100_000
TID_EXPOSED = 200_000


@dataclass
class Span:
    rank: int
    tid: int
    name: str
    cat: str
    t0: int  # ns, rank 0's clock
    t1: int
    args: dict = field(default_factory=dict)

    @property
    def dur(self) -> int:
        return self.t1 - self.t0


@dataclass
class Instant:
    rank: int
    tid: int
    name: str
    cat: str
    t: int
    args: dict = field(default_factory=dict)
