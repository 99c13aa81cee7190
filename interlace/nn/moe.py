"""Tensor-parallel mixture-of-experts block (Mixtral-style: softmax router, top-k experts,
gated expert MLPs): every rank holds a slice of every expert's intermediate features.

Sequence parallel (the default): each rank routes its own tokens, gathers every rank's
tokens and routing (``all_gather``), runs its expert slices on them, and reduce-scatters
the partial sums back to its share of the tokens; without it, the tokens are the same on
every rank and the partial sums are all-reduced. The expert GEMMs here are a per-expert
loop of torch matmuls (``strategy="none"``); the fused AG + grouped GEMM + RS ops belong to
:mod:`interlace.ops.moe` (``strategy="fused"`` needs it).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InterlaceValueError
from ..ops import autograd as _ops
from ..ops import library as _library
from ..runtime import Group
from .linear import copy_to_parallel, shard, sync_sequence_parallel_grads


def _moe_ops_available() -> bool:
    return importlib.util.find_spec("interlace.ops.moe") is not None


class MoEBlock(nn.Module):
    """``num_experts`` gated MLPs (``hidden_size`` -> ``intermediate_size``), ``top_k`` per
    token from a softmax router (weights renormalised over the top k when ``normalize``).
    ``x``: ``[..., H]``, this rank's tokens (sequence parallel) or all of them."""

    STRATEGIES = ("auto", "none", "fused")

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 group: Group, *, act=F.silu, normalize: bool = True, strategy: str = "auto",
                 sequence_parallel: bool = True, dtype=None, device=None):  # fmt: skip
        super().__init__()
        if strategy not in self.STRATEGIES:
            raise InterlaceValueError(
                f"MoEBlock: strategy must be one of {self.STRATEGIES}, got {strategy!r}"
            )
        if strategy == "fused" and not _moe_ops_available():
            raise InterlaceValueError("MoEBlock: strategy 'fused' needs interlace.ops.moe")
        if strategy == "fused":
            raise InterlaceValueError(
                "MoEBlock: strategy 'fused' is not wired to interlace.ops.moe yet; use 'none'"
            )
        w = group.world_size
        if intermediate_size % w:
            raise InterlaceValueError(
                f"MoEBlock: intermediate_size {intermediate_size} must split over {w} ranks"
            )
        self.group, self.handle = group, _library.register_group(group)
        self.hidden_size, self.intermediate_size = int(hidden_size), int(intermediate_size)
        self.num_experts, self.top_k, self.act = int(num_experts), int(top_k), act
        self.normalize, self.strategy = bool(normalize), strategy
        self.sequence_parallel = bool(sequence_parallel)
        kw = dict(dtype=dtype, device=group.device if device is None else device)
        i_loc = self.intermediate_size // w
        self.router = nn.Parameter(torch.empty(num_experts, hidden_size, **kw))
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * i_loc, hidden_size, **kw))
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, i_loc, **kw))
        for p in (self.router, self.gate_up, self.down):
            nn.init.normal_(p, std=hidden_size**-0.5)
        self.gate_up._interlace_tp = self.down._interlace_tp = True
        if self.sequence_parallel:  # the router sees this rank's tokens only
            sync_sequence_parallel_grads([self.router], group)

    def shard_gate_up(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full ``[E, 2 * I, H]`` (gate rows, then up rows) tensor."""
        i = self.intermediate_size
        return shard(full, self.group.rank, self.group.world_size, 1, [i, i])

    def shard_down(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full ``[E, H, I]`` tensor."""
        return shard(full, self.group.rank, self.group.world_size, 2)

    @classmethod
    def from_weights(cls, router, gate_up, down, top_k: int, group: Group, **kw):
        """From full weights: ``router [E, H]``, ``gate_up [E, 2 * I, H]`` (gate rows
        first), ``down [E, H, I]``."""
        kw.setdefault("dtype", gate_up.dtype)
        e, h, i = down.shape
        block = cls(h, i, e, top_k, group, **kw)
        with torch.no_grad():
            block.router.copy_(router)
            block.gate_up.copy_(block.shard_gate_up(gate_up))
            block.down.copy_(block.shard_down(down))
        return block

    @classmethod
    def from_module(cls, moe: nn.Module, group: Group, **kw):
        """From a transformers Mixtral-style sparse MoE block: ``gate`` (a router with a
        ``weight`` ``[E, H]``) and ``experts`` holding ``gate_up_proj`` / ``down_proj``
        tensors (transformers 5) or a list of ``w1`` / ``w3`` / ``w2`` linears (4.x)."""
        experts = moe.experts
        top_k = getattr(moe, "top_k", None) or getattr(moe.gate, "top_k", None)
        if hasattr(experts, "gate_up_proj"):
            gate_up, down = experts.gate_up_proj, experts.down_proj
        else:
            gate_up = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in experts])
            down = torch.stack([e.w2.weight for e in experts])
        kw.setdefault("act", getattr(experts, "act_fn", None) or experts[0].act_fn)
        kw.setdefault("normalize", bool(getattr(moe, "norm_topk_prob", True)))
        return cls.from_weights(moe.gate.weight, gate_up, down, top_k, group, **kw)

    def _route(self, x):
        logits = F.linear(x, self.router)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, index

    def _experts(self, x, weights, index):
        """This rank's slice of every expert on tokens ``x`` [T, H]: the partial sums."""
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(index == e)
            if token.numel() == 0:
                continue
            gate, up = F.linear(x[token], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down[e]) * weights[token, slot, None]
            out = out.index_add(0, token, y.to(out.dtype))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.group.world_size == 1:
            return self._experts(x2, *self._route(x2)).view(shape)
        h = self.handle
        if not self.sequence_parallel:
            weights, index = self._route(x2)
            weights = copy_to_parallel(weights, self.group)
            partial = self._experts(copy_to_parallel(x2, self.group), weights, index)
            return _ops.all_reduce(partial, h).view(shape)
        weights, index = self._route(x2)
        xs = _ops.all_gather(x2, h)
        ws = _ops.all_gather(weights, h)
        # the indices travel bit for bit as float32 words
        index = _ops.all_gather(index.to(torch.int32).view(torch.float32), h)
        index = index.view(torch.int32).long()
        partial = self._experts(xs, ws, index)
        return _ops.reduce_scatter(partial, h).view(shape)


__all__ = ["MoEBlock"]
