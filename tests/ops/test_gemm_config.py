"""The GEMM+RS / GEMM+AR kernel's tile config (``_gemm.scatter_config``): 128-column tiles
widened to 256 columns and 8 warps where the output is wide enough and no config was
given, then shared memory made for the push / reduce epilogue."""

from __future__ import annotations

from interlace.ops.segment_gemm import SHARED_BYTES, GemmConfig, scatter_config

NARROW = GemmConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=5)
WIDE = GemmConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3)


def _fits(cfg: GemmConfig) -> bool:
    stage = (cfg.block_m + cfg.block_n) * cfg.block_k * 2
    tile = cfg.block_m * cfg.block_n * 2
    return cfg.num_stages * stage + tile * ((0.5 if cfg.subtile else 1) + 0.6) <= SHARED_BYTES


def test_narrow_tiles_widened():
    cfg = scatter_config(NARROW, n=4096)
    assert (cfg.block_n, cfg.num_warps, cfg.group_m) == (256, 8, NARROW.group_m)
    assert cfg.subtile and _fits(cfg)


def test_kept_where_asked_or_too_narrow():
    assert scatter_config(NARROW, n=4096, widen=False).block_n == 128  # a user's config
    assert scatter_config(NARROW, n=200).block_n == 128  # fewer than 256 columns
    assert _fits(scatter_config(NARROW, n=200))


def test_wide_tiles_get_epilogue_room():
    cfg = scatter_config(WIDE, n=8192)
    assert (cfg.block_n, cfg.num_warps) == (256, 8) and cfg.subtile and _fits(cfg)
