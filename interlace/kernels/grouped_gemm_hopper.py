"""``MoERS``'s reduce GEMM on Hopper, in Gluon (stock Triton's ``triton.experimental.gluon``):
``grouped_gemm.moe_gemm_kernel`` in reduce mode (same tile table, rows, map and completion
counter) with its warps specialised.

One program per SM, persistent over the tiles (tile ``g``: row tile ``g // tiles_n`` in row
order, as the Triton kernel's reduce mode runs them, its expert from the tile table's
``TILE_ROW_EXPERT`` column; column tile ``g % tiles_n``), in three partitions:

* a one-warp **loader**: for each of the program's tiles, the K steps of A (the
  expert-sorted ``h``) and of the expert's weight block by TMA into a ring of ``STAGES``
  slots (an mbarrier per slot fills, another empties when its product is done);
* two **consumer warpgroups** taking the program's tiles alternately (CUTLASS's
  "ping-pong"): a pair of mbarriers gives one warpgroup's main loop the tensor cores while
  the other runs its epilogue, so a tile's epilogue (the weighted rows' stores, the row
  map) runs under the next tile's products. The epilogue converts the tile to a
  row-major layout (through shared memory) and stores it in 16-byte stores; the
  accumulator's own layout would store 4 or 8 bytes at a time.

After the partitions join, the last program of the launch raises every owner's
contribution counter (``grouped_gemm.publish_rows``), as the Triton kernel does. A's rows
beyond the expert's rows are padding rows (weight 0: stored as zeros). The GPU path of
``ops.moe._gemm.launch_gemm`` in reduce mode where ``hopper_reduce`` holds (K and N
multiples of the blocks).

On one H200, as ``MoERS``'s GEMM with bf16 rows, it ran TileLink's reduce shapes at 1.11 x
``torch._grouped_mm`` (TP 4) and 1.07 x (TP 8), geomean of 12 each (``bench moe``'s
``t_kernel_ms`` in benchmarks/results/2026-11-29-h200-w1.json).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .grouped_gemm import TILE_COLS, TILE_ROW_EXPERT, publish_rows


@gluon.jit
def _loader(a_desc, b_desc, a_smem, b_smem, full, empty, tiles, n_tiles, tiles_n, K):
    """The TMA partition: the program's tiles in order, K step by K step."""
    STAGES: gl.constexpr = a_smem.shape[0]
    BK: gl.constexpr = a_smem.shape[2]
    BN: gl.constexpr = b_smem.shape[2]
    BM: gl.constexpr = a_smem.shape[1]
    it = 0
    for g in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        q = g // tiles_n  # row tiles in row order: each expert's weights read once
        row0 = q * BM
        w_row = gl.load(tiles + q * TILE_COLS + TILE_ROW_EXPERT) * K
        col = (g % tiles_n) * BN
        for kk in range(0, K, BK):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # fresh: passes
            mbarrier.expect(full.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [row0, kk], full.index(s), a_smem.index(s))
            tma.async_copy_global_to_shared(b_desc, [w_row + kk, col], full.index(s),
                                            b_smem.index(s))  # fmt: skip
            it += 1


@gluon.jit
def _consumer(wg: gl.constexpr, rows_out, row_of, sorted_entry, sorted_w, a_smem, b_smem,
              full, empty, turn, n_tiles, tiles_n, K, N):  # fmt: skip
    """Warpgroup ``wg``: the program's tiles ``wg, wg + 2, ...``, each main loop in its
    turn; the epilogue multiplies each row by its routing weight, stores the tile into
    ``rows_out`` in ``h``'s row order and (first column tile) each entry's row into
    ``row_of``."""
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
    VEC: gl.constexpr = 128 // rows_out.dtype.element_ty.primitive_bitwidth
    out_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // BN, BN // VEC], [4, 1],
                                                [1, 0])  # fmt: skip
    r = gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
    r_o = gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))
    c_o = gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
    turns = 0
    for i in range(wg, n_mine, 2):
        g = pid + i * nprog
        row0 = (g // tiles_n) * BM
        col = (g % tiles_n) * BN
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
        mbarrier.arrive(turn.index(other))  # the tensor cores to the other warpgroup
        rows = row0 + r
        ent = gl.load(sorted_entry + rows)
        live = ent >= 0
        wgt = gl.load(sorted_w + rows, mask=live, other=0.0)
        val = (acc * gl.expand_dims(wgt, 1)).to(rows_out.dtype.element_ty)
        # stored from a row-major layout, 16 bytes per thread and access (the accumulator's
        # layout gives each thread pairs of columns: 4- or 8-byte stores)
        val = gl.convert_layout(val, out_layout)
        rows_o = row0 + r_o
        cols = col + c_o
        dst = rows_out + gl.expand_dims(rows_o.to(gl.int64) * N, 1) + gl.expand_dims(cols, 0)
        gl.store(dst, val, mask=gl.expand_dims(cols < N, 0))
        gl.store(row_of + ent, rows, mask=live & (col == 0))


@gluon.jit
def _consumer_1(rows_out, row_of, sorted_entry, sorted_w, a_smem, b_smem, full, empty, turn,
                n_tiles, tiles_n, K, N):  # fmt: skip
    """Warpgroup 1 (a worker partition: its index cannot come as an argument)."""
    _consumer(1, rows_out, row_of, sorted_entry, sorted_w, a_smem, b_smem, full, empty, turn,
              n_tiles, tiles_n, K, N)  # fmt: skip


@gluon.jit
def moe_reduce_gemm_hopper_kernel(
    a_desc, b_desc, rows_out, row_of, tiles, tile_count, sorted_entry, sorted_w, K, N, sig,
    sig_table, rank, done_slot, contrib_slot,
    WORLD: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
):  # fmt: skip
    """``a_desc``: ``h [rows, K]`` in blocks of ``[128, BK]`` (128: the routing's row
    padding); ``b_desc``: the weights ``[E * K, N]`` in blocks of ``[BK, BN]``;
    ``rows_out [rows, N]`` and ``row_of``: as ``moe_gemm_kernel``'s. A persistent grid
    (at most one program per SM), launched with 4 warps (consumer 0)."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    tiles_n = gl.cdiv(N, BN)
    n_tiles = gl.load(tile_count) * tiles_n
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
    mbarrier.arrive(turn.index(0))  # warpgroup 0 takes the first turn
    # the partitions' arguments as tuple literals (a tuple assigned to a name first would
    # turn its compile-time constants into values)
    gl.warp_specialize(
        [
            (_consumer, (0, rows_out, row_of, sorted_entry, sorted_w, a_smem, b_smem, full,
                         empty, turn, n_tiles, tiles_n, K, N)),
            (_consumer_1, (rows_out, row_of, sorted_entry, sorted_w, a_smem, b_smem, full,
                           empty, turn, n_tiles, tiles_n, K, N)),
            (_loader, (a_desc, b_desc, a_smem, b_smem, full, empty, tiles, n_tiles, tiles_n,
                       K)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )  # fmt: skip
    publish_rows(sig, sig_table, done_slot, contrib_slot, rank, 0, WORLD)
