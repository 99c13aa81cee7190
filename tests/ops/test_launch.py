"""The launch paths of ``interlace.ops._launch``: the hook check that decides whether the
short path may be taken, and ``PreparedLaunch`` putting each call's operands in the right
places (under the interpreter it takes Triton's full path with the same arguments)."""

from __future__ import annotations

import threading

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
    monkeypatch.setattr(_launch, "_THREAD", threading.local())
    _launch.install_scratch_allocator()
    alloc = set_to["fn"]
    first = alloc(256, 128, 11)
    assert alloc(256, 128, 11) is first  # same stream, same size: reused
    assert alloc(256, 128, 12) is not first  # another stream
    assert alloc(512, 128, 11) is not first  # another size
    capturing["now"] = True
    assert alloc(256, 128, 11) is not first  # a captured launch gets its own


def test_scratch_allocator_is_set_in_every_thread():
    """Triton keeps its allocator per thread (a context variable) and autograd runs a
    backward on a thread of its own: the allocator set in one thread is missing in another
    until that thread installs it too."""
    from triton.runtime import _allocation

    from interlace.ops import _launch

    _launch.install_scratch_allocator()
    assert _allocation._allocator.get() is _launch._scratch_alloc
    seen = {}

    def other():
        seen["before"] = _allocation._allocator.get()
        _launch.install_scratch_allocator()
        seen["after"] = _allocation._allocator.get()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["before"] is not _launch._scratch_alloc
    assert seen["after"] is _launch._scratch_alloc
