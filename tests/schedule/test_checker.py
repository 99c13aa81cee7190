"""The checker rejects broken schedules with a message naming rank, op and cause, and
accepts collective-based ones."""

from __future__ import annotations

from dataclasses import replace

import pytest

from interlace.errors import InterlaceValueError
from interlace.schedule import (
    P2P,
    Chunk,
    Collective,
    Schedule,
    ScheduleError,
    analyze,
    check,
    full_mesh_all_gather,
    full_mesh_reduce_scatter,
    partition_all_reduce,
    ring_all_gather,
    ring_reduce_scatter,
)


def _with_ops(s: Schedule, ops: dict) -> Schedule:
    return replace(s, ops={r: list(v) for r, v in ops.items()})


def _chunks(w: int, rows: int = 4) -> tuple[Chunk, ...]:
    return tuple(Chunk(r, "A", r * rows, (r + 1) * rows, r) for r in range(w))


def _schedule(kind: str, w: int, ops: dict) -> Schedule:
    return Schedule(w, kind, (4,) * w, _chunks(w), ops)


def test_error_is_a_value_error():
    assert issubclass(ScheduleError, InterlaceValueError)
    assert issubclass(ScheduleError, ValueError)


def test_hand_made_all_gather_passes():
    s = _schedule("all_gather", 2, {0: [P2P(0, 0, 1)], 1: [P2P(1, 1, 0)]})
    a = check(s)
    assert a.level == [0, 0]


def test_cycle_is_reported_with_its_ops():
    ops = {
        0: [P2P(0, 0, 1, deps=((1, 0),))],
        1: [P2P(1, 1, 0, deps=((0, 0),))],
    }
    with pytest.raises(ScheduleError, match="dependency cycle") as e:
        check(_schedule("all_gather", 2, ops))
    assert "rank 0 op 0" in str(e.value) and "rank 1 op 0" in str(e.value)


def test_cycle_through_program_order():
    # rank 0 op 1 waits on rank 1 op 0, which waits on rank 0 op 1 (after op 0 of rank 0)
    s = ring_all_gather(2, 4, split=2)
    ops = {r: list(v) for r, v in s.ops.items()}
    ops[1][0] = replace(ops[1][0], deps=((0, 1),))
    ops[0][1] = replace(ops[0][1], deps=((1, 0),))
    with pytest.raises(ScheduleError, match=r"cycle.*rank 0 op 1.*rank 1 op 0"):
        check(_with_ops(s, ops))


def test_self_dependency():
    with pytest.raises(ScheduleError, match="rank 0 op 0: depends on itself"):
        check(_schedule("all_gather", 2, {0: [P2P(0, 0, 1, deps=((0, 0),))], 1: []}))


def test_missing_piece():
    s = full_mesh_all_gather(3, 4)
    ops = {r: list(v) for r, v in s.ops.items()}
    dropped = ops[2].pop()  # rank 2's send to rank 1
    assert (dropped.chunk, dropped.dst) == (2, 1)
    with pytest.raises(ScheduleError, match=r"rank 1 never receives chunk 2 \(rows \[8, 12\)"):
        check(_with_ops(s, ops))


def test_missing_reduce_contribution():
    s = full_mesh_reduce_scatter(3, 4)
    ops = {r: list(v) for r, v in s.ops.items()}
    ops[1].pop()  # rank 1's partial of rank 0's rows
    with pytest.raises(ScheduleError, match=r"rank 0 ends with chunk 0 .* missing ranks \[1\]"):
        check(_with_ops(s, ops))


def test_double_counted_reduce():
    s = full_mesh_reduce_scatter(3, 4)
    ops = {r: list(v) for r, v in s.ops.items()}
    ops[1].append(P2P(0, 1, 0, reduce=True))  # rank 1 adds its partial of chunk 0 again
    with pytest.raises(ScheduleError, match=r"rank 1 op 2: .*double-counted"):
        check(_with_ops(s, ops))


def test_double_counted_collective():
    ops = {r: [P2P(0, r, 0, reduce=True)] for r in (1, 2)}
    ops[0] = [Collective("reduce_scatter", (0, 1, 2), (0, 1, 2), deps=((1, 0), (2, 0)))]
    for r in (1, 2):
        ops[r].append(Collective("reduce_scatter", (0, 1, 2), (0, 1, 2)))
    with pytest.raises(ScheduleError, match="rank 0 op 0: reduce_scatter of chunk 0 double"):
        check(_schedule("reduce_scatter", 3, ops))


def test_forward_before_receive():
    s = ring_all_gather(3, 4)
    ops = {r: [replace(op, deps=()) for op in v] for r, v in s.ops.items()}
    with pytest.raises(ScheduleError, match=r"rank 0 op 1: reads chunk 2 on rank 0 while") as e:
        check(_with_ops(s, ops))
    assert "data used before it arrived" in str(e.value)
    assert "rank 2 op 0" in str(e.value)  # the receive it should wait on


def test_forward_before_receive_reduce():
    s = ring_reduce_scatter(3, 4, mode="pull")
    ops = {r: [replace(op, deps=()) for op in v] for r, v in s.ops.items()}
    with pytest.raises(ScheduleError, match="data used before it arrived"):
        check(_with_ops(s, ops))


def test_send_of_chunk_never_received():
    ops = {0: [P2P(0, 0, 1)], 1: [P2P(1, 1, 0), P2P(2, 1, 2)], 2: []}
    with pytest.raises(ScheduleError, match="rank 1 op 1: sends chunk 2 from rank 1, which does"):
        check(_schedule("all_gather", 3, ops))


def test_dep_to_nonexistent_op():
    s = ring_all_gather(3, 4)
    ops = {r: list(v) for r, v in s.ops.items()}
    ops[1][1] = replace(ops[1][1], deps=((0, 7),))
    with pytest.raises(ScheduleError, match="rank 1 op 1: depends on rank 0 op 7, which does not"):
        check(_with_ops(s, ops))
    ops[1][1] = replace(ops[1][1], deps=((5, 0),))
    with pytest.raises(ScheduleError, match="rank 1 op 1: depends on rank 5 op 0"):
        check(_with_ops(s, ops))
    ops[1][1] = replace(ops[1][1], deps=(0,))
    with pytest.raises(ScheduleError, match=r"rank 1 op 1: a dependency must be \(rank, index\)"):
        check(_with_ops(s, ops))


def test_duplicate_delivery():
    s = full_mesh_all_gather(2, 4)
    ops = {0: [P2P(0, 0, 1), P2P(0, 0, 1)], 1: list(s.ops[1])}
    with pytest.raises(ScheduleError, match=r"rank 0 op 1: delivers chunk 0 .* to rank 1 again"):
        check(_with_ops(s, ops))


def test_op_on_the_wrong_list():
    ops = {0: [P2P(0, 0, 1), P2P(0, 0, 2)], 1: [P2P(1, 1, 0), P2P(1, 1, 2)], 2: []}
    ops[2] = [P2P(2, 2, 0), P2P(2, 2, 1), P2P(0, 0, 1, mode="pull")]
    with pytest.raises(ScheduleError, match="rank 2 op 2: a pull from 0 to 1 must be in rank 1"):
        check(_schedule("all_gather", 3, ops))


def test_concurrent_overwrites_race():
    # rank 2 forwards chunk 0 to rank 1 while rank 0 may still be sending it there too
    ops = {0: [P2P(0, 0, 2), P2P(0, 0, 1)], 1: [P2P(1, 1, 0), P2P(1, 1, 2)]}
    ops[2] = [P2P(2, 2, 0), P2P(2, 2, 1), P2P(0, 2, 1, deps=((0, 0),))]
    with pytest.raises(ScheduleError, match="rank 2 op 2: writes chunk 0 on rank 1 unordered"):
        check(_schedule("all_gather", 3, ops))


def test_overwrite_of_owner():
    ops = {0: [P2P(0, 0, 1)], 1: [P2P(1, 1, 0), P2P(0, 1, 0, deps=((0, 0),))]}
    with pytest.raises(ScheduleError, match="rank 1 op 1: overwrites chunk 0 .* on its owner"):
        check(_schedule("all_gather", 2, ops))


def test_structural_errors():
    good = {0: [P2P(0, 0, 1)], 1: [P2P(1, 1, 0)]}
    with pytest.raises(ScheduleError, match="chunk 5 does not exist"):
        check(_schedule("all_gather", 2, {0: [P2P(5, 0, 1)], 1: []}))
    with pytest.raises(ScheduleError, match="bad transfer 0 -> 0"):
        check(_schedule("all_gather", 2, {0: [P2P(0, 0, 0)], 1: []}))
    with pytest.raises(ScheduleError, match="rank 0 op 0: mode"):
        check(_schedule("all_gather", 2, {0: [P2P(0, 0, 1, mode="get")], 1: []}))
    with pytest.raises(ScheduleError, match="kind"):
        check(_schedule("broadcast", 2, good))
    gap = (Chunk(0, "A", 0, 3, 0), Chunk(1, "A", 4, 8, 1))
    with pytest.raises(ScheduleError, match=r"rows \[3, 4\) are in no chunk"):
        check(Schedule(2, "all_gather", (4, 4), gap, good))
    overlap = (Chunk(0, "A", 0, 4, 0), Chunk(1, "A", 3, 8, 1))
    with pytest.raises(ScheduleError, match="outside rank 1's shard"):
        check(Schedule(2, "all_gather", (4, 4), overlap, good))
    overlap = (Chunk(0, "A", 0, 4, 0), Chunk(2, "A", 2, 3, 0), Chunk(1, "A", 4, 8, 1))
    with pytest.raises(ScheduleError, match="chunk 2 overlaps rows below 4"):
        check(Schedule(2, "all_gather", (4, 4), overlap, good))
    short = (Chunk(0, "A", 0, 4, 0), Chunk(1, "A", 4, 7, 1))
    with pytest.raises(ScheduleError, match=r"rows \[7, 8\) are in no chunk"):
        check(Schedule(2, "all_gather", (4, 4), short, good))
    with pytest.raises(ScheduleError, match="not unique"):
        check(Schedule(2, "all_gather", (4, 4), (Chunk(0, "A", 0, 4, 0),) * 2, good))


def test_removing_any_op_is_caught():
    makers = [
        lambda: ring_all_gather(3, 5, split=2),
        lambda: full_mesh_all_gather(3, 5, split=2, mode="pull"),
        lambda: ring_reduce_scatter(3, 5, split=2),
        lambda: full_mesh_reduce_scatter(4, 5),
        lambda: partition_all_reduce(3, 5, algorithm="ring", mode="pull"),
        lambda: partition_all_reduce(3, 5),
    ]
    for make in makers:
        s = make()
        for r, i in s.refs():
            ops = {q: list(v) for q, v in s.ops.items()}
            del ops[r][i]
            # later ops of rank r shift down: repoint deps at them, drop deps on the victim
            for q in ops:
                for j, op in enumerate(ops[q]):
                    deps = tuple(
                        (dr, di - (dr == r and di > i)) for dr, di in op.deps if (dr, di) != (r, i)
                    )
                    ops[q][j] = replace(op, deps=deps)
            with pytest.raises(ScheduleError):
                check(_with_ops(s, ops))


def test_dropping_any_cross_rank_dep_of_a_ring_is_caught():
    s = ring_all_gather(4, 6, split=2, mode="pull")
    refs = [ref for ref in s.refs() if s.op(ref).deps]
    assert len(refs) == 4 * 2 * 2
    for r, i in refs:
        ops = {q: list(v) for q, v in s.ops.items()}
        ops[r][i] = replace(ops[r][i], deps=())
        with pytest.raises(ScheduleError, match="data used before it arrived"):
            check(_with_ops(s, ops))


def test_collective_all_gather_in_pieces():
    # each rank's shard is two chunks; two stock all-gathers, one per sub-chunk
    w = 3
    s = full_mesh_all_gather(w, 6, split=2)
    first = tuple(2 * r for r in range(w))
    second = tuple(2 * r + 1 for r in range(w))
    ops = {r: [Collective("all_gather", first, (0, 1, 2))] for r in range(w)}
    for r in range(w):
        ops[r].append(Collective("all_gather", second, (0, 1, 2)))
    a = check(_with_ops(s, ops))
    assert len(a.members) == 2 and a.level == [0, 1]
    del ops[2][1]
    with pytest.raises(ScheduleError, match=r"is not called by ranks \[2\]"):
        check(_with_ops(s, ops))


def test_collectives_called_in_inconsistent_order_deadlock():
    w = 2
    s = full_mesh_all_gather(w, 6, split=2)
    a_, b_ = Collective("all_gather", (0, 2), (0, 1)), Collective("all_gather", (1, 3), (0, 1))
    with pytest.raises(ScheduleError, match="dependency cycle"):
        check(_with_ops(s, {0: [a_, b_], 1: [b_, a_]}))


def test_collective_reduce_scatter_then_p2p_gather_is_an_all_reduce():
    w = 3
    s = partition_all_reduce(w, 4)
    rs = Collective("reduce_scatter", (0, 1, 2), (0, 1, 2))
    ops = {r: [rs] for r in range(w)}
    for r in range(w):
        for d in (1, 2):
            ops[r].append(P2P(r, r, (r + d) % w))
    check(_with_ops(s, ops))
    ops = {r: [rs] for r in range(w)}
    ops[0].append(P2P(0, 0, 1))  # rank 2 never gets partition 0's sum
    with pytest.raises(ScheduleError, match=r"rank 2 ends with chunk 0 .* missing ranks \[0, 1\]"):
        check(_with_ops(s, ops))


def test_analysis_levels_and_order():
    s = ring_all_gather(3, 4)
    a = analyze(s)
    assert [a.level[a.node[(r, i)]] for r in range(3) for i in range(2)] == [0, 1] * 3
    assert a.before(a.node[(2, 0)], a.node[(0, 1)])
    assert not a.ordered(a.node[(0, 0)], a.node[(1, 0)])
