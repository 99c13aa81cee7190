"""``MoERS``'s Hopper reduce GEMM (``kernels.grouped_gemm_hopper``, Gluon) compiled for sm_90
without a GPU, and the rule that picks it (``ops.moe._gemm.hopper_reduce``).

Compiled: it fits a Hopper SM's shared memory with its ring stages, keeps its
warp-specialised partitions (register reallocation, ``wgmma``), does not spill, and ends
with the completion counter the owners' finish waits for (a system-scope release). Results
against float32 run on the GPU (``tests/ops/test_moe.py::test_moe_reduce_hopper_kernel``,
the per-rank path of ``bench moe``).
"""

from __future__ import annotations

import re

import pytest
import torch

from interlace.ops.moe import _gemm
from interlace.testing.codegen import compile_for_hopper, cuda_compile_unavailable

SMEM_PER_BLOCK = 232448  # an H100 / H200 SM, per block


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def compiled(request):
    """The kernel for float32 rows (the op's) and bf16 rows."""
    reason = cuda_compile_unavailable()
    if reason:
        pytest.skip(reason)
    from triton.experimental.gluon import language as gl

    from interlace.kernels import grouped_gemm_hopper as KH

    bn, bk = _gemm.HOPPER_BLOCK_N, _gemm.HOPPER_BLOCK_K
    la = gl.NVMMASharedLayout.get_default_for([128, bk], gl.bfloat16)
    lb = gl.NVMMASharedLayout.get_default_for([bk, bn], gl.bfloat16)
    sig = dict(
        a_desc=f"tensordesc<bf16[128, {bk}],{la!r}>", b_desc=f"tensordesc<bf16[{bk}, {bn}],{lb!r}>",
        rows_out=f"*{request.param}", row_of="*i32", tiles="*i32", tile_count="*i32",
        sorted_entry="*i32", sorted_w="*fp32", K="i32", N="i32", sig="*i32", sig_table="*i64",
        rank="i32", done_slot="i32", contrib_slot="i32",
    )  # fmt: skip
    const = dict(
        WORLD=4, STAGES=_gemm.HOPPER_STAGES[4 if request.param == "fp32" else 2],
        CONSUMER_REGS=_gemm.HOPPER_REGS[0],
        LOADER_REGS=_gemm.HOPPER_REGS[1],
    )  # fmt: skip
    # (aligned as a launch on 16-byte aligned rows with N a multiple of 16 specialises it)
    aligned = ("rows_out", "row_of", "sorted_entry", "sorted_w", "K", "N")
    out = compile_for_hopper(
        KH.moe_reduce_gemm_hopper_kernel, sig, const, aligned=aligned, num_warps=4
    )
    return dict(out, name=request.param)


def test_compiles_warp_specialised(compiled):
    assert compiled["shared"] <= SMEM_PER_BLOCK, compiled["shared"]
    ptx = compiled["ptx"]
    assert "setmaxnreg" in ptx
    assert ptx.count("wgmma.mma_async") >= 2
    assert "local" not in "".join(line for line in ptx.splitlines() if "st." in line)
    # the rows leave in 16-byte stores (128 x 128 per tile over 128 threads), the rest
    # (the entry -> row map, publish_rows) in words
    stores = re.findall(r"st\.global[.\w]*", ptx)
    width = 4 if compiled["name"] == "fp32" else 2
    assert stores.count("st.global.v4.b32") * 16 * 128 >= 128 * 128 * width, stores
    assert set(stores) <= {"st.global.v4.b32", "st.global.b32"}, set(stores)
    # publish_rows: the finished-program count (one thread), then the last program's
    # releases of the W owners' counters
    assert ptx.count("atom.global.sys.acq_rel.add") == 1
    assert ptx.count("atom.global.sys.release.add") == 4


def test_hopper_reduce_rule(monkeypatch):
    """Gluon present, Hopper, TMA-readable operands, 128-row padding, K and N multiples of
    the blocks, no trace recorder, the switch on."""
    if _gemm.KH is None:
        pytest.skip("this Triton has no Gluon")
    a, w = torch.zeros(256, 64, dtype=torch.bfloat16), torch.zeros(2, 64, 128, dtype=torch.bfloat16)
    rows = torch.zeros(256, 128)
    cfg = _gemm.GPU_CONFIGS["reduce"]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert _gemm.hopper_reduce(a, w, rows, cfg, True)
    assert not _gemm.hopper_reduce(a, w, rows, cfg, False)  # not TMA-readable
    assert not _gemm.hopper_reduce(a, w, rows, _gemm.CPU_CONFIG, True)  # 16-row padding
    assert not _gemm.hopper_reduce(a.float(), w, rows, cfg, True)
    assert not _gemm.hopper_reduce(a, w[:, :40], rows, cfg, True)  # K not a block multiple
    assert not _gemm.hopper_reduce(a, w[..., :100], rows, cfg, True)  # nor N
    monkeypatch.setattr(_gemm._trace, "ACTIVE", True)
    assert not _gemm.hopper_reduce(a, w, rows, cfg, True)
    monkeypatch.setattr(_gemm._trace, "ACTIVE", False)
    monkeypatch.setattr(_gemm, "HOPPER_REDUCE", False)
    assert not _gemm.hopper_reduce(a, w, rows, cfg, True)
    monkeypatch.setattr(_gemm, "HOPPER_REDUCE", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert not _gemm.hopper_reduce(a, w, rows, cfg, True)
