"""Kernels of expert-parallel dispatch and combine over symmetric memory (kernels only; the
context that owns the buffers and launches them is ``interlace.ops.ep``).

Buffers (``W`` ranks, ``T`` = max tokens per rank, ``KP`` = top-k padded to a power of two,
``H`` = hidden):

* ``route_idx [W, T, KP]`` int32 / ``route_w [W, T, KP]`` fp32 / ``route_n [W]`` int32,
  symmetric: slot ``s`` on rank ``d`` holds source ``s``'s routing (expert ids, -1 where
  none; weights; token count, ``-1 - n`` when an expert id was out of range).
* ``stage [W, T, H]``, symmetric: slot ``s`` holds source ``s``'s tokens, row = the token's
  index at its source. A token is stored once per destination rank, however many of its
  experts live there. FP8 dispatch adds ``stage_scale [W, T, H / 128]``.
* ``comb [W, T, H]``, symmetric: slot ``d`` on the home rank holds expert rank ``d``'s
  weighted partial sums of the home rank's tokens.
* ``pair_rel [W, T, KP]`` int32, local: for each (source, token, k) pair routed to one of
  this rank's experts, its row within that expert's segment of the expanded output (the
  segment is ordered by source rank, then token); -1 for pairs routed elsewhere.

Signals (int32 slots on the context's pad; every protocol resets itself, so calls can be
captured in a CUDA graph and replayed):

* ``route[s]``: source ``s`` wrote its routing here (1); the receiver zeroes it once it
  has consumed the routing and the staged tokens, which frees slot ``s`` for the next call
  (the source waits for 0 before writing).
* ``data[s]``: release-added by each of source ``s``'s send programs once its stores
  landed; the receiver waits for the count of send programs, zeroed with ``route``.
* ``comb[d]``: release-added by each of expert rank ``d``'s combine programs; the home
  rank waits for the count, then zeroes it; an expert rank writes a home rank's slot only
  after seeing it below the count (the previous call's adds consumed).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..language.primitives import (
    CAUSE_TIMEOUT,
    ERROR_POLL,
    REMOTE_SLOT,
    notify,
    peer_ptr_aligned,
    record_check,
    record_fault,
    rounded,
    signal_base,
    wait,
    wait_deadline,
    wait_stop,
)
from ..language.trace import (
    EV_END,
    EV_NOTIFY,
    EV_START,
    EV_TILE_END,
    EV_WAIT_BEGIN,
    EV_WAIT_END,
    trace_event,
    trace_step,
)  # fmt: skip

#: Values per FP8 scale (one fp32 scale per this many consecutive values of a row).
FP8_GROUP = tl.constexpr(128)
#: Largest finite e4m3 value.
E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def _decode_count(n_raw):
    """A source's token count from its ``route_n`` word (``-1 - n`` marks bad ids)."""
    return tl.where(n_raw < 0, -1 - n_raw, n_raw)


@triton.jit
def _wait_below(sig, bound, err, rank, slot, max_spins):
    """Acquire-spin until ``*sig < bound``, bounded as ``primitives.wait``: ``max_spins``
    microseconds, and it stops once this rank or any rank of the group recorded a fault."""
    seen = tl.load(sig, volatile=True)
    deadline = wait_deadline(max_spins)
    spins = 0
    cause = 0
    while (seen >= bound) & (cause == 0):
        spins += 1
        if spins % ERROR_POLL == 0:
            cause = wait_stop(err, deadline)
        seen = tl.load(sig, volatile=True)
    seen = tl.atomic_add(sig, 0, sem="acquire", scope="sys")
    if seen >= bound:
        record_fault(err, rank, slot, seen, bound - 1, tl.where(cause == 0, CAUSE_TIMEOUT, cause))


@triton.jit
def _column(mat, cols, j):
    """Column ``j`` of a ``[rows, KP]`` tensor (one element per row)."""
    return tl.sum(tl.where(cols[None, :] == j, mat, 0), axis=1)


@triton.jit
def _expert_starts(counts, rank, E_LOC: tl.constexpr, EP2: tl.constexpr):
    """Exclusive prefix sums of the per-local-expert row counts: where each expert's
    segment of the expanded output starts."""
    ev = tl.arange(0, EP2)
    cnt = tl.load(counts + ev, mask=ev < E_LOC, other=0)
    return tl.cumsum(cnt, 0) - cnt


@triton.jit
def _rows_of(rel, idx, starts, rank, E_LOC: tl.constexpr, EP2: tl.constexpr):
    """Expanded-output row of each pair: its expert's start plus its row within it."""
    ev = tl.arange(0, EP2)
    e_loc = idx - rank * E_LOC
    hit = e_loc[:, :, None] == ev[None, None, :]
    start = tl.sum(tl.where(hit, starts[None, None, :], 0), axis=2)
    return tl.where(rel >= 0, start + rel, -1)


@triton.jit
def _source_starts(seg_counts, s, world, E_LOC: tl.constexpr, EP2: tl.constexpr,
                   WP: tl.constexpr):  # fmt: skip
    """Source-major layout (rows grouped by source rank, then local expert, then token):
    for each local expert, the value to add to a pair's ``pair_rel`` (its row within the
    expert's source-ordered segment) to get its row within source ``s``'s region, and
    the inclusive prefix sums of ``s``'s rows per expert (``offs`` of that region)."""
    ev = tl.arange(0, EP2)
    wv = tl.arange(0, WP)
    m = (ev < E_LOC)[:, None] & (wv < world)[None, :]
    seg = tl.load(seg_counts + ev[:, None] * world + wv[None, :], mask=m, other=0)
    col = tl.sum(tl.where(wv[None, :] == s, seg, 0), axis=1)
    before_s = tl.sum(tl.where(wv[None, :] < s, seg, 0), axis=1)
    incl = tl.cumsum(col, 0)
    return incl - col - before_s, incl


@triton.jit
def _round_e4m3(v):
    """``v`` rounded to the nearest e4m3 value, ties to even (as a hardware conversion
    rounds), so the later cast is exact on every backend (Triton's interpreter truncates
    in its own conversion). Ties are common: bf16 inputs carry few mantissa bits."""
    a = tl.abs(v)
    e = tl.maximum(tl.floor(tl.log2(a)), -6.0)
    step = tl.exp2(e - 3.0)
    y = a / step
    f = tl.floor(y)
    frac = y - f
    up = (frac > 0.5) | ((frac == 0.5) & (f - 2.0 * tl.floor(f * 0.5) == 1.0))
    r = tl.minimum(tl.where(up, f + 1.0, f) * step, E4M3_MAX)
    return tl.where(v < 0, -r, r)


@triton.jit
def quantise_e4m3(v, R: tl.constexpr, C: tl.constexpr):
    """``v [R, C]`` (``C`` a multiple of 128) quantised to e4m3 with one fp32 scale per
    128 consecutive values of a row, ``amax / 448``: returns the codes as raw bytes
    (uint8 ``[R, C]``: data then moves as bytes; the interpreter would convert fp8 values
    on every load and store) and the scales ``[R, C / 128]``. The divisions are IEEE
    (Triton's ``/`` on fp32 is approximate on a GPU), so scales and codes are those of
    ``(x / (amax / 448)).to(float8_e4m3fn)``."""
    NG: tl.constexpr = C // FP8_GROUP
    g = tl.reshape(v.to(tl.float32), [R, NG, FP8_GROUP])
    amax = tl.max(tl.abs(g), axis=2)
    s = tl.math.div_rn(tl.maximum(amax, 1e-12), tl.full([R, NG], 448.0, tl.float32))
    q = _round_e4m3(tl.math.div_rn(g, tl.broadcast_to(s[:, :, None], [R, NG, FP8_GROUP])))
    return tl.reshape(q, [R, C]).to(tl.float8e4nv).to(tl.uint8, bitcast=True), s


@triton.jit
def ep_route_kernel(
    topk_idx, topk_w, n_tok, route_idx, idx_tab, route_w, w_tab, route_n, n_tab, sig_tab,
    ROUTE_OFF, err, rank, world, n_experts, K, T_MAX, max_spins,
    KP: tl.constexpr, BT: tl.constexpr,
    TRACE: tl.constexpr = False, tbuf=None,
):  # fmt: skip
    """Program ``i`` writes this rank's routing into slot ``rank`` of rank ``rank + i``
    (after that slot was freed), then raises that rank's ``route[rank]``. Expert ids out of
    ``[-1, n_experts)`` become -1 and mark the token count (``-1 - n``), so that every
    rank sees the error.

    Traced (``language.trace``, one tile per program): start / end; the wait for the
    slot (begin / end: peer, 0); the routing's push (tile end: peer, tokens); the flag
    raised (notify: slot, peer)."""
    trace_event(TRACE, tbuf, EV_START, 0, 0, 0)
    peer = (rank + tl.program_id(0)) % world
    flag = signal_base(sig_tab, peer) + ROUTE_OFF + rank
    trace_step(TRACE, tbuf, EV_WAIT_BEGIN, 0, peer, 0)
    wait(flag, 0, err, rank, ROUTE_OFF + rank + (peer + 1) * REMOTE_SLOT, max_spins, EQUAL=True)
    trace_step(TRACE, tbuf, EV_WAIT_END, 0, peer, 0)
    base = tl.cast(rank, tl.int64) * T_MAX * KP
    dst_idx = peer_ptr_aligned(route_idx, idx_tab, rank, peer) + base
    dst_w = peer_ptr_aligned(route_w, w_tab, rank, peer) + base
    cols = tl.arange(0, KP)
    bad = 0
    for t0 in range(0, n_tok, BT):
        rows = t0 + tl.arange(0, BT)
        rmask = rows < n_tok
        m = rmask[:, None] & (cols < K)[None, :]
        src = rows[:, None].to(tl.int64) * K + cols[None, :]
        idx = tl.load(topk_idx + src, mask=m, other=-1).to(tl.int32)
        wrong = m & ((idx >= n_experts) | (idx < -1))
        bad += tl.sum(wrong.to(tl.int32))
        idx = tl.where(wrong, -1, idx)
        w = tl.load(topk_w + src, mask=m, other=0.0).to(tl.float32)
        dst = rows[:, None] * KP + cols[None, :]
        tl.store(dst_idx + dst, idx, mask=rmask[:, None])
        tl.store(dst_w + dst, w, mask=rmask[:, None])
    n_word = tl.where(bad > 0, -1 - n_tok, n_tok)
    tl.store(peer_ptr_aligned(route_n, n_tab, rank, peer) + rank, n_word)
    trace_step(TRACE, tbuf, EV_TILE_END, 0, peer, n_tok)
    notify(flag, 1)
    trace_step(TRACE, tbuf, EV_NOTIFY, 0, ROUTE_OFF + rank, peer)
    trace_event(TRACE, tbuf, EV_END, 0, 0, 0)


@triton.jit
def ep_send_kernel(
    x, n_tok, route_idx, stage, stage_tab, scale, scale_tab, sig_tab, DATA_OFF,
    rank, world, H, T_MAX,
    E_LOC: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
    FP8: tl.constexpr,
    TRACE: tl.constexpr = False, tbuf=None,
):  # fmt: skip
    """Each token's row is stored once into slot ``rank`` of every rank that holds one of
    its experts (destinations rank-rotated); FP8: quantised on the way, one scale per
    128 values. Each program then release-adds 1 to ``data[rank]`` on every rank.

    Traced (``language.trace``, one tile per program): start / end; the end of the
    program's pushes (tile end: its token blocks, 0); the counters raised (notify: slot,
    -1 = every rank)."""
    trace_event(TRACE, tbuf, EV_START, 0, 0, 0)
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, KP)
    own = route_idx + tl.cast(rank, tl.int64) * T_MAX * KP
    for blk in range(pid, tl.cdiv(n_tok, BT), n_prog):
        rows = blk * BT + tl.arange(0, BT)
        rmask = rows < n_tok
        idx = tl.load(own + rows[:, None] * KP + cols[None, :], mask=rmask[:, None], other=-1)
        dest = tl.where(idx >= 0, idx // E_LOC, -1)
        rows64 = rows.to(tl.int64)
        for h0 in range(0, H, BH):
            hc = h0 + tl.arange(0, BH)
            hm = hc < H
            v = tl.load(x + rows64[:, None] * H + hc[None, :], mask=rmask[:, None] & hm[None, :])
            if FP8:
                NG: tl.constexpr = BH // FP8_GROUP
                v, s = quantise_e4m3(v, BT, BH)
                gc = h0 // FP8_GROUP + tl.arange(0, NG)
                gm = gc < H // FP8_GROUP
            for i in range(world):
                d = (rank + i) % world
                go = tl.max(tl.where(dest == d, 1, 0), axis=1) > 0
                dst = (
                    peer_ptr_aligned(stage, stage_tab, rank, d)
                    + tl.cast(rank, tl.int64) * T_MAX * H
                )
                tl.store(dst + rows64[:, None] * H + hc[None, :], v, mask=go[:, None] & hm[None, :])
                if FP8:
                    n_groups = H // FP8_GROUP
                    sdst = peer_ptr_aligned(scale, scale_tab, rank, d)
                    sdst += tl.cast(rank, tl.int64) * T_MAX * n_groups
                    tl.store(
                        sdst + rows64[:, None] * n_groups + gc[None, :], s,
                        mask=go[:, None] & gm[None, :],
                    )  # fmt: skip
    trace_step(TRACE, tbuf, EV_TILE_END, 0, tl.cdiv(n_tok, BT), 0)
    for i in range(world):
        d = (rank + i) % world
        notify(signal_base(sig_tab, d) + DATA_OFF + rank, 1, ADD=True)
    trace_step(TRACE, tbuf, EV_NOTIFY, 0, DATA_OFF + rank, -1)
    trace_event(TRACE, tbuf, EV_END, 0, 0, 0)


@triton.jit
def ep_layout_kernel(
    route_idx, route_n, pair_rel, counts, seg_counts, status, sig, ROUTE_OFF, err, rank, world,
    T_MAX, capacity, OVERFLOW_SLOT, BAD_SLOT, max_spins,
    E_LOC: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, WP: tl.constexpr,
    TRACE: tl.constexpr = False, tbuf=None,
):  # fmt: skip
    """After every source's routing has landed: program ``e`` (one per local expert) gives
    each pair routed to expert ``e`` its row within ``e``'s segment (sources in rank order,
    tokens in order) and writes the segment's size to ``counts[e]`` (and the rows of each
    source to ``seg_counts[e, s]``); the last program marks
    every other pair -1 and checks the whole routing: rows each rank receives against
    ``capacity``, expert ids in range. Every rank sees the same routing, so every rank
    finds the same failure: it writes ``status`` (1 overflow, 2 bad expert id) and records
    it in its error word, and no later kernel of the call moves data.

    Traced (``language.trace``; step ``s`` of program ``p`` of ``P`` is tile ``p + s P``):
    start / end; per source ``s`` the wait for its routing (begin / end: ``s``, 0); the
    end of the program's work in the last step (tile end: ``pid``, 0)."""
    trace_event(TRACE, tbuf, EV_START, 0, 0, 0)
    pid = tl.program_id(0)
    for s in range(world):
        trace_step(TRACE, tbuf, EV_WAIT_BEGIN, s, s, 0)
        wait(sig + ROUTE_OFF + s, 1, err, rank, ROUTE_OFF + s, max_spins)
        trace_step(TRACE, tbuf, EV_WAIT_END, s, s, 0)
    cols = tl.arange(0, KP)
    if pid < E_LOC:
        e = rank * E_LOC + pid
        carry = 0
        for s in range(world):
            n = _decode_count(tl.load(route_n + s))
            base = tl.cast(s, tl.int64) * T_MAX * KP
            before = carry
            for t0 in range(0, n, BT):
                rows = t0 + tl.arange(0, BT)
                at = base + rows[:, None] * KP + cols[None, :]
                idx = tl.load(route_idx + at, mask=(rows < n)[:, None], other=-1)
                hit = (idx == e).to(tl.int32)
                flat = tl.reshape(hit, [BT * KP])
                rel = tl.reshape(tl.cumsum(flat, 0), [BT, KP]) - 1 + carry
                tl.store(pair_rel + at, rel, mask=hit != 0)
                carry += tl.sum(flat)
            tl.store(seg_counts + pid * world + s, carry - before)
        tl.store(counts + pid, carry)
    else:
        wv = tl.arange(0, WP)
        totals = tl.zeros([WP], dtype=tl.int32)
        bad_src = world
        for s in range(world):
            n_raw = tl.load(route_n + s)
            if n_raw < 0:
                bad_src = tl.minimum(bad_src, s)
            n = _decode_count(n_raw)
            base = tl.cast(s, tl.int64) * T_MAX * KP
            for t0 in range(0, n, BT):
                rows = t0 + tl.arange(0, BT)
                rmask = (rows < n)[:, None]
                at = base + rows[:, None] * KP + cols[None, :]
                idx = tl.load(route_idx + at, mask=rmask, other=-1)
                mine = (idx >= rank * E_LOC) & (idx < (rank + 1) * E_LOC)
                tl.store(pair_rel + at, -1, mask=rmask & (mine == 0))
                dest = tl.where(idx >= 0, idx // E_LOC, -1)
                hit = (dest[:, :, None] == wv[None, None, :]).to(tl.int32)
                totals += tl.sum(tl.sum(hit, axis=0), axis=0)
        over = (totals > capacity) & (wv < world)
        first_over = tl.min(tl.where(over, wv, WP))
        need = tl.max(tl.where(wv == first_over, totals, 0))
        state = 0
        if bad_src < world:
            state = 2
            record_check(err, bad_src, BAD_SLOT, 0)
        elif first_over < WP:
            state = 1
            record_check(err, first_over, OVERFLOW_SLOT, need)
        tl.store(status, state)
    trace_step(TRACE, tbuf, EV_TILE_END, world - 1, pid, 0)
    trace_event(TRACE, tbuf, EV_END, 0, 0, 0)


@triton.jit
def ep_expand_kernel(
    stage, stage_scale, route_idx, route_n, pair_rel, counts, status, recv_x, recv_scale,
    out_counts, out_offsets, sig, ROUTE_OFF, DATA_OFF, DONE_SLOT, n_senders, err, rank,
    world, H, T_MAX, max_spins, seg_counts, src_offs, cap_s, SRC_DONE,
    E_LOC: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
    EP2: tl.constexpr, WP: tl.constexpr, FP8: tl.constexpr, SRC_MAJOR: tl.constexpr = False,
    TRACE: tl.constexpr = False, tbuf=None,
):  # fmt: skip
    """Copies each staged token into the expanded output once per local expert it is
    routed to (``recv_x[start[e] + pair_rel]``), source by source as each source's tokens
    land (own first, then rank-rotated). Program 0 writes the per-expert counts and their
    inclusive prefix sums (``offs`` of ``torch._grouped_mm``). The last program to finish
    zeroes ``data`` and then releases ``route`` (slots free for the next call).

    ``SRC_MAJOR`` (the overlapped MoE layer): rows go to a source-major layout instead,
    source ``s``'s region starting at row ``s * cap_s`` and grouped by local expert there;
    program 0 writes each region's ``offs`` to ``src_offs [W, E_LOC]``, and every program
    release-adds 1 to local signal ``SRC_DONE + s`` once its rows of source ``s`` are
    stored, so a consumer can start on a source's rows as soon as they are complete.

    Traced (``language.trace``; step ``i`` of program ``p`` of ``P`` is tile ``p + i P``):
    start / end; per source (step ``i``: own first, then rank-rotated) the wait for its
    tokens (begin: source, senders; end: source, 0) and the end of its rows' copies (tile
    end: source, 0); the last program's release of the routing slots (notify in step 0:
    route slot, -1 = every rank)."""
    trace_event(TRACE, tbuf, EV_START, 0, 0, 0)
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    state = tl.load(status)
    starts = _expert_starts(counts, rank, E_LOC, EP2)
    if pid == 0:
        ev = tl.arange(0, EP2)
        cnt = tl.load(counts + ev, mask=ev < E_LOC, other=0)
        tl.store(out_counts + ev, cnt, mask=ev < E_LOC)
        tl.store(out_offsets + ev, tl.cumsum(cnt, 0), mask=ev < E_LOC)
    cols = tl.arange(0, KP)
    n_groups = H // FP8_GROUP
    for i in range(world):
        s = (rank + i) % world
        if SRC_MAJOR:
            rel_start, incl = _source_starts(seg_counts, s, world, E_LOC, EP2, WP)
            starts = rel_start + s * cap_s
            if pid == 0:
                ev = tl.arange(0, EP2)
                tl.store(src_offs + s * E_LOC + ev, incl, mask=ev < E_LOC)
        trace_step(TRACE, tbuf, EV_WAIT_BEGIN, i, s, n_senders)
        wait(sig + DATA_OFF + s, n_senders, err, rank, DATA_OFF + s, max_spins)
        trace_step(TRACE, tbuf, EV_WAIT_END, i, s, 0)
        n = tl.where(state == 0, _decode_count(tl.load(route_n + s)), 0)
        base = tl.cast(s, tl.int64) * T_MAX
        for blk in range(pid, tl.cdiv(n, BT), n_prog):
            rows = blk * BT + tl.arange(0, BT)
            rmask = rows < n
            at = (base + rows)[:, None] * KP + cols[None, :]
            rel = tl.load(pair_rel + at, mask=rmask[:, None], other=-1)
            idx = tl.load(route_idx + at, mask=rmask[:, None], other=-1)
            row = _rows_of(rel, idx, starts, rank, E_LOC, EP2)
            used = tl.max(row, axis=1) >= 0
            for h0 in range(0, H, BH):
                hc = h0 + tl.arange(0, BH)
                hm = hc < H
                src = (base + rows)[:, None] * H + hc[None, :]
                v = tl.load(stage + src, mask=used[:, None] & hm[None, :])
                if FP8:
                    NG: tl.constexpr = BH // FP8_GROUP
                    gc = h0 // FP8_GROUP + tl.arange(0, NG)
                    gm = gc < n_groups
                    sv = tl.load(
                        stage_scale + (base + rows)[:, None] * n_groups + gc[None, :],
                        mask=used[:, None] & gm[None, :],
                    )  # fmt: skip
                for j in tl.static_range(KP):
                    rj = _column(row, cols, j).to(tl.int64)
                    ok = rj >= 0
                    tl.store(
                        recv_x + rj[:, None] * H + hc[None, :], v, mask=ok[:, None] & hm[None, :]
                    )
                    if FP8:
                        tl.store(
                            recv_scale + rj[:, None] * n_groups + gc[None, :], sv,
                            mask=ok[:, None] & gm[None, :],
                        )  # fmt: skip
        trace_step(TRACE, tbuf, EV_TILE_END, i, s, 0)
        if SRC_MAJOR:
            notify(sig + SRC_DONE + s, 1, ADD=True, LOCAL=True)
    tl.debug_barrier()
    if tl.atomic_add(sig + DONE_SLOT, 1, sem="acq_rel", scope="gpu") == n_prog - 1:
        wv = tl.arange(0, WP)
        tl.store(sig + DATA_OFF + wv, 0, mask=wv < world)
        tl.store(sig + DONE_SLOT, 0)
        tl.debug_barrier()
        for s in range(world):
            tl.atomic_xchg(sig + ROUTE_OFF + s, 0, sem="release", scope="sys")
        trace_step(TRACE, tbuf, EV_NOTIFY, 0, ROUTE_OFF, -1)
    trace_event(TRACE, tbuf, EV_END, 0, 0, 0)


@triton.jit
def ep_combine_send_kernel(
    expert_out, route_idx, route_w, route_n, pair_rel, counts, status, comb, comb_tab,
    sig_tab, COMB_OFF, err, rank, world, H, T_MAX, max_spins, only_src, seg_counts,
    E_LOC: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
    EP2: tl.constexpr, WP: tl.constexpr = 2, SRC_MAJOR: tl.constexpr = False,
    TRACE: tl.constexpr = False, tbuf=None,
):  # fmt: skip
    """For each token routed here, the weighted sum (fp32) of its rows of ``expert_out``
    over this rank's experts, stored once into slot ``rank`` of the token's home rank at
    the token's index (home ranks rank-rotated). Each program first waits until the home
    rank consumed the previous call's ``comb[rank]`` adds, and release-adds 1 when done.

    ``only_src >= 0``: only home rank ``only_src``'s tokens, whose rows ``expert_out``
    holds in the source-major layout of that source's region alone (``SRC_MAJOR``; see
    ``ep_expand_kernel``): one launch per source, each as soon as its rows are computed.

    Traced (``language.trace``; step ``i`` of program ``p`` of ``P`` is tile ``p + i P``):
    start / end; per home rank (step ``i``: own first, then rank-rotated) the wait for its
    slot (begin / end: home rank, 0) and the end of the rows' push (tile end: home rank,
    1 where its tokens are sent); the counters raised (notify in step 0: slot, -1 = every
    rank, else ``only_src``)."""
    trace_event(TRACE, tbuf, EV_START, 0, 0, 0)
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    state = tl.load(status)
    starts = _expert_starts(counts, rank, E_LOC, EP2)
    cols = tl.arange(0, KP)
    for i in range(world):
        s = (rank + i) % world
        flag = signal_base(sig_tab, s) + COMB_OFF + rank
        mine = (only_src < 0) | (s == only_src)
        if mine:
            trace_step(TRACE, tbuf, EV_WAIT_BEGIN, i, s, 0)
            _wait_below(flag, n_prog, err, rank, COMB_OFF + rank + (s + 1) * REMOTE_SLOT, max_spins)
            trace_step(TRACE, tbuf, EV_WAIT_END, i, s, 0)
        if SRC_MAJOR:
            rel_start, _ = _source_starts(seg_counts, s, world, E_LOC, EP2, WP)
            starts = rel_start
        n = tl.where((state == 0) & mine, _decode_count(tl.load(route_n + s)), 0)
        base = tl.cast(s, tl.int64) * T_MAX
        dst = peer_ptr_aligned(comb, comb_tab, rank, s) + tl.cast(rank, tl.int64) * T_MAX * H
        for blk in range(pid, tl.cdiv(n, BT), n_prog):
            rows = blk * BT + tl.arange(0, BT)
            rmask = rows < n
            at = (base + rows)[:, None] * KP + cols[None, :]
            rel = tl.load(pair_rel + at, mask=rmask[:, None], other=-1)
            idx = tl.load(route_idx + at, mask=rmask[:, None], other=-1)
            w = tl.load(route_w + at, mask=rmask[:, None], other=0.0)
            row = _rows_of(rel, idx, starts, rank, E_LOC, EP2)
            used = tl.max(row, axis=1) >= 0
            rows64 = rows.to(tl.int64)
            for h0 in range(0, H, BH):
                hc = h0 + tl.arange(0, BH)
                hm = hc < H
                acc = tl.zeros([BT, BH], dtype=tl.float32)
                for j in tl.static_range(KP):
                    rj = _column(row, cols, j).to(tl.int64)
                    wj = tl.sum(tl.where(cols[None, :] == j, w, 0.0), axis=1)
                    v = tl.load(
                        expert_out + rj[:, None] * H + hc[None, :],
                        mask=(rj >= 0)[:, None] & hm[None, :], other=0.0,
                    )  # fmt: skip
                    acc += wj[:, None] * v.to(tl.float32)
                tl.store(
                    dst + rows64[:, None] * H + hc[None, :], rounded(acc, dst.dtype.element_ty),
                    mask=used[:, None] & hm[None, :],
                )  # fmt: skip
        trace_step(TRACE, tbuf, EV_TILE_END, i, s, mine.to(tl.int32))
    for i in range(world):
        s = (rank + i) % world
        if (only_src < 0) | (s == only_src):
            notify(signal_base(sig_tab, s) + COMB_OFF + rank, 1, ADD=True)
    trace_step(TRACE, tbuf, EV_NOTIFY, 0, COMB_OFF + rank, tl.where(only_src < 0, -1, only_src))
    trace_event(TRACE, tbuf, EV_END, 0, 0, 0)


@triton.jit
def ep_combine_recv_kernel(
    out, n_tok, route_idx, comb, status, sig, COMB_OFF, DONE_SLOT, n_senders, err, rank,
    world, H, T_MAX, max_spins,
    E_LOC: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
    WP: tl.constexpr,
    TRACE: tl.constexpr = False, tbuf=None,
):  # fmt: skip
    """``out[t] = sum over the ranks d holding one of token t's experts of comb[d][t]``,
    in fp32, in rank order (deterministic). Tokens routed nowhere get 0; after a failed
    dispatch (``status``) every row is NaN. The last program zeroes ``comb`` (release).

    Traced (``language.trace``; step ``d`` of program ``p`` of ``P`` is tile ``p + d P``):
    start / end; per expert rank ``d`` the wait for its rows (begin: ``d``, senders; end:
    ``d``, 0); the end of the sums in the last step (tile end: ``pid``, 0); the last
    program's release of ``comb`` (notify in step 0: slot, -1 = every rank)."""
    trace_event(TRACE, tbuf, EV_START, 0, 0, 0)
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    state = tl.load(status)
    for d in range(world):
        trace_step(TRACE, tbuf, EV_WAIT_BEGIN, d, d, n_senders)
        wait(sig + COMB_OFF + d, n_senders, err, rank, COMB_OFF + d, max_spins)
        trace_step(TRACE, tbuf, EV_WAIT_END, d, d, 0)
    cols = tl.arange(0, KP)
    own = route_idx + tl.cast(rank, tl.int64) * T_MAX * KP
    for blk in range(pid, tl.cdiv(n_tok, BT), n_prog):
        rows = blk * BT + tl.arange(0, BT)
        rmask = rows < n_tok
        rows64 = rows.to(tl.int64)
        idx = tl.load(own + rows[:, None] * KP + cols[None, :], mask=rmask[:, None], other=-1)
        dest = tl.where(idx >= 0, idx // E_LOC, -1)
        for h0 in range(0, H, BH):
            hc = h0 + tl.arange(0, BH)
            hm = hc < H
            acc = tl.zeros([BT, BH], dtype=tl.float32)
            for d in range(world):
                go = tl.max(tl.where(dest == d, 1, 0), axis=1) > 0
                src = comb + (d * T_MAX + rows64)[:, None] * H + hc[None, :]
                acc += tl.load(src, mask=go[:, None] & hm[None, :], other=0.0).to(tl.float32)
            acc = tl.where(state == 0, acc, float("nan"))
            tl.store(
                out + rows64[:, None] * H + hc[None, :], rounded(acc, out.dtype.element_ty),
                mask=rmask[:, None] & hm[None, :],
            )  # fmt: skip
    trace_step(TRACE, tbuf, EV_TILE_END, world - 1, pid, 0)
    tl.debug_barrier()
    if tl.atomic_add(sig + DONE_SLOT, 1, sem="acq_rel", scope="gpu") == n_prog - 1:
        tl.store(sig + DONE_SLOT, 0)
        tl.debug_barrier()
        for d in range(world):
            tl.atomic_xchg(sig + COMB_OFF + d, 0, sem="release", scope="sys")
        trace_step(TRACE, tbuf, EV_NOTIFY, 0, COMB_OFF, -1)
    trace_event(TRACE, tbuf, EV_END, 0, 0, 0)
