"""What does the GEMM+RS / GEMM+AR ``ce_fused`` kernel cost by itself, on one GPU?

One process emulates rank ``--rank`` of ``--world-size`` ranks: the kernel runs the
segments that rank runs (``ops._rs_variants.cef_layout``), with every wait already met
(the peers' partials lie in a local receive buffer and their arrival flags are raised
before the first launch), the all-reduce's broadcast stores going to ``world`` local
result buffers. So the times are the kernel's own work, with no communication and no
synchronisation: what the op's GEMM would take if every copy landed in time.

Each variant is checked against a float32 reference first (outputs poisoned), then timed
as a CUDA graph of ``--reps`` launches, every variant's graph replayed once per round for
``--iters`` rounds (per-launch median, ms):

* ``cublas``: ``torch.matmul``; ``plain`` / ``plain_room``: the segment GEMM with plain
  stores, with the op's config (``with_epilogue_room``) for the latter;
* ``seg_plain``: the chunks as plain store segments (what segments cost by themselves);
* ``rs_stage``: every chunk staged (the push epilogue path for every tile, no reduction);
* ``rs_cef`` / ``ar_cef``: the GEMM+RS / GEMM+AR (``gather="epilogue"``) layouts;
  ``*_1l``: the same in the kernel's one-loop mode (``ONE_LOOP``);
* ``*_1l_alt`` (``--other-tiles``): the one-loop layouts with the other tile width
  (128 columns and 4 warps where the op's config has 256, else 256 and 8 warps);
* ``*_before``: the same with the kernel module named by ``--before`` (e.g. a copy of
  an earlier ``kernels/gemm.py`` saved as ``interlace/kernels/_gemm_before.py``), so
  two kernel versions are compared in one run on one machine.

    python scripts/probe_kernel_layout.py [--world-size 4] [--m 8192 2048] [--json F]
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
from dataclasses import replace

import torch
from _probe import replayed_ms

from interlace.bench.dense import MODELS, model_shape, rel_err
from interlace.ops import _gemm
from interlace.ops._cef_emulated import Emulated


def _baselines(m, n, k, errors) -> dict:
    """cuBLAS and the plain segment GEMM (its own config, and the op's) on fresh operands:
    name -> callable (checked here)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(99)
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16, generator=gen) / math.sqrt(k)
    c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    ref = a.float() @ b.float()
    base = _gemm.gemm_config(m, n, k)
    calls = {"cublas": lambda: torch.matmul(a, b, out=c)}
    for name, cfg in (("plain", base), ("plain_room", _gemm.with_epilogue_room(base))):
        c.fill_(float("nan"))
        _gemm.matmul(a, b, out=c, cfg=cfg)
        errors[name] = rel_err(c.float(), ref)
        calls[name] = lambda cfg=cfg: _gemm.matmul(a, b, out=c, cfg=cfg)
    return calls


def shape_row(model, m, world, rank, reps, iters, before, other_tiles=False):
    """Every variant of one shape, checked, then timed interleaved: round ``i`` replays
    each variant's graph once before round ``i + 1`` replays any (``paired_median_ms``),
    so the machine's drift during the run reaches every variant alike."""
    shape = model_shape("gemm_rs", model, m, world)
    m, n, k = shape.M, shape.N, shape.K
    variants = {  # name: (mode, split, one loop)
        "seg_plain": ("plain", 2, False), "seg_plain_1l": ("plain", 2, True),
        "rs_stage": ("stage", 2, False), "rs_stage_1l": ("stage", 2, True),
        "rs_cef": ("rs", 2, False), "rs_cef_1l": ("rs", 2, True),
        "ar_cef": ("ar", 2, False), "ar_cef_1l": ("ar", 2, True),
    }  # fmt: skip
    errors = {}
    calls = _baselines(m, n, k, errors)
    kernels = {"": None}
    if before is not None:
        kernels["_before"] = before
    for name, (mode, split, one_loop) in variants.items():
        for suffix, kernel in kernels.items():
            emu = Emulated(world, rank, m, n, k, mode, split, kernel=kernel, one_loop=one_loop)
            errors[name + suffix] = emu.check()
            calls[name + suffix] = emu
    if other_tiles:  # the one-loop layouts with the other tile width
        cfg = _gemm.scatter_config(_gemm.gemm_config(m, n, k, "cuda"), n)  # the op's
        wide = cfg.block_n < 256
        alt = replace(
            cfg, block_n=256 if wide else 128, num_warps=8 if wide else 4,
            num_stages=3 if wide else 5,
        )  # fmt: skip
        for name, mode in (("rs_cef_1l_alt", "rs"), ("ar_cef_1l_alt", "ar")):
            emu = Emulated(world, rank, m, n, k, mode, 2, one_loop=True, cfg=alt)
            errors[name] = emu.check()
            calls[name] = emu
    row = replayed_ms(calls, reps, iters)
    return dict(model=model, M=m, N=n, K=k, world_size=world, rank=rank, ms=row, rel_err=errors)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--m", type=int, nargs="+", default=[8192, 2048])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--reps", type=int, default=5, help="launches per graph replay")
    p.add_argument("--iters", type=int, default=25, help="interleaved rounds")
    p.add_argument("--before", default=None, help="module of an earlier kernel to compare")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--other-tiles", action="store_true",
        help="also the one-loop layouts with the other tile width (128 <-> 256 columns)",
    )  # fmt: skip
    args = p.parse_args()
    before = None
    if args.before:
        before = importlib.import_module(args.before).gemm_segments_kernel
    rows = []
    for m in args.m:
        for model in args.models:
            row = shape_row(
                model, m, args.world_size, args.rank, args.reps, args.iters, before,
                args.other_tiles,
            )  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__,
        triton=importlib.import_module("triton").__version__, rows=rows,
    )  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=1)
    cols = list(rows[0]["ms"])
    print(f"ce_fused kernel layouts on one GPU, as rank {args.rank} of {args.world_size}, ms")
    width = [max(8, len(c) + 1) for c in cols]
    print(f"{'model':12s}{'M':>6s}" + "".join(f"{c:>{w}s}" for c, w in zip(cols, width)))
    for r in rows:
        times = "".join(f"{r['ms'][c]:{w}.3f}" for c, w in zip(cols, width))
        print(f"{r['model']:12s}{r['M']:6d}" + times)
    worst = max(v for r in rows for v in r["rel_err"].values())
    print(f"largest relative error vs float32: {worst:.2e}")


if __name__ == "__main__":
    main()
