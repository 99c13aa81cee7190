"""Public ops: contexts that own their buffers and launch communication and compute."""

from .ag_gemm import AGGemm
from .attention import DecodeConfig, FlashDecode, SPAttention, zigzag_shard, zigzag_unshard
from .collectives import AllGather, AllReduce, ReduceScatter
from .ep import EPAllToAll, EPCapacityError, EPHandle, EPLowLatency, EPLowLatencyHandle, EPMoE
from .gemm_ar import GemmAR
from .gemm_rs import GemmRS
from .moe import AGMoE, MoeRouting, MoERS
from .p2p_ring import FuseAGLinear, FuseRSLinear, P2PRing, fuse_ag, fuse_rs
from .signal_reorder import SignalReorderGemmA2A, SignalReorderGemmAR, SignalReorderGemmRS

__all__ = [
    "AGGemm",
    "AGMoE",
    "AllGather",
    "AllReduce",
    "DecodeConfig",
    "EPAllToAll",
    "EPCapacityError",
    "EPHandle",
    "EPLowLatency",
    "EPLowLatencyHandle",
    "EPMoE",
    "FlashDecode",
    "FuseAGLinear",
    "FuseRSLinear",
    "GemmAR",
    "GemmRS",
    "MoERS",
    "MoeRouting",
    "P2PRing",
    "ReduceScatter",
    "SPAttention",
    "SignalReorderGemmA2A",
    "SignalReorderGemmAR",
    "SignalReorderGemmRS",
    "fuse_ag",
    "fuse_rs",
    "zigzag_shard",
    "zigzag_unshard",
]
