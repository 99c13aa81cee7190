"""Shared by the nn tests: world parameters, float32 references of the tensor-parallel
math built on every rank from seeds every rank knows, tiny model configs. Module level, so
rank bodies that use them pickle by reference."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import GPU_SIZES

TOL = 1e-2  # one op, bf16 against a float32 reference
MODEL_TOL = 2e-2  # a whole model (several layers of bf16 rounding) against float32


def worlds(cpu=(2, 3), gpu=GPU_SIZES):
    """World parameters for ``@pytest.mark.parametrize("world", ..., indirect=True)``."""
    return [pytest.param(("cpu", w), id=f"cpu{w}") for w in cpu] + [
        pytest.param(("cuda", w), id=f"cuda{w}", marks=pytest.mark.gpu) for w in gpu
    ]


def seeded(seed: int, *shape, scale: float = 1.0, dtype=torch.bfloat16, device="cpu"):
    """A random tensor every rank can rebuild from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def rel(out, ref) -> float:
    ref = ref.detach().float().cpu()
    return float((out.detach().float().cpu() - ref).norm() / ref.norm().clamp_min(1e-12))


def leaf(t):
    return t.detach().clone().requires_grad_()
