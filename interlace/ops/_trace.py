"""Where the ops meet the timeline trace (``interlace.trace``): the recorders in force in
this process, the traced launch of the segment GEMM, and traced copies and stream spans.

The trace layer sits above the ops, so the ops only see a recorder through the small
interface it implements (``kernel_buffer``, ``stream_begin``, ``stream_end``); with no
recorder in force every function here falls through to the untraced path at the cost of
one list check. Calls being captured in a CUDA graph are never traced.
"""

from __future__ import annotations

import torch

from ..runtime import streams
from ..runtime.symmetric import _open_buffers
from ._launch import install_scratch_allocator


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


#: recorders in force in this process (``interlace.trace.record``), innermost last
ACTIVE: list = []


def sink():
    """The recorder in force, or None (none, or the current stream is being captured)."""
    if not ACTIVE:
        return None
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    return ACTIVE[-1]


#: the segment GEMM's flags that name what a launch is (first match)
_KERNEL_NAMES = (
    ("BROADCAST", "gemm_ar"), ("STAGE_PUSHES", "gemm_rs_ce_fused"), ("HAS_PUSH", "gemm_rs"),
    ("NOTIFY_STORES", "gemm_rs_partials"), ("HAS_OWN_A", "ag_gemm"),
)  # fmt: skip


def launch_gemm(prepared, operands) -> bool:
    """Launch the segment GEMM ``prepared`` (``ops._launch.PreparedLaunch``) on
    ``operands`` with ``TRACE`` on, its events going into a buffer of the recorder in
    force; False (nothing launched) where no recorder is in force."""
    rec = sink()
    if rec is None:
        return False
    kernel, kwargs, grid = prepared.kernel, prepared.kwargs, prepared.grid
    args = list(prepared.args)
    for i, t in zip(prepared._where, operands):
        args[i] = t
    value = dict(zip(kernel.arg_names, args))
    m, n, n_seg = int(value["M"]), int(value["N"]), int(value["n_seg"])
    tiles_n = cdiv(n, kwargs["BLOCK_N"])
    # every segment adds at most one row of tiles beyond the rows' own
    bound = (cdiv(m, kwargs["BLOCK_M"]) + n_seg) * tiles_n
    name = next((nm for flag, nm in _KERNEL_NAMES if kwargs.get(flag)), "gemm")
    info = dict(
        kernel=name, seg=value["seg"], n_seg=n_seg, seg_first=int(value["seg_first"]), M=m,
        N=n, K=int(value["K"]), rank=int(value["rank"]), grid=grid,
        block_m=kwargs["BLOCK_M"], block_n=kwargs["BLOCK_N"], one_loop=bool(kwargs["ONE_LOOP"]),
    )  # fmt: skip
    tbuf = rec.kernel_buffer(grid, cdiv(bound, grid), info)
    install_scratch_allocator()
    kernel[(grid,)](*args, **kwargs, TRACE=True, tbuf=tbuf)
    return True


def _rank_of(t: torch.Tensor):
    """The rank whose memory ``t`` lies in, found among the open symmetric buffers (None
    where it is in none)."""
    ptr = t.data_ptr()
    for buf in list(_open_buffers):
        for q, peer in enumerate(buf.peers):
            base = peer.data_ptr()
            if base <= ptr < base + buf.nbytes:
                return q
    return None


def copy_and_signal(dst, src, signal=None, index: int = 0, value: int = 1, stream=None) -> None:
    """``runtime.copy_and_signal``, recorded as a ``copy`` span on its stream (and the
    signal it writes at the span's end) when a recorder is in force."""
    rec = sink()
    if rec is None:
        streams.copy_and_signal(dst, src, signal, index, value, stream=stream)
        return
    token = rec.stream_begin(stream)
    streams.copy_and_signal(dst, src, signal, index, value, stream=stream)
    rec.stream_end(
        token, "copy", peer=_rank_of(dst), bytes=src.numel() * src.element_size(),
        signal_slot=index if signal is not None else None,
    )  # fmt: skip


def begin(stream=None):
    """Start a span of stream work on ``stream`` (default: the current one); None where no
    recorder is in force. Close it with :func:`end`."""
    rec = sink()
    return None if rec is None else (rec, rec.stream_begin(stream))


def end(span, kind: str, **meta) -> None:
    """Close a span from :func:`begin` (no-op for None)."""
    if span is not None:
        span[0].stream_end(span[1], kind, **meta)
