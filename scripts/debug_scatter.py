"""Run the copy-engine-scatter and ring GEMM+RS / GEMM+AR on 2+ GPUs at the test shapes and
one public shape, call by call, and print each failure with the signal pad's state and the
host time each enqueue took (a host stall between a spinning wait and the kernel it waits
for shows up as a long gap).

    INTERLACE_WAIT_SPINS=4000000 python scripts/debug_scatter.py [--world-size 2]
"""

from __future__ import annotations

import argparse
import functools
import time
import traceback

import torch
import torch.distributed as dist

import interlace
from interlace.ops import _gemm, _rs_variants
from interlace.testing import World

SHAPES = [(300, 520, 264), (1000, 1024, 512), (77, 200, 72), (129, 33, 20), (1024, 4096, 5504)]


def _timed(name, fn, log):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            log.append((name, (time.perf_counter() - t0) * 1e3))

    return wrapper


def body(group, cases):
    log: list = []
    _rs_variants.launch = _timed("launch", _rs_variants.launch, log)
    _rs_variants.copy_and_signal = _timed("copy", _rs_variants.copy_and_signal, log)
    _gemm.GemmLaunch.__call__ = _timed("gemm", _gemm.GemmLaunch.__call__, log)
    w, r = group.world_size, group.rank
    lines = []
    for op, strategy in cases:
        cls = {"rs": interlace.GemmRS, "ar": interlace.GemmAR}[op]
        for m_loc, n, k in SHAPES:
            gen = torch.Generator().manual_seed(3 + r)
            ctx = cls(group, max_m=w * m_loc, n=n, k=k, strategy=strategy)
            try:
                for i in range(3):
                    m = w * (m_loc if i % 2 == 0 else max(1, m_loc // 3))
                    a = (torch.randn(m, k, generator=gen)).to(torch.bfloat16).to(group.device)
                    b = (torch.randn(k, n, generator=gen) * 0.2).to(torch.bfloat16).to(group.device)
                    full = a.float() @ b.float()
                    dist.all_reduce(full)
                    ref = full[r * (m // w) : (r + 1) * (m // w)] if op == "rs" else full
                    log.clear()
                    t0 = time.perf_counter()
                    status = "ok"
                    try:
                        c = ctx(a, b)
                        if group.backend == "cuda":
                            torch.cuda.synchronize()
                        err = float((c.float() - ref).norm() / ref.norm())
                        status = f"rel_err {err:.1e}" + (" BAD" if not err < 2e-2 else "")
                    except Exception as exc:  # noqa: BLE001 - report and go on
                        status = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                        pad = ctx.pad.buffer.local.tolist()
                        nonzero = {ctx.pad.describe(s): v for s, v in enumerate(pad) if v}
                        status += f" | pad nonzero {nonzero}"
                        status += " | " + traceback.format_exc().splitlines()[-3][:200]
                    host = " ".join(f"{nm}:{ms:.1f}" for nm, ms in log)
                    lines.append(
                        f"rank {r} {op} {strategy} {(m, n, k)} call {i}: {status} "
                        f"[{(time.perf_counter() - t0) * 1e3:.0f} ms; {host}]"
                    )
                    dist.barrier()
            finally:
                ctx.close()
    return lines


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--cases", default="rs:ce_scatter,rs:ring,ar:ce_scatter")
    args = p.parse_args()
    cases = [tuple(c.split(":")) for c in args.cases.split(",")]
    with World(args.world_size, timeout=500) as world:
        for rank_lines in world.run(body, cases):
            print("\n".join(rank_lines))
