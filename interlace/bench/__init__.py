"""Benchmarks: the timing protocol and the per-op benchmark bodies."""
