"""The eager fast path of the GEMM ops' argument checks (``_gemm.operands_fit``) may only
accept what the full checks accept: every input it lets through must pass
``check_gemm_call`` and the row bound, and the common valid call must take it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from interlace.errors import InterlaceError
from interlace.ops import segment_gemm as _gemm
from interlace.ops._context import OpContext

K, N, ROWS = 32, 48, 64


class _Ctx:
    op_name = "test_op"
    dtype = torch.bfloat16
    group = SimpleNamespace(device=torch.device("cpu"))
    k, n = K, N
    _check_tensor = OpContext._check_tensor
    _check_placed = OpContext._check_placed


def _full_checks_pass(ctx, a, b, bias, rows_max) -> bool:
    try:
        _gemm.check_gemm_call(ctx, a, b, bias)
    except (InterlaceError, TypeError, AttributeError):
        return False
    return 0 < a.shape[0] <= rows_max


def _unaligned(rows, cols, dtype=torch.bfloat16):
    flat = torch.randn(rows * cols + 1).to(dtype)
    return flat[1:].view(rows, cols)  # contiguous, starts 2 bytes past an allocation


def _cases():
    bf = torch.bfloat16
    a, b, bias = torch.randn(16, K).to(bf), torch.randn(K, N).to(bf), torch.randn(N).to(bf)
    return {
        "valid": (a, b, None),
        "valid with bias": (a, b, bias),
        "narrower b": (a, b[:, :16].contiguous(), None),
        "a float16": (a.half(), b, None),
        "b float32": (a, b.float(), None),
        "a 1-D": (a.reshape(-1), b, None),
        "a 3-D": (a.reshape(2, 8, K), b, None),
        "a transposed": (torch.randn(K, 16).to(bf).t(), b, None),
        "a wrong k": (torch.randn(16, K + 8).to(bf), b, None),
        "b wrong k": (a, torch.randn(K + 8, N).to(bf), None),
        "b too wide": (a, torch.randn(K, N + 16).to(bf), None),
        "too many rows": (torch.randn(ROWS + 1, K).to(bf), b, None),
        "no rows": (torch.randn(0, K).to(bf), b, None),
        "a unaligned": (_unaligned(16, K), b, None),
        "bias wrong length": (a, b, torch.randn(N - 1).to(bf)),
        "bias float32": (a, b, torch.randn(N)),
        "bias 2-D": (a, b, bias.view(1, N)),
        "a not a tensor": (a.tolist(), b, None),
        "bias not a tensor": (a, b, [0.0] * N),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_fast_path_accepts_only_what_the_full_checks_accept(name):
    a, b, bias = _cases()[name]
    ctx = _Ctx()
    fits = _gemm.operands_fit(ctx, a, b, bias, ROWS)
    if fits:
        assert _full_checks_pass(ctx, a, b, bias, ROWS), f"{name}: fast path accepted it"
    if name.startswith("valid") or name == "narrower b":
        assert fits, f"{name}: a valid call missed the fast path"
