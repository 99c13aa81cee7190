#!/usr/bin/env bash
# The whole GPU job in one call: GPU test suite, then the benchmarks.
# Full logs and JSON go under $OUT (default ./gpu-out); a short table is printed last.
# Usage on the GPU machine, from the repository root:  bash scripts/gpu_suite.sh [bench args]
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Multicast / NVLS stays off on these machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-240}

{ nvidia-smi -L; nvidia-smi topo -m; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
    > "$OUT/machine.txt" 2>&1

timeout -k 10 "$TEST_TIMEOUT" python3 -m pytest -m gpu tests -q -rfEs -p no:cacheprovider --continue-on-collection-errors \
    --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.log" 2>&1
test_rc=$?

timeout -k 10 "$BENCH_TIMEOUT" python3 -m interlace bench --out "$OUT" "$@" > "$OUT/bench.log" 2>&1
bench_rc=$?

if [ -n "${PROBE:-}" ]; then
    timeout -k 10 150 python3 -m interlace.bench.overhead > "$OUT/overhead.log" 2>&1
fi

echo "== machine"; head -4 "$OUT/machine.txt"
echo "== GPU tests (rc=$test_rc)"; grep -E "^(FAILED|ERROR)|passed|failed|error" "$OUT/gpu_tests.log" | tail -25
[ -n "${PROBE:-}" ] && { echo "== overhead probe"; tail -22 "$OUT/overhead.log"; }
echo "== bench (rc=$bench_rc)"; tail -32 "$OUT/bench.log"
