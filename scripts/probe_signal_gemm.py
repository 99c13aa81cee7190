"""What does ``signal_reorder``'s signalling GEMM cost against cuBLAS? On a world of GPU
ranks (one GPU is enough: ``--world-size 1``), for the public GEMM+AR shapes of TP
``--tp``: cuBLAS, the plain segment GEMM, and the signalling GEMM (all-reduce layout,
partition: all waves but the last, then the last) with its tiles stored by TMA and counted
per warp (the default) or by plain stores with a release per thread (``plain_*``), each
with its signals and without (``*_nosig``); ``signal_2free``: the default path with a
grid that leaves 2 SMs free instead of ``comm_sms`` (16). Timed as CUDA graphs of
``--reps`` launches, the variants interleaved round by round (ms per launch, max over
ranks). Before timing, the two store paths must fill the reordered buffer with the same
bits and raise every group's counter to its tiles x ``lanes``.

    python scripts/probe_signal_gemm.py [--world-size 1] [--tp 4] [--m 8192]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
from _probe import print_table, replayed_ms, run_on_world

import interlace
from interlace.bench.dense import MODELS, model_shape
from interlace.bench.timing import max_over_ranks
from interlace.ops import _gemm


def _check(ctx, plans, a, b) -> None:
    """Both store paths write the same reordered tiles and complete every counter."""
    used = (
        plans["signal"].layout.n_tiles * plans["signal"].cfg.block_m * plans["signal"].cfg.block_n
    )
    seen = {}
    for name in ("signal", "plain"):
        plan = plans[name]
        ctx.send.fill_(float("nan"))
        ctx.counters.zero_()
        ctx.launch_gemm(plan, a, b)
        torch.cuda.synchronize()
        want = [count * plan.lanes for _, count in plan.groups]
        got = ctx.counters[: len(want)].tolist()
        if got != want:
            raise RuntimeError(f"{name}: counters {got}, expected {want}")
        seen[name] = ctx.send[:used].clone()
    if not torch.equal(seen["signal"], seen["plain"]):
        raise RuntimeError("the TMA and plain store paths wrote different tiles")
    ctx.counters.zero_()


def shape_row(group, model, m, tp, reps, iters):
    shape = model_shape("gemm_ar", model, m, tp)  # the per-rank GEMM of TP ``tp``
    m, n, k = shape.M, shape.N, shape.K
    dev = group.device
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16) * 0.05
    c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    ctx = interlace.SignalReorderGemmAR(group, m, n, k)
    wide = interlace.SignalReorderGemmAR(group, m, n, k, comm_sms=2)  # nearly every SM
    try:
        full = wide.plan(m, n, (wide.layout(m, n).n_waves - 1, 1))
        waves = ctx.layout(m, n).n_waves
        plan = ctx.plan(m, n, (waves - 1, 1))
        plain = replace(plan, tma_store=False, lanes=32 * plan.cfg.num_warps)
        _check(ctx, {"signal": plan, "plain": plain}, a, b)
        calls = {
            "cublas": lambda: torch.matmul(a, b, out=c),
            "segment_gemm": lambda: _gemm.matmul(a, b, out=c),
            "signal": lambda: ctx.launch_gemm(plan, a, b),
            "signal_nosig": lambda: ctx.launch_gemm(plan, a, b, signal=False),
            "plain": lambda: ctx.launch_gemm(plain, a, b),
            "plain_nosig": lambda: ctx.launch_gemm(plain, a, b, signal=False),
            "signal_2free": lambda: wide.launch_gemm(full, a, b),
        }
        t = replayed_ms(calls, reps, iters)
        torch.cuda.synchronize()
    finally:
        ctx.close()
        wide.close()
    return max_over_ranks(group, t)


def body(group, tp, ms, models, reps, iters):
    return {
        f"{model} {m}": shape_row(group, model, m, tp, reps, iters) for m in ms for model in models
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--tp", type=int, default=4, help="the shape table's TP (per-rank GEMMs)")
    p.add_argument("--m", type=int, nargs="+", default=[8192])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--reps", type=int, default=5, help="launches per graph replay")
    p.add_argument("--iters", type=int, default=25, help="interleaved rounds")
    args = p.parse_args()
    rows = run_on_world(
        body, args.world_size, args.tp, args.m, args.models, args.reps, args.iters, timeout=400
    )[0]
    title = f"signalling GEMM (all-reduce layout), TP {args.tp} shapes, ms per launch"
    print_table(title, rows, width=14)


if __name__ == "__main__":
    main()
