"""The fused kernels as one rank runs them, on one device with their waits met in advance
(``interlace.testing.emulated``, what ``bench kernels`` times): each mode writes what
float32 says into its outputs (poisoned first) and, for ``ce_fused``, raises every chunk's
counter to its tiles x the count unit (``check`` raises otherwise), again on a second
launch of the same kernel. ``ce_fused`` runs as one rank of four in the per-segment loop
and in the one-loop mode; every mode as a first and a last rank. On the CPU this runs the
kernel under Triton's interpreter; with a GPU, compiled."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import get_world

CE_FUSED = ("stage", "rs", "ar")
EVERY = ("plain", "ag", "rs_fused", "ar_fused", "rs", "ar")


def _ce_fused_body(group, one_loop):
    from interlace.testing.emulated import Emulated

    dev = group.device
    errors = {}
    m, n, k = (256, 64, 48) if group.backend == "cpu" else (2048, 512, 384)
    for mode in CE_FUSED:
        for rank in (0, 3):  # first and last rank: own chunks at either end of the rows
            emu = Emulated(4, rank, m, n, k, mode, 2, device=dev, one_loop=one_loop)
            errors[(mode, rank)] = emu.check()
            if one_loop:
                assert emu.unit == emu.cfg.num_warps  # counted per warp
    return errors


@pytest.mark.parametrize("one_loop", [False, True], ids=["segment_loop", "one_loop"])
@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_emulated_ce_fused_layouts(backend, one_loop):
    for errors in get_world(backend, 1).run(_ce_fused_body, one_loop):
        assert set(errors) == {(mode, r) for mode in CE_FUSED for r in (0, 3)}
        worst = max(errors.values())
        assert worst < 1e-2, errors
        assert torch.isfinite(torch.tensor(worst))


def _every_mode_body(group, world):
    from interlace.testing.emulated import Emulated

    dev = group.device
    m, n, k = (37 * world, 40, 24) if group.backend == "cpu" else (1000 * world, 520, 264)
    errors = {}
    for mode in EVERY:
        for rank in (0, world - 1):
            emu = Emulated(world, rank, m, n, k, mode, device=dev, one_loop=None)
            first = emu.check()
            errors[(mode, rank)] = max(first, emu.check())  # a second launch, waits still met
    return errors


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_emulated_every_mode(backend, world):
    for errors in get_world(backend, 1).run(_every_mode_body, world):
        assert set(errors) == {(mode, r) for mode in EVERY for r in (0, world - 1)}
        assert max(errors.values()) < 1e-2, errors


def test_emulated_rejects_unknown_mode():
    from interlace.testing.emulated import Emulated

    with pytest.raises(ValueError, match="mode must be one of"):
        Emulated(2, 0, 64, 32, 32, "bogus", device=torch.device("cpu"))


def _pushes_body(group):
    from interlace.testing.emulated import Emulated

    dev = group.device
    m_loc, n, k = (32, 40, 24) if group.backend == "cpu" else (512, 520, 264)
    moved = {}
    for mode in ("rs_fused", "ar_fused"):
        emu = Emulated(3, 1, 3 * m_loc, n, k, mode, device=dev, one_loop=None)
        before = emu.recv.clone()
        emu.peer_recv.fill_(float("nan"))
        emu.check()
        pushed = emu.peer_recv[1]  # this rank's slot of the owners' (stand-in) buffers
        moved[mode] = (bool(torch.equal(emu.recv, before)), bool(torch.isfinite(pushed).all()))
    return moved


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_emulated_fused_pushes_land_in_the_stand_in(backend):
    """``fused``'s partial tiles for other ranks go to the stand-in of their buffers: this
    rank's receive buffer, which holds the peers' partials it reduces, stays untouched,
    and every row of this rank's slot in the stand-in is written."""
    for moved in get_world(backend, 1).run(_pushes_body):
        assert moved == {"rs_fused": (True, True), "ar_fused": (True, True)}
