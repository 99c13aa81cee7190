"""Helpers shared by the op tests: random inputs, errors against float32 references built
with torch.distributed, and checks that bad inputs raise. Module level, so rank bodies
that use them pickle by reference to the spawned ranks."""

from __future__ import annotations

import contextlib

import pytest
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
    """``x`` of every rank, concatenated in rank order (the all-gather reference), on
    ``x``'s device; the collective runs where the group's backend takes tensors."""
    src = x.contiguous().to(group.device if group.nccl else "cpu")
    parts = [torch.empty_like(src) for _ in range(group.world_size)]
    dist.all_gather(parts, src)
    return torch.cat(parts).to(x.device)


def reduced(x, group):
    """The sum of ``x`` over ranks, in float32 (the all-reduce reference)."""
    full = x.float().to(group.device if group.nccl else "cpu", copy=True)
    dist.all_reduce(full)
    return full.to(x.device)


def reduced_rows(x, group):
    """This rank's rows of the sum over ranks, in float32 (the reduce-scatter reference)."""
    rows = x.shape[0] // group.world_size
    return reduced(x, group)[group.rank * rows : (group.rank + 1) * rows]


def capture(step, side_stream=False):
    """``(graph, out)``: ``step()`` called once eagerly (compiles kernels, takes buffers; on
    a side stream with ``side_stream``), then, every rank past that call, captured in a
    CUDA graph; ``out`` is what the captured ``step()`` returned (what a replay writes)."""
    if side_stream:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
    else:
        step()
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def replay(graph, *poison):
    """Fill ``poison`` (the outputs) with NaN and wait for the fill (no peer's write into
    them can land before it), then replay ``graph`` once every rank is ready and wait."""
    for t in poison:
        t.fill_(float("nan"))
    torch.cuda.synchronize()
    dist.barrier()
    graph.replay()
    torch.cuda.synchronize()


def check_graph_replays(ctx, a, b, gen, reference, tol, replays=3):
    """Capture ``c = ctx(a, b)`` in a CUDA graph (after one eager call), then replay it on
    fresh random ``a`` with ``c`` poisoned: every result is within ``tol`` of
    ``reference(a)``, and ``ctx.check()`` passes afterwards."""
    graph, c = capture(lambda: ctx(a, b))
    for _ in range(replays):
        a.copy_(rand(gen, *a.shape, dtype=a.dtype, device=a.device))
        replay(graph, c)
        assert rel_err(c, reference(a)) < tol
    ctx.check()


def run_on_gpus(world, body, *args, why="needs a GPU"):
    """``world.run(body, *args)`` where the world's ranks run on GPUs; a CPU world of a
    ``gpu``-marked test skips, saying ``why``."""
    if world.backend != "cuda":
        pytest.skip(why)
    return world.run(body, *args)


def expect_error(exc, text, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` raises ``exc`` with ``text`` in its message."""
    try:
        fn(*args, **kwargs)
    except exc as e:
        assert text in str(e), f"{text!r} not in {e}"
    else:
        raise AssertionError(f"no {exc.__name__} for {text}")


def recording(name: str, graphs: list):
    """A ``torch.compile`` backend that keeps each graph's call targets (as strings) in
    ``graphs``, then compiles with the backend ``name``."""
    inner = torch._dynamo.lookup_backend(name)

    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return inner(gm, example_inputs)

    return backend


@contextlib.contextmanager
def counting(module, name: str):
    """``module.name`` replaced, while in the block, by a wrapper that counts its calls:
    yields the list that grows by one per call."""
    fn, calls = getattr(module, name), []

    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    setattr(module, name, counted)
    try:
        yield calls
    finally:
        setattr(module, name, fn)
