"""The ``p2p_ring`` strategy (CommFuse): collectives decomposed into ``W - 1`` point-to-point
steps, each hidden under the compute of one sequence slice; the last step computes only.

``P2PRing`` is the context (``ag_gemm``, ``gemm_rs``, ``attn_rs``, ``attn_a2a``);
``fuse_ag`` / ``fuse_rs`` are their differentiable GEMMs and ``FuseAGLinear`` /
``FuseRSLinear`` the tensor-parallel layers built on them.
"""

from .autograd import FuseAGLinear, FuseRSLinear, fuse_ag, fuse_rs
from .context import MAX_CHUNKS, P2PRing, chunk_bounds
from .plans import SCHEDULES, partner, resolve_schedule

__all__ = [
    "MAX_CHUNKS",
    "SCHEDULES",
    "FuseAGLinear",
    "FuseRSLinear",
    "P2PRing",
    "chunk_bounds",
    "fuse_ag",
    "fuse_rs",
    "partner",
    "resolve_schedule",
]
