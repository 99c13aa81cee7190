"""Shared fixtures: rank worlds started once per session and reused by every test body.

``world`` is parametrised over the CPU emulation with 2, 3 and 4 ranks and over CUDA with
2 and 4 ranks (``INTERLACE_TEST_GPU_SIZES=2,4,8`` for others), marked ``gpu`` and skipped
where there are fewer GPUs, unless ``INTERLACE_TEST_SHARE_GPU=1``: then the ranks share
GPU 0 (``World(share_device=True)``), which checks the cross-rank protocol on a one-GPU
machine, and tests marked ``own_gpu`` are skipped. A test body is a module-level function
``body(group, ...)`` run on every rank with ``world.run(body, ...)``.
"""

from __future__ import annotations

import os

import pytest

from interlace.testing import World

CPU_SIZES = (2, 3, 4)
#: ``INTERLACE_TEST_GPU_SIZES=2,4,8`` adds 8-rank GPU worlds (an 8-GPU machine, or shared)
GPU_SIZES = tuple(int(w) for w in os.environ.get("INTERLACE_TEST_GPU_SIZES", "2,4").split(","))

_worlds: dict[tuple[str, int], World] = {}


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


def get_world(backend: str, size: int, own_gpu: bool = False) -> World:
    """The session's world of ``size`` ranks on ``backend`` (started on first use).
    ``own_gpu``: the test needs each rank on its own GPU (the process group's collectives
    on CUDA tensors, which gloo cannot move; per-GPU memory accounting): skipped where the
    ranks would share one."""
    share = backend == "cuda" and _gpu_count() < size
    if share and not (_gpu_count() and os.environ.get("INTERLACE_TEST_SHARE_GPU") == "1"):
        pytest.skip(f"needs {size} GPUs, found {_gpu_count()}")
    if share and own_gpu:
        pytest.skip("needs a GPU per rank (collectives on CUDA tensors, per-GPU memory)")
    key = (backend, size)
    if key not in _worlds:
        # INTERLACE_TEST_WORLD_TIMEOUT_S bounds each test body (a GPU run sets it low so
        # that one hung body costs less of a bounded device call).
        default = 240 if backend == "cpu" or share else 120
        timeout = float(os.environ.get("INTERLACE_TEST_WORLD_TIMEOUT_S", default))
        _worlds[key] = World(size, backend, timeout=timeout, share_device=share)
    return _worlds[key]


WORLD_PARAMS = [pytest.param(("cpu", w), id=f"cpu{w}") for w in CPU_SIZES] + [
    pytest.param(("cuda", w), id=f"cuda{w}", marks=pytest.mark.gpu) for w in GPU_SIZES
]
#: ``WORLD_PARAMS`` plus one GPU, for tests whose device code runs the same with one rank:
#: ``@pytest.mark.parametrize("world", WITH_ONE_GPU, indirect=True)``
WITH_ONE_GPU = [*WORLD_PARAMS, pytest.param(("cuda", 1), id="cuda1", marks=pytest.mark.gpu)]


@pytest.fixture(params=WORLD_PARAMS)
def world(request) -> World:
    return get_world(*request.param, own_gpu=request.node.get_closest_marker("own_gpu") is not None)


def pytest_sessionfinish(session, exitstatus):
    for w in _worlds.values():
        w.close()
    _worlds.clear()
