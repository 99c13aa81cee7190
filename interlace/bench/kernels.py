"""``python -m interlace bench kernels``: each fused kernel as one rank of W = 2, 4, 8 runs
it, its waits already met, timed against cuBLAS (``torch.matmul``) on the same per-rank
GEMM in the same run. One GPU is enough: this is the kernel's own work, with no
communication and no synchronisation (``interlace.testing.emulated``), i.e. what the op's
GEMM takes when every copy lands in time. The time a fused op adds over it is the part
that needs two or more GPUs to see.

Kernels (``op``, ``strategy``): the plain segment GEMM (``plain``, on each distinct
per-rank shape, its ``op`` the first op whose per-rank GEMM it is); AG+GEMM's consumer
(``ag_gemm``, ``fused``); GEMM+RS and GEMM+AR in each strategy ``auto`` may pick
(``fused``, ``ce_fused``); the ``signal_reorder`` GEMM (``gemm_ar``, ``signal_reorder``:
the GEMM that counts finished wave groups, with the partition the op takes by default).
Shapes: the public table (LLaMA-7B, LLaMA-3-8B, LLaMA-3-70B; M 2048 and 8192), the GEMM
of one rank at TP = W; ``--models`` also takes models outside it
(``dense.OTHER_MODELS``), whose configs come from the wave model.

Every kernel is first checked against a float32 reference (outputs poisoned), then it and
cuBLAS are each captured in a CUDA graph and the replays timed interleaved
(``paired_median_ms``: CUDA events around one replay, device idle before each, median of
``--iters``), so the figure is device time, without either side's host launch cost (that is
``bench host``'s figure); ``timing`` in the record says ``graph``, or ``eager`` for a kernel
that could not be captured. Records (docs/design.md, "Measuring"): ``op``,
``strategy``, ``model``, ``M``, ``N``, ``K``, ``as_world``, ``waits_met: true``, ``ref:
"cublas"``, ``t_ms``, ``t_ref_ms``, ``rel_err``; written with ``world_size`` 1. Without a
GPU it checks tiny shapes under Triton's interpreter (no timings).
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch

from .dense import MODELS, MS, OTHER_MODELS, model_shape

WORLDS = (2, 4, 8)
#: (op, strategy, emulation mode); mode None: the signal_reorder GEMM
KERNELS = (
    ("ag_gemm", "fused", "ag"),
    ("gemm_rs", "fused", "rs_fused"),
    ("gemm_rs", "ce_fused", "rs"),
    ("gemm_ar", "fused", "ar_fused"),
    ("gemm_ar", "ce_fused", "ar"),
    ("gemm_ar", "signal_reorder", None),
)
MAX_REL_ERR = 2e-2


def cases(models, ms, worlds) -> list[tuple[str, str, str | None, str, int, int, int, int]]:
    """``(op, strategy, mode, model, M, N, K, W)`` for every kernel, then the plain GEMM
    once per distinct per-rank shape (``op``: the first op with that shape)."""
    out, plain = [], []
    for model in models:
        for m in ms:
            for w in worlds:
                for op, strategy, mode in KERNELS:
                    s = model_shape(op, model, m, w)
                    out.append((op, strategy, mode, model, s.M, s.N, s.K, w))
                    if all(p[1:] != (model, s.M, s.N, s.K, w) for p in plain):
                        plain.append((op, model, s.M, s.N, s.K, w))
    out += [(op, "plain", "plain", model, m, n, k, w) for op, model, m, n, k, w in plain]
    return out


def record(op, strategy, model, m, n, k, w, t, t_ref, err) -> dict:
    """A kernel record (see the module docstring)."""
    rnd = lambda x: None if x is None else round(x, 4)  # noqa: E731
    return {
        "op": op, "strategy": strategy, "model": model, "M": m, "N": n, "K": k,
        "as_world": w, "waits_met": True, "ref": "cublas", "dtype": "bfloat16",
        "t_ms": rnd(t), "t_ref_ms": rnd(t_ref), "rel_err": None if err is None else float(err),
        "ok": err is not None and err <= MAX_REL_ERR,
    }  # fmt: skip


class _SignalGemm:
    """The ``signal_reorder`` GEMM (all-reduce layout) of a one-rank context: the kernel
    that stores tiles in wave-group order and counts each finished group."""

    def __init__(self, group, m, n, k):
        from ..ops.signal_reorder import SignalReorderGemmAR

        gen = torch.Generator(device=group.device).manual_seed(7)
        self.a = torch.randn(m, k, device=group.device, dtype=torch.bfloat16, generator=gen)
        self.b = torch.randn(k, n, device=group.device, dtype=torch.bfloat16, generator=gen)
        self.b /= k**0.5
        self.ctx = SignalReorderGemmAR(group, m, n, k, eager_graphs=False)
        self.plan = self.ctx.plan(m, n)

    def check(self) -> float:
        """The op's whole call on one rank (all-reduce of one rank: the GEMM itself)."""
        from ..testing.emulated import rel_err

        out = torch.full((self.a.shape[0], self.b.shape[1]), float("nan"),
                         device=self.a.device, dtype=torch.bfloat16)  # fmt: skip
        y = self.ctx(self.a, self.b, out=out)
        if self.a.is_cuda:
            torch.cuda.synchronize()
        return rel_err(y, self.a.float() @ self.b.float())

    def __call__(self):
        self.ctx.launch_gemm(self.plan, self.a, self.b)

    def close(self):
        self.ctx.close()


def against_cublas(kernels: dict, iters: int = 20) -> tuple[float, dict]:
    """``(t_cublas_ms, {name: t / t_cublas})`` of one-rank kernels of one shape
    (``testing.emulated.Emulated``, checked first by the caller): cuBLAS on the first
    kernel's operands and each kernel captured in a CUDA graph, the replays timed
    interleaved (``paired_median_ms``); raises where a kernel's wait timed out. For probes
    that compare variants of a kernel."""
    from .timing import graph_of, paired_median_ms

    first = next(iter(kernels.values()))
    a, b = first.a, first.b
    ref_out = torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=a.dtype)
    graphs = [graph_of(None, lambda: torch.matmul(a, b, out=ref_out))]
    graphs += [graph_of(None, k) for k in kernels.values()]
    times = paired_median_ms(None, [g.replay for g in graphs], iters)
    for name, k in kernels.items():
        if int(k.err[0]):
            raise RuntimeError(f"{name}: a wait timed out: {k.err.tolist()}")
    return times[0], {name: t / times[0] for name, t in zip(kernels, times[1:])}


def run_cases(group, todo, iters: int = 20, warmup: int = 5, timed: bool = True) -> list[dict]:
    """Rank body (a one-rank world): check, then time each case against cuBLAS."""
    from ..ops.segment_gemm import matmul
    from ..testing.emulated import Emulated, rel_err
    from .timing import graph_of, paired_median_ms

    dev = group.device
    records = []
    for op, strategy, mode, model, m, n, k, w in todo:
        kernel = err = t = t_ref = None
        note, timing = None, None
        try:
            if mode is None:
                kernel = _SignalGemm(group, m, n, k)
                err = kernel.check()
                run, a, b = kernel, kernel.a, kernel.b
            elif mode == "plain":
                gen = torch.Generator(device=dev).manual_seed(3)
                a = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
                b = torch.randn(k, n, device=dev, dtype=torch.bfloat16, generator=gen) / k**0.5
                out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
                matmul(a, b, out=out)
                err = rel_err(out, a.float() @ b.float())
                run = lambda a=a, b=b, out=out: matmul(a, b, out=out)  # noqa: E731
            else:
                kernel = Emulated(w, 0, m, n, k, mode, device=dev, one_loop=None)
                err = kernel.check()
                run, a, b = kernel, kernel.a, kernel.b
            if timed and err <= MAX_REL_ERR:
                ref_out = torch.empty(a.shape[0], b.shape[1], device=dev, dtype=a.dtype)
                cublas = lambda a=a, b=b, o=ref_out: torch.matmul(a, b, out=o)  # noqa: E731
                timing = "graph"
                try:  # device time: each side replayed from a CUDA graph (no host launch cost)
                    fns = [graph_of(None, cublas).replay, graph_of(None, run).replay]
                except Exception:  # noqa: BLE001 - a kernel that cannot be captured
                    fns, timing = [cublas, run], "eager"
                t_ref, t = paired_median_ms(None, fns, iters, warmup)
                if mode not in (None, "plain") and int(kernel.err[0]):
                    raise RuntimeError(f"a wait timed out: {kernel.err.tolist()}")
        except Exception as exc:  # noqa: BLE001 - reported in the record
            note = f"{type(exc).__name__}: {str(exc)[:200]}"
        rec = record(op, strategy, model, m, n, k, w, t, t_ref, err)
        if t is not None:
            rec["timing"] = timing
        if note:
            rec["note"], rec["ok"] = note, False
        records.append(rec)
        if hasattr(kernel, "close"):
            kernel.close()
        del kernel
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return records


def table(records: list[dict]) -> None:
    from .cli import ms, print_table, ratio

    head = ["op", "strategy", "model", "M", "N", "K", "as W", "t_ms", "cublas_ms",
            "t / cuBLAS", "rel_err"]  # fmt: skip
    rows = [
        [
            r["op"], r["strategy"] + ("" if r["ok"] else " !"), r["model"], str(r["M"]),
            str(r["N"]), str(r["K"]), str(r["as_world"]), ms(r["t_ms"]), ms(r["t_ref_ms"]),
            ratio(r["t_ms"], r["t_ref_ms"]),
            "-" if r["rel_err"] is None else f"{r['rel_err']:.1e}",
        ]
        for r in records
    ]  # fmt: skip
    print_table("fused kernels, one rank of W, waits met, against cuBLAS", head, rows)
    for r in records:
        if r.get("note"):
            print(f"note {r['op']} {r['strategy']} {r['model']} M={r['M']} W={r['as_world']}: "
                  f"{r['note']}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from ..testing import World
    from .cli import csv, emulation_ok
    from .records import DEFAULT_OUT, write_records

    p = argparse.ArgumentParser(prog="python -m interlace bench kernels")
    p.add_argument("--models", type=csv(MODELS | OTHER_MODELS), default=None,
                   help=f"subset of {','.join(MODELS)} (the default), or models outside the "
                        f"tuned table: {','.join(OTHER_MODELS)}")  # fmt: skip
    p.add_argument("--ms", type=csv(kind=int), default=None, help="M values, e.g. 8192")
    p.add_argument("--worlds", type=csv(kind=int), default=None, help="W values, e.g. 2,4,8")
    p.add_argument("--iters", type=int, default=20, help="timed runs (median taken)")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for the JSON results")
    p.add_argument("--quick", action="store_true", help="M = 8192 only")
    p.add_argument("--cpu", action="store_true", help="tiny shapes under the interpreter")
    args = p.parse_args(argv)
    timed = torch.cuda.is_available() and not args.cpu
    if timed:
        ms = args.ms or ([8192] if args.quick else list(MS))
        todo = cases(args.models or list(MODELS), ms, args.worlds or list(WORLDS))
    else:
        if not emulation_ok():
            return 2
        print("No GPU: the kernels on tiny shapes under Triton's interpreter; no timings.")
        todo = [(op, s, mode, "tiny", 37 * w, 40, 24, w) for op, s, mode in KERNELS
                for w in (args.worlds or [2])]  # fmt: skip
        todo += [("gemm_rs", "plain", "plain", "tiny", 74, 40, 24, 2)]
    with World(1, "cuda" if timed else "cpu", timeout=1800) as ranks:
        records = ranks.run(run_cases, todo, args.iters, 5, timed)[0]
    table(records)
    if timed:
        path = write_records(args.out, torch.cuda.get_device_name(0), 1, records)
        print(f"results written to {path}")
    bad = [r for r in records if not r["ok"]]
    if bad:
        print(f"{len(bad)} kernel records failed their check")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
