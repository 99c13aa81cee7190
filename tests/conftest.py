"""Shared fixtures: rank worlds started once per session and reused by every test body.

``world`` is parametrised over the CPU emulation with 2, 3 and 4 ranks and over CUDA with
2 and 4 ranks (marked ``gpu``; skipped where there are fewer GPUs). A test body is a
module-level function ``body(group, ...)`` run on every rank with ``world.run(body, ...)``.
"""

from __future__ import annotations

import pytest

from interlace.testing import World

CPU_SIZES = (2, 3, 4)
GPU_SIZES = (2, 4)

_worlds: dict[tuple[str, int], World] = {}


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


def get_world(backend: str, size: int) -> World:
    """The session's world of ``size`` ranks on ``backend`` (started on first use)."""
    if backend == "cuda" and _gpu_count() < size:
        pytest.skip(f"needs {size} GPUs, found {_gpu_count()}")
    key = (backend, size)
    if key not in _worlds:
        _worlds[key] = World(size, backend, timeout=240 if backend == "cpu" else 120)
    return _worlds[key]


WORLD_PARAMS = [pytest.param(("cpu", w), id=f"cpu{w}") for w in CPU_SIZES] + [
    pytest.param(("cuda", w), id=f"cuda{w}", marks=pytest.mark.gpu) for w in GPU_SIZES
]
#: ``WORLD_PARAMS`` plus one GPU, for tests whose device code runs the same with one rank:
#: ``@pytest.mark.parametrize("world", WITH_ONE_GPU, indirect=True)``
WITH_ONE_GPU = [*WORLD_PARAMS, pytest.param(("cuda", 1), id="cuda1", marks=pytest.mark.gpu)]


@pytest.fixture(params=WORLD_PARAMS)
def world(request) -> World:
    return get_world(*request.param)


def pytest_sessionfinish(session, exitstatus):
    for w in _worlds.values():
        w.close()
    _worlds.clear()
