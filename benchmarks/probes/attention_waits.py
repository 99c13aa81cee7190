"""What each sequence-parallel attention kernel's chunk waits cost, kernel by kernel: the
forward, dK / dV and dQ kernels of ``bench attention``'s per-rank problem (rank 0 of W,
every arrival flag already raised) timed as launched (``WAIT`` on) and compiled without
their waits, the two interleaved (``bench.timing.paired_median_ms``). ``bench attention``
reports the same ratio for the forward and for the whole backward; this splits the
backward's between its two kernels. Prints a table; ``--out FILE`` keeps it (JSON).

    python benchmarks/probes/attention_waits.py [--seqs 16384 32768] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", nargs="*", type=int, default=[16384])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    from interlace.bench.attention import _PerRank
    from interlace.bench.timing import paired_median_ms

    rows = []
    for s in args.seqs:
        for causal in (False, True):
            per = _PerRank(s, causal)
            per.flags_up()
            per.fwd()  # lse and delta for the backward kernels
            per.bwd()
            for kernel, fn in (("fwd", per.fwd), ("dkdv", per.dkdv), ("dq", per.dq_only)):
                t, t_nowait = paired_median_ms(
                    None, [fn, functools.partial(fn, wait=False)], iters=args.iters, warmup=3,
                    setup=per.flags_up,
                )  # fmt: skip
                rows.append(dict(S=s, causal=causal, kernel=kernel, t_ms=round(t, 4),
                                 t_nowait_ms=round(t_nowait, 4)))  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
            del per
            torch.cuda.empty_cache()
    print(f"{'S':>6} {'causal':<6} {'kernel':<5} {'t ms':>8} {'no wait':>8} {'waits':>7}")
    for r in rows:
        cost = 100 * (r["t_ms"] / r["t_nowait_ms"] - 1)
        print(f"{r['S']:>6} {r['causal']!s:<6} {r['kernel']:<5} {r['t_ms']:8.3f} "
              f"{r['t_nowait_ms']:8.3f} {cost:+6.1f}%")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
