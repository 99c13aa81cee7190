"""Kernels of the low-latency expert-parallel dispatch and combine (kernels only; the
context is ``interlace.ops.ep.low_latency``). One kernel per direction: every program
first sends its share, then receives its share, so a call is one launch and needs no
layout pass, no host synchronisation and no separate flag kernel.

Words and epochs. Every arrival is recognised by the call's *epoch*, a counter the
kernels keep on the device (``epochs[0]`` dispatch, ``epochs[1]`` combine; the last
program of a launch stores the new value), so CUDA-graph replays advance it too. A word
is an int64 ``(epoch << 32) | payload`` (payload: 4 bytes). Receive buffers are double
buffered by the epoch's parity: a sender can be at most one call ahead of a receiver
(each call waits for a word from every peer, sent at its start), so the half it writes
was read by everyone two calls ago, and a word tagged with an older epoch is never
mistaken for this call's.

Two protocols (``FLAG_IN_DATA``), chosen by measurement:

* flag in data: every 8-byte word of a row carries 4 bytes of the row and the epoch; the
  receiver polls the row's words themselves until every one carries this call's epoch
  (twice the bytes on the wire, no ordering needed: a word is stored in one piece).
* one flag per token: rows are plain 4-byte words; after a row, the sender's program
  barrier plus a release exchange of the row's meta word (token, k, epoch) publishes it;
  the receiver polls the meta word and acquires before reading the row.

Count words (rows per (expert, source); ``-1 - n`` marks a source that passed an expert id
out of range) and meta words always carry the epoch in their high half.

Buffers (``W`` ranks, ``T`` = max tokens per rank, ``E_LOC`` local experts, ``KP`` top-k
padded to a power of two, ``HW`` = hidden / 2 words of two 16-bit values; a dispatch
message is ``RW = QW + SW`` 4-byte words: ``QW`` words of values, ``HW``, or hidden / 4
words of four e4m3 bytes with FP8, then ``SW`` words of fp32 scales, hidden / 128 with
FP8, else none):

* dispatch, symmetric: ``d_count [2, E_LOC, W]``, ``d_meta [2, E_LOC, W, T]``,
  ``d_data [2, E_LOC, W, T, RW]``: segment ``(e, s)`` on rank ``d`` holds source ``s``'s
  rows for ``d``'s local expert ``e``, packed in token order; meta = ``t * KP + k``
  (``k`` the first slot of the token naming the expert: a token reaches an expert once).
* dispatch, local outputs: ``recv [E_LOC, W * T, QW]`` (expert ``e``'s rows packed by
  source, then token), with FP8 ``recv_scale [E_LOC, W * T, SW]``, ``recv_src [E_LOC,
  W * T]`` = ``(s * T + t) * KP + k``, ``layout
  [E_LOC, W, 2]`` (first row and rows of each source), ``counts [E_LOC]``, and the home
  routing ``home_idx [T, KP]`` / ``home_w [T, KP]`` (kept for combine).
* combine, symmetric: ``c_arrive [W]`` (peer ``s`` started combine ``epoch``),
  ``c_meta [2, KP, T]``, ``c_data [2, KP, T, HW]``: row ``(k, t)`` of the home rank is its
  token ``t``'s output of expert ``home_idx[t, k]``, sent unweighted by the expert rank;
  the home rank sums ``weight * row`` in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..language.primitives import (
    CAUSE_TIMEOUT,
    ERROR_POLL,
    peer_ptr_aligned,
    record_check,
    record_fault,
    rounded,
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
from .ep import FP8_GROUP, quantise_e4m3

LOW32 = tl.constexpr(0xFFFFFFFF)


@triton.jit
def _word(payload, epoch):
    """``(epoch << 32) | payload`` as int64 (payload: int32, any shape)."""
    return (tl.cast(epoch, tl.int64) << 32) | (tl.cast(payload, tl.int64) & LOW32)


@triton.jit
def _epoch_of(word):
    return (word >> 32).to(tl.int32)


@triton.jit
def _payload(word):
    return word.to(tl.int32)


@triton.jit
def _poll_word(ptr, epoch, err, rank, slot, max_spins, AT_LEAST: tl.constexpr = False):
    """Spin (volatile loads) until the word at ``ptr`` carries ``epoch`` (or a later one
    with ``AT_LEAST``); returns the word. Bounded as ``primitives.wait`` (``max_spins``
    microseconds; it stops once any rank of the group recorded a fault): a wait that stops
    is recorded in the error word and returns a word whose payload is 0."""
    w = tl.load(ptr, volatile=True)
    deadline = wait_deadline(max_spins)
    spins = 0
    cause = 0
    if AT_LEAST:
        met = _epoch_of(w) - epoch >= 0
    else:
        met = _epoch_of(w) == epoch
    while (not met) & (cause == 0):
        spins += 1
        if spins % ERROR_POLL == 0:
            cause = wait_stop(err, deadline)
        w = tl.load(ptr, volatile=True)
        if AT_LEAST:
            met = _epoch_of(w) - epoch >= 0
        else:
            met = _epoch_of(w) == epoch
    if not met:
        cause = tl.where(cause == 0, CAUSE_TIMEOUT, cause)
        record_fault(err, rank, slot, _epoch_of(w), epoch, cause)
        w = _word(0, epoch)
    return w


@triton.jit
def _poll_acquire(ptr, epoch, err, rank, slot, max_spins):
    """``_poll_word``, then one acquiring read of the word: the loads after it see what
    the sender stored before its release of the word."""
    w = _poll_word(ptr, epoch, err, rank, slot, max_spins)
    w2 = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    return tl.where(_epoch_of(w2) == epoch, w2, w)


@triton.jit
def _poll_row(ptrs, mask, epoch, err, rank, slot, max_spins):
    """Spin until every word of a row chunk carries ``epoch``; returns the words. Bounded
    as ``_poll_word``; a wait that stops records how many words were missing."""
    w = tl.load(ptrs, mask=mask, other=0, volatile=True)
    missing = tl.sum((mask & (_epoch_of(w) != epoch)).to(tl.int32))
    deadline = wait_deadline(max_spins)
    spins = 0
    cause = 0
    while (missing > 0) & (cause == 0):
        spins += 1
        if spins % ERROR_POLL == 0:
            cause = wait_stop(err, deadline)
        w = tl.load(ptrs, mask=mask, other=0, volatile=True)
        missing = tl.sum((mask & (_epoch_of(w) != epoch)).to(tl.int32))
    if missing > 0:
        record_fault(err, rank, slot, missing, 0, tl.where(cause == 0, CAUSE_TIMEOUT, cause))
    return w


@triton.jit
def _publish(ptr, word, FLAG_IN_DATA: tl.constexpr):
    """Store a meta word: plainly (flag in data: the row's own words carry the epoch), or
    after a CTA barrier with a release exchange (one flag per token: it publishes the
    row every thread of the program stored before it)."""
    if FLAG_IN_DATA:
        tl.store(ptr, word)
    else:
        tl.debug_barrier()
        tl.atomic_xchg(ptr, word, sem="release", scope="sys")


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _pack_bytes(q, N: tl.constexpr):
    """uint8 ``q [N]`` as ``N / 4`` int32 words, the first byte lowest (little endian, so
    the words stored are the bytes in order)."""
    b = tl.reshape(q.to(tl.int32), [N // 4, 4])
    shift = tl.arange(0, 4) * 8
    return tl.reduce(b << shift[None, :], 1, _or)


@triton.jit
def _store_words(ptr, v, mask, epoch, FLAG_IN_DATA: tl.constexpr):
    """Store int32 payload words ``v`` into a message: as ``(epoch, payload)`` int64 words
    (flag in data) or plain int32 words at the same word index."""
    if FLAG_IN_DATA:
        tl.store(ptr, _word(v, epoch), mask=mask)
    else:
        tl.store(ptr.to(tl.pointer_type(tl.int32)), v, mask=mask)


@triton.jit
def _nth_set(flags, rows, i):
    """Index of the ``i``-th set entry of ``flags`` (0/1, 1-D) and its position."""
    pos = tl.cumsum(flags, 0) - 1
    return tl.sum(tl.where((flags != 0) & (pos == i), rows, 0))


@triton.jit
def trace_phase(TRACE: tl.constexpr, tbuf, KIND: tl.constexpr, before, unit, a, b):
    """``language.trace.trace_step`` for ``unit`` of a phase whose units are dealt to the
    ``G`` programs round robin (``unit`` on program ``unit % G``, in the phase's step
    ``unit // G``) and whose steps come after those of a phase of ``before`` units.
    Compiles to nothing unless ``TRACE``."""
    if TRACE:
        G = tl.num_programs(0)
        trace_step(TRACE, tbuf, KIND, tl.cdiv(before, G) + unit // G, a, b)


@triton.jit
def _peers(idx, use, E_LOC: tl.constexpr):
    """Bit ``q`` set for each rank ``q`` (below 63) holding an expert of ``idx`` where
    ``use``: the ranks whose rows a home token reads (a trace field)."""
    q = (idx // E_LOC).to(tl.int64)
    return tl.reduce(tl.where(use & (q < 63), tl.full(q.shape, 1, tl.int64) << q, 0), 0, _or)


@triton.jit
def _finish(epochs, which, epoch):
    """The launch's last program to get here stores the new epoch (every program read the
    old one at its start) and zeroes the arrival counter ``epochs[2 + which]``."""
    tl.debug_barrier()
    done = epochs + 2 + which
    if tl.atomic_add(done, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(done, 0)
        tl.atomic_xchg(epochs + which, epoch, sem="release", scope="gpu")


@triton.jit
def ll_dispatch_kernel(
    x, n_tok, topk_idx, topk_w, home_idx, home_w,
    d_count, count_tab, d_meta, meta_tab, d_data, data_tab,
    recv, recv_scale, recv_src, layout, counts, epochs, err, rank, world, n_experts, K, T,
    H, QW, SW, BAD_SLOT, SLOT_BASE, max_spins,
    E_LOC: tl.constexpr, KP: tl.constexpr, TP: tl.constexpr, BW: tl.constexpr,
    BQ: tl.constexpr, FLAG_IN_DATA: tl.constexpr, FP8: tl.constexpr,
    TRACE: tl.constexpr = False, tbuf=None,
):  # fmt: skip
    """Send: program ``p`` handles global experts ``p, p + G, ...``: the tokens naming the
    expert (each once), in token order, go to the expert's rank, segment ``(e, rank)``;
    the count word first, then each row and its meta word. ``FP8``: each row is
    quantised on the way, ``BQ`` values at a time, by ``kernels.ep.quantise_e4m3`` (again
    for each expert the token goes to), into a message of e4m3 bytes then its scales. Receive:
    program ``p`` handles segments ``(e, s)``: it reads the count words of sources up to
    ``s`` (the segment's first row in ``recv``), then copies each row as it lands
    (``FP8``: the scale words into ``recv_scale``).

    Traced (``language.trace``; step ``i`` of program ``p`` of ``G`` is tile ``p + i G``):
    start / end; the send of global expert ``e`` in tile ``e`` (tile end: its rank, rows
    sent); then, from step ``S = cdiv(n_experts, G)`` on, the receive of segment ``j`` in
    tile ``S G + j``: its wait (begin: source, local expert; end: source, rows seen so
    far), whose end is rewritten after each arrival it polls (the count words, each row's
    meta word, with ``FLAG_IN_DATA`` each chunk of the row's words), so it ends when the
    segment's last word was seen; then the end of its copies (tile end: source, rows)."""
    trace_event(TRACE, tbuf, EV_START, 0, 0, 0)
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    epoch = tl.load(epochs) + 1
    par = epoch % 2
    rows = tl.arange(0, TP)
    cols = tl.arange(0, KP)
    rmask = rows < n_tok
    m = rmask[:, None] & (cols < K)[None, :]
    src = rows[:, None].to(tl.int64) * K + cols[None, :]
    idx = tl.load(topk_idx + src, mask=m, other=-1).to(tl.int32)
    wrong = m & ((idx >= n_experts) | (idx < -1))
    bad = tl.sum(wrong.to(tl.int32)) > 0
    idx = tl.where(wrong, -1, idx)
    if pid == 0:  # the home routing, for combine
        tl.store(home_idx + rows[:, None] * KP + cols[None, :], idx, mask=rows[:, None] < T)
        w = tl.load(topk_w + src, mask=m, other=0.0).to(tl.float32)
        tl.store(home_w + rows[:, None] * KP + cols[None, :], w, mask=rows[:, None] < T)
    wc = tl.arange(0, BW)
    x32 = x.to(tl.pointer_type(tl.int32))
    RW = QW + SW
    # ---------------------------------------------------------------- send
    for e in range(pid, n_experts, G):
        d = e // E_LOC
        el = e % E_LOC
        eq = idx == e
        hit = tl.max(eq.to(tl.int32), axis=1)
        kf = tl.min(tl.where(eq, cols[None, :], KP), axis=1)
        cnt = tl.sum(hit)
        seg = (par * E_LOC + el) * world + rank  # segment (e, rank) of this parity
        c_word = _word(tl.where(bad, -1 - cnt, cnt), epoch)
        tl.store(peer_ptr_aligned(d_count, count_tab, rank, d) + seg, c_word)
        meta = peer_ptr_aligned(d_meta, meta_tab, rank, d) + tl.cast(seg, tl.int64) * T
        data = peer_ptr_aligned(d_data, data_tab, rank, d) + tl.cast(seg, tl.int64) * T * RW
        for i in range(cnt):
            t = _nth_set(hit, rows, i)
            k = tl.sum(tl.where(rows == t, kf, 0))
            row_dst = data + tl.cast(i, tl.int64) * RW
            if FP8:
                qc = tl.arange(0, BQ)
                qwc = tl.arange(0, BQ // 4)
                gc = tl.arange(0, BQ // FP8_GROUP)
                row_src = x + tl.cast(t, tl.int64) * H
                for h0 in range(0, H, BQ):
                    v = tl.load(row_src + h0 + qc, mask=h0 + qc < H, other=0.0)
                    q, sc = quantise_e4m3(tl.reshape(v, [1, BQ]), 1, BQ)
                    words = _pack_bytes(tl.reshape(q, [BQ]), BQ)
                    at = h0 // 4 + qwc
                    _store_words(row_dst + at, words, at < QW, epoch, FLAG_IN_DATA)
                    sw = tl.reshape(sc, [BQ // FP8_GROUP]).to(tl.int32, bitcast=True)
                    g = h0 // FP8_GROUP + gc
                    _store_words(row_dst + QW + g, sw, g < SW, epoch, FLAG_IN_DATA)
            else:
                row_src = x32 + tl.cast(t, tl.int64) * QW
                for w0 in range(0, QW, BW):
                    wm = w0 + wc < QW
                    v = tl.load(row_src + w0 + wc, mask=wm)
                    _store_words(row_dst + w0 + wc, v, wm, epoch, FLAG_IN_DATA)
            _publish(meta + i, _word(t * KP + k, epoch), FLAG_IN_DATA)
        trace_event(TRACE, tbuf, EV_TILE_END, e, d, cnt)
    # ---------------------------------------------------------------- receive
    recv32 = recv.to(tl.pointer_type(tl.int32))
    rs32 = recv_scale.to(tl.pointer_type(tl.int32))
    for j in range(pid, E_LOC * world, G):
        el = j // world
        s = j % world
        trace_phase(TRACE, tbuf, EV_WAIT_BEGIN, n_experts, j, s, el)
        first = 0
        for s2 in range(s):
            seg2 = (par * E_LOC + el) * world + s2
            w2 = _poll_word(d_count + seg2, epoch, err, rank, SLOT_BASE + s2, max_spins)
            c2 = _payload(w2)
            first += tl.where(c2 < 0, -1 - c2, c2)
        seg = (par * E_LOC + el) * world + s
        cw = _payload(_poll_word(d_count + seg, epoch, err, rank, SLOT_BASE + s, max_spins))
        trace_phase(TRACE, tbuf, EV_WAIT_END, n_experts, j, s, 0)
        if cw < 0:
            record_check(err, s, BAD_SLOT, 0)
        cnt = tl.where(cw < 0, -1 - cw, cw)
        tl.store(layout + j * 2, first)
        tl.store(layout + j * 2 + 1, cnt)
        if s == world - 1:
            tl.store(counts + el, first + cnt)
        meta = d_meta + tl.cast(seg, tl.int64) * T
        data = d_data + tl.cast(seg, tl.int64) * T * RW
        for i in range(cnt):
            if FLAG_IN_DATA:
                mw = _poll_word(meta + i, epoch, err, rank, SLOT_BASE + s, max_spins)
            else:
                mw = _poll_acquire(meta + i, epoch, err, rank, SLOT_BASE + s, max_spins)
            trace_phase(TRACE, tbuf, EV_WAIT_END, n_experts, j, s, i + 1)
            info = _payload(mw)
            row = el * world * T + first + i
            tl.store(recv_src + row, (s * T + info // KP) * KP + info % KP)
            row_src = data + tl.cast(i, tl.int64) * RW
            row_dst = recv32 + tl.cast(row, tl.int64) * QW
            for w0 in range(0, RW, BW):
                c = w0 + wc
                wm = c < RW
                if FLAG_IN_DATA:
                    v = _payload(
                        _poll_row(row_src + c, wm, epoch, err, rank, SLOT_BASE + s, max_spins)
                    )
                    trace_phase(TRACE, tbuf, EV_WAIT_END, n_experts, j, s, i + 1)
                else:
                    v = tl.load(row_src.to(tl.pointer_type(tl.int32)) + c, mask=wm)
                tl.store(row_dst + c, v, mask=c < QW)
                if FP8:
                    sm = (c >= QW) & wm
                    tl.store(rs32 + tl.cast(row, tl.int64) * SW + (c - QW), v, mask=sm)
        trace_phase(TRACE, tbuf, EV_TILE_END, n_experts, j, s, cnt)
    _finish(epochs, 0, epoch)
    trace_event(TRACE, tbuf, EV_END, 0, 0, 0)


@triton.jit
def _unpack(p, IS_BF16: tl.constexpr):
    """The two 16-bit values (bfloat16, else float16) of int32 words ``p``, low half
    first, as fp32."""
    if IS_BF16:
        lo = (p << 16).to(tl.float32, bitcast=True)
        hi = (p & -65536).to(tl.float32, bitcast=True)
    else:
        lo = (p & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (p >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _pack(lo, hi, IS_BF16: tl.constexpr):
    """fp32 ``lo`` / ``hi`` rounded to bfloat16 (else float16) and packed into int32
    words (low first)."""
    if IS_BF16:
        a = rounded(lo, tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        b = rounded(hi, tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) << 16
    else:
        a = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        b = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16
    return a | b


@triton.jit
def ll_combine_kernel(
    expert_out, out, n_tok, home_idx, home_w, recv_src, layout,
    c_arrive, arrive_tab, c_meta, meta_tab, c_data, data_tab,
    epochs, err, rank, world, T, HW, SLOT_BASE, ARRIVE_SLOT, max_spins,
    E_LOC: tl.constexpr, KP: tl.constexpr, BW: tl.constexpr, IS_BF16: tl.constexpr,
    FLAG_IN_DATA: tl.constexpr,
    TRACE: tl.constexpr = False, tbuf=None,
):  # fmt: skip
    """Send: program 0 first stores this call's epoch into ``c_arrive[rank]`` of every
    rank; program ``p`` handles segments ``(e, s)`` of the last dispatch and sends each of
    their rows of ``expert_out [E_LOC, W * T, hidden]`` to row ``(k, t)`` of home rank
    ``s``. Receive: program ``p`` handles home tokens ``p, p + G, ...``: for each distinct
    expert of the token, it waits for that expert's row and adds it, times the sum of
    the token's weights naming that expert, in fp32. Tokens routed nowhere get 0.

    Traced (``language.trace``; step ``i`` of program ``p`` of ``G`` is tile ``p + i G``):
    start / end; program 0's arrival words (notify in step 0: epoch, -1 = every rank); the
    send of segment ``j`` in tile ``j`` (tile end: home rank, rows sent); with ``S =
    cdiv(E_LOC W, G)``, program 0's wait for rank ``q``'s arrival word, at its end, in
    step ``S + q`` (begin / end: ``q``, 0); home token ``t`` in tile ``(S + W) G + t``:
    its wait (begin: ``t``, the mask of the ranks whose rows it reads; end: ``t``, 0),
    whose end is rewritten after each arrival it polls (each row's meta word; with
    ``FLAG_IN_DATA`` each chunk of a row's words, inside the sum), so it ends when the
    token's last word was seen; then the end of its sum (tile end: ``t``, 0)."""
    trace_event(TRACE, tbuf, EV_START, 0, 0, 0)
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    epoch = tl.load(epochs + 1) + 1
    par = epoch % 2
    wc = tl.arange(0, BW)
    if pid == 0:
        for i in range(world):
            d = (rank + i) % world
            tl.store(peer_ptr_aligned(c_arrive, arrive_tab, rank, d) + rank, _word(0, epoch))
        trace_event(TRACE, tbuf, EV_NOTIFY, 0, epoch, -1)
    # ---------------------------------------------------------------- send
    eo32 = expert_out.to(tl.pointer_type(tl.int32))
    for j in range(pid, E_LOC * world, G):
        el = j // world
        s = j % world
        first = tl.load(layout + j * 2)
        cnt = tl.load(layout + j * 2 + 1)
        meta = peer_ptr_aligned(c_meta, meta_tab, rank, s) + par * KP * T
        data = peer_ptr_aligned(c_data, data_tab, rank, s) + tl.cast(par, tl.int64) * KP * T * HW
        for i in range(cnt):
            row = el * world * T + first + i
            info = tl.load(recv_src + row)
            t = (info // KP) % T
            k = info % KP
            slot = k * T + t
            row_src = eo32 + tl.cast(row, tl.int64) * HW
            row_dst = data + tl.cast(slot, tl.int64) * HW
            for w0 in range(0, HW, BW):
                wm = w0 + wc < HW
                v = tl.load(row_src + w0 + wc, mask=wm)
                if FLAG_IN_DATA:
                    tl.store(row_dst + w0 + wc, _word(v, epoch), mask=wm)
                else:
                    tl.store(row_dst.to(tl.pointer_type(tl.int32)) + w0 + wc, v, mask=wm)
            _publish(meta + slot, _word(rank, epoch), FLAG_IN_DATA)
        trace_event(TRACE, tbuf, EV_TILE_END, j, s, cnt)
    # ---------------------------------------------------------------- receive
    cols = tl.arange(0, KP)
    out32 = out.to(tl.pointer_type(tl.int32))
    meta = c_meta + par * KP * T
    data = c_data + tl.cast(par, tl.int64) * KP * T * HW
    for t in range(pid, n_tok, G):
        idx = tl.load(home_idx + t * KP + cols)
        w = tl.load(home_w + t * KP + cols)
        valid = idx >= 0
        same = (idx[:, None] == idx[None, :]) & valid[:, None]
        earlier = tl.sum((same & (cols[None, :] < cols[:, None])).to(tl.int32), axis=1)
        use = valid & (earlier == 0)
        wsum = tl.sum(tl.where(same, w[None, :], 0.0), axis=1)
        trace_phase(TRACE, tbuf, EV_WAIT_BEGIN, (E_LOC + G) * world, t, t, _peers(idx, use, E_LOC))
        for k in tl.static_range(KP):
            if tl.sum(tl.where(cols == k, use.to(tl.int32), 0)) != 0:
                slot = k * T + t
                if not FLAG_IN_DATA:
                    _poll_acquire(meta + slot, epoch, err, rank, SLOT_BASE + k, max_spins)
                    trace_phase(TRACE, tbuf, EV_WAIT_END, (E_LOC + G) * world, t, t, 0)
        for w0 in range(0, HW, BW):
            wm = w0 + wc < HW
            acc_lo = tl.zeros([BW], dtype=tl.float32)
            acc_hi = tl.zeros([BW], dtype=tl.float32)
            for k in tl.static_range(KP):
                on = tl.sum(tl.where(cols == k, use.to(tl.int32), 0)) != 0
                if on:
                    wk = tl.sum(tl.where(cols == k, wsum, 0.0))
                    ptrs = data + tl.cast((k * T + t), tl.int64) * HW + w0 + wc
                    if FLAG_IN_DATA:
                        v = _payload(
                            _poll_row(ptrs, wm, epoch, err, rank, SLOT_BASE + k, max_spins)
                        )
                        trace_phase(TRACE, tbuf, EV_WAIT_END, (E_LOC + G) * world, t, t, 0)
                    else:
                        v = tl.load(ptrs.to(tl.pointer_type(tl.int32)), mask=wm, other=0)
                    lo, hi = _unpack(v, IS_BF16)
                    acc_lo += wk * lo
                    acc_hi += wk * hi
            tl.store(
                out32 + tl.cast(t, tl.int64) * HW + w0 + wc, _pack(acc_lo, acc_hi, IS_BF16), mask=wm
            )
        trace_phase(TRACE, tbuf, EV_TILE_END, (E_LOC + G) * world, t, t, 0)
    if pid == 0:
        for s in range(world):
            trace_phase(TRACE, tbuf, EV_WAIT_BEGIN, E_LOC * world, s * G, s, 0)
            _poll_word(c_arrive + s, epoch, err, rank, ARRIVE_SLOT + s, max_spins, AT_LEAST=True)
            trace_phase(TRACE, tbuf, EV_WAIT_END, E_LOC * world, s * G, s, 0)
    _finish(epochs, 1, epoch)
    trace_event(TRACE, tbuf, EV_END, 0, 0, 0)
