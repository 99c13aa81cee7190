"""Data that steers the ops, kept as JSON beside this reader.

``gemm.json``: the best segment-GEMM tile config per ``(m, n, k)``, measured on one H200
(``benchmarks/probes/tune_gemm.py --emit`` writes it). The reader returns plain dicts
(``ops.segment_gemm`` turns them into its ``GemmConfig``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
GEMM_FIELDS = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")


@functools.cache
def gemm_configs() -> dict[tuple[int, int, int], dict[str, int]]:
    """``{(m, n, k): {block_m, block_n, block_k, group_m, num_warps, num_stages}}``, plus
    ``subtile: True`` where a row says so (the output tile stored in two halves)."""
    with open(HERE / "gemm.json") as f:
        doc = json.load(f)
    table = {}
    for row in doc["configs"]:
        cfg = {name: int(row[name]) for name in GEMM_FIELDS}
        if row.get("subtile"):
            cfg["subtile"] = True
        table[(row["m"], row["n"], row["k"])] = cfg
    return table


def gemm_config_rows(table: dict[tuple[int, int, int], dict[str, int]]) -> list[dict]:
    """``table`` as the rows of ``gemm.json`` (what the tuning probe writes)."""
    return [{"m": m, "n": n, "k": k, **cfg} for (m, n, k), cfg in table.items()]


def write_gemm_configs(table: dict, about: str, path: Path | None = None) -> Path:
    """Write ``table`` (as :func:`gemm_configs` returns it) to ``gemm.json``, one config a
    line."""
    path = Path(path or HERE / "gemm.json")
    rows = gemm_config_rows(table)
    lines = ["{", f' "about": {json.dumps(about)},', ' "configs": [']
    lines += [f"  {json.dumps(r)}" + ("," if i < len(rows) - 1 else "") for i, r in enumerate(rows)]
    lines += [" ]", "}"]
    path.write_text("\n".join(lines) + "\n")
    gemm_configs.cache_clear()
    return path
