#!/usr/bin/env bash
# The whole GPU job in one call: the GPU test suite, then the benchmark suites.
# Full logs, JSON and PNGs go under $OUT (default ./gpu-out); the short tables are printed last.
# Usage on the GPU machine, from the repository root:  bash scripts/gpu_suite.sh [bench args]
# Environment:
#   BENCH: the suites of `python -m interlace bench`, space-separated (default: what the
#     machine can show: "shared kernels host" on one GPU, "collectives dense p2p_ring
#     signal_reorder" on several; "none": tests only), e.g. BENCH="kernels host moe ep".
#   TESTS=0 skips the GPU tests; TEST_PATHS / TEST_K pick some of them (pytest paths, -k).
#   TEST_SHARDS: groups of test paths separated by ';' run at once, group i alone on GPU i
#     with its ranks sharing it (CUDA_VISIBLE_DEVICES=i, INTERLACE_TEST_SHARE_GPU=1): the
#     one-GPU suite in parallel on a machine with several GPUs. Replaces TEST_PATHS. In
#     either, "a,b" is one pytest run of both (e.g. test ids of one file).
#     TEST_SHARDS=@FILE reads the groups from FILE, one per line ('#' lines skipped), e.g.
#     @scripts/gpu_test_shards.txt: the whole suite in four shards of about equal time.
#   INTERLACE_TEST_GPU_SIZES: the GPU worlds' rank counts (default 2,4; 2,4,8 on 8 GPUs).
#   INTERLACE_TEST_SHARE_GPU=1: worlds with more ranks than GPUs share GPU 0 (set by
#     default on a one-GPU machine).
#   TEST_TIMEOUT (per test path) / BENCH_TIMEOUT (per suite) in seconds.
#   STRATEGIES: the dense strategies (default: all but signal_reorder, which has its own
#     suite, plus auto without graph-backed eager calls).
#   SAVE_CACHE=1 packs Triton's cache (.triton_cache/) into $OUT for a later fresh machine.
#   PACK=1 writes everything into one archive, $OUT/gpu-suite.tgz (for a device call that
#     brings back only a few files), plus $OUT/summary.txt.
# Extra arguments go to every suite in BENCH, e.g. BENCH=dense ... --models llama3-8b --ms 8192.
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
FINAL_OUT=$OUT
if [ -n "${PACK:-}" ]; then OUT=$(mktemp -d); fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Multicast / NVLS stays off on these machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
# GPU worlds of 2 and 4 ranks, and 8 where there are 8 GPUs (tests/conftest.py).
if [ -z "${INTERLACE_TEST_GPU_SIZES:-}" ] && [ "$GPUS" -ge 8 ]; then
    export INTERLACE_TEST_GPU_SIZES=2,4,8
fi
if [ "$GPUS" -le 1 ]; then
    export INTERLACE_TEST_SHARE_GPU=${INTERLACE_TEST_SHARE_GPU:-1}
    BENCH=${BENCH:-shared kernels host}
else
    BENCH=${BENCH:-collectives dense p2p_ring signal_reorder}
fi
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-540}

{ nvidia-smi -L; nvidia-smi topo -m; python3 -c 'import torch, triton, numpy; print("torch", torch.__version__, "triton", triton.__version__, "numpy", numpy.__version__)'; } \
    > "$OUT/machine.txt" 2>&1

if [ "${TESTS:-1}" != 0 ]; then
    # One pytest per path, each bounded by TEST_TIMEOUT: SIGINT first, so that pytest
    # still prints the failures and tracebacks it has when its time runs out.
    run_paths() {  # run_paths LOG PATH...: one bounded pytest per path; prints the worst rc
        local log=$1 worst=0 path rc; shift
        for path in "$@"; do
            echo "#### $path" >> "$log"
            # shellcheck disable=SC2086 # a path "a,b" is one pytest of both
            timeout -s INT -k 20 "$TEST_TIMEOUT" python3 -m pytest -m gpu ${path//,/ } -k "${TEST_K:-}" \
                -q -rfEs --tb=short -p no:cacheprovider --continue-on-collection-errors \
                >> "$log" 2>&1
            rc=$?
            # 5: nothing selected in this path
            if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then worst=$rc; fi
        done
        echo "$worst"
    }
    : > "$OUT/gpu_tests.log"; test_rc=0
    case "${TEST_SHARDS:-}" in
        @*) TEST_SHARDS=$(grep -v '^#' "${TEST_SHARDS:1}" | grep -v '^ *$' | paste -sd ';' -) ;;
    esac
    if [ -n "${TEST_SHARDS:-}" ]; then
        IFS=';' read -ra shards <<< "$TEST_SHARDS"
        for i in "${!shards[@]}"; do
            : > "$OUT/gpu_tests.shard$i.log"
            # shellcheck disable=SC2086 # a shard: several paths
            (CUDA_VISIBLE_DEVICES=$i INTERLACE_TEST_SHARE_GPU=1 \
                run_paths "$OUT/gpu_tests.shard$i.log" ${shards[$i]} > "$OUT/gpu_tests.shard$i.rc") &
        done
        wait
        for i in "${!shards[@]}"; do
            echo "######## shard $i on GPU $i: ${shards[$i]}" >> "$OUT/gpu_tests.log"
            cat "$OUT/gpu_tests.shard$i.log" >> "$OUT/gpu_tests.log"
            rc=$(cat "$OUT/gpu_tests.shard$i.rc")
            if [ "$rc" != 0 ]; then test_rc=$rc; fi
        done
    else
        # shellcheck disable=SC2086 # TEST_PATHS: several paths
        test_rc=$(run_paths "$OUT/gpu_tests.log" ${TEST_PATHS:-tests})
    fi
else
    echo "skipped (TESTS=0)" > "$OUT/gpu_tests.log"; test_rc=skipped
fi

declare -A rcs
for suite in $BENCH; do
    [ "$suite" = none ] && continue
    extra=()
    if [ "$suite" = dense ]; then
        extra=(--strategies "${STRATEGIES:-auto,auto:eager_graphs=0,fused,ce_fused,ce_scatter,ring,sm_pull,none}")
    fi
    timeout -s INT -k 20 "$BENCH_TIMEOUT" python3 -m interlace bench "$suite" --out "$OUT" "${extra[@]}" "$@" \
        > "$OUT/bench-$suite.log" 2>&1
    rcs[$suite]=$?
done

if [ -n "${SAVE_CACHE:-}" ]; then
    tar -C "$TRITON_CACHE_DIR" -czf - . | split -b 15m - "$OUT/triton-cache.tgz."
fi

summary() {
    echo "== machine"; head -5 "$OUT/machine.txt"
    echo "== GPU tests (rc=$test_rc)"; grep -E "^(####|FAILED|ERROR)|passed|failed|error|Interrupted" "$OUT/gpu_tests.log" | tail -60
    for suite in $BENCH; do
        [ "$suite" = none ] && continue
        echo "== bench $suite (rc=${rcs[$suite]})"
        # the lines a suite prints per check, then its table to the end (the tail on a crash)
        grep -E "^(shared GPU|shared-GPU|note |dense:|error)" "$OUT/bench-$suite.log" | head -40
        if grep -qE "^ *(interlace |fused kernels|host time|gemm_ar signal_reorder)|┏" "$OUT/bench-$suite.log"; then
            sed -n '/^ *\(interlace \|fused kernels\|host time\|gemm_ar signal_reorder\)/,$p' "$OUT/bench-$suite.log" | tail -80
        else
            tail -25 "$OUT/bench-$suite.log"
        fi
    done
    if [ "$GPUS" -le 1 ]; then echo "cross-GPU overlap needs two or more GPUs"; fi
}
if [ -n "${PACK:-}" ]; then
    summary | tee "$OUT/summary.txt"
    tar -C "$OUT" -czf "$FINAL_OUT/gpu-suite.tgz" .
    cp "$OUT/summary.txt" "$FINAL_OUT/"
else
    summary
fi
true
