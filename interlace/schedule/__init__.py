"""Communication schedules (AutoOverlap's chunk abstraction): the data model, templates,
a CPU checker that proves a schedule realises its collective, and lowering to one rank's
transfers and tile tables. Pure Python; torch only for ``as_tensors``."""

from .checker import Analysis, analyze, check
from .chunks import (
    BACKENDS,
    KINDS,
    MODES,
    P2P,
    Chunk,
    Collective,
    Op,
    Ref,
    Schedule,
    ScheduleError,
    split_rows,
)
from .lowering import (
    ConsumerPlan,
    ProducerPlan,
    Transfer,
    as_tensors,
    consumer_plan,
    n_signals,
    producer_plan,
    signal_counts,
    transfers,
)
from .templates import (
    full_mesh_all_gather,
    full_mesh_reduce_scatter,
    partition_all_reduce,
    ring_all_gather,
    ring_reduce_scatter,
    swizzled_all_gather,
)

__all__ = [
    "BACKENDS",
    "KINDS",
    "MODES",
    "Analysis",
    "Chunk",
    "Collective",
    "ConsumerPlan",
    "Op",
    "P2P",
    "ProducerPlan",
    "Ref",
    "Schedule",
    "ScheduleError",
    "Transfer",
    "analyze",
    "as_tensors",
    "check",
    "consumer_plan",
    "full_mesh_all_gather",
    "full_mesh_reduce_scatter",
    "n_signals",
    "partition_all_reduce",
    "producer_plan",
    "ring_all_gather",
    "ring_reduce_scatter",
    "signal_counts",
    "split_rows",
    "swizzled_all_gather",
    "transfers",
]
