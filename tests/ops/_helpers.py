"""Helpers shared by the op tests: random inputs, errors against float32 references built
with torch.distributed, and checks that bad inputs raise. Module level, so rank bodies
that use them pickle by reference to the spawned ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist


def sync(group):
    if group.backend == "cuda":
        torch.cuda.synchronize()


def rel_err(out, ref):
    """Relative (Frobenius) error of ``out`` against ``ref``, both taken in float32."""
    ref = ref.float()
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-12))


def rand(gen, *shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)


def nans(*shape, dtype, device):
    """An output filled with NaN: a result that is not written does not pass."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def gathered(x, group):
    """``x`` of every rank, concatenated in rank order (the all-gather reference)."""
    parts = [torch.empty_like(x) for _ in range(group.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def reduced(x, group):
    """The sum of ``x`` over ranks, in float32 (the all-reduce reference)."""
    full = x.float().clone()
    dist.all_reduce(full)
    return full


def reduced_rows(x, group):
    """This rank's rows of the sum over ranks, in float32 (the reduce-scatter reference)."""
    rows = x.shape[0] // group.world_size
    return reduced(x, group)[group.rank * rows : (group.rank + 1) * rows]


def check_graph_replays(ctx, a, b, gen, reference, tol, replays=3):
    """Capture ``c = ctx(a, b)`` in a CUDA graph (after one eager call), then replay it on
    fresh random ``a`` with ``c`` poisoned: every result is within ``tol`` of
    ``reference(a)``, and ``ctx.check()`` passes afterwards."""
    ctx(a, b)
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c = ctx(a, b)
    for _ in range(replays):
        a.copy_(rand(gen, *a.shape, dtype=a.dtype, device=a.device))
        c.fill_(float("nan"))
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(c, reference(a)) < tol
    ctx.check()


def expect_error(exc, text, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` raises ``exc`` with ``text`` in its message."""
    try:
        fn(*args, **kwargs)
    except exc as e:
        assert text in str(e), f"{text!r} not in {e}"
    else:
        raise AssertionError(f"no {exc.__name__} for {text}")
