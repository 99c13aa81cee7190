#!/usr/bin/env bash
# Set up (if needed) and run the test suite. Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$root" && exec "$PY" -m pytest "$@"
