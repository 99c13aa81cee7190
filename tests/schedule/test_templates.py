"""Every template realises its collective (checked symbolically) for W = 1..8, ragged
shards and splits; plus the structure each template promises."""

from __future__ import annotations

import pytest

from interlace.errors import InterlaceValueError
from interlace.schedule import (
    P2P,
    check,
    full_mesh_all_gather,
    full_mesh_reduce_scatter,
    partition_all_reduce,
    ring_all_gather,
    ring_reduce_scatter,
    split_rows,
    swizzled_all_gather,
)

TEMPLATES = {
    "ring_ag": ring_all_gather,
    "mesh_ag": full_mesh_all_gather,
    "swizzled_ag": swizzled_all_gather,
    "ring_rs": ring_reduce_scatter,
    "mesh_rs": full_mesh_reduce_scatter,
    "mesh_ar": partition_all_reduce,
    "ring_ar": lambda *a, **k: partition_all_reduce(*a, algorithm="ring", **k),
}
ROWS = (1, 7, 128, 300)


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_templates_pass_checker(name, mode):
    make = TEMPLATES[name]
    for w in range(1, 9):
        for rows in ROWS:
            for split in (1, 2, 3):
                s = make(w, rows, split, mode=mode)
                check(s)
                assert s.world_size == w and s.rows == w * rows
                assert all(op.mode == mode for ops in s.ops.values() for op in ops)


@pytest.mark.parametrize("name", TEMPLATES)
def test_templates_ragged_across_ranks(name):
    for rows in ([5, 1, 9], [0, 3, 4, 1], [300, 7, 1, 128, 2]):
        for split in (1, 3):
            s = TEMPLATES[name](len(rows), rows, split, mode="pull", backend="sm")
            check(s)
            assert s.shard_rows == tuple(rows)
            assert all(op.backend == "sm" for ops in s.ops.values() for op in ops)


def test_chunks_even_and_row_ordered():
    assert split_rows(10, 17, 3) == [(10, 12), (12, 14), (14, 17)]
    assert split_rows(0, 2, 3) == [(0, 1), (1, 2)]  # fewer rows than parts: no empty chunk
    s = ring_all_gather(3, 7, 3)
    assert [(c.lo, c.hi, c.owner) for c in s.chunks] == [
        (0, 2, 0), (2, 4, 0), (4, 7, 0), (7, 9, 1), (9, 11, 1), (11, 14, 1),
        (14, 16, 2), (16, 18, 2), (18, 21, 2),
    ]  # fmt: skip
    assert [c.id for c in s.row_order] == list(range(9))


def _dsts(s, rank):
    return [op.dst for op in s.ops[rank]]


def test_full_mesh_is_rank_rotated_peer_by_peer():
    s = full_mesh_all_gather(4, 10, split=2)
    for r in range(4):
        assert _dsts(s, r) == [(r + 1) % 4] * 2 + [(r + 2) % 4] * 2 + [(r + 3) % 4] * 2
        assert [op.chunk for op in s.ops[r]] == [2 * r, 2 * r + 1] * 3
        assert all(op.deps == () for op in s.ops[r])  # sends only its own data
    pulled = full_mesh_all_gather(4, 10, split=2, mode="pull")
    for r in range(4):  # the same moves, issued by the receiver
        assert [op.src for op in pulled.ops[r]] == [(r - 1) % 4] * 2 + [(r - 2) % 4] * 2 + [
            (r - 3) % 4
        ] * 2


def test_swizzled_is_subchunk_major_and_links_distinct():
    w, split = 5, 3
    s = swizzled_all_gather(w, 30, split=split)
    for r in range(w):
        ops = s.ops[r]
        assert [(op.dst - r) % w for op in ops] == [1, 2, 3, 4] * split
        assert [op.chunk - split * r for op in ops] == [0] * 4 + [1] * 4 + [2] * 4
    for step in range(len(s.ops[0])):
        links = {(s.ops[r][step].src, s.ops[r][step].dst) for r in range(w)}
        assert len({d for _, d in links}) == w  # each rank receives from exactly one


def test_ring_forwards_after_receiving():
    s = ring_all_gather(4, 8, split=1)
    for r in range(4):
        assert _dsts(s, r) == [(r + 1) % 4] * 3
        assert [s.chunk(op.chunk).owner for op in s.ops[r]] == [r, (r - 1) % 4, (r - 2) % 4]
        # step s > 0 waits on the receive of step s - 1 from the left neighbour
        assert [op.deps for op in s.ops[r]] == [(), (((r - 1) % 4, 0),), (((r - 1) % 4, 1),)]


def test_reduce_scatter_structure():
    w = 4
    ring = ring_reduce_scatter(w, 8)
    mesh = full_mesh_reduce_scatter(w, 8)
    for s in (ring, mesh):
        assert all(op.reduce for ops in s.ops.values() for op in ops)
        assert s.num_ops() == w * (w - 1)
    for r in range(w):
        # a rank never sends its own rows; the ring's last step completes the right
        # neighbour's sum, the mesh sends to r+1, r+2, ...
        assert all(mesh.chunk(op.chunk).owner != r for op in mesh.ops[r] + ring.ops[r])
        owners = [ring.chunk(op.chunk).owner for op in ring.ops[r]]
        assert owners == [(r - 1) % w, (r - 2) % w, (r + 1) % w]
        assert _dsts(mesh, r) == [(r + 1) % w, (r + 2) % w, (r + 3) % w]


def test_all_reduce_has_both_phases():
    w = 3
    s = partition_all_reduce(w, 4, split=2)
    for r in range(w):
        reduces = [op.reduce for op in s.ops[r]]
        assert reduces == [True] * 4 + [False] * 4
    # the gather of a partition waits for every reduce into it
    first_gather = s.ops[0][4]
    assert first_gather.chunk in (0, 1) and first_gather.src == 0
    into_0 = {
        (r, i)
        for r in range(w)
        for i, op in enumerate(s.ops[r])
        if op.reduce and op.dst == 0 and op.chunk == first_gather.chunk
    }
    assert into_0 <= set(first_gather.deps) | {(0, i) for i in range(4)}
    assert len(into_0) == w - 1


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(world_size=0, rows_per_rank=4),
        dict(world_size=2, rows_per_rank=0),
        dict(world_size=2, rows_per_rank=[1, 2, 3]),
        dict(world_size=2, rows_per_rank=[0, 0]),
        dict(world_size=2, rows_per_rank=4, split=0),
        dict(world_size=2, rows_per_rank=4, mode="fetch"),
        dict(world_size=2, rows_per_rank=4, backend="tma"),
        dict(world_size=True, rows_per_rank=4),
    ],
)
def test_bad_arguments(kwargs):
    with pytest.raises(InterlaceValueError):
        ring_all_gather(**kwargs)


def test_bad_algorithm():
    with pytest.raises(InterlaceValueError, match="algorithm"):
        partition_all_reduce(2, 4, algorithm="tree")


def test_ops_are_p2p_on_issuer_list():
    for make in TEMPLATES.values():
        for mode in ("push", "pull"):
            s = make(3, 5, 2, mode=mode)
            for r, ops in s.ops.items():
                assert all(isinstance(op, P2P) and op.issuer == r for op in ops)
