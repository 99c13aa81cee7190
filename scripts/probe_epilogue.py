"""Where does GEMM+RS ``fused`` lose device time against cuBLAS? On 2+ GPUs, each kernel
replayed as a CUDA graph (no host time), for the public GEMM+RS shapes at M 8192:

* ``cublas``: ``torch.matmul``.
* ``plain``: the segment GEMM, one store segment, its own tile config.
* ``plain_room``: the same with the fused op's config (``with_epilogue_room``).
* ``push_path_store``: the fused kernel's code path (``HAS_PUSH``) with store segments only.
* ``reduce_only``: every tile a reduce tile (adds a partial from the local receive
  buffer, no waits).
* ``push_local`` / ``push_peer``: every tile pushed by TMA into this rank's / the next
  rank's receive buffer (no waits).
* ``layout_nowait``: the fused op's segments (peers' rows pushed first, in two chunks per
  owner, then this rank's rows reduced), without its waits or entry barrier: what the
  fused kernel's work costs without its synchronisation.
* ``rs_fused`` / ``rs_ce_scatter`` / ``rs_ce_fused``: the ops as they run.

    python scripts/probe_epilogue.py [--world-size 2]
"""

from __future__ import annotations

import argparse

import torch
from _probe import print_table, run_on_world

import interlace
from interlace.bench.timing import graph_of, max_over_ranks, median_ms
from interlace.ops import _gemm
from interlace.ops._gemm import Segment

SHAPES = {"llama-7b": (8192, 4096, 11008), "llama3-8b": (8192, 4096, 14336)}
SHAPES["llama3-70b"] = (8192, 8192, 28672)


def _graph_ms(group, fn):
    graph = graph_of(group, fn)
    t = median_ms(group, graph.replay)
    del graph
    return t


def shape_row(group, m, n, inter):
    w, r, dev = group.world_size, group.rank, group.device
    k = inter // w
    torch.manual_seed(r)
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16) * 0.05
    c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    out = torch.empty(m // w, n, device=dev, dtype=torch.bfloat16)
    t = {"cublas": _graph_ms(group, lambda: torch.matmul(a, b, out=c))}
    base = _gemm.gemm_config(m, n, k)
    room = _gemm.with_epilogue_room(base)
    for name, cfg in (("plain", base), ("plain_room", room)):
        t[name] = _graph_ms(group, lambda cfg=cfg: _gemm.matmul(a, b, out=c, cfg=cfg))
    # the synthetic epilogues borrow a fused context's receive buffer and signals
    ctx = interlace.GemmRS(group, m, n, k, strategy="fused")
    m_loc = m // w
    peer = (r + 1) % w
    note = ctx.pad.offset("partial")

    def segs(kind, owner):
        return [
            Segment(row0=i * m_loc, rows=m_loc, kind=kind, owner=owner, out_row0=0, notify=note)
            for i in range(w)
        ]

    half = m_loc // 2
    layout = []
    for o in [(r + i) % w for i in range(1, w)] + [r]:
        for j in range(2):
            row0 = o * m_loc + j * half
            kind = "reduce" if o == r else "push"
            layout.append(
                Segment(row0=row0, rows=half, kind=kind, owner=o, out_row0=j * half, notify=note)
            )
    for name, kind, owner in (
        ("push_path_store", "store", r),
        ("reduce_only", "reduce", r),
        ("push_local", "push", r),
        ("push_peer", "push", peer),
        ("layout_nowait", None, None),
    ):
        s = segs(kind, owner) if kind else layout
        table = _gemm.segment_table(s, n, room, dev)
        grid = _gemm.programs_for(_gemm.total_tiles(s, n, room), dev, "cuda", single=True)
        run = _gemm.launcher(
            m, n, k, room, grid, table, len(s), dtype=a.dtype, device=dev,
            recv=ctx.recv.local, recv_table=ctx.recv.ptrs, recv_rows=m_loc,
            out_table=ctx.recv.ptrs, sig_table=ctx.pad.ptrs, sig=ctx.pad.buffer.local,
            err=ctx.error.address, rank=r, max_spins=ctx.max_spins, world=w, push=True,
        )  # fmt: skip
        dst = c if kind == "store" else out  # reduce / push: this rank's rows
        t[name] = _graph_ms(group, lambda run=run, dst=dst: run(a, b, dst))
    ctx.close()
    for strategy in ("fused", "ce_scatter", "ce_fused"):
        op = interlace.GemmRS(group, m, n, k, strategy=strategy)
        t["rs_" + strategy] = _graph_ms(group, lambda op=op: op(a, b, out=out))
        op.check()
        op.close()
    return max_over_ranks(group, t)


def body(group):
    return {name: shape_row(group, *shape) for name, shape in SHAPES.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", type=int, default=2)
    args = p.parse_args()
    rows = run_on_world(body, args.world_size)[0]
    print_table("GEMM+RS epilogue probe, graph replay ms (max over ranks), M 8192", rows)


if __name__ == "__main__":
    main()
