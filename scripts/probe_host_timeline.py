"""Where does the host time of an eager overlapped call go? On 2+ GPUs, the op's host
path is wrapped function by function with ``perf_counter_ns`` stamps (no profiler: the
torch profiler sets Triton's launch hooks, which changes the launch path), and for
aligned calls (device idle, ranks past a barrier: the benchmark's protocol) the median
entry / exit time of each step, in µs from the call's start, is printed per op; plus the
host time of an aligned call against one issued back to back, and of a fixed piece of
pure Python in both states (is the host itself slower after a sync?).

    python scripts/probe_host_timeline.py [--world-size 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _probe import host_us, llama3_8b_fused, run_on_world

from interlace.bench.timing import _align
from interlace.ops import _context, _gemm, _launch
from interlace.ops import gemm as gemm_ops

STAMPS: list[tuple[str, int, int]] = []


def _wrap(owner, name, label=None):
    orig = getattr(owner, name)
    label = label or name

    def wrapped(*args, **kwargs):
        STAMPS.append((label, 0, time.perf_counter_ns()))
        try:
            return orig(*args, **kwargs)
        finally:
            STAMPS.append((label, 1, time.perf_counter_ns()))

    setattr(owner, name, wrapped)


def _instrument():
    for cls in (gemm_ops.AGGemm, gemm_ops.GemmRS, gemm_ops.GemmAR):
        _wrap(cls, "__call__", "call")
    og = gemm_ops._OverlappedGemm
    for name in ("_check_call", "_resolve", "_known_plan"):
        _wrap(og, name)
    _wrap(_context.OpContext, "_check_out")
    _wrap(_context.OpContext, "_begin")
    _wrap(_context.AlternatingSets, "_buffer_set")
    _wrap(_gemm, "check_tma_aligned")
    _wrap(_gemm, "check_gemm_operands")
    for name in ("fork", "join", "copy_and_signal", "use_stream"):
        _wrap(gemm_ops, name)
    _wrap(gemm_ops.AGGemm, "_gemm", "ag._gemm")
    _wrap(gemm_ops._ScatterGemm, "_fused", "rs._fused")
    _wrap(_gemm.GemmLaunch, "__call__", "GemmLaunch")
    _wrap(_launch.PreparedLaunch, "__call__", "PreparedLaunch")
    for name in ("_short_path_ok", "_hooks_clear", "scratch"):
        if hasattr(_launch, name):
            _wrap(_launch, name)
    _wrap(_launch, "_run", "_run(triton launcher)")


def _timeline(fn, group, iters=20):
    """Median (enter, exit) µs from the call's start per label (first occurrence)."""
    per = {}
    totals = []
    for _ in range(iters):
        _align(group)
        STAMPS.clear()
        t0 = time.perf_counter_ns()
        fn()
        totals.append((time.perf_counter_ns() - t0) / 1e3)
        seen = {}
        for label, kind, t in STAMPS:
            key = (label, kind)
            if key not in seen:
                seen[key] = (t - t0) / 1e3
        for key, v in seen.items():
            per.setdefault(key, []).append(v)
    labels = []
    for (label, kind), _ in sorted(per.items(), key=lambda kv: statistics.median(kv[1])):
        if kind == 0:
            labels.append(label)
    rows = [
        (label, statistics.median(per[(label, 0)]), statistics.median(per.get((label, 1), [0])))
        for label in labels
    ]
    return statistics.median(totals), rows


def body(group):
    _instrument()
    operands, contexts = llama3_8b_fused(group)
    a_shard, b_ag, a, b_rs = operands.values()
    ag, rs, ar = contexts.values()
    calls = {
        "ag_fused": lambda: ag(a_shard, b_ag),
        "rs_fused": lambda: rs(a, b_rs),
        "ar_fused": lambda: ar(a, b_rs),
        "cublas": lambda: torch.matmul(a, b_rs),
        "python_2k": lambda: sum(range(2000)),
    }
    res = {"rank": group.rank, "ops": {}}
    for name, fn in calls.items():
        for _ in range(5):
            fn()
        total, rows = _timeline(fn, group)
        res["ops"][name] = {
            "aligned_us": total,
            "back_to_back_us": host_us(fn, group, aligned=False),
            "rows": rows,
        }
    for ctx in (ag, rs, ar):
        ctx.check()
        ctx.close()
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", type=int, default=2)
    args = p.parse_args()
    results = run_on_world(body, args.world_size)
    for res in results:
        print(f"===== rank {res['rank']}")
        for name, op in res["ops"].items():
            print(
                f"{name}: aligned {op['aligned_us']:.1f} us, back to back "
                f"{op['back_to_back_us']:.1f} us"
            )
            for label, enter, leave in op["rows"]:
                print(f"    {enter:8.1f} {leave:8.1f}  {label}")


if __name__ == "__main__":
    main()
