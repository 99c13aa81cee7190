"""Why is an op's ``none`` path (cuBLAS + NCCL inside the context's call) slower eager
than the same two calls written by hand? On 2+ GPUs, for GEMM+RS and GEMM+AR at one
public shape, every variant below is timed eager with its calls interleaved (the
benchmark's protocol, ``paired_median_ms``), plus the host time of an aligned call:

* ``raw``: matmul into a preallocated buffer, then the collective (the benchmark's
  baseline); ``raw_alloc``: the same allocating its output and result per call;
* ``op_none`` / ``op_auto``: the context built with ``strategy="none"`` / ``"auto"``
  (which resolves to ``none`` at this shape), called as a user does; ``op_out``: the
  ``none`` context writing into a given ``out``.

    python scripts/probe_none_path.py [--world-size 4] [--model llama-7b] [--m 2048]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from _probe import host_us, run_on_world

import interlace
from interlace.bench.dense import MODELS, model_shape
from interlace.bench.timing import max_over_ranks, paired_median_ms


def _op_row(group, op, model, m):
    w, dev, pg = group.world_size, group.device, group.process_group
    shape = model_shape(op, model, m, w)
    torch.manual_seed(group.rank)
    a = torch.randn(shape.M, shape.K, device=dev, dtype=torch.bfloat16)
    b = torch.randn(shape.K, shape.N, device=dev, dtype=torch.bfloat16) * 0.05
    c = torch.empty(shape.M, shape.N, device=dev, dtype=torch.bfloat16)
    rows = shape.M // w if op == "gemm_rs" else shape.M
    out = torch.empty(rows, shape.N, device=dev, dtype=torch.bfloat16)
    cls = interlace.GemmRS if op == "gemm_rs" else interlace.GemmAR

    def collective(dst, src):
        if op == "gemm_rs":
            dist.reduce_scatter_tensor(dst, src, group=pg)
        else:
            dist.all_reduce(src, group=pg)

    def raw():
        torch.matmul(a, b, out=c)
        collective(out, c)

    def raw_alloc():
        y = torch.matmul(a, b)
        collective(torch.empty(rows, shape.N, device=dev, dtype=torch.bfloat16), y)

    none = cls(group, shape.M, shape.N, shape.K, strategy="none")
    auto = cls(group, shape.M, shape.N, shape.K, strategy="auto")
    try:
        calls = {
            "raw": raw,
            "raw_alloc": raw_alloc,
            "op_none": lambda: none(a, b),
            "op_auto": lambda: auto(a, b),
            "op_out": lambda: none(a, b, out=out),
        }
        times = paired_median_ms(group, list(calls.values()), iters=30, warmup=5)
        row = {f"{k}_ms": t for k, t in zip(calls, times)}
        row.update({f"{k}_host_us": host_us(fn, group) for k, fn in calls.items()})
        row["auto_ran_none"] = 1.0 if auto.last_strategy == "none" else 0.0
        return max_over_ranks(group, row)
    finally:
        none.close()
        auto.close()


def body(group, model, m):
    return {op: _op_row(group, op, model, m) for op in ("gemm_rs", "gemm_ar")}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    p.add_argument("--model", default="llama-7b", choices=list(MODELS))
    p.add_argument("--m", type=int, default=2048)
    args = p.parse_args()
    res = run_on_world(body, args.world_size, args.model, args.m)[0]
    for op, row in res.items():
        print(f"{op} {args.model} M={args.m} (max over ranks)")
        for k, v in row.items():
            print(f"    {k:18s} {v:9.4f}")


if __name__ == "__main__":
    main()
