"""Schedule templates: ring, full-mesh and 2-D swizzled all-gather, ring and full-mesh
reduce-scatter, and partition all-reduce, for any world size and ragged shards.

Every template lists its transfers in a sensible global order and lets :class:`_Builder`
derive the dependencies from the data each transfer reads and writes (read after write,
write after read, write after overwrite), dropping those already implied by program order
or by another dependency. The templates therefore only decide *what moves when*; the
checker then proves the result.

Shard ``r`` is cut into ``split`` sub-chunks as even as possible (fewer when the shard has
fewer rows than ``split``); chunk ids are numbered in row order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from ..errors import InterlaceValueError
from .chunks import BACKENDS, MODES, P2P, Chunk, Ref, Schedule, split_rows

__all__ = [
    "full_mesh_all_gather",
    "full_mesh_reduce_scatter",
    "partition_all_reduce",
    "ring_all_gather",
    "ring_reduce_scatter",
    "swizzled_all_gather",
]


def _shard_rows(world_size: int, rows_per_rank: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InterlaceValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(rows_per_rank, int) and not isinstance(rows_per_rank, bool):
        if rows_per_rank < 1:
            raise InterlaceValueError(f"rows_per_rank must be >= 1, got {rows_per_rank}")
        return (rows_per_rank,) * world_size
    rows = tuple(rows_per_rank)
    if (
        len(rows) != world_size
        or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in rows)
        or sum(rows) < 1
    ):
        raise InterlaceValueError(
            f"rows_per_rank must be an int >= 1 or {world_size} ints >= 0 with a positive "
            f"sum, got {rows_per_rank!r}"
        )
    return rows


def _check_choice(name: str, value, allowed: Sequence) -> None:
    if value not in allowed:
        raise InterlaceValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


class _Builder:
    """Appends transfers to per-rank lists and infers their dependencies from data flow."""

    def __init__(self, world_size, kind, rows_per_rank, split, mode, backend, tensor, align=1):
        shard_rows = _shard_rows(world_size, rows_per_rank)
        if isinstance(split, bool) or not isinstance(split, int) or split < 1:
            raise InterlaceValueError(f"split must be an int >= 1, got {split!r}")
        _check_choice("mode", mode, MODES)
        _check_choice("backend", backend, BACKENDS)
        self.world_size, self.kind, self.split = world_size, kind, split
        self.mode, self.backend = mode, backend
        self.shard_rows = shard_rows
        self.chunks: list[Chunk] = []
        self.sub: list[list[int]] = []  # rank -> its chunk ids, in row order
        lo = 0
        for rank, n in enumerate(shard_rows):
            ids = []
            for a, b in split_rows(lo, lo + n, split, align):
                ids.append(len(self.chunks))
                self.chunks.append(Chunk(len(self.chunks), tensor, a, b, rank))
            self.sub.append(ids)
            lo += n
        self.ops: dict[int, list[P2P]] = {r: [] for r in range(world_size)}
        self._anc: dict[Ref, int] = {}  # op -> bit mask of the ops it (transitively) follows
        self._bit: dict[Ref, int] = {}
        self._readers: dict[tuple[int, int], list[Ref]] = {}  # (rank, chunk) -> ops
        self._writers: dict[tuple[int, int], list[tuple[Ref, bool]]] = {}  # ... (op, reduce)

    def send(self, chunk: int, src: int, dst: int, reduce: bool = False) -> Ref:
        """Append the transfer of ``chunk`` from ``src`` to ``dst`` to its issuer's list."""
        src_loc, dst_loc = (src, chunk), (dst, chunk)
        need = [w for w, _ in self._writers.get(src_loc, [])]  # read after write
        need += self._readers.get(dst_loc, [])  # write after read
        need += [w for w, red in self._writers.get(dst_loc, []) if not (reduce and red)]
        issuer = src if self.mode == "push" else dst
        ref = (issuer, len(self.ops[issuer]))
        prev = (issuer, ref[1] - 1) if ref[1] else None
        above = [prev] if prev else []
        anc = 0
        for d in above + need:
            anc |= self._anc[d] | (1 << self._bit[d])
        # Keep only deps on other ranks that no other dep or the previous op already implies.
        deps = sorted(
            {
                d
                for d in need
                if d[0] != issuer
                and not any((self._anc[e] >> self._bit[d]) & 1 for e in above + need if e != d)
            }
        )
        self._bit[ref], self._anc[ref] = len(self._bit), anc
        op = P2P(chunk, src, dst, self.mode, reduce, self.backend, tuple(deps))
        self.ops[issuer].append(op)
        self._readers.setdefault(src_loc, []).append(ref)
        self._writers.setdefault(dst_loc, []).append((ref, reduce))
        return ref

    def build(self) -> Schedule:
        return Schedule(
            self.world_size, self.kind, self.shard_rows, tuple(self.chunks), self.ops, self.split
        )


# --------------------------------------------------------------------------------------
# Phases (shared by the all-reduce template)
# --------------------------------------------------------------------------------------


def _ring_gather(b: _Builder) -> None:
    """Step ``s``: every rank ``q`` forwards the shard of rank ``q - s`` to ``q + 1``."""
    w = b.world_size
    for s in range(w - 1):
        for q in range(w):
            for c in b.sub[(q - s) % w]:
                b.send(c, q, (q + 1) % w)


def _mesh_gather(b: _Builder, swizzle: bool) -> None:
    """Step ``d``: every rank ``q`` sends its shard to ``q + d`` (rank-rotated, peer by
    peer). ``swizzle``: sub-chunk-major order instead, (sub-chunk 0 to every peer, then
    sub-chunk 1, ...), still rank-rotated so that at each step the ranks use distinct
    links."""
    w = b.world_size
    if swizzle:
        for k in range(b.split):
            for d in range(1, w):
                for q in range(w):
                    if k < len(b.sub[q]):
                        b.send(b.sub[q][k], q, (q + d) % w)
    else:
        for d in range(1, w):
            for q in range(w):
                for c in b.sub[q]:
                    b.send(c, q, (q + d) % w)


def _ring_scatter(b: _Builder) -> None:
    """Step ``s``: every rank ``q`` adds its running sum of the shard of rank ``q - s - 1``
    into ``q + 1``; after ``W - 1`` steps each shard's sum has reached its owner."""
    w = b.world_size
    for s in range(w - 1):
        for q in range(w):
            for c in b.sub[(q - s - 1) % w]:
                b.send(c, q, (q + 1) % w, reduce=True)


def _mesh_scatter(b: _Builder) -> None:
    """Step ``d``: every rank ``q`` adds its partial of the shard of ``q + d`` into it."""
    w = b.world_size
    for d in range(1, w):
        for q in range(w):
            for c in b.sub[(q + d) % w]:
                b.send(c, q, (q + d) % w, reduce=True)


# --------------------------------------------------------------------------------------
# Templates
# --------------------------------------------------------------------------------------


def _template(
    name: str,
    kind: str,
    phases: Callable[[_Builder], None],
    doc: str,
    *,
    default_tensor: str,
    default_split: int = 1,
):
    """The public template ``name`` (documented by ``doc``): a ``kind`` schedule whose
    transfers ``phases`` appends, with the given defaults for ``tensor`` and ``split``."""

    def template(
        world_size: int,
        rows_per_rank: int | Sequence[int],
        split: int = default_split,
        mode: str = "push",
        backend: str = "ce",
        tensor: str = default_tensor,
        align: int = 1,
    ) -> Schedule:
        b = _Builder(world_size, kind, rows_per_rank, split, mode, backend, tensor, align)
        phases(b)
        return b.build()

    template.__name__ = template.__qualname__ = name
    template.__doc__ = doc
    return template


ring_all_gather = _template(
    "ring_all_gather",
    "all_gather",
    _ring_gather,
    """Ring all-gather: ``W - 1`` steps, each rank forwards to its right neighbour the
    shard it received in the previous step (its own first).""",
    default_tensor="A",
)

full_mesh_all_gather = _template(
    "full_mesh_all_gather",
    "all_gather",
    partial(_mesh_gather, swizzle=False),
    """Full-mesh all-gather, rank-rotated and peer by peer: data moves from rank ``q`` to
    ``q + 1``, then ``q + 2``, ... (push: ``q`` sends; pull: ``q + d`` fetches).""",
    default_tensor="A",
)

swizzled_all_gather = _template(
    "swizzled_all_gather",
    "all_gather",
    partial(_mesh_gather, swizzle=True),
    """2-D swizzled all-gather: shards cut into ``split`` sub-chunks, sent sub-chunk-major
    and peer-rotated, so each rank receives the first rows of every peer early and, at any
    step (with equal shards), every rank uses a different link.""",
    default_split=2,
    default_tensor="A",
)

ring_reduce_scatter = _template(
    "ring_reduce_scatter",
    "reduce_scatter",
    _ring_scatter,
    """Ring reduce-scatter: ``W - 1`` steps of adding a running partial sum into the right
    neighbour; a rank's own shard arrives complete in the last step.""",
    default_tensor="C",
)

full_mesh_reduce_scatter = _template(
    "full_mesh_reduce_scatter",
    "reduce_scatter",
    _mesh_scatter,
    """Full-mesh reduce-scatter, rank-rotated: each rank adds its partial of rank
    ``q + d``'s shard into ``q + d`` for ``d = 1, 2, ...``; its own shard is never sent.""",
    default_tensor="C",
)


def partition_all_reduce(
    world_size: int,
    rows_per_rank: int | Sequence[int],
    split: int = 1,
    mode: str = "push",
    backend: str = "ce",
    algorithm: str = "full_mesh",
    tensor: str = "C",
    align: int = 1,
) -> Schedule:
    """Partition all-reduce: the rows are cut into one partition per rank
    (``rows_per_rank`` each), reduce-scattered to their owners, then the reduced partitions
    all-gathered. ``algorithm``: ``"full_mesh"`` or ``"ring"`` for both phases."""
    _check_choice("algorithm", algorithm, ("full_mesh", "ring"))
    b = _Builder(world_size, "all_reduce", rows_per_rank, split, mode, backend, tensor, align)
    if algorithm == "ring":
        _ring_scatter(b)
        _ring_gather(b)
    else:
        _mesh_scatter(b)
        _mesh_gather(b, swizzle=False)
    return b.build()
