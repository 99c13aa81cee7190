"""When does each GPU activity of an overlapped GEMM+RS / GEMM+AR call run? On 2+ GPUs, for
one public shape at M 8192, each strategy is called as the benchmark calls it (device
idle, ranks aligned) under the torch profiler, and every kernel and copy of the last call
is printed with its start and duration in µs from the call's start, for ranks 0 and 1;
plus each call's median eager and graph-replay time. Shows whether a strategy loses in
its GEMM (longer than cuBLAS), in its copies (bandwidth) or in a tail after the GEMM.

    python benchmarks/probes/probe_device_timeline.py [--world-size 4] [--model llama-7b] \
        [--strategies fused,ce_fused:partials_from=plain]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from probe_eager import traced_calls

import interlace
from interlace.bench.dense import MODELS, model_shape, split_variant
from interlace.bench.timing import graph_of, median_ms
from interlace.testing import World

STRATEGIES = ("fused", "ce_fused")


def body(group, model, out_dir, strategies=STRATEGIES):
    w, dev = group.world_size, group.device
    shape = model_shape("gemm_rs", model, 8192, w)
    m, n, k = shape.M, shape.N, shape.K
    torch.manual_seed(group.rank)
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16) * 0.05
    c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    rs_out = torch.empty(m // w, n, device=dev, dtype=torch.bfloat16)

    def rs_none():
        torch.matmul(a, b, out=c)
        dist.reduce_scatter_tensor(rs_out, c)

    def ar_none():
        torch.matmul(a, b, out=c)
        dist.all_reduce(c)

    calls, contexts = {"rs_none": rs_none, "ar_none": ar_none}, []
    for s in strategies:
        name, options = split_variant(s)
        rs = interlace.GemmRS(group, m, n, k, strategy=name, **options)
        ar = interlace.GemmAR(group, m, n, k, strategy=name, **options)
        contexts += [rs, ar]
        calls[f"rs_{s}"] = lambda rs=rs: rs(a, b, out=rs_out)
        calls[f"ar_{s}"] = lambda ar=ar: ar(a, b, out=c)
    calls["gemm"] = lambda: torch.matmul(a, b, out=c)
    res = {"rank": group.rank, "ms": {}, "timelines": {}}
    for name, fn in calls.items():
        res["ms"][name] = median_ms(group, fn)
        g = graph_of(group, fn)
        res["ms"][name + "_graph"] = median_ms(group, g.replay)
        del g
        head, *events = traced_calls(group, name, fn, out_dir)[-1]
        res["timelines"][name] = [head] + [e for e in events if e.startswith("  gpu")]
    for ctx in contexts:
        ctx.check()
        ctx.close()
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    p.add_argument("--model", default="llama-7b", choices=list(MODELS))
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="variants as in bench")
    args = p.parse_args()
    world = World(args.world_size, "cuda", timeout=500)
    try:
        results = world.run(body, args.model, args.out, args.strategies.split(","))
    finally:
        world.close()
    print("median ms, rank 0:", {k: round(v, 3) for k, v in results[0]["ms"].items()})
    for res in results[:2]:
        print(f"===== rank {res['rank']}")
        for lines in res["timelines"].values():
            print("\n".join(lines))


if __name__ == "__main__":
    main()
