"""Benchmark of the overlapped dense ops (AG+GEMM, GEMM+RS, GEMM+AR) and their CPU check.

For each shape of the public table (docs/design.md, "Measuring") one rank body times, in the same
run, cuBLAS alone, the NCCL collective alone, both back to back (``none``), torch's fused op
where one exists, and every interlace strategy eager and replayed from a CUDA graph; it also
checks each strategy against a float32 reference. Timings are per-rank medians, then the max
over ranks, so every rank returns the same records. Each strategy's eager calls are timed
interleaved, call by call, with cuBLAS + NCCL's (``t_none_ms`` of its record), so that the
comparison the targets make is not decided by drift between two moments of the run;
``t_none_solo_ms`` is cuBLAS + NCCL timed alone at the start of the shape.

``M, N, K`` are the GEMM each rank runs: AG+GEMM gathers ``[M/W, K]`` shards and multiplies
by a ``[K, N]`` column shard; GEMM+RS / GEMM+AR multiply ``[M, K]`` by ``[K, N]`` with ``K``
the local reduction dim, then reduce over ranks.
"""

from __future__ import annotations

import gc
import math
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .timing import graph_of, max_over_ranks, median_ms, paired_median_ms

#: model -> (hidden H, intermediate I)
MODELS = {"llama-7b": (4096, 11008), "llama3-8b": (4096, 14336), "llama3-70b": (8192, 28672)}
#: (hidden, intermediate) of models outside the public table, whose per-rank GEMMs the
#: tuned configs (``ops/configs/gemm.json``) do not hold: ``bench kernels --models``
#: takes them to check the configs chosen for shapes nobody tuned
OTHER_MODELS = {"qwen2-7b": (3584, 18944), "llama2-13b": (5120, 13824)}
MS = (2048, 8192)
#: op -> name of its context class in ``interlace``
OPS = {"ag_gemm": "AGGemm", "gemm_rs": "GemmRS", "gemm_ar": "GemmAR"}
MAX_REL_ERR = 2e-2
TIME_KEYS = (
    "t_ms", "t_graph_ms", "t_none_ms", "t_none_solo_ms", "t_torch_ms", "t_gemm_ms", "t_comm_ms"
)  # fmt: skip


@dataclass(frozen=True)
class Shape:
    """One benchmark case: the op and the GEMM each rank runs."""

    op: str
    model: str
    M: int
    N: int
    K: int


def model_shape(op: str, model: str, m: int, world: int) -> Shape:
    """The shape table's entry for ``op`` on ``model`` at ``m`` rows with TP = ``world``."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r} (one of {', '.join(OPS)})")
    known = MODELS | OTHER_MODELS
    if model not in known:
        raise ValueError(f"unknown model {model!r} (one of {', '.join(known)})")
    hidden, inter = known[model]
    if inter % world or m % world:
        raise ValueError(f"{model}: I={inter} and M={m} must be divisible by W={world}")
    if op == "ag_gemm":
        return Shape(op, model, m, inter // world, hidden)
    return Shape(op, model, m, hidden, inter // world)


def shape_table(ops, models, ms, world: int) -> list[Shape]:
    """Every (op, model, M) case, op by op."""
    return [model_shape(op, model, m, world) for op in ops for model in models for m in ms]


def cpu_shapes(ops, world: int) -> list[Shape]:
    """Tiny ragged cases for the CPU emulation: M/W = 37 rows, N and K off any tile size."""
    return [Shape(op, "tiny", 37 * world, 40, 24) for op in ops]


def op_class(op: str):
    """The interlace context class of ``op``, or None where it does not exist (yet)."""
    import interlace

    return getattr(interlace, OPS[op], None)


def strategies_of(op: str, wanted=None) -> list[str]:
    """The op's strategies (``cls.STRATEGIES``), restricted to ``wanted`` when given.
    ``wanted`` may hold variants, ``"fused:split=4"`` or ``"sm_pull:comm_sms=8"`` (a
    strategy and context options: the ablation); they are kept when their strategy is the
    op's."""
    cls = op_class(op)
    if cls is None:
        return []
    have = list(getattr(cls, "STRATEGIES", ("auto",)))
    if wanted is None:
        return have
    kept = []
    for s in wanted:
        name, options = split_variant(s)
        if name in have and all(
            hasattr(cls, attr) for key, attr in CLASS_OPTIONS.items() if key in options
        ):
            kept.append(s)
    return kept


def split_variant(strategy: str) -> tuple[str, dict]:
    """``"sm_pull:split=2+comm_sms=8"`` -> ``("sm_pull", {"split": 2, "comm_sms": 8})``;
    ``"ce_fused:gather=epilogue"`` -> ``("ce_fused", {"gather": "epilogue"})`` (GEMM+AR)."""
    name, _, opts = strategy.partition(":")
    options = {}
    for item in filter(None, opts.split("+")):
        key, _, value = item.partition("=")
        if key in VARIANT_OPTIONS and value.isdigit():
            options[key] = int(value)
        elif value in WORD_OPTIONS.get(key, ()):
            options[key] = value
        else:
            words = " and ".join(f"{k}={'|'.join(v)}" for k, v in WORD_OPTIONS.items())
            raise ValueError(
                f"strategy variant {strategy!r}: options are {VARIANT_OPTIONS}=<int> and {words}"
            )
    return name, options


VARIANT_OPTIONS = ("split", "comm_sms", "eager_graphs")  # eager_graphs=0: no eager graphs
#: context options that take a word, and their words
WORD_OPTIONS = {"gather": ("copy", "epilogue")}
#: options only some ops take: kept for an op whose class has the attribute
CLASS_OPTIONS = {"gather": "GATHERS"}


# ----------------------------------------------------------------------------- records
def _round(x, digits):
    return None if x is None else round(x, digits)


def make_record(
    shape: Shape,
    strategy: str,
    dtype_name: str,
    times: dict,
    rel_err: float | None,
    last_strategy: str | None = None,
    notes=(),
) -> dict:
    """One result record (docs/design.md, "Measuring") with bound, efficiencies and the ``ok`` flag.

    ``times`` holds the keys of ``TIME_KEYS`` in ms (None where not measured)."""
    t = {k: times.get(k) for k in TIME_KEYS}
    bound = max(t["t_gemm_ms"], t["t_comm_ms"]) if t["t_gemm_ms"] and t["t_comm_ms"] else None
    rec = {
        "op": shape.op,
        "strategy": strategy,
        "model": shape.model,
        "dtype": dtype_name,
        "M": shape.M,
        "N": shape.N,
        "K": shape.K,
        **{k: _round(v, 4) for k, v in t.items()},
        "bound_ms": _round(bound, 4),
        "efficiency": _round(bound / t["t_ms"], 3) if bound and t["t_ms"] else None,
        "graph_efficiency": _round(bound / t["t_graph_ms"], 3)
        if bound and t["t_graph_ms"]
        else None,
        "last_strategy": last_strategy,
        "rel_err": None if rel_err is None else float(f"{rel_err:.3g}"),
        "ok": rel_err is not None and rel_err <= MAX_REL_ERR,
    }
    if notes:
        rec["note"] = "; ".join(notes)
    return rec


# ----------------------------------------------------------------------------- rank side
def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of ``y`` against ``ref`` (inf where ``y`` has NaNs)."""
    err = float((y.float() - ref).norm() / ref.norm().clamp_min(1e-12))
    return err if math.isfinite(err) else float("inf")


def make_inputs(group, op: str, m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    """Random ``(a, b)`` of this rank (``a`` is the local shard for AG); entries scaled by
    ``k**-0.25`` so every output element has a spread of about 1."""
    gen = torch.Generator(device=group.device).manual_seed(seed + 1000 * group.rank)
    rows = m // group.world_size if op == "ag_gemm" else m
    scale = k**-0.25
    a = torch.randn(rows, k, generator=gen, device=group.device).mul_(scale).to(dtype)
    b = torch.randn(k, n, generator=gen, device=group.device).mul_(scale).to(dtype)
    return a, b


def reference(group, op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The op's result in float32 from this rank's data (torch.distributed for the comm)."""
    pg, w = group.process_group, group.world_size
    if op == "ag_gemm":
        full = a.new_empty(w * a.shape[0], a.shape[1])
        dist.all_gather_into_tensor(full, a, group=pg)
        return full.float() @ b.float()
    c = a.float() @ b.float()
    dist.all_reduce(c, group=pg)
    return c.chunk(w)[group.rank] if op == "gemm_rs" else c


def baselines(group, op: str, a: torch.Tensor, b: torch.Tensor):
    """``(gemm, comm, none, out)``: cuBLAS alone, the NCCL collective alone, both back to
    back as a user writes them, on preallocated buffers; ``out`` holds ``none``'s result."""
    pg, w = group.process_group, group.world_size
    if op == "ag_gemm":
        full = a.new_empty(w * a.shape[0], a.shape[1])
        out = a.new_empty(full.shape[0], b.shape[1])

        def gemm():
            torch.matmul(full, b, out=out)

        def comm():
            dist.all_gather_into_tensor(full, a, group=pg)

        order = (comm, gemm)
    else:
        c = a.new_empty(a.shape[0], b.shape[1])

        def gemm():
            torch.matmul(a, b, out=c)

        if op == "gemm_rs":
            out = c.new_empty(c.shape[0] // w, c.shape[1])

            def comm():
                dist.reduce_scatter_tensor(out, c, group=pg)
        else:
            out = c

            def comm():
                dist.all_reduce(c, group=pg)

        order = (gemm, comm)

    def none():
        for step in order:
            step()

    return gemm, comm, none, out


def torch_fused(group, op: str, a: torch.Tensor, b: torch.Tensor):
    """``(fn, note)``: torch's fused op as a callable returning the op's result, or
    ``(None, why)`` where it fails on this rank (``(None, None)`` for GEMM+AR, which has
    none, and on the CPU)."""
    if op == "gemm_ar" or group.backend != "cuda":
        return None, None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        name = group.process_group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(name)
        if op == "ag_gemm":

            def fn():
                _, outs = torch.ops.symm_mem.fused_all_gather_matmul(
                    a, [b], gather_dim=0, group_name=name
                )
                return outs[0]
        else:

            def fn():
                return torch.ops.symm_mem.fused_matmul_reduce_scatter(
                    a, b, "sum", scatter_dim=0, group_name=name
                )

        fn()
        return fn, None
    except Exception as e:  # noqa: BLE001 - recorded as a note, the run goes on
        return None, f"torch fused op failed: {type(e).__name__}: {str(e)[:160]}"


def _graph_ms(group, fn, iters: int, warmup: int):
    """Median replay time of ``fn`` captured in a CUDA graph, or ``(None, why)``."""
    try:
        graph = graph_of(group, fn)
        t = median_ms(group, graph.replay, iters, warmup)
        del graph
        return t, None
    except Exception as e:  # noqa: BLE001 - recorded as a note, the run goes on
        torch.cuda.synchronize()
        return None, f"graph failed: {type(e).__name__}: {str(e)[:160]}"


def _check_strategy(group, cls, shape, strategy, dtype, cases):
    """Build the context and check it on each ``(a, b, ref, poison_out)`` case; returns the
    open context, the worst relative error and the strategy the last call ran."""
    name, options = split_variant(strategy)
    ctx = cls(group, shape.M, shape.N, shape.K, dtype=dtype, strategy=name, **options)
    worst = 0.0
    try:
        for a, b, ref, poison in cases:
            out = torch.full(ref.shape, float("nan"), dtype=dtype, device=a.device)
            y = ctx(a, b, out=out) if poison else ctx(a, b)
            if group.backend == "cuda":
                torch.cuda.synchronize()
            if tuple(y.shape) != tuple(ref.shape):
                raise AssertionError(f"{strategy}: shape {tuple(y.shape)} != {tuple(ref.shape)}")
            worst = max(worst, rel_err(y, ref))
    except BaseException:
        ctx.close()
        raise
    return ctx, worst, getattr(ctx, "last_strategy", None)


def _run_strategy(group, cls, shape, strategy, dtype, cases, pair_clock, graph_clock):
    """Check one strategy on ``cases``, then time it on the first case's inputs, its calls
    interleaved with cuBLAS + NCCL's; returns ``(t_ms, t_none_ms, t_graph_ms, rel_err,
    last_strategy, notes)`` of this rank."""
    ctx, err, last = _check_strategy(group, cls, shape, strategy, dtype, cases)
    a, b = cases[0][:2]
    try:
        t, t_none = pair_clock(lambda: ctx(a, b))
        t_graph, why = graph_clock(lambda: ctx(a, b))
    finally:
        ctx.close()
    return t, t_none, t_graph, err, last, [why] if why else []


def _shape_records(group, shape, strategies, dtype_name, iters, warmup, graph, timed):
    dtype = getattr(torch, dtype_name)
    op, w = shape.op, group.world_size
    seed = 7 + 31 * shape.M + shape.N
    a, b = make_inputs(group, op, shape.M, shape.N, shape.K, dtype, seed)
    ref = reference(group, op, a, b)
    cases = [(a, b, ref, timed)]
    if not timed:  # a second, smaller call on the same context, into a poisoned ``out``
        small = make_inputs(group, op, 5 * w, shape.N, shape.K, dtype, seed + 1)
        cases.append((*small, reference(group, op, *small), True))

    gemm, comm, none, none_out = baselines(group, op, a, b)
    none()
    err = rel_err(none_out, ref)
    if err > MAX_REL_ERR:
        raise AssertionError(f"{op}: cuBLAS + NCCL baseline off by {err:.2e}: harness bug")
    fused, torch_note = torch_fused(group, op, a, b)
    if fused is not None and rel_err(fused(), ref) > MAX_REL_ERR:
        fused, torch_note = None, "torch fused op: wrong result, not timed"

    def clock(fn):
        return median_ms(group, fn, iters, warmup) if timed and fn is not None else None

    def pair_clock(fn):  # fn's time and cuBLAS + NCCL's, their calls interleaved
        return paired_median_ms(group, [fn, none], iters, warmup) if timed else (None, None)

    def graph_clock(fn):
        return _graph_ms(group, fn, iters, warmup) if timed and graph else (None, None)

    base = max_over_ranks(
        group,
        {
            "t_gemm_ms": clock(gemm),
            "t_comm_ms": clock(comm),
            "t_none_solo_ms": clock(none),
            "t_torch_ms": clock(fused),
        },
    )
    cls = op_class(op)
    records = []
    for strategy in strategies:
        if timed and group.rank == 0:  # where a run that times out stopped
            print(f"{op} {shape.model} M={shape.M}: {strategy}", flush=True)
        t = t_none = t_graph = err = last = None
        notes = [torch_note] if torch_note else []
        try:
            t, t_none, t_graph, err, last, more = _run_strategy(
                group, cls, shape, strategy, dtype, cases, pair_clock, graph_clock
            )
            notes += more
        except Exception as e:
            if not timed:
                raise
            notes.append(f"failed: {type(e).__name__}: {str(e)[:160]}")
            torch.cuda.synchronize()
        agreed = max_over_ranks(
            group, {"t_ms": t, "t_none_ms": t_none, "t_graph_ms": t_graph, "rel_err": err}
        )
        err = agreed.pop("rel_err")
        if not timed and (err is None or err > MAX_REL_ERR):
            raise AssertionError(f"{op}/{strategy}: relative error {err} against fp32")
        records.append(
            make_record(shape, strategy, dtype_name, {**base, **agreed}, err, last, notes)
        )
    return records


def run_shape(
    group,
    shape: Shape,
    strategies,
    dtype_name: str = "bfloat16",
    iters: int = 20,
    warmup: int = 5,
    graph: bool = True,
    timed: bool = True,
) -> list[dict]:
    """Rank body: one shape, every baseline and strategy, checked (and timed when ``timed``);
    the same records on every rank.

    Untimed (the CPU emulation) a failure raises; timed, it becomes a note in the record so
    the other strategies still get measured. Frees the shape's memory before returning."""
    try:
        with warnings.catch_warnings():  # torch >= 2.12 deprecates the *_tensor collectives
            warnings.simplefilter("ignore", FutureWarning)
            return _shape_records(group, shape, strategies, dtype_name, iters, warmup, graph, timed)
    finally:
        gc.collect()
        if group.backend == "cuda":
            torch.cuda.empty_cache()


def warm_device(group, seconds: float) -> int:
    """Keep the GPUs busy with cuBLAS + NCCL for about ``seconds`` (rank 0's clock), so the
    timings that follow do not see a cold machine; returns the rounds run."""
    x = torch.randn(4096, 4096, device=group.device, dtype=torch.bfloat16)
    go = torch.ones(1, device=group.device)
    start, rounds = time.monotonic(), 0
    while True:
        for _ in range(10):
            y = x @ x
            dist.all_reduce(y, group=group.process_group)
        go.fill_(float(time.monotonic() - start < seconds))
        dist.broadcast(go, src=dist.get_global_rank(group.process_group, 0),
                       group=group.process_group)  # fmt: skip
        rounds += 1
        if not go.item():
            return rounds


def _table(records: list[dict], timed: bool) -> None:
    from .cli import ms, print_table, ratio

    head = ["op", "model", "M", "strategy", "t_ms", "graph_ms", "none_ms", "torch_ms",
            "gemm_ms", "comm_ms", "T/bound", "T_graph/bound", "x none", "rel_err"]  # fmt: skip
    rows = []
    for r in records:
        ran = r.get("last_strategy")
        strategy = r["strategy"] + (f">{ran}" if ran and ran != r["strategy"] else "")
        bound, err = r.get("bound_ms"), r.get("rel_err")
        rows.append(
            [
                r["op"], r["model"], str(r["M"]), strategy + ("" if r.get("ok") else " !"),
                ms(r.get("t_ms")), ms(r.get("t_graph_ms")), ms(r.get("t_none_ms")),
                ms(r.get("t_torch_ms")), ms(r.get("t_gemm_ms")), ms(r.get("t_comm_ms")),
                ratio(r.get("t_ms"), bound), ratio(r.get("t_graph_ms"), bound),
                ratio(r.get("t_none_ms"), r.get("t_ms")), "-" if err is None else f"{err:.1e}",
            ]
        )  # fmt: skip
    title = "interlace dense ops" + ("" if timed else " (CPU emulation: correctness only)")
    print_table(title, head, rows, width=170)
    for r in records:
        if r.get("note"):
            print(f"note {r['op']} {r['model']} M={r['M']} {r['strategy']}: {r['note']}")


def _jobs(args, timed: bool, world: int) -> list:
    """``(shape, strategies)`` per dense case; ops whose class does not exist yet are
    skipped on GPUs and only get their cuBLAS + NCCL baseline checked on the CPU."""
    ops = args.ops or list(OPS)
    missing = [op for op in ops if op_class(op) is None]
    for op in missing:
        what = "skipped" if timed else "only its cuBLAS + NCCL baseline checked"
        print(f"dense: interlace.{OPS[op]} does not exist yet: {op} {what}", flush=True)
    if timed:
        present = [op for op in ops if op not in missing]
        ms_ = args.ms or ([8192] if args.quick else list(MS))
        shapes = shape_table(present, args.models or list(MODELS), ms_, world)
    else:
        shapes = cpu_shapes(ops, world)
    jobs = [(shape, strategies_of(shape.op, args.strategies)) for shape in shapes]
    if args.strategies:
        known = {s for op in ops for s in strategies_of(op)}
        for s in sorted(set(args.strategies)):
            if split_variant(s)[0] not in known:
                print(f"dense: no op has strategy {s!r}", flush=True)
    return jobs


def main(argv: list[str] | None = None) -> int:
    """``python -m interlace bench dense``: every strategy of AG+GEMM, GEMM+RS and GEMM+AR
    against cuBLAS + NCCL on the public shapes (2+ GPUs), or the CPU-emulation check."""
    import argparse

    from ..testing import World
    from .cli import csv, progress, rank_args, start
    from .records import DEFAULT_OUT, write_records

    p = argparse.ArgumentParser(prog="python -m interlace bench dense")
    rank_args(p, DEFAULT_OUT, "M = 8192 only", "the cuBLAS + NCCL load before timing")
    p.add_argument("--ops", "--dense-ops", dest="ops", type=csv(OPS), default=None,
                   help=f"subset of {','.join(OPS)}")  # fmt: skip
    p.add_argument("--models", type=csv(MODELS), default=None,
                   help=f"subset of {','.join(MODELS)}")  # fmt: skip
    p.add_argument("--ms", type=csv(kind=int), default=None, help="M values, e.g. 8192")
    p.add_argument("--strategies", type=csv(), default=None,
                   help="only these strategies, e.g. auto,fused; variants for the ablation: "
                   "fused:split=4, sm_pull:comm_sms=8+split=2")  # fmt: skip
    p.add_argument("--no-graph", dest="graph", action="store_false", help="skip CUDA graphs")
    p.add_argument("--warmup-iters", type=int, default=5, help="untimed calls before each")
    p.add_argument("--warmup-s", type=float, default=20.0,
                   help="seconds of cuBLAS + NCCL load before timing")  # fmt: skip
    args = p.parse_args(argv)
    plan = start(args)
    if plan is None:
        return 2
    timed, world = plan
    jobs = _jobs(args, timed, world)
    warm = timed and args.warmup_pass and args.warmup_s > 0
    step, stop = progress(len(jobs) + warm)
    device = torch.cuda.get_device_name(0) if timed else "cpu"
    records, path = [], None
    with World(world, "cuda" if timed else "cpu", timeout=600) as ranks:
        try:
            if warm:
                ranks.run(warm_device, args.warmup_s)
                step(f"warm-up {args.warmup_s:g} s")
            for shape, strategies in jobs:
                rows = ranks.run(
                    run_shape, shape, strategies, args.dtype, args.iters, args.warmup_iters,
                    args.graph, timed,
                )[0]  # fmt: skip
                records += rows
                if timed and rows:  # after every shape: a time-out keeps what was measured
                    path = write_records(args.out, device, world, rows)
                step(f"{shape.op} {shape.model} M={shape.M}")
        finally:
            stop()
    if records:
        _table(records, timed)
    bad = [r for r in records if not r["ok"]]
    if path:
        print(f"results written to {path}")
    elif not timed:
        print("all results match their references (CPU emulation; no timings written)")
    if bad:
        print(f"{len(bad)} dense records failed their check (rel_err > 2e-2 or errors)")
    return 1 if bad else 0
