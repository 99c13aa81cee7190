"""Tuning: cost models, the predictive wave-group search of ``signal_reorder`` and the
on-disk cache of tuning results."""

from . import cache
from .predict import (
    CommCurve,
    Model,
    best_partition,
    comm_time,
    enumerate_partitions,
    errors_without,
    exhaustive_candidates,
    grade,
    mean_abs_error,
    measure_curve,
    measure_model,
    predict,
)

__all__ = [
    "CommCurve",
    "Model",
    "best_partition",
    "cache",
    "comm_time",
    "enumerate_partitions",
    "errors_without",
    "exhaustive_candidates",
    "grade",
    "mean_abs_error",
    "measure_curve",
    "measure_model",
    "predict",
]
