"""How well the segment GEMM's wave model (``interlace.ops.segment_gemm.modelled_config``)
picks a tile config, read against the committed H200 tuning runs: for every measured shape,
the time of the config the model picks over the best measured candidate's, next to the
same ratio for the rule it replaced and for the wide tiles alone, at several margins.

    python benchmarks/probes/gemm_wave_model.py [RUN.json ...]   (no GPU)
"""

from __future__ import annotations

import ast
import json
import math
import re
import sys
from pathlib import Path

from interlace.ops.segment_gemm import NARROW, WIDE, GemmConfig, modelled_config

HISTORY = Path(__file__).resolve().parents[1] / "results" / "history"
RUNS = ("2026-11-21-h200-gemm-tuning-run1.json", "2026-11-22-h200-gemm-tuning-run2.json")
H200_SMS = 132


def _config(text: str) -> GemmConfig | None:
    """A candidate as the tuning probe wrote it (``GemmConfig(block_m=128, ...)``)."""
    fields = {k: ast.literal_eval(v) for k, v in re.findall(r"(\w+)=(\w+)", text)}
    return GemmConfig(**fields) if "block_n" in fields else None


def measured(paths) -> list[tuple[int, int, int, dict[GemmConfig, float]]]:
    """``(M, N, K, {config: ms})`` of every shape of the tuning runs at ``paths``."""
    rows = []
    for path in paths:
        for r in json.loads(Path(path).read_text())["results"]:
            times = {}
            for c in r["configs"]:
                cfg = _config(str(c["config"])) if "t_ms" in c else None
                if cfg is not None:
                    times[cfg] = c["t_ms"]
            if WIDE in times and NARROW in times:
                rows.append((r["M"], r["N"], r["K"], times))
    return rows


def _old_rule(m: int, n: int, k: int) -> GemmConfig:
    return NARROW if (k <= 4096 and n <= 8192 and n % 256 != 0) else WIDE


def evaluate(rows, margin: float, sms: int = H200_SMS) -> dict[str, tuple[float, float]]:
    """``{picker: (worst, geometric mean)}`` of picked time / best measured time."""
    pickers = {
        "model": lambda m, n, k: modelled_config(m, n, sms, margin),
        "old rule": _old_rule,
        "wide only": lambda m, n, k: WIDE,
    }
    out = {}
    for name, pick in pickers.items():
        ratios = [t[pick(m, n, k)] / min(t.values()) for m, n, k, t in rows]
        out[name] = (max(ratios), math.exp(sum(map(math.log, ratios)) / len(ratios)))
    return out


def main(argv: list[str]) -> None:
    paths = argv or [HISTORY / name for name in RUNS]
    rows = measured(paths)
    print(f"{len(rows)} measured shapes; picked / best measured time (worst, geometric mean)")
    for margin in (1.0, 1.03, 1.05, 1.08, 1.1):
        cells = ", ".join(f"{k} {w:.3f} / {g:.3f}" for k, (w, g) in evaluate(rows, margin).items())
        print(f"margin {margin:.2f}: {cells}")


if __name__ == "__main__":
    main(sys.argv[1:])
