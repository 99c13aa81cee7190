"""Best segment-GEMM config per shape, measured by scripts/tune_gemm.py on one H200
(generated; edit by re-running the script with --emit)."""

from ._gemm import GemmConfig

TUNED = {
    (2048, 5504, 4096): GemmConfig(
        block_m=128, block_n=256, block_k=64, group_m=16, num_warps=8, num_stages=3
    ),
    (2048, 4096, 5504): GemmConfig(
        block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3
    ),
    (8192, 5504, 4096): GemmConfig(
        block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=5
    ),
    (8192, 4096, 5504): GemmConfig(
        block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3
    ),
    (2048, 7168, 4096): GemmConfig(
        block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=5
    ),
    (2048, 4096, 7168): GemmConfig(
        block_m=128, block_n=256, block_k=64, group_m=16, num_warps=8, num_stages=3
    ),
    (8192, 7168, 4096): GemmConfig(
        block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3
    ),
    (8192, 4096, 7168): GemmConfig(
        block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3
    ),
    (2048, 8192, 14336): GemmConfig(
        block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3
    ),
    (8192, 14336, 8192): GemmConfig(
        block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3
    ),
    (8192, 8192, 14336): GemmConfig(
        block_m=128, block_n=256, block_k=64, group_m=16, num_warps=8, num_stages=3
    ),
    (2048, 2752, 4096): GemmConfig(
        block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=5
    ),
    (2048, 4096, 2752): GemmConfig(
        block_m=128, block_n=256, block_k=64, group_m=16, num_warps=8, num_stages=3
    ),
    (8192, 2752, 4096): GemmConfig(
        block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=5
    ),
    (2048, 4096, 3584): GemmConfig(
        block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3
    ),
    (8192, 3584, 4096): GemmConfig(
        block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3
    ),
    (8192, 4096, 3584): GemmConfig(
        block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=5
    ),
    (2048, 7168, 8192): GemmConfig(
        block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=5
    ),
    (2048, 8192, 7168): GemmConfig(
        block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3
    ),
    (8192, 7168, 8192): GemmConfig(
        block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3
    ),
    (8192, 8192, 7168): GemmConfig(
        block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3
    ),
}
