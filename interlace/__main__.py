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
        t, tn, tg = r.get("t_ms"), r.get("t_nccl_ms"), r.get("t_graph_ms")
        tp, tnp = r.get("t_pipelined_ms"), r.get("t_nccl_pipelined_ms")
        rows.append(
            [
                r["op"],
                r["strategy"],
                f"{r['bytes_per_rank'] / 2**20:.3g}",
                f"{t:.3f}" if t else "-",
                f"{tg:.3f}" if tg else "-",
                f"{tp:.3f}" if tp else "-",
                f"{tn:.3f}" if tn else "-",
                f"{tnp:.3f}" if tnp else "-",
                f"{r['busbw_gbps']:.0f}" if timed else "-",
                f"{r['nccl_busbw_gbps']:.0f}" if timed else "-",
                f"{tn / t:.2f}" if t else "-",
                f"{r['rel_err']:.1e}",
            ]
        )
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(
            title="interlace collectives" + ("" if timed else " (CPU emulation: correctness only)")
        )
        for h in head:
            table.add_column(h, justify="right")
        for row in rows:
            table.add_row(*row)
        Console(width=140).print(table)
    except ImportError:
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
        for row in [head, *rows]:
            print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def write_results(out_dir: str, device: str, world: int, records: list[dict]) -> str:
    """Merge ``records`` into ``<out_dir>/<date>-<device>-w<world>.json`` (DESIGN.md format);
    a record replaces an earlier one with the same op, strategy and size."""
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

    def key(r):
        return (r.get("op"), r.get("strategy"), r.get("bytes_per_rank"), r.get("model"), r.get("M"))

    fresh = {key(r) for r in records}
    doc["records"] = [r for r in doc["records"] if key(r) not in fresh] + records
    os.makedirs(out_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return path


def bench(args) -> int:
    import torch

    from .bench.collectives import OPS, merge_ranks, run_size
    from .testing import World

    gpus = torch.cuda.device_count()
    timed = gpus >= 2 and not args.cpu
    world = args.world_size or (gpus if timed else 2)
    if timed and world > gpus:
        print(f"error: --world-size {world} but only {gpus} GPUs", file=sys.stderr)
        return 2
    sizes = args.sizes or (
        [1 << 20, 16 << 20, 64 << 20, 256 << 20] if timed else [12 << 10, 96 << 10]
    )
    ops = args.ops.split(",") if args.ops else list(OPS)
    if not timed:
        print(
            "No GPUs in use: running the CPU emulation on tiny sizes. These are correctness "
            "runs checked against torch.distributed, not timings.",
            flush=True,
        )
    jobs = [(op, size) for op in ops for size in sizes]
    # A whole untimed pass first: on a fresh GPU machine the first minute of timings ran
    # up to 3x slower (seen on 2 x H200), for NCCL and interlace alike.
    warmup = [(op, size, True) for op, size in jobs] if timed and args.warmup_pass else []
    step, stop = _progress(len(warmup) + len(jobs))
    records = []
    with World(world, "cuda" if timed else "cpu", timeout=600) as ranks:
        try:
            for op, size, _ in warmup:
                ranks.run(run_size, op, size, args.dtype, 5, timed)
                step(f"warm-up {op} {size / 2**20:g} MB")
            for op, size in jobs:
                per_rank = ranks.run(run_size, op, size, args.dtype, args.iters, timed)
                records += merge_ranks(per_rank, world)
                step(f"{op} {size / 2**20:g} MB")
        finally:
            stop()
    _table(records, timed)
    if timed:
        path = write_results(args.out, torch.cuda.get_device_name(0), world, records)
        print(f"results written to {path}")
    else:
        print("all results match torch.distributed (CPU emulation; no timings written)")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m interlace")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="benchmark the ops against their baselines")
    b.add_argument("--world-size", type=int, default=None, help="ranks (default: every GPU)")
    b.add_argument(
        "--sizes",
        type=lambda s: [parse_size(x) for x in s.split(",")],
        default=None,
        help="bytes per rank, e.g. 64M,256M",
    )
    b.add_argument(
        "--ops", default=None, help="comma-separated subset of all_gather,reduce_scatter,all_reduce"
    )
    b.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    b.add_argument("--iters", type=int, default=20, help="timed runs per rank (median taken)")
    b.add_argument(
        "--no-warmup-pass",
        dest="warmup_pass",
        action="store_false",
        help="skip the untimed pass over every job that precedes the timed one",
    )
    b.add_argument("--out", default="benchmarks/results", help="folder for the JSON results")
    b.add_argument("--cpu", action="store_true", help="force the CPU emulation (correctness only)")
    args = parser.parse_args(argv)
    if args.command == "bench":
        return bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
