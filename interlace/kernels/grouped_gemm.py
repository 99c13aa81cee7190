"""Kernels of the tensor-parallel MoE ops: the device-built routing tables and the
persistent grouped GEMM that reads them.

Routing (``moe_route_kernel``, no host synchronisation). The token entries ``(token, slot
j)`` of every rank's routing reach each rank as a packed meta buffer: per source rank
``src`` its ``m * k`` expert ids (int32), then its ``m * k`` weights (float32 bits), at
``meta + src * meta_stride``. Entries are visited in *arrival order*: position ``p`` holds
source rank ``(rank + p) % WORLD`` (this rank first, then the rank-rotated copy order),
cut into chunks of ``CHUNK`` entries (``cps`` chunks per source), one program per chunk,
in two phases:

* count: the chunk's histogram of expert ids;
* build, from every chunk's histogram (each program sums them itself): each expert's
  rows padded to ``BLOCK_M`` (``offsets``: padded start of each expert, the total at
  ``E``); the number of row tiles; the *tile table*, which the programs share: row tile
  ``q`` in the order the gather GEMM runs them -> (first row, expert, first and last
  arrival position its rows read), ordered by the last arrival position they need, then
  by expert, so the first tiles need only the shards that arrive first; beside it, the
  expert of each row tile in row order (``TILE_ROW_EXPERT``), the order reduce mode runs,
  whose tiles wait for nothing: there an expert's tiles follow one another and its
  weights are read from HBM once (in arrival order, at E 32 with balanced routing every
  position's tiles span all experts, whose weights outgrow L2: the reduce GEMM and its
  finish took 1.10-1.25 x longer, benchmarks/results/history/
  2026-11-29-h200-w1-moe-tile-order.txt); and the chunk's
  rows, by a stable counting sort: each entry's row is ``offsets[e] + (entries of e in
  earlier chunks) + (rank in its chunk)``, so rows are sorted by (expert, arrival
  position, token, slot). Writes ``sorted_entry[row]`` (the entry's global index ``(src *
  m + t) * k + slot``, whose token is ``entry // k``; -1 in padding rows) and
  ``sorted_w[row]``.

On a GPU both phases run in one launch whose programs meet at a grid barrier (all of
them resident: at most one per SM); the interpreter, which runs programs one after
another, launches each phase alone.

Ids outside ``[0, E)`` are dropped (the op checks them on the host where it can).

Grouped GEMM (``moe_gemm_kernel``): persistent; tile ``g`` is row tile ``g // tiles_n`` (of
the tile table in gather mode, in row order in reduce mode) and column tile ``g %
tiles_n``; the real tile count is read on the device,
so the grid and the tables have a worst-case size known on the host. Two modes:

* gather (the first half): A's rows are gathered through each row's token (this rank's
  tokens read in place from ``x_own``, the peers' from ``gathered``), after a wait on the
  arrival flags of the positions the tile reads; optional fused SwiGLU: ``w`` holds the
  gate columns ``[0, I)`` and the up columns ``[I, 2 I)`` side by side, and the tile's
  output is ``silu(x @ gate) * (x @ up)``.
* reduce (the second half): A is the expert-sorted ``h``, read through a TMA descriptor;
  the epilogue multiplies each row by its routing weight and stores the tile (float32, or
  the output type) in the same row order into this rank's *local* row buffer ``rows_out``
  (whole tiles through a TMA descriptor: asynchronous, under the next tile's main loop),
  and records each entry's row (``row_of[token * k + slot]``). No row is added to another
  here (no atomics). When every program of the launch is done, the last one raises each
  owner's contribution counter; ``moe_finish_kernel`` on the owner waits for all ``WORLD``
  contributions, then sums, in float32, the ``k`` rows of each of its tokens in every
  rank's row buffer, found through that rank's ``row_of`` (peer reads: the top-k sum and
  the reduce-scatter in one pass), and writes them in the output type. Every entry's row
  and map word are rewritten by every call, so nothing is cleared between calls. On
  Hopper the reduce mode runs ``grouped_gemm_hopper``'s warp-specialised Gluon kernel
  instead, where ``ops.moe._gemm.hopper_reduce`` holds.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..language.primitives import (
    INTERPRETED,
    bulk_stores_done,
    guard,
    last_program_clears,
    notify,
    rounded,
    signal_base,
    wait,
    wait_inline,
)
from ..language.trace import (
    EV_END,
    EV_FINAL_BEGIN,
    EV_FINAL_END,
    EV_NOTIFY,
    EV_START,
    EV_TILE_END,
    EV_WAIT_BEGIN,
    EV_WAIT_END,
    trace_event,
)  # fmt: skip

#: tile table columns: first row, expert, first and last arrival position read (entry
#: ``q``: the ``q``-th row tile in arrival order); and ``TILE_ROW_EXPERT``: the expert of
#: row tile ``q`` in *row* order (rows ``q * BLOCK_M ..``), which reduce mode runs
TILE_ROW0 = tl.constexpr(0)
TILE_EXPERT = tl.constexpr(1)
TILE_FIRST = tl.constexpr(2)
TILE_LAST = tl.constexpr(3)
TILE_ROW_EXPERT = tl.constexpr(4)
TILE_COLS = tl.constexpr(5)


@triton.jit
def _chunk_source(rank, cps, CHUNK: tl.constexpr, WORLD: tl.constexpr):
    """``(arrival position, source rank, first entry)`` of this program's chunk."""
    c = tl.program_id(0)
    p = c // cps
    return p, (rank + p) % WORLD, (c % cps) * CHUNK


@triton.jit
def _meta_wait(sig, flag0, p, err, rank, max_spins, WAIT: tl.constexpr):
    """Wait for the meta flag of arrival position ``p`` (own entries: none)."""
    token = 1
    if WAIT:
        if p > 0:
            token = wait(sig + flag0 + p, 1, err, rank, flag0 + p, max_spins)
    return token


#: rows of a program's scratch in ``moe_route_kernel`` (``E_PAD`` int32 each): per
#: arrival position ``p`` the entries of each expert from positions ``<= p``, the tiles of
#: each expert complete by position ``p``, and the table index of each expert's first tile
#: that needs ``p`` last; then each expert's first padded row
ROW_CUM = tl.constexpr(0)
ROW_NLE = tl.constexpr(1)
ROW_BASE = tl.constexpr(2)


@triton.jit(
    do_not_specialize=["rank", "mk", "cps", "max_spins", "flag0", "n_chunks", "bar_slot"]
)  # fmt: skip
def moe_route_kernel(
    meta, meta_stride, w_off, mk, cps, E, counts, n_chunks, offsets, tiles, tile_count,
    scratch, base_scratch, sorted_entry, sorted_w, sig, flag0, bar_slot, err, rank,
    max_spins,
    CHUNK: tl.constexpr, E_PAD: tl.constexpr, WORLD: tl.constexpr, BLOCK_M: tl.constexpr,
    CB: tl.constexpr, TB: tl.constexpr, WAIT: tl.constexpr, PHASE: tl.constexpr,
    NC_PAD: tl.constexpr, W_PAD: tl.constexpr,
):  # fmt: skip
    """The routing build, one program per chunk (see the module docstring). ``PHASE`` 1:
    count (``counts[c, e]``: entries of chunk ``c`` routed to expert ``e``; ``E_PAD``
    columns, the last collecting ids out of range); 2: build (offsets, the tile table and
    this chunk's rows, from the counts of a finished count launch); 0: both in one launch,
    the programs meeting at a grid barrier between them (counter ``sig + bar_slot`` and the
    departure counter after it, left at zero: every program must be resident at once).
    ``scratch``: int32 ``[n_chunks, 3 * WORLD + 1, E_PAD]``, ``base_scratch``: ``[n_chunks,
    E_PAD]``, working space. ``NC_PAD``: the build reads every chunk's counts in one load
    of ``NC_PAD`` rows (``>= n_chunks``; 0: ``CB`` rows at a time, where they do not fit
    in registers). ``W_PAD``: a power of two ``>= WORLD`` (the arrival positions' rows)."""
    c = tl.program_id(0)
    n_prog = tl.num_programs(0)
    p, src, i0 = _chunk_source(rank, cps, CHUNK, WORLD)
    token = _meta_wait(sig, flag0, p, err, rank, max_spins, WAIT)
    e_r = tl.arange(0, E_PAD)
    src_meta = meta + src.to(tl.int64) * meta_stride
    idx = tl.arange(0, CHUNK)
    ok = guard(i0 + idx < mk, token, 1)
    ids = tl.load(src_meta + i0 + idx, mask=ok, other=-1)
    ids = tl.where((ids >= 0) & (ids < E), ids, E_PAD - 1)
    hist = tl.histogram(ids, E_PAD)
    hist = tl.where(e_r < E, hist, 0)
    if PHASE != 2:
        tl.store(counts + c * E_PAD + e_r, hist)
    seen = n_prog
    if PHASE == 0:  # every chunk's counts stored before any program reads them
        tl.debug_barrier()
        tl.atomic_add(sig + bar_slot, 1, sem="release", scope="gpu")
        seen = wait(sig + bar_slot, n_prog, err, rank, bar_slot, max_spins)
        gone = tl.atomic_add(sig + bar_slot + 1, 1, sem="relaxed", scope="gpu")
        if gone == n_prog - 1:  # the last to leave: every program is past its wait
            tl.store(sig + bar_slot + tl.arange(0, 2), tl.zeros((2,), tl.int32))
    if PHASE != 1:
        _route_build(
            c, n_prog, hist, ids, idx, i0, mk, cps, E, src, src_meta, w_off, counts,
            n_chunks, offsets, tiles, tile_count, scratch + c * (3 * WORLD + 1) * E_PAD,
            base_scratch, sorted_entry, sorted_w, seen >= n_prog, CHUNK, E_PAD, WORLD,
            BLOCK_M, CB, TB, NC_PAD, W_PAD,
        )  # fmt: skip


@triton.jit
def _route_build(
    c, n_prog, hist, ids, idx, i0, mk, cps, E, src, src_meta, w_off, counts, n_chunks,
    offsets, tiles, tile_count, scr, base_scratch, sorted_entry, sorted_w, counted,
    CHUNK: tl.constexpr, E_PAD: tl.constexpr, WORLD: tl.constexpr, BLOCK_M: tl.constexpr,
    CB: tl.constexpr, TB: tl.constexpr, NC_PAD: tl.constexpr, W_PAD: tl.constexpr,
):  # fmt: skip
    """``moe_route_kernel``'s build: from every chunk's counts (read only if ``counted``:
    the grid barrier held), each expert's padded start and this chunk's prefix, then tiles
    ``c * TB ..`` of the table (every ``n_prog * TB``), this chunk's rows, and (program 0)
    the offsets, the tile count and the experts' padding rows."""
    e_r = tl.arange(0, E_PAD)
    # per arrival position: the running count of each expert (chunks are in arrival order)
    if NC_PAD > 0:  # every chunk's counts in one load: the sums below come from registers
        c_r = tl.arange(0, NC_PAD)
        c_ok = (c_r < n_chunks) & counted
        every = tl.load(counts + c_r[:, None] * E_PAD + e_r[None, :], mask=c_ok[:, None], other=0)
        run = tl.sum(every, axis=0)
        before = tl.sum(tl.where((c_r < c)[:, None], every, 0), axis=0)  # chunks < c
    else:  # CB chunks' counts per load, the running sums through the scratch
        run = tl.zeros((E_PAD,), dtype=tl.int32)
        before = tl.zeros((E_PAD,), dtype=tl.int32)  # entries of each expert in chunks < c
        for q in tl.static_range(WORLD):
            for c0 in range(q * cps, (q + 1) * cps, CB):
                rows = c0 + tl.arange(0, CB)
                ok = (rows < (q + 1) * cps) & counted
                at = counts + rows[:, None] * E_PAD + e_r[None, :]
                blk = tl.load(at, mask=ok[:, None], other=0)
                run += tl.sum(blk, axis=0)
                before += tl.sum(tl.where((rows < c)[:, None], blk, 0), axis=0)
            tl.store(scr + (ROW_CUM * WORLD + q) * E_PAD + e_r, run)
    total = tl.where(e_r < E, run, 0)
    padded = tl.cdiv(total, BLOCK_M) * BLOCK_M
    start = tl.cumsum(padded, axis=0) - padded
    rows_total = tl.sum(padded, axis=0)
    n_tiles = rows_total // BLOCK_M
    tl.store(scr + (3 * WORLD) * E_PAD + e_r, start)
    if NC_PAD > 0:  # each position's running counts: one scan, the last chunks' rows kept
        q_of = (c_r + 1) // cps - 1
        ends = ((c_r + 1) % cps == 0) & (c_r < n_chunks)
        at = scr + ROW_CUM * WORLD * E_PAD + q_of[:, None] * E_PAD + e_r[None, :]
        tl.store(at, tl.cumsum(every, axis=0), mask=ends[:, None])
    tl.debug_barrier()
    # Per arrival position q (rows of W_PAD): the tiles of each expert whose rows all come
    # from positions <= q (``n_le``), and where the bucket of tiles that need q last starts
    # in the order (``q_base``): the buckets of positions < q, then this one's experts.
    q_r = tl.arange(0, W_PAD)
    q_ok = (q_r < WORLD)[:, None]
    q_rows = q_r[:, None] * E_PAD + e_r[None, :]
    q_at = scr + ROW_CUM * WORLD * E_PAD + q_rows
    cum = tl.load(q_at, mask=q_ok, other=0)
    cum_prev = tl.load(q_at - E_PAD, mask=q_ok & (q_r > 0)[:, None], other=0)
    n_all = tl.cdiv(total, BLOCK_M)[None, :]
    n_le = tl.where(cum == total[None, :], n_all, cum // BLOCK_M)
    prev = tl.where(cum_prev == total[None, :], n_all, cum_prev // BLOCK_M)
    prev = tl.where((q_r > 0)[:, None], prev, 0)
    b = tl.where(q_ok, n_le - prev, 0)
    b_q = tl.sum(b, axis=1)
    q_base = (tl.cumsum(b_q, axis=0) - b_q)[:, None] + tl.cumsum(b, axis=1) - b - prev
    tl.store(scr + ROW_BASE * WORLD * E_PAD + q_rows, q_base, mask=q_ok)
    tl.store(scr + ROW_NLE * WORLD * E_PAD + q_rows, n_le, mask=q_ok)
    tl.debug_barrier()
    for j0 in range(c * TB, n_tiles, n_prog * TB):
        # (names unused before this loop: Triton carries a reassigned name through it)
        tj = j0 + tl.arange(0, TB)
        t_ok = tj < n_tiles
        t_row0 = tj * BLOCK_M
        # the tile's expert: the last one whose padded rows start at or before its row
        t_before = (start[None, :] <= t_row0[:, None]) & (e_r < E)[None, :]
        t_e = tl.maximum(tl.sum(t_before.to(tl.int32), axis=1) - 1, 0)
        t_start = tl.load(scr + (3 * WORLD) * E_PAD + t_e, mask=t_ok, other=0)
        t_i = (t_row0 - t_start) // BLOCK_M  # the tile's index inside its expert
        t_first = tl.zeros((TB,), dtype=tl.int32)
        t_last = tl.zeros((TB,), dtype=tl.int32)
        for tp in tl.static_range(WORLD - 1):
            t_cum = tl.load(scr + (ROW_CUM * WORLD + tp) * E_PAD + t_e, mask=t_ok, other=0)
            t_nle = tl.load(scr + (ROW_NLE * WORLD + tp) * E_PAD + t_e, mask=t_ok, other=0)
            t_first += (t_cum <= t_i * BLOCK_M).to(tl.int32)  # positions wholly before it
            t_last += (t_nle <= t_i).to(tl.int32)  # positions before it is complete
        t_q = tl.load(scr + (ROW_BASE * WORLD + t_last) * E_PAD + t_e, mask=t_ok, other=0) + t_i
        t_dst = tiles + t_q * TILE_COLS
        tl.store(t_dst + TILE_ROW0, t_row0, mask=t_ok)
        tl.store(t_dst + TILE_EXPERT, t_e, mask=t_ok)
        tl.store(t_dst + TILE_FIRST, t_first, mask=t_ok)
        tl.store(t_dst + TILE_LAST, t_last, mask=t_ok)
        tl.store(tiles + tj * TILE_COLS + TILE_ROW_EXPERT, t_e, mask=t_ok)
    # this chunk's rows: a stable counting sort; the s-th entry in (expert, index) order
    # goes to row base[e] + s
    base = start + before - (tl.cumsum(hist, axis=0) - hist)
    tl.store(base_scratch + c * E_PAD + e_r, base)
    tl.debug_barrier()
    key = tl.sort(ids * CHUNK + idx)
    e_s = key // CHUNK
    orig = key % CHUNK
    valid = e_s < E
    row = tl.load(base_scratch + c * E_PAD + e_s, mask=valid, other=0) + idx
    entry = i0 + orig
    wgt = tl.load((src_meta + w_off + entry).to(tl.pointer_type(tl.float32)), mask=valid, other=0.0)
    tl.store(sorted_entry + row, src * mk + entry, mask=valid)
    tl.store(sorted_w + row, wgt, mask=valid)
    if c == 0:
        tl.store(offsets + e_r, start, mask=e_r < E)
        tl.store(offsets + E, rows_total)
        tl.store(tile_count, n_tiles)
        pad = padded - total
        r = tl.arange(0, BLOCK_M)
        pad_rows = (start + total)[:, None] + r[None, :]
        mask = (r[None, :] < pad[:, None]) & (e_r < E)[:, None]
        tl.store(sorted_entry + pad_rows, tl.full((E_PAD, BLOCK_M), -1, tl.int32), mask=mask)
        tl.store(sorted_w + pad_rows, tl.zeros((E_PAD, BLOCK_M), tl.float32), mask=mask)


@triton.jit
def _dot(a_t, b_t, acc):
    if INTERPRETED:  # the interpreter's dot mishandles bfloat16
        return tl.dot(a_t.to(tl.float32), b_t.to(tl.float32), acc)
    else:
        return tl.dot(a_t, b_t, acc)


@triton.jit
def _load_b(w, b_desc, row, col, k_left, N_W, USE_TMA: tl.constexpr,
            BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The ``[BLOCK_K, BLOCK_N]`` tile of ``w`` viewed as ``[E * K, N_W]`` at (row, col);
    rows past ``k_left`` of this expert read as zeros on the pointer path (with TMA they
    read the next expert's rows, multiplied by A's zero columns)."""
    if USE_TMA:
        return b_desc.load([row, col])
    else:
        ks = tl.arange(0, BLOCK_K)
        cols = col + tl.arange(0, BLOCK_N)
        ptrs = w + (row + ks)[:, None].to(tl.int64) * N_W + cols[None, :]
        return tl.load(ptrs, mask=(ks < k_left)[:, None] & (cols < N_W)[None, :], other=0.0)


@triton.jit
def publish_rows(
    sig, sig_table, done_slot, contrib_slot, rank, pid, WORLD: tl.constexpr,
    TRACE: tl.constexpr = False, tbuf=None,
):  # fmt: skip
    """Reduce mode's end (every program, its stores issued): the last program of the launch
    to get here resets the finished-program counter ``done_slot`` and raises every owner's
    contribution counter ``contrib_slot`` (each program's rows and map words published by
    the release chain of the counter); traced: that raise, in program ``pid``'s slots."""
    tl.debug_barrier()
    arrived = tl.atomic_add(sig + done_slot, 1, sem="acq_rel", scope="sys")
    if arrived == tl.num_programs(0) - 1:
        tl.atomic_xchg(sig + done_slot, 0, sem="relaxed", scope="gpu")
        for i in tl.static_range(WORLD):
            peer = (rank + i) % WORLD
            notify(signal_base(sig_table, peer) + contrib_slot, 1, ADD=True)
        trace_event(TRACE, tbuf, EV_NOTIFY, pid, contrib_slot, -1)


@triton.jit(
    do_not_specialize=[
        "rank", "m_loc", "max_spins", "flag0", "done_slot", "clear_first", "clear_count",
        "contrib_slot",
    ]
)  # fmt: skip
def moe_gemm_kernel(
    a, x_own, w, out, tiles, tile_count, sorted_entry, sorted_w, m_loc, k_top, E, K, N,
    N_W, UP, rows_out, row_of, sig, sig_table, flag0, err, rank, max_spins, done_slot,
    clear_first, clear_count, contrib_slot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WORLD: tl.constexpr, GATHER: tl.constexpr, SWIGLU: tl.constexpr, REDUCE: tl.constexpr,
    WAIT: tl.constexpr, USE_TMA: tl.constexpr, EXIT_CLEAR: tl.constexpr,
    FLATTEN: tl.constexpr = False, TRACE: tl.constexpr = False, tbuf=None,
):  # fmt: skip
    """See the module docstring. ``a``: gathered tokens ``[WORLD * m_loc, K]`` (``GATHER``)
    or ``h [rows, K]``; ``w``: ``[E, K, N_W]``; ``out``: ``[rows, N]`` (gather mode);
    ``UP``: first up column of ``w`` (``SWIGLU``); ``REDUCE``: ``rows_out [rows, N]``
    takes the weighted rows in ``a``'s (expert-sorted) order, ``row_of [WORLD * m_loc *
    k]`` each entry's row. ``WAIT``: tiles
    wait for the arrival flags ``flag0 + p`` of the positions they read; ``EXIT_CLEAR``:
    the last program waits for every position's flag (none may land after the clear) and
    zeroes ``clear_count`` slots from ``clear_first``, ``done_slot`` among them.
    ``REDUCE``: the last program raises ``contrib_slot`` on every rank once all programs
    are done.

    Traced (``language.trace``): program start / end, each tile's wait (begin: first and
    last arrival position read; end: last position, token), each tile's main-loop end (row
    tile, expert) and the last program's exit waits (final begin / end); ``REDUCE``: the
    last program's raise of every owner's counter (a notify in its first tile's slots:
    counter slot, -1 = every rank)."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    trace_event(TRACE, tbuf, EV_START, 0, 0, 0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    n_tiles = tl.load(tile_count) * tiles_n
    b_desc = None
    a_desc = None
    rows_desc = None
    if USE_TMA:
        b_desc = tl.make_tensor_descriptor(
            w, shape=[E * K, N_W], strides=[N_W, 1],
            block_shape=[BLOCK_K, BLOCK_N],
        )  # fmt: skip
        if not GATHER:  # the expert-sorted rows in use: whole tiles
            a_desc = tl.make_tensor_descriptor(
                a, shape=[tl.load(tile_count) * BLOCK_M, K], strides=[K, 1],
                block_shape=[BLOCK_M, BLOCK_K],
            )  # fmt: skip
            if REDUCE:  # the weighted rows in the same order: whole tiles, stored async
                rows_desc = tl.make_tensor_descriptor(
                    rows_out, shape=[tl.load(tile_count) * BLOCK_M, N], strides=[N, 1],
                    block_shape=[BLOCK_M, BLOCK_N],
                )  # fmt: skip
    ks = tl.arange(0, BLOCK_K)
    r = tl.arange(0, BLOCK_M)
    for g in tl.range(pid, n_tiles, n_prog, flatten=FLATTEN):
        q = g // tiles_n
        col = (g % tiles_n) * BLOCK_N
        info = tiles + q * TILE_COLS
        if REDUCE:  # row order: each expert's tiles one after another
            row0 = q * BLOCK_M
            e = tl.load(info + TILE_ROW_EXPERT)
        else:  # arrival order
            row0 = tl.load(info + TILE_ROW0)
            e = tl.load(info + TILE_EXPERT)
        rows = row0 + r
        ent = tl.load(sorted_entry + rows)
        live = ent >= 0
        if GATHER:
            token = 1
            if WAIT:
                lo = tl.maximum(tl.load(info + TILE_FIRST), 1)
                hi = tl.load(info + TILE_LAST)
                needed = (hi >= lo).to(tl.int32)
                count = tl.maximum(hi - lo + 1, 1)
                trace_event(TRACE, tbuf, EV_WAIT_BEGIN, g, lo, hi)
                token = wait_inline(
                    sig + flag0 + lo, 1, needed, err, rank, flag0 + lo, max_spins, count
                )
                trace_event(TRACE, tbuf, EV_WAIT_END, g, hi, token)
            tok = tl.where(live, ent // k_top, 0)
            src = tok // m_loc
            own = src == rank
            a_rows = tl.where(own, x_own + (tok - src * m_loc).to(tl.int64) * K,
                              a + tok.to(tl.int64) * K)  # fmt: skip
            a_ok = guard(live, token, 1)
        else:
            a_rows = a + rows.to(tl.int64) * K
            a_ok = live
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_row = e * K
        for kk in range(0, K, BLOCK_K):
            if USE_TMA and not GATHER:  # (a padding row's product is never stored)
                a_t = a_desc.load([row0, kk])
            else:
                a_t = tl.load(a_rows[:, None] + (kk + ks)[None, :],
                              mask=a_ok[:, None] & ((kk + ks) < K)[None, :], other=0.0)  # fmt: skip
            b_t = _load_b(w, b_desc, w_row + kk, col, K - kk, N_W, USE_TMA, BLOCK_K, BLOCK_N)
            acc = _dot(a_t, b_t, acc)
            if SWIGLU:
                u_t = _load_b(
                    w, b_desc, w_row + kk, UP + col, K - kk, N_W, USE_TMA, BLOCK_K, BLOCK_N
                )
                acc_up = _dot(a_t, u_t, acc_up)
        trace_event(TRACE, tbuf, EV_TILE_END, g, q, e)
        cols = col + tl.arange(0, BLOCK_N)
        if REDUCE:
            # the weighted rows in h's order (a padding row: weight 0), and (first column
            # tile) each entry's row in the map the owners' finish reads
            wgt = tl.load(sorted_w + rows, mask=live, other=0.0)
            val = rounded(acc * wgt[:, None], rows_out.dtype.element_ty)
            if USE_TMA:
                rows_desc.store([row0, col], val)
            else:
                dst = rows_out + rows[:, None].to(tl.int64) * N + cols[None, :]
                tl.store(dst, val, mask=(cols < N)[None, :])
            tl.store(row_of + ent, rows, mask=live & (col == 0))
        else:
            if SWIGLU:
                acc = acc / (1.0 + tl.exp(-acc)) * acc_up
            ptrs = out + rows[:, None].to(tl.int64) * N + cols[None, :]
            tl.store(ptrs, rounded(acc, out.dtype.element_ty), mask=(cols < N)[None, :])
    if REDUCE:
        if USE_TMA:
            bulk_stores_done()
        publish_rows(
            sig, sig_table, done_slot, contrib_slot, rank, pid, WORLD, TRACE, tbuf,
        )  # fmt: skip
    if EXIT_CLEAR:
        if pid == n_prog - 1:
            trace_event(TRACE, tbuf, EV_FINAL_BEGIN, 0, 0, 0)
            for p in tl.static_range(1, WORLD):
                wait(sig + flag0 + p, 1, err, rank, flag0 + p, max_spins)
            trace_event(TRACE, tbuf, EV_FINAL_END, 0, 0, 0)
        last_program_clears(sig, done_slot, clear_first, clear_count)
    trace_event(TRACE, tbuf, EV_END, 0, 0, 0)


@triton.jit(
    do_not_specialize=[
        "rank", "max_spins", "contrib_slot", "done_slot", "m_loc", "set_off",
    ]
)  # fmt: skip
def moe_finish_kernel(
    rows_table, set_off, map_table, map_off, y, m_loc, N, sig, contrib_slot, done_slot, err,
    rank, max_spins,
    WORLD: tl.constexpr, TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ROWS_F32: tl.constexpr = True, ALIGNED: tl.constexpr = False,
    TRACE: tl.constexpr = False, tbuf=None,
):  # fmt: skip
    """The owner's end of the top-k sum and the reduce-scatter. Once every rank has
    contributed (counter ``contrib_slot`` reaches ``WORLD``): ``y[t] = sum over ranks r
    and slots j of rows_r[map_r[(rank * m_loc + t) * TOPK + j]]`` in float32, stored in
    ``y``'s type, where ``rows_r`` is rank ``r``'s row buffer (``rows_table[r]`` +
    ``set_off`` elements, ``[rows, N]`` in that rank's expert-sorted order, float32 or,
    ``ROWS_F32`` off, ``y``'s type; the rows already weighted) and ``map_r`` its entry ->
    row map (int32, ``map_table[r]`` + ``map_off``). Ranks and slots are unrolled, so that
    a tile's ``WORLD * TOPK`` row loads are all in flight at once. ``ALIGNED``: every
    rank's buffer at ``set_off`` starts on 16 bytes (the loads then move 16 bytes each).
    Ranks are read in rotated order, this rank first, so that owners spread over the
    links. The last program zeroes the counter and ``done_slot`` (the next slot).

    Traced (``language.trace``): program start / end, the wait for the contributions in
    the program's first tile's slots (begin: counter slot, ``WORLD``; end: counter slot,
    token) and each tile's end (row tile, column tile)."""
    trace_event(TRACE, tbuf, EV_START, 0, 0, 0)
    trace_event(TRACE, tbuf, EV_WAIT_BEGIN, tl.program_id(0), contrib_slot, WORLD)
    token = wait(sig + contrib_slot, WORLD, err, rank, contrib_slot, max_spins)
    trace_event(TRACE, tbuf, EV_WAIT_END, tl.program_id(0), contrib_slot, token)
    tiles_n = tl.cdiv(N, BLOCK_N)
    n_tiles = tl.cdiv(m_loc, BLOCK_M) * tiles_n
    r = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    for g in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        rows = (g // tiles_n) * BLOCK_M + r
        cols = (g % tiles_n) * BLOCK_N + c
        row_ok = guard(rows < m_loc, token, WORLD)
        inside = (rows < m_loc)[:, None] & (cols < N)[None, :]
        ok = guard(inside, token, WORLD)
        first = (rank * m_loc + rows) * TOPK
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in tl.static_range(WORLD):
            peer = (rank + i) % WORLD
            if ROWS_F32:
                base = tl.load(rows_table + peer).to(tl.pointer_type(tl.float32)) + set_off
            else:
                base = tl.load(rows_table + peer).to(tl.pointer_type(y.dtype.element_ty))
                base += set_off
            if ALIGNED:  # (the host checked it: 16-byte loads)
                base = tl.multiple_of(base, 16)
            row_map = tl.load(map_table + peer).to(tl.pointer_type(tl.int32)) + map_off
            for j in tl.static_range(TOPK):
                at = tl.load(row_map + first + j, mask=row_ok, other=0).to(tl.int64)
                total += tl.load(base + at[:, None] * N + cols[None, :], mask=ok, other=0.0).to(
                    tl.float32
                )
        out = y + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(out, rounded(total, y.dtype.element_ty), mask=inside)
        trace_event(TRACE, tbuf, EV_TILE_END, g, g // tiles_n, g % tiles_n)
    last_program_clears(sig, done_slot, contrib_slot, 2)
    trace_event(TRACE, tbuf, EV_END, 0, 0, 0)
