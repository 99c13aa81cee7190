"""``MoERS``'s Hopper reduce GEMM (``kernels/grouped_gemm_hopper.py``: persistent, a TMA
loader warp, two consumer warpgroups in ping-pong) run as a plain grouped GEMM (every row
live with weight 1, bf16 rows out, one rank) against ``torch._grouped_mm`` on one GPU, for
each ring depth of ``--stages``.

    python benchmarks/probes/gluon_grouped_gemm.py [--stages 4 5 6] [--half both] [--dense]

Prints, per TileLink MoE shape at TP 4 (8192 tokens, balanced routing: each expert's rows a
multiple of the kernel's 128-row tiles): the time (CUDA-graph replays, as ``bench moe``) of
``torch._grouped_mm`` and of the kernel, their ratio, and the relative error against
float32 and against ``torch._grouped_mm``. ``--half first``: ``[M k, H] x [E, H, 2 I / W]``
(rows already in expert order: a bound for the gather GEMM); ``second``: ``[M k, I / W] x
[E, I / W, H]`` (the reduce GEMM). ``--dense``: ``bench kernels``' per-rank GEMMs (one
expert, K and N tails included) against cuBLAS (``torch.mm``). Needs a Hopper GPU. (The
kernel was first written here, standalone: commit d215997, whose numbers are in
benchmarks/results/history/2026-11-29-h200-w1-gluon-grouped-gemm.txt.)
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

SHAPES = [  # (H, I, E, top-k): TileLink's MoE shapes
    (2048, 1536, 8, 2), (2048, 1536, 32, 2), (2048, 1536, 32, 5),
    (4096, 2048, 8, 2), (4096, 2048, 32, 2), (4096, 2048, 32, 5),
]  # fmt: skip
TOKENS, TP = 8192, 4


def tile_table(counts: list[int], block_m: int, device):
    """The reduce GEMM's tile table (``grouped_gemm.TILE_COLS`` columns: first row, expert,
    arrival positions, and the expert of row tile ``q``: the same here, in row order) and
    tile count, for expert row counts that are multiples of ``block_m`` (the routing pads
    each expert so)."""
    rows, start = [], 0
    for e, c in enumerate(counts):
        rows += [[r, e, 0, 0, e] for r in range(start, start + c, block_m)]
        start += c
    tiles = torch.tensor(rows, dtype=torch.int32, device=device)
    return tiles, torch.tensor([len(rows)], dtype=torch.int32, device=device)


class ReduceGemm:
    """``kernels.grouped_gemm_hopper``'s kernel as a plain grouped GEMM: every row live with
    weight 1, bf16 rows out, one rank (its completion counter on a scratch signal pad)."""

    def __init__(self, a, b, counts, stages):
        from interlace.ops._launch import host_descriptor
        from interlace.ops.moe import _gemm

        rows, self.k = a.shape
        self.e, _, self.n = b.shape
        dev = a.device
        self.tiles, self.count = tile_table(counts, 128, dev)
        self.entry = torch.arange(rows, dtype=torch.int32, device=dev)
        self.weight = torch.ones(rows, dtype=torch.float32, device=dev)
        self.row_of = torch.empty(rows, dtype=torch.int32, device=dev)
        self.c = torch.empty(rows, self.n, dtype=a.dtype, device=dev)
        self.sig = torch.zeros(8, dtype=torch.int32, device=dev)
        self.sig_table = torch.tensor([self.sig.data_ptr()], dtype=torch.int64, device=dev)
        bn, bk = _gemm.HOPPER_BLOCK_N, _gemm.HOPPER_BLOCK_K
        self.a_desc = host_descriptor(a, [128, bk])
        self.b_desc = host_descriptor(b.view(self.e * self.k, self.n), [bk, bn])
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.grid = (min(sms, self.tiles.shape[0] * self.n // bn),)
        self.stages, self.regs, self.kernel = stages, _gemm.HOPPER_REGS, _gemm.KH

    def __call__(self):
        self.kernel.moe_reduce_gemm_hopper_kernel[self.grid](
            self.a_desc, self.b_desc, self.c, self.row_of, self.tiles, self.count, self.entry,
            self.weight, self.k, self.n, self.sig, self.sig_table, 0, 0, 1, WORLD=1,
            STAGES=self.stages, CONSUMER_REGS=self.regs[0], LOADER_REGS=self.regs[1],
            num_warps=4,
        )  # fmt: skip
        return self.c


def _moe_cases(halves):
    """(label, rows, K, N, rows per expert) of TileLink's shapes at TP 4, balanced."""
    for half in halves:
        for h, i, e, topk in SHAPES:
            rows = TOKENS * topk
            k, n = (h, 2 * i // TP) if half == "first" else (i // TP, h)
            yield f"{half} H{h} I{i} E{e} k{topk}", rows, k, n, [rows // e] * e


def _dense_cases():
    """(label, M, K, N, [M]) of ``bench kernels``' per-rank GEMMs: AG+GEMM's ``[M, H] x
    [H, I / W]`` and GEMM+RS's ``[M, I / W] x [I / W, H]``, public models, W 2 / 4 / 8."""
    from interlace.bench.dense import MODELS

    for model, (hidden, inter) in MODELS.items():
        for w in (2, 4, 8):
            for m in (2048, 8192):
                yield f"ag {model} M{m} W{w}", m, hidden, inter // w, [m]
                yield f"rs {model} M{m} W{w}", m, inter // w, hidden, [m]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", nargs="*", type=int, default=[4, 5, 6])
    p.add_argument("--half", choices=["first", "second", "both"], default="both")
    p.add_argument("--dense", action="store_true",
                   help="bench kernels' per-rank GEMMs against cuBLAS instead")  # fmt: skip
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    from interlace.bench.moe import graph_ms  # CUDA-graph replays: no host time inside

    halves = ["first", "second"] if args.half == "both" else [args.half]
    cases = _dense_cases() if args.dense else _moe_cases(halves)
    ref_name = "cublas" if args.dense else "grouped_mm"
    dev = "cuda"
    print(f"{'case':<30} {'stages':<7}{ref_name:>11}{'gluon':>9}{'ratio':>7} {'rel err':>8}")
    for label, rows, k, n, counts in cases:
        e = len(counts)
        gen = torch.Generator(device=dev).manual_seed(0)
        a = torch.randn(rows, k, device=dev, generator=gen).to(torch.bfloat16)
        b = (torch.randn(e, k, n, device=dev, generator=gen) / k**0.5).to(torch.bfloat16)
        if args.dense:
            ref_fn = functools.partial(torch.mm, a, b[0])
        else:
            offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
            ref_fn = functools.partial(torch._grouped_mm, a, b, offs=offs)
        ref = ref_fn()
        t_ref = graph_ms(ref_fn, args.iters)
        r0 = min(counts[0], 1024)
        exact = a[:r0].float() @ b[0].float()
        for stages in args.stages:
            try:
                run = ReduceGemm(a, b, counts, stages)
                c = run()
                torch.cuda.synchronize()
                err = float((c[:r0].float() - exact).norm() / exact.norm())
                same = float((c.float() - ref.float()).norm() / ref.float().norm())
                t = graph_ms(run, args.iters)
            except Exception as exc:  # noqa: BLE001 - a config that fails is reported
                print(f"{label} {stages}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            print(f"{label:<30} {stages:<7}{t_ref:11.4f}{t:9.4f}{t_ref / t:7.3f} {err:8.1e} "
                  f"(vs {ref_name} {same:.1e})", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
