"""Persistent GEMM for Hopper whose tile order, waits and epilogues come from a segment
table: the one compute kernel behind AG+GEMM, GEMM+RS and GEMM+AR (and the plain GEMM).

``C = A @ B`` with ``A [M, K]``, ``B [K, N]`` row-major. The rows of ``C`` are visited as a
list of *segments* (a segment is one communication chunk: a run of rows, tiled by
``BLOCK_M`` from its own first row). Each program walks the segments in table order and, in
each, the tiles ``g`` with ``g % n_programs == pid`` of one global tile numbering, so that no
wave is lost at segment ends. Before its first tile of a segment a program waits (bounded)
for the segment's signals; the wait stays outside the pipelined tile loop (a spin inside it
would stop Triton from software-pipelining the loop) and every A load takes its row
coordinate from the wait's token (``guard_coord``), so no load can move above the wait.

Segment kinds (the epilogue):

* ``KIND_STORE``: store the tile into ``c`` (with bias). AG+GEMM and the plain GEMM.
* ``KIND_STORE_OWN``: the same, reading A from ``a_own`` (this rank's shard, rows from
  ``SEG_OUT_ROW0``): AG+GEMM's own rows need no staging copy.
* ``KIND_PUSH``: store the fp32-accumulated tile, rounded to the output type, into the
  owner's receive buffer (slot of this rank), then release-add the owner's counter of this
  chunk. GEMM+RS / GEMM+AR for rows another rank owns.
* ``KIND_REDUCE``: rows this rank owns: wait until every peer has pushed all its tiles of
  the chunk, add their partials in fp32, add bias, store into ``c`` (reduce-scatter) or into
  every rank's output and release-add each peer's broadcast counter (all-reduce).

Segment table: int32 ``[n_segments, SEG_COLS]``; the columns are named below.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ..language.primitives import (
    barrier_all,
    bulk_stores_done,
    count_tile,
    guard,
    guard_coord,
    last_program_clears,
    notify,
    peer_ptr_aligned,
    rounded,
    signal_base,
    wait_inline,
)
from ..language.tile import consumer_tile_wait
from ..language.trace import (
    EV_BARRIER_BEGIN,
    EV_BARRIER_END,
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

KIND_STORE = tl.constexpr(0)
KIND_PUSH = tl.constexpr(1)
KIND_REDUCE = tl.constexpr(2)
KIND_STORE_OWN = tl.constexpr(3)  # as KIND_STORE, but A's rows come from ``a_own`` (no copy)

# Segment table columns.
SEG_TILE0 = tl.constexpr(0)  # global index of the segment's first tile
SEG_ROW0 = tl.constexpr(1)  # first row of the segment in A's rows
SEG_ROWS = tl.constexpr(2)  # rows in the segment
SEG_KIND = tl.constexpr(3)
SEG_OWNER = tl.constexpr(4)  # rank that owns the rows (push destination)
SEG_OUT_ROW0 = tl.constexpr(5)  # first row of the segment in the owner's output / receive rows
SEG_WAIT_FIRST = tl.constexpr(6)  # first local signal slot to wait for before reading
SEG_WAIT_COUNT = tl.constexpr(7)  # consecutive slots to wait for (0: none)
SEG_WAIT_EXPECTED = tl.constexpr(8)
SEG_NOTIFY = tl.constexpr(9)  # slot to release-add on the owner (push) / on peers (broadcast)
SEG_FINAL_SLOT = tl.constexpr(10)  # all-reduce: local slot the owner's broadcast raises
SEG_FINAL_EXPECTED = tl.constexpr(11)  # all-reduce: broadcast count this rank must receive
SEG_COLS = tl.constexpr(12)


@triton.jit
def _tile_coords(t, seg_mt, tiles_n, GROUP_M: tl.constexpr):
    """Grouped (L2-friendly) order of the tiles of one segment."""
    per_group = GROUP_M * tiles_n
    first_m = (t // per_group) * GROUP_M
    group_m = tl.minimum(seg_mt - first_m, GROUP_M)
    pid_m = first_m + (t % per_group) % group_m
    pid_n = (t % per_group) // group_m
    return pid_m, pid_n


INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _dot(a_t, b_t, acc):
    if INTERPRETED:
        return tl.dot(a_t.to(tl.float32), b_t.to(tl.float32), acc)
    else:
        return tl.dot(a_t, b_t, acc)


@triton.jit
def _load_a(a, rows, row_ok, ks, K):
    """The ``[rows, ks]`` tile of row-major ``a [*, K]`` by plain loads (zeros where
    ``row_ok`` is false or past ``K``)."""
    return tl.load(
        a + rows[:, None].to(tl.int64) * K + ks[None, :],
        mask=row_ok[:, None] & (ks < K)[None, :],
        other=0.0,
    )


@triton.jit
def _load_b(b, cols, ks, N, K):
    """The ``[ks, cols]`` tile of row-major ``b [K, N]`` by plain loads (zeros past
    ``K`` or ``N``)."""
    return tl.load(
        b + ks[:, None].to(tl.int64) * N + cols[None, :],
        mask=(ks < K)[:, None] & (cols < N)[None, :],
        other=0.0,
    )


@triton.jit
def _mma(
    a, b, a_desc, b_desc, row, col, token, wait_expected, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr,
):  # fmt: skip
    """fp32 accumulator of the tile at (row, col); A's rows are guarded by the wait token.

    Under ``TRITON_INTERPRET`` operands are widened to fp32 first: the interpreter's
    ``tl.dot`` mishandles bfloat16."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    if USE_TMA:
        a_row = guard_coord(row, token, wait_expected, M)
        for kk in range(k_tiles):
            a_t = a_desc.load([a_row, kk * BLOCK_K])
            b_t = b_desc.load([kk * BLOCK_K, col])
            acc = _dot(a_t, b_t, acc)
    else:
        rows = row + tl.arange(0, BLOCK_M)
        cols = col + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_ok = guard(rows < M, token, wait_expected)
        for kk in range(k_tiles):
            a_t = _load_a(a, rows, row_ok, kk * BLOCK_K + ks, K)
            b_t = _load_b(b, cols, kk * BLOCK_K + ks, N, K)
            acc = _dot(a_t, b_t, acc)
    return acc


@triton.jit
def _add_bias(acc, bias, col, N, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, enabled=True):
    """``acc + bias`` where ``enabled`` (partial sums get the bias once, at the owner)."""
    if HAS_BIAS:
        cols = col + tl.arange(0, BLOCK_N)
        b = tl.load(bias + cols, mask=(cols < N) & enabled, other=0.0)
        acc += b.to(tl.float32)[None, :]
    return acc


# Integers equal to 1 would be specialised into constants (rank 1, one segment, ...):
# keep the ones the kernel does arithmetic on as runtime values.
@triton.jit(
    do_not_specialize=[
        "rank", "n_seg", "recv_rows", "own_rows", "max_spins", "bar_slot", "go_slot",
        "clear_first", "clear_count", "seg_first", "lead_tiles",
    ]
)  # fmt: skip
def gemm_segments_kernel(
    a, b, c, bias, M, N, K,
    a_own, own_rows,
    seg, n_seg,
    recv, recv_table, recv_rows, out_table, stage,
    sig, sig_table, err, rank, max_spins,
    bar_slot, go_slot, clear_first, clear_count, seg_first, mt_seg, lead_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, WORLD: tl.constexpr,
    USE_TMA: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_PUSH: tl.constexpr, BROADCAST: tl.constexpr, HAS_OWN_A: tl.constexpr,
    SUBTILE: tl.constexpr = False, ENTRY_BARRIER: tl.constexpr = False,
    EXIT_CLEAR: tl.constexpr = False, NOTIFY_STORES: tl.constexpr = False,
    STAGE_PUSHES: tl.constexpr = False, ONE_LOOP: tl.constexpr = False,
    COUNT_UNIT: tl.constexpr = 1, PEER_LOADS: tl.constexpr = 1,
    TRACE: tl.constexpr = False, tbuf=None,
):  # fmt: skip
    """See the module docstring. ``a_own`` ([own_rows, K]) is read by ``KIND_STORE_OWN``;
    ``recv`` ([WORLD, recv_rows, N], symmetric, table ``recv_table``) receives partials;
    ``out_table`` is the all-reduce output's pointer table (``BROADCAST``).

    Call-to-call synchronisation without extra launches:

    * ``ENTRY_BARRIER``: program 0 first runs the device barrier over all ranks (slots
      from ``bar_slot``), then raises local slot ``go_slot``; segments that write into
      peers wait for ``go_slot`` (their table entry names it), so no peer is written
      before it has entered this call, while every program computes from the start.
    * ``EXIT_CLEAR``: the last program to finish zeroes the ``clear_count`` local slots
      from ``clear_first`` (they must include ``go_slot`` and the arrival counter
      ``go_slot + 1``): every signal this launch waited on is zero for the next one.
    * ``NOTIFY_STORES`` (GEMM+RS with a copy-engine scatter): a store segment with a
      ``SEG_NOTIFY`` slot (> 0) counts its finished tiles there (local, release), for a
      consumer that ships the chunk; bias goes only into rows this rank owns.
    * ``STAGE_PUSHES`` (``ce_fused``): a push segment stores its partial tiles into this
      rank's ``stage`` buffer (rows as in ``a``) and counts them in its local
      ``SEG_NOTIFY`` slot; the copy engine ships the chunk to its owner, whose reduce
      segments wait for it as for a push. A reduce segment with a ``SEG_NOTIFY`` slot
      (> 0) counts its finished tiles there too (the all-reduce's gather copies).
    * ``seg_first``: the first segment whose tiles this launch computes (the interpreter
      cuts a ``ce_fused`` call into several launches); an all-reduce's final waits still
      scan every segment.
    * ``ONE_LOOP`` (store segments, ``_one_loop``; or ``STAGE_PUSHES`` push and reduce
      segments, ``_one_loop_scatter``): a program runs its tiles of every segment in one
      pipelined loop, not one loop per segment; ``mt_seg`` gives the segment of each row
      of tiles, ``lead_tiles`` the tiles of the leading segments that run in a first loop
      of their own (``KIND_STORE_OWN``; with pushes, the ``KIND_PUSH`` ones); a pushed
      or reduced tile adds ``COUNT_UNIT`` (the launch's ``num_warps``) to its counter.
      Its reduce tiles load their peers' partials ``PEER_LOADS`` peers at a time (those
      loads in flight together; ``segment_gemm.peer_loads`` picks it).

    There is one main loop for every kind: only the epilogue branches. (A second
    instantiation of the pipelined loop, e.g. one per A source, cost 35 % on an H200.)"""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    trace_event(TRACE, tbuf, EV_START, 0, 0, 0)
    if ENTRY_BARRIER:
        if pid == 0:
            trace_event(TRACE, tbuf, EV_BARRIER_BEGIN, 0, 0, rank)
            # no "go" when a peer is in another call (the fault is recorded): the
            # segments that write into peers then stop at their wait instead
            if barrier_all(sig_table, bar_slot, rank, WORLD, err, max_spins) != 0:
                notify(sig + go_slot, 1)
            trace_event(TRACE, tbuf, EV_BARRIER_END, 0, 0, rank)
    tiles_n = tl.cdiv(N, BLOCK_N)
    out_ty = c.dtype.element_ty
    b_desc = None
    a_all_desc = None
    if USE_TMA:
        b_desc = tl.make_tensor_descriptor(
            b, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N]
        )
        if not HAS_OWN_A and not ONE_LOOP:
            # every segment reads ``a``: one descriptor for the launch, not one per
            # segment (building one on the device costs each program a global write and
            # a tensormap fence at every segment)
            a_all_desc = tl.make_tensor_descriptor(
                a, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K]
            )
    if ONE_LOOP:
        if HAS_PUSH:
            _one_loop_scatter(
                a, b, c, bias, M, N, K, seg, n_seg, mt_seg, lead_tiles, recv, recv_rows,
                out_table, stage, sig, sig_table, err, rank, max_spins, b_desc, BLOCK_M,
                BLOCK_N, BLOCK_K, GROUP_M, WORLD, HAS_BIAS, BROADCAST, SUBTILE, COUNT_UNIT,
                PEER_LOADS, TRACE, tbuf,
            )  # fmt: skip
        else:
            _one_loop(
                a, b, c, bias, M, N, K, a_own, own_rows, seg, n_seg, mt_seg, lead_tiles, sig,
                err, rank, max_spins, b_desc, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, HAS_BIAS,
                HAS_OWN_A, SUBTILE, TRACE, tbuf,
            )  # fmt: skip
    else:
        for s in range(seg_first, n_seg):
            row_of = seg + s * SEG_COLS
            tile0 = tl.load(row_of + SEG_TILE0)
            row0 = tl.load(row_of + SEG_ROW0)
            rows = tl.load(row_of + SEG_ROWS)
            kind = tl.load(row_of + SEG_KIND)
            seg_mt = tl.cdiv(rows, BLOCK_M)
            end = tile0 + seg_mt * tiles_n
            first = _first_tile(tile0, pid, n_prog)
            if first < end:
                owner = tl.load(row_of + SEG_OWNER)
                out_row0 = tl.load(row_of + SEG_OUT_ROW0)
                wait_count = tl.load(row_of + SEG_WAIT_COUNT)
                expected = tl.load(row_of + SEG_WAIT_EXPECTED)
                token = expected
                if wait_count > 0:
                    trace_event(TRACE, tbuf, EV_WAIT_BEGIN, first, s, 0)
                    token = consumer_tile_wait(
                        sig, tl.load(row_of + SEG_WAIT_FIRST), wait_count, expected,
                        err, rank, max_spins,
                    )  # fmt: skip
                    trace_event(TRACE, tbuf, EV_WAIT_END, first, s, token)
                notify_slot = tl.load(row_of + SEG_NOTIFY)
                # A's rows: this rank's shard read in place, or ``a``.
                a_src = a
                a_rows = M
                a_row0 = row0
                if HAS_OWN_A:
                    from_own = kind == KIND_STORE_OWN
                    a_src = tl.where(from_own, a_own, a)
                    a_rows = tl.where(from_own, own_rows, M)
                    a_row0 = tl.where(from_own, out_row0, row0)
                # C's rows: the owner's frame for a reduce-scatter's own rows, else global.
                c_row0 = row0
                if HAS_PUSH and not BROADCAST:
                    c_row0 = tl.where(kind == KIND_REDUCE, out_row0, row0)
                push_dst = c
                owner_sig = sig
                if HAS_PUSH:
                    if STAGE_PUSHES:  # local staging rows and counter: the copy engine ships
                        push_dst = stage + row0.to(tl.int64) * N
                        owner_sig = sig + notify_slot
                    else:
                        # This rank's slot of the owner's receive buffer: recv[rank, out_row0 + r].
                        push_dst = peer_ptr_aligned(recv, recv_table, rank, owner)
                        push_dst += (rank.to(tl.int64) * recv_rows + out_row0) * N
                        owner_sig = signal_base(sig_table, owner) + notify_slot
                a_desc = a_all_desc
                c_desc = None
                if USE_TMA:
                    if HAS_OWN_A:  # A's source changes with the segment
                        a_desc = tl.make_tensor_descriptor(
                            a_src, shape=[a_rows, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K]
                        )
                    # Where this segment's tiles go: ``c`` or, for a push, the owner's receive
                    # rows (a TMA store to a peer: asynchronous, so the program goes on to its
                    # next tile while the tile crosses NVLink). Bounded by the segment's rows:
                    # a tile overhanging the segment end never writes rows of the next segment.
                    # Stored in halves (``SUBTILE``, and always with pushes), the epilogue
                    # needs half the shared memory.
                    out_base = c + c_row0.to(tl.int64) * N
                    if HAS_PUSH:
                        out_base = tl.where(kind == KIND_PUSH, push_dst, out_base)
                    c_desc = tl.make_tensor_descriptor(
                        out_base, shape=[rows, N], strides=[N, 1],
                        block_shape=[BLOCK_M, BLOCK_N // 2 if SUBTILE or HAS_PUSH else BLOCK_N],
                    )  # fmt: skip
                for g in tl.range(first, end, n_prog, flatten=True):
                    pid_m, pid_n = _tile_coords(g - tile0, seg_mt, tiles_n, GROUP_M)
                    col = pid_n * BLOCK_N
                    acc = _mma(
                        a_src, b, a_desc, b_desc, a_row0 + pid_m * BLOCK_M, col, token, expected,
                        a_rows, N, K, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA,
                    )  # fmt: skip
                    trace_event(TRACE, tbuf, EV_TILE_END, g, s, 0)
                    lrows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
                    # The epilogue does not branch on the kind (Triton 3.6 cannot flatten the
                    # tile loop around such branches): each store is masked by it and a TMA
                    # store is moved out of bounds. Signals are raised after the loop.
                    if HAS_PUSH:
                        # In halves: the partials loaded beside the accumulator would
                        # otherwise spill registers (measured with ptxas at 128x256).
                        left, right = _halves(acc, BLOCK_M, BLOCK_N)
                        for h in tl.static_range(2):
                            _scatter_epilogue(
                                left if h == 0 else right, col + h * (BLOCK_N // 2), kind, rows,
                                row0, out_row0, c, c_desc, c_row0, pid_m * BLOCK_M, bias, recv,
                                recv_rows, push_dst, out_table, N, token, expected, rank, out_ty,
                                BLOCK_M, BLOCK_N // 2, WORLD, USE_TMA, HAS_BIAS, BROADCAST,
                            )  # fmt: skip
                    else:
                        cols = col + tl.arange(0, BLOCK_N)
                        mask = (lrows < rows)[:, None] & (cols < N)[None, :]
                        if NOTIFY_STORES:  # partial sums for other ranks: their owner adds it
                            acc = _add_bias(acc, bias, col, N, BLOCK_N, HAS_BIAS, owner == rank)
                        else:
                            acc = _add_bias(acc, bias, col, N, BLOCK_N, HAS_BIAS)
                        _store_tile(
                            acc, c, c_desc, c_row0, pid_m * BLOCK_M, col, lrows, cols, N, mask,
                            out_ty, BLOCK_M, BLOCK_N, USE_TMA, SUBTILE,
                        )  # fmt: skip
                # One release per (program, segment), outside the pipelined loop (a CTA barrier
                # in it stops Triton from pipelining): it publishes every tile this program
                # pushed or broadcast here; counters reach the chunk's tile count when all
                # programs of all sources are done.
                if HAS_PUSH:
                    mine = (end - first + n_prog - 1) // n_prog
                    if kind == KIND_PUSH:
                        if USE_TMA:
                            bulk_stores_done()
                        notify(owner_sig, mine, ADD=True, LOCAL=STAGE_PUSHES)
                        trace_event(TRACE, tbuf, EV_NOTIFY, first, s, owner)
                    if BROADCAST:
                        if kind == KIND_REDUCE:
                            for i in tl.static_range(1, WORLD):
                                q = (rank + i) % WORLD
                                notify(signal_base(sig_table, q) + notify_slot, mine, ADD=True)
                            trace_event(TRACE, tbuf, EV_NOTIFY, first, s, -1)
                    if STAGE_PUSHES and not BROADCAST:  # all-reduce: for the gather copies
                        if kind == KIND_REDUCE:
                            if notify_slot > 0:
                                if USE_TMA:
                                    bulk_stores_done()
                                notify(sig + notify_slot, mine, ADD=True, LOCAL=True)
                                trace_event(TRACE, tbuf, EV_NOTIFY, first, s, rank)
                if NOTIFY_STORES:
                    if notify_slot > 0:
                        if USE_TMA:
                            bulk_stores_done()
                        mine = (end - first + n_prog - 1) // n_prog
                        notify(sig + notify_slot, mine, ADD=True, LOCAL=True)
                        trace_event(TRACE, tbuf, EV_NOTIFY, first, s, rank)
    if BROADCAST:
        # The last program also waits for every peer's broadcast of the rows it owns, so
        # the kernel ends only when the whole all-reduced output is in place on this rank.
        # (Last: the interpreter runs programs in order, and this must not block the
        # others of this rank.)
        if pid == n_prog - 1:
            trace_event(TRACE, tbuf, EV_FINAL_BEGIN, 0, 0, 0)
            for s in range(n_seg):
                row_of = seg + s * SEG_COLS
                fin = tl.load(row_of + SEG_FINAL_EXPECTED)
                if fin > 0:
                    slot = tl.load(row_of + SEG_FINAL_SLOT)
                    consumer_tile_wait(sig, slot, 1, fin, err, rank, max_spins)
            trace_event(TRACE, tbuf, EV_FINAL_END, 0, 0, 0)
    trace_event(TRACE, tbuf, EV_END, 0, 0, 0)
    if EXIT_CLEAR:
        last_program_clears(sig, go_slot + 1, clear_first, clear_count)


@triton.jit
def _one_loop(
    a, b, c, bias, M, N, K, a_own, own_rows, seg, n_seg, mt_seg, lead_tiles, sig, err, rank,
    max_spins, b_desc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_OWN_A: tl.constexpr,
    SUBTILE: tl.constexpr, TRACE: tl.constexpr = False, tbuf=None,
):  # fmt: skip
    """The store segments (``KIND_STORE``, leading ``KIND_STORE_OWN``) of a launch with a
    program's tiles of all segments in one pipelined loop: the loop does not restart at
    each segment (with about one tile per program and segment, the restarts cost 7-15 %
    of AG+GEMM's kernel at TP 4 on an H200,
    ``benchmarks/results/history/2026-11-24-h200-ag-one-loop-probe.txt``).

    Each tile looks its segment up (``mt_seg``) and, the first time this program meets
    the segment, waits for it with ``wait_inline`` (one PTX statement, which keeps the
    loop pipelined); its A coordinate takes the token (``guard_coord``). Own rows come
    from ``a_own`` in a first loop of their own (another A descriptor). TMA only, one
    output descriptor over all of ``c``: the host enables this only when no tile of a
    segment overhangs into another segment's rows (``ops.segment_gemm.one_loop_tables``)."""
    pid, n_prog, tiles_n, total = _one_loop_grid(seg, n_seg, N, BLOCK_M, BLOCK_N)
    out_ty = c.dtype.element_ty
    c_desc = tl.make_tensor_descriptor(
        c, shape=[M, N], strides=[N, 1],
        block_shape=[BLOCK_M, BLOCK_N // 2 if SUBTILE else BLOCK_N],
    )  # fmt: skip
    start = pid
    if HAS_OWN_A:
        own_desc = tl.make_tensor_descriptor(
            a_own, shape=[own_rows, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K]
        )
        for g in tl.range(pid, lead_tiles, n_prog, flatten=True):
            _, row_of, pid_m, pid_n = _tile_of(g, seg, mt_seg, tiles_n, BLOCK_M, GROUP_M)
            tile_row = pid_m * BLOCK_M
            acc = _mma(
                a_own, b, own_desc, b_desc, tl.load(row_of + SEG_OUT_ROW0) + tile_row,
                pid_n * BLOCK_N, 0, 0, own_rows, N, K, BLOCK_M, BLOCK_N, BLOCK_K, True,
            )  # fmt: skip
            trace_event(TRACE, tbuf, EV_TILE_END, g, tl.load(mt_seg + g // tiles_n), 0)
            _store_flat(
                acc, bias, c_desc, tl.load(row_of + SEG_ROW0) + tile_row, pid_n * BLOCK_N, N,
                out_ty, BLOCK_M, BLOCK_N, HAS_BIAS, SUBTILE,
            )  # fmt: skip
        start = _first_tile(lead_tiles, pid, n_prog)
    a_desc = tl.make_tensor_descriptor(
        a, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K]
    )
    waited = -1  # the last segment this program waited for
    for g in tl.range(start, total, n_prog, flatten=True):
        trace_event(TRACE, tbuf, EV_WAIT_BEGIN, g, waited, 0)
        waited, row_of, pid_m, pid_n, token, expected = _flat_tile(
            g, seg, mt_seg, tiles_n, waited, sig, err, rank, max_spins, BLOCK_M, GROUP_M
        )
        trace_event(TRACE, tbuf, EV_WAIT_END, g, waited, token)
        tile_row = tl.load(row_of + SEG_ROW0) + pid_m * BLOCK_M
        acc = _mma(
            a, b, a_desc, b_desc, tile_row, pid_n * BLOCK_N, token, expected, M, N, K,
            BLOCK_M, BLOCK_N, BLOCK_K, True,
        )  # fmt: skip
        trace_event(TRACE, tbuf, EV_TILE_END, g, waited, 0)
        _store_flat(
            acc, bias, c_desc, tile_row, pid_n * BLOCK_N, N, out_ty, BLOCK_M, BLOCK_N, HAS_BIAS,
            SUBTILE,
        )  # fmt: skip


@triton.jit
def _one_loop_grid(seg, n_seg, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(pid, programs, tiles per row of tiles, tiles of the launch)`` of a one-loop
    launch: the last segment's first tile plus its tiles."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    last = seg + (n_seg - 1) * SEG_COLS
    total = tl.load(last + SEG_TILE0) + tl.cdiv(tl.load(last + SEG_ROWS), BLOCK_M) * tiles_n
    return tl.program_id(0), tl.num_programs(0), tiles_n, total


@triton.jit
def _first_tile(tile0, pid, n_prog):
    """This program's first tile from global tile ``tile0`` on (a program runs the tiles
    ``g`` with ``g % n_prog == pid``)."""
    return tile0 + (pid - tile0 % n_prog + n_prog) % n_prog


@triton.jit
def _tile_of(g, seg, mt_seg, tiles_n, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """``(segment, its table row, pid_m, pid_n)`` of global tile ``g`` of a one-loop
    launch."""
    s = tl.load(mt_seg + g // tiles_n)
    row_of = seg + s * SEG_COLS
    seg_mt = tl.cdiv(tl.load(row_of + SEG_ROWS), BLOCK_M)
    pid_m, pid_n = _tile_coords(g - tl.load(row_of + SEG_TILE0), seg_mt, tiles_n, GROUP_M)
    return s, row_of, pid_m, pid_n


@triton.jit
def _flat_tile(
    g, seg, mt_seg, tiles_n, waited, sig, err, rank, max_spins,
    BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Global tile ``g`` of a one-loop launch: ``(segment, its table row, pid_m, pid_n,
    token, expected)``. The tile waits for its segment's signals (``wait_inline``) only
    where the program has not yet met the segment (``waited``: the last one it waited
    for); the token is then ``expected``."""
    s, row_of, pid_m, pid_n = _tile_of(g, seg, mt_seg, tiles_n, BLOCK_M, GROUP_M)
    expected = tl.load(row_of + SEG_WAIT_EXPECTED)
    first = tl.load(row_of + SEG_WAIT_FIRST)
    count = tl.load(row_of + SEG_WAIT_COUNT)
    needed = ((s != waited) & (count > 0)).to(tl.int32)
    token = wait_inline(sig + first, expected, needed, err, rank, first, max_spins, count)
    return s, row_of, pid_m, pid_n, token, expected


@triton.jit
def _one_loop_scatter(
    a, b, c, bias, M, N, K, seg, n_seg, mt_seg, lead_tiles, recv, recv_rows, out_table,
    stage, sig, sig_table, err, rank, max_spins, b_desc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, WORLD: tl.constexpr, HAS_BIAS: tl.constexpr,
    BROADCAST: tl.constexpr, SUBTILE: tl.constexpr, COUNT_UNIT: tl.constexpr,
    PEER_LOADS: tl.constexpr, TRACE: tl.constexpr = False, tbuf=None,
):  # fmt: skip
    """GEMM+RS / GEMM+AR ``ce_fused`` (``STAGE_PUSHES``) in one-loop mode (see
    ``_one_loop``): the ``lead_tiles`` tiles of the leading push segments in a first
    pipelined loop, the reduce segments (a suffix of the table) in a second. Push tiles go
    into ``stage`` through one descriptor over all of it (in halves with ``SUBTILE``) and
    wait for nothing; reduce tiles wait (``wait_inline``, on every peer's arrival flag, the
    first time this program meets the segment), add the peers' partials and are stored
    (all-reduce: broadcast) through pointers. Two loops, not one loop whose tiles pick
    their epilogue: the reduce code in the push tiles' loop, even where they ran none of
    it, cost them 7-9 % of the kernel on an H200
    (``benchmarks/results/history/2026-11-24-h200-ce-fused-one-loop-epilogue-ablation.txt``).

    Counting without a CTA barrier: a tile is counted (``count_tile``: each warp adds 1
    once its stores have landed, so a chunk's counter ends at tiles x ``COUNT_UNIT``)
    after the next tile's main loop, when its stores are long done; a program's last push
    tile before its first reduce tile's wait, its last tile after the loops.
    Push tiles count in their local slot; reduce tiles in their local slot
    (all-reduce with copy gathers) or, broadcast, in every peer's slot at system scope."""
    pid, n_prog, tiles_n, total = _one_loop_grid(seg, n_seg, N, BLOCK_M, BLOCK_N)
    out_ty = c.dtype.element_ty
    a_desc = tl.make_tensor_descriptor(
        a, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K]
    )
    stage_desc = tl.make_tensor_descriptor(
        stage, shape=[M, N], strides=[N, 1],
        block_shape=[BLOCK_M, BLOCK_N // 2 if SUBTILE else BLOCK_N],
    )  # fmt: skip
    pend = 0  # local counter slot of the previous tile, still to count (0: none)
    for g in tl.range(pid, lead_tiles, n_prog, flatten=True):
        _, row_of, pid_m, pid_n = _tile_of(g, seg, mt_seg, tiles_n, BLOCK_M, GROUP_M)
        row = tl.load(row_of + SEG_ROW0) + pid_m * BLOCK_M
        col = pid_n * BLOCK_N
        acc = _mma(
            a, b, a_desc, b_desc, row, col, 0, 0, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, True
        )  # fmt: skip
        trace_event(TRACE, tbuf, EV_TILE_END, g, tl.load(mt_seg + g // tiles_n), 0)
        _count_previous(sig, sig_table, pend, 0, rank, WORLD, False, COUNT_UNIT)
        _store_flat(
            acc, bias, stage_desc, row, col, N, out_ty, BLOCK_M, BLOCK_N, False, SUBTILE
        )  # fmt: skip
        pend = tl.load(row_of + SEG_NOTIFY)
    # The last push tile is counted now, not after the next tile's main loop: that tile's
    # wait is on the peers' copies, which wait on the peers' push counts, which wait the
    # same way on this rank's copies (a cross-rank deadlock). Its stores may still be in
    # flight, so the count waits for them: once per program.
    _count_previous(sig, sig_table, pend, 0, rank, WORLD, False, COUNT_UNIT)
    pend = 0
    waited = -1  # the last segment this program waited for
    pend_peers = 0  # broadcast: the peers' counter slot of the previous tile (0: none)
    start = _first_tile(lead_tiles, pid, n_prog)
    for g in tl.range(start, total, n_prog, flatten=True):
        trace_event(TRACE, tbuf, EV_WAIT_BEGIN, g, waited, 0)
        waited, row_of, pid_m, pid_n, token, expected = _flat_tile(
            g, seg, mt_seg, tiles_n, waited, sig, err, rank, max_spins, BLOCK_M, GROUP_M
        )
        trace_event(TRACE, tbuf, EV_WAIT_END, g, waited, token)
        row0 = tl.load(row_of + SEG_ROW0)
        out_row0 = tl.load(row_of + SEG_OUT_ROW0)
        rows = tl.load(row_of + SEG_ROWS)
        tile_row = pid_m * BLOCK_M
        col = pid_n * BLOCK_N
        acc = _mma(
            a, b, a_desc, b_desc, row0 + tile_row, col, token, expected, M, N, K, BLOCK_M,
            BLOCK_N, BLOCK_K, True,
        )  # fmt: skip
        trace_event(TRACE, tbuf, EV_TILE_END, g, waited, 0)
        _count_previous(sig, sig_table, pend, pend_peers, rank, WORLD, BROADCAST, COUNT_UNIT)
        left, right = _halves(acc, BLOCK_M, BLOCK_N)
        for h in tl.static_range(2):
            _reduce_half(
                left if h == 0 else right, col + h * (BLOCK_N // 2), rows,
                row0 if BROADCAST else out_row0, out_row0,
                tile_row, c, bias, recv, recv_rows, out_table, N, token, expected, rank,
                out_ty, BLOCK_M, BLOCK_N // 2, WORLD, HAS_BIAS, BROADCAST, PEER_LOADS,
            )  # fmt: skip
        notify_slot = tl.load(row_of + SEG_NOTIFY)
        if BROADCAST:
            pend = 0
            pend_peers = notify_slot
        else:
            pend = notify_slot  # the gather copies' counter (or 0)
    _count_previous(sig, sig_table, pend, pend_peers, rank, WORLD, BROADCAST, COUNT_UNIT)


@triton.jit
def _add_partial(
    acc, recv, recv_rows, out_row0, tile_row, in_tile, ok, rank, i, N, WORLD: tl.constexpr
):
    """``acc`` plus the partial of the ``i``-th peer after ``rank`` (loads masked by ``ok``)."""
    p = (rank + i) % WORLD
    part_base = recv + (p * recv_rows + out_row0 + tile_row).to(tl.int64) * N
    return acc + tl.load(part_base + in_tile, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _reduce_half(
    acc, col, rows, c_row0, out_row0, tile_row, c, bias, recv, recv_rows, out_table, N,
    token, expected, rank, out_ty,
    BLOCK_M: tl.constexpr, HALF_N: tl.constexpr, WORLD: tl.constexpr,
    HAS_BIAS: tl.constexpr, BROADCAST: tl.constexpr, PEER_LOADS: tl.constexpr,
):  # fmt: skip
    """``_one_loop_scatter``'s reduce tile, ``HALF_N`` columns: add the peers' partials
    (loads guarded by the wait's token) and the bias, then store into ``c`` at row
    ``c_row0`` of the segment or, ``BROADCAST``, into every rank's result."""
    r = tl.arange(0, BLOCK_M)
    cols = col + tl.arange(0, HALF_N)
    mask = (tile_row + r < rows)[:, None] & (cols < N)[None, :]
    in_tile = r[:, None] * N + cols[None, :]
    ok = guard(mask, token, expected)
    for i0 in range(1, WORLD, PEER_LOADS):  # PEER_LOADS peers' loads in flight together
        for j in tl.static_range(PEER_LOADS):
            acc = _add_partial(
                acc, recv, recv_rows, out_row0, tile_row, in_tile, ok & (i0 + j < WORLD), rank,
                i0 + j, N, WORLD,
            )  # fmt: skip
    val = rounded(_add_bias(acc, bias, col, N, HALF_N, HAS_BIAS), out_ty)
    for i in range(0, WORLD if BROADCAST else 1):
        q = (rank + i) % WORLD
        dst = c
        if BROADCAST:
            dst = peer_ptr_aligned(c, out_table, rank, q)
        dst += (c_row0 + tile_row).to(tl.int64) * N
        tl.store(dst + in_tile, val, mask=mask)


@triton.jit
def _count_previous(
    sig, sig_table, pend, pend_peers, rank,
    WORLD: tl.constexpr, BROADCAST: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    """``_one_loop_scatter``'s deferred count of its previous tile (``UNIT`` per tile)."""
    count_tile(sig + pend, pend, UNIT)
    if BROADCAST:
        for i in range(1, tl.where(pend_peers != 0, WORLD, 1)):
            q = (rank + i) % WORLD
            count_tile(signal_base(sig_table, q) + pend_peers, 1, UNIT, True)


@triton.jit
def _store_flat(
    acc, bias, c_desc, row, col, N, out_ty, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, SUBTILE: tl.constexpr,
):  # fmt: skip
    acc = _add_bias(acc, bias, col, N, BLOCK_N, HAS_BIAS)
    _store_tile(
        acc, c_desc, c_desc, 0, row, col, None, None, N, None, out_ty, BLOCK_M, BLOCK_N, True,
        SUBTILE,
    )  # fmt: skip


@triton.jit
def _halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A ``[BLOCK_M, BLOCK_N]`` tile as its left and right ``BLOCK_N // 2`` columns."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@triton.jit
def _store_tile(
    acc, c, c_desc, c_row0, tile_row, col, lrows, cols, N, mask, out_ty,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr,
    SUBTILE: tl.constexpr,
):  # fmt: skip
    if USE_TMA:
        if SUBTILE:
            left, right = _halves(acc, BLOCK_M, BLOCK_N)
            c_desc.store([tile_row, col], rounded(left, out_ty))
            c_desc.store([tile_row, col + BLOCK_N // 2], rounded(right, out_ty))
        else:
            c_desc.store([tile_row, col], rounded(acc, out_ty))
    else:
        ptrs = c + (c_row0 + lrows)[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(ptrs, rounded(acc, out_ty), mask=mask)


@triton.jit
def _scatter_epilogue(
    acc, col, kind, rows, row0, out_row0, c, c_desc, c_row0, tile_row, bias, recv,
    recv_rows, push_dst, out_table, N, token, expected, rank, out_ty,
    BLOCK_M: tl.constexpr, HALF_N: tl.constexpr, WORLD: tl.constexpr,
    USE_TMA: tl.constexpr, HAS_BIAS: tl.constexpr, BROADCAST: tl.constexpr,
):  # fmt: skip
    """The epilogue of GEMM+RS / GEMM+AR for ``HALF_N`` columns of a tile: push the
    partial to its owner, or (own rows) add the peers' partials and the bias, then store
    (reduce-scatter) or broadcast (all-reduce) the result.

    Addresses are a 64-bit base per tile plus 32-bit offsets inside it: 64-bit offsets
    per element cost two registers each and made the kernel spill."""
    r = tl.arange(0, BLOCK_M)
    cols = col + tl.arange(0, HALF_N)
    mask = (tile_row + r < rows)[:, None] & (cols < N)[None, :]
    in_tile = r[:, None] * N + cols[None, :]
    is_push = kind == KIND_PUSH
    keep = kind != KIND_PUSH
    ok = guard(mask, token, expected)
    # The flattened tile loop cannot hold a branch with results, but it can hold a loop
    # whose trip count depends on the kind: a reduce tile adds its peers' partials, one
    # peer at a time (unrolled with four ranks the loads were hoisted together and spilled
    # registers); any other tile runs no iteration, so it pays for no masked-off loads.
    for i in range(1, tl.where(kind == KIND_REDUCE, WORLD, 1)):
        acc = _add_partial(acc, recv, recv_rows, out_row0, tile_row, in_tile, ok, rank, i, N, WORLD)
    if not USE_TMA:
        push_base = push_dst + tile_row.to(tl.int64) * N
        tl.store(push_base + in_tile, rounded(acc, out_ty), mask=mask & is_push)
    acc = _add_bias(acc, bias, col, N, HALF_N, HAS_BIAS, keep)
    val = rounded(acc, out_ty)
    if BROADCAST:
        if USE_TMA:  # the partial to its owner; own rows: out of bounds, no store
            c_desc.store([tl.where(is_push, tile_row, rows), col], val)
        # every rank's all-reduce output gets the reduced tile (a push tile: no iteration)
        for i in range(0, tl.where(keep, WORLD, 0)):
            q = (rank + i) % WORLD
            dst = peer_ptr_aligned(c, out_table, rank, q) + (row0 + tile_row).to(tl.int64) * N
            tl.store(dst + in_tile, val, mask=mask)
    else:
        if USE_TMA:  # the partial to its owner, or the reduced tile into ``c``
            c_desc.store([tile_row, col], val)
        else:
            dst = c + (c_row0 + tile_row).to(tl.int64) * N
            tl.store(dst + in_tile, val, mask=mask & keep)
