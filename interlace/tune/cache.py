"""A small on-disk cache for tuning results: one JSON file per key.

The directory is ``$INTERLACE_CACHE_DIR`` or ``~/.cache/interlace``. A key is the canonical
JSON of a kind and its fields (shape, dtype, world size, device, ...), so equal fields give
the same entry on every run; the file name is the kind plus a hash of the key, and the file
stores the key itself, so a hash collision reads as a miss. Writes are atomic (a temporary
file renamed into place), so ranks or processes sharing the directory never read half a
file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """Where entries live: ``$INTERLACE_CACHE_DIR`` or ``~/.cache/interlace``."""
    env = os.environ.get("INTERLACE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "interlace"


def cache_key(kind: str, **fields) -> str:
    """The canonical key of an entry of ``kind`` described by ``fields`` (JSON values)."""
    return json.dumps({"kind": kind, **fields}, sort_keys=True, separators=(",", ":"))


def _path(key: str) -> Path:
    kind = json.loads(key)["kind"]
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache_dir() / f"{kind}-{digest}.json"


def load(key: str):
    """The value stored under ``key``, or None (missing, unreadable or another key)."""
    try:
        with open(_path(key)) as f:
            entry = json.load(f)
    except (OSError, ValueError):
        return None
    return entry.get("value") if entry.get("key") == key else None


def store(key: str, value) -> Path:
    """Store ``value`` (JSON-serialisable) under ``key``; returns the file."""
    path = _path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "value": value}, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


__all__ = ["cache_dir", "cache_key", "load", "store"]
