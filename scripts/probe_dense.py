"""Where does an overlapped GEMM's time go? On 2+ GPUs, for a few public shapes: cuBLAS,
the plain segment GEMM, the AG+GEMM consumer alone (flags pre-set, no copies), the op
eager and as a CUDA graph, and the same for GEMM+RS / GEMM+AR.

    python scripts/probe_dense.py [--world-size 2]
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist

import interlace
from interlace.bench.timing import graph_of, median_ms
from interlace.ops._gemm import matmul
from interlace.testing import World


def body(group, shapes):
    rows = [_probe(group, *shape) for shape in shapes]
    return rows


def _probe(group, op, m, n, k):
    w, dev = group.world_size, group.device
    torch.manual_seed(group.rank)
    res = {"op": op, "M": m, "N": n, "K": k}
    ms = functools.partial(median_ms, group, warmup=3)
    graph = functools.partial(graph_of, group)
    if op == "ag":
        a_shard = torch.randn(m // w, k, device=dev, dtype=torch.bfloat16)
        full = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16) * 0.05
        res["cublas"] = ms(lambda: torch.matmul(full, b))
        res["plain"] = ms(lambda: matmul(full, b))
        ctx = interlace.AGGemm(group, m, n, k, strategy="fused")
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        plan = ctx._plan(m // w, n, pull=False)
        first, count = ctx._set_slots()
        flags = ctx.pad.buffer.local[first : first + count - 2]  # buffer set 0's arrivals

        def consumer():  # every arrival flag raised (the GEMM zeroes them as it ends)
            flags.fill_(1)
            ctx._gemm(plan, a_shard, b, None, out, m // w)

        res["consumer"] = ms(consumer)
        torch.cuda.synchronize()
        dist.barrier()
        res["op_eager"] = ms(lambda: ctx(a_shard, b, out=out))
        g = graph(lambda: ctx(a_shard, b, out=out))
        res["op_graph"] = ms(g.replay)
        res["comm_nccl"] = ms(lambda: dist.all_gather_into_tensor(full, a_shard))
    else:
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16) * 0.05
        res["cublas"] = ms(lambda: torch.matmul(a, b))
        res["plain"] = ms(lambda: matmul(a, b))
        cls = interlace.GemmRS if op == "rs" else interlace.GemmAR
        ctx = cls(group, m, n, k, strategy="fused")
        res["op_eager"] = ms(lambda: ctx(a, b))
        g = graph(lambda: ctx(a, b))
        res["op_graph"] = ms(g.replay)
        c = torch.matmul(a, b)
        if op == "rs":
            o = torch.empty(m // w, n, device=dev, dtype=torch.bfloat16)
            res["comm_nccl"] = ms(lambda: dist.reduce_scatter_tensor(o, c))
        else:
            res["comm_nccl"] = ms(lambda: dist.all_reduce(c))
    ctx.check()
    ctx.close()
    torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    args = ap.parse_args()
    w = args.world_size
    shapes = [
        ("ag", 8192, 28672 // w, 8192), ("ag", 8192, 14336 // w, 4096),
        ("ag", 2048, 14336 // w, 4096),
        ("rs", 8192, 8192, 28672 // w), ("rs", 8192, 4096, 14336 // w),
        ("ar", 8192, 4096, 14336 // w),
    ]  # fmt: skip
    world = World(w, "cuda", timeout=400)
    try:
        rows = world.run(body, shapes)[0]
    finally:
        world.close()
    keys = ["cublas", "plain", "consumer", "op_eager", "op_graph", "comm_nccl"]
    print("op    M     N     K  " + "  ".join(f"{k:>9}" for k in keys))
    for r in rows:
        vals = "  ".join(f"{r[k]:9.3f}" if k in r else f"{'-':>9}" for k in keys)
        print(f"{r['op']:3} {r['M']:5} {r['N']:5} {r['K']:5}  {vals}")


if __name__ == "__main__":
    main()
