"""``runtime.graphs.EagerGraph``: one call's work captured once, replayed with other
operands (kernel parameters and copy addresses re-pointed). The replay tests need one GPU;
the address bookkeeping runs anywhere."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from interlace.errors import InterlaceError
from interlace.runtime import driver, graphs
from interlace.runtime.graphs import EagerGraph, GraphUnsupported


def test_overlapping_operands_are_refused():
    base = torch.empty(64)
    assert graphs._ranges([base[:32], base[32:]]) == [
        (base.data_ptr(), base.data_ptr() + 128),
        (base.data_ptr() + 128, base.data_ptr() + 256),
    ]
    with pytest.raises(GraphUnsupported, match="overlap"):
        graphs._ranges([base[:40], base[32:]])


def test_owner_of_an_address():
    spans = [(100, 200), (300, 400)]
    assert [graphs._owner(a, spans) for a in (99, 100, 199, 200, 300, 399, 400)] == [
        None, 0, 0, None, 1, 1, None,
    ]  # fmt: skip


@triton.jit
def _affine_kernel(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(x + offs, mask=offs < n) * 2.0 + 1.0, mask=offs < n)


needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not graphs.available(), reason="needs a GPU"
)


def _operands(n: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, device="cuda", generator=g)
    y, z, w = (torch.full((n,), float("nan"), device="cuda") for _ in range(3))
    return x, y, z, w


@pytest.mark.gpu
@needs_gpu
def test_replay_moves_kernel_params_and_copies():
    """A Triton kernel (pointer parameters), a driver copy from an offset into an input
    (a copy node), a torch copy into an output and a write into a buffer that is not an
    operand: replayed with new tensors, every result lands in the new tensors, the
    captured ones are left alone, the non-operand buffer is written as captured."""
    n, shift = 4096, 64
    scratch = torch.zeros(n, device="cuda")

    def enqueue(x, y, z, w):
        _affine_kernel[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024)
        stream = torch.cuda.current_stream().cuda_stream
        driver.copy(z.data_ptr(), x.data_ptr() + shift * 4, (n - shift) * 4, stream)
        w.copy_(y)
        scratch.add_(1.0)

    first = _operands(n, 0)
    enqueue(*first)  # warm-up: compiles the kernel outside the capture
    torch.cuda.synchronize()
    scratch.zero_()
    graph = EagerGraph(lambda: enqueue(*first), list(first))
    assert graph.patched_nodes >= 3
    for seed in range(1, 4):
        ops = _operands(n, seed)
        for t in first[1:]:
            t.fill_(float("nan"))
        graph.launch(list(ops))
        torch.cuda.synchronize()
        x, y, z, w = ops
        torch.testing.assert_close(y, x * 2 + 1)
        torch.testing.assert_close(z[: n - shift], x[shift:])
        assert torch.isnan(z[n - shift :]).all()
        torch.testing.assert_close(w, y)
        assert all(torch.isnan(t).all() for t in first[1:]), "a replay wrote a captured tensor"
    assert float(scratch[0]) == 3.0  # the capture did not run; three replays did


@pytest.mark.gpu
@needs_gpu
def test_unreachable_operand_is_refused():
    """An operand that no node reads or writes cannot be re-pointed: refused, not ignored."""
    x, y, _, w = _operands(1024, 0)
    _affine_kernel[(1,)](x, y, 1024, BLOCK=1024)
    torch.cuda.synchronize()
    with pytest.raises(GraphUnsupported, match="re-pointed"):
        EagerGraph(lambda: _affine_kernel[(1,)](x, y, 1024, BLOCK=1024), [x, y, w])


@pytest.mark.gpu
@needs_gpu
def test_operand_aligned_otherwise_is_refused():
    """Triton specialises a kernel on its pointers' 16-byte alignment: a replay with an
    operand aligned otherwise than the captured one raises instead of faulting."""
    x, y, _, _ = _operands(1024, 0)
    _affine_kernel[(1,)](x, y, 1024, BLOCK=1024)
    torch.cuda.synchronize()
    graph = EagerGraph(lambda: _affine_kernel[(1,)](x, y, 1024, BLOCK=1024), [x, y])
    shifted = torch.empty(1025, device="cuda")[1:]  # 4 bytes past a 16-byte boundary
    with pytest.raises(InterlaceError, match="alignment"):
        graph.launch([shifted, torch.empty(1024, device="cuda")])
