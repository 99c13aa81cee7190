"""Host side of the segment GEMM: tile configs, segment tables, the launch, and the plain
``matmul`` built on it.

A *segment* is one communication chunk of rows (see ``kernels.gemm``). The overlapped ops
describe their chunks in arrival order (AG+GEMM) or in the order the scatter needs them
(GEMM+RS / GEMM+AR); :func:`segment_table` turns that into the kernel's int32 table.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from ..errors import InterlaceTypeError, InterlaceValueError
from ..kernels.gemm import (
    KIND_PUSH,
    KIND_REDUCE,
    KIND_STORE,
    KIND_STORE_OWN,
    SEG_COLS,
    gemm_segments_kernel,
)
from ..runtime.signals import ERROR_WORDS
from . import _trace
from ._context import cdiv, sm_count
from ._launch import PreparedLaunch, install_scratch_allocator
from .configs import gemm_configs

KINDS = {
    "store": KIND_STORE.value,
    "push": KIND_PUSH.value,
    "reduce": KIND_REDUCE.value,
    "store_own": KIND_STORE_OWN.value,
}


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and launch parameters of the segment GEMM (the same on every rank: the
    tile grid defines the signal counts)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    subtile: bool = False  # store the output tile in two halves (frees shared memory)


#: The two segment-GEMM configs the H200 tuning runs found best (128 x 256 tiles with 8
#: warps and 3 stages on most shapes; 128 x 128 tiles with 4 warps and 5 stages where the
#: wide tiles fill the last wave of SMs badly): ``benchmarks/results/history/
#: 2026-11-21-h200-gemm-tuning-run1.json`` and ``2026-11-22-...-run2.json``.
WIDE = GemmConfig()
NARROW = GemmConfig(block_n=128, num_warps=4, num_stages=5)
#: How much better the narrow tiles must fill the waves to be picked: the wide tiles run a
#: few per cent faster where both fill the waves alike. With 1.05, over the 36 shapes of
#: both tuning runs the model's pick takes at worst 1.079 x (geometric mean 1.008 x) the
#: best candidate's time, against 1.296 x (1.023 x) for the rule it replaced (narrow
#: tiles where K <= 4096, N <= 8192 and N is no multiple of 256); 1.00-1.10 give the same
#: worst case (``benchmarks/probes/gemm_wave_model.py`` recomputes this).
WAVE_MARGIN = 1.05


def wave_efficiency(m: int, n: int, cfg: GemmConfig, sms: int) -> float:
    """The share of the SMs' wave slots that the tiles of an ``m x n`` output fill: tiles
    / (waves x SMs), a persistent GEMM running one tile per SM at a time."""
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    return tiles / (cdiv(tiles, sms) * sms)


def modelled_config(m: int, n: int, sms: int, margin: float = WAVE_MARGIN) -> GemmConfig:
    """The config for a shape the tuned table lacks: :data:`NARROW` where its tiles fill
    the waves at least ``margin`` times better than :data:`WIDE`'s, else WIDE."""
    narrow, wide = wave_efficiency(m, n, NARROW, sms), wave_efficiency(m, n, WIDE, sms)
    return NARROW if narrow > margin * wide else WIDE


@functools.cache
def _device_sms(device_index: int) -> int:
    return sm_count(device_index)


def gemm_config(m: int, n: int, k: int, backend: str = "cuda") -> GemmConfig:
    """The tile config for a GEMM shape: the tuned one (``ops/configs/gemm.json``,
    measured on an H200), else the wave model (:func:`modelled_config`) for this GPU's SM
    count. A function of the shape and the GPU model only, so every rank picks the same
    config without talking (the tile grid defines the signal counts)."""
    if backend != "cuda":  # the interpreter: small tiles keep CPU tests fast
        return GemmConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1)
    tuned = gemm_configs().get((m, n, k))
    if tuned is not None:
        return GemmConfig(**tuned)
    return modelled_config(m, n, _device_sms(torch.cuda.current_device()))


SHARED_BYTES = 224 * 1024  # of an H200 SM's 227 KB, leaving room for Triton's own use


def with_epilogue_room(cfg: GemmConfig, itemsize: int = 2) -> GemmConfig:
    """The config for a kernel whose epilogue also stores tiles through registers (pushes
    to peers, all-reduce broadcasts): that store needs a tile of shared memory for its
    layout change, so store halves and drop pipeline stages until it fits."""
    tile = cfg.block_m * cfg.block_n * itemsize
    stage = (cfg.block_m + cfg.block_n) * cfg.block_k * itemsize
    subtile = cfg.subtile or cfg.block_n >= 256
    stages = cfg.num_stages
    # the TMA store buffer (halved by subtiling) plus ~0.6 tile for the layout change
    # (measured: 128x256x64, 3 stages, whole-tile store needed 245,784 bytes)
    while stages > 2 and stages * stage + tile * ((0.5 if subtile else 1) + 0.6) > SHARED_BYTES:
        stages -= 1
    return replace(cfg, subtile=subtile, num_stages=stages)


def scatter_config(cfg: GemmConfig, n: int, widen: bool = True) -> GemmConfig:
    """The config of a GEMM+RS / GEMM+AR kernel (push and reduce epilogues) from the plain
    GEMM's: 128-column tiles widened to 256 and 8 warps (``widen``, where ``n`` allows),
    the reduce tiles' epilogue then having twice the warps per tile (LLaMA-3-8B, M 8192,
    TP 4, the kernel alone on one H200: GEMM+RS 0.402 -> 0.390 ms, GEMM+AR 0.437 ->
    0.412, ``history/2026-11-24-h200-ce-fused-other-tiles-probe.txt``; over five models,
    M 2048 / 8192, W 4 / 8, ``fused`` and ``ce_fused``, the wide tiles were the faster in
    every group, ``history/2026-11-30-h200-w1-scatter-tiles.txt``); then room made for the
    epilogue (``with_epilogue_room``)."""
    if widen and cfg.block_n < 256 <= n:
        cfg = replace(cfg, block_n=256, num_warps=8, num_stages=3)
    return with_epilogue_room(cfg)


#: most chunks per owner a GEMM+RS / GEMM+AR / AG+GEMM call is cut into (the signal
#: regions are sized for it)
MAX_SPLIT = 8


@dataclass(frozen=True)
class Segment:
    """One chunk of rows as the GEMM sees it (see ``kernels.gemm`` for the fields)."""

    row0: int
    rows: int
    kind: str = "store"
    owner: int = 0
    out_row0: int = 0
    wait_first: int = 0
    wait_count: int = 0
    wait_expected: int = 1
    notify: int = 0
    final_slot: int = 0
    final_expected: int = 0


def tiles_of(rows: int, n: int, cfg: GemmConfig) -> int:
    return cdiv(rows, cfg.block_m) * cdiv(n, cfg.block_n)


def segment_table(segments: list[Segment], n: int, cfg: GemmConfig, device) -> torch.Tensor:
    """The kernel's ``[len(segments), SEG_COLS]`` int32 table (with each segment's first
    tile in one global numbering)."""
    rows, tile0 = [], 0
    for s in segments:
        if s.rows <= 0:
            raise InterlaceValueError(f"segment with {s.rows} rows")
        rows.append(
            [
                tile0, s.row0, s.rows, KINDS[s.kind], s.owner, s.out_row0, s.wait_first,
                s.wait_count, s.wait_expected, s.notify, s.final_slot, s.final_expected,
            ]
        )  # fmt: skip
        tile0 += tiles_of(s.rows, n, cfg)
    assert len(rows[0]) == SEG_COLS.value
    return to_device(torch.tensor(rows, dtype=torch.int32), device)


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A host table on ``device``, also while a CUDA graph is being captured (a plan may be
    built then, e.g. when ``auto`` picks ``fused`` for the first time inside a capture):
    the copy comes from pinned memory, kept alive by the returned tensor's owner."""
    if torch.device(device).type != "cuda":
        return host
    pinned = host.pin_memory()
    table = torch.empty_like(pinned, device=device)
    table.copy_(pinned, non_blocking=True)
    table._interlace_host = pinned  # the capture's copy node reads it at every replay
    return table


@dataclass(frozen=True)
class OneLoop:
    """What the kernel's ``ONE_LOOP`` mode reads besides the segment table."""

    mt_seg: torch.Tensor  # int32 [rows of tiles]: the segment of each
    lead_tiles: int  # tiles of the leading ``store_own`` / ``push`` segments (own loop)


def one_loop_tables(segments: list[Segment], m: int, n: int, k: int, cfg, dtype, device):
    """The tables of the kernel's one-loop mode for these segments, or None where it does
    not apply. It needs TMA, more than one segment, and no tile overhanging its segment's
    last row into another segment's rows (each segment a multiple of ``block_m`` rows, or
    ending at row ``m``); and either store segments (``store_own`` ones first, at most one
    signal each) or push segments then reduce segments (``ce_fused``, whose launch stages
    its pushes; its counters then count ``num_warps`` per tile: :func:`count_unit`). The
    leading ``store_own`` or ``push`` segments run in a first loop (``lead_tiles``)."""
    if len(segments) < 2 or not tma_ok(k, n, dtype):
        return None
    if any(s.rows % cfg.block_m and s.row0 + s.rows != m for s in segments):
        return None
    kinds = [s.kind for s in segments]
    lead_kind = "push" if "push" in kinds or "reduce" in kinds else "store_own"
    lead = 0
    while lead < len(segments) and kinds[lead] == lead_kind:
        lead += 1
    rest = segments[lead:]
    if lead_kind == "push":
        if not all(s.kind == "reduce" for s in rest):  # reduce segments only at the end
            return None
    elif not all(s.kind == "store" and s.wait_count <= 1 for s in rest):
        return None
    mt_seg = []
    for i, s in enumerate(segments):
        mt_seg += [i] * cdiv(s.rows, cfg.block_m)
    lead_tiles = total_tiles(segments[:lead], n, cfg)
    return OneLoop(to_device(torch.tensor(mt_seg, dtype=torch.int32), device), lead_tiles)


def count_unit(one_loop: OneLoop | None, cfg: GemmConfig) -> int:
    """What one finished tile adds to a chunk's counter: 1 (one release per program and
    segment, adding its tiles), or ``num_warps`` in the one-loop mode (each warp of the
    tile's program adds 1)."""
    return 1 if one_loop is None else cfg.num_warps


def total_tiles(segments: list[Segment], n: int, cfg: GemmConfig) -> int:
    return sum(tiles_of(s.rows, n, cfg) for s in segments)


def tma_ok(k: int, n: int, dtype: torch.dtype) -> bool:
    """TMA descriptors need 16-byte aligned row strides."""
    return (k * dtype.itemsize) % 16 == 0 and (n * dtype.itemsize) % 16 == 0


def programs_for(tiles: int, device, backend: str, comm_sms: int = 0, single: bool = False):
    """Persistent grid: at most one program per SM left after ``comm_sms`` (all programs
    must be resident at once: they wait on each other across ranks)."""
    if backend != "cuda":
        # The interpreter runs programs one after another: a program that waits on a
        # peer must not depend on a later program of its own launch.
        return 1 if single else min(tiles, 3)
    return max(1, min(tiles, sm_count(device.index) - comm_sms))


#: Constexprs of ``gemm_segments_kernel`` that every launcher made from now on takes
#: instead of its own: a probe sets them to time two variants of the kernel in one
#: process (``benchmarks/probes/kernel_ab.py``). Empty in the library.
KERNEL_OVERRIDES: dict = {}

#: the segment GEMM's parameters that change from call to call (the op's operands)
OPERANDS = ("a", "b", "c", "bias", "a_own")


@dataclass(frozen=True)
class Tiles:
    """What one launch computes: the segment table of a plan (:func:`segment_table`), the
    persistent grid, the first segment whose tiles this launch computes and the end
    (``count``: segments ``first .. count - 1``), and the one-loop tables (or None)."""

    cfg: GemmConfig
    table: torch.Tensor
    count: int
    grid: int
    first: int = 0
    one_loop: OneLoop | None = None


@dataclass(frozen=True)
class Signals:
    """The launch's signal arguments: the local pad ``sig`` (and ``sig_table``, every
    rank's pad, for remote notifies), the error word's address, this rank, the bound on
    spins, the world size. ``bar_slot`` (not None): program 0 runs the entry barrier on
    those slots and raises ``go_slot``; ``clear``: ``(first, count)`` local slots the
    launch zeroes as it ends; ``notify_stores``: store segments count finished tiles in
    their notify slot."""

    sig: torch.Tensor
    err: int
    rank: int
    max_spins: int
    world: int
    sig_table: torch.Tensor | None = None
    bar_slot: int | None = None
    go_slot: int = 0
    clear: tuple[int, int] | None = None
    notify_stores: bool = False


@dataclass(frozen=True)
class PeerStores:
    """Where the epilogue sends tiles besides ``c``. ``push``: partial tiles of other
    ranks' rows go to their owner's ``recv`` (``recv_table``: every rank's; ``recv_rows``
    rows per source), or, with ``stage``, into this local buffer, counted in local slots;
    ``broadcast``: reduced tiles are stored into every rank's output (``out_table``)."""

    push: bool = False
    broadcast: bool = False
    recv: torch.Tensor | None = None
    recv_table: torch.Tensor | None = None
    recv_rows: int = 0
    out_table: torch.Tensor | None = None
    stage: torch.Tensor | None = None


def peer_loads(world: int) -> int:
    """How many peers' partials a reduce tile of the one-loop scatter loads at once: all
    of them up to 4 ranks, one at a time beyond. On one H200 as rank 0 of 8 (``ce_fused``,
    the public shapes at M 2048 / 8192), all seven at once took 1.06 x the time of one at
    a time (GEMM+RS, LLaMA-7B, M 2048: 1.94 against 1.59 x cuBLAS), and GEMM+AR's spilled
    registers; at 4 ranks one at a time was even (1.001 x):
    ``benchmarks/results/history/2026-11-29-h200-w1-peer-loads-probe.txt``."""
    return world - 1 if world <= 4 else 1


def launcher(
    m: int, n: int, k: int, tiles: Tiles, *, dtype, device, has_bias: bool = False,
    own_rows: int = 0, signals: Signals | None = None, peers: PeerStores | None = None,
) -> GemmLaunch:  # fmt: skip
    """The segment GEMM of one plan, its fixed arguments bound once: call it with the
    operands ``(a, b, c, bias, a_own)`` (``bias`` / ``a_own`` None when absent), on the
    current stream. ``own_rows`` (> 0): ``store_own`` segments read that many rows of A
    from ``a_own`` (AG+GEMM's own shard, in place). ``signals``: None for a GEMM that
    neither waits nor notifies; ``peers``: None for one that only stores into ``c``."""
    sg = signals or Signals(sig=tiles.table, err=0, rank=0, max_spins=0, world=1)
    ps = peers or PeerStores()
    one_loop = tiles.one_loop
    use_tma = tma_ok(k, n, dtype)
    if one_loop is not None and (
        sg.notify_stores or ps.push != (ps.stage is not None) or not use_tma
    ):
        raise InterlaceValueError(
            "the one-loop mode runs store segments, or pushes into a stage, with TMA"
        )
    if use_tma and torch.device(device).type == "cuda":
        install_scratch_allocator()
    err = sg.err or _unused_error_word(torch.device(device)).data_ptr()  # a 64-bit address
    table = tiles.table  # stands in for every absent tensor (the kernel never reads it)
    pick = lambda t: table if t is None else t  # noqa: E731
    args = (
        None, None, None, None, m, n, k, None, max(own_rows, 1), table, tiles.count,
        pick(ps.recv), pick(ps.recv_table), max(ps.recv_rows, 1), pick(ps.out_table),
        pick(ps.stage), pick(sg.sig if signals is not None else None), pick(sg.sig_table),
        err, sg.rank, sg.max_spins, sg.bar_slot or 0, sg.go_slot, *(sg.clear or (0, 0)),
        tiles.first, one_loop.mt_seg if one_loop is not None else table,
        one_loop.lead_tiles if one_loop is not None else 0,
    )  # fmt: skip
    cfg = tiles.cfg
    kwargs = dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        WORLD=sg.world, USE_TMA=use_tma, HAS_BIAS=has_bias, HAS_PUSH=ps.push,
        BROADCAST=ps.broadcast, HAS_OWN_A=own_rows > 0, SUBTILE=cfg.subtile,
        ENTRY_BARRIER=sg.bar_slot is not None, EXIT_CLEAR=sg.clear is not None,
        NOTIFY_STORES=sg.notify_stores, STAGE_PUSHES=ps.stage is not None,
        ONE_LOOP=one_loop is not None, COUNT_UNIT=count_unit(one_loop, cfg),
        PEER_LOADS=peer_loads(sg.world), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    kwargs.update(KERNEL_OVERRIDES)
    return GemmLaunch(PreparedLaunch(gemm_segments_kernel, tiles.grid, args, kwargs, OPERANDS))


class GemmLaunch:
    """The prepared segment GEMM of one plan: ``run(a, b, c, bias=None, a_own=None)``."""

    def __init__(self, prepared: PreparedLaunch):
        self.prepared = prepared

    @staticmethod
    def _operands(a, b, c, bias, a_own):
        # absent tensors are stand-ins the kernel never reads (``HAS_BIAS``/``HAS_OWN_A``)
        return a, b, c, c if bias is None else bias, a if a_own is None else a_own

    def __call__(self, a, b, c, bias=None, a_own=None) -> None:
        operands = self._operands(a, b, c, bias, a_own)
        if _trace.ACTIVE and _trace.launch_gemm(self.prepared, operands):
            return  # traced (``interlace.trace.record``)
        self.prepared(*operands)

    def compile(self, a, b, c, bias=None, a_own=None) -> None:
        """Compile now, without launching: for a GEMM enqueued behind kernels that already
        spin waiting for it (its first compile could outlast their bounded wait)."""
        self.prepared.compile(*self._operands(a, b, c, bias, a_own))


def plan_tiles(
    segments: list[Segment], m: int, n: int, cfg: GemmConfig, device, backend: str, *,
    comm_sms: int = 0, single: bool = False, one_loop: OneLoop | None = None,
) -> Tiles:  # fmt: skip
    """The :class:`Tiles` of a plan's segments: their table and a persistent grid that
    leaves ``comm_sms`` SMs free (``single``: one program on the interpreter)."""
    table = segment_table(segments, n, cfg, device)
    grid = programs_for(total_tiles(segments, n, cfg), device, backend, comm_sms, single)
    return Tiles(cfg, table, len(segments), grid, one_loop=one_loop)


@functools.cache
def _unused_error_word(device) -> torch.Tensor:
    """A whole error word (zeros: no group fault word, no call slot) for launches that run
    no wait."""
    return torch.zeros(ERROR_WORDS, dtype=torch.int32, device=device)


SUPPORTED = (torch.bfloat16, torch.float16)


def check_gemm_shape(op: str, max_m, n, k, dtype) -> None:
    """A GEMM context's capacity and dtype: ``max_m``, ``n`` and ``k`` positive, ``dtype``
    one of ``SUPPORTED``; the message names the op."""
    if dtype not in SUPPORTED:
        raise InterlaceTypeError(f"{op}: dtype must be one of {SUPPORTED}, got {dtype}")
    for name, v in (("max_m", max_m), ("n", n), ("k", k)):
        if int(v) <= 0:
            raise InterlaceValueError(f"{op}: {name} must be positive, got {v}")


def check_gemm_operands(op: str, a, b, bias=None) -> None:
    """Types and shapes every GEMM op needs, with a message that names the op."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise InterlaceTypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise InterlaceValueError(f"{op}: {name} must be 2-D, got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise InterlaceValueError(f"{op}: {name} must be contiguous (row-major)")
    if a.dtype != b.dtype or a.dtype not in SUPPORTED:
        raise InterlaceTypeError(
            f"{op}: a and b must both be one of {SUPPORTED}, got {a.dtype} and {b.dtype}"
        )
    if a.shape[1] != b.shape[0]:
        raise InterlaceValueError(
            f"{op}: a is {tuple(a.shape)} and b is {tuple(b.shape)}: inner dimensions differ"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != b.shape[1]):
        raise InterlaceValueError(f"{op}: bias must have shape ({b.shape[1]},)")
    if bias is not None and bias.dtype != a.dtype:
        raise InterlaceTypeError(f"{op}: bias has dtype {bias.dtype}, expected {a.dtype}")


def check_gemm_call(ctx, a, b, bias) -> None:
    """The operands of a call on the GEMM context ``ctx`` (an ``OpContext`` with ``k`` and
    ``n``): ``check_gemm_operands``, each a tensor of the context's dtype and device, ``a``
    with ``k`` columns and ``b`` with at most ``n``."""
    check_gemm_operands(ctx.op_name, a, b, bias)
    for name, t in (("a", a), ("b", b)):
        ctx._check_tensor(name, t)
    if bias is not None:
        ctx._check_tensor("bias", bias)
    if a.shape[1] != ctx.k:
        raise InterlaceValueError(
            f"{ctx.op_name}: a has {a.shape[1]} columns, the context was built for k = {ctx.k}"
        )
    if b.shape[1] > ctx.n:
        raise InterlaceValueError(
            f"{ctx.op_name}: b has {b.shape[1]} columns, more than the context's n = {ctx.n}"
        )
    check_tma_aligned(ctx.op_name, a, b)


def operands_fit(ctx, a, b, bias, a_rows_max: int) -> bool:
    """True when ``check_gemm_call`` (and the row bound) would accept these operands,
    judged in one expression; False means "run the full checks", which raise the clear
    error. (On an idle H200 host the full checks cost 14-35 µs of an eager call.)"""
    dtype, device = ctx.dtype, ctx.group.device
    try:
        return (
            a.dtype is dtype
            and b.dtype is dtype
            and a.dim() == 2
            and b.dim() == 2
            and 0 < a.shape[0] <= a_rows_max
            and a.shape[1] == ctx.k
            and b.shape[0] == ctx.k
            and 0 < b.shape[1] <= ctx.n
            and a.is_contiguous()
            and b.is_contiguous()
            and a.device == device
            and b.device == device
            and a.data_ptr() % 16 == 0
            and b.data_ptr() % 16 == 0
            and (
                bias is None
                or (
                    bias.dtype is dtype
                    and bias.dim() == 1
                    and bias.shape[0] == b.shape[1]
                    and bias.is_contiguous()
                    and bias.device == device
                )
            )
        )
    except (AttributeError, TypeError):
        return False


def check_tma_aligned(op: str, *tensors, names=("a", "b", "out")) -> None:
    """Tensors the GEMM reads or writes through TMA descriptors (when their row strides
    allow TMA at all) must start on a 16-byte boundary: a view that starts mid-row of a
    larger tensor may not."""
    for name, t in zip(names, tensors):
        if t is not None and tma_ok(t.shape[-1], t.shape[-1], t.dtype) and t.data_ptr() % 16:
            raise InterlaceValueError(
                f"{op}: {name} starts at an address that is not 16-byte aligned (a view "
                f"into a larger tensor?); pass a tensor of its own (e.g. {name}.clone())"
            )


def matmul(a: torch.Tensor, b: torch.Tensor, bias=None, out=None, cfg: GemmConfig | None = None):
    """``a @ b (+ bias)`` with the persistent segment GEMM (one segment, no signals): the
    plain kernel that the overlapped ops are built on, benchmarked against cuBLAS."""
    check_gemm_operands("matmul", a, b, bias)
    m, k = a.shape
    n = b.shape[1]
    backend = "cuda" if a.is_cuda else "cpu"
    cfg = cfg or gemm_config(m, n, k, backend)
    if out is None:
        out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    segs = [Segment(row0=0, rows=m)]
    table = _table_cache(m, n, cfg, a.device)
    grid = programs_for(total_tiles(segs, n, cfg), a.device, backend)
    run = launcher(
        m, n, k, Tiles(cfg, table, 1, grid), dtype=a.dtype, device=a.device,
        has_bias=bias is not None,
    )  # fmt: skip
    run(a, b, out, bias)
    return out


@functools.lru_cache(maxsize=64)
def _table_cache(m, n, cfg, device):
    return segment_table([Segment(row0=0, rows=m)], n, cfg, device)
