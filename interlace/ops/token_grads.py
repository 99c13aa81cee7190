"""What the MoE and expert-parallel custom ops' backward passes share: every rank's tokens,
output gradients and routing gathered once, in float32, and the tokens' gradients summed
back to their ranks.

The fused MoE and EP ops have no backward kernels of their own: their backward ops
recompute the unfused path in float32 on every rank's tokens (each rank then owns the
gradients of its own expert weights, and the tokens' gradients it computed for every
rank) and reduce-scatter the tokens' gradients home. :func:`gather_tokens` does the first
step, :meth:`GatheredTokens.scatter_home` the last; the per-expert chain rule between them
is each op's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .library import _all_gather, _reduce_scatter

Tensor = torch.Tensor


@dataclass
class GatheredTokens:
    """Every rank's tokens in rank order, ``rows_per_rank`` rows each (padding rows route
    to expert -1, which names no expert)."""

    x: Tensor  #: float32 [rows, hidden]
    dy: Tensor  #: float32 [rows, hidden]: the output gradients
    weights: Tensor  #: float32 [rows, topk]
    ids: Tensor  #: int64 [rows, topk]
    #: float32 zeros [rows, hidden + topk] for each op to fill: the tokens' dx, then the
    #: gradients of their routing weights
    grads: Tensor
    group: int
    world: int
    n: int  #: this rank's tokens

    def scatter_home(
        self, x_dtype: torch.dtype, weights_dtype: torch.dtype, need_x: bool, need_weights: bool,
        empty: Callable[[], Tensor],
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """``(dx, dweights)`` of this rank's tokens: every rank's share of ``grads`` summed
        (one float32 reduce-scatter), each a fresh contiguous tensor of its input's dtype;
        ``empty()`` where not needed."""
        if not (need_x or need_weights):
            return empty(), empty()
        grads = self.grads
        mine = grads if self.world == 1 else _reduce_scatter(grads, self.group, "default")
        hidden = self.x.shape[1]
        own = dict(memory_format=torch.contiguous_format, copy=True)  # (not views of mine)
        dx = mine[: self.n, :hidden].to(x_dtype, **own) if need_x else empty()
        dweights = mine[: self.n, hidden:].to(weights_dtype, **own) if need_weights else empty()
        return dx, dweights


def gather_tokens(
    x: Tensor, dy: Tensor, weights: Tensor, ids: Tensor, group: int, world: int, rows_per_rank: int
) -> GatheredTokens:  # fmt: skip
    """Gather ``x [n, hidden]``, ``dy`` and the routing ``weights`` / ``ids [n, topk]`` of
    every rank, each padded to ``rows_per_rank`` rows: one gather in the tokens' dtype
    (tokens and gradients side by side) and one in float32 (weights and expert ids, which
    float32 holds exactly)."""
    n, hidden = x.shape
    k = ids.shape[1]
    tokens = x.new_zeros(rows_per_rank, 2 * hidden)
    tokens[:n, :hidden], tokens[:n, hidden:] = x, dy
    route = torch.full((rows_per_rank, 2 * k), -1.0, dtype=torch.float32, device=x.device)
    route[:n, :k], route[:n, k:] = weights, ids
    if world > 1:
        tokens, route = _all_gather(tokens, group, "default"), _all_gather(route, group, "default")
    tokens = tokens.float()
    return GatheredTokens(
        x=tokens[:, :hidden], dy=tokens[:, hidden:], weights=route[:, :k],
        ids=route[:, k:].long(), grads=tokens.new_zeros(tokens.shape[0], hidden + k),
        group=group, world=world, n=n,
    )  # fmt: skip
