"""A persistent, warp-specialised grouped GEMM written in Gluon (stock Triton's
``triton.experimental.gluon``) against ``torch._grouped_mm`` and the library's MoE grouped
GEMM on one GPU: the schedule the MoE kernels lack.

Why: ``MoERS``'s reduce GEMM runs at ~0.69 x ``torch._grouped_mm`` on an H200 and
``AGMoE``'s gather GEMM at ~0.78 x (``benchmarks/NOTES.md``, 2026-11-29): with K = I / W
(384 or 512) a tile's main loop is six to eight K steps, and the Triton kernel's epilogue
(the store of a 128 x 128 tile) does not overlap the next tile's loads and products. The
attention forward met cuDNN once written this way (``kernels/attention_hopper.py``).

Schedule (CUTLASS's "ping-pong"): one program per SM; a one-warp TMA loader walks the
program's tiles (A rows of one expert, B that expert's weights) through a ring of
``STAGES`` slots; two consumer warpgroups take alternate tiles, a pair of mbarriers giving
one warpgroup's main loop the tensor cores while the other stores its finished tile. A
tile's rows beyond its expert's end are computed on the next expert's rows and not stored.

    python benchmarks/probes/gluon_grouped_gemm.py [--configs 128,128,64,4] [--half both]

Prints, per TileLink MoE shape at TP 4 (8192 tokens, balanced routing): the time (CUDA-graph
replays, as ``bench moe``) of ``torch._grouped_mm``, of each Gluon config (block_m, block_n, block_k, stages) and their
ratio, with the relative error against float32. ``--half first``: ``[M k, H] x [E, H, 2 I /
W]`` (rows already in expert order: the gather GEMM's bound); ``second``: ``[M k, I / W] x
[E, I / W, H]`` (the reduce GEMM). Needs a Hopper GPU.
"""

from __future__ import annotations

import argparse
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

SHAPES = [  # (H, I, E, top-k): TileLink's MoE shapes
    (2048, 1536, 8, 2), (2048, 1536, 32, 2), (2048, 1536, 32, 5),
    (4096, 2048, 8, 2), (4096, 2048, 32, 2), (4096, 2048, 32, 5),
]  # fmt: skip
TOKENS, TP = 8192, 4


@gluon.jit
def _gg_loader(a_desc, b_desc, a_smem, b_smem, full, empty, tile_e, tile_row, n_tiles, n_n,
               K):  # fmt: skip
    """The TMA partition: every tile of this program in order, K step by K step."""
    STAGES: gl.constexpr = a_smem.shape[0]
    BK: gl.constexpr = a_smem.shape[2]
    BN: gl.constexpr = b_smem.shape[2]
    it = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        m_t = t // n_n
        n0 = (t % n_n) * BN
        e = gl.load(tile_e + m_t)
        row = gl.load(tile_row + m_t)
        for k in range(0, K, BK):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(full.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [row, k], full.index(s), a_smem.index(s))
            tma.async_copy_global_to_shared(b_desc, [e * K + k, n0], full.index(s),
                                            b_smem.index(s))  # fmt: skip
            it += 1


@gluon.jit
def _gg_consumer(wg: gl.constexpr, c_ptr, a_smem, b_smem, full, empty, turn, tile_row,
                 tile_end, n_tiles, n_n, K, N):  # fmt: skip
    """Warpgroup ``wg``: the program's tiles ``wg, wg + 2, ...``; each main loop in its turn,
    the epilogue (a masked store of the rows inside the expert) outside it."""
    STAGES: gl.constexpr = a_smem.shape[0]
    BM: gl.constexpr = a_smem.shape[1]
    BK: gl.constexpr = a_smem.shape[2]
    BN: gl.constexpr = b_smem.shape[2]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
    )
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    other: gl.constexpr = 1 - wg
    kt = K // BK
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_mine = (n_tiles - pid + nprog - 1) // nprog
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
    turns = 0
    for i in range(wg, n_mine, 2):
        t = pid + i * nprog
        m_t = t // n_n
        n0 = (t % n_n) * BN
        row = gl.load(tile_row + m_t)
        end = gl.load(tile_end + m_t)
        mbarrier.wait(turn.index(wg), turns & 1)
        turns += 1
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        prev = 0
        for kk in range(kt):
            it = i * kt + kk
            s = it % STAGES
            mbarrier.wait(full.index(s), (it // STAGES) & 1)
            acc = warpgroup_mma(a_smem.index(s), b_smem.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
            if kk > 0:  # the product that read the previous slot is done
                mbarrier.arrive(empty.index(prev))
            prev = s
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(empty.index(prev))
        mbarrier.arrive(turn.index(other))
        out = gl.convert_layout(acc.to(c_ptr.dtype.element_ty), out_layout)
        r = row + rows
        ptrs = c_ptr + gl.expand_dims(r.to(gl.int64) * N, 1) + gl.expand_dims(n0 + cols, 0)
        gl.store(ptrs, out, mask=gl.expand_dims(r < end, 1))


@gluon.jit
def _gg_consumer_1(c_ptr, a_smem, b_smem, full, empty, turn, tile_row, tile_end, n_tiles, n_n,
                   K, N):  # fmt: skip
    _gg_consumer(1, c_ptr, a_smem, b_smem, full, empty, turn, tile_row, tile_end, n_tiles, n_n,
                 K, N)  # fmt: skip


@gluon.jit
def gluon_grouped_gemm_kernel(a_desc, b_desc, c_ptr, tile_e, tile_row, tile_end, n_tiles, n_n,
                              K, N, STAGES: gl.constexpr):  # fmt: skip
    """``c[rows of e] = a[rows of e] @ b[e]`` over a tile table (tile -> expert, first row,
    the expert's end row); a persistent grid, 4 warps launched (consumer 0)."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BK, BN], b_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for w in gl.static_range(2):
        mbarrier.init(turn.index(w), count=1)
    mbarrier.arrive(turn.index(0))
    gl.warp_specialize(
        [
            (_gg_consumer, (0, c_ptr, a_smem, b_smem, full, empty, turn, tile_row, tile_end,
                            n_tiles, n_n, K, N)),
            (_gg_consumer_1, (c_ptr, a_smem, b_smem, full, empty, turn, tile_row, tile_end,
                              n_tiles, n_n, K, N)),
            (_gg_loader, (a_desc, b_desc, a_smem, b_smem, full, empty, tile_e, tile_row,
                          n_tiles, n_n, K)),
        ],
        [4, 1],
        [232, 40],
    )  # fmt: skip


def tile_table(counts: list[int], block_m: int, device):
    """Per row tile: its expert, first row and the expert's end row (int32)."""
    e_of, row_of, end_of, start = [], [], [], 0
    for e, c in enumerate(counts):
        for r in range(start, start + c, block_m):
            e_of.append(e), row_of.append(r), end_of.append(start + c)
        start += c
    as_t = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    return as_t(e_of), as_t(row_of), as_t(end_of)


def grouped_gemm(a, b, counts, block_m=128, block_n=128, block_k=64, stages=4, table=None):
    """``a [rows, K]`` (rows in expert order, ``counts`` per expert) times ``b [E, K, N]``."""
    rows, k = a.shape
    e, _, n = b.shape
    c = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    t_e, t_row, t_end = table or tile_table(counts, block_m, a.device)
    la = gl.NVMMASharedLayout.get_default_for([block_m, block_k], gl.bfloat16)
    lb = gl.NVMMASharedLayout.get_default_for([block_k, block_n], gl.bfloat16)
    b2 = b.view(e * k, n)
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [block_m, block_k], la)
    b_desc = TensorDescriptor(b2, list(b2.shape), list(b2.stride()), [block_k, block_n], lb)
    n_n = n // block_n
    n_tiles = t_e.numel() * n_n
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    gluon_grouped_gemm_kernel[(min(sms, n_tiles),)](
        a_desc, b_desc, c, t_e, t_row, t_end, n_tiles, n_n, k, n, STAGES=stages, num_warps=4
    )
    return c


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="*", default=["128,128,64,4", "128,128,64,5"],
                   help="block_m,block_n,block_k,stages")  # fmt: skip
    p.add_argument("--half", choices=["first", "second", "both"], default="both")
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    from interlace.bench.moe import graph_ms  # CUDA-graph replays: no host time inside

    halves = ["first", "second"] if args.half == "both" else [args.half]
    dev = "cuda"
    print(f"{'half':<7}{'H':>5}{'I':>5}{'E':>4}{'k':>3} {'config':<16}{'grouped_mm':>11}"
          f"{'gluon':>9}{'ratio':>7} {'rel err':>8}")  # fmt: skip
    for half in halves:
        for h, i, e, topk in SHAPES:
            rows = TOKENS * topk
            counts = [rows // e] * e  # balanced
            k, n = (h, 2 * i // TP) if half == "first" else (i // TP, h)
            gen = torch.Generator(device=dev).manual_seed(0)
            a = torch.randn(rows, k, device=dev, generator=gen).to(torch.bfloat16)
            b = (torch.randn(e, k, n, device=dev, generator=gen) / k**0.5).to(torch.bfloat16)
            offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
            ref = torch._grouped_mm(a, b, offs=offs)
            t_ref = graph_ms(lambda: torch._grouped_mm(a, b, offs=offs), args.iters)
            r0 = counts[0]
            exact = a[:r0].float() @ b[0].float()
            for text in args.configs:
                bm, bn, bk, st = (int(x) for x in text.split(","))
                try:
                    table = tile_table(counts, bm, dev)
                    run = lambda: grouped_gemm(a, b, counts, bm, bn, bk, st, table)  # noqa: E731
                    c = run()
                    torch.cuda.synchronize()
                    err = float((c[:r0].float() - exact).norm() / exact.norm())
                    same = float((c.float() - ref.float()).norm() / ref.float().norm())
                    t = graph_ms(run, args.iters)
                except Exception as exc:  # noqa: BLE001 - a config that fails is reported
                    print(f"{half} {h} {i} {e} {topk} {text}: {type(exc).__name__}: "
                          f"{str(exc)[:300]}", flush=True)  # fmt: skip
                    continue
                print(f"{half:<7}{h:>5}{i:>5}{e:>4}{topk:>3} {text:<16}{t_ref:11.4f}{t:9.4f}"
                      f"{t_ref / t:7.3f} {err:8.1e} (vs grouped_mm {same:.1e})",
                      flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
