"""Lowering: per-rank transfers with slots and waits, consumer / producer tile tables."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interlace.errors import InterlaceValueError
from interlace.schedule import (
    P2P,
    Collective,
    ScheduleError,
    as_tensors,
    consumer_plan,
    full_mesh_all_gather,
    full_mesh_reduce_scatter,
    n_signals,
    partition_all_reduce,
    producer_plan,
    ring_all_gather,
    ring_reduce_scatter,
    signal_counts,
    swizzled_all_gather,
    transfers,
)

AG = {"ring": ring_all_gather, "mesh": full_mesh_all_gather, "swizzled": swizzled_all_gather}
RS = {
    "ring": ring_reduce_scatter,
    "mesh": full_mesh_reduce_scatter,
    "ar_mesh": partition_all_reduce,
    "ar_ring": lambda *a, **k: partition_all_reduce(*a, algorithm="ring", **k),
}


def _tile_rows(t, block_m, rows):
    return t * block_m, min(rows, (t + 1) * block_m)


def _run(schedule, seed):
    """Execute every rank's transfers the way a runtime would (each rank issues its list in
    order, a transfer starts once its ``waits`` hold, landing raises its slot), picking a
    random ready rank each step; return the final holdings (sets of contributing ranks)."""
    w, rng = schedule.world_size, random.Random(seed)
    lists = [transfers(schedule, r) for r in range(w)]
    sig = [[0] * n_signals(schedule) for _ in range(w)]
    ag = schedule.kind == "all_gather"
    data = {
        (r, c.id): (frozenset({r}) if (not ag or c.owner == r) else None)
        for r in range(w)
        for c in schedule.chunks
    }
    pos = [0] * w
    while any(pos[r] < len(lists[r]) for r in range(w)):
        ready = [
            r
            for r in range(w)
            if pos[r] < len(lists[r])
            and all(sig[q][slot] >= v for q, slot, v in lists[r][pos[r]].waits)
        ]
        assert ready, f"deadlock at positions {pos}"
        r = rng.choice(ready)
        t = lists[r][pos[r]]
        pos[r] += 1
        payload = data[(t.src, t.chunk_id)]
        assert payload is not None, f"rank {r} sent chunk {t.chunk_id} before it arrived"
        if t.reduce:
            assert not payload & data[(t.dst, t.chunk_id)]
            payload = payload | data[(t.dst, t.chunk_id)]
        data[(t.dst, t.chunk_id)] = payload
        sig[t.dst][t.signal] += 1
    for r in range(w):
        assert sig[r] == signal_counts(schedule, r)
    return data


@pytest.mark.parametrize("name", list(AG) + list(RS))
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_runtime_following_the_waits_realises_the_collective(name, mode):
    make = {**AG, **RS}[name]
    full = None
    for w in (2, 3, 5):
        full = frozenset(range(w))
        for rows, split in ((1, 2), (7, 3), (10, 1)):
            s = make(w, rows, split, mode=mode)
            for seed in range(3):
                data = _run(s, seed)
                for c in s.chunks:
                    for r in range(w):
                        if s.kind == "all_gather":
                            assert data[(r, c.id)] == {c.owner}
                        elif s.kind == "all_reduce" or r == c.owner:
                            assert data[(r, c.id)] == full


def test_transfers_follow_the_list_and_row_order_slots():
    s = ring_all_gather(3, 5, split=2, mode="pull", backend="sm")
    assert n_signals(s) == 6
    for r in range(3):
        ts = transfers(s, r)
        assert len(ts) == len(s.ops[r]) == 4
        for t, op in zip(ts, s.ops[r]):
            c = s.chunk(op.chunk)
            assert (t.chunk_id, t.src, t.dst, t.lo, t.hi) == (c.id, op.src, op.dst, c.lo, c.hi)
            assert (t.backend, t.reduce, t.mode) == ("sm", False, "pull")
            assert t.signal == sorted(x.lo for x in s.chunks).index(c.lo)
    # rank 1 pulls rank 0's chunks, then rank 2's once they reached rank 0 (slot 4, 5 there)
    assert [(t.src, t.signal, t.waits) for t in transfers(s, 1)] == [
        (0, 0, ()), (0, 1, ()), (0, 4, ((0, 4, 1),)), (0, 5, ((0, 5, 1),)),
    ]  # fmt: skip


def test_signal_slots_are_row_order_even_if_ids_are_not():
    s = full_mesh_all_gather(2, 4, split=2)
    # renumber chunks backwards: slots must still follow rows
    from dataclasses import replace

    back = {c.id: 3 - c.id for c in s.chunks}
    s2 = replace(
        s,
        chunks=tuple(replace(c, id=back[c.id]) for c in s.chunks),
        ops={r: [replace(op, chunk=back[op.chunk]) for op in v] for r, v in s.ops.items()},
    )
    assert [(t.chunk_id, t.signal) for t in transfers(s2, 0)] == [(3, 0), (2, 1)]


def test_reduce_waits_count_concurrent_arrivals():
    # full-mesh RS + AG: the owner's gather waits until all W-1 reduces into its slot landed
    w = 4
    s = partition_all_reduce(w, 8)
    ts = transfers(s, 0)
    gather = [t for t in ts if not t.reduce]
    assert gather[0].waits == ((0, 0, w - 1),)
    assert all(t.waits == () for t in ts if t.reduce)
    assert signal_counts(s, 0) == [w - 1, 1, 1, 1]
    ring = transfers(ring_reduce_scatter(w, 8), 1)
    assert [t.waits for t in ring] == [(), ((1, 3, 1),), ((1, 2, 1),)]


def test_consumer_plan_arrival_order():
    for make in (ring_all_gather, full_mesh_all_gather):
        for mode in ("push", "pull"):
            s = make(4, 128, mode=mode)
            p = consumer_plan(s, 1, 128)
            assert p.tile_order == (1, 0, 3, 2)  # own, then r-1, r-2, r-3
            assert p.waits == ((-1,) * 4, (0, -1, -1, -1), (3, -1, -1, -1), (2, -1, -1, -1))
            assert p.expected == 1


def test_consumer_plan_swizzled_gets_first_subchunks_early():
    s = swizzled_all_gather(3, 8, split=2)  # chunks of 4 rows, tiles of 4 rows
    p = consumer_plan(s, 0, 4)
    # own (tiles 0, 1), then first halves from 2 and 1, then second halves
    assert p.tile_order == (0, 1, 4, 2, 5, 3)


def test_consumer_plan_ragged_tile_spanning_shards():
    s = full_mesh_all_gather(3, 5)  # shards [0,5) [5,10) [10,15); tiles of 4 rows
    p = consumer_plan(s, 1, 4)
    assert p.tile_order == (0, 1, 2, 3)  # every tile has remote rows; rank 0's land first
    assert p.waits[1] == (0, -1, -1, -1)  # rows [4, 8): rank 0's chunk + own
    assert p.waits[2] == (2, -1, -1, -1)  # rows [8, 12): own + rank 2's chunk
    t_order, waits = as_tensors(p)
    assert t_order.dtype == waits.dtype == __import__("torch").int32
    assert waits.shape == (4, 4) and t_order.tolist() == [0, 1, 2, 3]
    assert waits[3].tolist() == [2, -1, -1, -1]


def test_consumer_plan_too_many_waits():
    s = full_mesh_all_gather(4, 6, split=3)  # 2-row chunks
    with pytest.raises(ScheduleError, match=r"rank 0: tile 1 \(rows \[8, 16\)\) needs 4 remote"):
        consumer_plan(s, 0, 8, max_waits=3)
    p = consumer_plan(s, 0, 8, max_waits=4)
    assert p.waits[p.tile_order.index(1)] == (4, 5, 6, 7)
    assert p.waits[p.tile_order.index(0)] == (3, -1, -1, -1)


def test_producer_plan_own_rows_last():
    s = full_mesh_reduce_scatter(4, 128)
    p = producer_plan(s, 1, 128)
    assert p.tile_order == (2, 3, 0, 1)  # sent to r+1, r+2, r+3; own rows stay
    assert p.notifies == ((2, -1, -1, -1), (3, -1, -1, -1), (0, -1, -1, -1), (1, -1, -1, -1))
    assert p.expected == (1, 1, 1, 1)
    assert producer_plan(ring_reduce_scatter(4, 128), 1, 128).tile_order == (0, 3, 2, 1)
    order, notifies, expected = as_tensors(producer_plan(s, 1, 96))
    # 96-row tiles straddle chunks: a tile comes as early as the first chunk it feeds
    assert order.tolist() == [2, 3, 4, 5, 0, 1]
    assert notifies.shape == (6, 4) and expected.tolist() == [2, 2, 2, 2]
    assert notifies[0].tolist() == [1, 2, -1, -1]


def test_plan_errors():
    ag, rs = ring_all_gather(2, 4), ring_reduce_scatter(2, 4)
    with pytest.raises(ScheduleError, match="needs an all_gather"):
        consumer_plan(rs, 0, 4)
    with pytest.raises(ScheduleError, match="needs a reduce_scatter"):
        producer_plan(ag, 0, 4)
    with pytest.raises(InterlaceValueError, match="block_m"):
        consumer_plan(ag, 0, 0)
    with pytest.raises(InterlaceValueError, match="rank"):
        transfers(ag, 2)
    with pytest.raises(ScheduleError, match="max_notifies=1"):
        producer_plan(ring_reduce_scatter(2, 4, split=2), 0, 4, max_notifies=1)
    from dataclasses import replace

    coll = replace(ag, ops={r: [Collective("all_gather", (0, 1), (0, 1))] for r in (0, 1)})
    with pytest.raises(ScheduleError, match="P2P ops only"):
        transfers(coll, 0)
    broken = replace(ag, ops={0: [P2P(0, 0, 1)], 1: []})
    with pytest.raises(ScheduleError, match="never receives"):
        consumer_plan(broken, 0, 4)


def _check_consumer(s, rank, block_m, p):
    n = -(-s.rows // block_m)
    assert sorted(p.tile_order) == list(range(n))
    row_order = s.row_order
    own_only = [
        t
        for t in range(n)
        if all(s.owner_of_row(r) == rank for r in range(*_tile_rows(t, block_m, s.rows)))
    ]
    assert set(p.tile_order[: len(own_only)]) == set(own_only)
    for t, waits in zip(p.tile_order, p.waits):
        assert len(waits) == p.max_waits
        slots = [x for x in waits if x >= 0]
        assert waits[len(slots) :] == (-1,) * (p.max_waits - len(slots))
        assert all(row_order[x].owner != rank for x in slots)
        lo, hi = _tile_rows(t, block_m, s.rows)
        overlapping = [i for i, c in enumerate(row_order) if c.lo < hi and c.hi > lo]
        assert overlapping == list(range(overlapping[0], overlapping[-1] + 1))  # contiguous
        covered = set()
        for i in overlapping:
            if i in slots or row_order[i].owner == rank:
                covered.update(range(row_order[i].lo, row_order[i].hi))
        assert set(range(lo, hi)) <= covered
        assert set(slots) == {i for i in overlapping if row_order[i].owner != rank}


def _check_producer(s, rank, block_m, p):
    n = -(-s.rows // block_m)
    assert sorted(p.tile_order) == list(range(n))
    lo, hi = s.shard(rank)
    stays = [t for t in range(n) if lo <= t * block_m and min(s.rows, (t + 1) * block_m) <= hi]
    assert set(p.tile_order[n - len(stays) :]) == set(stays)
    expected = [0] * len(s.chunks)
    for t, notifies in zip(p.tile_order, p.notifies):
        slots = [x for x in notifies if x >= 0]
        a, b = _tile_rows(t, block_m, s.rows)
        assert slots == [i for i, c in enumerate(s.row_order) if c.lo < b and c.hi > a]
        for x in slots:
            expected[x] += 1
    assert list(p.expected) == expected


# the plan property cases besides the template: mode, world size, rows per rank, split,
# tile height, and data to draw the rank from
_PLAN_CASES = dict(
    mode=st.sampled_from(["push", "pull"]),
    w=st.integers(2, 8),
    rows=st.integers(1, 300),
    split=st.integers(1, 4),
    block_m=st.sampled_from([1, 16, 64, 128, 100]),
    data=st.data(),
)


def _plan_or_none(plan_fn, s, rank, block_m, limit):
    """``plan_fn``'s plan with the keyword ``limit`` (``max_waits``, ``max_notifies``) at 8,
    or None where the plan needs more and the ScheduleError says so."""
    try:
        return plan_fn(s, rank, block_m, **{limit: 8})
    except ScheduleError as e:
        assert f"{limit}=8" in str(e)
        return None


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(AG)), **_PLAN_CASES)
def test_consumer_plan_properties(name, mode, w, rows, split, block_m, data):
    s = AG[name](w, rows, split, mode=mode)
    rank = data.draw(st.integers(0, w - 1))
    p = _plan_or_none(consumer_plan, s, rank, block_m, "max_waits")
    if p is None:
        return
    _check_consumer(s, rank, block_m, p)
    if mode == "pull":
        # pulls land in this rank's issue order: tiles go by their last remote chunk's turn
        turn = {t.signal: i for i, t in enumerate(transfers(s, rank))}
        last = [max((turn[x] for x in ws if x >= 0), default=-1) for ws in p.waits]
        assert last == sorted(last)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(RS)), **_PLAN_CASES)
def test_producer_plan_properties(name, mode, w, rows, split, block_m, data):
    s = RS[name](w, rows, split, mode=mode)
    rank = data.draw(st.integers(0, w - 1))
    p = _plan_or_none(producer_plan, s, rank, block_m, "max_notifies")
    if p is not None:
        _check_producer(s, rank, block_m, p)


def test_chunk_order_and_aligned_chunks():
    from interlace.schedule import check, chunk_order, full_mesh_reduce_scatter

    s = full_mesh_all_gather(4, 300, 2, align=128)
    check(s)
    assert [(c.lo, c.hi) for c in s.row_order][:2] == [(0, 256), (256, 300)]
    order = chunk_order(s, 1)
    # own chunks first (no wait), then by arrival: rank 0 pushes to 1 first, then 3, then 2
    assert [(c.owner, slot) for c, slot in order] == [
        (1, None), (1, None), (0, 0), (0, 1), (3, 6), (3, 7), (2, 4), (2, 5),
    ]  # fmt: skip
    rs = full_mesh_reduce_scatter(3, 7, 1)
    assert [c.owner for c, _ in chunk_order(rs, 0)] == [1, 2, 0]  # own rows last
