# Sourced by scripts/test.sh and scripts/bench.sh: sets $PY to a python that has torch and
# triton. Uses python3 as it is when it already has them (a GPU machine, a user's env);
# otherwise builds ./.venv with the CPU set CI runs: torch 2.13.0, triton 3.6.0, numpy < 2.3
# (Triton 3.6's interpreter breaks on numpy >= 2.3), and the optional extras the tests
# exercise (matplotlib for figures, transformers for interlace.nn.parallelize).
set -e
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if python3 - <<'PY' 2>/dev/null
import torch, triton, numpy
gpu = torch.cuda.is_available()
ok_numpy = tuple(int(v) for v in numpy.__version__.split(".")[:2]) < (2, 3)
raise SystemExit(0 if gpu or ok_numpy else 1)
PY
then
    PY=python3
    export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
else
    if [ ! -x "$root/.venv/bin/python" ] || ! "$root/.venv/bin/python" -c "import torch, triton, pytest" 2>/dev/null; then
        echo "setting up $root/.venv (torch 2.13.0 CPU, triton 3.6.0) ..." >&2
        python3 -m venv "$root/.venv"
        "$root/.venv/bin/python" -m pip install -q --upgrade pip
        "$root/.venv/bin/python" -m pip install -q "torch==2.13.0" "triton==3.6.0" "numpy<2.3"
        "$root/.venv/bin/python" -m pip install -q -e "$root[dev,cli,plot,hf]"
    fi
    PY="$root/.venv/bin/python"
fi
set +e
