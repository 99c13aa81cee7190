"""Tensor-parallel mixture of experts: all-gather + grouped GEMM (+ SwiGLU)
(:class:`AGMoE`) and grouped GEMM + top-k reduce + reduce-scatter (:class:`MoERS`), with
the device-built routing they share (:class:`MoeRouting`)."""

from .ag_moe import AGMoE
from .moe_rs import MoERS
from .routing import MoeRouting

__all__ = ["AGMoE", "MoERS", "MoeRouting"]
