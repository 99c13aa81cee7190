"""What does cutting a GEMM into segments cost? One GPU: the plain segment GEMM against
the same GEMM cut into W segments (all read in place, no waits), with the first read from
a separate tensor (``store_own``, as AG+GEMM does), and with a wait on a raised flag.

    python scripts/probe_segments.py
"""

from __future__ import annotations

import torch

from interlace.bench.timing import median_ms
from interlace.ops import _gemm
from interlace.ops._gemm import Segment


def _ms(fn):
    return median_ms(None, fn, warmup=3)


def variants(m, n, k, w, dev):
    cfg = _gemm.gemm_config(m, n, k)
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16) * 0.05
    c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    own = a[: m // w].clone()
    sig = torch.ones(64, dtype=torch.int32, device=dev)
    err = torch.zeros(4, dtype=torch.int32, device=dev)
    ml = m // w
    cut = [Segment(row0=i * ml, rows=ml) for i in range(w)]
    own_first = [Segment(row0=0, rows=ml, kind="store_own", out_row0=0)] + cut[1:]
    waiting = own_first[:1] + [
        Segment(row0=s.row0, rows=s.rows, wait_first=i, wait_count=1) for i, s in enumerate(cut[1:])
    ]
    out = {"cublas": _ms(lambda: torch.matmul(a, b))}
    for name, segs, has_own in (
        ("one", [Segment(row0=0, rows=m)], False),
        ("cut", cut, False),
        ("own_first", own_first, True),
        ("waiting", waiting, True),
    ):
        table = _gemm.segment_table(segs, n, cfg, dev)
        grid = _gemm.programs_for(_gemm.total_tiles(segs, n, cfg), a.device, "cuda")
        extra = dict(a_own=own, own_rows=ml) if has_own else {}

        def run(table=table, segs=segs, grid=grid, extra=extra):
            _gemm.launch(
                a, b, c, table, len(segs), m, n, k, cfg, grid, sig=sig,
                err=err.data_ptr(), max_spins=1 << 20, **extra,
            )  # fmt: skip

        out[name] = _ms(run)
        ref = a.float() @ b.float()
        out[name + "_err"] = float((c.float() - ref).norm() / ref.norm())
    return out


def main():
    dev = torch.device("cuda", 0)
    print("   M     N     K  W   cublas   one   cut  own_first  waiting")
    for m, n, k, w in ((8192, 14336, 8192, 2), (8192, 7168, 4096, 2), (8192, 3584, 4096, 4)):
        r = variants(m, n, k, w, dev)
        print(
            f"{m:5} {n:5} {k:5} {w:2}  {r['cublas']:.3f}  {r['one']:.3f}  {r['cut']:.3f}  "
            f"{r['own_first']:.3f}  {r['waiting']:.3f}   errs "
            f"{max(r[x] for x in r if x.endswith('_err')):.1e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
