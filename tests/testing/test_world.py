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


def _rank_1_hangs(group):
    import time

    if group.rank == 1:
        time.sleep(60)  # (the world is torn down long before)
    return True


def test_a_rank_that_hangs_is_reported_with_its_stack():
    """A rank that does not answer in time is named, with the Python stack where it was
    (here: the body's sleep; written shortly before the limit), and its stack file is
    removed with the world."""
    hung = "(?s)ranks \\[1\\] did not answer.*where it was.*line [0-9]+ in _rank_1_hangs"
    with World(2, "cpu", timeout=120) as world:
        world.run(_pid)  # started: the limit below is the body's alone
        with pytest.raises(WorldError, match=hung):
            world.run(_rank_1_hangs, timeout=4)
        prefix = world.shm_prefix
    import glob
    import tempfile

    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"{prefix}-stack-*"))


def _rank_0_fails_rank_1_hangs(group):
    import time

    if group.rank == 0:
        raise RuntimeError("rank 0 gives up")
    time.sleep(60)
    return True


def test_after_a_failure_a_hung_peer_is_shown_where_it_waits(monkeypatch):
    """Rank 0 raises and rank 1 never answers: the error holds rank 0's traceback and
    rank 1's last stack (written within the grace the world gives after a failure)."""
    from interlace.testing import world as world_mod

    monkeypatch.setattr(world_mod, "ERROR_GRACE_S", 4.0)
    want = "(?s)rank 0 gives up.*rank 1, where it was.*line [0-9]+ in _rank_0_fails_rank_1_hangs"
    with World(2, "cpu", timeout=120) as world:
        world.run(_pid)
        with pytest.raises(WorldError, match=want):
            world.run(_rank_0_fails_rank_1_hangs)


def test_stack_writes_never_disturb_a_long_body(monkeypatch):
    """A rank's stack is rewritten every half second while a body runs the interpreter (a
    sequence-parallel attention forward and backward, ten seconds at W 2; bodies of the CPU
    suite run that long and longer): every rank answers. (Stacks read without the GIL, by
    faulthandler's watchdog, crashed such ranks within seconds.)"""
    from interlace.testing import world as world_mod
    from tests.ops.test_sp_attention import _fwd_bwd_body

    monkeypatch.setattr(world_mod, "STACK_MARGIN_S", world_mod.ERROR_GRACE_S - 0.5)
    with World(2, "cpu", timeout=120) as world:
        world.run(_fwd_bwd_body, True, 0, 4, 2, 64, "bfloat16", "fused", True)


def _rank_1_exits(group):
    if group.rank == 1:
        os._exit(3)
    return True


def test_a_rank_that_dies_is_named_with_its_exit_code():
    """A rank whose process ends in a body is reported at once, with its exit code (not as
    a rank that ran out of time)."""
    import time

    with World(2, "cpu", timeout=120) as world:
        world.run(_pid)
        start = time.monotonic()
        want = "ranks \\[1\\] did not answer: rank 1 exited with code 3"
        with pytest.raises(WorldError, match=want):
            world.run(_rank_1_exits)
        assert time.monotonic() - start < 60
