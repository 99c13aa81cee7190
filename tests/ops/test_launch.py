"""The launch paths of ``interlace.ops._launch``: the hook check that decides whether the
short path may be taken, and ``PreparedLaunch`` putting each call's operands in the right
places (under the interpreter it takes Triton's full path with the same arguments)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from interlace.ops._launch import PreparedLaunch, _no_hook


def test_no_hook_sees_through_an_empty_hook_chain():
    from triton import knobs

    chain = type(knobs.runtime.launch_enter_hook)()  # Triton 3.6: a HookChain
    assert _no_hook(None) and _no_hook(chain)
    chain.add(print)
    assert not _no_hook(chain)


@triton.jit
def _axpy_kernel(x, y, out, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(
        out + offs, alpha * tl.load(x + offs, mask=mask) + tl.load(y + offs, mask=mask), mask=mask
    )


def test_operands_must_be_positional():
    with pytest.raises(ValueError, match="positional"):
        PreparedLaunch(_axpy_kernel, 1, (None, None), {"BLOCK": 16}, ("x", "out"))


def _prepared_body(group):
    n = 100
    run = PreparedLaunch(
        _axpy_kernel, 2, (None, None, None, n, 3.0), {"BLOCK": 64}, ("y", "x", "out")
    )
    gen = torch.Generator().manual_seed(group.rank)
    for _ in range(3):  # fresh operands every call, passed in the order ``operands`` names
        x, y = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        out = torch.full((n,), float("nan"))
        run(y, x, out)
        torch.testing.assert_close(out, 3.0 * x + y)
    return True


def test_prepared_launch_substitutes_operands():
    from tests.conftest import get_world

    get_world("cpu", 2).run(_prepared_body)
