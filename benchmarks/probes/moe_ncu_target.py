"""A target for Nsight Compute: ``AGMoE``'s routing build and gather GEMM as rank 0 of W
with every wait met (``bench moe``'s per-rank problem, balanced routing), five times each.

    ncu --metrics gpu__time_duration.sum,launch__registers_per_thread -k regex:moe_ \\
        python benchmarks/probes/moe_ncu_target.py W E K H I      (e.g. 8 32 5 2048 1536)

``ROUTE_WARPS=n`` in the environment builds the routing with ``n`` warps instead of the
library's (``ops.moe.routing.ROUTE_WARPS``).
"""

from __future__ import annotations

import os
import sys

import torch


def main() -> int:
    from interlace.bench import moe as bm
    from interlace.ops.moe import _gemm, routing

    world, experts, k, hidden, inter = (int(x) for x in sys.argv[1:6])
    if os.environ.get("ROUTE_WARPS"):
        routing.ROUTE_WARPS = int(os.environ["ROUTE_WARPS"])
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    pb = bm._Problem(hidden, inter, experts, k, world, "balanced", gen, dev, 3)
    cfg = _gemm.GPU_CONFIGS["gather"]
    rt, route = pb.routing(cfg)
    gemm, _ = pb.gather_gemm(
        rt, cfg, torch.empty(rt.rows, pb.i_loc, dtype=torch.bfloat16, device=dev)
    )
    for _ in range(5):
        route()
        gemm()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
