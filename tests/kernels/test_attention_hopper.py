"""The Hopper attention forward (``kernels.attention_hopper``, Gluon) compiled for sm_90
without a GPU, and the rule that picks it (``sp_attention.hopper_forward``).

Compiled: every variant the op launches fits a Hopper SM's shared memory, keeps its
warp-specialised partitions (register reallocation, ``wgmma``), and every K / V load of a
waiting launch takes its coordinate from the arrival flag's acquire (a peer's chunk cannot
be read before its flag is up); a launch without waits has no such dependency, so the check
can fail. Numbers and results against a float32 reference run on the GPU
(``tests/ops/test_sp_attention.py::test_hopper_forward``).
"""

from __future__ import annotations

import pytest
import torch

from interlace.ops.attention import sp_attention as sp
from interlace.testing.codegen import compile_for_hopper, cuda_compile_unavailable, data_loads

SMEM_PER_BLOCK = 232448  # an H100 / H200 SM, per block


def _compile(world, causal, varlen, wait, d=128, dtype="bf16"):
    from triton.experimental.gluon import language as gl

    from interlace.kernels import attention_hopper as KH

    gl_dtype = gl.bfloat16 if dtype == "bf16" else gl.float16

    def desc(rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, d], gl_dtype)
        return f"tensordesc<{dtype}[{rows}, {d}],{layout!r}>"

    tq, tk = desc(KH.WG_M.value), desc(sp.HOPPER_BLOCK_N)
    sig = dict(
        q_desc=tq, k_desc=tk, v_desc=tk, kp_desc=tk, vp_desc=tk, o_desc=tq, lse="*fp32",
        seg="*i32", cu="*i32", sig="*i32", err="i64", rank="i32", max_spins="i32",
        arrival="i32", qk_scale="fp32", S_loc="i32", half="i32", H="i32", HKV="i32",
    )  # fmt: skip
    const = dict(
        WORLD=world, CAUSAL=causal, VARLEN=varlen, WAIT=wait, CLEAR=wait,
        STAGES=sp.HOPPER_STAGES[d], CONSUMER_REGS=sp.HOPPER_CONSUMER_REGS,
        LOADER_REGS=sp.HOPPER_LOADER_REGS,
    )  # fmt: skip
    return compile_for_hopper(KH.sp_attn_fwd_hopper_kernel, sig, const, num_warps=4)


VARIANTS = {
    "w4-causal": (4, True, False, True),
    "w2-full-docs": (2, False, True, True),
    "w2-full-nowait": (2, False, False, False),
}


@pytest.fixture(scope="module")
def compiled():
    reason = cuda_compile_unavailable()
    if reason:
        pytest.skip(reason)
    return {name: _compile(*args) for name, args in VARIANTS.items()}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_compiles_warp_specialised(compiled, name):
    ir = compiled[name]
    assert ir["shared"] <= SMEM_PER_BLOCK, ir["shared"]
    assert "setmaxnreg" in ir["ptx"]  # the partitions' register reallocation
    assert ir["ptx"].count("wgmma.mma_async") >= 4
    assert "ttir" not in ir  # Gluon starts at TTGIR


def _kv_loads(ttgir):
    return [ld for ld in data_loads(ttgir) if ld.kind.startswith("ttng.async_tma_copy")
            and f"tensor<{sp.HOPPER_BLOCK_N}x" in ld.text]  # fmt: skip


@pytest.mark.parametrize("name", ["w4-causal", "w2-full-docs"])
def test_kv_loads_follow_the_arrival_flags(compiled, name):
    loads = _kv_loads(compiled[name]["ttgir"])
    assert len(loads) >= 4  # K and V, local and gathered descriptors
    for ld in loads:
        source = ld.guarded.get("coord")
        assert source is not None and "ld.acquire" in source[0], ld.text


def test_loads_without_waits_are_not_guarded(compiled):
    loads = _kv_loads(compiled["w2-full-nowait"]["ttgir"])
    assert loads and all("coord" not in ld.guarded for ld in loads)


def _args(backend="cuda", s_loc=1024, d=128):
    dummy = torch.zeros(1, dtype=torch.int32)
    return sp.KernelArgs(0, 2, 4, 2, d, s_loc, True, False, 0.1, dummy, dummy, dummy, 0, 1000,
                         backend)  # fmt: skip


def test_hopper_forward_rule(monkeypatch):
    """Hopper (capability 9), S_loc a multiple of 128, no trace recorder, the switch on."""
    if sp.KH is None:
        pytest.skip("this Triton has no Gluon")
    q = torch.zeros(1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert sp.hopper_forward(_args(), q)
    assert not sp.hopper_forward(_args(s_loc=1000), q)
    assert not sp.hopper_forward(_args(backend="cpu"), q)
    monkeypatch.setattr(sp._trace, "ACTIVE", True)
    assert not sp.hopper_forward(_args(), q)
    monkeypatch.setattr(sp._trace, "ACTIVE", False)
    monkeypatch.setattr(sp.SPAttention, "HOPPER_FORWARD", False)
    assert not sp.hopper_forward(_args(), q)
    monkeypatch.setattr(sp.SPAttention, "HOPPER_FORWARD", True)
    for capability in ((8, 0), (10, 0)):
        fake = lambda device=None, c=capability: c  # noqa: E731
        monkeypatch.setattr(torch.cuda, "get_device_capability", fake)
        assert not sp.hopper_forward(_args(), q)
