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
* Every wait is bounded by ``max_spins``. When the bound is reached the wait records
  ``[2, rank, slot, last value]`` into the error word at address ``err`` (first timeout
  wins) and returns, so the kernel ends and the host raises ``WaitTimeoutError`` instead of
  hanging the GPU. Data guarded by a timed-out wait is masked off (see ``guard``).
* Ordering: a load guarded by a wait must take its mask from ``guard(mask, token, expected)``
  with the value the wait returned. The load then depends on the waited value, so Triton's
  software pipeliner cannot issue it before the wait (the role of Triton-distributed's
  ``consume_token``).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


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


INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


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


#: ``slot`` values at or above this name a slot on another rank's pad: ``slot +
#: (peer + 1) * REMOTE_SLOT``; the host decodes it in timeout reports.
REMOTE_SLOT = tl.constexpr(1 << 16)
#: A spinning wait re-reads the error word every this many spins, and gives up at once if
#: another wait of the launch (or of an earlier one) already timed out.
ERROR_POLL = tl.constexpr(4096)

_GE = tl.constexpr(0)  # wait until value >= expected
_EQ = tl.constexpr(1)  # wait until value == expected
_CAS = tl.constexpr(2)  # swap expected -> new, waiting until the swap succeeds


@triton.jit
def record_timeout(err, rank, slot, seen):
    """Write ``[2, rank, slot, seen]`` to the error word at address ``err`` (first wins)."""
    word = err.to(tl.pointer_type(tl.int32))
    if tl.atomic_cas(word, 0, 1, sem="acq_rel", scope="sys") == 0:
        tl.atomic_xchg(word + 1, rank, sem="relaxed", scope="sys")
        tl.atomic_xchg(word + 2, slot, sem="relaxed", scope="sys")
        tl.atomic_xchg(word + 3, seen, sem="relaxed", scope="sys")
        tl.atomic_xchg(word, 2, sem="release", scope="sys")


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
def _spin(sig, expected, new, err, rank, slot, max_spins, MODE: tl.constexpr):
    """The one bounded spin behind every wait. Returns the token: the value seen, or
    ``expected - 1`` if the wait gave up, so that ``guard`` masks the data off.

    A plain wait ends with one acquiring atomic read of the signal: it orders every later
    load after the producer's release, and it is the token ``guard`` makes loads depend on.
    """
    seen = _poll(sig, expected, new, MODE)
    spins = 0
    while (not _met(seen, expected, MODE)) & (spins < max_spins):
        if spins % ERROR_POLL == ERROR_POLL - 1:
            failed = tl.load(err.to(tl.pointer_type(tl.int32)), volatile=True)
            if failed != 0:
                spins = max_spins
        seen = _poll(sig, expected, new, MODE)
        spins += 1
    if MODE != _CAS:
        seen = tl.atomic_add(sig, 0, sem="acquire", scope="sys")
    token = seen
    if not _met(seen, expected, MODE):
        record_timeout(err, rank, slot, seen)
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
    them). Same protocol as ``wait``: volatile polls, the error word read every
    ``ERROR_POLL`` (4096) spins, one acquiring load per signal once met (the token
    depends on each); on timeout ``[2, rank, slot, seen]`` is recorded (first wins) and
    ``expected - 1`` returned. In the interpreter, ``wait`` on each."""
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
            .reg .u64 %a;
            mov.b32 $0, $2;
            setp.eq.u32 %p, $7, 0;
            @%p bra DONE;
            mov.b32 $0, 2147483647;
            mov.u32 %i, 0;
            mov.b64 %a, $1;
            SLOT:
            mov.u32 %n, 0;
            POLL:
            ld.volatile.global.u32 %v, [%a];
            setp.ge.s32 %p, %v, $2;
            @%p bra MET;
            add.u32 %n, %n, 1;
            setp.ge.u32 %p, %n, $5;
            @%p bra TIMEOUT;
            and.b32 %t, %n, 4095;
            setp.ne.u32 %p, %t, 0;
            @%p bra POLL;
            ld.volatile.global.u32 %t, [$3];
            setp.eq.u32 %p, %t, 0;
            @%p bra POLL;
            bra GIVEUP;
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
            @%p bra GIVEUP;
            st.relaxed.sys.global.u32 [$3+4], $4;
            add.u32 %t, $6, %i;
            st.relaxed.sys.global.u32 [$3+8], %t;
            st.relaxed.sys.global.u32 [$3+12], %v;
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
def consume(sig, expected, err, rank, slot, max_spins):
    """Wait until ``*sig == expected``, then reset it to 0 in the same atomic step.

    The handshake resets itself, so a signal used this way is ready for the next call and
    for CUDA-graph replays with no extra memset. Returns ``expected`` on success.
    """
    return _spin(sig, expected, 0, err, rank, slot, max_spins, _CAS)


@triton.jit
def put_flag(sig, err, rank, slot, max_spins):
    """Set a handshake flag from 0 to 1, first waiting for the previous 1 to be consumed."""
    _spin(sig, 0, 1, err, rank, slot, max_spins, _CAS)


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

    Each rank sets flag ``slot_base + rank`` on every peer, then consumes flag
    ``slot_base + peer`` of its own for every peer. Self-resetting: the same slots serve
    every later barrier and CUDA-graph replays. Run it from one program.
    """
    mine = signal_base(sig_table, rank) + slot_base
    for i in range(1, world):
        peer = (rank + i) % world
        theirs = signal_base(sig_table, peer) + slot_base
        put_flag(theirs + rank, err, rank, slot_base + rank + (peer + 1) * REMOTE_SLOT, max_spins)
    for i in range(1, world):
        peer = (rank + world - i) % world
        consume(mine + peer, 1, err, rank, slot_base + peer, max_spins)


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
