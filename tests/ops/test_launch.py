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


def test_tma_scratch_is_reused_per_stream_and_fresh_under_capture(monkeypatch):
    """The scratch allocator hands one buffer per (device, stream, size) to eager launches
    (launches on one stream run in order) and a new one to a launch being captured."""
    from interlace.ops import _launch

    set_to = {}
    monkeypatch.setattr(triton, "set_allocator", lambda fn: set_to.setdefault("fn", fn))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    capturing = {"now": False}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    real_empty = torch.empty
    monkeypatch.setattr(
        torch, "empty", lambda size, device=None, dtype=None: real_empty(size, dtype=dtype)
    )
    monkeypatch.setattr(_launch, "_SCRATCH", {})
    _launch.install_scratch_allocator.cache_clear()
    try:
        _launch.install_scratch_allocator()
        alloc = set_to["fn"]
        first = alloc(256, 128, 11)
        assert alloc(256, 128, 11) is first  # same stream, same size: reused
        assert alloc(256, 128, 12) is not first  # another stream
        assert alloc(512, 128, 11) is not first  # another size
        capturing["now"] = True
        assert alloc(256, 128, 11) is not first  # a captured launch gets its own
    finally:
        _launch.install_scratch_allocator.cache_clear()
