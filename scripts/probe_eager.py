"""Why is an eager call slower than its CUDA-graph replay? On 2+ GPUs, for one public shape
per op, trace a few calls made as the benchmark makes them (device idle, ranks aligned)
with the torch profiler and print, per call, what the host did and when each GPU
activity ran, relative to the call's start; plus the host time of an aligned call and a
cProfile of the host path.

    python scripts/probe_eager.py [--world-size 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist
from _probe import llama3_8b_fused

from interlace.bench.timing import _align, graph_of, median_ms
from interlace.testing import World

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")


def _timeline(trace_path: str, marks: list[str]) -> list[list[str]]:
    """Per marked call: its host and device events, in µs from the call's start."""
    events = json.load(open(trace_path))["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    out = []
    for mark in marks:
        top = next(e for e in spans if e.get("name") == mark and e.get("cat") == "user_annotation")
        t0, t_end = top["ts"], top["ts"] + top["dur"]
        lines = [f"{mark}: host {top['dur']:.0f} us"]
        for e in sorted(spans, key=lambda e: e["ts"]):
            if e is top or not (t0 - 5 <= e["ts"] <= t_end + 3000):
                continue
            cat = e.get("cat", "")
            host_side = cat in ("cuda_runtime", "cuda_driver") and e["ts"] <= t_end
            if cat in GPU_CATS or host_side:
                where = "gpu " if cat in GPU_CATS else "host"
                lines.append(f"  {where} {e['ts'] - t0:8.1f} +{e['dur']:7.1f}  {e['name'][:70]}")
        out.append(lines)
    return out


def traced_calls(group, name, fn, out_dir, calls: int = 3) -> list[list[str]]:
    """``fn`` called ``calls`` times as the benchmark calls it (ranks aligned, device idle)
    under the torch profiler: per call, its timeline (``_timeline``)."""
    marks = [f"{name}#{i}" for i in range(calls)]
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for mark in marks:
            _align(group)
            with torch.profiler.record_function(mark):
                fn()
        torch.cuda.synchronize()
    path = os.path.join(out_dir, f"trace_{name}_r{group.rank}.json")
    prof.export_chrome_trace(path)
    try:
        return _timeline(path, marks)
    finally:
        os.remove(path)


def body(group, out_dir):
    w, dev = group.world_size, group.device
    m, h, inter = 8192, 4096, 14336  # LLaMA-3-8B, M 8192 (as ``llama3_8b_fused``)
    operands, contexts = llama3_8b_fused(group)
    a_shard, b_ag, a, b_rs = operands.values()
    ag, rs, ar = contexts.values()
    ag_out = torch.empty(m, inter // w, device=dev, dtype=torch.bfloat16)
    rs_out = torch.empty(m // w, h, device=dev, dtype=torch.bfloat16)
    full = torch.empty(m, h, device=dev, dtype=torch.bfloat16)

    def rs_none():
        c = torch.matmul(a, b_rs)
        dist.reduce_scatter_tensor(rs_out, c)

    calls = {
        "ag_fused": lambda: ag(a_shard, b_ag, out=ag_out),
        "rs_fused": lambda: rs(a, b_rs, out=rs_out),
        "ar_fused": lambda: ar(a, b_rs),
        "rs_none": rs_none,
        "ag_nccl": lambda: dist.all_gather_into_tensor(full, a_shard),
    }
    from triton import knobs

    res = {"rank": group.rank, "timelines": {}, "host_aligned_us": {}, "ms": {}}
    res["hooks"] = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    # Host timings and the cProfile first: the torch profiler below may leave hooks set.
    for name, fn in calls.items():
        for _ in range(3):
            fn()
        host = []
        for _ in range(20):
            _align(group)
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e6)
        res["host_aligned_us"][name] = statistics.median(host)
    prof = cProfile.Profile()
    for _ in range(30):
        _align(group)
        prof.enable()
        calls["rs_fused"]()
        calls["ag_fused"]()
        prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    res["cprofile"] = s.getvalue()
    for name, fn in calls.items():
        res["ms"][name + "_eager"] = median_ms(group, fn)
        if name.endswith("fused"):
            g = graph_of(group, fn)
            res["ms"][name + "_graph"] = median_ms(group, g.replay)
        res["timelines"][name] = traced_calls(group, name, fn, out_dir)
    res["hooks_after_profiler"] = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    for ctx in (ag, rs, ar):
        ctx.close()
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    world = World(args.world_size, "cuda", timeout=500)
    try:
        results = world.run(body, args.out)
    finally:
        world.close()
    for res in results:
        print(f"===== rank {res['rank']}")
        print(
            "triton launch hooks:", res["hooks"], "after the profiler:", res["hooks_after_profiler"]
        )
        print("median ms:", {k: round(v, 3) for k, v in res["ms"].items()})
        host = {k: round(v) for k, v in res["host_aligned_us"].items()}
        print("host us of an aligned call:", host)
        for calls in res["timelines"].values():
            for lines in calls[-2:]:
                print("\n".join(lines))
    print(results[0]["cprofile"])


if __name__ == "__main__":
    main()
