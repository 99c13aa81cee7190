"""Expert parallelism: dispatch / combine over symmetric memory and the EP MoE layer."""

from .dispatch import EPAllToAll
from .ep_moe import EPMoE
from .layout import EPCapacityError, EPHandle
from .low_latency import EPLowLatency, EPLowLatencyHandle

__all__ = [
    "EPAllToAll",
    "EPCapacityError",
    "EPHandle",
    "EPLowLatency",
    "EPLowLatencyHandle",
    "EPMoE",
]
