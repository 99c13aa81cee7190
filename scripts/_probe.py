"""What the GPU probes in ``scripts/`` share: running a body on a world of GPU ranks, the
LLaMA-3-8B M 8192 operands and fused contexts of the three overlapped GEMMs, and a table
of times per model."""

from __future__ import annotations

import statistics
import time

import torch

import interlace
from interlace.bench.timing import _align, graph_of, paired_median_ms
from interlace.testing import World


def run_on_world(body, world_size: int = 2, *args, timeout: float = 500) -> list:
    """``body(group, *args)`` on every rank of a new CUDA world; the per-rank results."""
    world = World(world_size, "cuda", timeout=timeout)
    try:
        return world.run(body, *args)
    finally:
        world.close()


def host_us(fn, group, aligned: bool = True, iters: int = 20) -> float:
    """Median host time (µs) of ``fn()`` on this rank: each call after the device went idle
    and the ranks met (``aligned``, the benchmark's protocol), or back to back."""
    out = []
    if not aligned:
        _align(group)
    for _ in range(iters):
        if aligned:
            _align(group)
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    return statistics.median(out)


def llama3_8b_fused(group):
    """LLaMA-3-8B at M 8192 on this group: ``(operands, contexts)`` with operands
    ``a_shard, b_ag`` (AG+GEMM) and ``a, b_rs`` (GEMM+RS / AR) and the ``fused``
    contexts ``ag, rs, ar``."""
    w, dev = group.world_size, group.device
    torch.manual_seed(group.rank)
    m, h, inter = 8192, 4096, 14336
    operands = dict(
        a_shard=torch.randn(m // w, h, device=dev, dtype=torch.bfloat16),
        b_ag=torch.randn(h, inter // w, device=dev, dtype=torch.bfloat16) * 0.05,
        a=torch.randn(m, inter // w, device=dev, dtype=torch.bfloat16),
        b_rs=torch.randn(inter // w, h, device=dev, dtype=torch.bfloat16) * 0.05,
    )
    contexts = dict(
        ag=interlace.AGGemm(group, m, inter // w, h, strategy="fused", eager_graphs=False),
        rs=interlace.GemmRS(group, m, h, inter // w, strategy="fused", eager_graphs=False),
        ar=interlace.GemmAR(group, m, h, inter // w, strategy="fused", eager_graphs=False),
    )
    return operands, contexts


def print_table(title: str, rows: dict[str, dict[str, float]], width: int = 16) -> None:
    """``rows``: model -> {column: ms}, printed under ``title``."""
    cols = list(next(iter(rows.values())))
    print(title)
    print(f"{'model':12s}" + "".join(f"{c:>{width}s}" for c in cols))
    for name, t in rows.items():
        print(f"{name:12s}" + "".join(f"{t[c]:{width}.3f}" for c in cols))


def replayed_ms(calls: dict, reps: int, iters: int) -> dict[str, float]:
    """One process's ``calls`` (name -> callable) timed as CUDA graphs of ``reps`` calls
    each, replayed interleaved round by round (``paired_median_ms``): name -> ms per call."""

    def many(fn):
        def run():
            for _ in range(reps):
                fn()

        return run

    graphs = [graph_of(None, many(fn)) for fn in calls.values()]
    times = paired_median_ms(None, [g.replay for g in graphs], iters=iters, warmup=2)
    return {name: t / reps for name, t in zip(calls, times)}
