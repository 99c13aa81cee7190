"""``World``: its options, and how it reports and recovers from a failed body."""

from __future__ import annotations

import os

import pytest

from interlace.errors import InterlaceValueError
from interlace.testing import World
from interlace.testing.world import WorldError


def test_share_device_needs_the_cuda_backend():
    with pytest.raises(InterlaceValueError, match="share_device=True needs backend='cuda'"):
        World(2, "cpu", share_device=True)


def _pid(group):
    return os.getpid()


def _fail_on_rank_1(group):
    if group.rank == 1:
        raise RuntimeError("rank 1 gives up")
    return True


def test_a_failed_body_ends_the_world():
    """A body that fails on one rank is reported with that rank's traceback, and the next
    body runs on fresh rank processes (nothing of the failed body's state carries over)."""
    with World(2, "cpu") as world:
        before = world.run(_pid)
        with pytest.raises(WorldError, match="(?s)failed on ranks \\[1\\].*rank 1 gives up"):
            world.run(_fail_on_rank_1)
        after = world.run(_pid)
        assert set(after).isdisjoint(before)
