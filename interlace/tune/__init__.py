"""Tuning: ``auto``'s policy table (``policy``), tuned GEMM configs as data (``configs``),
the cost models and predictive wave-group search of ``signal_reorder`` (``search``) and the
on-disk cache of tuning results (``cache``).

``policy`` and ``configs`` are data readers that import nothing from interlace: the ops
read them. ``search`` drives the ops, so its names are imported on first use (importing it
here would make ``ops -> tune -> search -> ops`` a cycle)."""

from __future__ import annotations

import importlib

from . import cache, configs, policy

_SEARCH = (
    "CommCurve",
    "Model",
    "best_partition",
    "comm_time",
    "enumerate_partitions",
    "errors_without",
    "exhaustive_candidates",
    "grade",
    "mean_abs_error",
    "measure_curve",
    "measure_model",
    "predict",
)


def __getattr__(name: str):
    if name in _SEARCH:
        search = importlib.import_module(".search", __name__)
        return getattr(search, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["cache", "configs", "policy", *_SEARCH]
