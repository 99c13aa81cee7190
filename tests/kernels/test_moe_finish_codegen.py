"""What the compiler makes of MoERS's finish kernel for Hopper, checked without a GPU: it
reads a block of every rank's accumulator and then zeroes that block, and the compiler
gives the zeroing store a thread mapping other than the load's (a ``#blocked1`` layout
against ``#blocked``). Without a barrier between them one thread could clear an element
that another thread has not read yet; with N a multiple of 16 that lost about a third of
the sum on an H200 (``benchmarks/probes/moe_rs_gpu_check.py``)."""

from __future__ import annotations

import re

import pytest

from interlace.kernels.grouped_gemm import moe_finish_kernel
from interlace.ops.moe._gemm import FINISH_BLOCK
from interlace.testing.codegen import compile_for_hopper, cuda_compile_unavailable

pytestmark = pytest.mark.skipif(
    cuda_compile_unavailable() is not None, reason=str(cuda_compile_unavailable())
)

SIGNATURE = {
    "acc_table": "*i64", "set_off": "i64", "y": "*bf16", "m_loc": "i32", "N": "i32",
    "sig": "*i32", "contrib_slot": "i32", "done_slot": "i32", "err": "i64", "rank": "i32",
    "max_spins": "i64",
}  # fmt: skip


@pytest.mark.parametrize("world", [2, 4])
def test_finish_zeroes_only_after_every_load(world):
    bm, bn = FINISH_BLOCK
    ttgir = compile_for_hopper(
        moe_finish_kernel, SIGNATURE,
        {"WORLD": world, "BLOCK_M": bm, "BLOCK_N": bn, "TRACE": False, "tbuf": None},
        aligned=("acc_table", "y", "N", "sig"),
    )["ttgir"]  # fmt: skip
    lines = ttgir.splitlines()
    loads = [i for i, s in enumerate(lines) if re.search(r"= tt\.load .*x!tt\.ptr<f32>", s)]
    zeroes = [i for i, s in enumerate(lines) if re.search(r"tt\.store .*x!tt\.ptr<f32>", s)]
    barriers = [i for i, s in enumerate(lines) if "gpu.barrier" in s]
    assert len(loads) == world and len(zeroes) == world, (loads, zeroes)
    assert any(max(loads) < b < min(zeroes) for b in barriers), (
        "a zeroing store of the accumulator is not separated from the loads by a barrier"
    )
