"""Results files: one JSON document per (date, device, world size) under
``benchmarks/results/`` in the format of ``docs/design.md`` ("Measuring"), and the PNG
figures drawn beside it.

Every benchmark builds plain dict records and hands them to :func:`write_records`, which
merges them into the day's file (a record replaces an earlier one that describes the same
measurement, see :func:`record_key`) and redraws the file's figures when matplotlib is
installed (``pip install interlace[plot]``).
"""

from __future__ import annotations

import datetime
import json
import os
import re

#: Fields that say *what* a record measured (never how fast): two records with the same
#: values here describe the same measurement, and the newer one replaces the older.
KEY_FIELDS = (
    "op", "strategy", "model", "dtype", "M", "N", "K", "S", "H", "I", "E", "topk", "routing",
    "batch", "heads", "kv_heads", "d", "causal", "kv_len", "tokens", "hidden", "experts",
    "mode", "as_world", "bytes_per_rank", "variant", "kernel", "layers", "train",
)  # fmt: skip

DEFAULT_OUT = "benchmarks/results"


def record_key(rec: dict) -> tuple:
    """The identity of a record: its :data:`KEY_FIELDS` values."""
    return tuple((k, json.dumps(rec.get(k))) for k in KEY_FIELDS)


def device_name(device=None) -> str:
    """The CUDA device's name, or ``"cpu"`` where there is none."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(device if device is not None else 0)


def results_path(out_dir: str, device: str, world: int, date: str | None = None) -> str:
    """``<out_dir>/<date>-<device slug>-w<world>.json``, e.g. ``2026-11-25-h100-80gb-hbm3-w1``."""
    date = date or datetime.date.today().isoformat()
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower().replace("nvidia", "")).strip("-") or "cpu"
    return os.path.join(out_dir, f"{date}-{slug}-w{world}.json")


def _complete(rec: dict) -> dict:
    """``rec`` with the fields every record has: ``op`` and ``strategy`` (required), and
    ``t_ms`` (None for a record that measured no time, e.g. a host-cost record)."""
    missing = [k for k in ("op", "strategy") if rec.get(k) is None]
    if missing:
        raise ValueError(f"a results record needs {missing}: {rec}")
    return {**rec, "t_ms": rec.get("t_ms")}


def write_records(
    out_dir: str, device: str, world: int, records: list[dict], plot: bool = True,
    versions: dict[str, str] | None = None, date: str | None = None,
) -> str:  # fmt: skip
    """Merge ``records`` into the day's results file for ``device`` and ``world``; returns its
    path. With ``plot``, the file's figures are redrawn beside it (skipped, with one line
    saying so, when matplotlib is missing). ``versions`` (``torch``, ``triton``): the
    software the records were measured with (default: this process's); ``date``: the
    file's day (default: today)."""
    import torch
    import triton

    path = results_path(out_dir, device, world, date)
    versions = versions or {
        "torch": torch.__version__.split("+")[0], "triton": triton.__version__,
    }  # fmt: skip
    doc = {
        "device": device,
        "world_size": world,
        "torch": versions["torch"],
        "triton": versions["triton"],
        "date": os.path.basename(path)[:10],
        "records": [],
    }
    if os.path.exists(path):
        with open(path) as f:
            doc["records"] = json.load(f).get("records", [])
    records = [_complete(r) for r in records]
    fresh = {record_key(r) for r in records}
    doc["records"] = [r for r in doc["records"] if record_key(r) not in fresh] + list(records)
    os.makedirs(out_dir or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    if plot:
        from .plots import plot_file

        plot_file(path, quiet=True)
    return path


def merge_file(src: str, out_dir: str = DEFAULT_OUT, plot: bool = True) -> str:
    """Merge the results file ``src`` (e.g. what a GPU machine wrote under ``$OUT``) into
    ``out_dir``'s file of the same device, world size and day, keeping the versions it
    was measured with; a record of ``src`` replaces the one of the same identity
    (:func:`record_key`). Returns the merged file's path."""
    with open(src) as f:
        doc = json.load(f)
    missing = [k for k in ("device", "world_size", "torch", "triton", "date") if k not in doc]
    if missing or not isinstance(doc.get("records"), list):
        raise ValueError(f"{src}: not a results file (missing {missing or ['records']})")
    versions = {"torch": doc["torch"], "triton": doc["triton"]}
    path = results_path(out_dir, doc["device"], doc["world_size"], doc["date"])
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if any(old.get(k) != v for k, v in versions.items()):
            print(f"note: {path} was measured with torch {old.get('torch')}, triton "
                  f"{old.get('triton')}; {src} with torch {versions['torch']}, triton "
                  f"{versions['triton']} (the file now names the latter)")  # fmt: skip
    return write_records(out_dir, doc["device"], doc["world_size"], doc["records"], plot,
                         versions=versions, date=doc["date"])  # fmt: skip


def probe_exit(records: list[dict], out: str | None) -> int:
    """A probe's end: its records written to ``out`` as JSON (where given), and its exit
    status: 0 if every record is ``ok``, else 1."""
    if out:
        with open(out, "w") as f:
            json.dump(records, f, indent=1)
    return 0 if all(r["ok"] for r in records) else 1
