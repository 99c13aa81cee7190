"""Signalling GEMM for the ``signal_reorder`` strategy (FlashOverlap's design).

A persistent GEMM ``A @ B`` whose epilogue writes each finished tile into a *reordered*
buffer, where the tiles of each wave group are contiguous, and then release-adds one to the
counter of the tile's group. A comm stream waits on each counter and hands exactly that
contiguous slice to a stock collective, so any ``torch.distributed`` backend can move it.

Tile order: program ``pid`` of ``P`` computes the tiles ``g = pid, pid + P, ...`` of one
visit numbering; tile ``g`` has the grouped (L2-friendly) coordinates of
``kernels.gemm._tile_coords``, so wave ``w`` is the tiles ``[w * P, (w + 1) * P)``.
Where a tile goes and which counter it raises come from ``tile_map`` (int32, one row of
``MAP_COLS`` per visit index, built on the host from the same order).

Two layouts (``STRIPS``):

* ``STRIPS == 1`` (all-reduce): unit = tile. Tile rows are C's rows
  ``pid_m * BLOCK_M + [0, BLOCK_M)``; the whole ``[BLOCK_M, BLOCK_N]`` tile is stored at
  sub-tile slot ``MAP_SLOT`` (slots are ``BLOCK_M * BLOCK_N`` elements, row-major).
* ``STRIPS > 1`` (reduce-scatter, all-to-all): unit = sub-tile. C's rows are cut into
  ``world`` equal shares of ``rows_per_rank``; a tile is ``STRIPS`` strips of
  ``SUB_M = BLOCK_M // STRIPS`` rows, strip ``k`` taken from share ``k`` (rows
  ``k * rows_per_rank + pid_m * SUB_M + [0, SUB_M)``). Strip ``k`` is stored at slot
  ``MAP_SLOT + k * MAP_STRIDE`` (slots of ``SUB_M * BLOCK_N`` elements): the host lays
  out each group as ``[world, tiles of the group]`` sub-tiles, so the group's slice splits
  into ``world`` equal pools, pool ``k`` holding rows of share ``k`` only, as
  ``reduce_scatter_tensor`` and ``all_to_all_single`` want. ``STRIPS`` is the world size
  rounded up to a power of two; strips ``k >= world`` hold no rows and are not stored.

The all-reduce layout stores each tile by TMA and counts it per warp one tile later
(``count_tile``: each warp waits for its bulk stores, then adds 1), which keeps the loop
pipelined without a CTA barrier; the strip layouts use plain stores, each thread
releasing its own. Measured on one H200 at TP 4 shapes, the TMA path took 2-3 % off the
GEMM (7B M 8192 0.313 -> 0.307 ms,
``benchmarks/results/history/2026-11-24-h200-w1-signal-gemm-tma-store.txt``); what remains
against cuBLAS (0.265) is mostly its grid: it leaves ``comm_sms`` SMs to the collectives,
and with fewer programs the tiles take another wave. The plain-store GEMM is 10-28 %
slower than cuBLAS, with its signals and without them alike
(``history/2026-11-22-h200-w2-signal-gemm-probe.txt``, 2 x H200). ``python -m interlace
bench kernels`` times it against cuBLAS. Padding rows and columns of a tile hold zeros
(or the bias) and are stored too: the collectives treat them like any element and the
un-reorder never reads them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..language.primitives import count_tile, rounded
from ..language.trace import (
    EV_END,
    EV_NOTIFY,
    EV_START,
    EV_TILE_END,
    trace_event,
)  # fmt: skip
from .gemm import _add_bias, _dot, _load_a, _load_b, _mma, _store_tile, _tile_coords

# tile_map columns (one row per visit index g).
MAP_SLOT = tl.constexpr(0)  # sub-tile slot of strip 0 (the whole tile when STRIPS == 1)
MAP_STRIDE = tl.constexpr(1)  # slots between strip k and strip k + 1
MAP_GROUP = tl.constexpr(2)  # counter the tile raises
MAP_COLS = tl.constexpr(3)


@triton.jit
def _mma_strips(
    a, b, b_desc, pid_m, col, rows_per_rank, world, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STRIPS: tl.constexpr, USE_TMA: tl.constexpr,
):  # fmt: skip
    """fp32 accumulator of a strip tile: strip ``k`` is rows
    ``k * rows_per_rank + pid_m * SUB_M + [0, SUB_M)`` of A (zeros past the share's end).

    A's rows are gathered with plain loads (``cp.async`` into shared memory), B comes by
    TMA when ``USE_TMA``: both operands then feed the wgmma from shared memory, pipelined.
    (A 3-D TMA box of the strips needs a reshape that moves A through registers and
    serialises the wgmmas.)"""
    SUB_M: tl.constexpr = BLOCK_M // STRIPS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    r = tl.arange(0, BLOCK_M)
    strip = r // SUB_M
    local = pid_m * SUB_M + r % SUB_M
    rows = strip * rows_per_rank + local
    row_ok = (strip < world) & (local < rows_per_rank)
    cols = col + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    for kk in range(k_tiles):
        a_t = _load_a(a, rows, row_ok, kk * BLOCK_K + ks, K)
        if USE_TMA:
            b_t = b_desc.load([kk * BLOCK_K, col])
        else:
            b_t = _load_b(b, cols, kk * BLOCK_K + ks, N, K)
        acc = _dot(a_t, b_t, acc)
    return acc


@triton.jit
def trace_count(TRACE: tl.constexpr, tbuf, g, group, counted):
    """``language.trace.trace_event``'s notify of tile ``g`` (its group's counter raised)
    where ``counted`` is not 0. Compiles to nothing unless ``TRACE``."""
    if TRACE:
        if counted != 0:
            trace_event(TRACE, tbuf, EV_NOTIFY, g, group, 0)


@triton.jit
def signal_gemm_kernel(
    a, b, buf, bias, M, N, K, rows_per_rank, world,
    tile_map, n_tiles, counters,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, STRIPS: tl.constexpr, USE_TMA: tl.constexpr,
    HAS_BIAS: tl.constexpr, LANES: tl.constexpr, SIGNAL: tl.constexpr,
    TMA_STORE: tl.constexpr = False, SUBTILE: tl.constexpr = False,
    TRACE: tl.constexpr = False, tbuf=None,
):  # fmt: skip
    """See the module docstring. ``a [M, K]``, ``b [K, N]``, ``buf`` the reordered output
    (flat), ``counters`` int32, one per wave group; ``LANES``: what one finished tile adds
    to its group's counter. ``SIGNAL=False`` leaves the counters alone
    (what the signals cost).

    ``TMA_STORE`` (all-reduce layout, ``STRIPS == 1``): each tile goes into its slot by a
    TMA store (in halves with ``SUBTILE``) and is counted by ``count_tile`` (each warp adds
    1 once the stores have landed: ``LANES`` = ``num_warps``): after the next tile's main
    loop where that tile is of the same group, else (the program's last tile of its group)
    right after its stores; else plain stores, each thread releasing its own (``LANES`` =
    the launch's threads).

    Traced (``language.trace``; program ``p``'s tiles ``p, p + programs, ...``): program
    start / end; per tile its main loop's end (group, row tile) and its group's counter
    raised (a notify: group, 0), in the tile's own slots where a later tile counts it.
    The counters are the comm stream's to wait on: the kernel waits for nothing."""
    trace_event(TRACE, tbuf, EV_START, 0, 0, 0)
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    SUB_M: tl.constexpr = BLOCK_M // STRIPS
    tiles_n = tl.cdiv(N, BLOCK_N)
    if STRIPS == 1:
        tiles_m = tl.cdiv(M, BLOCK_M)
    else:
        tiles_m = tl.cdiv(rows_per_rank, SUB_M)
    out_ty = buf.dtype.element_ty
    a_desc = None
    b_desc = None
    if USE_TMA:
        if STRIPS == 1:
            a_desc = tl.make_tensor_descriptor(
                a, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K]
            )
        b_desc = tl.make_tensor_descriptor(
            b, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N]
        )
    out_desc = None
    if TMA_STORE:  # the slots as rows of tiles: slot s is rows [s * BLOCK_M, +BLOCK_M)
        out_desc = tl.make_tensor_descriptor(
            buf, shape=[n_tiles * BLOCK_M, BLOCK_N], strides=[BLOCK_N, 1],
            block_shape=[BLOCK_M, BLOCK_N // 2 if SUBTILE else BLOCK_N],
        )  # fmt: skip
    pend = -1  # TMA_STORE: the group of the previous tile, still to count (-1: none)
    r = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    strip = r // SUB_M
    within = (r % SUB_M) * BLOCK_N
    for g in tl.range(pid, n_tiles, n_prog, flatten=True):
        pid_m, pid_n = _tile_coords(g, tiles_m, tiles_n, GROUP_M)
        col = pid_n * BLOCK_N
        if STRIPS == 1:
            acc = _mma(
                a, b, a_desc, b_desc, pid_m * BLOCK_M, col, 1, 1, M, N, K,
                BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA,
            )  # fmt: skip
        else:
            acc = _mma_strips(
                a, b, b_desc, pid_m, col, rows_per_rank, world, N, K,
                BLOCK_M, BLOCK_N, BLOCK_K, STRIPS, USE_TMA,
            )  # fmt: skip
        acc = _add_bias(acc, bias, col, N, BLOCK_N, HAS_BIAS)
        row_of = tile_map + g * MAP_COLS
        group = tl.load(row_of + MAP_GROUP)
        trace_event(TRACE, tbuf, EV_TILE_END, g, group, pid_m)
        if TMA_STORE:
            # Every count sits here, after the main loop: one placed before it (reading
            # what the previous tile's epilogue left) ran out of order once the loop was
            # pipelined, one tile per program counted twice (seen on one H200).
            if SIGNAL:  # the previous tile, of this group: its stores are done by now
                count_tile(counters + tl.maximum(pend, 0), (pend >= 0).to(tl.int32), LANES)
                trace_count(TRACE, tbuf, g - n_prog, pend, pend >= 0)
            row = tl.load(row_of + MAP_SLOT) * BLOCK_M
            _store_tile(
                acc, out_desc, out_desc, 0, row, 0, None, None, N, None, out_ty, BLOCK_M,
                BLOCK_N, True, SUBTILE,
            )  # fmt: skip
            # This program's last tile of the group: counted now (a wait for its stores),
            # not after the next tile, so the group's collective starts a tile sooner.
            after = g + n_prog
            closes = tl.load(
                tile_map + after * MAP_COLS + MAP_GROUP, mask=after < n_tiles, other=-1
            ) != group  # fmt: skip
            if SIGNAL:
                count_tile(counters + group, closes.to(tl.int32), LANES)
                trace_count(TRACE, tbuf, g, group, closes)
            pend = tl.where(closes, -1, group)
        else:
            slot = tl.load(row_of + MAP_SLOT).to(tl.int64)
            stride = tl.load(row_of + MAP_STRIDE).to(tl.int64)
            offs = (slot + strip * stride) * (SUB_M * BLOCK_N) + within
            ptrs = buf + offs[:, None] + c[None, :]
            if STRIPS == 1:
                tl.store(ptrs, rounded(acc, out_ty))
            else:
                tl.store(ptrs, rounded(acc, out_ty), mask=(strip < world)[:, None])
            # Every thread releases its own stores (no CTA barrier: one in the loop stops
            # Triton 3.6 from pipelining it); the group is done at tiles * LANES.
            if SIGNAL:
                lanes = tl.zeros([LANES], dtype=tl.int32)
                tl.atomic_add(counters + group + lanes, 1, sem="release", scope="gpu")
                trace_event(TRACE, tbuf, EV_NOTIFY, g, group, 0)
    trace_event(TRACE, tbuf, EV_END, 0, 0, 0)
