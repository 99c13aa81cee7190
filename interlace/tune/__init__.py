"""Tuning: the cost models and predictive wave-group search of ``signal_reorder``
(:mod:`~interlace.tune.search`: ``best_partition``, ``measure_model``, ``grade``, ...) and
the on-disk cache of tuning results (``cache``). The search measures the ops, so this layer
stands above them; the tables the ops read at run time (``auto``'s policy, the tuned GEMM
configs) are :mod:`interlace.ops.policy` and :mod:`interlace.ops.configs`."""

from __future__ import annotations

from . import cache, search

__all__ = ["cache", "search"]
