"""The segment GEMM's tile configs: the wave model for shapes the tuned table lacks
(``segment_gemm.modelled_config``), and the GEMM+RS / GEMM+AR kernel's config
(``scatter_config``): 128-column tiles widened to 256 columns and 8 warps where the output
is wide enough and no config was given, then shared memory made for the push / reduce
epilogue."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from interlace.ops import segment_gemm
from interlace.ops.segment_gemm import (
    SHARED_BYTES,
    GemmConfig,
    modelled_config,
    scatter_config,
    wave_efficiency,
)

NARROW = GemmConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=5)
WIDE = GemmConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3)
PROBE = Path(__file__).resolve().parents[2] / "benchmarks" / "probes" / "gemm_wave_model.py"


def test_the_model_picks_the_tiles_that_fill_the_waves():
    assert (segment_gemm.NARROW, segment_gemm.WIDE) == (NARROW, WIDE)
    # 16 x 22 = 352 wide tiles: 3 waves of 132 SMs, the last 2/3 full; 16 x 43 = 688
    # narrow tiles: 6 waves, the last 0.2 full -> 352/396 = 0.89 against 688/792 = 0.87
    assert abs(wave_efficiency(2048, 5504, WIDE, 132) - 352 / 396) < 1e-9
    assert modelled_config(2048, 5504, 132) == WIDE
    # LLaMA-3-8B AG+GEMM at TP 2, M 2048: 16 x 28 = 448 wide tiles (0.85) against 896
    # narrow ones (0.97): the narrow ones, as the tuning runs measured
    assert modelled_config(2048, 7168, 132) == NARROW
    # one wave either way and the same fill: the wide tiles
    assert modelled_config(8192, 4096, 132) == WIDE
    # a decode-sized M: 4 x 16 = 64 wide tiles leave half the SMs idle
    assert modelled_config(512, 4096, 132) == NARROW


def test_the_model_against_the_tuning_runs():
    """Over the committed H200 tuning runs, the model's pick is within 8 % of the best
    measured candidate on every shape and better than the rule it replaced."""
    spec = importlib.util.spec_from_file_location("gemm_wave_model", PROBE)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    rows = probe.measured([probe.HISTORY / name for name in probe.RUNS])
    assert len(rows) == 36
    got = probe.evaluate(rows, segment_gemm.WAVE_MARGIN)
    assert got["model"][0] < 1.08 and got["model"][1] < 1.01, got
    assert got["model"][0] < got["old rule"][0] and got["model"][1] < got["old rule"][1], got


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


def test_the_outside_models_are_outside_the_tuned_table():
    """``bench kernels --models qwen2-7b,llama2-13b`` times shapes no config was tuned for
    (so their configs come from the wave model)."""
    from interlace.bench.dense import OTHER_MODELS, model_shape
    from interlace.ops.configs import gemm_configs

    shapes = [model_shape(op, model, m, w) for op in ("ag_gemm", "gemm_rs") for model in
              OTHER_MODELS for m in (2048, 8192) for w in (2, 4, 8)]  # fmt: skip
    assert len(shapes) == 24
    assert not [s for s in shapes if (s.M, s.N, s.K) in gemm_configs()]
