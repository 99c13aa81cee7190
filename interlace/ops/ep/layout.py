"""Sizes, launch configuration and the handle of expert-parallel dispatch / combine.

The layout itself (per destination rank and per local expert counts, prefix sums, each
pair's row in the expanded output) is computed on the GPU by
``kernels.ep.ep_layout_kernel``; this module holds the host-side description of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import InterlaceValueError
from .._context import next_pow2, replay_key


class EPCapacityError(InterlaceValueError):
    """A dispatch would have sent a rank more (token, expert) rows than the receive
    capacity the context was built with. Raised on every rank (every rank sees the whole
    routing); nothing of that call was written to the expanded outputs."""


@dataclass(frozen=True)
class EPConfig:
    """Block sizes and program counts of the dispatch / combine kernels. ``programs`` is
    the same on every rank (it depends on the context's arguments only): receivers wait
    for that many release-adds per source."""

    block_tokens: int  # tokens per block of the data kernels
    block_hidden: int  # hidden values per block (a multiple of 128 for FP8)
    layout_tokens: int  # tokens per block of the layout kernel's prefix sums
    programs: int  # programs of the data kernels
    num_warps: int = 4


def ep_config(backend: str, max_tokens: int, hidden: int, fp8: bool, sms: int = 132) -> EPConfig:
    """The kernels' configuration: on a GPU, blocks of 4 tokens x up to 1024 values and at
    most two programs per SM; in the interpreter, few small programs (it runs them one
    after another)."""
    cap_h = 1024 if backend == "cuda" else 64
    bh = min(cap_h, next_pow2(hidden))
    if fp8:
        bh = max(bh, 128)
    if backend == "cuda":
        bt = 4
        programs = max(1, min(-(-max_tokens // bt), 2 * sms))
        return EPConfig(bt, bh, 128, programs)
    return EPConfig(4, bh, 8, 2)


@dataclass
class EPHandle:
    """What :meth:`EPAllToAll.dispatch` returns on each rank.

    * ``recv_x [capacity, hidden]``: the rows this rank received, grouped by local expert
      (expert ``e``'s rows are ``expert_offsets[e] - expert_counts[e] ..
      expert_offsets[e]``), within an expert by source rank, then by the token's index at
      its source. Rows past ``expert_offsets[-1]`` are unspecified. FP8 dispatch: e4m3
      values, with ``recv_scale [capacity, hidden / 128]`` (fp32, one per 128 values).
    * ``expert_counts`` / ``expert_offsets``: int32 ``[local experts]`` on the device
      (counts and their inclusive prefix sums: ``offs`` of ``torch._grouped_mm``).

    The views alias the context's buffers: valid until the next dispatch. ``combine``
    takes this handle (the routing it needs stays on the device).
    """

    recv_x: torch.Tensor
    recv_scale: torch.Tensor | None
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    num_tokens: int
    call: int


_INDEX_DTYPES = (torch.int64, torch.int32)


def routing_args_fit(ctx, x, topk_idx, topk_weights) -> bool:
    """True when :func:`check_routing_args` would accept these inputs, judged in one
    expression (an eager call pays for every check on the host); False means "run the full
    checks", which raise the clear error."""
    device = ctx.group.device
    try:
        t = x.shape[0]
        return (
            x.dtype is ctx.dtype
            and x.dim() == 2
            and x.shape[1] == ctx.hidden
            and t <= ctx.max_tokens
            and x.is_contiguous()
            and x.device == device
            and topk_idx.dtype in _INDEX_DTYPES
            and (topk_weights.dtype is torch.float32 or topk_weights.dtype is ctx.dtype)
            and topk_idx.shape == (t, ctx.topk)
            and topk_weights.shape == (t, ctx.topk)
            and topk_idx.is_contiguous()
            and topk_weights.is_contiguous()
            and topk_idx.device == device
            and topk_weights.device == device
        )
    except (AttributeError, TypeError, IndexError):  # not tensors, or x has no dims
        return False


def check_routing_args(op, x, topk_idx, topk_weights, ctx) -> None:
    """Shapes, dtypes and devices of a dispatch's inputs; raises on bad ones (no launch)."""
    from ...errors import InterlaceTypeError

    if routing_args_fit(ctx, x, topk_idx, topk_weights):
        return  # the common case
    ctx._check_placed("x", x)
    if x.dim() != 2 or x.shape[1] != ctx.hidden or not x.is_contiguous():
        raise InterlaceValueError(
            f"{op}: x must be a contiguous [tokens, {ctx.hidden}] tensor, got "
            f"{tuple(x.shape)}{'' if x.is_contiguous() else ' (not contiguous)'}"
        )
    t = x.shape[0]
    if t > ctx.max_tokens:
        raise InterlaceValueError(
            f"{op}: {t} tokens, more than the context's max_tokens = {ctx.max_tokens}"
        )
    for name, tensor, dtypes in (
        ("topk_idx", topk_idx, _INDEX_DTYPES),
        ("topk_weights", topk_weights, (torch.float32, ctx.dtype)),
    ):
        if not isinstance(tensor, torch.Tensor):
            raise InterlaceTypeError(f"{op}: {name} must be a torch.Tensor")
        if tensor.dtype not in dtypes:
            raise InterlaceTypeError(f"{op}: {name} has dtype {tensor.dtype}, expected {dtypes}")
        if tensor.device != ctx.group.device:
            raise InterlaceValueError(
                f"{op}: {name} is on {tensor.device}, expected {ctx.group.device}"
            )
        if tuple(tensor.shape) != (t, ctx.topk) or not tensor.is_contiguous():
            raise InterlaceValueError(
                f"{op}: {name} must be a contiguous [{t}, {ctx.topk}] tensor, got "
                f"{tuple(tensor.shape)}"
            )


class EPCallChecks:
    """Mixed into the EP contexts (``OpContext`` subclasses with ``hidden``, ``experts``,
    ``topk`` and a ``bad_index`` signal region): what their dispatch and combine share."""

    def _fingerprint(self, graphed: bool = False) -> None:
        """``_begin_call`` of a dispatch or combine: the arguments every rank shares (token
        counts differ by rank); a rank that skipped a step differs in its call count.
        ``graphed``: the call's device work is one ``_enqueue`` (``OpContext._begin_call``)."""
        self._begin_call(graphed=graphed, hidden=self.hidden, experts=self.experts, topk=self.topk)

    def _replayed_dispatch(self, x, topk_idx, topk_weights):
        """The short path of a dispatch (``OpContext._armed``): ``(key, n)``, ``n`` this
        rank's tokens where a call like one that went the whole way replayed its graph at
        once, else None (the call goes the whole way, then arms ``key``)."""
        operands = (x, topk_idx, topk_weights)
        key, ptrs = replay_key("dispatch", operands)
        armed = self._armed(key)
        if armed is None:
            return key, None
        self._replay(armed, operands, ptrs)
        return key, x.shape[0]

    def _replayed_combine(self, expert_out, handle, out, handle_type):
        """The short path of a combine (``OpContext._armed``): ``(key, result)``, ``result``
        None where the call must go the whole way (then arming ``key``, None where it may
        not: a handle not of the latest dispatch, no tokens). ``out`` where given is in the
        key (its dtype, shape, strides, device and alignment: all its checks read), else
        the result is a fresh tensor."""
        if type(handle) is not handle_type or not handle.num_tokens:
            return None, None
        last = self._dispatched
        if last is None or handle.call != last[0]:
            return None, None
        n, hidden = handle.num_tokens, self.hidden
        fresh = lambda _: torch.empty(n, hidden, dtype=self.dtype, device=self.group.device)  # noqa: E731
        return self._replayed_out(("combine", n), (expert_out,), out, fresh)

    def _bad_index_error(self, rank: int, slot: int, what: str):
        """The error of an expert id outside [-1, experts), found alike on every rank
        (``what``: what the call then did), or None for another slot."""
        if slot != self.pad.offset("bad_index"):
            return None
        return InterlaceValueError(
            f"{self.op_name}: rank {rank} passed an expert id outside [-1, {self.experts}); {what}"
        )
