"""Tracing off costs nothing: the segment GEMM compiled with ``TRACE`` off is the kernel
without its trace hooks, instruction for instruction (PTX for Hopper, no GPU needed).

The kernel without hooks is rebuilt from ``kernels/gemm.py``'s own source by removing what
``language/trace.py``'s conventions say a hook is (one-line ``trace_...`` calls, the
``TRACE: tl.constexpr = False, tbuf=None`` parameters and the ``TRACE, tbuf`` arguments,
the import of the hooks), so the comparison follows the kernel as it changes. With
``TRACE`` on, the main loop is still software-pipelined (the overhead stays small)."""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys

import pytest

import interlace.kernels.gemm as gemm_module
from interlace.ops.segment_gemm import peer_loads
from interlace.testing.codegen import compile_for_hopper, cuda_compile_unavailable
from tests.kernels.test_gemm_codegen import BASE, VARIANTS

pytestmark = pytest.mark.skipif(
    cuda_compile_unavailable() is not None, reason=str(cuda_compile_unavailable())
)

#: the variants the overlapped ops launch (AG+GEMM one-loop and per segment, GEMM+RS /
#: GEMM+AR fused, GEMM+RS ce_fused one-loop)
CHECKED = ("ag_consumer", "ag_consumer_one_loop", "gemm_rs", "gemm_ar", "gemm_rs_ce_fused_one_loop")


def strip_hooks(source: str) -> str:
    """``source`` without its trace hooks (see ``interlace.language.trace``)."""
    out = re.sub(r"from \.\.language\.trace import \([^)]*\)[^\n]*\n", "", source)
    out = re.sub(r"\n[ \t]*trace_\w+\(.*\)[ \t]*(?=\n)", "", out)
    out = re.sub(r"\n[ \t]*TRACE: tl\.constexpr = False, tbuf=None,(?=\n)", "", out)
    out = re.sub(r", TRACE: tl\.constexpr = False, tbuf=None,", ",", out)
    out = re.sub(r"\n[ \t]*TRACE, tbuf,(?=\n)", "", out)
    out = re.sub(r", TRACE, tbuf,", ",", out)
    return out


@pytest.fixture(scope="module")
def untraced(tmp_path_factory):
    """``kernels/gemm.py`` with its hooks removed, imported as a sibling module."""
    source = strip_hooks(inspect.getsource(gemm_module))
    for word in ("TRACE", "tbuf", "trace_"):
        assert word not in source, f"{word!r} left after stripping the hooks"
    path = tmp_path_factory.mktemp("untraced") / "gemm_untraced.py"
    path.write_text(source)
    name = "interlace.kernels._gemm_untraced"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)


def _ptx(kernel, variant: str, **extra) -> str:
    import triton

    constexprs = dict(BASE, **VARIANTS[variant], **extra)
    constexprs.setdefault("PEER_LOADS", peer_loads(constexprs["WORLD"]))
    if extra.get("TRACE"):
        del constexprs["tbuf"]
    constexprs = {k: v for k, v in constexprs.items() if k in kernel.arg_names}
    names = [n for n in kernel.arg_names if n not in constexprs and n != "tbuf"]
    sig = {n: "i32" for n in names}
    sig.update({n: "*bf16" for n in ("a", "b", "c", "bias", "a_own", "recv", "stage")})
    sig.update(seg="*i32", sig="*i32", err="i64", mt_seg="*i32")
    sig.update({n: "*i64" for n in ("recv_table", "out_table", "sig_table")})
    if extra.get("TRACE"):
        sig["tbuf"] = "*i64"
    knobs = triton.knobs.compilation
    saved = knobs.disable_line_info
    knobs.disable_line_info = True  # line numbers differ between the two sources
    try:
        ptx = compile_for_hopper(
            kernel, sig, constexprs,
            aligned=("a", "b", "c", "a_own", "recv", "stage", "N", "K"), num_warps=8, num_stages=3,
        )["ptx"]  # fmt: skip
    finally:
        knobs.disable_line_info = saved
    return "\n".join(ln for ln in ptx.splitlines() if not ln.lstrip().startswith("//"))


def test_stripping_removes_only_hooks():
    """The stripped source differs from the kernel source in hook lines only."""
    source = inspect.getsource(gemm_module)
    stripped = strip_hooks(source)
    hooks = [ln for ln in source.splitlines() if ln.strip().startswith("trace_event(")]
    assert len(hooks) >= 15, len(hooks)
    assert len(source.splitlines()) - len(stripped.splitlines()) >= len(hooks)


@pytest.mark.parametrize("variant", CHECKED)
def test_trace_off_compiles_to_the_kernel_without_hooks(untraced, variant):
    off = _ptx(gemm_module.gemm_segments_kernel, variant, TRACE=False)
    bare = _ptx(untraced.gemm_segments_kernel, variant)
    # the waits read the global timer for their time bound; the hooks add no read
    assert off.count("%globaltimer") == bare.count("%globaltimer"), variant
    assert off == bare, variant


@pytest.mark.parametrize("variant", ("ag_consumer_one_loop", "gemm_rs"))
def test_trace_on_reads_the_timer_and_keeps_the_loop_pipelined(variant):
    constexprs = dict(BASE, **VARIANTS[variant], TRACE=True)
    del constexprs["tbuf"]
    kernel = gemm_module.gemm_segments_kernel
    sig = {n: "i32" for n in kernel.arg_names if n not in constexprs}
    sig.update({n: "*bf16" for n in ("a", "b", "c", "bias", "a_own", "recv", "stage")})
    sig.update(seg="*i32", sig="*i32", err="i64", mt_seg="*i32", tbuf="*i64")
    sig.update({n: "*i64" for n in ("recv_table", "out_table", "sig_table")})
    out = compile_for_hopper(
        kernel, sig, constexprs, aligned=("a", "b", "c", "a_own", "recv", "stage", "N", "K"),
        num_warps=8, num_stages=3,
    )  # fmt: skip
    # more timer reads than the waits' alone (their time bound): the hooks'
    waits_only = _ptx(kernel, variant, TRACE=False).count("%globaltimer")
    assert out["ptx"].count("%globaltimer") > waits_only, variant
    assert out["ttgir"].count("ttng.async_tma_copy_global_to_local") >= 4, variant
    assert re.search(r"ttng\.warp_group_dot .*isAsync = true", out["ttgir"]), variant
