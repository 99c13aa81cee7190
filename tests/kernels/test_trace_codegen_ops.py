"""Tracing off costs nothing in ``AGMoE``'s grouped GEMM (``moe_gemm_kernel``, gather mode)
and ``SPAttention``'s forward (``sp_attn_fwd_kernel``): compiled with ``TRACE`` off, each is
the kernel without its trace hooks, instruction for instruction (PTX for Hopper, no GPU
needed), and with ``TRACE`` on it reads the timer more often than its waits alone.

As in ``test_trace_codegen.py``, the kernel without hooks is rebuilt from the module's own
source (the hooks removed by ``language.trace``'s conventions; the attention module's
``trace_step`` helper, the 2-D grid's hook, removed whole)."""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys

import pytest

import interlace.kernels.attention as attention_module
import interlace.kernels.grouped_gemm as grouped_module
from interlace.testing.codegen import compile_for_hopper, cuda_compile_unavailable
from tests.kernels.test_trace_codegen import strip_hooks

pytestmark = pytest.mark.skipif(
    cuda_compile_unavailable() is not None, reason=str(cuda_compile_unavailable())
)

BF16 = "*bf16"


def _strip(source: str) -> str:
    """``source`` without its trace hooks and without hook helpers (``def trace_...``)."""
    source = re.sub(r"@triton\.jit\ndef trace_\w+\(.*?\n\n\n", "", source, flags=re.S)
    return strip_hooks(source)


def _untraced(module, tmp_path_factory):
    source = _strip(inspect.getsource(module))
    for word in ("TRACE", "tbuf", "trace_"):
        assert word not in source, f"{word!r} left after stripping the hooks"
    name = f"{module.__name__}_untraced"
    path = tmp_path_factory.mktemp("untraced") / f"{name.rsplit('.', 1)[1]}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    stripped = importlib.util.module_from_spec(spec)
    sys.modules[name] = stripped
    spec.loader.exec_module(stripped)
    return name, stripped


@pytest.fixture(scope="module")
def untraced(tmp_path_factory):
    """Both kernel modules with their hooks removed, imported as sibling modules."""
    names, mods = [], {}
    try:
        for key, module in (("moe", grouped_module), ("attn", attention_module)):
            name, mods[key] = _untraced(module, tmp_path_factory)
            names.append(name)
        yield mods
    finally:
        for name in names:
            sys.modules.pop(name, None)


# ---------------------------------------------------------------------- the two kernels
def _moe(kernel, variant: str, trace: bool) -> dict:
    """The grouped GEMM in gather mode as ``AGMoE`` launches it on a GPU."""
    i32, p32 = "i32", "*i32"
    sig = {
        "a": BF16, "x_own": BF16, "w": BF16, "out": BF16, "tiles": p32, "tile_count": p32,
        "sorted_tok": p32, "sorted_w": "*fp32", "m_loc": i32, "E": i32, "K": i32, "N": i32,
        "N_W": i32, "UP": i32, "acc_out": "*fp32", "sig": p32, "sig_table": "*i64",
        "flag0": i32, "err": "i64", "rank": i32, "max_spins": i32, "done_slot": i32,
        "clear_first": i32, "clear_count": i32, "contrib_slot": i32,
    }  # fmt: skip
    const = dict(
        BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, WORLD=4, GATHER=True,
        SWIGLU=variant == "swiglu_tma", REDUCE=False, WAIT=True,
        USE_TMA=variant == "swiglu_tma", EXIT_CLEAR=True,
    )  # fmt: skip
    return _compile(kernel, sig, const, trace, ("a", "x_own", "w", "out", "acc_out", "K", "N"),
                    num_stages=4)  # fmt: skip


def _attn(kernel, variant: str, trace: bool) -> dict:
    """The attention forward as ``SPAttention`` launches it on a GPU (d 128)."""
    i32 = "i32"
    sig = {n: BF16 for n in ("q", "k", "v", "k_all", "v_all", "o")}
    sig.update(
        lse="*fp32", seg="*i32", cu="*i32", sig="*i32", err="i64", rank=i32, max_spins=i32,
        arrival=i32, qk_scale="fp32", S_loc=i32, half=i32, H=i32, HKV=i32,
    )  # fmt: skip
    const = dict(
        D=128, WORLD=4, BLOCK_M=128, BLOCK_N=128, CAUSAL=variant == "causal",
        VARLEN=variant == "varlen", WAIT=True, CLEAR=True, WS=False,
    )  # fmt: skip
    return _compile(kernel, sig, const, trace, ("q", "k", "v", "k_all", "v_all", "o"),
                    num_stages=3)  # fmt: skip


def _compile(kernel, sig, const, trace, aligned, num_stages) -> dict:
    import triton

    sig, const = dict(sig), dict(const)
    if "TRACE" in kernel.arg_names:
        if trace:
            const["TRACE"] = True
            sig["tbuf"] = "*i64"
        else:
            const.update(TRACE=False, tbuf=None)
    knobs = triton.knobs.compilation
    saved = knobs.disable_line_info
    knobs.disable_line_info = True  # line numbers differ between the two sources
    try:
        out = compile_for_hopper(
            kernel, sig, const, aligned=aligned, num_warps=8, num_stages=num_stages
        )
    finally:
        knobs.disable_line_info = saved
    out["ptx"] = "\n".join(ln for ln in out["ptx"].splitlines() if not ln.lstrip().startswith("//"))
    return out


CASES = [("moe", "swiglu_tma"), ("moe", "plain"), ("attn", "causal"), ("attn", "varlen")]
KERNELS = {"moe": ("moe_gemm_kernel", _moe), "attn": ("sp_attn_fwd_kernel", _attn)}
MODULES = {"moe": grouped_module, "attn": attention_module}


def test_stripping_removes_only_hooks():
    """The stripped sources differ from the kernel sources in hook lines (and the hook
    helper) only."""
    for key, least in (("moe", 6), ("attn", 6)):
        source = inspect.getsource(MODULES[key])
        stripped = _strip(source)
        hooks = [ln for ln in source.splitlines() if ln.strip().startswith("trace_")]
        assert len(hooks) >= least, (key, hooks)
        assert len(source.splitlines()) - len(stripped.splitlines()) >= len(hooks)


@pytest.mark.parametrize("key, variant", CASES)
def test_trace_off_compiles_to_the_kernel_without_hooks(untraced, key, variant):
    name, build = KERNELS[key]
    off = build(getattr(MODULES[key], name), variant, trace=False)["ptx"]
    bare = build(getattr(untraced[key], name), variant, trace=False)["ptx"]
    # the waits read the global timer for their time bound; the hooks add no read
    assert off.count("%globaltimer") == bare.count("%globaltimer"), (key, variant)
    assert off == bare, (key, variant)


@pytest.mark.parametrize("key, variant", [CASES[0], CASES[2]])
def test_trace_on_reads_the_timer(key, variant):
    name, build = KERNELS[key]
    kernel = getattr(MODULES[key], name)
    on = build(kernel, variant, trace=True)
    off = build(kernel, variant, trace=False)
    assert on["ptx"].count("%globaltimer") > off["ptx"].count("%globaltimer"), (key, variant)
    assert "wgmma" in on["ptx"], "the traced kernel still uses Hopper's wgmma"
