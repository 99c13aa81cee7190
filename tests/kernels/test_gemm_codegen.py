"""What the compiler makes of the segment GEMM for Hopper, checked without a GPU: every
variant (plain, AG+GEMM consumer, GEMM+RS, GEMM+AR) keeps a software-pipelined TMA main
loop and does not spill registers, and the AG consumer's A loads depend on the acquire of
their chunk's wait. Each of these regressed once while the kernel was written (a second
loop instantiation, a barrier inside the loop, 64-bit per-element offsets)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest

from interlace.kernels.gemm import gemm_segments_kernel
from interlace.ops.segment_gemm import peer_loads
from interlace.testing.codegen import compile_for_hopper, cuda_compile_unavailable, data_loads

pytestmark = pytest.mark.skipif(
    cuda_compile_unavailable() is not None, reason=str(cuda_compile_unavailable())
)

# Every constexpr named (one left out would be compiled as a run-time integer, and its
# branches both kept, unlike any launch).
BASE = dict(
    BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, WORLD=2, USE_TMA=True, HAS_BIAS=False,
    HAS_PUSH=False, BROADCAST=False, HAS_OWN_A=False, SUBTILE=False, ENTRY_BARRIER=False,
    EXIT_CLEAR=False, NOTIFY_STORES=False, STAGE_PUSHES=False, ONE_LOOP=False, COUNT_UNIT=1,
    TRACE=False, tbuf=None,
)  # fmt: skip
VARIANTS = {
    "plain": {},
    "ag_consumer": {"HAS_OWN_A": True},
    "ag_consumer_one_loop": {"HAS_OWN_A": True, "ONE_LOOP": True, "EXIT_CLEAR": True},
    "gemm_rs": {"HAS_PUSH": True, "SUBTILE": True},
    "gemm_ar": {"HAS_PUSH": True, "BROADCAST": True, "SUBTILE": True},
    "gemm_rs_ce_scatter": {"NOTIFY_STORES": True, "HAS_BIAS": True},
    "gemm_rs_ce_fused": {"HAS_PUSH": True, "STAGE_PUSHES": True, "SUBTILE": True},
    "gemm_rs_ce_fused_one_loop": {
        "HAS_PUSH": True,
        "STAGE_PUSHES": True,
        "SUBTILE": True,
        "ONE_LOOP": True,
        "WORLD": 4,
        "EXIT_CLEAR": True,
    },
    # LLaMA-3-8B's config: 128 x 128 tiles, whole-tile stores into the stage
    "gemm_rs_ce_fused_one_loop_n128": {
        "HAS_PUSH": True,
        "STAGE_PUSHES": True,
        "BLOCK_N": 128,
        "ONE_LOOP": True,
        "WORLD": 4,
        "EXIT_CLEAR": True,
    },
    "gemm_ar_ce_fused_one_loop": {
        "HAS_PUSH": True,
        "STAGE_PUSHES": True,
        "SUBTILE": True,
        "ONE_LOOP": True,
        "WORLD": 4,
        "BROADCAST": True,
        "HAS_BIAS": True,
        "EXIT_CLEAR": True,
    },
    # eight ranks: the reduce tiles load their peers' partials one at a time
    # (``segment_gemm.peer_loads``); all seven at once spilled registers here
    "gemm_ar_ce_fused_one_loop_w8": {
        "HAS_PUSH": True,
        "STAGE_PUSHES": True,
        "SUBTILE": True,
        "ONE_LOOP": True,
        "WORLD": 8,
        "BROADCAST": True,
        "HAS_BIAS": True,
        "EXIT_CLEAR": True,
    },
    # GEMM+AR ``ce_fused`` runs the reduce-scatter kernel (the copy engine gathers), here
    # with a bias and four ranks
    "gemm_ar_ce_fused": {
        "HAS_PUSH": True,
        "STAGE_PUSHES": True,
        "SUBTILE": True,
        "HAS_BIAS": True,
        "WORLD": 4,
    },
}
_cache: dict[str, dict] = {}


def _compiled(variant: str) -> dict:
    if variant not in _cache:
        constexprs = dict(BASE, **VARIANTS[variant])
        constexprs.setdefault("PEER_LOADS", peer_loads(constexprs["WORLD"]))
        sig = {n: "i32" for n in gemm_segments_kernel.arg_names if n not in constexprs}
        sig.update({n: "*bf16" for n in ("a", "b", "c", "bias", "a_own", "recv", "stage")})
        sig.update(seg="*i32", sig="*i32", err="i64", mt_seg="*i32")
        sig.update({n: "*i64" for n in ("recv_table", "out_table", "sig_table")})
        _cache[variant] = compile_for_hopper(
            gemm_segments_kernel, sig, constexprs,
            aligned=("a", "b", "c", "a_own", "recv", "stage", "N", "K"), num_warps=8, num_stages=3,
        )  # fmt: skip
    return _cache[variant]


def _spilled_bytes(ptx: str) -> int:
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        run = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    found = re.findall(r"(\d+) bytes spill stores", run.stdout + run.stderr)
    assert found, run.stdout + run.stderr
    return max(int(x) for x in found)


@pytest.mark.parametrize("variant", VARIANTS)
def test_main_loop_is_pipelined(variant):
    ttgir = _compiled(variant)["ttgir"]
    # a pipelined loop has its loads issued ahead: a prologue plus the loop body
    assert ttgir.count("ttng.async_tma_copy_global_to_local") >= 4, variant
    assert re.search(r"ttng\.warp_group_dot .*isAsync = true", ttgir), variant


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_register_spills(variant):
    assert _spilled_bytes(_compiled(variant)["ptx"]) <= 64


def test_ag_consumer_a_loads_follow_the_wait():
    """The first A load the pipeliner issues for a segment takes its coordinate from the
    chunk's acquire (``guard_coord``); the later A loads sit in the same region after it
    (the loop the prologue feeds), so none can run before the wait. B loads need no wait."""
    loads = [ld for ld in data_loads(_compiled("ag_consumer")["ttgir"]) if "tma" in ld.kind]
    a_loads = [ld for ld in loads if "%a_desc" in ld.text]
    assert len(a_loads) * 2 == len(loads), [ld.text[:60] for ld in loads]
    first = a_loads[0]
    assert first.guarded_by("coord") in ("block", "outer"), first
    for ld in a_loads[1:]:
        assert ld.path.startswith(first.path), (first.path, ld.path)
        assert ld.path != first.path or ld.index > first.index


@pytest.mark.parametrize(
    "variant, scope",
    [("gemm_rs", "sys"), ("gemm_rs_ce_fused", "gpu"), ("gemm_rs_ce_scatter", "gpu")],
)
def test_counter_release_scope(variant, scope):
    """A counter a peer reads is released at system scope; one that only this GPU reads
    (a staged chunk, for a wait kernel and the copy engine after it) at GPU scope."""
    adds = set(re.findall(r"atom\.global\.(\w+)\.release\.add", _compiled(variant)["ptx"]))
    assert adds == {scope}, adds


def test_one_loop_a_loads_follow_the_wait():
    """One-loop mode: every A load of the peers' rows, in the pipeliner's prologue and in
    the loop, takes its coordinate from the inline-PTX acquire of its own tile
    (``wait_inline``), in the same iteration or carried from the one that waited; the own
    rows' loads (a descriptor of their own) wait for nothing."""
    ttgir = _compiled("ag_consumer_one_loop")["ttgir"]
    assert ttgir.count("ld.acquire.sys") >= 1
    loads = [ld for ld in data_loads(ttgir) if "tma" in ld.kind]
    a_loads = [ld for ld in loads if "%a_desc" in ld.text]
    own_loads = [ld for ld in loads if "%own_desc" in ld.text]
    assert a_loads and own_loads, [ld.text[:60] for ld in loads]
    for ld in a_loads:
        assert ld.guarded_by("coord") in ("block", "outer", "carried"), ld
    for ld in own_loads:
        assert ld.guarded_by("coord") is None, ld
