"""``python -m interlace bench``: spawn the ranks, run the benchmarks, write the results.

On GPUs it times every op against its baselines (DESIGN.md protocol) and writes
``<out>/<date>-<device>-w<world>.json``; without GPUs it runs the CPU emulation on tiny
sizes as a correctness check only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+)([KMG]?)B?", text.strip().upper())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 64M)")
    return int(match.group(1)) * SIZE_UNITS.get(match.group(2), 1)


def _progress(total: int):
    """A rich progress bar when rich is installed, plain lines otherwise."""
    try:
        from rich.progress import Progress

        bar = Progress(transient=False)
        task = bar.add_task("benchmark", total=total)
        bar.start()
        return (lambda label: bar.update(task, advance=1, description=label)), bar.stop
    except ImportError:
        done = [0]

        def step(label):
            done[0] += 1
            print(f"[{done[0]}/{total}] {label}", flush=True)

        return step, lambda: None


def _ranks(world_size: int | None, cpu: bool) -> tuple[bool, int] | None:
    """``(timed, world)`` of a benchmark run: timed on the GPUs when there are at least two
    and ``cpu`` is off; ``world_size`` ranks, by default every GPU (timed) or 2 (the CPU
    emulation). None, after printing why, when more ranks than GPUs are asked for."""
    import torch

    gpus = torch.cuda.device_count()
    timed = gpus >= 2 and not cpu
    world = world_size or (gpus if timed else 2)
    if timed and world > gpus:
        print(f"error: --world-size {world} but only {gpus} GPUs", file=sys.stderr)
        return None
    return timed, world


def _print_table(title: str, head: list[str], rows: list[list[str]], width: int = 140) -> None:
    """A rich table when rich is installed, aligned plain text otherwise."""
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for h in head:
            table.add_column(h, justify="right")
        for row in rows:
            table.add_row(*row)
        Console(width=width).print(table)
    except ImportError:
        print(title)
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
        for row in [head, *rows]:
            print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def _ms(x) -> str:
    return f"{x:.3f}" if x else "-"


def _ratio(num, den) -> str:
    return f"{num / den:.2f}" if num and den else "-"


def _table(records: list[dict], timed: bool) -> None:
    head = [
        "op",
        "strategy",
        "MB/rank",
        "t_ms",
        "graph_ms",
        "pipe_ms",
        "nccl_ms",
        "nccl_pipe",
        "busbw",
        "nccl_busbw",
        "x NCCL",
        "rel_err",
    ]
    rows = []
    for r in records:
        t, tn = r.get("t_ms"), r.get("t_nccl_ms")
        rows.append(
            [
                r["op"],
                r["strategy"],
                f"{r['bytes_per_rank'] / 2**20:.3g}",
                _ms(t),
                _ms(r.get("t_graph_ms")),
                _ms(r.get("t_pipelined_ms")),
                _ms(tn),
                _ms(r.get("t_nccl_pipelined_ms")),
                f"{r['busbw_gbps']:.0f}" if timed else "-",
                f"{r['nccl_busbw_gbps']:.0f}" if timed else "-",
                _ratio(tn, t),
                f"{r['rel_err']:.1e}",
            ]
        )
    title = "interlace collectives" + ("" if timed else " (CPU emulation: correctness only)")
    _print_table(title, head, rows)


def _dense_table(records: list[dict], timed: bool) -> None:
    head = ["op", "model", "M", "strategy", "t_ms", "graph_ms", "none_ms", "torch_ms",
            "gemm_ms", "comm_ms", "T/bound", "T_graph/bound", "x none", "rel_err"]  # fmt: skip
    rows = []
    for r in records:
        ran = r.get("last_strategy")
        strategy = r["strategy"] + (f">{ran}" if ran and ran != r["strategy"] else "")
        bound = r.get("bound_ms")
        err = r.get("rel_err")
        rows.append(
            [
                r["op"],
                r["model"],
                str(r["M"]),
                strategy + ("" if r.get("ok") else " !"),
                _ms(r.get("t_ms")),
                _ms(r.get("t_graph_ms")),
                _ms(r.get("t_none_ms")),
                _ms(r.get("t_torch_ms")),
                _ms(r.get("t_gemm_ms")),
                _ms(r.get("t_comm_ms")),
                _ratio(r.get("t_ms"), bound),
                _ratio(r.get("t_graph_ms"), bound),
                _ratio(r.get("t_none_ms"), r.get("t_ms")),
                "-" if err is None else f"{err:.1e}",
            ]
        )
    title = "interlace dense ops" + ("" if timed else " (CPU emulation: correctness only)")
    _print_table(title, head, rows, width=170)
    for r in records:
        if r.get("note"):
            print(f"note {r['op']} {r['model']} M={r['M']} {r['strategy']}: {r['note']}")


def record_key(rec: dict) -> tuple:
    """Merge key of a results record: (op, strategy, model, M, N, K) for the dense ops,
    (op, strategy, bytes_per_rank, model, M) for the rest."""
    from .bench.dense import OPS as DENSE_OPS
    from .bench.dense import record_key as dense_key

    if rec.get("op") in DENSE_OPS:
        return dense_key(rec)
    return (rec.get("op"), rec.get("strategy"), rec.get("bytes_per_rank"), rec.get("model"),
            rec.get("M"))  # fmt: skip


def write_results(out_dir: str, device: str, world: int, records: list[dict]) -> str:
    """Merge ``records`` into ``<out_dir>/<date>-<device>-w<world>.json`` (DESIGN.md format);
    a record replaces an earlier one with the same ``record_key``."""
    import torch
    import triton

    date = datetime.date.today().isoformat()
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower().replace("nvidia", "")).strip("-")
    path = os.path.join(out_dir, f"{date}-{slug}-w{world}.json")
    doc = {
        "device": device,
        "world_size": world,
        "torch": torch.__version__.split("+")[0],
        "triton": triton.__version__,
        "date": date,
        "records": [],
    }
    if os.path.exists(path):
        with open(path) as f:
            doc["records"] = json.load(f).get("records", [])

    fresh = {record_key(r) for r in records}
    doc["records"] = [r for r in doc["records"] if record_key(r) not in fresh] + records
    os.makedirs(out_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return path


def _collective_jobs(args, timed: bool) -> list[tuple[str, int]]:
    from .bench.collectives import OPS

    sizes = args.sizes or (
        [1 << 20, 16 << 20, 64 << 20, 256 << 20] if timed else [12 << 10, 96 << 10]
    )
    ops = args.ops.split(",") if args.ops else list(OPS)
    return [(op, size) for op in ops for size in sizes]


def _dense_jobs(args, timed: bool, world: int) -> list:
    """``(shape, strategies)`` per dense case; ops whose class does not exist yet are
    skipped on GPUs and only get their cuBLAS + NCCL baseline checked on the CPU."""
    from .bench.dense import (
        MODELS,
        MS,
        OPS,
        cpu_shapes,
        op_class,
        shape_table,
        split_variant,
        strategies_of,
    )

    ops = args.dense_ops or list(OPS)
    missing = [op for op in ops if op_class(op) is None]
    for op in missing:
        what = "skipped" if timed else "only its cuBLAS + NCCL baseline checked"
        print(f"dense: interlace.{OPS[op]} does not exist yet: {op} {what}", flush=True)
    if timed:
        present = [op for op in ops if op not in missing]
        shapes = shape_table(present, args.models or list(MODELS), args.ms or list(MS), world)
    else:
        shapes = cpu_shapes(ops, world)
    jobs = [(shape, strategies_of(shape.op, args.strategies)) for shape in shapes]
    if args.strategies:
        known = {s for op in ops for s in strategies_of(op)}
        for s in sorted(set(args.strategies)):
            if split_variant(s)[0] not in known:
                print(f"dense: no op has strategy {s!r}", flush=True)
    return jobs


def bench(args) -> int:
    if args.suite == "p2p_ring":  # its own runner (sliced MLP and attention, not GEMM shapes)
        from .bench.p2p_ring import main as p2p_ring_main

        argv = ["--iters", str(args.iters), "--out", args.out] + (["--cpu"] if args.cpu else [])
        if args.world_size:
            argv += ["--world-size", str(args.world_size)]
        return p2p_ring_main(argv)
    import torch

    from .bench.collectives import merge_ranks, run_size
    from .bench.dense import run_shape, warm_device
    from .testing import World

    plan = _ranks(args.world_size, args.cpu)
    if plan is None:
        return 2
    timed, world = plan
    suites = ("collectives", "dense") if args.suite == "all" else (args.suite,)
    if not timed:
        print(
            "No GPUs in use: running the CPU emulation on tiny sizes. These are correctness "
            "runs checked against torch.distributed, not timings.",
            flush=True,
        )
    jobs = _collective_jobs(args, timed) if "collectives" in suites else []
    dense_jobs = _dense_jobs(args, timed, world) if "dense" in suites else []
    # A whole untimed pass first: on a fresh GPU machine the first minute of timings ran
    # up to 3x slower (seen on 2 x H200), for NCCL and interlace alike.
    warmup = [(op, size, True) for op, size in jobs] if timed and args.warmup_pass else []
    warm_dense = timed and args.warmup_pass and not jobs and dense_jobs
    step, stop = _progress(len(warmup) + len(jobs) + len(dense_jobs) + bool(warm_dense))
    device = torch.cuda.get_device_name(0) if timed else ""
    records, dense_records, path = [], [], None
    with World(world, "cuda" if timed else "cpu", timeout=600) as ranks:
        try:
            for op, size, _ in warmup:
                ranks.run(run_size, op, size, args.dtype, 5, timed)
                step(f"warm-up {op} {size / 2**20:g} MB")
            for op, size in jobs:
                per_rank = ranks.run(run_size, op, size, args.dtype, args.iters, timed)
                records += merge_ranks(per_rank, world)
                step(f"{op} {size / 2**20:g} MB")
            if timed and records:
                path = write_results(args.out, device, world, records)
            if warm_dense:
                ranks.run(warm_device, args.warmup_s)
                step(f"warm-up {args.warmup_s:g} s")
            for shape, strategies in dense_jobs:
                rows = ranks.run(
                    run_shape, shape, strategies, args.dtype, args.iters, args.warmup_iters,
                    args.graph, timed,
                )[0]  # fmt: skip
                dense_records += rows
                if timed and rows:  # after every shape: a time-out keeps what was measured
                    path = write_results(args.out, device, world, rows)
                step(f"{shape.op} {shape.model} M={shape.M}")
        finally:
            stop()
    if records:
        _table(records, timed)
    if dense_records:
        _dense_table(dense_records, timed)
    bad = [r for r in dense_records if not r["ok"]]
    if path:
        print(f"results written to {path}")
    elif not timed:
        print("all results match their references (CPU emulation; no timings written)")
    if bad:
        print(f"{len(bad)} dense records failed their check (rel_err > 2e-2 or errors)")
    return 1 if bad else 0


def _csv(choices=None, kind=str):
    """argparse type: a comma-separated list, each item converted and checked."""

    def parse(text: str) -> list:
        items = [kind(x) for x in text.split(",") if x]
        bad = [x for x in items if choices is not None and x not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad} not in {', '.join(map(str, choices))}")
        return items

    return parse


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["trace"]:  # python -m interlace trace OP --shape M,N,K (its own options)
        from .bench.trace import main as trace_main

        return trace_main(argv[1:])
    from .bench.dense import MODELS
    from .bench.dense import OPS as DENSE_OPS

    parser = argparse.ArgumentParser(prog="python -m interlace")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="benchmark the ops against their baselines")
    b.add_argument(
        "--suite",
        default="all",
        choices=["collectives", "dense", "p2p_ring", "all"],
        help="which benchmarks (default: all = collectives and dense; p2p_ring on its own)",
    )
    b.add_argument("--world-size", type=int, default=None, help="ranks (default: every GPU)")
    b.add_argument(
        "--sizes",
        type=lambda s: [parse_size(x) for x in s.split(",")],
        default=None,
        help="collectives: bytes per rank, e.g. 64M,256M",
    )
    b.add_argument(
        "--ops",
        default=None,
        help="collectives: comma-separated subset of all_gather,reduce_scatter,all_reduce",
    )
    b.add_argument(
        "--dense-ops",
        type=_csv(DENSE_OPS),
        default=None,
        help=f"dense: comma-separated subset of {','.join(DENSE_OPS)}",
    )
    b.add_argument(
        "--models",
        type=_csv(MODELS),
        default=None,
        help=f"dense: comma-separated subset of {','.join(MODELS)}",
    )
    b.add_argument("--ms", type=_csv(kind=int), default=None, help="dense: M values, e.g. 8192")
    b.add_argument(
        "--strategies",
        type=_csv(),
        default=None,
        help="dense: only these strategies, e.g. auto,fused; variants for the ablation: "
        "fused:split=4, sm_pull:comm_sms=8+split=2",
    )
    b.add_argument(
        "--no-graph", dest="graph", action="store_false", help="dense: skip CUDA-graph timings"
    )
    b.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    b.add_argument("--iters", type=int, default=20, help="timed runs per rank (median taken)")
    b.add_argument("--warmup-iters", type=int, default=5, help="dense: untimed calls before each")
    b.add_argument(
        "--no-warmup-pass",
        dest="warmup_pass",
        action="store_false",
        help="skip the untimed pass over every job that precedes the timed one",
    )
    b.add_argument(
        "--warmup-s",
        type=float,
        default=20.0,
        help="dense without collectives: seconds of cuBLAS + NCCL load before timing",
    )
    b.add_argument("--out", default="benchmarks/results", help="folder for the JSON results")
    b.add_argument("--cpu", action="store_true", help="force the CPU emulation (correctness only)")
    args = parser.parse_args(argv)
    if args.command == "bench":
        return bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
