"""``python -m interlace bench host``: the host time of one eager call per op, graphs on
(``eager_graphs``, the default where the driver allows: a call replays its captured graph).

What a user's eager call costs the CPU before it returns, after warm-up calls that compile
and capture: ``host_us``, per call in a loop of calls (``timing.host_us``: median over
``--iters`` batches of back-to-back calls, each batch started with the device idle and
every rank past a host barrier), and ``host_cold_us``, a lone call right after such a
barrier (``timing.host_cold_us``). Every record carries ``torch.mm``'s host time measured
the same two ways in the same world (``host_torch_mm_us``, ``host_torch_mm_cold_us``,
``timing.torch_mm_host``): what one library call costs that CPU. On one GPU it runs
twice: in a world of one rank (the op's host path alone, ``as_world`` 1), then in a world
of two ranks sharing the GPU (``World(share_device=True)``; records marked ``shared_gpu:
true``, ``variant: shared_gpu``), whose host times include what two processes driving one
GPU cost each other. Ops: AG+GEMM, GEMM+RS and GEMM+AR in ``fused`` (and GEMM+RS /
GEMM+AR in ``ce_fused``) at LLaMA-3-8B, M 2048; the collectives in their default method at
16 MB per rank. Records: ``op``, ``strategy``, the shape, ``as_world``, ``host_us``,
``host_cold_us``, ``eager_graphs: true``, and the host time of each step of the call path
(``host_check_us``, ``host_fingerprint_us``, ``host_enqueue_us``, ..., :data:`STEPS`;
timed apart in back-to-back calls); written with ``world_size`` 1 on one GPU, with the
world size on several.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .collectives import _inputs
from .dense import model_shape
from .timing import host_cold_us, host_us, max_over_ranks, torch_mm_host

DENSE = (("ag_gemm", "fused"), ("gemm_rs", "fused"), ("gemm_rs", "ce_fused"),
         ("gemm_ar", "fused"), ("gemm_ar", "ce_fused"))  # fmt: skip
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
MODEL, M, COLLECTIVE_BYTES = "llama3-8b", 2048, 16 << 20


#: The steps of an op's call path timed apart (``host_<step>_us``), those the context has:
#: the argument checks (``_begin`` and the op's checks), the strategy choice, the call's
#: fingerprint written into its signal pad (a stream memory write), the enqueue (on a GPU
#: the replay of the call's captured graph), the end. ``other``: the rest of the call
#: (output allocation, plan lookups, the op's own code). A call like an earlier one runs
#: none of these steps (``OpContext._armed``: its graph replayed at once): all ``other``.
STEPS = {"_begin": "check", "_check_call": "check", "_check_tensor": "check",
         "_check_out": "check", "_resolve": "resolve", "_begin_call": "fingerprint",
         "_enqueue": "enqueue", "_end": "end"}  # fmt: skip


class StepClock:
    """Host clocks around the call-path steps of one context (:data:`STEPS`, each method
    of the instance wrapped while the clock is in force): seconds per step summed over
    the calls, a step called inside another timed step counting to the outer one. The
    wrappers add a fraction of a microsecond per step."""

    def __init__(self, ctx):
        self.ctx, self.seconds, self._depth = ctx, {}, 0

    def _wrap(self, fn, step):
        def timed(*args, **kwargs):
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds[step] = self.seconds.get(step, 0.0) + time.perf_counter() - t0

        return timed

    def __enter__(self):
        for name, step in STEPS.items():
            fn = getattr(self.ctx, name, None)
            if fn is not None:
                setattr(self.ctx, name, self._wrap(fn, step))
        return self

    def __exit__(self, *exc):
        for name in STEPS:
            self.ctx.__dict__.pop(name, None)  # the class's method again
        return None


def step_times(ctx, call, iters: int) -> dict[str, float]:
    """``host_<step>_us`` per call (means over ``iters`` calls, back to back) and
    ``host_other_us`` (the rest of the call's host time)."""
    with StepClock(ctx) as clock:
        t0 = time.perf_counter()
        for _ in range(iters):
            call(ctx)
        total = time.perf_counter() - t0
    per = {f"host_{k}_us": round(v / iters * 1e6, 2) for k, v in clock.seconds.items()}
    per["host_other_us"] = round((total - sum(clock.seconds.values())) / iters * 1e6, 2)
    return per


def _timed(group, make, call, iters: int, warmup: int) -> dict:
    """``host_us``: the max over ranks of each rank's median host time of ``call(ctx)`` on
    a context from ``make()``, after ``warmup`` calls, and the context's ``method`` where
    it has one. An interlace error (raised alike on every rank, by design) gives
    ``host_us: None`` and the ``error`` instead of ending the suite."""
    from ..errors import InterlaceError

    out = {}
    t = cold = None
    steps = {}
    try:
        with make() as ctx:
            out["method"] = getattr(ctx, "method", "default")
            for _ in range(warmup):
                call(ctx)
            t = host_us(group, lambda: call(ctx), iters)
            cold = host_cold_us(group, lambda: call(ctx), iters)
            steps = step_times(ctx, call, iters)
            ctx.check()
    except InterlaceError as e:
        t, out["error"] = None, f"{type(e).__name__}: {e}"
    worst = max_over_ranks(group, {"t": t, "cold": cold})
    out["host_us"] = None if worst["t"] is None else round(worst["t"], 1)
    out["host_cold_us"] = None if worst["cold"] is None else round(worst["cold"], 1)
    if worst["t"] is not None:  # (this rank's steps; every rank runs the same path)
        out.update(steps)
    return out


def measure(group, iters: int = 20, warmup: int = 5) -> list[dict]:
    """Rank body: one record per op, the max over ranks of each rank's median; an op that
    fails gets ``host_us: None`` and its ``error``."""
    import interlace

    w, dev = group.world_size, group.device
    classes = {"ag_gemm": interlace.AGGemm, "gemm_rs": interlace.GemmRS,
               "gemm_ar": interlace.GemmAR}  # fmt: skip
    records = []
    for op, strategy in DENSE:
        s = model_shape(op, MODEL, M, w)
        rows = s.M // w if op == "ag_gemm" else s.M
        a = torch.randn(rows, s.K, device=dev, dtype=torch.bfloat16)
        b = torch.randn(s.K, s.N, device=dev, dtype=torch.bfloat16) / s.K**0.5
        got = _timed(
            group, lambda op=op, s=s, strategy=strategy: classes[op](
                group, max_m=s.M, n=s.N, k=s.K, strategy=strategy),
            lambda ctx, a=a, b=b: ctx(a, b), iters, warmup,
        )  # fmt: skip
        got.pop("method", None)
        records.append({"op": op, "strategy": strategy, "model": MODEL, "M": s.M, "N": s.N,
                        "K": s.K, "as_world": w, "eager_graphs": True, **got})  # fmt: skip
    collective = {"all_gather": interlace.AllGather, "reduce_scatter": interlace.ReduceScatter,
                  "all_reduce": interlace.AllReduce}  # fmt: skip
    for op in COLLECTIVES:
        x, _, capacity = _inputs(group, op, COLLECTIVE_BYTES, torch.bfloat16, seed=0)
        cls = collective[op]
        got = _timed(
            group, lambda cls=cls, capacity=capacity: cls(group, capacity, torch.bfloat16),
            lambda ctx, x=x: ctx(x), iters, warmup,
        )  # fmt: skip
        records.append({"op": op, "strategy": got.pop("method", "default"),
                        "bytes_per_rank": COLLECTIVE_BYTES, "as_world": w, "eager_graphs": True,
                        **got})  # fmt: skip
    ref = max_over_ranks(group, torch_mm_host(group, iters))
    return [dict(r, **ref) for r in records]


def table(records: list[dict]) -> None:
    from .cli import print_table

    def who(r):
        shared = " shared" if r.get("shared_gpu") else ""
        return [r["op"], r["strategy"], f"{r['as_world']}{shared}"]

    rows = []
    for r in records:
        shape = (f"{r['model']} M={r['M']}" if "model" in r
                 else f"{r['bytes_per_rank'] >> 20} MB/rank")  # fmt: skip
        t = "failed" if r["host_us"] is None else f"{r['host_us']:.1f}"
        cold = r.get("host_cold_us")
        rows.append([*who(r), shape, t, str(r.get("host_torch_mm_us", "-")),
                     "-" if cold is None else f"{cold:.1f}",
                     str(r.get("host_torch_mm_cold_us", "-"))])  # fmt: skip
    print_table("host us per eager call (graphs on): in a loop of calls / a lone call after "
                "a barrier; torch.mm beside each",
                ["op", "strategy", "as W", "shape", "host_us", "torch.mm", "cold", "mm cold"],
                rows)  # fmt: skip
    steps = ["check", "resolve", "fingerprint", "enqueue", "end", "other"]
    rows = [who(r) + [str(r.get(f"host_{k}_us", "-")) for k in steps]
            for r in records if r.get("host_us") is not None]  # fmt: skip
    if rows:
        print_table("host us per call by step (back to back, clocks on)",
                    ["op", "strategy", "as W", *steps], rows)  # fmt: skip
    for r in records:
        if r.get("error"):
            print(f"error {r['op']} {r['strategy']}: {r['error']}")


def main(argv: list[str] | None = None) -> int:
    from ..testing import World
    from .records import DEFAULT_OUT, write_records

    p = argparse.ArgumentParser(prog="python -m interlace bench host")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks (default: every GPU, or 2 sharing one GPU)")  # fmt: skip
    p.add_argument("--iters", type=int, default=20, help="calls timed (median taken)")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for the JSON results")
    p.add_argument("--quick", action="store_true", help="(the suite is short already)")
    args = p.parse_args(argv)
    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("bench host: needs a GPU (host time of a CUDA call)")
        return 0
    worlds = [args.world_size] if args.world_size else ([gpus] if gpus >= 2 else [1, 2])
    records = []
    for world in worlds:
        shared = world > gpus
        if shared and gpus >= 2:
            print(f"error: --world-size {world} but only {gpus} GPUs", file=sys.stderr)
            return 2
        with World(world, "cuda", share_device=shared, timeout=900) as ranks:
            got = ranks.run(measure, args.iters)[0]
        if shared:
            got = [dict(r, shared_gpu=True, variant="shared_gpu") for r in got]
        path = write_records(args.out, torch.cuda.get_device_name(0), 1 if shared else world, got)
        records += got
    table(records)
    print(f"results written to {path}")
    return 1 if any(r.get("error") for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
