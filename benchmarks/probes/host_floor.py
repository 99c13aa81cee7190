"""The floor under an eager call's host time: what each piece of a graph-backed call costs
the CPU on its own, next to the whole call and to ``torch.mm`` (one cuBLAS launch).

One GPU, a world of one rank, AG+GEMM ``fused`` at LLaMA-3-8B, M 2048 (as ``bench host``).
After warm-up (compile, capture), each line is the median, over batches of 50
back-to-back calls (the device synchronised before each batch), of the host time per
call (``--iters`` calls in all):

* ``call``: the eager call ``ctx(a, b)`` (a call like an earlier one: its graph replayed
  at once, ``OpContext._armed``); ``call, whole way``: the same with that short path off;
  its pieces: ``replay_key``, ``_armed``, ``graph.launch`` (the armed graph);
* the same three for GEMM+AR ``fused`` (no output allocation: its result is the
  context's own buffer);
* ``torch.mm``: ``torch.mm(a_full, b)`` (the cuBLAS call a user makes instead);
* ``torch.empty``: the output's allocation;
* ``stream write``: ``runtime.streams.stream_write_value32`` (the call fingerprint's write);
* ``driver write``: the driver's ``cuStreamWriteValue32`` alone (through ``ctypes``);
* ``begin+check``: the op's argument checks of one call (``_check_call``);
* a one-kernel graph (a Triton kernel that adds 1 to one float) through each layer:
  ``triton launch`` (the kernel launched eagerly), ``EagerGraph.launch`` (interlace's
  replay, nothing to patch), ``CUDAGraph.replay`` (torch's), ``cuGraphLaunch`` (the
  driver call alone through ``ctypes``).

    python benchmarks/probes/host_floor.py [--iters 2000]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl


def per_call_us(fn, iters: int, batch: int = 50) -> float:
    """Median over batches of ``batch`` back-to-back calls of the host time per call
    (``bench.timing.host_us`` in this process alone)."""
    from interlace.bench.timing import host_us

    return host_us(None, fn, max(1, iters // batch), batch)


@triton.jit
def _touch(x):
    tl.store(x, tl.load(x) + 1)


def _short_path_pieces(ctx, a, b, iters: int, out=None) -> dict:
    """The short path's pieces alone for ``ctx(a, b)`` (no bias; ``out``: the output the
    graph writes, where the op allocates one per call)."""
    from interlace.ops._context import replay_key

    key, ptrs = replay_key(ctx._next_set, (a, b))
    armed = ctx._armed(key)
    if armed is None:  # (the buffer set due now has none: the other set's key)
        return {"replay_key": per_call_us(lambda: replay_key(ctx._next_set, (a, b)), iters)}
    operands = (a, b, None, out)
    p_out = None if out is None else out.data_ptr()
    return {
        "replay_key": per_call_us(lambda: replay_key(ctx._next_set, (a, b)), iters),
        "_armed": per_call_us(lambda: ctx._armed(key), iters),
        "graph.launch": per_call_us(
            lambda: armed.graph.launch(operands, (ptrs[0], ptrs[1], None, p_out)), iters
        ),
    }


def body(group, iters: int):
    import interlace
    from interlace.bench.dense import model_shape
    from interlace.runtime import driver
    from interlace.runtime.graphs import EagerGraph
    from interlace.runtime.streams import stream_write_value32

    dev = group.device
    s = model_shape("ag_gemm", "llama3-8b", 2048, 1)
    a = torch.randn(s.M, s.K, device=dev, dtype=torch.bfloat16)
    b = torch.randn(s.K, s.N, device=dev, dtype=torch.bfloat16) / s.K**0.5
    rows = {"device": torch.cuda.get_device_name(dev)}
    with interlace.AGGemm(group, max_m=s.M, n=s.N, k=s.K, strategy="fused") as ctx:
        for _ in range(5):
            ctx(a, b)
        torch.cuda.synchronize()
        rows["call"] = per_call_us(lambda: ctx(a, b), iters)
        replays, ctx._replays = ctx._replays, None
        rows["call, whole way"] = per_call_us(lambda: ctx(a, b), iters)
        ctx._replays = replays
        out = torch.empty(s.M, s.N, device=dev, dtype=torch.bfloat16)
        rows.update(_short_path_pieces(ctx, a, b, iters, out))
        rows["torch.mm"] = per_call_us(lambda: torch.mm(a, b), iters)
        rows["torch.empty"] = per_call_us(
            lambda: torch.empty(s.M, s.N, device=dev, dtype=torch.bfloat16), iters
        )
        rows["begin+check"] = per_call_us(lambda: ctx._check_call(a, b, None, s.M), iters)
        slot = ctx.pad.local("call").view(torch.uint32)
        rows["stream write"] = per_call_us(lambda: stream_write_value32(slot, 0, 7), iters)
        ctx.check()
    sr = model_shape("gemm_ar", "llama3-8b", 2048, 1)
    a2 = torch.randn(sr.M, sr.K, device=dev, dtype=torch.bfloat16)
    b2 = torch.randn(sr.K, sr.N, device=dev, dtype=torch.bfloat16) / sr.K**0.5
    with interlace.GemmAR(group, max_m=sr.M, n=sr.N, k=sr.K, strategy="fused") as ar:
        for _ in range(5):
            ar(a2, b2)
        rows["GEMM+AR call"] = per_call_us(lambda: ar(a2, b2), iters)
        replays, ar._replays = ar._replays, None
        rows["GEMM+AR call, whole way"] = per_call_us(lambda: ar(a2, b2), iters)
        ar._replays = replays
        rows.update({f"GEMM+AR {k}": v for k, v in _short_path_pieces(ar, a2, b2, iters).items()})
        ar.check()
    # a one-kernel graph: the floor of a replay, through each layer
    x = torch.zeros(1, device=dev)
    _touch[(1,)](x)
    rows["triton launch"] = per_call_us(lambda: _touch[(1,)](x), iters)
    g = EagerGraph(lambda: _touch[(1,)](x), [x])
    rows["EagerGraph.launch"] = per_call_us(lambda: g.launch([x]), iters)
    tg = torch.cuda.CUDAGraph()
    with torch.cuda.graph(tg):
        _touch[(1,)](x)
    rows["CUDAGraph.replay"] = per_call_us(tg.replay, iters)
    if driver.enabled():
        stream = driver.current_stream(dev.index)
        addr = x.data_ptr()
        rows["driver write"] = per_call_us(lambda: driver.write_value32(addr, 7, stream), iters)
        rows["cuGraphLaunch"] = per_call_us(lambda: g._graph_launch(g._exec, stream), iters)
    torch.cuda.synchronize()
    return rows


def main() -> int:
    from interlace.testing import World

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args()
    with World(1, "cuda", timeout=600) as world:
        rows = world.run(body, args.iters)[0]
    print(f"host us per call, median of batches of back-to-back calls ({rows.pop('device')})")
    for name, v in rows.items():
        print(f"{name:>18}  {v:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
