"""Multi-rank test harness: run a test body on W spawned ranks (CPU emulation or GPUs)."""

from .world import World, WorldError, run_world

__all__ = ["World", "WorldError", "run_world"]
