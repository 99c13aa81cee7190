"""Where the ops meet the timeline trace (``interlace.trace``): the recorders in force in
this process, the traced launch of the segment GEMM, trace buffers for the other traced
kernels (the grouped GEMM of ``AGMoE``, the attention kernels of ``SPAttention``, the
``signal_reorder`` GEMM, ...), and traced copies and stream spans.

The trace layer sits above the ops, so the ops only see a recorder through the small
interface it implements (``kernel_buffer``, ``stream_begin``, ``stream_end``); with no
recorder in force every function here falls through to the untraced path at the cost of
one list check. Calls being captured in a CUDA graph are never traced.
"""

from __future__ import annotations

import torch

from ..errors import InterlaceValueError
from ..runtime import streams
from ..runtime.symmetric import _open_buffers
from ._launch import install_scratch_allocator


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


#: recorders in force in this process (``interlace.trace.record``), innermost last
ACTIVE: list = []


def hopper_untraced(device) -> bool:
    """Whether a kernel without trace hooks (the Gluon Hopper kernels) may run on
    ``device``: a Hopper GPU (compute capability 9) and no recorder in force (a recorded
    call runs the Triton kernels, whose tiles the trace records)."""
    return not ACTIVE and torch.cuda.get_device_capability(device)[0] == 9


def sink():
    """The recorder in force, or None (none, or the current stream is being captured)."""
    if not ACTIVE:
        return None
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    return ACTIVE[-1]


#: How the trace decodes a launch's buffer (``info["layout"]``): ``segments``: the segment
#: GEMM (``info["seg"]``: its segment table; the default); ``tiles``: a persistent kernel
#: whose program ``p`` runs tiles ``p, p + grid, ...`` each after at most one wait (the
#: grouped GEMM; the ``signal_reorder`` GEMM); ``steps``: a ``(grid_m, columns)`` grid
#: whose buffer holds one block of ``grid_m`` programs per column, each program's ``j``-th
#: tile slots its step ``j`` (the attention forward and dQ: one step per K/V chunk; dK/dV:
#: its key block, then its push; the backward's reduction, one column: one step per
#: source rank).
LAYOUTS = ("segments", "tiles", "steps")

#: the kernels' names in traces (beside the segment GEMM's, ``_KERNEL_NAMES``)
GROUPED_GEMM = "moe_gemm"
ATTENTION_FWD = "sp_attn_fwd"
#: ``SPAttention``'s backward kernels (the ``delta`` kernel before them is not traced)
ATTENTION_DKDV = "sp_attn_dkdv"
ATTENTION_DQ = "sp_attn_dq"
ATTENTION_REDUCE = "sp_attn_reduce"
#: the ``signal_reorder`` strategy's GEMM (``kernels.signal_gemm``)
SIGNAL_GEMM = "signal_gemm"
#: ``EPLowLatency``'s two kernels (``EPAllToAll``'s names: ``ops.ep.dispatch``, ``combine``)
EP_LL_DISPATCH = "ep_ll_dispatch"
EP_LL_COMBINE = "ep_ll_combine"

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
        kernel=name, layout="segments", seg=value["seg"], n_seg=n_seg,
        seg_first=int(value["seg_first"]), M=m, N=n, K=int(value["K"]),
        rank=int(value["rank"]), grid=grid, block_m=kwargs["BLOCK_M"],
        block_n=kwargs["BLOCK_N"], one_loop=bool(kwargs["ONE_LOOP"]),
    )  # fmt: skip
    tbuf = rec.kernel_buffer(grid, cdiv(bound, grid), info)
    install_scratch_allocator()
    kernel[(grid,)](*args, **kwargs, TRACE=True, tbuf=tbuf)
    return True


def buffer(grid: int, tiles_per_program: int, info: dict, columns: int = 1):
    """A zeroed trace buffer from the recorder in force for a launch of ``grid`` programs
    (per column, ``columns`` of them: layout ``steps``) of at most ``tiles_per_program``
    tiles (steps) each; ``info`` (``kernel``, ``layout``, ...) says how to decode it. None
    where no recorder is in force: launch untraced."""
    rec = sink()
    if rec is None:
        return None
    if info.get("layout") not in LAYOUTS:
        got = info.get("layout")
        raise InterlaceValueError(f"trace layout must be one of {LAYOUTS}, got {got!r}")
    return rec.kernel_buffer(grid, tiles_per_program, dict(info, columns=columns), columns)


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


def copy_and_signal(
    dst, src, signal=None, index: int = 0, value: int = 1, stream=None, what: str | None = None
) -> None:
    """``runtime.copy_and_signal``, recorded as a ``copy`` span on its stream (and the
    signal it writes at the span's end) when a recorder is in force; ``what``: what the
    copy carries (kept in the span's args)."""
    rec = sink()
    if rec is None:
        streams.copy_and_signal(dst, src, signal, index, value, stream=stream)
        return
    token = rec.stream_begin(stream)
    streams.copy_and_signal(dst, src, signal, index, value, stream=stream)
    rec.stream_end(
        token, "copy", peer=_rank_of(dst), bytes=src.numel() * src.element_size(),
        signal_slot=index if signal is not None else None,
        **({} if what is None else dict(what=what)),
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
