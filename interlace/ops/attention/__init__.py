"""Attention ops: sequence-parallel attention (prefill and training) and distributed
flash-decode."""

from .flash_decode import DecodeConfig, FlashDecode
from .sp_attention import SPAttention, zigzag_shard, zigzag_unshard

__all__ = ["DecodeConfig", "FlashDecode", "SPAttention", "zigzag_shard", "zigzag_unshard"]
