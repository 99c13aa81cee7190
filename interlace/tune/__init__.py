"""Tuning: ``auto``'s policy table (``policy``), tuned GEMM configs as data (``configs``),
the cost models and predictive wave-group search of ``signal_reorder`` (``search``) and the
on-disk cache of tuning results (``cache``).

``policy`` and ``configs`` are data readers that import nothing from interlace: the ops
read them. ``search`` drives the ops, so its names are imported on first use (importing it
here would make ``ops -> tune -> search -> ops`` a cycle)."""

from __future__ import annotations

import importlib

from . import cache, configs, policy


def __getattr__(name: str):
    """The names of ``search`` (``best_partition``, ``measure_model``, ...), imported on
    first use."""
    search = importlib.import_module(".search", __name__)
    if name == "search" or name in search.__all__:
        return search if name == "search" else getattr(search, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["cache", "configs", "policy", "search"]
