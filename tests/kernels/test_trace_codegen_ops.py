"""Tracing off costs nothing in ``AGMoE``'s grouped GEMM (``moe_gemm_kernel``, gather mode),
``SPAttention``'s forward (``sp_attn_fwd_kernel``) and backward (dK/dV, dQ, the reduction),
``MoERS``'s kernels (the grouped GEMM in reduce mode, ``moe_finish_kernel``),
``FlashDecode``'s (``split_decode_kernel``, ``merge_kernel``), ``EPAllToAll``'s
(``kernels.ep``: route, send, layout, expand, combine send and receive),
``EPLowLatency``'s (``kernels.ep_low_latency``: dispatch, bf16 and FP8, and combine, both
protocols) and the ``signal_reorder`` GEMM (``signal_gemm_kernel``: TMA stores counted per
warp, plain stores released per thread): compiled with ``TRACE`` off, each is the kernel
without its trace hooks,
instruction for instruction (PTX for Hopper, no GPU needed), and with ``TRACE`` on it reads
the timer more often than its waits alone.

As in ``test_trace_codegen.py``, the kernel without hooks is rebuilt from the module's own
source (the hooks removed by ``language.trace``'s conventions; the hook helpers of the
attention and signal-GEMM modules, ``trace_step`` and ``trace_count``, removed whole)."""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys

import pytest

import interlace.kernels.attention as attention_module
import interlace.kernels.decode as decode_module
import interlace.kernels.ep as ep_module
import interlace.kernels.ep_low_latency as ep_ll_module
import interlace.kernels.grouped_gemm as grouped_module
import interlace.kernels.signal_gemm as signal_module
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


class _Untraced(dict):
    """``MODULES``' keys -> the module with its hooks removed, imported as a sibling module
    on first use (a module that fails to strip fails only its own cases)."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp_path_factory, self.names = tmp_path_factory, []

    def __missing__(self, key):
        name, self[key] = _untraced(MODULES[key], self.tmp_path_factory)
        self.names.append(name)
        return self[key]


@pytest.fixture(scope="module")
def untraced(tmp_path_factory):
    """The kernel modules with their hooks removed (``_Untraced``)."""
    mods = _Untraced(tmp_path_factory)
    try:
        yield mods
    finally:
        for name in mods.names:
            sys.modules.pop(name, None)


# ---------------------------------------------------------------------- the kernels
def _moe(kernel, variant: str, trace: bool) -> dict:
    """The grouped GEMM as ``AGMoE`` (gather mode) or ``MoERS`` (``reduce``) launches it on
    a GPU."""
    i32, p32 = "i32", "*i32"
    sig = {
        "a": BF16, "x_own": BF16, "w": BF16, "out": BF16, "tiles": p32, "tile_count": p32,
        "sorted_entry": p32, "sorted_w": "*fp32", "m_loc": i32, "k_top": i32, "E": i32,
        "K": i32, "N": i32,
        "N_W": i32, "UP": i32, "rows_out": "*fp32", "row_of": p32, "sig": p32,
        "sig_table": "*i64",
        "flag0": i32, "err": "i64", "rank": i32, "max_spins": i32, "done_slot": i32,
        "clear_first": i32, "clear_count": i32, "contrib_slot": i32,
    }  # fmt: skip
    reduce = variant == "reduce"
    const = dict(
        BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, WORLD=4, GATHER=not reduce,
        SWIGLU=variant == "swiglu_tma", REDUCE=reduce, WAIT=not reduce,
        USE_TMA=variant in ("swiglu_tma", "reduce"), EXIT_CLEAR=not reduce, FLATTEN=reduce,
    )  # fmt: skip
    return _compile(kernel, sig, const, trace, ("a", "x_own", "w", "out", "rows_out", "K", "N"),
                    num_stages=4)  # fmt: skip


def _attn(kernel, variant: str, trace: bool, cfg=None) -> dict:
    """The attention forward as ``SPAttention`` launches it on a GPU (d 128, ``GPU_CONFIGS``
    unless ``cfg`` is given)."""
    from interlace.ops.attention.sp_attention import config_of

    cfg = cfg or config_of("fwd", 128, "cuda")
    i32 = "i32"
    sig = {n: BF16 for n in ("q", "k", "v", "k_all", "v_all", "o")}
    sig.update(
        lse="*fp32", seg="*i32", cu="*i32", sig="*i32", err="i64", rank=i32, max_spins=i32,
        arrival=i32, qk_scale="fp32", S_loc=i32, half=i32, H=i32, HKV=i32,
    )  # fmt: skip
    const = dict(
        D=128, WORLD=4, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=variant == "causal",
        VARLEN=variant == "varlen", WAIT=True, CLEAR=True, WS=False, FAST_EXP=cfg.fast_exp,
    )  # fmt: skip
    return _compile(kernel, sig, const, trace, ("q", "k", "v", "k_all", "v_all", "o"),
                    num_stages=cfg.num_stages, num_warps=cfg.num_warps)  # fmt: skip


def _attn_bwd(kernel, variant: str, trace: bool, cfg=None) -> dict:
    """A backward kernel of ``SPAttention`` as ``launch_dkdv`` / ``launch_dq`` /
    ``launch_reduce`` launch it on a GPU (d 128, ``GPU_CONFIGS`` unless ``cfg`` is given):
    ``full``, ``causal`` or ``varlen``."""
    from interlace.ops.attention.sp_attention import REDUCE_BLOCK, config_of

    i32, name = "i32", kernel.__name__
    if name == "sp_attn_bwd_reduce_kernel":
        sig = dict(recv=BF16, dk=BF16, dv=BF16, sig="*i32", err="i64")
        for arg in ("rank", "max_spins", "dkv_slot", "n_rows", "expected"):
            sig[arg] = i32
        const = dict(D=128, WORLD=4, BLOCK=REDUCE_BLOCK)
        return _compile(kernel, sig, const, trace, ("recv", "dk", "dv"), num_stages=3,
                        num_warps=4)  # fmt: skip
    kind = "dkdv" if name == "sp_attn_bwd_dkdv_kernel" else "dq"
    causal = variant == "causal"
    cfg = cfg or config_of(kind, 128, "cuda")
    sig = {}
    for arg in kernel.arg_names:
        if arg in ("TRACE", "tbuf"):
            continue
        if arg in ("q", "k", "v", "k_all", "v_all", "do", "recv", "dq"):
            sig[arg] = BF16
        elif arg in ("lse", "delta"):
            sig[arg] = "*fp32"
        elif arg in ("seg", "cu", "sig"):
            sig[arg] = "*i32"
        elif arg in ("recv_table", "sig_table"):
            sig[arg] = "*i64"
        elif arg in ("sm_scale", "qk_scale"):
            sig[arg] = "fp32"
        else:
            sig[arg] = "i64" if arg == "err" else i32
    const = dict(
        D=128, WORLD=4, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal,
        VARLEN=variant == "varlen", WAIT=True, CLEAR=True, FAST_EXP=cfg.fast_exp,
    )  # fmt: skip
    const = {k: v for k, v in const.items() if k in kernel.arg_names}
    for arg in const:
        sig.pop(arg)
    aligned = tuple(n for n in ("q", "k", "v", "k_all", "v_all", "do", "recv", "dq") if n in sig)
    return _compile(kernel, sig, const, trace, aligned, num_stages=cfg.num_stages,
                    num_warps=cfg.num_warps)  # fmt: skip


def _signal(kernel, variant: str, trace: bool) -> dict:
    """The ``signal_reorder`` GEMM as ``SignalReorderGemm.launch_gemm`` launches it on a GPU
    (the default tile, bias added): ``ar`` (the all-reduce layout: TMA stores, each warp
    counting), ``rs`` (four strips: plain stores, each thread releasing) or ``ar_plain``
    (no TMA: rows of N not 16-byte aligned)."""
    strips = 4 if variant == "rs" else 1
    tma = variant != "ar_plain"
    tma_store = tma and strips == 1
    sig = dict(a=BF16, b=BF16, buf=BF16, bias=BF16, tile_map="*i32", counters="*i32")
    for arg in ("M", "N", "K", "rows_per_rank", "world", "n_tiles"):
        sig[arg] = "i32"
    const = dict(
        BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, STRIPS=strips, USE_TMA=tma,
        HAS_BIAS=True, LANES=8 if tma_store else 256, SIGNAL=True, TMA_STORE=tma_store,
        SUBTILE=False,
    )  # fmt: skip
    aligned = ("a", "b", "buf", "K", "rows_per_rank") + (("N",) if tma else ())
    return _compile(kernel, sig, const, trace, aligned, num_stages=3)


def _finish(kernel, variant: str, trace: bool) -> dict:
    """``MoERS``'s finish kernel as ``launch_finish`` launches it on a GPU (``w2``, ``w4``:
    the world)."""
    from interlace.ops.moe._gemm import FINISH_BLOCK

    sig = {
        "rows_table": "*i64", "set_off": "i64", "map_table": "*i64", "map_off": "i64",
        "y": BF16, "m_loc": "i32", "N": "i32", "sig": "*i32", "contrib_slot": "i32",
        "done_slot": "i32", "err": "i64", "rank": "i32", "max_spins": "i64",
    }  # fmt: skip
    bm, bn = FINISH_BLOCK
    const = dict(WORLD=int(variant[1:]), TOPK=2, BLOCK_M=bm, BLOCK_N=bn, ROWS_F32=True,
                 ALIGNED=True)  # fmt: skip
    return _compile(kernel, sig, const, trace, ("rows_table", "y", "N", "sig"), num_stages=3,
                    num_warps=4)  # fmt: skip


_DECODE_STRIDES = ("stride_qb", "stride_qh", "stride_kb", "stride_kh", "stride_kn",
                   "stride_vb", "stride_vh", "stride_vn")  # fmt: skip


def _decode(kernel, variant: str, trace: bool) -> dict:
    """``FlashDecode``'s split kernel as it launches it on a GPU (d 128, GQA 4):
    ``splits`` (every rank merges, several splits) or ``owner_lens`` (one owner, one split,
    ``kv_lens``)."""
    i32 = "i32"
    sig = dict(
        q=BF16, k=BF16, v=BF16, lens="*i32", part_o="*fp32", part_lse="*fp32",
        push_o="*fp32", push_lse="*fp32", o_table="*i64", lse_table="*i64", sig_table="*i64",
        err="i64", qk_scale="fp32",
    )  # fmt: skip
    for name in ("rank", "world", "owner", "max_spins", "count_first", "epoch_slot",
                 "arrive_first", "ack_slot", "n_groups", "kv_cap", "split_len", "n_splits",
                 "max_rows", *_DECODE_STRIDES):  # fmt: skip
        sig[name] = i32
    one = variant == "owner_lens"
    const = dict(
        HKV=8, G=4, BLOCK_G=16, D=128, BLOCK_N=64, HAS_LENS=one, ONE_SPLIT=one,
        OWNER_ONLY=one,
    )  # fmt: skip
    aligned = ("q", "k", "v", "part_o", "push_o", *_DECODE_STRIDES)
    return _compile(kernel, sig, const, trace, aligned, num_stages=3, num_warps=4)


def _merge(kernel, variant: str, trace: bool) -> dict:
    """``FlashDecode``'s merge kernel as it launches it on a GPU (d 128): ``all`` (every
    rank merges, 4 rows a program) or ``ack`` (one owner, 16 rows a program)."""
    i32 = "i32"
    sig = dict(push_o="*fp32", push_lse="*fp32", out=BF16, sig_table="*i64", err="i64")
    for name in ("rank", "world", "max_spins", "epoch_slot", "arrive_first", "ack_slot",
                 "done_slot", "n_rows", "max_rows", "stride_ob", "stride_oh"):  # fmt: skip
        sig[name] = i32
    ack = variant == "ack"
    const = dict(HQ=32, D=128, BLOCK_R=16 if ack else 4, ACK=ack)
    aligned = ("push_o", "push_lse", "out", "stride_ob", "stride_oh")
    return _compile(kernel, sig, const, trace, aligned, num_stages=3, num_warps=4 if ack else 2)


#: ``kernels.ep``'s pointer arguments (the others are int32 scalars, ``err`` an address)
_EP_POINTERS = {
    "topk_idx": "*i64", "topk_w": "*fp32", "route_w": "*fp32", "scale": "*fp32",
    "stage_scale": "*fp32", "recv_scale": "*fp32", "x": BF16, "expert_out": BF16,
    "comb": BF16, "out": BF16, "err": "i64",
    **{n: "*i32" for n in ("route_idx", "route_n", "pair_rel", "counts", "seg_counts",
                           "status", "sig", "out_counts", "out_offsets", "src_offs")},
}  # fmt: skip


def _ep(kernel, variant: str, trace: bool) -> dict:
    """An ``EPAllToAll`` kernel as it launches it on a GPU (hidden 7168, 256 experts over
    8 ranks, top-8): ``plain``, ``fp8`` (dispatch in e4m3 bytes) or ``src_major``
    (``EPMoE``'s layout)."""
    fp8 = variant == "fp8"
    const = dict(
        E_LOC=32, KP=8, BT=128 if kernel.__name__ in ("ep_route_kernel", "ep_layout_kernel")
        else 4, BH=1024, EP2=32, WP=8, FP8=fp8, SRC_MAJOR=variant == "src_major",
    )  # fmt: skip
    const = {k: v for k, v in const.items() if k in kernel.arg_names}
    raw = "*u8" if fp8 else BF16
    sig = {}
    for name in kernel.arg_names:
        if name in const or name in ("TRACE", "tbuf"):
            continue
        typ = "*i64" if name.endswith("_tab") else _EP_POINTERS.get(name, "i32")
        sig[name] = raw if name in ("stage", "recv_x") else typ
    aligned = tuple(n for n in ("x", "stage", "recv_x", "expert_out", "comb", "out") if n in sig)
    return _compile(kernel, sig, const, trace, aligned, num_stages=3, num_warps=4)


#: ``kernels.ep_low_latency``'s arguments other than int32 scalars (``d_data`` /
#: ``c_data``: int64 words with the flag in the data, else int32)
_EP_LL_TYPES = {
    "x": BF16, "expert_out": BF16, "out": BF16, "topk_idx": "*i64", "topk_w": "*fp32",
    "home_w": "*fp32", "recv_scale": "*fp32", "err": "i64",
    **{n: "*i64" for n in ("d_count", "d_meta", "c_arrive", "c_meta")},
    **{n: "*i32" for n in ("home_idx", "recv_src", "layout", "counts", "epochs")},
}  # fmt: skip


def _ep_ll(kernel, variant: str, trace: bool) -> dict:
    """An ``EPLowLatency`` kernel as it launches it on a GPU (hidden 7168, 256 experts over
    8 ranks, top-8, 128 tokens): ``flag_in_data`` or ``token_flag``, ``fp8_`` before
    either: the dispatch in e4m3 bytes."""
    fp8 = variant.startswith("fp8_")
    flag = variant.endswith("flag_in_data")
    const = dict(E_LOC=32, KP=8, TP=128, BW=1024, BQ=1024, FLAG_IN_DATA=flag, FP8=fp8,
                 IS_BF16=True)  # fmt: skip
    const = {k: v for k, v in const.items() if k in kernel.arg_names}
    sig = {}
    for name in kernel.arg_names:
        if name in const or name in ("TRACE", "tbuf"):
            continue
        typ = "*i64" if name.endswith("_tab") else _EP_LL_TYPES.get(name, "i32")
        if name in ("d_data", "c_data"):
            typ = "*i64" if flag else "*i32"
        elif name == "recv":
            typ = "*u8" if fp8 else BF16
        sig[name] = typ
    aligned = tuple(n for n in ("x", "recv", "expert_out", "out", "d_data", "c_data") if n in sig)
    return _compile(kernel, sig, const, trace, aligned, num_stages=3, num_warps=4)


def _compile(kernel, sig, const, trace, aligned, num_stages, num_warps=8) -> dict:
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
            kernel, sig, const, aligned=aligned, num_warps=num_warps, num_stages=num_stages
        )
    finally:
        knobs.disable_line_info = saved
    out["ptx"] = "\n".join(ln for ln in out["ptx"].splitlines() if not ln.lstrip().startswith("//"))
    return out


CASES = [
    ("moe", "swiglu_tma"), ("moe", "plain"), ("attn", "causal"), ("attn", "varlen"),
    ("moe", "reduce"), ("finish", "w2"), ("finish", "w4"), ("decode", "splits"),
    ("decode", "owner_lens"), ("merge", "all"), ("merge", "ack"), ("ep_route", "plain"),
    ("ep_send", "plain"), ("ep_send", "fp8"), ("ep_layout", "plain"), ("ep_expand", "plain"),
    ("ep_expand", "src_major"), ("ep_combine_send", "plain"),
    ("ep_combine_send", "src_major"), ("ep_combine_recv", "plain"),
    ("ep_ll_dispatch", "flag_in_data"), ("ep_ll_dispatch", "token_flag"),
    ("ep_ll_dispatch", "fp8_flag_in_data"), ("ep_ll_dispatch", "fp8_token_flag"),
    ("ep_ll_combine", "flag_in_data"), ("ep_ll_combine", "token_flag"),
    ("attn_dkdv", "full"), ("attn_dkdv", "causal"), ("attn_dkdv", "varlen"),
    ("attn_dq", "causal"), ("attn_dq", "varlen"), ("attn_reduce", "w4"), ("signal", "ar"),
    ("signal", "rs"), ("signal", "ar_plain"),
]  # fmt: skip
#: case -> (its module in ``MODULES``, the kernel, how it is compiled)
KERNELS = {
    "moe": ("moe", "moe_gemm_kernel", _moe), "attn": ("attn", "sp_attn_fwd_kernel", _attn),
    "finish": ("moe", "moe_finish_kernel", _finish),
    "decode": ("decode", "split_decode_kernel", _decode),
    "merge": ("decode", "merge_kernel", _merge),
    **{k: ("ep", f"{k}_kernel", _ep) for k in ("ep_route", "ep_send", "ep_layout",
                                              "ep_expand", "ep_combine_send", "ep_combine_recv")},
    "ep_ll_dispatch": ("ep_ll", "ll_dispatch_kernel", _ep_ll),
    "ep_ll_combine": ("ep_ll", "ll_combine_kernel", _ep_ll),
    "attn_dkdv": ("attn", "sp_attn_bwd_dkdv_kernel", _attn_bwd),
    "attn_dq": ("attn", "sp_attn_bwd_dq_kernel", _attn_bwd),
    "attn_reduce": ("attn", "sp_attn_bwd_reduce_kernel", _attn_bwd),
    "signal": ("signal", "signal_gemm_kernel", _signal),
}  # fmt: skip
MODULES = {
    "moe": grouped_module, "attn": attention_module, "decode": decode_module, "ep": ep_module,
    "ep_ll": ep_ll_module, "signal": signal_module,
}  # fmt: skip


def test_stripping_removes_only_hooks():
    """The stripped sources differ from the kernel sources in hook lines (and the hook
    helpers) only."""
    for key, least in (("moe", 11), ("attn", 19), ("decode", 14), ("ep", 30), ("ep_ll", 17),
                       ("signal", 6)):  # fmt: skip
        source = inspect.getsource(MODULES[key])
        stripped = _strip(source)
        hooks = [ln for ln in source.splitlines() if ln.strip().startswith("trace_")]
        assert len(hooks) >= least, (key, hooks)
        assert len(source.splitlines()) - len(stripped.splitlines()) >= len(hooks)


@pytest.mark.parametrize("key, variant", CASES)
def test_trace_off_compiles_to_the_kernel_without_hooks(untraced, key, variant):
    module, name, build = KERNELS[key]
    off = build(getattr(MODULES[module], name), variant, trace=False)["ptx"]
    bare = build(getattr(untraced[module], name), variant, trace=False)["ptx"]
    # the waits read the global timer for their time bound; the hooks add no read
    assert off.count("%globaltimer") == bare.count("%globaltimer"), (key, variant)
    assert off == bare, (key, variant)


@pytest.mark.parametrize(
    "key, variant",
    [CASES[i] for i in (0, 2, 4, 6, 7, 10, 11, 12, 15, 19, 20, 23, 25, 26, 27, 29, 31, 32, 33)],
)
def test_trace_on_reads_the_timer(key, variant):
    module, name, build = KERNELS[key]
    kernel = getattr(MODULES[module], name)
    on = build(kernel, variant, trace=True)
    off = build(kernel, variant, trace=False)
    assert on["ptx"].count("%globaltimer") > off["ptx"].count("%globaltimer"), (key, variant)
    if key in ("moe", "attn", "attn_dkdv", "attn_dq", "signal"):
        assert "wgmma" in on["ptx"], "the traced kernel still uses Hopper's wgmma"


#: An SM's shared memory (H100 / H200) and what the hardware keeps of it per resident block
SM_SHARED, BLOCK_RESERVED = 233472, 1024


@pytest.mark.parametrize("table", ["GPU_CONFIGS", "GPU_CONFIGS_LONG"])
def test_attention_gpu_configs_fit(table):
    """Every GPU config of the attention kernels (d 128) compiles for sm_90 within a
    block's shared memory; the forward's and dK / dV's default configs fit two programs
    in one SM, which their choice in ``sp_attention.GPU_CONFIGS`` rests on."""
    from interlace.ops.attention import sp_attention as sp

    for (kind, d), cfg in getattr(sp, table).items():
        if d != 128:
            continue
        if kind == "fwd":
            out = _attn(attention_module.sp_attn_fwd_kernel, "full", False, cfg)
        else:
            name = "sp_attn_bwd_dkdv_kernel" if kind == "dkdv" else "sp_attn_bwd_dq_kernel"
            out = _attn_bwd(getattr(attention_module, name), "full", False, cfg)
        assert out["shared"] <= SM_SHARED - BLOCK_RESERVED, (kind, cfg, out["shared"])
        if table == "GPU_CONFIGS" and kind in ("fwd", "dkdv"):
            assert 2 * (out["shared"] + BLOCK_RESERVED) <= SM_SHARED, (kind, cfg, out["shared"])
