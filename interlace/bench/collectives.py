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
