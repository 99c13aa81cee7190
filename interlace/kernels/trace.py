"""Kernels of the timeline trace: reading the GPU's global timer for clock anchoring."""

from __future__ import annotations

import triton
import triton.language as tl

from ..language.trace import global_timer


@triton.jit
def clock_kernel(out, i):
    """``out[i]`` = the global timer now (ns; the host clock in the interpreter)."""
    tl.store(out + i, global_timer())
