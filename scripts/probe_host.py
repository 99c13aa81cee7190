"""Host cost of one overlapped-op call (eager), and where it goes: on 2+ GPUs, time the
Python side of each call (no device sync inside the loop) and profile 50 calls.

    python scripts/probe_host.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch
import torch.distributed as dist

import interlace
from interlace.testing import World


def _host_us(fn, calls=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def body(group):
    w, dev = group.world_size, group.device
    m, n, k = 8192, 14336 // w, 4096
    a_shard = torch.randn(m // w, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16) * 0.05
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    ag = interlace.AGGemm(group, m, n, k, strategy="fused", eager_graphs=False)
    a = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    b2 = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.05
    rs = interlace.GemmRS(group, m, k, n, strategy="fused", eager_graphs=False)
    res = {
        "ag_fused_us": _host_us(lambda: ag(a_shard, b, out=out)),
        "rs_fused_us": _host_us(lambda: rs(a, b2)),
        "matmul_us": _host_us(lambda: torch.matmul(a_shard, b)),
    }
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        ag(a_shard, b, out=out)
        rs(a, b2)
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
    res["profile"] = s.getvalue()
    ag.close()
    rs.close()
    return res


def main():
    world = World(2, "cuda", timeout=300)
    try:
        res = world.run(body)[0]
    finally:
        world.close()
    for key, val in res.items():
        print(key, val if key == "profile" else f"{val:.1f}")


if __name__ == "__main__":
    main()
