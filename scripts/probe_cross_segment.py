"""What do AG+GEMM's segments cost its consumer GEMM, in the kernel's segment loop and in
its one-loop mode?

One GPU, AG+GEMM's layout as rank 0 of ``--world-size``: the own chunk(s) from ``a_own``,
then the peers' chunks, each waiting on an arrival flag that is already raised. Timed as
CUDA graphs of ``--reps`` launches, every variant interleaved (per-launch median, ms):

* ``cublas``; ``plain``: the segment GEMM, one segment;
* ``seg``: the segment GEMM looping segment by segment (the kernel's default);
* ``one_loop``: the same segments in the kernel's one-loop mode (``ONE_LOOP``): every
  tile of a program in one pipelined loop, each waiting in inline PTX;
* ``one_loop_nowait``: the same without waits (what the waits cost).

    python scripts/probe_cross_segment.py [--world-size 4] [--split 1 2]
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

import torch
from _probe import replayed_ms

from interlace.bench.dense import MODELS, model_shape, rel_err
from interlace.ops import _gemm

SPINS = 1 << 20


class Layout:
    """AG+GEMM's segments on rank 0: own chunk(s) first, then the peers' in arrival order."""

    def __init__(self, world, m, n, k, split, dev):
        self.cfg = _gemm.gemm_config(m, n, k)
        m_loc = m // world
        step = m_loc // split
        segs = [
            _gemm.Segment(row0=i * step, rows=step, kind="store_own", out_row0=i * step)
            for i in range(split)
        ]
        slot = 0
        for p in range(1, world):
            for i in range(split):
                segs.append(
                    _gemm.Segment(
                        row0=p * m_loc + i * step, rows=step, kind="store",
                        wait_first=slot, wait_count=1, wait_expected=1,
                    )
                )  # fmt: skip
                slot += 1
        self.segments = segs
        self.own_rows = m_loc
        self.table = _gemm.segment_table(segs, n, self.cfg, dev)
        self.grid = _gemm.programs_for(_gemm.total_tiles(segs, n, self.cfg), dev, "cuda", 1)
        self.one_loop = _gemm.one_loop_tables(segs, m, n, k, self.cfg, torch.bfloat16, dev)
        assert self.one_loop is not None, "segments not eligible for the one-loop mode"
        nowait = [replace(sg, wait_count=0) for sg in segs]
        self.table_nowait = _gemm.segment_table(nowait, n, self.cfg, dev)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--split", type=int, nargs="+", default=[1, 2])
    p.add_argument("--m", type=int, nargs="+", default=[8192, 2048])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--iters", type=int, default=25)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    _gemm.install_scratch_allocator()
    rows = []
    for m in args.m:
        for model in args.models:
            for split in args.split:
                rows.append(one_shape(model, m, args.world_size, split, dev, args.reps, args.iters))
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    cols = list(rows[0]["ms"])
    print(f"AG+GEMM layouts on one GPU, rank 0 of {args.world_size}, ms per launch")
    width = [max(10, len(c) + 1) for c in cols]
    print(
        f"{'model':12s}{'M':>6s}{'split':>6s}" + "".join(f"{c:>{w}s}" for c, w in zip(cols, width))
    )
    for r in rows:
        print(
            f"{r['model']:12s}{r['M']:6d}{r['split']:6d}"
            + "".join(f"{r['ms'][c]:{w}.3f}" for c, w in zip(cols, width))
        )
    print("largest relative error:", max(v for r in rows for v in r["rel_err"].values()))


def one_shape(model, m, world, split, dev, reps, iters):
    shape = model_shape("ag_gemm", model, m, world)
    m, n, k = shape.M, shape.N, shape.K
    lay = Layout(world, m, n, k, split, dev)
    cfg = lay.cfg
    gen = torch.Generator(device=dev).manual_seed(7)
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16, generator=gen) / math.sqrt(k)
    a_own = a[: lay.own_rows].clone()
    a_missing = a.clone()
    a_missing[: lay.own_rows] = float("nan")  # the own rows must come from ``a_own``
    c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    sig = torch.ones(64, device=dev, dtype=torch.int32)  # every arrival flag raised
    err = torch.zeros(4, device=dev, dtype=torch.int32)
    ref = a.float() @ b.float()

    def run(table, one_loop):
        return _gemm.launcher(
            m, n, k, cfg, lay.grid, table, len(lay.segments), dtype=a.dtype, device=dev,
            sig=sig, err=err.data_ptr(), max_spins=SPINS, world=world, own_a=True,
            own_rows=lay.own_rows, one_loop=one_loop,
        )  # fmt: skip

    variants = {
        "seg": run(lay.table, None),
        "one_loop": run(lay.table, lay.one_loop),
        "one_loop_nowait": run(lay.table_nowait, lay.one_loop),
    }
    calls = {
        "cublas": lambda: torch.matmul(a, b, out=c),
        "plain": lambda: _gemm.matmul(a, b, out=c, cfg=cfg),
        **{name: (lambda r=r: r(a_missing, b, c, None, a_own)) for name, r in variants.items()},
    }
    errors = {}
    for name, fn in calls.items():
        c.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        assert int(err[0]) == 0, f"{name}: a wait timed out {err.tolist()}"
        errors[name] = rel_err(c, ref)
    ms = replayed_ms(calls, reps, iters)
    return dict(model=model, M=m, N=n, K=k, split=split, world_size=world, ms=ms, rel_err=errors)


if __name__ == "__main__":
    main()
