"""Tensor-parallel gated MLP: ``down(act(gate(x)) * up(x))`` with the gate and up
projections fused into one column-parallel GEMM and the down projection row-parallel.

With SiLU (Llama, Qwen2, Mixtral) the gated product's backward writes the gate and up
halves of its gradient into one tensor: autograd's chunk backward would otherwise
concatenate them, a copy of ``[tokens, 2 * I / W]`` per layer and step that the plain
model (two separate projections) does not make."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime import Group
from .linear import ColumnParallelLinear, RowParallelLinear


def _is_silu(act) -> bool:
    return act is F.silu or isinstance(act, nn.SiLU)


class _SiluGate(torch.autograd.Function):
    """``silu(gate) * up`` of ``h = [gate | up]`` (halves of the last dim): the ops of the
    unfused expression, its gradient made as one tensor shaped like ``h``."""

    @staticmethod
    def forward(ctx, h):
        gate, up = h.chunk(2, dim=-1)
        s = F.silu(gate)
        ctx.save_for_backward(h, s)
        return s * up

    @staticmethod
    def backward(ctx, dy):
        h, s = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        dh = torch.empty_like(h)
        dgate, dup = dh.chunk(2, dim=-1)
        torch.mul(dy, s, out=dup)
        torch.ops.aten.silu_backward.grad_input(dy * up, gate, grad_input=dgate)
        return dh


def gated(h: torch.Tensor, act) -> torch.Tensor:
    """``act(gate) * up`` of ``h = [gate | up]`` (halves of the last dim)."""
    if _is_silu(act) and h.requires_grad and torch.is_grad_enabled():
        if not torch.compiler.is_compiling():  # (a compiled graph fuses it anyway)
            return _SiluGate.apply(h)
    gate, up = h.chunk(2, dim=-1)
    return act(gate) * up


class ParallelMLP(nn.Module):
    """The gated MLP of Llama-style models over ``group``: ``gate_up`` holds this rank's
    slices of the gate and up weights stacked (``[2 * I / W, H]``, one AG+GEMM), ``down``
    its slice of the down weight's columns (GEMM+RS, or GEMM+AR without sequence
    parallelism). Sequence parallel (the default): ``x`` is this rank's share of the
    tokens (``[..., H]``, any leading shape) and so is the result."""

    def __init__(self, hidden_size: int, intermediate_size: int, group: Group, *,
                 act=F.silu, bias: bool = False, strategy: str = "auto",
                 down_strategy: str | None = None, sequence_parallel: bool = True,
                 dtype=None, device=None):  # fmt: skip
        super().__init__()
        self.group, self.act = group, act
        self.hidden_size, self.intermediate_size = int(hidden_size), int(intermediate_size)
        self.sequence_parallel = bool(sequence_parallel)
        i = self.intermediate_size
        self.gate_up = ColumnParallelLinear(
            hidden_size, 2 * i, group, bias, strategy=strategy, parts=[i, i],
            sequence_parallel=sequence_parallel, dtype=dtype, device=device,
        )  # fmt: skip
        self.down = RowParallelLinear(
            i, hidden_size, group, bias, strategy=down_strategy or strategy,
            sequence_parallel=sequence_parallel, dtype=dtype, device=device,
        )  # fmt: skip

    @classmethod
    def from_linears(cls, gate: nn.Linear, up: nn.Linear, down: nn.Linear, group: Group, *,
                     act=F.silu, **kw):  # fmt: skip
        """From the full ``gate``, ``up`` and ``down`` projections (sharded here)."""
        bias = gate.bias is not None
        kw.setdefault("dtype", gate.weight.dtype)
        mlp = cls(gate.in_features, gate.out_features, group, act=act, bias=bias, **kw)
        with torch.no_grad():
            mlp.gate_up.weight.copy_(mlp.gate_up.shard(torch.cat([gate.weight, up.weight])))
            mlp.down.weight.copy_(mlp.down.shard(down.weight))
            if bias:
                mlp.gate_up.bias.copy_(mlp.gate_up.shard(torch.cat([gate.bias, up.bias])))
                mlp.down.bias.copy_(down.bias)
        return mlp

    @classmethod
    def from_module(cls, mlp: nn.Module, group: Group, **kw):
        """From a transformers-style MLP with ``gate_proj``, ``up_proj``, ``down_proj`` and
        ``act_fn``."""
        return cls.from_linears(mlp.gate_proj, mlp.up_proj, mlp.down_proj, group,
                                act=getattr(mlp, "act_fn", F.silu), **kw)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:  # the plain MLP's ops
            gate, up = self.gate_up.forward_parts(x)
            return self.down(self.act(gate) * up)
        shape = x.shape
        h = self.gate_up(x.reshape(-1, shape[-1]))
        return self.down(gated(h, self.act)).view(shape)


__all__ = ["ParallelMLP", "gated"]
