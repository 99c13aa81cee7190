"""Tuning: the cost models and predictive wave-group search of ``signal_reorder``
(``search``) and the on-disk cache of tuning results (``cache``). The search measures the
ops, so this layer stands above them; the tables the ops read at run time (``auto``'s
policy, the tuned GEMM configs) are :mod:`interlace.ops.policy` and
:mod:`interlace.ops.configs`."""

from __future__ import annotations

from . import cache, search
from .search import (
    MAX_FIRST,
    MAX_LAST,
    CommCurve,
    Model,
    best_partition,
    comm_time,
    device_name,
    enumerate_partitions,
    errors_without,
    exhaustive_candidates,
    grade,
    mean_abs_error,
    measure_curve,
    measure_model,
    predict,
    time_ms,
)

__all__ = [
    "cache",
    "search",
    "MAX_FIRST",
    "MAX_LAST",
    "CommCurve",
    "Model",
    "best_partition",
    "comm_time",
    "device_name",
    "enumerate_partitions",
    "errors_without",
    "exhaustive_candidates",
    "grade",
    "mean_abs_error",
    "measure_curve",
    "measure_model",
    "predict",
    "time_ms",
]
