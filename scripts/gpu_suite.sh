#!/usr/bin/env bash
# The whole GPU job in one call: GPU test suite, then the benchmarks.
# Full logs and JSON go under $OUT (default ./gpu-out); the short tables are printed last.
# Usage on the GPU machine, from the repository root:  bash scripts/gpu_suite.sh [bench args]
# Environment: SUITE=collectives|dense|p2p_ring|signal_reorder|all|none (default all: every one; none: tests only),
# TESTS=0 skips the GPU tests, TEST_PATHS / TEST_K pick some of them (pytest paths, -k),
# INTERLACE_TEST_GPU_SIZES: the GPU worlds' rank counts (default 2,4; 2,4,8 on 8 GPUs),
# INTERLACE_TEST_SHARE_GPU=1: worlds with more ranks than GPUs share GPU 0 (protocol only),
# TEST_TIMEOUT / BENCH_TIMEOUT / P2P_TIMEOUT / SR_TIMEOUT in seconds (P2P_TIMEOUT=0 skips p2p_ring), PROBE=1 adds the host-overhead probe,
# STRATEGIES: the dense strategies (default: all but signal_reorder, which has its own run,
# plus auto without graph-backed eager calls),
# SAVE_CACHE=1 packs Triton's cache (.triton_cache/, kept on a warm machine) into $OUT so a
# later call on a fresh machine can carry it instead of compiling every kernel again.
# Extra arguments go to `python -m interlace bench`, e.g. --models llama3-8b --ms 8192.
set -u
OUT=${OUT:-$PWD/gpu-out}
SUITE=${SUITE:-all}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Multicast / NVLS stays off on these machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
# GPU worlds of 2 and 4 ranks, and 8 where there are 8 GPUs (tests/conftest.py).
if [ -z "${INTERLACE_TEST_GPU_SIZES:-}" ] && [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -ge 8 ]; then
    export INTERLACE_TEST_GPU_SIZES=2,4,8
fi
TEST_TIMEOUT=${TEST_TIMEOUT:-400}
if [ "$SUITE" = collectives ]; then BENCH_TIMEOUT=${BENCH_TIMEOUT:-240}; else BENCH_TIMEOUT=${BENCH_TIMEOUT:-540}; fi

{ nvidia-smi -L; nvidia-smi topo -m; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
    > "$OUT/machine.txt" 2>&1

if [ "${TESTS:-1}" != 0 ]; then
    # shellcheck disable=SC2086 # TEST_PATHS: several paths
    timeout -k 10 "$TEST_TIMEOUT" python3 -m pytest -m gpu ${TEST_PATHS:-tests} -k "${TEST_K:-}" -q -rfEs \
        -p no:cacheprovider --continue-on-collection-errors \
        --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.log" 2>&1
    test_rc=$?
else
    echo "skipped (TESTS=0)" > "$OUT/gpu_tests.log"; test_rc=skipped
fi

MAIN_SUITE=$SUITE
case "$SUITE" in p2p_ring|signal_reorder|none) MAIN_SUITE="" ;; esac
bench_rc=skipped
if [ -n "$MAIN_SUITE" ]; then
    timeout -k 10 "$BENCH_TIMEOUT" python3 -m interlace bench --suite "$MAIN_SUITE" --out "$OUT" \
        --strategies "${STRATEGIES:-auto,auto:eager_graphs=0,fused,ce_fused,ce_scatter,ring,sm_pull,none}" "$@" > "$OUT/bench.log" 2>&1
    bench_rc=$?
fi
# The two strategies with their own runners (sliced layers; wave-group search).
p2p_rc=skipped; sr_rc=skipped
if { [ "$SUITE" = all ] && [ "${P2P_TIMEOUT:-150}" != 0 ]; } || [ "$SUITE" = p2p_ring ]; then
    timeout -k 10 "${P2P_TIMEOUT:-150}" python3 -m interlace.bench.p2p_ring --out "$OUT" > "$OUT/p2p_ring.log" 2>&1
    p2p_rc=$?
fi
if [ "$SUITE" = all ] || [ "$SUITE" = signal_reorder ]; then
    timeout -k 10 "${SR_TIMEOUT:-240}" python3 -m interlace.bench.signal_reorder --out "$OUT" --ms 8192 > "$OUT/signal_reorder.log" 2>&1
    sr_rc=$?
fi

if [ -n "${PROBE:-}" ]; then
    timeout -k 10 150 python3 -m interlace.bench.overhead > "$OUT/overhead.log" 2>&1
fi

if [ -n "${SAVE_CACHE:-}" ]; then
    tar -C "$TRITON_CACHE_DIR" -czf - . | split -b 15m - "$OUT/triton-cache.tgz."
fi

echo "== machine"; head -4 "$OUT/machine.txt"
echo "== GPU tests (rc=$test_rc)"; grep -E "^(FAILED|ERROR)|passed|failed|error" "$OUT/gpu_tests.log" | tail -25
[ -n "${PROBE:-}" ] && { echo "== overhead probe"; tail -22 "$OUT/overhead.log"; }
echo "== bench $SUITE (rc=$bench_rc)"
# From the first results table to the end (tables, notes, file written); the tail on a crash.
if [ ! -f "$OUT/bench.log" ]; then
    echo "skipped"
elif grep -qE "interlace (collectives|dense ops)" "$OUT/bench.log"; then
    grep -E "^(dense|error)" "$OUT/bench.log" | head -5
    sed -n '/interlace \(collectives\|dense ops\)/,$p' "$OUT/bench.log"
else
    tail -32 "$OUT/bench.log"
fi
echo "== p2p_ring (rc=$p2p_rc)"; [ -f "$OUT/p2p_ring.log" ] && tail -12 "$OUT/p2p_ring.log"
echo "== signal_reorder (rc=$sr_rc)"; [ -f "$OUT/signal_reorder.log" ] && sed -n '/^gemm_ar signal_reorder/,$p' "$OUT/signal_reorder.log"
true
