"""Benchmark of the ``signal_reorder`` strategy (FlashOverlap) on GEMM + all-reduce, its
predictor and its reorder cost.

For each shape of the public table (GEMM+AR: ``A [M, I/W]``, ``B [I/W, H]``; docs/design.md,
"Measuring") the rank body times, in one run: cuBLAS alone, NCCL all-reduce alone, both back
to back (``none``), and ``SignalReorderGemmAR`` with the partition the predictor picks
(eager and replayed from a CUDA graph), checked against a float32 reference. Three records
per shape, the same on every rank (per-rank medians, then the max over ranks):

* ``op: gemm_ar, strategy: signal_reorder``: the docs/design.md record, plus ``partition``,
  ``predicted_ms`` and ``comm_sms``; ``t_eager_graphs_ms``: the same eager calls with
  ``eager_graphs`` (replayed from a CUDA graph the context captured; GPUs only).
* ``op: signal_reorder_predictor``: the measured model (``curve`` beside the GEMM,
  ``free_curve`` alone, wave, reorder and host times), up to ``grade_limit`` partitions
  predicted against measured (``partitions``), ``mean_abs_err``, the same error without
  the free curve (``mean_abs_err_without``), and the measured time of the predicted best
  against the best measured one (``gap``).
* ``op: reorder_rmsnorm``: the fused reorder-RMSNorm of the [M, H] result (``t_ms``)
  against the same kernel on a normal row-major tensor (``t_plain_ms``), torch's RMSNorm
  (``t_torch_ms``) and the plain un-reorder (``t_unreorder_ms``); ``overhead`` =
  ``t_ms / t_plain_ms - 1``.

``python -m interlace bench signal_reorder --out DIR`` spawns one rank per GPU and merges
the records into ``DIR/<date>-<device>-w<W>.json``; without GPUs it runs the CPU emulation
on a tiny shape as a correctness check and writes nothing.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import warnings

import torch
import torch.distributed as dist

from ..ops.signal_reorder import SignalReorderGemmAR, default_partition, launch_rows, rms_norm
from ..tune import search
from .dense import rel_err
from .timing import graph_of, max_over_ranks, median_ms

#: model -> (hidden H, intermediate I)
MODELS = {"llama-7b": (4096, 11008), "llama3-8b": (4096, 14336), "llama3-70b": (8192, 28672)}
MS = (2048, 8192)
MAX_REL_ERR = 2e-2
#: SMs the GEMM leaves to the collective, tried per shape (the fastest is kept).
COMM_SMS = (8, 16, 24, 32)
#: NCCL groups whose kernels use at most ``ctas`` CTAs, per (world, ctas); None where the
#: process group cannot be built so.
_limited_groups: dict = {}


def shapes(world: int, models=None, ms=None) -> list[tuple[str, int, int, int]]:
    """``(model, M, N, K)`` of GEMM+AR per the public table: N = H, K = I / W."""
    out = []
    for model in models or MODELS:
        hidden, inter = MODELS[model]
        for m in ms or MS:
            out.append((model, m, hidden, inter // world))
    return out


def _r(x, digits=4):
    return None if x is None else round(float(x), digits)


def _limited_group(group, ctas: int):
    """An NCCL process group over the same ranks whose collectives use at most ``ctas``
    CTAs, so every NCCL CTA finds a free SM beside the GEMM (None where not possible)."""
    key = (group.world_size, ctas)
    if key not in _limited_groups:
        pg = None
        if group.backend == "cuda":
            try:
                opts = dist.ProcessGroupNCCL.Options()
                opts.config.max_ctas = ctas
                ranks = dist.get_process_group_ranks(group.process_group)
                pg = dist.new_group(ranks, backend="nccl", pg_options=opts)
            except Exception:  # noqa: BLE001 - fall back to the group's own communicator
                pg = None
        _limited_groups[key] = pg
    return _limited_groups[key]


def _context(group, m, n, k, dtype, comm_sms):
    comm_group = None if comm_sms is None else _limited_group(group, max(1, comm_sms - 1))
    # eager calls as they are (t_ms, the predictor); the graph-backed ones are timed apart
    return SignalReorderGemmAR(
        group, m, n, k, dtype, comm_sms=comm_sms, comm_group=comm_group, eager_graphs=False
    )


def _max_ctas(ctx):
    return None if ctx.comm_group is ctx.group.process_group else max(1, ctx.comm_sms - 1)


def _inputs(group, m, n, k, dtype, seed):
    gen = torch.Generator(device=group.device).manual_seed(seed + 1000 * group.rank)
    scale = k**-0.25
    a = torch.randn(m, k, generator=gen, device=group.device).mul_(scale).to(dtype)
    b = torch.randn(k, n, generator=gen, device=group.device).mul_(scale).to(dtype)
    return a, b


def _pick_context(group, m, n, k, dtype, a, b, comm_sms, iters, warmup, timed):
    """Per ``comm_sms`` candidate (``COMM_SMS`` unless one is given): measure the model,
    take its predicted partition and time it; keep the fastest context. Returns the open
    context, its model, predicted time and partition, and ``{comm_sms: summary}``."""
    candidates = [comm_sms] if comm_sms is not None or not timed else list(COMM_SMS)
    best, sweep = None, {}
    for sms in candidates:
        ctx = _context(group, m, n, k, dtype, sms)
        try:
            mdl = search.measure_model(ctx, m, a=a, b=b, iters=iters if timed else 1,
                                     warmup=warmup if timed else 0, use_cache=False)  # fmt: skip
            predicted, part = mdl.best_predicted()
            if not timed:  # the CPU check covers the overlapped path, whatever the model says
                part = ctx.partition_for(m)
            ctx.set_partition(m, part)
            t = median_ms(group, lambda ctx=ctx: ctx(a, b), iters, warmup) if timed else None
            t = max_over_ranks(group, {"t": t})["t"]
        except BaseException:
            ctx.close()
            raise
        sweep[ctx.comm_sms] = {"t_ms": _r(t), "predicted_ms": _r(predicted),
                               "partition": list(part)}  # fmt: skip
        if best is None or (t is not None and t < best[0]):
            if best is not None:
                best[1].close()
            best = (t, ctx, mdl, predicted, part)
        else:
            ctx.close()
    return (*best[1:], sweep)


def _shape_records(group, model, m, n, k, dtype_name, iters, warmup, grade_limit, comm_sms,
                   graph, timed):  # fmt: skip
    dtype = getattr(torch, dtype_name)
    pg = group.process_group
    a, b = _inputs(group, m, n, k, dtype, seed=7 + m + n)
    ref = a.float() @ b.float()
    dist.all_reduce(ref, group=pg)
    c = torch.empty(m, n, dtype=dtype, device=group.device)

    def gemm():
        torch.matmul(a, b, out=c)

    def comm():
        dist.all_reduce(c, group=pg)

    def none():
        gemm()
        comm()

    def clock(fn):
        return median_ms(group, fn, iters, warmup) if timed else None

    base = max_over_ranks(
        group, {"t_gemm_ms": clock(gemm), "t_comm_ms": clock(comm), "t_none_ms": clock(none)}
    )
    ctx, mdl, predicted, part, sweep = _pick_context(
        group, m, n, k, dtype, a, b, comm_sms, iters, warmup, timed
    )
    try:
        out = torch.full((m, n), float("nan"), dtype=dtype, device=group.device)
        y = ctx(a, b, out=out)
        err = rel_err(y, ref)
        t = clock(lambda: ctx(a, b))
        t_graph, notes = None, []
        if timed and graph:
            try:
                g = graph_of(group, lambda: ctx(a, b))
                t_graph = median_ms(group, g.replay, iters, warmup)
                del g
            except Exception as e:  # noqa: BLE001 - recorded as a note, the run goes on
                torch.cuda.synchronize()
                notes.append(f"graph failed: {type(e).__name__}: {str(e)[:160]}")
        t_eager_graphs = None
        if timed and group.backend == "cuda":  # the same calls, replayed from eager graphs
            ctx._init_eager_graphs(True)
            t_eager_graphs = clock(lambda: ctx(a, b))
            ctx._init_eager_graphs(False)
        agreed = max_over_ranks(
            group, {"t_ms": t, "t_graph_ms": t_graph, "t_eager_graphs_ms": t_eager_graphs,
                    "rel_err": err},
        )  # fmt: skip
        err = agreed.pop("rel_err")
        bound = None
        if base["t_gemm_ms"] and base["t_comm_ms"]:
            bound = max(base["t_gemm_ms"], base["t_comm_ms"])
        main = {
            "op": "gemm_ar", "strategy": "signal_reorder", "model": model, "dtype": dtype_name,
            "M": m, "N": n, "K": k,
            **{key: _r(v) for key, v in {**base, **agreed}.items()}, "t_torch_ms": None,
            "bound_ms": _r(bound),
            "efficiency": _r(bound / agreed["t_ms"], 3) if bound and agreed["t_ms"] else None,
            "graph_efficiency": _r(bound / agreed["t_graph_ms"], 3)
            if bound and agreed["t_graph_ms"] else None,
            "last_strategy": "signal_reorder" if len(part) > 1 else "sequential",
            "partition": list(part), "predicted_ms": _r(predicted) if timed else None,
            "comm_sms": ctx.comm_sms, "nccl_max_ctas": _max_ctas(ctx), "comm_sms_sweep": sweep,
            "rel_err": float(f"{err:.3g}"),
            "ok": err <= MAX_REL_ERR,
        }  # fmt: skip
        if notes:
            main["note"] = "; ".join(notes)
        records = [main]
        if timed:
            records.append(_predictor_record(ctx, mdl, model, m, n, k, dtype_name, a, b,
                                             grade_limit, iters, warmup))  # fmt: skip
            records.append(_reorder_record(ctx, model, m, n, k, dtype_name, a, b, part, iters,
                                           warmup))  # fmt: skip
        return records
    finally:
        ctx.close()


def _predictor_record(ctx, mdl, model, m, n, k, dtype_name, a, b, limit, iters, warmup):
    """Predicted against measured time over up to ``limit`` partitions (all of them when
    there are fewer; else the predictor's favourites and a spread of the rest)."""
    cands = search.exhaustive_candidates(mdl, limit)
    rows = search.grade(ctx, m, cands, model=mdl, a=a, b=b, iters=iters, warmup=2)
    best = min(rows, key=lambda r: r["measured_ms"])
    chosen = rows[0]  # candidates come best predicted first
    ablation = {name: _r(err) for name, err in search.errors_without(mdl, rows).items()}
    return {
        "op": "signal_reorder_predictor", "strategy": "signal_reorder", "model": model,
        "dtype": dtype_name, "M": m, "N": n, "K": k, "n_waves": mdl.layout.n_waves,
        "programs": mdl.layout.programs, "wave_ms": _r(mdl.wave_ms), "post_ms": _r(mdl.post_ms),
        "gemm_ms": _r(mdl.gemm_ms), "host0_ms": _r(mdl.host0_ms), "host_ms": _r(mdl.host_ms),
        "curve": mdl.curve.to_dict(),
        "free_curve": mdl.free_curve.to_dict() if mdl.free_curve is not None else None,
        "partitions": [
            {"partition": r["partition"], "predicted_ms": _r(r["predicted_ms"]),
             "measured_ms": _r(r["measured_ms"])} for r in rows
        ],
        "mean_abs_err": _r(search.mean_abs_error(rows)),
        "mean_abs_err_without": ablation,
        # t_ms: what following the predictor gives (every record has one: docs/design.md,
        # "Measuring")
        "t_ms": _r(chosen["measured_ms"]),
        "best_predicted": chosen["partition"], "t_best_predicted_ms": _r(chosen["measured_ms"]),
        "best_measured": best["partition"], "t_best_measured_ms": _r(best["measured_ms"]),
        "gap": _r(chosen["measured_ms"] / best["measured_ms"] - 1),
    }  # fmt: skip


def _reorder_record(ctx, model, m, n, k, dtype_name, a, b, part, iters, warmup):
    """The fused reorder-RMSNorm against plain RMSNorm of the same [M, N] result."""
    group = ctx.group
    if len(part) == 1:  # no reordered layout for a single group: take the default one
        part = default_partition(ctx.waves(m, n))
    plan = ctx.plan(m, n, part)
    if len(plan.groups) == 1:
        return {"op": "reorder_rmsnorm", "strategy": "signal_reorder", "model": model,
                "M": m, "N": n, "note": "one wave: nothing reordered"}  # fmt: skip
    weight = torch.rand(n, device=group.device).to(ctx.dtype)
    ctx(a, b, partition=plan.partition)  # fills ctx.send with the reordered, reduced result
    normal = torch.empty(m, n, dtype=ctx.dtype, device=group.device)
    launch_rows(ctx.send, normal, slots=plan.slots, layout=plan.layout)  # un-reorder
    fused, plain = torch.empty_like(normal), torch.empty_like(normal)

    def run_fused():
        launch_rows(ctx.send, fused, weight, ctx.eps, slots=plan.slots, layout=plan.layout)

    def run_unreorder():
        launch_rows(ctx.send, plain, slots=plan.slots, layout=plan.layout)

    def run_plain():
        rms_norm(normal, weight, ctx.eps, out=plain)

    def run_torch():
        torch.nn.functional.rms_norm(normal, (n,), weight, ctx.eps)

    times = {
        "t_ms": median_ms(group, run_fused, iters, warmup),
        "t_unreorder_ms": median_ms(group, run_unreorder, iters, warmup),
        "t_plain_ms": median_ms(group, run_plain, iters, warmup),
        "t_torch_ms": median_ms(group, run_torch, iters, warmup),
    }
    run_fused()
    run_plain()
    err = rel_err(fused, plain.float())
    times = max_over_ranks(group, {**times, "rel_err": err})
    err = times.pop("rel_err")
    return {
        "op": "reorder_rmsnorm", "strategy": "signal_reorder", "model": model,
        "dtype": dtype_name, "M": m, "N": n, **{key: _r(v) for key, v in times.items()},
        "overhead": _r(times["t_ms"] / times["t_plain_ms"] - 1, 3),
        "rel_err": float(f"{err:.3g}"), "ok": err <= MAX_REL_ERR,
    }  # fmt: skip


def run_signal_reorder_bench(
    group, models=None, ms=None, dtype_name: str = "bfloat16", iters: int = 20,
    warmup: int = 5, grade_limit: int = 24, comm_sms: int | None = None, graph: bool = True,
    timed: bool | None = None, shape_list=None,
) -> list[dict]:  # fmt: skip
    """Rank body: every shape (``shape_list`` of ``(model, M, N, K)``, default the public
    table for this world size); the same records on every rank. Untimed (the CPU
    emulation) only the correctness of the ``gemm_ar`` record is checked, and a failure
    raises; timed, a shape that fails becomes a record with a ``note``."""
    timed = group.backend == "cuda" if timed is None else timed
    shape_list = shape_list or shapes(group.world_size, models, ms)
    records = []
    for model, m, n, k in shape_list:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                recs = _shape_records(group, model, m, n, k, dtype_name, iters, warmup,
                                      grade_limit, comm_sms, graph, timed)  # fmt: skip
        except Exception as e:
            if not timed:
                raise
            torch.cuda.synchronize()
            recs = [{"op": "gemm_ar", "strategy": "signal_reorder", "model": model,
                     "dtype": dtype_name, "M": m, "N": n, "K": k, "ok": False,
                     "note": f"failed: {type(e).__name__}: {str(e)[:200]}"}]  # fmt: skip
        finally:
            gc.collect()
            if group.backend == "cuda":
                torch.cuda.empty_cache()
        if not timed and not recs[0]["ok"]:
            raise AssertionError(f"signal_reorder {model} M={m}: rel err {recs[0]['rel_err']}")
        records += recs
    return records


# ----------------------------------------------------------------------------- CLI
def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def print_summary(records: list[dict]) -> None:
    """Short tables: speed-up against cuBLAS + NCCL, the predictor, the reorder cost."""
    print("gemm_ar signal_reorder: model M | t_ms eager_graphs_ms graph_ms none_ms gemm_ms "
          "comm_ms | x none | partition | rel_err")  # fmt: skip
    for r in records:
        if r["op"] == "gemm_ar":
            ratio = r["t_none_ms"] / r["t_ms"] if r.get("t_ms") and r.get("t_none_ms") else None
            print(f"  {r['model']:>10} {r['M']:>5} | {_fmt(r.get('t_ms'))} "
                  f"{_fmt(r.get('t_eager_graphs_ms'))} "
                  f"{_fmt(r.get('t_graph_ms'))} {_fmt(r.get('t_none_ms'))} "
                  f"{_fmt(r.get('t_gemm_ms'))} {_fmt(r.get('t_comm_ms'))} | {_fmt(ratio, '.2f')} "
                  f"| {r.get('partition')} | {r.get('rel_err')} {r.get('note', '')}")  # fmt: skip
    for key, label in (("t_ms", ""), ("t_eager_graphs_ms", " with eager_graphs")):
        speedups = [r["t_none_ms"] / r[key] for r in records
                    if r["op"] == "gemm_ar" and r.get("M") == 8192 and r.get(key)
                    and r.get("t_none_ms")]  # fmt: skip
        if speedups:
            geo = math.exp(sum(map(math.log, speedups)) / len(speedups))
            print(f"  geomean x none at M=8192{label}: {geo:.3f}")
    for r in records:
        if r["op"] == "signal_reorder_predictor":
            print(f"predictor {r['model']} M={r['M']}: waves {r['n_waves']}, mean abs err "
                  f"{_fmt(r['mean_abs_err'])}, predicted best {r['best_predicted']} "
                  f"{_fmt(r['t_best_predicted_ms'])} ms, measured best {r['best_measured']} "
                  f"{_fmt(r['t_best_measured_ms'])} ms, gap {_fmt(r['gap'])}")  # fmt: skip
    for r in records:
        if r["op"] == "reorder_rmsnorm" and "t_ms" in r:
            print(f"reorder-RMSNorm {r['model']} M={r['M']}: fused {_fmt(r['t_ms'])} ms, plain "
                  f"{_fmt(r['t_plain_ms'])}, torch {_fmt(r['t_torch_ms'])}, un-reorder "
                  f"{_fmt(r['t_unreorder_ms'])}, overhead {_fmt(r['overhead'])}")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m interlace bench signal_reorder")
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON")
    parser.add_argument("--world-size", type=int, default=None, help="ranks (default: GPUs)")
    parser.add_argument("--models", default=None, help=f"subset of {','.join(MODELS)}")
    parser.add_argument("--ms", default=None, help="M values, e.g. 8192")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=20, help="timed runs (median taken)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--grade-limit", type=int, default=24, help="partitions graded")
    parser.add_argument("--comm-sms", type=int, default=None, help="SMs the GEMM leaves free")
    parser.add_argument("--no-graph", dest="graph", action="store_false")
    parser.add_argument("--cpu", action="store_true", help="CPU emulation (correctness only)")
    parser.add_argument("--quick", action="store_true", help="M = 8192 only")
    args = parser.parse_args(argv)

    from ..testing import World
    from .cli import ranks_plan
    from .records import write_records

    plan = ranks_plan(args.world_size, args.cpu)
    if plan is None:
        return 2
    timed, world = plan
    models = args.models.split(",") if args.models else None
    ms = [int(x) for x in args.ms.split(",")] if args.ms else ([8192] if args.quick else None)
    shape_list = shapes(world, models, ms) if timed else [("tiny", 37 * world, 40, 24)]
    device = torch.cuda.get_device_name(0) if timed else "cpu"
    records, path = [], None
    with World(world, "cuda" if timed else "cpu", timeout=600) as ranks:
        for shape in shape_list:  # one shape per run: a time-out keeps what was measured
            recs = ranks.run(
                run_signal_reorder_bench, dtype_name=args.dtype, iters=args.iters,
                warmup=args.warmup, grade_limit=args.grade_limit, comm_sms=args.comm_sms,
                graph=args.graph, timed=timed, shape_list=[shape],
            )[0]  # fmt: skip
            records += recs
            if timed:
                path = write_records(args.out, device, world, recs)
            print(f"done {shape[0]} M={shape[1]}", flush=True)
    print_summary(records)
    if path:
        print(f"results written to {path}")
    elif not timed:
        print("signal_reorder matches its reference (CPU emulation; no timings written)")
    bad = [r for r in records if r.get("ok") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["MODELS", "MS", "main", "print_summary", "run_signal_reorder_bench", "shapes"]
