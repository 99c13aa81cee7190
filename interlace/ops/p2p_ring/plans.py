"""Step plans of the ``p2p_ring`` strategy: which slice each step computes, where its
result goes and where the data it needs comes from. Pure logic on rank numbers.

Two schedules:

* ``ring``: every message goes to the next rank and comes from the previous one
  (unidirectional; gathered slices are forwarded, partial sums accumulate on the way).
* ``pairwise``: round-robin pairing (circle method, even world sizes): in each round every
  rank exchanges with one partner, so each link carries traffic both ways and every slice
  travels straight from its owner (or straight to it).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import InterlaceValueError

SCHEDULES = ("ring", "pairwise")


def resolve_schedule(schedule: str, world: int, kind: str, op: str = "p2p_ring") -> str:
    """The schedule to run. ``auto``: ``ring`` for reductions (partial sums accumulate in
    flight, one add per hop); ``pairwise`` for gathers and all-to-all on even world sizes
    (each slice comes straight from its owner, no forwarding chain), ``ring`` otherwise.
    ``pairwise`` on an odd world size raises."""
    if schedule == "auto":
        return "pairwise" if kind != "reduce" and world % 2 == 0 else "ring"
    if schedule not in SCHEDULES:
        raise InterlaceValueError(
            f"{op}: schedule must be one of {('auto', *SCHEDULES)}, got {schedule!r}"
        )
    if schedule == "pairwise" and world % 2:
        raise InterlaceValueError(
            f"{op}: schedule='pairwise' needs an even world size (each round pairs every "
            f"rank with one partner), got {world}; use schedule='ring' or 'auto'"
        )
    return schedule


def partner(rank: int, rnd: int, world: int) -> int:
    """Rank ``rank``'s partner in round ``rnd`` (0 .. world - 2) of the circle-method
    round robin: over the rounds every rank meets every other rank exactly once."""
    n = world - 1
    if rank == n:
        return rnd
    if rank == rnd:
        return n
    return (2 * rnd - rank) % n


@dataclass(frozen=True)
class Plan:
    """What one rank does, step by step (``world`` steps; the last computes only).

    ``order[i]``: the slice (owner rank) step ``i`` computes.
    ``dest[i]``: the peer step ``i`` sends to (``i < world - 1``).
    ``src[i]``: the peer whose message lands in this rank's slot ``i``; it is posted with
    step ``i``'s send.
    ``acc[i]``: the slots added into step ``i``'s result (reductions only).
    """

    order: tuple[int, ...]
    dest: tuple[int, ...]
    src: tuple[int, ...]
    acc: tuple[tuple[int, ...], ...] = ()


def gather_plan(schedule: str, rank: int, world: int) -> Plan:
    """All-gather then compute: own slice first. Step ``i`` sends slice ``order[i]``
    (ring: forwarded once it has arrived) or the own slice (pairwise) to ``dest[i]``, and
    receives slice ``order[i + 1]`` from ``src[i]``."""
    r, w = rank, world
    if schedule == "ring":
        order = tuple((r - i) % w for i in range(w))
        return Plan(order, ((r + 1) % w,) * (w - 1), ((r - 1) % w,) * (w - 1))
    partners = tuple(partner(r, t, w) for t in range(w - 1))
    return Plan((r, *partners), partners, partners)


def reduce_plan(schedule: str, rank: int, world: int) -> Plan:
    """Compute then reduce-scatter: own slice last. Step ``i`` computes the partial of
    slice ``order[i]``, adds the slots ``acc[i]`` and sends the sum to ``dest[i]`` (the
    last step keeps it)."""
    r, w = rank, world
    if schedule == "ring":
        order = tuple((r - 1 - i) % w for i in range(w))
        acc = ((),) + tuple((i - 1,) for i in range(1, w))
        return Plan(order, ((r + 1) % w,) * (w - 1), ((r - 1) % w,) * (w - 1), acc)
    partners = tuple(partner(r, t, w) for t in range(w - 1))
    acc = ((),) * (w - 1) + (tuple(range(w - 1)),)
    return Plan((*partners, r), partners, partners, acc)


def all_to_all_plan(schedule: str, rank: int, world: int) -> Plan:
    """Compute then all-to-all: own slice last. Step ``i`` computes the slice owned by
    ``order[i]`` and sends it there; slot ``i`` receives this rank's slice from ``src[i]``.
    ``ring`` shifts by ``i + 1`` at step ``i`` (every step is a permutation)."""
    r, w = rank, world
    if schedule == "ring":
        order = tuple((r + 1 + i) % w for i in range(w - 1))
        return Plan((*order, r), order, tuple((r - 1 - i) % w for i in range(w - 1)))
    partners = tuple(partner(r, t, w) for t in range(w - 1))
    return Plan((*partners, r), partners, partners)
