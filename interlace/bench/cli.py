"""What the bench suites share on the command line: argument types, the rank plan of a
run, a progress line, tables, and the check that the CPU emulation can run here."""

from __future__ import annotations

import argparse
import re
import sys

SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

#: Triton 3.6's interpreter (the CPU emulation) reads run-time loop bounds as numpy
#: arrays; numpy >= 2.3 refuses to turn a 1-element array into a Python int there
#: ("only 0-dimensional arrays can be converted to Python scalars").
NUMPY_MAX = (2, 3)
NUMPY_FIX = 'python3 -m pip install "numpy<2.3"'


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+)([KMG]?)B?", text.strip().upper())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 64M)")
    return int(match.group(1)) * SIZE_UNITS.get(match.group(2), 1)


def csv(choices=None, kind=str):
    """argparse type: a comma-separated list, each item converted and checked."""

    def parse(text: str) -> list:
        items = [kind(x) for x in text.split(",") if x]
        bad = [x for x in items if choices is not None and x not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad} not in {', '.join(map(str, choices))}")
        return items

    return parse


def add_several_only(parser: argparse.ArgumentParser) -> None:
    """``--several-only`` for a suite with a one-GPU part and a cross-GPU comparison."""
    parser.add_argument("--several-only", action="store_true",
                        help="on several GPUs, only the cross-GPU comparison")  # fmt: skip


def runs_one_gpu(args: argparse.Namespace, gpus: int) -> bool:
    """Whether the suite runs its one-GPU part: always, unless ``--several-only`` on 2+
    GPUs."""
    return not (getattr(args, "several_only", False) and gpus >= 2)


def numpy_problem(version: str | None = None) -> str | None:
    """Why the CPU emulation cannot run with this numpy (None when it can): the message
    names the pip command that fixes it."""
    if version is None:
        import numpy

        version = numpy.__version__
    try:
        major, minor = (int(re.match(r"\d+", v).group()) for v in version.split(".")[:2])
    except (AttributeError, ValueError):
        return None
    if (major, minor) < NUMPY_MAX:
        return None
    return (
        f"the CPU emulation runs kernels in Triton's interpreter, which fails with numpy "
        f"{version} (numpy >= {NUMPY_MAX[0]}.{NUMPY_MAX[1]} breaks its run-time loop bounds). "
        f"Install an older numpy into this environment:\n    {NUMPY_FIX}\n"
        f"or run `bash scripts/test.sh` once, which builds ./.venv with one."
    )


def emulation_ok() -> bool:
    """Print why the CPU emulation cannot run here and return False, or return True."""
    problem = numpy_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return False
    return True


def ranks_plan(world_size: int | None, cpu: bool) -> tuple[bool, int] | None:
    """``(timed, world)`` of a multi-rank run: timed on the GPUs when there are at least
    two and ``cpu`` is off; ``world_size`` ranks, by default every GPU (timed) or 2 (the
    CPU emulation). None, after printing why, when more ranks than GPUs are asked for or
    the emulation cannot run here."""
    import torch

    gpus = torch.cuda.device_count()
    timed = gpus >= 2 and not cpu
    world = world_size or (gpus if timed else 2)
    if timed and world > gpus:
        print(f"error: --world-size {world} but only {gpus} GPUs", file=sys.stderr)
        return None
    if not timed and not emulation_ok():
        return None
    return timed, world


def rank_args(parser: argparse.ArgumentParser, out: str, quick: str, warmup: str) -> None:
    """The options every multi-rank suite takes: ranks, dtype, timed runs, output folder,
    the CPU emulation, fewer cases (``quick``: what it leaves) and no warm-up (``warmup``:
    what it skips)."""
    parser.add_argument("--world-size", type=int, default=None, help="ranks (default: GPUs)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=20, help="timed runs per rank (median)")
    parser.add_argument("--out", default=out, help="folder for the JSON results")
    parser.add_argument("--cpu", action="store_true", help="force the CPU emulation")
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--no-warmup-pass", dest="warmup_pass", action="store_false",
                        help=f"skip {warmup}")  # fmt: skip


def start(args) -> tuple[bool, int] | None:
    """:func:`ranks_plan` of parsed :func:`rank_args`, saying so when the run is the CPU
    emulation's."""
    plan = ranks_plan(args.world_size, args.cpu)
    if plan is not None and not plan[0]:
        print("No GPUs in use: the CPU emulation on tiny sizes, checked against "
              "torch.distributed; no timings.", flush=True)  # fmt: skip
    return plan


def progress(total: int):
    """``(step, stop)``: a rich progress bar when rich is installed, plain lines otherwise."""
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


def print_table(title: str, head: list[str], rows: list[list[str]], width: int = 140) -> None:
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


def ms(x) -> str:
    return f"{x:.3f}" if x else "-"


def ratio(num, den) -> str:
    return f"{num / den:.2f}" if num and den else "-"
