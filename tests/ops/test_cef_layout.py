"""``cef_layout``: the segments one rank's ``ce_fused`` GEMM runs (pure host logic, shared
by the op and the single-GPU kernel probe)."""

from __future__ import annotations

import pytest

from interlace.ops.gemm_rs import cef_layout
from interlace.ops.segment_gemm import MAX_SPLIT, GemmConfig, tiles_of

CFG = GemmConfig(block_m=32, block_n=32)
ARRIVAL, DONE = 100, 10


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize(
    "all_reduce,gather_epilogue", [(False, False), (True, True), (True, False)]
)
@pytest.mark.parametrize("split", [1, 2])
def test_every_row_once_own_rows_reduced(world, all_reduce, gather_epilogue, split):
    m, n = world * 70, 48  # 70 rows per rank: no multiple of the tile
    for rank in range(world):
        lay = cef_layout(
            world, rank, m, n, CFG, split, all_reduce=all_reduce,
            gather_epilogue=gather_epilogue, arrival=ARRIVAL, done=DONE,
        )  # fmt: skip
        assert len(lay.segments) == len(lay.chunks) == world * split
        rows = sorted((s.row0, s.row0 + s.rows) for s in lay.segments)
        assert rows[0][0] == 0 and rows[-1][1] == m
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))  # each row exactly once
        for chunk, seg in zip(lay.chunks, lay.segments):
            cid = lay.slot_of[chunk.id]
            assert (seg.row0, seg.rows, seg.owner) == (chunk.lo, chunk.rows, chunk.owner)
            assert seg.out_row0 == chunk.lo - chunk.owner * (m // world)
            if chunk.owner != rank:  # staged, counted for the copy engine, never waits
                assert seg.kind == "push" and seg.wait_count == 0 and seg.notify == DONE + cid
                final = tiles_of(chunk.rows, n, CFG) if gather_epilogue else 0
                assert seg.final_expected == final
            else:  # one arrival flag per peer
                assert seg.kind == "reduce" and seg.wait_count == world - 1
                assert seg.wait_first == ARRIVAL + cid * (world - 1)
                broadcast = ARRIVAL + world * MAX_SPLIT * (world - 1) + cid
                want = broadcast if gather_epilogue else DONE + cid if all_reduce else 0
                assert seg.notify == want
        kinds = [s.kind for s in lay.segments]
        if not all_reduce:  # reduce-scatter: own chunks last
            assert kinds[-split:] == ["reduce"] * split
            assert "reduce" not in kinds[:-split]
        else:  # all-reduce: own chunk j after round j + 1 (a round late), the last at the end
            assert kinds[-1] == "reduce" and kinds[0] == "push"
