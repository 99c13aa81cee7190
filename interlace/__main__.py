"""``python -m interlace``: the benchmark suites and the plots of a results file.

    python -m interlace bench [SUITE] [ARGS ...]
    python -m interlace plot FILE.json [FILE.json ...]
    python -m interlace trace OP [ARGS ...]

``bench SUITE`` runs ``interlace.bench.<SUITE>.main(ARGS)``. Without a suite it runs what
the machine can show: with two or more GPUs the collectives and the dense ops against
their baselines; with one GPU the shared-GPU correctness checks, each fused kernel with
its waits met against cuBLAS, and the host cost of an eager call; without a GPU the CPU
emulation's correctness runs. ``trace OP`` is ``bench trace OP``: a timeline trace of one
op (``interlace.bench.trace``). Results go to ``benchmarks/results/`` (``--out``) through
``interlace.bench.records.write_records``, with PNG figures beside them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

#: suite name -> what it runs (each is the module ``interlace.bench.<name>``)
SUITES = {
    "dense": "AG+GEMM, GEMM+RS, GEMM+AR: every strategy against cuBLAS + NCCL (2+ GPUs)",
    "collectives": "all-gather, reduce-scatter, all-reduce against NCCL (2+ GPUs)",
    "p2p_ring": "the sliced MLP and attention layers of p2p_ring (2+ GPUs)",
    "signal_reorder": "FlashOverlap's GEMM + all-reduce and its predictor (2+ GPUs)",
    "shared": "every dense op's correctness in worlds whose ranks share one GPU",
    "kernels": "each fused kernel as one rank of W = 2, 4, 8, waits met, against cuBLAS",
    "host": "host time of one eager call per op",
    "moe": "MoE layers",
    "ep": "expert-parallel dispatch and combine",
    "attention": "attention with overlapped communication",
    "decode": "decode attention",
    "model": "a whole model's layers",
    "trace": "traces of overlapped calls",
    "soak": "many back-to-back calls of each op: no drift, no memory growth, no fault",
}
ONE_GPU_SUITES = ("shared", "kernels", "host")
MULTI_GPU_SUITES = ("collectives", "dense")
NO_OVERLAP = "cross-GPU overlap needs two or more GPUs"


def suite_main(name: str):
    """The ``main(argv)`` of suite ``name``, or None where this version has none."""
    module_name = f"interlace.bench.{name}"
    try:
        if importlib.util.find_spec(module_name) is None:
            return None
    except ModuleNotFoundError:
        return None
    return getattr(importlib.import_module(module_name), "main", None)


def run_suite(name: str, argv: list[str]) -> int:
    main = suite_main(name)
    if main is None:
        print(f"bench {name}: not available in this version")
        return 2
    return int(main(argv) or 0)


def default_suites(gpus: int) -> tuple[str, ...]:
    """What ``bench`` without a suite runs on a machine with ``gpus`` GPUs."""
    if gpus >= 2:
        return MULTI_GPU_SUITES
    if gpus == 1:
        return ONE_GPU_SUITES
    return MULTI_GPU_SUITES  # the CPU emulation's correctness runs


def bench(argv: list[str]) -> int:
    if "--suite" in argv:  # the older spelling: bench --suite NAME
        i = argv.index("--suite")
        if i + 1 < len(argv):
            argv = [argv[i + 1], *argv[:i], *argv[i + 2 :]]
    if argv and not argv[0].startswith("-"):
        name = argv[0]
        if name not in SUITES:
            listed = ", ".join(SUITES)
            print(f"bench: unknown suite {name!r} (choose from {listed})", file=sys.stderr)
            return 2
        return run_suite(name, argv[1:])
    p = argparse.ArgumentParser(
        prog="python -m interlace bench",
        description="Without SUITE: what this machine can show. Suites: "
        + "; ".join(f"{k}: {v}" for k, v in SUITES.items()),
    )
    p.add_argument("--out", default=None, help="folder for the JSON results")
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.add_argument("--cpu", action="store_true", help="the CPU emulation, even with GPUs")
    args = p.parse_args(argv)
    import torch

    gpus = 0 if args.cpu else torch.cuda.device_count()
    common = (["--out", args.out] if args.out else []) + (["--quick"] if args.quick else [])
    if gpus == 0:
        common.append("--cpu")
        from .bench.cli import emulation_ok

        if not emulation_ok():
            return 2
    rc = 0
    for name in default_suites(gpus):
        rc = max(rc, run_suite(name, common))
    if gpus == 1:
        print(NO_OVERLAP)
    return rc


def plot(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m interlace plot")
    p.add_argument("files", nargs="+", help="results files (benchmarks/results/*.json)")
    args = p.parse_args(argv)
    from .bench.plots import PlotUnavailable, plot_file

    try:
        for path in args.files:
            for out in plot_file(path):
                print(out)
    except PlotUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def merge(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m interlace merge",
        description="merge results files (e.g. from a GPU machine) into the results folder",
    )
    p.add_argument("files", nargs="+", help="results files to merge")
    p.add_argument("--out", default="benchmarks/results", help="the results folder")
    p.add_argument("--no-plot", action="store_true", help="do not redraw the figures")
    args = p.parse_args(argv)
    from .bench.records import merge_file

    for path in args.files:
        try:
            print(merge_file(path, args.out, plot=not args.no_plot))
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"bench": bench, "plot": plot, "merge": merge,
                "trace": lambda rest: run_suite("trace", rest)}  # fmt: skip
    if not argv or argv[0] not in commands:
        print(
            "usage: python -m interlace {bench [SUITE] [ARGS ...] | plot FILE.json ... | "
            "merge FILE.json ... | trace OP [ARGS ...]}"
        )
        print("suites: " + ", ".join(SUITES))
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
