"""The data model of a communication schedule: chunks, point-to-point moves, collectives
and per-rank op lists with cross-rank dependencies (AutoOverlap's chunk abstraction).

A schedule moves *chunks*, logical row blocks of one tensor, between ranks. Chunk size is a
parameter of the schedule, independent of the compute kernel's tile size: a compute tile may
need several chunks and a chunk may feed several tiles (lowering maps one onto the other).

Ordering rules, which the checker and the lowering both assume:

* Each rank has one list of ops. The ops of one list are issued **in list order on one
  stream**: op ``i`` completes before op ``i + 1`` of the same rank starts. Same-rank order
  is therefore always a dependency and never needs to be written in ``deps``.
* ``deps`` of an op name other ops as ``(rank, index)`` (``index``: position in that rank's
  list); the op starts only after all of them have completed (for a transfer: landed).
* A :class:`P2P` lives in the list of the rank that issues it: the source for ``"push"``,
  the destination for ``"pull"``.
* A :class:`Collective` appears in the list of every rank in ``ranks``; the ``n``-th
  occurrence of the same ``(op, chunks, ranks)`` on each of them is one call (as with NCCL,
  every participant calls it). It completes for all participants at once.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property

from ..errors import InterlaceValueError

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
MODES = ("push", "pull")
BACKENDS = ("ce", "sm")

Ref = tuple[int, int]
"""An op's address: ``(rank, index in that rank's list)``."""


class ScheduleError(InterlaceValueError):
    """A schedule is malformed or does not realise its collective (names rank, op, cause)."""


@dataclass(frozen=True)
class Chunk:
    """Rows ``[lo, hi)`` of the full (gathered / unreduced) tensor ``tensor``.

    ``owner`` is the rank whose shard the rows are (all-gather) or the rank that must end
    with their sum (reduce-scatter; the partition's reducer in all-reduce)."""

    id: int
    tensor: str
    lo: int
    hi: int
    owner: int

    @property
    def rows(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class P2P:
    """Move chunk ``chunk`` (an id) from rank ``src`` to rank ``dst``.

    ``mode``: ``"push"`` (issued by ``src``) or ``"pull"`` (issued by ``dst``). ``reduce``:
    the destination adds the data into its accumulator instead of overwriting it;
    reduces into one accumulator may run concurrently (the runtime makes them atomic or
    stages them). ``backend``: ``"ce"`` (copy engine) or ``"sm"`` (SM loads/stores)."""

    chunk: int
    src: int
    dst: int
    mode: str = "push"
    reduce: bool = False
    backend: str = "ce"
    deps: tuple[Ref, ...] = ()

    @property
    def issuer(self) -> int:
        """The rank whose list holds this op."""
        return self.src if self.mode == "push" else self.dst


@dataclass(frozen=True)
class Collective:
    """A stock collective ``op`` (one of :data:`KINDS`) over ``chunks`` among ``ranks``.

    all_gather: each chunk's owner sends it to the others; reduce_scatter: each chunk's
    owner ends with the sum of every participant's copy; all_reduce: every participant
    does."""

    op: str
    chunks: tuple[int, ...]
    ranks: tuple[int, ...]
    deps: tuple[Ref, ...] = ()

    @property
    def key(self) -> tuple:
        return (self.op, self.chunks, self.ranks)


Op = P2P | Collective


@dataclass
class Schedule:
    """A collective ``kind`` realised as per-rank op lists.

    ``shard_rows[r]`` rows of the full tensor belong to rank ``r``, in rank order (rank
    ``r`` owns ``[offsets[r], offsets[r + 1])``); ``split`` is the number of sub-chunks a
    shard was cut into (informational; the chunks themselves are authoritative).
    ``ops[r]`` is rank ``r``'s op list (a missing key means no ops). Treat a schedule as
    immutable once built (derived tables are cached); build a new one to change it."""

    world_size: int
    kind: str
    shard_rows: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    ops: dict[int, list[Op]]
    split: int = 1

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        out = [0]
        for n in self.shard_rows:
            out.append(out[-1] + n)
        return tuple(out)

    @property
    def rows(self) -> int:
        """Rows of the full tensor."""
        return self.offsets[-1]

    def shard(self, rank: int) -> tuple[int, int]:
        return self.offsets[rank], self.offsets[rank + 1]

    def owner_of_row(self, row: int) -> int:
        return bisect_right(self.offsets, row) - 1

    def rank_ops(self, rank: int) -> list[Op]:
        return self.ops.get(rank, [])

    def op(self, ref: Ref) -> Op:
        return self.rank_ops(ref[0])[ref[1]]

    def refs(self) -> list[Ref]:
        """Every op's address, rank by rank, in list order."""
        return [(r, i) for r in range(self.world_size) for i in range(len(self.rank_ops(r)))]

    @cached_property
    def chunk_index(self) -> dict[int, Chunk]:
        return {c.id: c for c in self.chunks}

    def chunk(self, chunk_id: int) -> Chunk:
        return self.chunk_index[chunk_id]

    @cached_property
    def row_order(self) -> tuple[Chunk, ...]:
        """The chunks sorted by (tensor, lo): position in this list is a chunk's signal slot."""
        return tuple(sorted(self.chunks, key=lambda c: (c.tensor, c.lo, c.hi, c.id)))

    @cached_property
    def slots(self) -> dict[int, int]:
        """Chunk id -> arrival-signal slot (the chunk's index in row order)."""
        return {c.id: i for i, c in enumerate(self.row_order)}

    def num_ops(self) -> int:
        return sum(len(v) for v in self.ops.values())


def split_rows(lo: int, hi: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """Rows ``[lo, hi)`` cut into ``parts`` ranges as even as possible, empty ones dropped
    (sub-range ``k`` starts at ``lo + k * n // parts``, as in ``language.tile``).

    With ``align > 1`` every range but the last is a multiple of ``align`` rows (a GEMM's
    tile height: then no tile straddles two chunks of one shard)."""
    n = hi - lo
    if align > 1:
        per_part = -(-n // parts)
        step = -(-per_part // align) * align
        bounds = [min(hi, lo + k * step) for k in range(parts + 1)]
        return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    bounds = [lo + k * n // parts for k in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def describe(ref: Ref) -> str:
    """``"rank R op I"``: how errors name an op."""
    return f"rank {ref[0]} op {ref[1]}"
