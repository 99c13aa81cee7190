"""An expert-parallel MoE layer: dispatch, one linear map per local expert, combine::

    moe = interlace.EPMoE(group, max_tokens=4096, hidden=7168, experts=256, topk=8)
    y = moe(x, topk_idx, topk_weights, weight)   # weight [local experts, hidden, hidden]

Strategies:

* ``fused``: :class:`~interlace.ops.ep.dispatch.EPAllToAll` dispatch (symmetric memory,
  no host synchronisation), ``torch._grouped_mm`` over the expanded rows (its ``offs``
  come from the device), then the combine.
* ``none``: ``all_to_all_single`` (split sizes read back to the host) +
  ``torch._grouped_mm`` + ``all_to_all_single`` (:mod:`.baseline`).

The grouped GEMM runs after the whole dispatch: it does not yet start on each source
rank's rows as they land, nor does combine send rows as their tiles finish.
"""

from __future__ import annotations

import torch

from ...errors import InterlaceTypeError, InterlaceValueError
from .baseline import a2a_combine, a2a_dispatch
from .dispatch import EPAllToAll


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor):
    """``rows[segment e] @ weight[e]`` for each expert segment (``offsets``: inclusive
    prefix sums of the segment sizes, int32, on the device)."""
    return torch._grouped_mm(rows, weight, offs=offsets)


class EPMoE:
    """See the module docstring. Collective: every rank calls with its own tokens."""

    STRATEGIES = ("fused", "none")
    op_name = "ep_moe"

    def __init__(
        self, group, max_tokens: int, hidden: int, experts: int, topk: int,
        dtype: torch.dtype = torch.bfloat16, strategy: str = "fused",
        capacity: int | None = None, **options,
    ):  # fmt: skip
        if strategy not in self.STRATEGIES:
            raise InterlaceValueError(
                f"{self.op_name}: strategy must be one of {self.STRATEGIES}, got {strategy!r}"
            )
        self.group, self.strategy, self.dtype = group, strategy, dtype
        self.hidden, self.experts, self.topk = int(hidden), int(experts), int(topk)
        self.e_loc = self.experts // group.world_size
        self.a2a = EPAllToAll(
            group, max_tokens, hidden, experts, topk, dtype, capacity=capacity, **options
        )

    def _check_weight(self, weight) -> None:
        if not isinstance(weight, torch.Tensor):
            raise InterlaceTypeError(f"{self.op_name}: weight must be a torch.Tensor")
        want = (self.e_loc, self.hidden, self.hidden)
        if tuple(weight.shape) != want or weight.dtype != self.dtype:
            raise InterlaceValueError(
                f"{self.op_name}: weight must be {list(want)} of {self.dtype}, got "
                f"{tuple(weight.shape)} of {weight.dtype}"
            )
        if weight.device != self.group.device:
            raise InterlaceValueError(
                f"{self.op_name}: weight is on {weight.device}, expected {self.group.device}"
            )

    def __call__(self, x, topk_idx, topk_weights, weight) -> torch.Tensor:
        self._check_weight(weight)
        if self.strategy == "none":
            from .layout import check_routing_args

            check_routing_args(self.op_name, x, topk_idx, topk_weights, self.a2a)
            rows, _, offsets, state = a2a_dispatch(
                self.group, x, topk_idx, topk_weights, self.experts
            )
            return a2a_combine(self.group, grouped_linear(rows, weight, offsets), state)
        handle = self.a2a.dispatch(x, topk_idx, topk_weights)
        rows = grouped_linear(handle.recv_x, weight, handle.expert_offsets)
        return self.a2a.combine(rows, handle)

    def check(self) -> None:
        self.a2a.check()

    def close(self) -> None:
        self.a2a.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
