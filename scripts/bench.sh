#!/usr/bin/env bash
# Set up (if needed) and run the benchmark: python -m interlace bench. Extra arguments go to it.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$root" && exec "$PY" -m interlace bench "$@"
