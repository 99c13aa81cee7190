"""Where the fused GEMM+RS / GEMM+AR kernels lose to cuBLAS as the world grows: per
segment (one segment per owner rank: its own loop start, tile-table reads, output
descriptor, release and count, so a cost that grows with W at a fixed GEMM) or per tile
(an epilogue that a shorter main loop, K = I / W, no longer hides).

Two sweeps of the kernels ``bench kernels`` times (``bench.kernels.run_cases``: rank 0 of
W with every wait met, checked against float32, then device time of graph replays against
cuBLAS on the same GEMM, interleaved), plus the plain segment GEMM on each shape:

* fixed GEMM (M 2048, N 4096, K 4096), W = 2, 4, 8: only the segment count changes;
* fixed W = 8 (M 2048, N 4096), K = 1376, 2752, 5504, 11008: only the main loop's length.

Prints ``t / t_cublas`` per kernel and point; ``--out FILE`` keeps the records (JSON).

    python benchmarks/probes/fused_w_scaling.py [--iters 20] [--out FILE]   (one GPU)
    python benchmarks/probes/fused_w_scaling.py --cpu   (tiny shapes, interpreter: a smoke run)
"""

from __future__ import annotations

import argparse

M, N = 2048, 4096
FIXED_K, WORLDS = 4096, (2, 4, 8)
FIXED_W, KS = 8, (1376, 2752, 5504, 11008)


def swept(kernels) -> list[tuple[str, str, str]]:
    """``bench kernels``' GEMM+RS / GEMM+AR kernels (``(op, strategy, emulation mode)``),
    then the plain segment GEMM."""
    scatter = [c for c in kernels if c[0] in ("gemm_rs", "gemm_ar") and c[2] is not None]
    return scatter + [("gemm_rs", "plain", "plain")]


def points(cpu: bool) -> list[tuple[str, int, int, int, int]]:
    """``(sweep, M, N, K, W)`` of both sweeps (``cpu``: tiny shapes with the same W)."""
    if cpu:
        return [("W", 37 * w, 40, 24, w) for w in WORLDS] + [("K", 37 * FIXED_W, 40, 48, 8)]
    return [("W", M, N, FIXED_K, w) for w in WORLDS] + [("K", M, N, k, FIXED_W) for k in KS]


def main() -> int:
    import torch

    from interlace.bench.kernels import KERNELS, run_cases
    from interlace.bench.records import probe_exit
    from interlace.testing import World

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None, help="JSON file for the records")
    p.add_argument("--cpu", action="store_true", help="tiny shapes, interpreter, no timing")
    args = p.parse_args()
    timed = torch.cuda.is_available() and not args.cpu
    todo = [(op, strategy, mode, sweep, m, n, k, w)
            for sweep, m, n, k, w in points(not timed)
            for op, strategy, mode in swept(KERNELS)]  # fmt: skip
    with World(1, "cuda" if timed else "cpu", timeout=1800) as world:
        records = world.run(run_cases, todo, args.iters, 5, timed)[0]
    print(f"{'sweep':>5} {'op':>8} {'strategy':>9} {'W':>2} {'K':>6} {'t/cuBLAS':>9} {'ok':>3}")
    for r in records:
        ratio = "-" if not r["t_ms"] else f"{r['t_ms'] / r['t_ref_ms']:.3f}"
        print(f"{r['model']:>5} {r['op']:>8} {r['strategy']:>9} {r['as_world']:>2} "
              f"{r['K']:>6} {ratio:>9} {'yes' if r['ok'] else 'NO':>3}")  # fmt: skip
    return probe_exit(records, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
