"""Where a replayed eager call's host time goes, op by op, and what a graph launch costs
per node.

A one-rank world on one GPU. For each op (AG+GEMM, GEMM+RS, GEMM+AR ``fused`` at
LLaMA-3-8B, M 2048 as ``bench host``; the three collectives at 16 MB; EP normal and
low-latency dispatch / combine at ``bench ep``'s decode shape), after warm-up:

* ``call``: per call, back to back (median over batches, as ``bench.timing.host_us``);
* the armed graph's nodes by type (kernel, copy, memset, other) and how many calls of a
  loop re-pointed it (an operand at another address than the last call's);
* the call split by its pieces: each of ``replay_key``, ``OpContext._armed``,
  ``torch.empty``, ``EagerGraph.launch`` and the driver's ``cuGraphLaunch`` inside it,
  timed in place (a wrapper's own cost, ~0.1-0.3 us, is in each figure); ``rest`` is the
  call less the pieces: the op's own Python.

Each call that returns a fresh output is also timed with ``out=`` given. ``--world 2``:
two ranks sharing the GPU, the EP calls only (each rank's figures). ``--pin``: each rank's
process on one physical core of its own (``os.sched_setaffinity``).

Then (one rank) graphs of ``n`` one-program kernels (n = 1, 2, 3, 4, 6, 8), with and without a
memset node in front: the driver's ``cuGraphLaunch`` per launch, to tell what one more
node costs the host.

``--ep-tokens 128 4096``: the EP calls at each of these token counts (``bench ep``'s
decode and prefill shapes; low latency up to 256 tokens).

    python benchmarks/probes/call_split.py [--iters 1000] [--world 2] [--ep-tokens 128 4096]
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _touch(x):
    tl.store(x, tl.load(x) + 1)


BATCH = 20  # calls per batch, each batch started from an idle device (``bench.timing``)


def per_call_us(fn, iters: int, group=None) -> float:
    from interlace.bench.timing import host_us

    return host_us(group, fn, max(1, iters // BATCH), BATCH)


class _Split:
    """Time named callables in place: ``wrap(owner, name)`` replaces ``owner.name`` with a
    wrapper that adds its time to ``self.ns[label]``; ``restore()`` puts them back."""

    def __init__(self):
        self.ns, self._undo = {}, []

    def wrap(self, owner, name, label=None):
        label = label or name
        inner = getattr(owner, name)
        self.ns.setdefault(label, 0)
        ns, clock = self.ns, time.perf_counter_ns

        def timed(*a, **k):
            t0 = clock()
            try:
                return inner(*a, **k)
            finally:
                ns[label] += clock() - t0

        keep = owner.__dict__.get(name) if isinstance(owner, type) else inner
        self._undo.append((owner, name, keep))
        setattr(owner, name, timed)

    def restore(self):
        for owner, name, old in reversed(self._undo):
            if old is None and isinstance(owner, type):
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self._undo = []


def node_types(graph) -> dict:
    """The nodes of an ``EagerGraph``'s captured graph by type."""
    from interlace.runtime.graphs import _checked, _size, _vp

    raw = graph._graph.raw_cuda_graph()
    count = _size(0)
    _checked("cuGraphGetNodes", raw, None, ctypes.byref(count))
    nodes = (_vp * count.value)()
    _checked("cuGraphGetNodes", raw, nodes, ctypes.byref(count))
    names = {0: "kernel", 1: "copy", 2: "memset"}
    out = {}
    kind = ctypes.c_int()
    for node in nodes:
        _checked("cuGraphNodeGetType", node, ctypes.byref(kind))
        n = names.get(kind.value, f"type{kind.value}")
        out[n] = out.get(n, 0) + 1
    return out


def split_call(name, ctx, fn, iters: int, group=None) -> dict:
    """``call`` per call, the armed graph's nodes, re-pointed launches, and the split."""
    import interlace.ops._context as context
    import interlace.ops.collectives as collectives
    import interlace.ops.ep.layout as ep_layout
    import interlace.ops.overlapped as overlapped
    from interlace.bench.timing import _align
    from interlace.ops._context import OpContext
    from interlace.runtime import graphs

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    row = {"op": name, "call": per_call_us(fn, iters, group)}
    armed = list(ctx._replays.values())
    if armed:
        g = armed[-1].graph
        row["nodes"] = node_types(g)
    moves = {"n": 0, "calls": 0}
    orig_launch = graphs.EagerGraph.launch

    def counting(self, operands, ptrs=None):
        moves["calls"] += 1
        if ptrs is not None:
            starts = ptrs if self._dense else tuple([ptrs[i] for i in self._present])
            moves["n"] += starts != self._last
        return orig_launch(self, operands, ptrs)

    graphs.EagerGraph.launch = counting
    try:
        for _ in range(200):
            fn()
    finally:
        graphs.EagerGraph.launch = orig_launch
    row["re-pointed"] = f"{moves['n']}/{moves['calls']}"
    s = _Split()
    for mod in (context, ep_layout, overlapped, collectives):
        if hasattr(mod, "replay_key"):
            s.wrap(mod, "replay_key")
    s.wrap(OpContext, "_armed")
    s.wrap(torch, "empty")
    s.wrap(torch, "empty_like")
    s.wrap(graphs.EagerGraph, "launch")
    for g in {id(a.graph): a.graph for a in armed}.values():
        s.wrap(g, "_graph_launch", "cuGraphLaunch")
    n = total = 0
    for _ in range(max(1, iters // BATCH)):  # batches as ``per_call_us`` times them
        _align(group)
        t0 = time.perf_counter_ns()
        for _ in range(BATCH):
            fn()
        total += time.perf_counter_ns() - t0
        n += BATCH
    torch.cuda.synchronize()
    s.restore()
    split = {k: v / n / 1e3 for k, v in s.ns.items()}
    split["launch (less driver)"] = split.pop("launch") - split.get("cuGraphLaunch", 0.0)
    split["all (timed)"] = total / n / 1e3
    split["rest"] = split["all (timed)"] - sum(
        v for k, v in split.items() if k != "all (timed)"
    )  # fmt: skip
    row["split"] = split
    return row


def node_cost(dev, iters: int) -> list[str]:
    """``cuGraphLaunch`` per launch of graphs of ``n`` one-program kernels."""
    from interlace.runtime import driver
    from interlace.runtime.graphs import _calls

    launch = _calls()["cuGraphLaunch"]
    stream = driver.current_stream(dev.index)
    x = torch.zeros(8, device=dev)
    _touch[(1,)](x)
    lines = []
    for memset in (False, True):
        for n in (1, 2, 3, 4, 6, 8):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                if memset:
                    x[4:].zero_()
                for _ in range(n):
                    _touch[(1,)](x)
            ex = g.raw_cuda_graph_exec()
            for _ in range(5):
                launch(ex, stream)
            t = per_call_us(lambda ex=ex: launch(ex, stream), iters)
            lines.append(f"  graph of {n} kernel(s){' + memset' if memset else ''}: "
                         f"cuGraphLaunch {t:.2f} us")  # fmt: skip
    torch.cuda.synchronize()
    return lines


def physical_cores() -> list[int]:
    """One logical CPU of each physical core this process may run on (the lowest of its
    SMT siblings), from ``/sys``; every allowed CPU where the topology cannot be read."""
    import os

    allowed, firsts = sorted(os.sched_getaffinity(0)), []
    for cpu in allowed:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                text = f.read().strip()
        except OSError:
            return allowed
        sibs = [int(x) for part in text.split(",") for x in _span(part)]
        if min(sibs) == cpu:
            firsts.append(cpu)
    return firsts


def _span(part: str) -> range:
    a, _, b = part.partition("-")
    return range(int(a), int(b or a) + 1)


def _ep_rows(group, tokens, hidden, topk, experts, iters, tag: bool) -> list[dict]:
    """The EP dispatch / combine rows (normal; low latency where ``tokens`` <= 256) at
    ``tokens`` tokens (named with it when ``tag``)."""
    from interlace.ops.ep import EPAllToAll, EPLowLatency

    dev = group.device
    gen = torch.Generator().manual_seed(0)
    xt = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(dev)
    idx = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices.to(dev)
    wts = torch.softmax(torch.rand(tokens, topk, generator=gen), -1).to(dev)
    eps = [("ep normal", EPAllToAll)]
    if tokens <= 256:
        eps.append(("ep low_latency", EPLowLatency))
    rows = []
    for name, cls in eps:
        name = f"{name} {tokens} tokens" if tag else name
        ctx = cls(group, tokens, hidden, experts, topk)
        h = ctx.dispatch(xt, idx, wts)
        eo = torch.randn(*h.recv_x.shape, device=dev).to(torch.bfloat16)
        fn = lambda c=ctx: c.dispatch(xt, idx, wts)  # noqa: E731
        rows.append(split_call(f"{name} dispatch", ctx, fn, iters, group))
        h = ctx.dispatch(xt, idx, wts)
        fn = lambda c=ctx, eo=eo, h=h: c.combine(eo, h)  # noqa: E731
        rows.append(split_call(f"{name} combine", ctx, fn, iters, group))
        out = torch.empty_like(fn())
        fn = lambda c=ctx, eo=eo, h=h, out=out: c.combine(eo, h, out=out)  # noqa: E731
        rows.append(split_call(f"{name} combine out=", ctx, fn, iters, group))
        ctx.check()
        ctx.close()
    return rows


def body(group, iters: int, pin: bool = False, ep_tokens=(128,)):
    import os

    import interlace
    from interlace.bench.dense import model_shape
    from interlace.bench.host import COLLECTIVE_BYTES, _inputs

    dev = group.device
    rows = []
    if pin:  # this rank on a physical core of its own (the main thread)
        cores = physical_cores()
        os.sched_setaffinity(0, {cores[(2 * group.rank + 1) % len(cores)]})
    dense = group.world_size == 1  # (two ranks sharing the GPU: the EP calls only)
    gemms = (("ag_gemm", interlace.AGGemm), ("gemm_rs", interlace.GemmRS),
             ("gemm_ar", interlace.GemmAR))  # fmt: skip
    for op, cls in gemms if dense else ():
        s = model_shape(op, "llama3-8b", 2048, 1)
        a = torch.randn(s.M, s.K, device=dev, dtype=torch.bfloat16)
        b = torch.randn(s.K, s.N, device=dev, dtype=torch.bfloat16) / s.K**0.5
        with cls(group, max_m=s.M, n=s.N, k=s.K, strategy="fused") as ctx:
            rows.append(split_call(op, ctx, lambda c=ctx, a=a, b=b: c(a, b), iters))
            out = torch.empty_like(ctx(a, b))
            fn = lambda c=ctx, a=a, b=b, out=out: c(a, b, out=out)  # noqa: E731
            rows.append(split_call(f"{op} out=", ctx, fn, iters))
            ctx.check()
    collectives = (("all_gather", interlace.AllGather), ("reduce_scatter", interlace.ReduceScatter),
                   ("all_reduce", interlace.AllReduce))  # fmt: skip
    for op, cls in collectives if dense else ():
        x, _, capacity = _inputs(group, op, COLLECTIVE_BYTES, torch.bfloat16, seed=0)
        with cls(group, capacity, torch.bfloat16) as ctx:
            rows.append(split_call(op, ctx, lambda c=ctx, x=x: c(x), iters))
            ctx.check()
    hidden, topk, experts = 7168, 8, 256
    for tokens in ep_tokens:
        rows += _ep_rows(group, tokens, hidden, topk, experts, iters, len(ep_tokens) > 1)
    a = torch.randn(2048, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 6144, device=dev, dtype=torch.bfloat16)
    mm = per_call_us(lambda: torch.mm(a, b), iters, group)
    lines = [f"host us per call ({torch.cuda.get_device_name(dev)}), rank {group.rank} of "
             f"{group.world_size}, torch.mm {mm:.2f} us; CPUs {sorted(os.sched_getaffinity(0))} "
             f"of physical cores {physical_cores() if not pin else '(pinned)'}"]  # fmt: skip
    for r in rows:
        lines.append(f"== {r['op']}: call {r['call']:.2f} us; nodes {r.get('nodes')}; "
                     f"re-pointed {r['re-pointed']}")  # fmt: skip
        lines.append("   " + ", ".join(f"{k} {v:.2f}" for k, v in r["split"].items()))
    if dense:
        lines += node_cost(dev, iters)
    return "\n".join(lines)


def main() -> int:
    from interlace.testing import World

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--world", type=int, default=1, help="ranks sharing the GPU (EP calls only)")
    p.add_argument("--pin", action="store_true", help="each rank on a physical core of its own")
    p.add_argument("--ep-tokens", type=int, nargs="+", default=[128], help="EP calls' tokens")
    args = p.parse_args()
    with World(args.world, "cuda", timeout=600, share_device=args.world > 1) as world:
        print("\n".join(world.run(body, args.iters, args.pin, args.ep_tokens)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
