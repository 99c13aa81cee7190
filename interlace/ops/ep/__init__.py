"""Expert parallelism: dispatch / combine over symmetric memory and the EP MoE layer.
Importing this package registers the custom ops ``torch.ops.interlace.ep_moe`` /
``ep_moe_backward``, ``ep_dispatch`` / ``ep_combine`` and ``ep_low_latency_dispatch`` /
``ep_low_latency_combine`` (:mod:`.library`)."""

from . import library
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
    "library",
]
