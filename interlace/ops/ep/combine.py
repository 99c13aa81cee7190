"""Combine of :class:`~interlace.ops.ep.dispatch.EPAllToAll`: argument checks and the two
launches (expert ranks send weighted per-token sums home; home ranks add them)."""

from __future__ import annotations

import torch

from ...errors import InterlaceValueError
from ...kernels.ep import ep_combine_recv_kernel, ep_combine_send_kernel
from .. import _trace
from .._launch import launch
from .layout import EPHandle, next_pow2

#: the combine kernels' names in traces (``interlace.trace``)
EP_COMBINE_SEND, EP_COMBINE_RECV = "ep_combine_send", "ep_combine_recv"


def check_combine_args(ctx, expert_out, handle, out) -> None:
    op = "ep_combine"
    if not isinstance(handle, EPHandle):
        raise InterlaceValueError(f"{op}: handle must be the EPHandle a dispatch returned")
    if ctx._dispatched is None or handle.call != ctx._dispatched[0]:
        raise InterlaceValueError(
            f"{op}: the handle is not from this context's latest dispatch (a handle is "
            "valid until the next dispatch)"
        )
    ctx._check_placed("expert_out", expert_out)
    want = (ctx.capacity, ctx.hidden)
    if tuple(expert_out.shape) != want or not expert_out.is_contiguous():
        raise InterlaceValueError(
            f"{op}: expert_out must be a contiguous {list(want)} tensor (one row per row "
            f"of recv_x), got {tuple(expert_out.shape)}"
        )
    if out is not None:
        ctx._check_placed("out", out)
        if tuple(out.shape) != (handle.num_tokens, ctx.hidden) or not out.is_contiguous():
            raise InterlaceValueError(
                f"{op}: out must be a contiguous [{handle.num_tokens}, {ctx.hidden}] tensor"
            )


def combine(ctx, expert_out, handle, out=None) -> torch.Tensor:
    """:meth:`EPAllToAll.combine`: a call like one that went the whole way replays its
    graph at once (``OpContext._armed``); otherwise checks, fingerprint, the launches."""
    key, result = ctx._replayed_combine(expert_out, handle, out, EPHandle)
    if result is not None:
        return result
    ctx._begin()
    out = _combine_call(ctx, expert_out, handle, out)
    ctx._arm(key)
    return out


def _combine_call(ctx, expert_out, handle, out) -> torch.Tensor:
    check_combine_args(ctx, expert_out, handle, out)
    ctx._fingerprint(graphed=True)
    n = handle.num_tokens
    if out is None:
        out = torch.empty(n, ctx.hidden, dtype=ctx.dtype, device=ctx.group.device)
    run = lambda: _combine(ctx, n, expert_out, out)  # noqa: E731
    if n == 0:
        run() if ctx.group.backend == "cpu" else ctx._enqueue("combine0", run, expert_out)
    else:
        ctx._enqueue("combine", run, expert_out, out)
    ctx._end()
    return out


def _combine(ctx, n, expert_out, out) -> None:
    tr = ({}, {})  # the launches' trace arguments: none unless recording
    if _trace.ACTIVE:  # (the call then runs eagerly, not from its graph: ``_enqueue``)
        p, w = ctx.cfg.programs, ctx.world_size
        tr = ctx._trace_args((EP_COMBINE_SEND, p, w, p * w), (EP_COMBINE_RECV, p, w, p))
    send_rows(ctx, expert_out, trace=tr[0])
    recv_sum(ctx, n, out, trace=tr[1])


def send_rows(ctx, expert_out, only_src: int = -1, trace: dict | None = None) -> None:
    """Expert side of combine: weighted per-token sums sent home. ``only_src >= 0``: only
    that home rank's tokens, ``expert_out`` holding that source's region of the
    source-major layout (``EPMoE``'s overlapped path). ``trace``: the ``TRACE`` / ``tbuf``
    arguments of a traced launch (``EPAllToAll._trace_args``)."""
    cfg, w, pad = ctx.cfg, ctx.world_size, ctx.pad
    launch(
        ep_combine_send_kernel, cfg.programs, expert_out, ctx.route_idx.local,
        ctx.route_w.local, ctx.route_n.local, ctx.pair_rel, ctx.counts, ctx.status,
        ctx.comb.local, ctx.comb.ptrs, pad.ptrs, pad.offset("comb"), ctx.error.address,
        ctx.rank, w, ctx.hidden, ctx.max_tokens, ctx.max_spins, only_src, ctx.seg_counts,
        E_LOC=ctx.e_loc, KP=ctx.kp, BT=cfg.block_tokens, BH=cfg.block_hidden,
        EP2=max(2, next_pow2(ctx.e_loc)), WP=max(2, next_pow2(w)), SRC_MAJOR=only_src >= 0,
        num_warps=cfg.num_warps, **(trace or {}),
    )  # fmt: skip


def recv_sum(ctx, n, out, trace: dict | None = None) -> None:
    """Home side of combine: the sum of the expert ranks' rows of each token (``trace``:
    as for ``send_rows``)."""
    cfg, w, pad = ctx.cfg, ctx.world_size, ctx.pad
    err, rank = ctx.error.address, ctx.rank
    launch(
        ep_combine_recv_kernel, cfg.programs, out, n, ctx.route_idx.local, ctx.comb.local,
        ctx.status, pad.buffer.local, pad.offset("comb"), pad.offset("done") + 1,
        cfg.programs, err, rank, w, ctx.hidden, ctx.max_tokens, ctx.max_spins,
        E_LOC=ctx.e_loc, KP=ctx.kp, BT=cfg.block_tokens, BH=cfg.block_hidden,
        WP=max(2, next_pow2(w)), num_warps=cfg.num_warps, **(trace or {}),
    )  # fmt: skip
