"""Symbolic execution of a schedule on the CPU: proves it realises its collective.

Every (rank, chunk) pair is a *location*. Its value is ``None`` (no data) or the set of
ranks whose contribution it holds: for an all-gather the owner holds ``{owner}`` of its
chunks and nothing else at the start; for a reduce-scatter / all-reduce every rank holds
its own partial ``{rank}`` of every chunk. An overwriting transfer copies the source's
set, a reducing one adds it (the sets must be disjoint: overlap is double counting).

Ops run when their dependencies allow, so the checker reasons about *every* interleaving
through the happens-before order (dependencies plus same-rank program order): a transfer
may read a location only if every op writing it is ordered before or after the read, two
writes to a location may be unordered only if both reduce, and the value read is the fold
of the writes ordered before it. A schedule that passes therefore works however the
transfers' timing turns out.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from .chunks import BACKENDS, KINDS, MODES, P2P, Collective, Ref, Schedule, ScheduleError
from .chunks import describe as _name

__all__ = ["Analysis", "analyze", "check"]

Loc = tuple[int, int]  # (rank, chunk id)


@dataclass
class Analysis:
    """The dependency graph of a checked schedule.

    Ops are nodes; the matched occurrences of one collective call share a node. ``node``
    maps every op's ref to its node, ``topo`` lists nodes in a topological order, ``level``
    is a node's step in an as-soon-as-possible run where every op takes one step (an op
    with nothing before it is at level 0), ``anc[n]`` is the bit mask of nodes before
    ``n``. ``writers[loc]`` / ``readers[loc]``: nodes that write / read a location. Nodes
    are numbered in (rank, index) order of their first op, and ``topo`` takes the lowest
    ready node first, so errors come out in a stable order."""

    schedule: Schedule
    node: dict[Ref, int]
    members: list[list[Ref]]
    topo: list[int]
    level: list[int]
    anc: list[int]
    readers: dict[Loc, list[int]]
    writers: dict[Loc, list[int]]

    def before(self, a: int, b: int) -> bool:
        """Whether node ``a`` completes before node ``b`` starts, in every run."""
        return bool((self.anc[b] >> a) & 1)

    def ordered(self, a: int, b: int) -> bool:
        return self.before(a, b) or self.before(b, a)

    def name(self, n: int) -> str:
        return _name(self.members[n][0])


def check(schedule: Schedule) -> Analysis:
    """Raise :class:`ScheduleError` unless ``schedule`` realises its collective; return the
    analysis (dependency graph, levels) that lowering builds on."""
    a = analyze(schedule)
    _Executor(a).run()
    return a


# --------------------------------------------------------------------------------------
# Structure
# --------------------------------------------------------------------------------------


def _validate(s: Schedule) -> None:
    w = s.world_size
    if w < 1:
        raise ScheduleError(f"world_size must be >= 1, got {w}")
    if s.kind not in KINDS:
        raise ScheduleError(f"kind must be one of {list(KINDS)}, got {s.kind!r}")
    if len(s.shard_rows) != w or any(n < 0 for n in s.shard_rows) or s.rows < 1:
        raise ScheduleError(
            f"shard_rows must be {w} counts >= 0 with a positive sum, got {s.shard_rows}"
        )
    bad = [r for r in s.ops if not 0 <= r < w]
    if bad:
        raise ScheduleError(f"op lists for ranks {bad} outside the world of {w}")
    ids = [c.id for c in s.chunks]
    if len(set(ids)) != len(ids):
        raise ScheduleError(f"chunk ids are not unique: {sorted(ids)}")
    for c in s.chunks:
        if not 0 <= c.owner < w:
            raise ScheduleError(f"chunk {c.id}: owner {c.owner} outside the world of {w}")
        lo, hi = s.shard(c.owner)
        if not lo <= c.lo < c.hi <= hi:
            raise ScheduleError(
                f"chunk {c.id}: rows [{c.lo}, {c.hi}) are empty or outside rank {c.owner}'s "
                f"shard [{lo}, {hi})"
            )
    for tensor in sorted({c.tensor for c in s.chunks}):
        row = 0
        for c in (c for c in s.row_order if c.tensor == tensor):
            if c.lo < row:
                raise ScheduleError(f"tensor {tensor}: chunk {c.id} overlaps rows below {row}")
            if c.lo > row:
                raise ScheduleError(f"tensor {tensor}: rows [{row}, {c.lo}) are in no chunk")
            row = c.hi
        if row != s.rows:
            raise ScheduleError(f"tensor {tensor}: rows [{row}, {s.rows}) are in no chunk")
    if not s.chunks:
        raise ScheduleError("schedule has no chunks")
    for ref in s.refs():
        _validate_op(s, ref)


def _validate_op(s: Schedule, ref: Ref) -> None:
    op, w = s.op(ref), s.world_size
    where = _name(ref)
    if isinstance(op, P2P):
        if op.chunk not in s.chunk_index:
            raise ScheduleError(f"{where}: chunk {op.chunk} does not exist")
        if not (0 <= op.src < w and 0 <= op.dst < w) or op.src == op.dst:
            raise ScheduleError(f"{where}: bad transfer {op.src} -> {op.dst} (world {w})")
        if op.mode not in MODES:
            raise ScheduleError(f"{where}: mode must be one of {list(MODES)}, got {op.mode!r}")
        if op.backend not in BACKENDS:
            raise ScheduleError(f"{where}: backend must be one of {list(BACKENDS)}")
        if op.issuer != ref[0]:
            raise ScheduleError(
                f"{where}: a {op.mode} from {op.src} to {op.dst} must be in rank {op.issuer}'s list"
            )
    elif isinstance(op, Collective):
        if op.op not in KINDS:
            raise ScheduleError(f"{where}: collective must be one of {list(KINDS)}")
        if ref[0] not in op.ranks or len(set(op.ranks)) != len(op.ranks):
            raise ScheduleError(f"{where}: collective ranks {op.ranks} must list rank {ref[0]}")
        if any(not 0 <= r < w for r in op.ranks):
            raise ScheduleError(f"{where}: collective ranks {op.ranks} outside the world")
        for c in op.chunks:
            if c not in s.chunk_index:
                raise ScheduleError(f"{where}: chunk {c} does not exist")
            if op.op != "all_reduce" and s.chunk(c).owner not in op.ranks:
                raise ScheduleError(
                    f"{where}: {op.op} of chunk {c} without its owner {s.chunk(c).owner}"
                )
    else:
        raise ScheduleError(f"{where}: not an op: {op!r}")
    for dep in op.deps:
        if not isinstance(dep, tuple | list) or len(dep) != 2:
            raise ScheduleError(f"{where}: a dependency must be (rank, index), got {dep!r}")
        r, i = dep
        if not (0 <= r < w and 0 <= i < len(s.rank_ops(r))):
            raise ScheduleError(f"{where}: depends on rank {r} op {i}, which does not exist")
        if tuple(dep) == ref:
            raise ScheduleError(f"{where}: depends on itself")


# --------------------------------------------------------------------------------------
# Graph
# --------------------------------------------------------------------------------------


def _match_collectives(s: Schedule) -> list[list[Ref]]:
    """Group ops into nodes: a P2P alone, a collective call with its occurrence on every
    participant (the n-th occurrence of one key on each)."""
    groups: list[list[Ref]] = []
    seen: dict[tuple, list[list[Ref]]] = {}  # key -> calls, each a list of refs
    counts: dict[tuple[int, tuple], int] = {}
    for ref in s.refs():
        op = s.op(ref)
        if isinstance(op, P2P):
            groups.append([ref])
            continue
        n = counts.get((ref[0], op.key), 0)
        counts[(ref[0], op.key)] = n + 1
        calls = seen.setdefault(op.key, [])
        if n == len(calls):
            calls.append([])
            groups.append(calls[n])
        calls[n].append(ref)
    for calls in seen.values():
        for call in calls:
            ranks = s.op(call[0]).ranks
            missing = sorted(set(ranks) - {r for r, _ in call})
            if missing:
                raise ScheduleError(
                    f"{_name(call[0])}: collective {s.op(call[0]).op} of chunks "
                    f"{s.op(call[0]).chunks} is not called by ranks {missing}"
                )
    return groups


def analyze(s: Schedule) -> Analysis:
    """Validate the structure and build the dependency graph (no data flow yet)."""
    _validate(s)
    members = _match_collectives(s)
    node = {ref: n for n, refs in enumerate(members) for ref in refs}
    preds: list[set[int]] = [set() for _ in members]
    for ref, n in node.items():
        if ref[1] > 0:
            preds[n].add(node[(ref[0], ref[1] - 1)])
        preds[n].update(node[tuple(d)] for d in s.op(ref).deps)
    for n, p in enumerate(preds):
        if n in p:
            raise ScheduleError(f"dependency cycle: {_name(members[n][0])} waits on itself")
    topo = _toposort(preds, members)
    anc, level = [0] * len(members), [0] * len(members)
    for n in topo:
        for p in preds[n]:
            anc[n] |= anc[p] | (1 << p)
            level[n] = max(level[n], level[p] + 1)
    readers: dict[Loc, list[int]] = {}
    writers: dict[Loc, list[int]] = {}
    for n, refs in enumerate(members):
        reads, writes = _accesses(s, s.op(refs[0]))
        for loc in reads:
            readers.setdefault(loc, []).append(n)
        for loc in writes:
            writers.setdefault(loc, []).append(n)
    return Analysis(s, node, members, topo, level, anc, readers, writers)


def _toposort(preds: list[set[int]], members: list[list[Ref]]) -> list[int]:
    succs: list[list[int]] = [[] for _ in preds]
    for n, p in enumerate(preds):
        for q in p:
            succs[q].append(n)
    missing = [len(p) for p in preds]
    ready = [n for n, k in enumerate(missing) if k == 0]  # a heap: lowest (rank, index) first
    topo = []
    while ready:
        n = heapq.heappop(ready)
        topo.append(n)
        for m in succs[n]:
            missing[m] -= 1
            if missing[m] == 0:
                heapq.heappush(ready, m)
    if len(topo) == len(preds):
        return topo
    # Every node left waits on another node left: walk back until a node repeats.
    left = {n for n, k in enumerate(missing) if k > 0}
    path, pos, n = [], {}, min(left)
    while n not in pos:
        pos[n] = len(path)
        path.append(n)
        n = min(p for p in preds[n] if p in left)
    cycle = path[pos[n] :] + [n]
    names = " -> ".join(_name(members[m][0]) for m in cycle)
    raise ScheduleError(f"dependency cycle (each op waits on the next): {names}")


def _accesses(s: Schedule, op) -> tuple[list[Loc], list[Loc]]:
    if isinstance(op, P2P):
        return [(op.src, op.chunk)], [(op.dst, op.chunk)]
    reads, writes = [], []
    for c in op.chunks:
        owner = s.chunk(c).owner
        if op.op == "all_gather":
            reads.append((owner, c))
            writes += [(r, c) for r in op.ranks if r != owner]
        elif op.op == "reduce_scatter":
            reads += [(r, c) for r in op.ranks]
            writes.append((owner, c))
        else:
            reads += [(r, c) for r in op.ranks]
            writes += [(r, c) for r in op.ranks]
    return reads, writes


# --------------------------------------------------------------------------------------
# Data flow
# --------------------------------------------------------------------------------------


class _Executor:
    """Computes what every op reads and writes, in topological order, and checks races,
    double counting and the final state."""

    def __init__(self, a: Analysis):
        self.a, self.s = a, a.schedule
        self.full = frozenset(range(self.s.world_size))
        self.out: dict[int, dict[Loc, tuple[bool, frozenset]]] = {}  # node -> loc -> (add, v)
        self.pos = {n: i for i, n in enumerate(a.topo)}

    def initial(self, loc: Loc):
        rank, c = loc
        if self.s.kind == "all_gather":
            return frozenset({rank}) if self.s.chunk(c).owner == rank else None
        return frozenset({rank})

    def value(self, loc: Loc, writes: list[int]):
        """Fold the writes (in topological order, all pairwise ordered unless both add)."""
        v = self.initial(loc)
        for w in sorted(writes, key=self.pos.__getitem__):
            add, payload = self.out[w][loc]
            if not add:
                v = payload
                continue
            rank, c = loc
            if v is None:
                raise ScheduleError(
                    f"{self.a.name(w)}: reduces chunk {c} into rank {rank}, which holds no "
                    "data for it"
                )
            if v & payload:
                raise ScheduleError(
                    f"{self.a.name(w)}: reduces ranks {sorted(payload)}'s contributions to "
                    f"chunk {c} into rank {rank}, which already has those of ranks "
                    f"{sorted(v)}: ranks {sorted(v & payload)} are double-counted"
                )
            v = v | payload
        return v

    def read(self, n: int, loc: Loc):
        a = self.a
        for w in a.writers.get(loc, []):
            if w != n and not a.ordered(w, n):
                raise ScheduleError(
                    f"{a.name(n)}: reads chunk {loc[1]} on rank {loc[0]} while "
                    f"{a.name(w)}, which writes it there, is neither a dependency of it nor "
                    "after it (data used before it arrived)"
                )
        v = self.value(loc, [w for w in a.writers.get(loc, []) if a.before(w, n)])
        if v is None:
            raise ScheduleError(
                f"{a.name(n)}: sends chunk {loc[1]} from rank {loc[0]}, which does not hold "
                "it (no op delivering it there comes before)"
            )
        return v

    def run(self) -> None:
        a, s = self.a, self.s
        for loc, ws in a.writers.items():
            for i, w1 in enumerate(ws):
                for w2 in ws[i + 1 :]:
                    if w1 != w2 and not a.ordered(w1, w2):
                        if not (self._adds(w1) and self._adds(w2)):
                            raise ScheduleError(
                                f"{a.name(w2)}: writes chunk {loc[1]} on rank {loc[0]} "
                                f"unordered with {a.name(w1)}, which writes it too (race)"
                            )
        for n in a.topo:
            op = s.op(a.members[n][0])
            self.out[n] = self._execute(n, op)
        self._check_final()

    def _adds(self, n: int) -> bool:
        op = self.s.op(self.a.members[n][0])
        return isinstance(op, P2P) and op.reduce

    def _execute(self, n: int, op) -> dict[Loc, tuple[bool, frozenset]]:
        if isinstance(op, P2P):
            return {(op.dst, op.chunk): (op.reduce, self.read(n, (op.src, op.chunk)))}
        out = {}
        for c in op.chunks:
            owner = self.s.chunk(c).owner
            if op.op == "all_gather":
                v = self.read(n, (owner, c))
                out.update({(r, c): (False, v) for r in op.ranks if r != owner})
                continue
            total = frozenset()
            for r in op.ranks:
                v = self.read(n, (r, c))
                if total & v:
                    raise ScheduleError(
                        f"{self.a.name(n)}: {op.op} of chunk {c} double-counts ranks "
                        f"{sorted(total & v)}"
                    )
                total |= v
            targets = [owner] if op.op == "reduce_scatter" else op.ranks
            out.update({(r, c): (False, total) for r in targets})
        return out

    def _check_final(self) -> None:
        a, s = self.a, self.s
        for c in s.row_order:
            for rank in range(s.world_size):
                loc = (rank, c.id)
                writes = a.writers.get(loc, [])
                v = self.value(loc, writes)
                what = f"chunk {c.id} (rows [{c.lo}, {c.hi}) of rank {c.owner})"
                if s.kind == "all_gather":
                    if rank == c.owner and writes:
                        raise ScheduleError(f"{a.name(writes[0])}: overwrites {what} on its owner")
                    if len(writes) > 1:
                        raise ScheduleError(
                            f"{a.name(writes[1])}: delivers {what} to rank {rank} again "
                            f"(already delivered by {a.name(writes[0])})"
                        )
                    if v != {c.owner}:
                        raise ScheduleError(f"rank {rank} never receives {what}")
                elif s.kind == "all_reduce" or rank == c.owner:
                    if v != self.full:
                        raise ScheduleError(
                            f"rank {rank} ends with {what} summed over ranks {sorted(v)}; "
                            f"missing ranks {sorted(self.full - v)}"
                        )
