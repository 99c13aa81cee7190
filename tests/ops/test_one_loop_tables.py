"""When the segment GEMM's one-loop mode applies (``_gemm.one_loop_tables``) and what its
tables hold: the segment of each row of tiles and the tiles of the leading segments
that run in a first loop (own rows; pushes)."""

from __future__ import annotations

import torch

from interlace.ops import segment_gemm as _gemm
from interlace.ops.segment_gemm import GemmConfig, Segment

CFG = GemmConfig(block_m=32, block_n=32, block_k=32)
BF16 = torch.bfloat16


def _tables(segments, m, n=64, k=64, cfg=CFG):
    return _gemm.one_loop_tables(segments, m, n, k, cfg, BF16, "cpu")


def test_ag_layout_with_own_rows_first():
    segs = [
        Segment(row0=0, rows=64, kind="store_own"),
        Segment(row0=64, rows=32, kind="store", wait_count=1),
        Segment(row0=96, rows=40, kind="store", wait_count=1),  # ragged, but ends at M
    ]
    t = _tables(segs, m=136)
    assert t is not None
    assert t.mt_seg.tolist() == [0, 0, 1, 2, 2]
    assert t.lead_tiles == 2 * 2  # two rows of tiles x (64 / 32) columns
    assert _gemm.count_unit(t, CFG) == CFG.num_warps and _gemm.count_unit(None, CFG) == 1


def test_scatter_layout_pushes_first():
    push = [Segment(row0=32 * i, rows=32, kind="push") for i in range(2)]
    reduce = Segment(row0=64, rows=32, kind="reduce")
    t = _tables([*push, reduce], m=96)
    assert t is not None and t.mt_seg.tolist() == [0, 1, 2]
    assert t.lead_tiles == 2 * 2  # the pushes' loop: two rows of tiles x 2 columns
    staged = _tables(push, m=64)  # pushes only: all in the first loop
    assert staged is not None and staged.lead_tiles == 4
    assert _tables([push[0], reduce, push[1]], m=96) is None  # a push after a reduce


def test_not_eligible():
    own = Segment(row0=0, rows=32, kind="store_own")
    peer = Segment(row0=32, rows=32, kind="store", wait_count=1)
    assert _tables([own], m=32) is None  # one segment: the plain loop
    ragged = Segment(row0=0, rows=40, kind="store_own")
    assert _tables([ragged, Segment(row0=40, rows=24, kind="store")], m=64) is None
    assert _tables([peer, own], m=64) is None  # own rows after a peer's
    two_waits = Segment(row0=32, rows=32, kind="store", wait_count=2)
    assert _tables([own, two_waits], m=64) is None
    mixed = [own, Segment(row0=32, rows=32, kind="push")]
    assert _tables(mixed, m=64) is None
    assert _tables([own, peer], m=64, n=63) is None  # no TMA (row stride not 16-byte aligned)
