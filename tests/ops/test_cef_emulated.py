"""The ``ce_fused`` GEMM as one rank of four runs it, on one device with its waits met in
advance (``interlace.testing.emulated``): each layout, in the per-segment loop and in the one-loop
mode (push tiles, then reduce tiles), writes what float32 says into the stage, the
reduce-scatter output or every rank's all-reduce result, and raises every chunk's counter
to its tiles x the count unit (``check`` raises otherwise). On the CPU this runs the
kernel under Triton's interpreter; with a GPU, compiled."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import get_world

MODES = ("stage", "rs", "ar")


def _body(group, one_loop):
    from interlace.testing.emulated import Emulated

    dev = group.device
    errors = {}
    m, n, k = (256, 64, 48) if group.backend == "cpu" else (2048, 512, 384)
    for mode in MODES:
        for rank in (0, 3):  # first and last rank: own chunks at either end of the rows
            emu = Emulated(4, rank, m, n, k, mode, 2, device=dev, one_loop=one_loop)
            errors[(mode, rank)] = emu.check()
            if one_loop:
                assert emu.unit == emu.cfg.num_warps  # counted per warp
    return errors


@pytest.mark.parametrize("one_loop", [False, True], ids=["segment_loop", "one_loop"])
@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_emulated_ce_fused_layouts(backend, one_loop):
    for errors in get_world(backend, 1).run(_body, one_loop):
        assert set(errors) == {(mode, r) for mode in MODES for r in (0, 3)}
        worst = max(errors.values())
        assert worst < 1e-2, errors
        assert torch.isfinite(torch.tensor(worst))
