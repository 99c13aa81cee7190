"""``runtime.driver``: off where it cannot work (no CUDA device, or switched off), so the
stream helpers keep torch's calls there; on the GPU machine the ops' GPU tests run on it."""

from __future__ import annotations

import torch

from interlace.runtime import driver


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("INTERLACE_DRIVER_CALLS", "0")
    driver._lib.cache_clear()
    try:
        assert driver._lib() is None
    finally:
        driver._lib.cache_clear()


def test_off_without_a_cuda_device():
    driver.enabled.cache_clear()
    try:
        assert driver.enabled() == (torch.cuda.is_available() and driver._lib() is not None)
        if not torch.cuda.is_available():
            assert not driver.enabled()
    finally:
        driver.enabled.cache_clear()
