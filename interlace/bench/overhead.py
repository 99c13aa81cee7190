"""Where a collective's time goes: host cost per call, the device barrier alone, and the
reduce-scatter piece count. Run with ``python -m interlace.bench.overhead`` on GPUs."""

from __future__ import annotations

import statistics
import sys
import time

import torch

from ..ops import AllGather, ReduceScatter
from .timing import median_ms


def host_us(group, fn, iters: int = 20) -> float:
    """Median host time of one call (the device idle at the start of each)."""
    samples = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def _measure(group, what: str, nbytes: int, ctx, x, barrier: bool = False) -> dict:
    ctx(x)  # warm-up: compile kernels
    row = {
        "what": what,
        "bytes": nbytes,
        "host_us": host_us(group, lambda: ctx(x)),
        "t_ms": median_ms(group, lambda: ctx(x)),
    }
    if barrier:
        row["barrier_ms"] = median_ms(group, ctx._barrier)
        row["barrier_host_us"] = host_us(group, ctx._barrier)
    return row


def overhead_body(group, nbytes_list) -> list[dict]:
    rows = []
    w = group.world_size
    for nbytes in nbytes_list:
        n = nbytes // 2 // w
        x_ag = torch.randn(n, device=group.device).to(torch.bfloat16)
        x_rs = torch.randn(w * n, device=group.device).to(torch.bfloat16)
        with AllGather(group, n, torch.bfloat16) as ag:
            rows.append(_measure(group, "all_gather ce_push", nbytes, ag, x_ag, barrier=True))
        for pieces in (1, 2, 4, 8):
            with ReduceScatter(group, n, torch.bfloat16, pieces=pieces) as rs:
                what = f"reduce_scatter ce_scatter pieces={pieces}"
                rows.append(_measure(group, what, nbytes, rs, x_rs))
        with ReduceScatter(group, n, torch.bfloat16, method="sm_pull") as rs:
            rows.append(_measure(group, "reduce_scatter sm_pull", nbytes, rs, x_rs))
    return rows


def main() -> int:
    from ..testing import World

    world = torch.cuda.device_count()
    sizes = [16 << 20, 64 << 20, 256 << 20]
    with World(world, "cuda", timeout=300) as ranks:
        per_rank = ranks.run(overhead_body, sizes)
    print(f"{'what':42s} {'MB':>5s} {'host_us':>8s} {'t_ms':>7s} {'barrier_ms':>10s}")
    for rows in zip(*per_rank):
        r = rows[0]
        t = max(x["t_ms"] for x in rows)
        host = max(x["host_us"] for x in rows)
        bar = max(x.get("barrier_ms", float("nan")) for x in rows)
        print(f"{r['what']:42s} {r['bytes'] >> 20:5d} {host:8.1f} {t:7.3f} {bar:10.4f}")
        if "barrier_host_us" in r:
            launch = max(x["barrier_host_us"] for x in rows)
            print(f"{'  barrier kernel alone: host us':42s} {launch:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
