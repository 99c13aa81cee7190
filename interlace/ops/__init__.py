"""Public ops: contexts that own their buffers and launch communication and compute."""

from .ag_gemm import AGGemm
from .collectives import AllGather, AllReduce, ReduceScatter
from .gemm_ar import GemmAR
from .gemm_rs import GemmRS
from .p2p_ring import FuseAGLinear, FuseRSLinear, P2PRing, fuse_ag, fuse_rs
from .signal_reorder import SignalReorderGemmA2A, SignalReorderGemmAR, SignalReorderGemmRS

__all__ = [
    "AGGemm",
    "AllGather",
    "AllReduce",
    "FuseAGLinear",
    "FuseRSLinear",
    "GemmAR",
    "GemmRS",
    "P2PRing",
    "ReduceScatter",
    "SignalReorderGemmA2A",
    "SignalReorderGemmAR",
    "SignalReorderGemmRS",
    "fuse_ag",
    "fuse_rs",
]
