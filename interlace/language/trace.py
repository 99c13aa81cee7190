"""Device half of the per-tile timeline trace: timestamped events written by a kernel into
a trace buffer, behind a compile-time switch.

A traced kernel takes ``TRACE: tl.constexpr = False`` and ``tbuf=None``. Every hook is one
statement ``trace_event(TRACE, tbuf, KIND, g, a, b)`` whose body sits under ``if TRACE:``,
so with ``TRACE`` off (and ``tbuf`` None, which Triton treats as a constant and drops from
the signature) the hooks compile to nothing and the kernel is the kernel without them.
Conventions that keep this checkable (``tests/kernels/test_trace_codegen.py`` strips the
hooks from the source and compares the compiled code):

* a hook call is one line and starts with ``trace_``;
* a traced function declares ``TRACE: tl.constexpr = False, tbuf=None`` as its last
  parameters, and a call passes them on as ``TRACE, tbuf`` (last);
* hook arguments compute nothing the kernel does not compute anyway (or only values whose
  only use is the hook, which the compiler removes with the hook).

Buffer layout (int64, ``[1 + programs * stride, 4]``; the host zeroes it): event 0 is the
header ``(stride, programs, capacity in tiles, 0)``; program ``p``'s events are the
``stride`` rows from ``1 + p * stride``, each ``(t_ns, kind, a, b)``. A program has fixed
slots, so no counter (no atomic) is needed: ``HEADER`` slots for its start and end, the
entry barrier and the final waits, then ``PER_TILE`` slots per tile it runs, the ``j``-th
tile of the program (global tile ``g``, ``j = g // programs``) owning slots
``HEADER + PER_TILE * j + (wait begin, wait end, main-loop end, notify)``. A slot whose
kind stays 0 was not written. Tiles past the capacity are not recorded.

Time: the GPU's global timer (``%globaltimer``, ns) on a GPU; in Triton's interpreter
(which cannot run inline assembly) the host's ``time.perf_counter_ns``, the same clock in
every rank process.

Event fields ``a`` / ``b`` per kind: program start / end: 0, 0; barrier: 0, rank; wait
begin: segment waited for (one-loop mode: the program's previous segment), 0; wait end:
segment, the wait's token; tile end: segment, 0; notify: segment, the rank notified (-1:
every peer); final waits: 0, 0.
"""

from __future__ import annotations

import os
import time

import triton
import triton.language as tl

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

EV_START = tl.constexpr(1)
EV_END = tl.constexpr(2)
EV_BARRIER_BEGIN = tl.constexpr(3)
EV_BARRIER_END = tl.constexpr(4)
EV_FINAL_BEGIN = tl.constexpr(5)
EV_FINAL_END = tl.constexpr(6)
EV_WAIT_BEGIN = tl.constexpr(7)
EV_WAIT_END = tl.constexpr(8)
EV_TILE_END = tl.constexpr(9)
EV_NOTIFY = tl.constexpr(10)

#: kind -> name (host side)
KIND_NAMES = {
    1: "start", 2: "end", 3: "barrier_begin", 4: "barrier_end", 5: "final_begin",
    6: "final_end", 7: "wait_begin", 8: "wait_end", 9: "tile_end", 10: "notify",
}  # fmt: skip

#: a program's header slots (indexed by kind - 1 for kinds 1-6), then per tile
HEADER = tl.constexpr(8)
PER_TILE = tl.constexpr(4)
#: per-tile slot of each per-tile kind
TILE_SLOT = {7: 0, 8: 1, 9: 2, 10: 3}


def _host_ns():
    """Host clock for the interpreter's events (one clock for every rank process)."""
    return time.perf_counter_ns()


# Called only in the interpreter branch below; marked so Triton's dependency scan (which
# walks both branches of ``if INTERPRETED``) accepts the reference.
_host_ns.__triton_builtin__ = True


@triton.jit
def global_timer():
    """Nanoseconds on the GPU's global timer (the host's clock in the interpreter)."""
    if INTERPRETED:
        return tl.full((), _host_ns(), tl.int64)
    else:
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )


@triton.jit
def trace_event(TRACE: tl.constexpr, tbuf, KIND: tl.constexpr, g, a, b):
    """Record event ``KIND`` of this program (for a per-tile kind: of its global tile
    ``g``) with fields ``a``, ``b`` and the time now. Compiles to nothing unless ``TRACE``."""
    if TRACE:
        t = global_timer()
        pid = tl.program_id(0)
        stride = tl.load(tbuf)
        cap = tl.load(tbuf + 2)
        if KIND <= 6:
            slot = KIND - 1
            ok = True
        else:
            j = g // tl.num_programs(0)
            if KIND == 7:
                slot = HEADER + PER_TILE * j
            elif KIND == 8:
                slot = HEADER + PER_TILE * j + 1
            elif KIND == 9:
                slot = HEADER + PER_TILE * j + 2
            else:
                slot = HEADER + PER_TILE * j + 3
            ok = j < cap
        row = 1 + pid.to(tl.int64) * stride + slot
        idx = tl.arange(0, 4)
        val = tl.where(idx == 0, t, tl.where(idx == 1, KIND, tl.where(idx == 2, a, b)))
        tl.store(tbuf + row * 4 + idx, val.to(tl.int64), mask=(idx < 4) & ok)


@triton.jit
def trace_step(TRACE: tl.constexpr, tbuf, KIND: tl.constexpr, j, a, b):
    """``trace_event`` in this program's ``j``-th tile slots (tile ``pid + j * programs``):
    for kernels whose programs record a fixed number of steps each. Compiles to nothing
    unless ``TRACE``."""
    if TRACE:
        trace_event(TRACE, tbuf, KIND, tl.program_id(0) + j * tl.num_programs(0), a, b)


def buffer_stride(tiles_per_program: int) -> int:
    """Event rows per program for a kernel whose programs run at most
    ``tiles_per_program`` tiles each."""
    return HEADER.value + PER_TILE.value * max(1, int(tiles_per_program))
