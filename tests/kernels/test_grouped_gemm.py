"""The MoE kernels compile for Hopper (no GPU needed: ``triton.compile`` for cuda:90) in
every mode the ops launch, and the gather GEMM's A loads stay after the tile's wait."""

from __future__ import annotations

import re

import pytest

from interlace.testing import codegen as inspect

pytestmark = pytest.mark.skipif(
    inspect.cuda_compile_unavailable() is not None,
    reason=str(inspect.cuda_compile_unavailable()),
)


def _routing_kernels():
    from interlace.kernels import grouped_gemm as g

    i32, p32 = "i32", "*i32"
    common = {"meta": p32, "meta_stride": i32, "mk": i32, "cps": i32, "E": i32, "sig": p32,
              "flag0": i32, "err": "i64", "rank": i32, "max_spins": i32}  # fmt: skip
    route = {
        **common, "w_off": i32, "counts": p32, "n_chunks": i32, "offsets": p32, "tiles": p32,
        "tile_count": p32, "scratch": p32, "base_scratch": p32, "sorted_entry": p32,
        "sorted_w": "*fp32", "bar_slot": i32,
    }  # fmt: skip
    # one launch, the count alone, the build alone (counts in one load, or CB at a time)
    for phase, nc_pad in ((0, 32), (1, 0), (2, 0), (2, 64)):
        yield g.moe_route_kernel, route, {
            "CHUNK": 1024, "E_PAD": 64, "WORLD": 4 if phase else 8, "BLOCK_M": 128, "CB": 32,
            "TB": 64, "WAIT": True, "PHASE": phase, "NC_PAD": nc_pad, "W_PAD": 4 if phase else 8,
        }  # fmt: skip
    yield g.moe_finish_kernel, {
        "rows_table": "*i64", "set_off": i32, "map_table": "*i64", "map_off": i32,
        "y": "*bf16", "m_loc": i32, "N": i32, "sig": p32,
        "contrib_slot": i32, "done_slot": i32, "err": "i64", "rank": i32, "max_spins": i32,
    }, {"WORLD": 4, "TOPK": 2, "BLOCK_M": 32, "BLOCK_N": 128, "ROWS_F32": True,
        "ALIGNED": True, "TRACE": False, "tbuf": None}  # fmt: skip


@pytest.mark.parametrize("i", range(5))
def test_routing_kernels_compile_for_hopper(i):
    kernel, sig, const = list(_routing_kernels())[i]
    inspect.compile_for_hopper(kernel, sig, const, num_stages=1)


#: the arguments Triton sees 16-byte aligned at the ops' launches
_ALIGNED = ("a", "x_own", "w", "out", "rows_out", "K", "N")


def _gemm_sig():
    i32, p32 = "i32", "*i32"
    return {
        "a": "*bf16", "x_own": "*bf16", "w": "*bf16", "out": "*bf16", "tiles": p32,
        "tile_count": p32, "sorted_entry": p32, "sorted_w": "*fp32", "m_loc": i32,
        "k_top": i32, "E": i32, "K": i32, "N": i32, "N_W": i32, "UP": i32, "rows_out": "*fp32",
        "row_of": p32, "sig": p32, "sig_table": "*i64", "flag0": i32, "err": "i64",
        "rank": i32, "max_spins": i32,
        "done_slot": i32, "clear_first": i32, "clear_count": i32, "contrib_slot": i32,
    }  # fmt: skip


@pytest.mark.parametrize("mode", ["gather_swiglu", "gather_plain", "reduce", "reduce_flat"])
@pytest.mark.parametrize("tma", [True, False])
def test_gemm_compiles_for_hopper(mode, tma):
    from interlace.kernels.grouped_gemm import moe_gemm_kernel

    reduce = mode.startswith("reduce")
    const = dict(
        BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, WORLD=4, GATHER=not reduce,
        SWIGLU=mode == "gather_swiglu", REDUCE=reduce, WAIT=not reduce,
        USE_TMA=tma, EXIT_CLEAR=not reduce, FLATTEN=mode == "reduce_flat" and tma,
        TRACE=False, tbuf=None,
    )  # fmt: skip
    ir = inspect.compile_for_hopper(
        moe_gemm_kernel, _gemm_sig(), const,
        aligned=_ALIGNED, num_warps=8, num_stages=3,
    )  # fmt: skip
    assert "wgmma" in ir["ptx"], "the grouped GEMM should use Hopper's wgmma"
    assert "local" not in re.findall(r"\bst\.(\w+)", ir["ptx"]), "registers spill"
    if reduce and tma:  # A, the weights and the rows through TMA descriptors
        assert "cp.async.bulk.tensor" in ir["ptx"] and "cp.async.cg" not in ir["ptx"]
        assert re.search(r"cp\.async\.bulk\.tensor\.2d\.global\.shared", ir["ptx"]), "no TMA store"
    if reduce:  # weighted rows: whole-tile stores, no float atomics
        atomics = set(re.findall(r"\b(?:atom|red)\.global\.[\w.]+", ir["ptx"]))
        assert not any(a.endswith("f32") for a in atomics), atomics
        if not tma:
            assert re.search(r"\bst\.global(\.\w+)*\.v4\.b32", ir["ptx"]), "no 16-byte stores"
    if not reduce:  # the gathered rows' loads take their mask from the wait
        loads = inspect.data_loads(ir["ttgir"])
        assert any(ld.guarded_by("mask") for ld in loads), "no A load depends on the wait"


@pytest.mark.parametrize("rows_f32", [True, False])
@pytest.mark.parametrize("aligned", [True, False])
def test_finish_loads_16_bytes_where_aligned(rows_f32, aligned):
    """The owner's finish reads every rank's rows with 16-byte loads where the host vouched
    for the buffers' alignment, and only there (scalar loads otherwise)."""
    from interlace.ops.moe._gemm import FINISH_BLOCK

    kernel, sig, const = list(_routing_kernels())[-1]  # (the finish kernel, last)
    bm, bn = FINISH_BLOCK
    const = {**const, "WORLD": 4, "TOPK": 5, "BLOCK_M": bm, "BLOCK_N": bn,
             "ROWS_F32": rows_f32, "ALIGNED": aligned}  # fmt: skip
    ptx = inspect.compile_for_hopper(
        kernel, sig, const, aligned=("rows_table", "y", "N", "sig"), num_warps=8
    )["ptx"]
    wide = re.findall(r"\bld\.global\.v4\.b32", ptx)
    assert bool(wide) == aligned, len(wide)
    assert "local" not in re.findall(r"\bst\.(\w+)", ptx), "registers spill"


def _configs():
    from interlace.ops.moe import _gemm

    for mode in ("gather", "reduce"):
        for cfg in dict.fromkeys([_gemm.GPU_CONFIGS[mode], *_gemm.CANDIDATES[mode]]):
            yield mode, cfg


@pytest.mark.parametrize("mode,cfg", list(_configs()), ids=str)
def test_every_gpu_config_fits_in_shared_memory(mode, cfg):
    """Each config the ops or ``bench moe``'s sweep launch on a GPU (TMA descriptors on, as
    there) fits in an H100 / H200 block's shared memory, ``occupancy`` programs in one SM's
    (233,472 bytes, 1,024 of them reserved per program)."""
    from interlace.kernels.grouped_gemm import moe_gemm_kernel

    gather = mode == "gather"
    const = dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, WORLD=4, GATHER=gather,
        SWIGLU=gather, REDUCE=not gather, WAIT=gather, USE_TMA=True, EXIT_CLEAR=gather,
        FLATTEN=cfg.flatten and not gather, TRACE=False, tbuf=None,
    )  # fmt: skip
    ir = inspect.compile_for_hopper(
        moe_gemm_kernel, _gemm_sig(), const, aligned=_ALIGNED, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    assert ir["shared"] <= 232448, f"{cfg}: {ir['shared']} bytes of shared memory"
    assert cfg.occupancy * (ir["shared"] + 1024) <= 233472, f"{cfg}: {ir['shared']} bytes"
