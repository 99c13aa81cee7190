"""Host side of the MoE grouped GEMM: tile configs and the launches of
``kernels.grouped_gemm.moe_gemm_kernel`` in its two modes and of ``MoERS``'s finish kernel
(each traced where a recorder is in force, ``interlace.trace.record``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.grouped_gemm import moe_finish_kernel, moe_gemm_kernel
from .. import _trace
from .._context import sm_count
from .._launch import host_descriptor, install_scratch_allocator
from .routing import MoeRouting

try:  # reduce mode's Hopper kernel is written in Gluon (Triton >= 3.5)
    from ...kernels import grouped_gemm_hopper as KH
except ImportError:  # an older Triton: the Triton kernel everywhere (``hopper_reduce``)
    KH = None


@dataclass(frozen=True)
class MoeGemmConfig:
    """Tile shape and launch parameters of the grouped GEMM. ``block_m`` is also the row
    padding of each expert in the routing (the same on every rank)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    #: one software-pipelined loop over the program's tiles and their K steps
    #: (``tl.range(flatten=True)``): the next tile's loads are issued under this one's
    #: epilogue. Only where A is read through a TMA descriptor (reduce mode): the gather's
    #: row loads lose their asynchronous copies in a flattened loop.
    flatten: bool = False
    #: reduce mode: programs per SM (its tiles wait for nothing, so a program's epilogue
    #: can run beside another's main loop where two fit in an SM's shared memory)
    occupancy: int = 1


#: the interpreter: small tiles keep the CPU tests fast
CPU_CONFIG = MoeGemmConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)

#: configs on an H100 / H200. gather: 128 x 128 per SwiGLU half, 8 warps, 4 stages won 7 of
#: the 12 TP-4 shapes of the sweep (3 stages the rest, within 5 %); reduce: 128 x 128,
#: 4 stages, flattened tile loop: the sweep's fastest on 8 of the 12 TP-4 shapes on an H200
#: (benchmarks/results/2026-11-29-h200-w1.json, config ``128x128x64w8s4f``; the others
#: chose 128 x 256, which failed the CUDA-graph test at rel err 1.08e-2, see
#: benchmarks/results/history/2026-11-25-h100-moe2-bench.log)
GPU_CONFIGS = {
    "gather": MoeGemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4),
    "reduce": MoeGemmConfig(
        block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, flatten=True
    ),
}

#: the configs ``bench.moe --sweep`` times (the row height is shared by both halves)
CANDIDATES = {
    "gather": [
        MoeGemmConfig(128, 128, 64, 8, 4),
        MoeGemmConfig(128, 128, 64, 8, 3),
        MoeGemmConfig(128, 64, 64, 4, 4),
        MoeGemmConfig(128, 64, 64, 8, 5),
    ],
    "reduce": [
        MoeGemmConfig(128, 128, 64, 8, 4),
        MoeGemmConfig(128, 64, 64, 4, 4),
        MoeGemmConfig(128, 256, 64, 8, 2, flatten=True),
        MoeGemmConfig(128, 256, 32, 8, 4, flatten=True),
        MoeGemmConfig(128, 128, 64, 8, 4, flatten=True),
        MoeGemmConfig(128, 128, 64, 8, 3, flatten=True),
        MoeGemmConfig(128, 64, 64, 4, 3, flatten=True, occupancy=2),
        MoeGemmConfig(128, 128, 32, 4, 3, flatten=True, occupancy=2),
    ],
}


def config_for(mode: str, backend: str) -> MoeGemmConfig:
    return CPU_CONFIG if backend != "cuda" else GPU_CONFIGS[mode]


def tma_ok(w: torch.Tensor) -> bool:
    """The tensor's rows (the weight's, or reduce mode's A) can be read through a TMA
    descriptor (16-byte aligned rows and base) on a GPU."""
    n_w = w.shape[-1]
    return w.is_cuda and (n_w * w.element_size()) % 16 == 0 and w.data_ptr() % 16 == 0


def programs(
    routing: MoeRouting, n: int, cfg: MoeGemmConfig, device, backend: str, reduce: bool = False
) -> int:  # fmt: skip
    """Persistent grid: one program per SM (gather mode: all resident, they wait on flags
    that other ranks raise), ``cfg.occupancy`` per SM in reduce mode; never more than the
    worst-case tiles."""
    tiles = routing.tiles.shape[0] * -(-n // cfg.block_n)
    if backend != "cuda":
        return max(1, min(tiles, 3))
    per_sm = cfg.occupancy if reduce else 1
    return max(1, min(tiles, per_sm * sm_count(device.index)))


#: reduce mode on Hopper: ``kernels.grouped_gemm_hopper`` where ``hopper_reduce`` holds
#: (off: the Triton kernel everywhere, for A/B runs). Its key and K blocks, ring stages per
#: byte width of the rows and the partitions' registers: 6 stages of 128 x 64 + 64 x 128
#: won on TileLink's six reduce shapes at TP 4 on one H200 against 4 and 5
#: (benchmarks/results/history/2026-11-29-h200-w1-gluon-grouped-gemm.txt); float32 rows
#: take 5: the epilogue's layout change stages 64 KiB of shared memory for them (16 KiB
#: for bf16), and 6 stages then exceed a block's 227 KiB.
HOPPER_REDUCE = True
HOPPER_BLOCK_N = 128
HOPPER_BLOCK_K = 64
HOPPER_STAGES = {4: 5, 2: 6}
HOPPER_REGS = (232, 40)


def hopper_reduce(a, w, rows_out, cfg: MoeGemmConfig, use_tma: bool) -> bool:
    """Whether a reduce-mode launch runs the Hopper kernel: Gluon in the installed Triton,
    a Hopper GPU (compute capability 9), A, the weights and the rows readable / writable
    through TMA (``use_tma``), the routing's rows padded to its 128-row tiles, K and N
    multiples of its blocks (the widths its GPU checks cover), no trace recorder in force
    (traces record the Triton kernel's tiles) and ``HOPPER_REDUCE`` on."""
    return (
        HOPPER_REDUCE
        and KH is not None
        and use_tma
        and cfg.block_m == 128
        and w.shape[1] % HOPPER_BLOCK_K == 0
        and w.shape[2] % HOPPER_BLOCK_N == 0
        and a.dtype in (torch.bfloat16, torch.float16)
        and _trace.hopper_untraced(a.device)
    )


def _launch_reduce_hopper(a, w, routing: MoeRouting, n: int, rows_out, row_of, sig,
                          sig_table, rank, done_slot, contrib_slot, world) -> None:  # fmt: skip
    e, k, n_w = w.shape
    bn, bk = HOPPER_BLOCK_N, HOPPER_BLOCK_K
    tiles = routing.tiles.shape[0] * -(-n // bn)  # worst case (the device count is less)
    grid = max(1, min(tiles, sm_count(a.device.index)))
    KH.moe_reduce_gemm_hopper_kernel[(grid,)](
        host_descriptor(a.view(-1, k), [128, bk]), host_descriptor(w.view(e * k, n_w), [bk, bn]),
        rows_out, row_of, routing.tiles, routing.tile_count, routing.entry_ids,
        routing.weights, k, n, sig, sig_table, rank, done_slot, contrib_slot,
        WORLD=world, STAGES=HOPPER_STAGES[rows_out.element_size()],
        CONSUMER_REGS=HOPPER_REGS[0],
        LOADER_REGS=HOPPER_REGS[1], num_warps=4,
    )  # fmt: skip


def launch_gemm(
    *, a, x_own, w, out, routing: MoeRouting, n: int, up: int, cfg: MoeGemmConfig, grid: int,
    gather: bool, swiglu: bool, reduce: bool, rows_out=None, row_of=None, sig=None,
    sig_table=None,
    flag0=0, err=0, rank=0, max_spins=0, done_slot=0, clear=None, contrib_slot=0,
    wait=False, world=1, use_tma: bool | None = None,
) -> str:  # fmt: skip
    """One launch of the grouped GEMM on the current stream (see the kernel); reduce mode
    on the Hopper kernel where ``hopper_reduce`` holds (``grid`` and ``cfg``'s tile then
    its own). Returns the kernel launched: ``"hopper"`` or ``"triton"``.
    ``use_tma``: read the weight tiles (and reduce mode's A tiles) through TMA
    descriptors; None: wherever ``tma_ok`` allows it (False forces the pointer path, which
    probes compare against).
    A launch is traced (``TRACE`` on) where a recorder is in force
    (``interlace.trace.record``): gather mode (``AGMoE``) as ``_trace.GROUPED_GEMM``,
    reduce mode (``MoERS``) as :data:`REDUCE_GEMM`."""
    use_tma = tma_ok(w) if use_tma is None else bool(use_tma) and tma_ok(w)
    # without the gather, A is read through TMA too; reduce mode stores its rows so
    use_tma = use_tma and (gather or tma_ok(a)) and (not reduce or tma_ok(rows_out))
    if reduce and not gather and hopper_reduce(a, w, rows_out, cfg, use_tma):
        _launch_reduce_hopper(a, w, routing, n, rows_out, row_of, sig, sig_table, rank,
                              done_slot, contrib_slot, world)  # fmt: skip
        return "hopper"
    if use_tma:
        install_scratch_allocator()
    stand_in = routing.entry_ids
    k = w.shape[1]
    traced = {}
    if _trace.ACTIVE:  # recorded where a recorder is in force
        tiles = routing.tiles.shape[0] * -(-n // cfg.block_n)  # worst case (device count)
        info = dict(
            kernel=_trace.GROUPED_GEMM if gather else REDUCE_GEMM, layout="tiles",
            mode="gather" if gather else "reduce", grid=grid, rank=rank, world=world,
            tiles=routing.tiles, tile_count=routing.tile_count, M=routing.rows, N=n, K=k,
            block_m=cfg.block_m, block_n=cfg.block_n,
        )  # fmt: skip
        tbuf = _trace.buffer(grid, -(-tiles // grid), info)
        if tbuf is not None:
            traced = dict(TRACE=True, tbuf=tbuf)
    moe_gemm_kernel[(grid,)](
        a, x_own if x_own is not None else a, w, out if out is not None else a, routing.tiles,
        routing.tile_count, routing.entry_ids, routing.weights, routing.m_loc, routing.topk,
        w.shape[0], k, n, w.shape[2], up, rows_out if rows_out is not None else a,
        row_of if row_of is not None else stand_in,
        sig if sig is not None else stand_in, sig_table if sig_table is not None else stand_in,
        flag0, err, rank, max_spins, done_slot, *(clear or (0, 0)), contrib_slot,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, WORLD=world,
        GATHER=gather, SWIGLU=swiglu, REDUCE=reduce, WAIT=wait, USE_TMA=use_tma,
        EXIT_CLEAR=clear is not None, FLATTEN=cfg.flatten and use_tma and not gather,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **traced,
    )  # fmt: skip
    return "triton"


#: the finish kernel's tile (32 token rows x 128 columns), its warps and programs per SM.
#: Its reads run at 2.5-3.5 TB/s on one H200, about a device copy's 2.8 (read + written);
#: five other shapes were 10 % faster to 12 % slower case by case, none faster everywhere
#: (benchmarks/results/history/2026-11-30-h200-w1-moe-bounds.txt).
FINISH_BLOCK = (32, 128)
FINISH_WARPS = 8
FINISH_PER_SM = 2

#: the names of ``MoERS``'s kernels in traces (``AGMoE``'s: ``_trace.GROUPED_GEMM``)
REDUCE_GEMM = "moe_gemm_reduce"
FINISH = "moe_finish"


def launch_finish(
    rows_table, set_off, map_table, map_off, y, m, topk, sig, contrib_slot, done_slot, err,
    rank, max_spins, world, device, backend, rows_f32: bool = True, aligned: bool = False,
):  # fmt: skip
    """The owner's top-k sum and reduce-scatter of ``MoERS`` (``moe_finish_kernel``) into
    ``y [m, N]`` on the current stream: the ``topk`` rows of each of this rank's tokens in
    every rank's row buffer (float32, or ``y``'s type: ``rows_f32`` off; ``set_off``
    elements into each), found through that rank's entry -> row map (``map_table``,
    ``map_off`` int32 elements into each), summed; traced
    (``TRACE`` on, as :data:`FINISH`) where a recorder is in force. ``aligned``: every
    rank's buffer in ``rows_table`` starts on 16 bytes (with ``set_off`` a multiple of 16
    bytes too, the loads move 16 bytes each)."""
    bm, bn = (16, 16) if backend != "cuda" else FINISH_BLOCK
    n = y.shape[1]
    tiles = -(-m // bm) * -(-n // bn)
    cap = FINISH_PER_SM * sm_count(device.index) if backend == "cuda" else 2
    grid = max(1, min(tiles, cap))
    traced = {}
    if _trace.ACTIVE:  # program p: one wait, then tiles p, p + grid, ...
        info = dict(
            kernel=FINISH, layout="tiles", slots="finish", grid=grid, rank=rank,
            world=world, n_tiles=tiles, M=m, N=n, block_m=bm, block_n=bn,
        )  # fmt: skip
        tbuf = _trace.buffer(grid, -(-tiles // grid), info)
        if tbuf is not None:
            traced = dict(TRACE=True, tbuf=tbuf)
    elem = 4 if rows_f32 else y.element_size()
    aligned = aligned and backend == "cuda" and set_off * elem % 16 == 0
    moe_finish_kernel[(grid,)](
        rows_table, set_off, map_table, map_off, y, m, n, sig, contrib_slot, done_slot, err,
        rank, max_spins,
        WORLD=world, TOPK=topk, BLOCK_M=bm, BLOCK_N=bn, ROWS_F32=rows_f32, ALIGNED=aligned,
        num_warps=FINISH_WARPS, **traced,
    )  # fmt: skip
