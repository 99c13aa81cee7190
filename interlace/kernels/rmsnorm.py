"""Row kernels that read a tile-reordered buffer (``kernels.signal_gemm``) back into
normal row-major layout: RMSNorm fused with the reorder, and the plain un-reorder.

One program per output row. The row is read as ``[NT, TILE_N]`` blocks, one per column
tile: with ``REORDER`` block ``t`` of output row ``row`` sits in sub-tile slot
``slots[blk, t]`` at row ``r_in`` (slots are ``SUB_M x TILE_N`` row-major), where, with
``j = row // rows_per_src`` (the source: all-to-all receives one set of tiles per rank)
and ``l = row % rows_per_src``, ``blk = j * tiles_m + l // SUB_M`` and ``r_in = l % SUB_M``.
Without ``REORDER`` the input is row-major ``[rows, N]``, so the same kernel is the plain
RMSNorm the fused one is measured against.

``HAS_NORM``: ``y = x * rsqrt(mean(x^2) + eps) * weight`` in fp32; otherwise a copy.
``ONE_PASS`` (the whole row fits in one ``[NT, TILE_N]`` block) keeps the row in registers;
otherwise a first pass sums the squares and a second writes.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row_block(
    src, slot_row, row, r_in, t0, N, tiles_n,
    SUB_M: tl.constexpr, TILE_N: tl.constexpr, NT: tl.constexpr, REORDER: tl.constexpr,
):  # fmt: skip
    """Input pointers, output offsets and mask of column tiles ``t0 .. t0 + NT``."""
    t = t0 + tl.arange(0, NT)
    c = tl.arange(0, TILE_N)
    cols = t[:, None] * TILE_N + c[None, :]
    mask = (t < tiles_n)[:, None] & (cols < N)
    if REORDER:
        slot = tl.load(slot_row + t, mask=t < tiles_n, other=0).to(tl.int64)
        offs = (slot * SUB_M + r_in) * TILE_N
        ptrs = src + offs[:, None] + c[None, :]
    else:
        ptrs = src + row * N + cols
    return ptrs, row * N + cols, cols, mask


@triton.jit
def reorder_rows_kernel(
    src, slots, out, weight, N, rows_per_src, tiles_m, tiles_n, eps,
    SUB_M: tl.constexpr, TILE_N: tl.constexpr, NT: tl.constexpr,
    REORDER: tl.constexpr, HAS_NORM: tl.constexpr, ONE_PASS: tl.constexpr,
):  # fmt: skip
    """See the module docstring: output row ``program_id(0)`` of ``out [rows, N]``."""
    row = tl.program_id(0).to(tl.int64)
    slot_row = slots
    r_in = row
    if REORDER:
        j = row // rows_per_src
        local = row % rows_per_src
        slot_row = slots + (j * tiles_m + local // SUB_M) * tiles_n
        r_in = local % SUB_M
    out_ty = out.dtype.element_ty
    if ONE_PASS:
        ptrs, o, cols, mask = _row_block(
            src, slot_row, row, r_in, 0, N, tiles_n, SUB_M, TILE_N, NT, REORDER
        )
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            rstd = tl.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / N + eps)
            w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
            x = x * rstd * w
        tl.store(out + o, x.to(out_ty), mask=mask)
    else:
        rstd = 1.0
        if HAS_NORM:
            acc = tl.zeros((NT, TILE_N), dtype=tl.float32)
            for t0 in range(0, tiles_n, NT):
                ptrs, o, cols, mask = _row_block(
                    src, slot_row, row, r_in, t0, N, tiles_n, SUB_M, TILE_N, NT, REORDER
                )
                x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
                acc += x * x
            rstd = tl.rsqrt(tl.sum(tl.sum(acc, axis=1), axis=0) / N + eps)
        for t0 in range(0, tiles_n, NT):
            ptrs, o, cols, mask = _row_block(
                src, slot_row, row, r_in, t0, N, tiles_n, SUB_M, TILE_N, NT, REORDER
            )
            x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            if HAS_NORM:
                w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
                x = x * rstd * w
            tl.store(out + o, x.to(out_ty), mask=mask)
