"""The stream spans' clock anchor: of several timer brackets around anchor events, the
narrowest is kept (ranks time-slicing one GPU widen some brackets by milliseconds), with a
half-width that covers every point of the bracket."""

from __future__ import annotations

import pytest

from interlace.errors import InterlaceValueError
from interlace.trace.recorder import ANCHORS, tightest_bracket


def test_tightest_bracket_is_kept():
    # wide brackets (a context switch between the reads) around a narrow one
    reads = [0, 2_000_000, 3_000_000, 3_000_007, 4_000_000, 4_900_000, 5_000_000, 5_000_010]
    i, middle, half = tightest_bracket(reads)
    assert i == 1
    assert middle == 3_000_003 and half == 4
    lo, hi = reads[2 * i], reads[2 * i + 1]
    assert middle - half <= lo and hi <= middle + half  # the whole bracket is covered


def test_one_bracket_per_anchor():
    reads = [10 * j + (j % 2) * (j + 5) for j in range(2 * ANCHORS)]
    i, middle, half = tightest_bracket(reads)
    widths = [reads[2 * k + 1] - reads[2 * k] for k in range(ANCHORS)]
    assert widths[i] == min(widths) and i == 0
    assert (middle, half) == (reads[0] + widths[0] // 2, -(-widths[0] // 2))


@pytest.mark.parametrize("reads", [[], [5], [1, 2, 3]])
def test_reads_come_in_pairs(reads):
    with pytest.raises(InterlaceValueError, match="pairs"):
        tightest_bracket(reads)


def test_timer_jump_between_the_anchors():
    from interlace.trace.recorder import TIMER_JUMP_MIN_NS, timer_jump

    # the timer and the events agree (to within the brackets): no jump
    assert timer_jump(1_000, 5_001_000, 5_000_000, 40) == 0
    assert timer_jump(1_000, 5_001_000 + TIMER_JUMP_MIN_NS, 5_000_000, 40) == 0
    # the timer moved 1.04 s more than the events' 5 ms apart: that jump, either way
    assert timer_jump(0, 1_045_000_000, 5_000_000, 40) == 1_040_000_000
    assert timer_jump(0, 4_000_000, 5_000_000, 40) == -1_000_000  # 1 ms back
    assert timer_jump(0, 4_990_000, 5_000_000, 40) == 0  # 10 us: within the minimum
    # a wide bracket (a context switch between the reads) covers more drift
    assert timer_jump(0, 5_300_000, 5_000_000, 400_000) == 0
