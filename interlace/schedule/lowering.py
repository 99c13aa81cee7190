"""Lowering a checked schedule to what one rank's runtime executes.

* :func:`transfers`: the rank's transfers in issue order, each with the signal slot it
  raises on its destination and the signals it must see before it may start.
* :func:`consumer_plan`: for a GEMM consuming gathered rows (all-gather), the order in
  which to visit its m-tiles (own rows first, then in arrival order) and, per tile, the
  signal slots to wait on.
* :func:`producer_plan`: for a GEMM producing partial sums to reduce-scatter, the order in
  which to compute its m-tiles (rows sent first come first, rows that stay last) and, per
  tile, the local slots to bump so a transfer can start once all of its rows are done.

Signal slots: on every rank, slot ``i`` belongs to the ``i``-th chunk in row order
(:attr:`Schedule.row_order`), so the chunks a tile needs have neighbouring slots. A slot
counts transfers that landed; each call starts from zero (the runtime resets them).

Times are steps of an as-soon-as-possible run in which every transfer takes one step
(``Analysis.level``): good enough to order tiles, and exact for the templates, whose
transfers all have the same size. Lowering supports schedules of :class:`P2P` ops only.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass

from ..errors import InterlaceValueError
from .checker import Analysis, check
from .chunks import Chunk, Collective, Schedule, ScheduleError

__all__ = [
    "ConsumerPlan",
    "chunk_order",
    "ProducerPlan",
    "Transfer",
    "as_tensors",
    "consumer_plan",
    "n_signals",
    "producer_plan",
    "signal_counts",
    "transfers",
]


@dataclass(frozen=True)
class Transfer:
    """Copy rows ``[lo, hi)`` (chunk ``chunk_id``) from ``src`` to ``dst``, adding into
    the destination if ``reduce``, then raise signal slot ``signal`` on ``dst`` by one.

    ``waits``: ``(rank, slot, value)`` triples; the transfer may start once signal ``slot``
    of rank ``rank`` has reached ``value`` for each (the cross-rank dependencies; those on
    the issuing rank's earlier ops are implied by stream order and not listed)."""

    chunk_id: int
    src: int
    dst: int
    lo: int
    hi: int
    signal: int
    backend: str
    reduce: bool
    mode: str = "push"
    waits: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class ConsumerPlan:
    """Tile order and per-tile waits of an all-gather's consumer on ``rank``.

    Tile ``t`` is rows ``[t * block_m, min(rows, (t + 1) * block_m))``. ``waits[i]`` lists
    the slots (padded with -1 to ``max_waits``) that must reach ``expected`` before tile
    ``tile_order[i]`` may be read."""

    rank: int
    rows: int
    block_m: int
    max_waits: int
    tile_order: tuple[int, ...]
    waits: tuple[tuple[int, ...], ...]
    expected: int = 1

    def as_tensors(self, device="cpu"):
        """``(tile_order [n], waits [n, max_waits])`` as int32 tensors."""
        import torch

        return (
            torch.tensor(self.tile_order, dtype=torch.int32, device=device),
            torch.tensor(self.waits, dtype=torch.int32, device=device).reshape(
                len(self.tile_order), self.max_waits
            ),
        )


@dataclass(frozen=True)
class ProducerPlan:
    """Tile order and per-tile notifications of a reduce-scatter's producer on ``rank``.

    ``notifies[i]``: the local slots (padded with -1 to ``max_notifies``) that tile
    ``tile_order[i]`` bumps by one when written; chunk slot ``s`` is complete when it has
    been bumped ``expected[s]`` times (the number of tiles overlapping it)."""

    rank: int
    rows: int
    block_m: int
    max_notifies: int
    tile_order: tuple[int, ...]
    notifies: tuple[tuple[int, ...], ...]
    expected: tuple[int, ...]

    def as_tensors(self, device="cpu"):
        """``(tile_order [n], notifies [n, max_notifies], expected [slots])`` as int32."""
        import torch

        return (
            torch.tensor(self.tile_order, dtype=torch.int32, device=device),
            torch.tensor(self.notifies, dtype=torch.int32, device=device).reshape(
                len(self.tile_order), self.max_notifies
            ),
            torch.tensor(self.expected, dtype=torch.int32, device=device),
        )


def as_tensors(plan: ConsumerPlan | ProducerPlan, device="cpu"):
    """The plan's tables as int32 torch tensors on ``device`` (see each plan's method)."""
    return plan.as_tensors(device)


def n_signals(schedule: Schedule) -> int:
    """Signal slots each rank needs: one per chunk."""
    return len(schedule.chunks)


def _lowerable(schedule: Schedule, rank: int) -> Analysis:
    a = check(schedule)
    if not (isinstance(rank, int) and 0 <= rank < schedule.world_size):
        raise InterlaceValueError(f"rank must be in [0, {schedule.world_size}), got {rank!r}")
    for ref in schedule.refs():
        if isinstance(schedule.op(ref), Collective):
            raise ScheduleError(
                f"rank {ref[0]} op {ref[1]}: lowering supports P2P ops only, not collectives"
            )
    return a


def signal_counts(schedule: Schedule, rank: int) -> list[int]:
    """For each slot, how many transfers land on ``rank`` (the value it ends a call at)."""
    a = _lowerable(schedule, rank)
    return [len(a.writers.get((rank, c.id), [])) for c in schedule.row_order]


def transfers(schedule: Schedule, rank: int) -> list[Transfer]:
    """The transfers ``rank`` issues, in order, with their slots and waits."""
    a = _lowerable(schedule, rank)
    s = schedule
    out = []
    for op in s.rank_ops(rank):
        c = s.chunk(op.chunk)
        waits: dict[tuple[int, int], int] = {}
        for dep in op.deps:
            if dep[0] == rank:
                continue  # an earlier op of this rank: implied by stream order
            d = a.node[tuple(dep)]
            dop = s.op(dep)
            landing = (dop.dst, dop.chunk)
            # Slot count reached only once ``dop`` has landed: every arrival not after it.
            value = sum(1 for w in a.writers[landing] if not a.before(d, w))
            key = (dop.dst, s.slots[dop.chunk])
            waits[key] = max(waits.get(key, 0), value)
        out.append(
            Transfer(
                c.id,
                op.src,
                op.dst,
                c.lo,
                c.hi,
                s.slots[c.id],
                op.backend,
                op.reduce,
                op.mode,
                tuple((r, slot, v) for (r, slot), v in sorted(waits.items())),
            )
        )
    return out


def _check_tiling(schedule: Schedule, block_m: int, limit: int, limit_name: str) -> None:
    for name, v in (("block_m", block_m), (limit_name, limit)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InterlaceValueError(f"{name} must be an int >= 1, got {v!r}")
    if len({c.tensor for c in schedule.chunks}) != 1:
        raise ScheduleError("tile plans need the chunks of exactly one tensor")


def _tile_chunks(schedule: Schedule, block_m: int) -> list[list[int]]:
    """For each m-tile, the row-order positions (= slots) of the chunks it overlaps."""
    los = [c.lo for c in schedule.row_order]
    his = [c.hi for c in schedule.row_order]
    m = schedule.rows
    out = []
    for t in range(-(-m // block_m)):
        lo, hi = t * block_m, min(m, (t + 1) * block_m)
        out.append(list(range(bisect_right(his, lo), bisect_left(los, hi))))
    return out


def _padded(slots: list[int], width: int) -> tuple[int, ...]:
    return tuple(slots) + (-1,) * (width - len(slots))


def consumer_plan(schedule: Schedule, rank: int, block_m: int, max_waits: int = 4) -> ConsumerPlan:
    """Tile order (own rows first, then by arrival, ties by row) and per-tile waits (the
    slots of the remote chunks a tile overlaps) for an all-gather's consumer on ``rank``."""
    if schedule.kind != "all_gather":
        raise ScheduleError(f"consumer_plan needs an all_gather schedule, got {schedule.kind}")
    a = _lowerable(schedule, rank)
    _check_tiling(schedule, block_m, max_waits, "max_waits")
    chunks = schedule.row_order
    arrival = [0 if c.owner == rank else a.level[a.writers[(rank, c.id)][0]] + 1 for c in chunks]
    tiles = _tile_chunks(schedule, block_m)
    ready = [max(arrival[i] for i in slots) for slots in tiles]
    order = sorted(range(len(tiles)), key=lambda t: (ready[t], t))
    remote = [[i for i in slots if chunks[i].owner != rank] for slots in tiles]
    for t, slots in enumerate(remote):
        if len(slots) > max_waits:
            raise ScheduleError(
                f"rank {rank}: tile {t} (rows [{t * block_m}, "
                f"{min(schedule.rows, (t + 1) * block_m)})) needs {len(slots)} remote "
                f"chunks, more than max_waits={max_waits}: use larger chunks (smaller split), "
                "a smaller block_m or a larger max_waits"
            )
    waits = tuple(_padded(remote[t], max_waits) for t in order)
    return ConsumerPlan(rank, schedule.rows, block_m, max_waits, tuple(order), waits)


def producer_plan(
    schedule: Schedule, rank: int, block_m: int, max_notifies: int = 4
) -> ProducerPlan:
    """Tile order for a reduce-scatter's (or all-reduce's) producer on ``rank``: tiles whose
    rows this rank sends first come first, rows it never sends (its own) last, ties by row;
    plus the slots each tile bumps when written."""
    if schedule.kind not in ("reduce_scatter", "all_reduce"):
        raise ScheduleError(
            f"producer_plan needs a reduce_scatter or all_reduce schedule, got {schedule.kind}"
        )
    a = _lowerable(schedule, rank)
    _check_tiling(schedule, block_m, max_notifies, "max_notifies")
    never = max(a.level, default=0) + 1
    need = [
        min((a.level[n] for n in a.readers.get((rank, c.id), [])), default=never)
        for c in schedule.row_order
    ]
    tiles = _tile_chunks(schedule, block_m)
    first = [min(need[i] for i in slots) for slots in tiles]
    order = sorted(range(len(tiles)), key=lambda t: (first[t], t))
    expected = [0] * len(need)
    for slots in tiles:
        if len(slots) > max_notifies:
            raise ScheduleError(
                f"rank {rank}: a tile of block_m={block_m} rows overlaps {len(slots)} chunks, "
                f"more than max_notifies={max_notifies}: use larger chunks or a smaller block_m"
            )
        for i in slots:
            expected[i] += 1
    notifies = tuple(_padded(tiles[t], max_notifies) for t in order)
    return ProducerPlan(
        rank, schedule.rows, block_m, max_notifies, tuple(order), notifies, tuple(expected)
    )


def chunk_order(schedule: Schedule, rank: int) -> list[tuple[Chunk, int | None]]:
    """The chunks in the order a chunk-granular kernel on ``rank`` visits them, each with
    the signal slot to wait on before reading it (``None``: nothing to wait for).

    * all-gather (a consumer): the rank's own chunks first, then the others by arrival
      (ties by row); slot = the chunk's row-order slot.
    * reduce-scatter / all-reduce (a producer of partial sums): the chunks this rank sends
      first come first, its own chunks (never sent) last, ties by row; no waits here (the
      producer's epilogue, not a transfer, moves the data).

    The op layer turns this into its kernel's segment table; chunk boundaries and order
    come from the (checked) schedule, chunk size from its ``split`` (and ``align``)."""
    a = _lowerable(schedule, rank)
    chunks = schedule.row_order
    if schedule.kind == "all_gather":
        arrival = [
            0 if c.owner == rank else a.level[a.writers[(rank, c.id)][0]] + 1 for c in chunks
        ]
        order = sorted(range(len(chunks)), key=lambda i: (arrival[i], i))
        return [(chunks[i], None if chunks[i].owner == rank else i) for i in order]
    never = max(a.level, default=0) + 1
    first_send = [
        min((a.level[n] for n in a.readers.get((rank, c.id), [])), default=never) for c in chunks
    ]
    order = sorted(range(len(chunks)), key=lambda i: (chunks[i].owner == rank, first_send[i], i))
    return [(chunks[i], None) for i in order]
