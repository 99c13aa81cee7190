"""Device primitives for communication inside Triton kernels (stock Triton).

Everything here is a plain ``@triton.jit`` helper built from ``tl.atomic_*`` with ``sem=``
and ``scope=`` and ordinary loads/stores, so the same source runs compiled on a GPU and in
Triton's interpreter on a CPU (the ``cpu`` backend). The one exception is
``bulk_stores_done`` (two PTX instructions, a no-op in the interpreter, which has no TMA).

Conventions
-----------
* A symmetric tensor reaches a kernel as its pointer table ``table`` (int64, one base
  address per rank). ``remote_base(table, peer, like)`` is rank ``peer``'s base, typed like
  the pointer ``like``.
* Signals are int32 words. ``notify`` releases (every write before it is visible to whoever
  acquires the signal); ``wait`` acquires.
* Every wait is bounded in time: ``max_spins`` (the name every kernel passes it under) is
  the bound in microseconds (``runtime.default_wait_bound_us``, ``INTERLACE_WAIT_TIMEOUT_S``),
  read against the GPU's global timer (``%globaltimer``) or, in the interpreter, the host
  clock. A wait that stops records ``[2, rank, slot, last value, cause, expected]`` into
  its rank's error word at address ``err`` (first wins) and returns, so the kernel ends and
  the host raises instead of hanging the GPU. Data guarded by a failed wait is masked off
  (see ``guard``).
* One fault stops every rank: the error word also holds the address of the group's fault
  word (rank 0's ``fault`` region of the signal pad, ``runtime.signals``). A wait that runs
  out of time, or a barrier that sees a peer's call fingerprint differ from its own, claims
  it; every spinning wait of every rank polls it (with its own error word) every
  ``ERROR_POLL`` spins and stops.
* Device barriers carry the call's fingerprint (this rank's ``call`` slot, also found
  through ``err``): a peer that called differently never satisfies them and is reported as
  a mismatch at once.
* Ordering: a load guarded by a wait must take its mask from ``guard(mask, token, expected)``
  with the value the wait returned. The load then depends on the waited value, so Triton's
  software pipeliner cannot issue it before the wait (the role of Triton-distributed's
  ``consume_token``).
"""

from __future__ import annotations

import os
import time

import triton
import triton.language as tl

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


def _host_clock_ns():
    """The interpreter's clock (device code calls it only where ``INTERPRETED``)."""
    return time.monotonic_ns()


_host_clock_ns.__triton_builtin__ = True  # let jit functions name it (interpreter only)


@triton.jit
def now_ns():
    """Nanoseconds of a clock that only moves forward: the GPU's global timer, or the host
    clock in the interpreter (which does not run inline PTX)."""
    if INTERPRETED:
        return tl.full([], _host_clock_ns(), tl.int64)
    else:
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )


@triton.jit
def remote_base(table, peer, like):
    """Rank ``peer``'s base address of a symmetric tensor, typed like pointer ``like``."""
    return tl.load(table + peer).to(tl.pointer_type(like.dtype.element_ty))


@triton.jit
def signal_base(table, peer):
    """Rank ``peer``'s base of a symmetric int32 signal pad."""
    return tl.load(table + peer).to(tl.pointer_type(tl.int32))


@triton.jit
def to_peer(ptrs, table, rank, peer):
    """Translate pointers into this rank's symmetric tensor into the same places on ``peer``."""
    delta = tl.load(table + peer) - tl.load(table + rank)
    return (ptrs.to(tl.int64) + delta).to(ptrs.dtype)


@triton.jit
def peer_ptr_aligned(local, table, rank, peer):
    """``local`` (a pointer into this rank's symmetric tensor) as seen on ``peer``, written
    so that Triton still knows the 16-byte alignment of ``local``: stores through it
    vectorise (a pointer loaded from the table has no known alignment, and 2-byte stores
    over NVLink crawl). Symmetric allocations are at least 16-byte aligned on every rank."""
    delta = tl.load(table + peer) - tl.load(table + rank)
    per_16 = 128 // local.dtype.element_ty.primitive_bitwidth
    return local + (delta // 16) * per_16


@triton.jit
def notify(sig, value, ADD: tl.constexpr = False, LOCAL: tl.constexpr = False):
    """Release-store ``value`` into signal ``sig`` (or release-add it when ``ADD``).

    The CTA barrier first makes every thread's earlier stores part of what the release
    publishes: Triton issues a scalar atomic from a single thread. ``LOCAL``: the signal
    and every reader of the data are on this GPU (a wait kernel, then the copy engine in
    stream order), so the release needs only GPU scope, not a system-wide fence."""
    tl.debug_barrier()
    if ADD:
        tl.atomic_add(sig, value, sem="release", scope="gpu" if LOCAL else "sys")
    else:
        tl.atomic_xchg(sig, value, sem="release", scope="gpu" if LOCAL else "sys")


@triton.jit
def bulk_stores_done():
    """Wait until this thread's TMA (bulk tensor) stores have completed, and order their
    writes before this thread's later ordinary memory operations. Call it before
    ``notify`` publishes data written with ``desc.store``: Triton only waits for a TMA
    store's shared-memory read (``wait_group.read``), not for its writes to land."""
    if not INTERPRETED:
        tl.inline_asm_elementwise(
            "cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, 0;",
            "=r", [], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def rounded(x, dtype: tl.constexpr):
    """``x`` (float32) in ``dtype``, rounded to nearest even as a GPU's conversion rounds.
    Triton's interpreter (3.6) truncates float32 -> bfloat16, which doubles a rounding's
    error; under it the value is rounded on its bits first, so that the CPU emulation's
    errors are a GPU's."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # (a NaN stays one)
    return x.to(dtype)


#: ``slot`` values at or above this name a slot on another rank's pad: ``slot +
#: (peer + 1) * REMOTE_SLOT``; the host decodes it in timeout reports.
REMOTE_SLOT = tl.constexpr(1 << 16)
#: A spinning wait reads its error word, the group's fault word and the clock every this
#: many spins: it gives up once any wait of any rank has recorded a fault, or once its
#: time is up. (A spin is about a microsecond on a GPU, a fraction of a millisecond in the
#: interpreter.)
ERROR_POLL = tl.constexpr(8 if os.environ.get("TRITON_INTERPRET", "0") == "1" else 4096)

# Why a wait stopped (``runtime.signals`` mirrors these).
CAUSE_TIMEOUT = tl.constexpr(1)
CAUSE_MISMATCH = tl.constexpr(2)
CAUSE_PEER = tl.constexpr(3)  # another wait (any rank) recorded a fault first
# A device-side argument check that every rank makes alike (``record_check``): recorded in
# this rank's error word only, so the op raises its own error and the context stays usable.
CAUSE_CHECK = tl.constexpr(5)

_GE = tl.constexpr(0)  # wait until value >= expected
_EQ = tl.constexpr(1)  # wait until value == expected
_CAS = tl.constexpr(2)  # swap expected -> new, waiting until the swap succeeds


@triton.jit
def _group_word(err):
    """Address of the group's fault word kept in the error word (0: none)."""
    return tl.load((err + 24).to(tl.pointer_type(tl.int64)))


@triton.jit
def call_fingerprint(err):
    """This call's fingerprint, from this rank's ``call`` slot (its address is kept in the
    error word); 1 where there is none (a context that does not fingerprint its calls)."""
    call = tl.load((err + 32).to(tl.pointer_type(tl.int64)))
    fp = 1
    if call != 0:
        fp = tl.load(call.to(tl.pointer_type(tl.int32)), volatile=True)
    return tl.where(fp == 0, 1, fp)


@triton.jit
def call_bump_kernel(slot, base):
    """A one-program kernel that writes the next call's fingerprint into this rank's
    ``call`` slot from the last one: ``base << 8 | (last + 1) mod 256`` (``base``: the
    call kind's part). A CUDA graph that replays a call of one kind starts with it, so
    the call count advances on the device and the host writes nothing per call."""
    last = tl.load(slot)
    tl.store(slot, (base << 8) | ((last + 1) & 0xFF))


@triton.jit
def failed(err):
    """Non-zero once a wait of this rank, or any rank's fault, has been recorded."""
    state = tl.load(err.to(tl.pointer_type(tl.int32)), volatile=True)
    group = _group_word(err)
    if group != 0:
        state = state | tl.load(group.to(tl.pointer_type(tl.int32)), volatile=True)
    return state


@triton.jit
def record_fault(err, rank, slot, seen, expected, cause):
    """Write ``[2, rank, slot, seen, cause, expected]`` to this rank's error word (first
    wins) and, for a fault found here (not ``CAUSE_PEER``), claim the group's fault word
    with ``[2, rank, cause, slot, seen, expected]`` (first of all ranks wins)."""
    word = err.to(tl.pointer_type(tl.int32))
    if tl.atomic_cas(word, 0, 1, sem="acq_rel", scope="sys") == 0:
        tl.atomic_xchg(word + 1, rank, sem="relaxed", scope="sys")
        tl.atomic_xchg(word + 2, slot, sem="relaxed", scope="sys")
        tl.atomic_xchg(word + 3, seen, sem="relaxed", scope="sys")
        tl.atomic_xchg(word + 4, cause, sem="relaxed", scope="sys")
        tl.atomic_xchg(word + 5, expected, sem="relaxed", scope="sys")
        tl.atomic_xchg(word, 2, sem="release", scope="sys")
    if (cause != CAUSE_PEER) & (cause != CAUSE_CHECK):
        group = _group_word(err)
        if group != 0:
            g = group.to(tl.pointer_type(tl.int32))
            if tl.atomic_cas(g, 0, 1, sem="acq_rel", scope="sys") == 0:
                tl.atomic_xchg(g + 1, rank, sem="relaxed", scope="sys")
                tl.atomic_xchg(g + 2, cause, sem="relaxed", scope="sys")
                tl.atomic_xchg(g + 3, slot, sem="relaxed", scope="sys")
                tl.atomic_xchg(g + 4, seen, sem="relaxed", scope="sys")
                tl.atomic_xchg(g + 5, expected, sem="relaxed", scope="sys")
                tl.atomic_xchg(g, 2, sem="release", scope="sys")


@triton.jit
def record_timeout(err, rank, slot, seen):
    """``record_fault`` of a wait that ran out of time."""
    record_fault(err, rank, slot, seen, seen + 1, CAUSE_TIMEOUT)


@triton.jit
def record_check(err, rank, slot, seen):
    """Record ``[2, rank, slot, seen, CAUSE_CHECK, 0]`` in this rank's error word (first
    wins), not in the group's fault word: for a check of the call's arguments that every
    rank makes on the same data, so every rank raises it alike and no wait is stopped."""
    record_fault(err, rank, slot, seen, 0, CAUSE_CHECK)


@triton.jit
def wait_deadline(bound_us):
    """The ``now_ns`` value at which a wait that starts now runs out of time (``bound_us``:
    the ``max_spins`` argument, microseconds)."""
    return now_ns() + bound_us.to(tl.int64) * 1000


@triton.jit
def wait_stop(err, deadline):
    """For a spin loop of its own (one that polls something other than one signal), called
    every ``ERROR_POLL`` spins: 0 to go on, else why to stop, as ``_spin`` decides it:
    ``CAUSE_PEER`` once this rank's error word or the group's fault word holds a fault,
    ``CAUSE_TIMEOUT`` once the clock passed ``deadline`` (``wait_deadline``). The loop then
    records ``record_fault(..., cause)``."""
    cause = 0
    if failed(err) != 0:
        cause = CAUSE_PEER
    elif now_ns() > deadline:
        cause = CAUSE_TIMEOUT
    return cause


@triton.jit
def _poll(sig, expected, new, MODE: tl.constexpr):
    """One look at the signal. Plain waits read it with a volatile load: many programs
    polling one word with atomics would serialise on it and slow the very transfers they
    wait for. The acquire comes after the spin (``_spin``)."""
    if MODE == _CAS:
        return tl.atomic_cas(sig, expected, new, sem="acq_rel", scope="sys")
    else:
        return tl.load(sig, volatile=True)


@triton.jit
def _met(seen, expected, MODE: tl.constexpr):
    if MODE == _GE:
        return seen >= expected
    else:
        return seen == expected


@triton.jit
def _spin(
    sig, expected, new, err, rank, slot, bound_us, MODE: tl.constexpr,
    CHECK: tl.constexpr = False,
):  # fmt: skip
    """The one bounded spin behind every wait. Returns the token: the value seen, or
    ``expected - 1`` if the wait gave up, so that ``guard`` masks the data off.

    Gives up when ``bound_us`` microseconds have passed, or when this rank's error word or
    the group's fault word is set (read every ``ERROR_POLL`` spins). ``CHECK`` (with
    ``_CAS``, a barrier's consume): the signal holds a call fingerprint, and a non-zero
    value other than ``expected`` is a peer in a different call: a mismatch, at once.

    A plain wait ends with one acquiring atomic read of the signal: it orders every later
    load after the producer's release, and it is the token ``guard`` makes loads depend on.
    """
    seen = _poll(sig, expected, new, MODE)
    start = now_ns()
    limit = bound_us.to(tl.int64) * 1000
    spins = 0
    cause = 0
    while (not _met(seen, expected, MODE)) & (cause == 0):
        if CHECK:
            if seen != 0:
                cause = CAUSE_MISMATCH
        spins += 1
        if spins % ERROR_POLL == 0:
            if failed(err) != 0:
                cause = CAUSE_PEER
            elif now_ns() - start > limit:
                cause = CAUSE_TIMEOUT
        if cause == 0:
            seen = _poll(sig, expected, new, MODE)
    if MODE != _CAS:
        seen = tl.atomic_add(sig, 0, sem="acquire", scope="sys")
    token = seen
    if not _met(seen, expected, MODE):
        record_fault(err, rank, slot, seen, expected, tl.where(cause == 0, CAUSE_TIMEOUT, cause))
        token = expected - 1
    return token


@triton.jit
def wait(sig, expected, err, rank, slot, max_spins, EQUAL: tl.constexpr = False):
    """Acquire-spin until ``*sig >= expected`` (``== expected`` when ``EQUAL``).

    Returns the token to pass to ``guard``: the value read, or ``expected - 1`` after a
    timeout. ``slot`` names the signal in a timeout report.
    """
    if EQUAL:
        return _spin(sig, expected, 0, err, rank, slot, max_spins, _EQ)
    else:
        return _spin(sig, expected, 0, err, rank, slot, max_spins, _GE)


@triton.jit
def wait_inline(sig, expected, needed, err, rank, slot, max_spins, count=1):
    """``wait`` as one inline-PTX statement, for a wait inside a software-pipelined loop:
    Triton sees no loop or branch, so the loop around it stays one pipelined loop (a
    ``wait`` there would stop Triton from pipelining it, and a scalar atomic adds CTA
    barriers). Waits for each of the ``count`` consecutive signals from ``sig`` (``slot``
    names the first) in turn and returns the smallest value seen; where ``needed`` is 0
    it returns ``expected`` at once (an earlier wait of this thread already acquired
    them). Same protocol as ``wait``: volatile polls; every ``ERROR_POLL`` (4096) spins
    the error word, the group's fault word and the global timer are read (a fault stops it,
    as does ``max_spins`` microseconds since it began); one acquiring load per signal once
    met (the token depends on each); on timeout the fault is recorded as ``record_fault``
    does (first wins) and ``expected - 1`` returned. The error block lives in host memory:
    a signal met before the first ``ERROR_POLL`` costs its polls and the acquiring load,
    with no read across PCIe. In the interpreter, ``wait`` on each."""
    if INTERPRETED:
        token = expected
        if needed != 0:
            token = wait(sig, expected, err, rank, slot, max_spins)
            for i in range(1, count):
                seen = wait(sig + i, expected, err, rank, slot + i, max_spins)
                token = tl.minimum(token, seen)
        return token
    else:
        return tl.inline_asm_elementwise(
            """{
            .reg .pred %p;
            .reg .u32 %n, %t, %i, %v;
            .reg .u64 %a, %g, %d, %e;
            mov.b32 $0, $2;
            setp.eq.u32 %p, $7, 0;
            @%p bra DONE;
            mov.b32 $0, 2147483647;
            mov.u32 %i, 0;
            mov.b64 %a, $1;
            mov.u64 %d, %globaltimer;
            cvt.u64.u32 %e, $5;
            mul.lo.u64 %e, %e, 1000;
            add.u64 %d, %d, %e;
            mov.u64 %g, 0;
            SLOT:
            mov.u32 %n, 0;
            POLL:
            ld.volatile.global.u32 %v, [%a];
            setp.ge.s32 %p, %v, $2;
            @%p bra MET;
            add.u32 %n, %n, 1;
            and.b32 %t, %n, 4095;
            setp.ne.u32 %p, %t, 0;
            @%p bra POLL;
            ld.volatile.global.u32 %t, [$3];
            setp.ne.u32 %p, %t, 0;
            @%p bra PEER;
            ld.global.u64 %g, [$3+24];
            setp.eq.u64 %p, %g, 0;
            @%p bra CLOCK;
            ld.volatile.global.u32 %t, [%g];
            setp.ne.u32 %p, %t, 0;
            @%p bra PEER;
            CLOCK:
            mov.u64 %e, %globaltimer;
            setp.lt.u64 %p, %e, %d;
            @%p bra POLL;
            bra TIMEOUT;
            MET:
            ld.acquire.sys.global.u32 %v, [%a];
            min.s32 $0, $0, %v;
            add.u32 %i, %i, 1;
            add.u64 %a, %a, 4;
            setp.lt.u32 %p, %i, $8;
            @%p bra SLOT;
            bra DONE;
            TIMEOUT:
            atom.acq_rel.sys.global.cas.b32 %t, [$3], 0, 1;
            setp.ne.u32 %p, %t, 0;
            @%p bra GROUP;
            st.relaxed.sys.global.u32 [$3+4], $4;
            add.u32 %t, $6, %i;
            st.relaxed.sys.global.u32 [$3+8], %t;
            st.relaxed.sys.global.u32 [$3+12], %v;
            mov.u32 %t, 1;
            st.relaxed.sys.global.u32 [$3+16], %t;
            st.relaxed.sys.global.u32 [$3+20], $2;
            mov.u32 %t, 2;
            st.release.sys.global.u32 [$3], %t;
            GROUP:
            setp.eq.u64 %p, %g, 0;
            @%p bra GIVEUP;
            atom.acq_rel.sys.global.cas.b32 %t, [%g], 0, 1;
            setp.ne.u32 %p, %t, 0;
            @%p bra GIVEUP;
            st.relaxed.sys.global.u32 [%g+4], $4;
            mov.u32 %t, 1;
            st.relaxed.sys.global.u32 [%g+8], %t;
            add.u32 %t, $6, %i;
            st.relaxed.sys.global.u32 [%g+12], %t;
            st.relaxed.sys.global.u32 [%g+16], %v;
            st.relaxed.sys.global.u32 [%g+20], $2;
            mov.u32 %t, 2;
            st.release.sys.global.u32 [%g], %t;
            bra GIVEUP;
            PEER:
            atom.acq_rel.sys.global.cas.b32 %t, [$3], 0, 1;
            setp.ne.u32 %p, %t, 0;
            @%p bra GIVEUP;
            st.relaxed.sys.global.u32 [$3+4], $4;
            add.u32 %t, $6, %i;
            st.relaxed.sys.global.u32 [$3+8], %t;
            st.relaxed.sys.global.u32 [$3+12], %v;
            mov.u32 %t, 3;
            st.relaxed.sys.global.u32 [$3+16], %t;
            st.relaxed.sys.global.u32 [$3+20], $2;
            mov.u32 %t, 2;
            st.release.sys.global.u32 [$3], %t;
            GIVEUP:
            sub.s32 $0, $2, 1;
            DONE:
            }""",
            "=r,l,r,l,r,r,r,r,r",
            [sig, expected, err.to(tl.pointer_type(tl.int32)), rank, max_spins, slot, needed,
             count],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


def _count_asm(scope: str) -> str:
    return f"""{{
    .reg .pred %p;
    .reg .u32 %l;
    mov.u32 $0, 0;
    setp.eq.u32 %p, $2, 0;
    @%p bra DONE;
    cp.async.bulk.wait_group 0;
    fence.proxy.async.global;
    bar.warp.sync -1;
    mov.u32 %l, %laneid;
    setp.ne.u32 %p, %l, 0;
    @%p bra DONE;
    red.release.{scope}.global.add.u32 [$1], 1;
    DONE:
    }}"""


_COUNT_GPU = tl.constexpr(_count_asm("gpu"))
_COUNT_SYS = tl.constexpr(_count_asm("sys"))


@triton.jit
def count_tile_inline(sig, needed, SYSTEM: tl.constexpr = False):
    """Release-add 1 to signal ``sig`` from each warp of the program, where ``needed`` is
    not 0, once the warp's earlier stores have landed: every thread waits for its TMA
    stores (``cp.async.bulk.wait_group 0``) and fences them, the warp synchronises, then
    its lane 0 adds (GPU scope; system scope with ``SYSTEM``, for a signal on a peer or
    data stored into one). One inline-PTX statement and no CTA barrier, so it can count
    tiles one by one inside a pipelined loop; a tile counts ``num_warps`` times. Call it
    for a tile once the next one's main loop has run (its stores are done by then), not
    right after storing it. A no-op in the interpreter, which counts with ``notify``."""
    if not INTERPRETED:
        tl.inline_asm_elementwise(
            _COUNT_SYS if SYSTEM else _COUNT_GPU, "=r,l,r", [sig, needed], dtype=tl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def count_tile(sig, needed, UNIT: tl.constexpr, SYSTEM: tl.constexpr = False):
    """``count_tile_inline`` on a GPU (each of the program's ``UNIT`` = ``num_warps`` warps
    adds 1); in the interpreter, which runs a program's stores before it goes on, one
    release-add of ``UNIT``. Either way a finished tile adds ``UNIT`` to ``sig``."""
    if INTERPRETED:
        if needed != 0:
            notify(sig, UNIT, ADD=True, LOCAL=not SYSTEM)
    else:
        count_tile_inline(sig, needed, SYSTEM)


@triton.jit
def call_flag(err):
    """The value a copy of this call raises its flags to (``OpContext.call_flag``): the
    fingerprint's op-and-arguments part, the same for every call of one kind (so a CUDA
    graph replays it), non-zero."""
    return call_fingerprint(err) >> 8


@triton.jit
def wait_call(sig, expected, err, rank, slot, max_spins):
    """Wait until ``*sig == expected``, a flag a peer's copy raised to its ``call_flag``;
    any other non-zero value is a peer in a call with other arguments: a mismatch, recorded
    at once. Returns the token for ``guard``, as ``wait``."""
    return _spin(sig, expected, 0, err, rank, slot, max_spins, _EQ, CHECK=True)


@triton.jit
def consume_call(sig, expected, err, rank, slot, max_spins):
    """``consume`` of a flag raised to a peer's ``call_flag`` (see ``wait_call``)."""
    return _spin(sig, expected, 0, err, rank, slot, max_spins, _CAS, CHECK=True)


@triton.jit
def consume(sig, expected, err, rank, slot, max_spins):
    """Wait until ``*sig == expected``, then reset it to 0 in the same atomic step.

    The handshake resets itself, so a signal used this way is ready for the next call and
    for CUDA-graph replays with no extra memset. Returns ``expected`` on success.
    """
    return _spin(sig, expected, 0, err, rank, slot, max_spins, _CAS)


@triton.jit
def put_flag(sig, err, rank, slot, max_spins, value=1):
    """Set a handshake flag from 0 to ``value`` (non-zero), first waiting for the previous
    value to be consumed."""
    _spin(sig, 0, value, err, rank, slot, max_spins, _CAS)


@triton.jit
def guard(mask, token, expected):
    """``mask`` made to depend on a wait's token: the load it guards stays after the wait
    (and is masked off entirely if the wait timed out)."""
    return mask & (token >= expected)


@triton.jit
def guard_coord(coord, token, expected, out_of_bounds):
    """``guard`` for tensor-descriptor (TMA) loads, which take no mask: the coordinate
    depends on the wait's token, and moves wholly out of bounds (the copy then fills zeros)
    if the wait timed out."""
    return tl.where(token >= expected, coord, out_of_bounds)


@triton.jit
def barrier_all(sig_table, slot_base, rank, world, err, max_spins):
    """Device-side barrier over all ranks, using slots ``[slot_base, slot_base + world)``.

    Each rank sets flag ``slot_base + rank`` on every peer to its call fingerprint
    (``call_fingerprint``), then consumes flag ``slot_base + peer`` of its own for every
    peer, expecting its own fingerprint there: a peer in a different call (other shapes,
    strategy, buffer set or call count) is reported as a mismatch at once, on both sides.
    Self-resetting: the same slots serve every later barrier and CUDA-graph replays. Run it
    from one program. Returns 1 if every peer arrived with this call's fingerprint, else 0
    (the fault is recorded).
    """
    fp = call_fingerprint(err)
    mine = signal_base(sig_table, rank) + slot_base
    for i in range(1, world):
        peer = (rank + i) % world
        theirs = signal_base(sig_table, peer) + slot_base
        put_flag(
            theirs + rank, err, rank, slot_base + rank + (peer + 1) * REMOTE_SLOT, max_spins, fp
        )
    ok = 1
    for i in range(1, world):
        peer = (rank + world - i) % world
        got = _spin(mine + peer, fp, 0, err, rank, slot_base + peer, max_spins, _CAS, True)
        ok = tl.where(got == fp, ok, 0)
    return ok


@triton.jit
def clear_slots(sig, first, count, BLOCK: tl.constexpr = 64):
    """Zero ``count`` local signal slots from ``first`` (plain stores, one program)."""
    for start in range(0, count, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(sig + first + offs, 0, mask=offs < count)


@triton.jit
def last_program_clears(sig, done_slot, first, count):
    """Called by every program of a launch as its last act: the program that arrives last
    (counted in local slot ``done_slot``, which must lie in the cleared range) zeroes the
    ``count`` local slots from ``first``. A kernel whose programs waited on those slots
    thus leaves them zero for the next launch, which then needs no clearing launch first
    (and no host-side state, so CUDA-graph replays work)."""
    tl.debug_barrier()  # every thread of this program is done
    arrived = tl.atomic_add(sig + done_slot, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        clear_slots(sig, first, count)


@triton.jit
def tile_push(src_ptrs, dst_ptrs, mask):
    """Copy a tile from local memory to (usually remote) ``dst_ptrs``."""
    tl.store(dst_ptrs, tl.load(src_ptrs, mask=mask), mask=mask)


@triton.jit
def tile_pull(src_ptrs, dst_ptrs, mask):
    """Copy a tile from (usually remote) ``src_ptrs`` into local ``dst_ptrs``."""
    tl.store(dst_ptrs, tl.load(src_ptrs, mask=mask), mask=mask)


@triton.jit
def barrier_kernel(
    sig_table, slot_base, rank, world, err, max_spins, clear_first=0, clear_count=0,
    CLEAR_BLOCK: tl.constexpr = 64,
):  # fmt: skip
    """A one-program kernel that runs ``barrier_all``, first zeroing ``clear_count`` local
    signal slots from ``clear_first``.

    Clearing here, before this rank tells its peers it has arrived, resets flags that the
    previous call read without consuming: no peer can raise them again before the barrier,
    and it saves a separate memset launch per call."""
    if clear_count > 0:
        clear_slots(signal_base(sig_table, rank), clear_first, clear_count, CLEAR_BLOCK)
        tl.debug_barrier()
    barrier_all(sig_table, slot_base, rank, world, err, max_spins)


@triton.jit
def wait_kernel(
    sig_ptr, first, count, expected, err, rank, max_spins, skip=-1, RESET: tl.constexpr = False
):
    """A one-program kernel that waits on the local signals ``first .. first + count - 1``
    except ``first + skip`` (consuming them when ``RESET``)."""
    for i in range(count):
        if i != skip:
            if RESET:
                consume(sig_ptr + first + i, expected, err, rank, first + i, max_spins)
            else:
                wait(sig_ptr + first + i, expected, err, rank, first + i, max_spins)


@triton.jit
def notify_kernel(sig_table, peer, slot, value, ADD: tl.constexpr):
    """A one-program kernel that notifies ``slot`` on rank ``peer`` (tests and tools)."""
    notify(signal_base(sig_table, peer) + slot, value, ADD)
