"""``AGMoE``'s gather GEMM written in Gluon on the schedule of ``MoERS``'s Hopper reduce GEMM
(``kernels/grouped_gemm_hopper.py``: persistent, two consumer warpgroups in ping-pong), with a
four-warp loader that gathers each tile's A rows itself (``cp.async``, 16 bytes a thread, the
tokens' rows picked through the routing: this rank's in place, the peers' from the gathered
buffer) beside TMA loads of the gate and up weight tiles, and SwiGLU in the epilogue.
Against the library's Triton gather GEMM and ``torch._grouped_mm`` on rows already sorted, on
``bench moe``'s per-rank problem (rank 0 of W, flags raised).

    python benchmarks/probes/gluon_gather_gemm.py [--stages 3 4] [--world 4]

Prints per TileLink shape and routing: ``torch._grouped_mm`` on sorted rows, the Triton
gather GEMM, this kernel (CUDA-graph replays), and this kernel's ``h`` against the Triton
kernel's. Needs a Hopper GPU. Compiled for sm_90a on the CPU; not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from interlace.kernels.grouped_gemm import (
    TILE_COLS,
    TILE_EXPERT,
    TILE_FIRST,
    TILE_LAST,
    TILE_ROW0,
)
from interlace.language.primitives import guard, wait_inline

LOADER_WARPS = gl.constexpr(4)


@gluon.jit
def _gather_loader(x_all, x_own, b_desc, a_smem, b_smem, full, empty, tiles, n_tiles, tiles_n,
                   sorted_entry, k_top, m_loc, rank, K, UP, sig, flag0, err, max_spins,
                   WAIT: gl.constexpr):  # fmt: skip
    """The loader (4 warps): per tile, its rows' token pointers (after the arrival flags of
    the positions it reads), then per K step the A rows by ``cp.async`` (each thread's
    copies tracked by the slot's mbarrier) and the gate / up weight tiles by TMA."""
    STAGES: gl.constexpr = a_smem.shape[0]
    BM: gl.constexpr = a_smem.shape[1]
    BK: gl.constexpr = a_smem.shape[2]
    BN: gl.constexpr = b_smem.shape[2]
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r = gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
    ks = gl.arange(0, BK, layout=gl.SliceLayout(0, ld))
    it = 0
    for g in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        info = tiles + (g // tiles_n) * TILE_COLS
        row0 = gl.load(info + TILE_ROW0)
        w_row = gl.load(info + TILE_EXPERT) * K
        col = (g % tiles_n) * BN
        ent = gl.load(sorted_entry + row0 + r)
        live = ent >= 0
        token = 1
        if WAIT:
            lo = gl.maximum(gl.load(info + TILE_FIRST), 1)
            hi = gl.load(info + TILE_LAST)
            needed = (hi >= lo).to(gl.int32)
            count = gl.maximum(hi - lo + 1, 1)
            token = wait_inline(sig + flag0 + lo, 1, needed, err, rank, flag0 + lo, max_spins,
                                count)  # fmt: skip
        ok = guard(live, token, 1)
        tok = gl.where(live, ent // k_top, 0)
        src = tok // m_loc
        own = src == rank
        base = gl.where(own, x_own + (tok - src * m_loc).to(gl.int64) * K,
                        x_all + tok.to(gl.int64) * K)  # fmt: skip
        ptrs = gl.expand_dims(base, 1) + gl.expand_dims(ks, 0)
        for kk in range(0, K, BK):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(full.index(s), 2 * b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(b_desc, [w_row + kk, col], full.index(s),
                                            b_smem.index(2 * s))  # fmt: skip
            tma.async_copy_global_to_shared(b_desc, [w_row + kk, UP + col], full.index(s),
                                            b_smem.index(2 * s + 1))  # fmt: skip
            mask = gl.expand_dims(ok, 1) & gl.expand_dims(kk + ks < K, 0)
            async_copy.async_copy_global_to_shared(a_smem.index(s), ptrs + kk, mask=mask)
            async_copy.mbarrier_arrive(full.index(s), increment_count=False)
            it += 1


@gluon.jit
def _gather_consumer(wg: gl.constexpr, out, a_smem, b_smem, full, empty, turn, tiles, n_tiles,
                     tiles_n, K, N):  # fmt: skip
    """Warpgroup ``wg``: alternate tiles, each main loop (gate and up products) in its turn;
    the epilogue ``silu(gate) * up`` stored while the other warpgroup's products run."""
    STAGES: gl.constexpr = a_smem.shape[0]
    BM: gl.constexpr = a_smem.shape[1]
    BK: gl.constexpr = a_smem.shape[2]
    BN: gl.constexpr = b_smem.shape[2]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
    )
    other: gl.constexpr = 1 - wg
    kt = gl.cdiv(K, BK)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_mine = gl.cdiv(n_tiles - pid, nprog)
    r = gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
    c = gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
    turns = 0
    for i in range(wg, n_mine, 2):
        g = pid + i * nprog
        row0 = gl.load(tiles + (g // tiles_n) * TILE_COLS + TILE_ROW0)
        col = (g % tiles_n) * BN
        mbarrier.wait(turn.index(wg), turns & 1)
        turns += 1
        acc_g = gl.zeros([BM, BN], gl.float32, acc_layout)
        acc_u = gl.zeros([BM, BN], gl.float32, acc_layout)
        prev = 0
        for kk in range(kt):
            it = i * kt + kk
            s = it % STAGES
            mbarrier.wait(full.index(s), (it // STAGES) & 1)
            fence_async_shared()  # the rows came by cp.async (generic proxy): wgmma reads
            acc_g = warpgroup_mma(a_smem.index(s), b_smem.index(2 * s), acc_g, is_async=True)
            acc_u = warpgroup_mma(a_smem.index(s), b_smem.index(2 * s + 1), acc_u,
                                  is_async=True)  # fmt: skip
            acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=[acc_g, acc_u])
            if kk > 0:
                mbarrier.arrive(empty.index(prev))
            prev = s
        acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=[acc_g, acc_u])
        mbarrier.arrive(empty.index(prev))
        mbarrier.arrive(turn.index(other))
        h = acc_g / (1.0 + gl.exp(-acc_g)) * acc_u
        rows = row0 + r
        cols = col + c
        dst = out + gl.expand_dims(rows.to(gl.int64) * N, 1) + gl.expand_dims(cols, 0)
        gl.store(dst, h.to(out.dtype.element_ty), mask=gl.expand_dims(cols < N, 0))


@gluon.jit
def _gather_consumer_1(out, a_smem, b_smem, full, empty, turn, tiles, n_tiles, tiles_n, K, N):
    _gather_consumer(1, out, a_smem, b_smem, full, empty, turn, tiles, n_tiles, tiles_n, K, N)


@gluon.jit
def gather_gemm_hopper_kernel(
    x_all, x_own, b_desc, out, tiles, tile_count, sorted_entry, k_top, m_loc, rank, K, N, UP,
    sig, flag0, err, max_spins,
    BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, WAIT: gl.constexpr,
):  # fmt: skip
    """``out[rows] = silu(x[tok] @ w[e][:, gate]) * (x[tok] @ w[e][:, up])`` over the routing's
    tile table; ``b_desc``: the weights ``[E * K, 2 I]`` in blocks of ``[BK, BN]``."""
    BN: gl.constexpr = b_desc.block_type.shape[1]
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    tiles_n = gl.cdiv(N, BN)
    n_tiles = gl.load(tile_count) * tiles_n
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], a_layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [2 * STAGES, BK, BN], b_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        # the TMA's expect (one arrival) and every loader thread's cp.async arrival
        mbarrier.init(full.index(s), count=1 + 32 * LOADER_WARPS)
        mbarrier.init(empty.index(s), count=1)
    for w in gl.static_range(2):
        mbarrier.init(turn.index(w), count=1)
    mbarrier.arrive(turn.index(0))
    gl.warp_specialize(
        [
            (_gather_consumer, (0, out, a_smem, b_smem, full, empty, turn, tiles, n_tiles,
                                tiles_n, K, N)),
            (_gather_consumer_1, (out, a_smem, b_smem, full, empty, turn, tiles, n_tiles,
                                  tiles_n, K, N)),
            (_gather_loader, (x_all, x_own, b_desc, a_smem, b_smem, full, empty, tiles,
                              n_tiles, tiles_n, sorted_entry, k_top, m_loc, rank, K, UP, sig,
                              flag0, err, max_spins, WAIT)),
        ],
        [4, LOADER_WARPS],
        [232, 80],
    )  # fmt: skip


def _gluon_launch(pb, rt, b_desc, h, stages, grid):
    """A closure launching the kernel on ``pb``'s per-rank problem, routing ``rt``."""

    def run():
        gather_gemm_hopper_kernel[(grid,)](
            pb.x, pb.x[: pb.m], b_desc, h, rt.tiles, rt.tile_count, rt.entry_ids, rt.topk,
            rt.m_loc, 0, pb.hidden, pb.i_loc, pb.i_loc, pb.sig, 0, pb.err.data_ptr(), 1 << 20,
            BM=128, BK=b_desc.block_shape[0], STAGES=stages, WAIT=pb.world > 1, num_warps=4,
        )  # fmt: skip

    return run


def _case(pb, label, stages_list, iters) -> None:
    """Times ``torch._grouped_mm`` (from ``pb``), the Triton gather GEMM and the kernel."""
    from interlace.bench.moe import graph_ms
    from interlace.ops._launch import host_descriptor
    from interlace.ops.moe import _gemm

    cfg = _gemm.GPU_CONFIGS["gather"]
    dev = pb.dev
    rt, _ = pb.routing(cfg)
    i_loc = pb.i_loc
    h_tri = torch.empty(rt.rows, i_loc, dtype=torch.bfloat16, device=dev)
    run = dict(
        w=pb.w1, out=h_tri, routing=rt, n=i_loc, up=i_loc, cfg=cfg,
        grid=_gemm.programs(rt, i_loc, cfg, dev, "cuda"), swiglu=True, reduce=False, rank=0,
        err=pb.err.data_ptr(), world=pb.world, a=pb.x, x_own=pb.x[: pb.m], gather=True,
        sig=pb.sig, flag0=0, max_spins=1 << 20, wait=pb.world > 1,
    )  # fmt: skip
    triton_gemm = functools.partial(_gemm.launch_gemm, **run)
    triton_gemm()
    t_tri = graph_ms(triton_gemm, iters)
    bn = bk = 64
    b_desc = host_descriptor(pb.w1.view(pb.experts * pb.hidden, 2 * i_loc), [bk, bn])
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    grid = min(sms, rt.tiles.shape[0] * -(-i_loc // bn))
    used = int(rt.tile_count[0]) * 128
    ref = h_tri[:used].float()
    for stages in stages_list:
        h = torch.empty_like(h_tri)
        gluon_gemm = _gluon_launch(pb, rt, b_desc, h, stages, grid)
        try:
            gluon_gemm()
            torch.cuda.synchronize()
            diff = float((h[:used].float() - ref).norm() / ref.norm())
            t = graph_ms(gluon_gemm, iters)
        except Exception as exc:  # noqa: BLE001 - a config that fails is reported
            print(f"{label} {stages}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        print(f"{label:<34}{pb.t_gmm1:11.4f}{t_tri:9.4f} {stages:>6}{t:9.4f}"
              f"{pb.t_gmm1 / t:7.3f}{t_tri / t:9.3f} {diff:9.1e}", flush=True)  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", nargs="*", type=int, default=[3, 4])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    from interlace.bench.moe import SHAPES, _Problem

    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(0)
    print(f"{'case':<34}{'grouped_mm':>11}{'triton':>9} {'stages':>6}{'gluon':>9}"
          f"{'x gmm':>7}{'x triton':>9} {'rel diff':>9}")  # fmt: skip
    for hidden, inter, experts, k in SHAPES:
        for kind in ("balanced", "zipf"):
            pb = _Problem(hidden, inter, experts, k, args.world, kind, gen, dev, args.iters)
            _case(pb, f"H{hidden} I{inter} E{experts} k{k} {kind}", args.stages, args.iters)
            del pb
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
