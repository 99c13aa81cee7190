"""Attention ops: sequence-parallel attention (prefill and training)."""

from .flash_decode import DecodeConfig, FlashDecode  # noqa: F401
from .sp_attention import SPAttention, zigzag_shard, zigzag_unshard

__all__ = ["SPAttention", "zigzag_shard", "zigzag_unshard"]
