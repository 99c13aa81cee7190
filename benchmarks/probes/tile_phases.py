"""Where a per-rank GEMM+RS / GEMM+AR kernel's time goes, tile by tile: the kernel as rank
0 of W with every wait met (``testing.emulated.Emulated``), launched with ``TRACE`` on
(``bench.trace.traced_launch``), its per-tile events decoded (``language.trace``'s buffer
layout) into, per tile kind (``push``, ``reduce``, ``store``):

* ``tile``: from the tile's start (its wait's begin where it waits, else the end of the
  program's previous tile's main loop, or the program's start) to the end of its main
  loop: its main loop, plus the previous tile's epilogue where the tile does not wait;
* ``tail``: from the end of a program's last main loop to the program's end (that tile's
  epilogue, its count, the kernel's exit);
* the kernel's span (first program start to last program end) and ``idle``: how long the
  programs that ended first waited for the last one (median over programs).

A reduce tile's epilogue (the peers' partials added, the result stored) is its ``tail``
where it is a program's last tile, as it is in the one-loop layout. Modes (``--modes``):
``rs`` / ``ar`` (``ce_fused``), ``rs_fused`` / ``ar_fused`` (``fused``), ``plain`` (the
same chunks as plain store segments). Prints a table per case; ``--out FILE`` keeps the
per-case summaries (JSON).

    python benchmarks/probes/tile_phases.py [--worlds 4 8] [--models llama-7b] [--ms 2048]
    python benchmarks/probes/tile_phases.py --cpu   (tiny shapes, interpreter: a smoke run)
"""

from __future__ import annotations

import argparse
import json
import statistics


def phases(buf, segments, header: int, per_tile: int) -> dict:
    """The summary of one traced launch's buffer (see the module docstring), in us."""
    stride, programs, capacity = (int(x) for x in buf[0, :3])
    ev = buf[1 : 1 + programs * stride].view(programs, stride, 4)
    tiles, tails, ends, starts = {}, {}, [], []
    for p in range(programs):
        start, end = ev[p, 0], ev[p, 1]  # header slots of kinds 1 and 2
        if int(start[1]) == 0 or int(end[1]) == 0:
            continue
        starts.append(int(start[0]))
        ends.append(int(end[0]))
        mark, last_kind = int(start[0]), None
        for j in range(capacity):
            slot = header + per_tile * j
            wait_begin, tile_end = ev[p, slot], ev[p, slot + 2]
            if int(tile_end[1]) == 0:
                break
            kind = segments[int(tile_end[2])].kind
            if int(wait_begin[1]) != 0:
                mark = int(wait_begin[0])
            tiles.setdefault(kind, []).append((int(tile_end[0]) - mark) / 1e3)
            mark, last_kind = int(tile_end[0]), kind
        if last_kind is not None:
            tails.setdefault(last_kind, []).append((int(end[0]) - mark) / 1e3)
    if not ends:
        return {}
    last = max(ends)
    med = lambda xs: round(statistics.median(xs), 2)  # noqa: E731
    return {
        "span_us": round((last - min(starts)) / 1e3, 2),
        "idle_us": med([(last - e) / 1e3 for e in ends]),
        "tile_us": {
            k: {"n": len(v), "median": med(v), "max": round(max(v), 2)} for k, v in tiles.items()
        },  # fmt: skip
        "tail_us": {
            k: {"n": len(v), "median": med(v), "max": round(max(v), 2)} for k, v in tails.items()
        },  # fmt: skip
    }


def body(group, todo, repeats: int) -> list[dict]:
    """Rank body (a one-rank world): each case traced ``repeats`` times (the first
    compiles), the last launch's events summarised, the output checked each time."""
    from interlace.bench.trace import traced_launch
    from interlace.language.trace import HEADER, PER_TILE
    from interlace.ops import segment_gemm
    from interlace.testing.emulated import Emulated

    out = []
    for mode, model, m, n, k, w in todo:
        kern = Emulated(w, 0, m, n, k, mode, device=group.device, one_loop=None)
        tiles = segment_gemm.total_tiles(kern.segments, n, kern.cfg)
        traced, buf = traced_launch(kern.run.prepared, tiles, group.device)
        kern.run.prepared = traced
        err = max(kern.check() for _ in range(repeats))
        summary = phases(buf.cpu(), kern.segments, HEADER.value, PER_TILE.value)
        rec = {"mode": mode, "model": model, "M": m, "N": n, "K": k, "as_world": w,
               "one_loop": bool(traced.kwargs.get("ONE_LOOP")), "programs": traced.grid,
               "tiles": tiles, "rel_err": err, **summary}  # fmt: skip
        out.append(rec)
        print("case", json.dumps(rec), flush=True)  # a partial run keeps its cases
    return out


def main() -> int:
    import torch

    from interlace.bench.dense import model_shape
    from interlace.testing import World
    from interlace.testing.emulated import OP_OF

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--modes", nargs="*", default=["rs", "ar", "rs_fused", "ar_fused", "plain"])
    p.add_argument("--models", nargs="*", default=["llama-7b", "llama3-70b"])
    p.add_argument("--ms", nargs="*", type=int, default=[2048, 8192])
    p.add_argument("--worlds", nargs="*", type=int, default=[4, 8])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="JSON file for the summaries")
    p.add_argument("--cpu", action="store_true", help="tiny shapes, interpreter")
    args = p.parse_args()
    gpu = torch.cuda.is_available() and not args.cpu
    if gpu:
        todo = []
        for model in args.models:
            for m in args.ms:
                for w in args.worlds:
                    for mode in args.modes:
                        op = OP_OF[mode][0] if mode != "plain" else "gemm_rs"
                        s = model_shape(op, model, m, w)
                        todo.append((mode, model, s.M, s.N, s.K, w))
    else:
        todo = [(mode, "tiny", 37 * 4, 48, 32, 4) for mode in args.modes]
    with World(1, "cuda" if gpu else "cpu", timeout=3600) as world:
        records = world.run(body, todo, args.repeats if gpu else 1)[0]
    print(f"{'mode':>8} {'model':>11} {'M':>5} {'W':>2} {'span':>7} {'idle':>6}  "
          "tile us (median / max) per kind; tail us (median / max) per kind")  # fmt: skip
    for r in records:
        cell = lambda d: ", ".join(  # noqa: E731
            f"{k} {v['median']}/{v['max']} x{v['n']}" for k, v in sorted(d.items())
        )
        print(f"{r['mode']:>8} {r['model']:>11} {r['M']:>5} {r['as_world']:>2} "
              f"{r.get('span_us', 0):7.1f} {r.get('idle_us', 0):6.1f}  "
              f"{cell(r.get('tile_us', {}))}; {cell(r.get('tail_us', {}))}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    return 0 if all(r["rel_err"] <= 2e-2 for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
