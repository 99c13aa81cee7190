"""What makes ``signal_reorder``'s signalling GEMM slower than cuBLAS? On 2 GPUs (one
context per rank, no communication), for the public GEMM+AR shapes at M 8192: cuBLAS, the
plain segment GEMM, and the signalling GEMM with its signals (one release per thread per
tile) and without them, timed back to back (CUDA events, median). The partition is two
groups (all waves but the last, then the last).

    python scripts/probe_signal_gemm.py
"""

from __future__ import annotations

import torch
from _probe import print_table, run_on_world

import interlace
from interlace.bench.timing import max_over_ranks, pipelined_median_ms
from interlace.ops import _gemm

SHAPES = {"llama-7b": (8192, 4096, 11008), "llama3-8b": (8192, 4096, 14336)}
SHAPES["llama3-70b"] = (8192, 8192, 28672)


def shape_row(group, m, n, inter):
    k = inter // group.world_size
    a = torch.randn(m, k, device=group.device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=group.device, dtype=torch.bfloat16) * 0.05
    c = torch.empty(m, n, device=group.device, dtype=torch.bfloat16)
    ctx = interlace.SignalReorderGemmAR(group, m, n, k)
    waves = ctx.layout(m, n).n_waves
    plan = ctx.plan(m, n, (waves - 1, 1))
    t = {
        "cublas": pipelined_median_ms(None, lambda: torch.matmul(a, b, out=c)),
        "segment_gemm": pipelined_median_ms(None, lambda: _gemm.matmul(a, b, out=c)),
        "signal_gemm": pipelined_median_ms(None, lambda: ctx.launch_gemm(plan, a, b)),
        "no_signals": pipelined_median_ms(None, lambda: ctx.launch_gemm(plan, a, b, signal=False)),
    }
    torch.cuda.synchronize()
    ctx.close()
    return max_over_ranks(group, t)


def body(group):
    return {name: shape_row(group, *shape) for name, shape in SHAPES.items()}


def main():
    rows = run_on_world(body, 2, timeout=400)[0]
    title = "signalling GEMM probe, ms (median back to back, max over ranks), M 8192"
    print_table(title, rows, width=14)


if __name__ == "__main__":
    main()
