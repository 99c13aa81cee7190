"""Benchmark of the standalone collectives against NCCL, and their CPU correctness run.

Sizes are ``bytes_per_rank`` in the nccl-tests sense: the whole per-rank buffer, i.e. the
gathered output of all-gather, the input of reduce-scatter, the tensor of all-reduce.
Bus bandwidth is nccl-tests' too: ``(W-1)/W * bytes / t`` for all-gather and reduce-scatter,
twice that for all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops import AllGather, AllReduce, ReduceScatter
from .timing import graph_of, median_ms, pipelined_median_ms

OPS = {
    "all_gather": (AllGather, AllGather.METHODS),
    "reduce_scatter": (ReduceScatter, ReduceScatter.METHODS),
    "all_reduce": (AllReduce, AllReduce.METHODS),
}


def bus_factor(op: str, world: int) -> float:
    return (world - 1) / world * (2 if op == "all_reduce" else 1)


def _inputs(group, op: str, nbytes: int, dtype: torch.dtype, seed: int):
    """The op's input, its NCCL output buffer, and the context capacity (elements)."""
    w = group.world_size
    total = nbytes // dtype.itemsize // w * w  # whole buffer, divisible by W
    gen = torch.Generator(device=group.device).manual_seed(seed + group.rank)
    if op == "all_gather":
        x = torch.randn(total // w, generator=gen, device=group.device).to(dtype)
        return x, torch.empty(total, dtype=dtype, device=group.device), total // w
    if op == "reduce_scatter":
        x = torch.randn(total, generator=gen, device=group.device).to(dtype)
        return x, torch.empty(total // w, dtype=dtype, device=group.device), total // w
    x = torch.randn(total, generator=gen, device=group.device).to(dtype)
    return x, torch.empty_like(x), total


def _reference(group, op: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """torch.distributed's result (fp32 sums for the reductions)."""
    if op == "all_gather":
        parts = [torch.empty_like(x) for _ in range(group.world_size)]
        dist.all_gather(parts, x, group=group.process_group)
        return torch.cat(parts)
    full = x.float().clone()
    dist.all_reduce(full, group=group.process_group)
    if op == "reduce_scatter":
        m = full.numel() // group.world_size
        return full[group.rank * m : (group.rank + 1) * m]
    return full


def _nccl_call(group, op: str, x, out):
    pg = group.process_group
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(out, x, group=pg)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(out, x, group=pg)
    return lambda: dist.all_reduce(out, group=pg)


def _check(op, method, y, ref) -> float:
    """Relative error of ``y`` against ``ref`` (exact equality required for all-gather)."""
    err = float((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))
    if op == "all_gather" and not torch.equal(y, ref.to(y.dtype)):
        raise AssertionError(f"{op}/{method}: result differs from torch.distributed")
    if err > 1e-2:
        raise AssertionError(f"{op}/{method}: relative error {err:.2e} against torch.distributed")
    return err


def run_size(group, op: str, nbytes: int, dtype_name: str, iters: int, timed: bool) -> list[dict]:
    """Rank body: every method of ``op`` at one size, checked (and timed when ``timed``)."""
    dtype = getattr(torch, dtype_name)
    cls, methods = OPS[op]
    x, nccl_out, capacity = _inputs(group, op, nbytes, dtype, seed=17)
    ref = _reference(group, op, x, nccl_out)
    rows = []
    t_nccl = t_nccl_pipe = None
    if timed:
        t_nccl = median_ms(group, _nccl_call(group, op, x, nccl_out), iters)
        t_nccl_pipe = pipelined_median_ms(group, _nccl_call(group, op, x, nccl_out), iters)
    for method in methods:
        with cls(group, max_numel=capacity, dtype=dtype, method=method) as ctx:
            err = _check(op, method, ctx(x), ref)
            t = t_graph = t_pipe = None
            if timed:
                t = median_ms(group, lambda: ctx(x), iters)
                t_pipe = pipelined_median_ms(group, lambda: ctx(x), iters)
                t_graph = median_ms(group, graph_of(group, lambda: ctx(x)).replay, iters)
            ctx.check()
        rows.append(
            {
                "op": op,
                "strategy": method,
                "bytes_per_rank": nbytes,
                "dtype": dtype_name,
                "t_ms": t,
                "t_graph_ms": t_graph,
                "t_pipelined_ms": t_pipe,
                "t_nccl_pipelined_ms": t_nccl_pipe,
                "t_nccl_ms": t_nccl,
                "rel_err": err,
            }
        )
    return rows


def merge_ranks(per_rank: list[list[dict]], world: int) -> list[dict]:
    """Max over ranks of each timing; bus bandwidth from that."""
    merged = []
    for rows in zip(*per_rank):
        rec = dict(rows[0])
        for key in (
            "t_ms",
            "t_graph_ms",
            "t_pipelined_ms",
            "t_nccl_ms",
            "t_nccl_pipelined_ms",
            "rel_err",
        ):
            vals = [r[key] for r in rows if r[key] is not None]
            rec[key] = max(vals) if vals else None
        if rec["t_ms"]:
            f = bus_factor(rec["op"], world) * rec["bytes_per_rank"] / 1e6
            rec["busbw_gbps"] = round(f / rec["t_ms"], 1)
            rec["nccl_busbw_gbps"] = round(f / rec["t_nccl_ms"], 1)
            for key in ("t_ms", "t_graph_ms", "t_pipelined_ms", "t_nccl_ms", "t_nccl_pipelined_ms"):
                rec[key] = round(rec[key], 4)
        merged.append(rec)
    return merged


def _table(records: list[dict], timed: bool) -> None:
    from .cli import ms, print_table, ratio

    head = ["op", "strategy", "MB/rank", "t_ms", "graph_ms", "pipe_ms", "nccl_ms", "nccl_pipe",
            "busbw", "nccl_busbw", "x NCCL", "rel_err"]  # fmt: skip
    rows = []
    for r in records:
        t, tn = r.get("t_ms"), r.get("t_nccl_ms")
        rows.append(
            [
                r["op"], r["strategy"], f"{r['bytes_per_rank'] / 2**20:.3g}", ms(t),
                ms(r.get("t_graph_ms")), ms(r.get("t_pipelined_ms")), ms(tn),
                ms(r.get("t_nccl_pipelined_ms")),
                f"{r['busbw_gbps']:.0f}" if timed else "-",
                f"{r['nccl_busbw_gbps']:.0f}" if timed else "-", ratio(tn, t),
                f"{r['rel_err']:.1e}",
            ]
        )  # fmt: skip
    title = "interlace collectives" + ("" if timed else " (CPU emulation: correctness only)")
    print_table(title, head, rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m interlace bench collectives``: every collective and method against NCCL
    (2+ GPUs), or its CPU-emulation correctness run."""
    import argparse

    from ..testing import World
    from .cli import csv, parse_size, progress, rank_args, start
    from .records import DEFAULT_OUT, write_records

    p = argparse.ArgumentParser(prog="python -m interlace bench collectives")
    rank_args(p, DEFAULT_OUT, "two sizes only", "the untimed pass over every size first")
    p.add_argument("--sizes", type=csv(kind=parse_size), default=None,
                   help="bytes per rank, e.g. 64M,256M")  # fmt: skip
    p.add_argument("--ops", type=csv(OPS), default=None, help=f"subset of {','.join(OPS)}")
    args = p.parse_args(argv)
    plan = start(args)
    if plan is None:
        return 2
    timed, world = plan
    sizes = args.sizes or (
        ([16 << 20, 256 << 20] if args.quick else [1 << 20, 16 << 20, 64 << 20, 256 << 20])
        if timed
        else [12 << 10, 96 << 10]
    )
    jobs = [(op, size) for op in (args.ops or list(OPS)) for size in sizes]
    # A whole untimed pass first: on a fresh GPU machine the first minute of timings ran
    # up to 3x slower (seen on 2 x H200), for NCCL and interlace alike.
    warmup = jobs if timed and args.warmup_pass else []
    step, stop = progress(len(warmup) + len(jobs))
    records, path = [], None
    device = torch.cuda.get_device_name(0) if timed else "cpu"
    with World(world, "cuda" if timed else "cpu", timeout=600) as ranks:
        try:
            for op, size in warmup:
                ranks.run(run_size, op, size, args.dtype, 5, timed)
                step(f"warm-up {op} {size / 2**20:g} MB")
            for op, size in jobs:
                per_rank = ranks.run(run_size, op, size, args.dtype, args.iters, timed)
                records += merge_ranks(per_rank, world)
                step(f"{op} {size / 2**20:g} MB")
        finally:
            stop()
    if timed and records:
        path = write_records(args.out, device, world, records)
    _table(records, timed)
    print(f"results written to {path}" if path else "every collective matches its reference "
          "(CPU emulation; no timings written)")  # fmt: skip
    return 0
