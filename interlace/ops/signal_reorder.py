"""GEMM + collective, overlapped by signals and a reordered output: the ``signal_reorder``
strategy (FlashOverlap's design).

A persistent GEMM (``kernels.signal_gemm``) computes its tiles wave by wave and writes each
finished tile into a *reordered* buffer where the tiles of each *wave group* are contiguous,
raising the group's counter. On a high-priority comm stream, per group, a one-program wait
kernel spins (bounded) until the group's counter is complete and resets it, then a stock
``torch.distributed`` collective runs on exactly that slice. Only the process group moves
bytes, so this works wherever it does (NVLink, PCIe, across nodes, any backend); no
symmetric memory. A final row kernel (``kernels.rmsnorm``) reads the result back through
the mapping table into normal layout, fused with RMSNorm when ``norm_weight`` is given.

Contexts (same call on every rank; ``a [M, k]``, ``b [k, n]``, ``M <= max_m``, ``n`` up to
the context's; ``bfloat16`` or ``float16``; ``bias [n]``)::

    ar = SignalReorderGemmAR(group, max_m, n, k)  # all_reduce(a @ b) + bias        [M, n]
    rs = SignalReorderGemmRS(group, max_m, n, k)  # reduce_scatter(a @ b) + bias    [M/W, n]
    aa = SignalReorderGemmA2A(group, max_m, n, k) # all_to_all(a @ b + bias)        [M, n]
    y = ar(a, b, bias=None, out=None, norm_weight=None, partition=None)

* reduce-scatter: rank ``r`` gets rows ``[r*M/W, (r+1)*M/W)`` of the sum over ranks, plus
  ``bias`` once (``M`` a multiple of ``W``).
* all-to-all: ``C = a @ b + bias`` on every rank, cut into ``W`` equal row pools; pool
  ``r`` of rank ``j`` lands at rows ``[j*M/W, (j+1)*M/W)`` of rank ``r``'s result, i.e.
  ``torch.distributed.all_to_all_single(result, C)`` with equal splits (``M`` a multiple of
  ``W``).
* ``norm_weight [n]``: the result is ``RMSNorm(result) * norm_weight`` (fp32 math,
  ``eps`` from the context), read from the reordered buffer in the same pass.

Layouts: all-reduce stores whole tiles (unit = tile). Reduce-scatter and all-to-all store
*sub-tiles*: a tile is ``W`` strips, strip ``k`` taken from rank ``k``'s share of the rows,
and each group is laid out as ``[W pools][tiles of the group]`` so that every group's slice
splits into ``W`` equal pools, pool ``k`` holding rows of share ``k`` only, which is what
``reduce_scatter_tensor`` and ``all_to_all_single`` need (whole tiles would give unequal
pools whenever a group's tiles are not spread evenly over the shares).

Partitions: ``partition`` lists the group sizes in waves (a wave is one tile per GEMM
program); they must sum to the shape's wave count (``ctx.waves(M, n)``). Without one, the
call takes the partition set with ``ctx.set_partition`` (what ``interlace.tune`` finds) or
``default_partition``. A single group runs cuBLAS + the collective back to back: with
nothing to overlap, that is the fastest way.

The GEMM runs ``SMs - comm_sms`` programs so that the wait kernels and the collectives'
kernels find free SMs while it runs (the GEMM itself never waits, so it always finishes).
On the ``cpu`` backend there are no streams: the GEMM runs, then each group's wait and
collective, in order.

Mismatched calls (ranks passing different ``M``, ``n``, ``k`` or partitions): on the ``cpu``
backend the context has a signal pad after all (a small one, ``/dev/shm`` being there
anyway): every call fingerprints ``M, N, K, partition`` (``OpContext._begin_call``) and runs
a device barrier that carries it before the first collective, so ranks that called
differently raise ``CallMismatchError`` on every rank, naming the field, and no collective
runs. On a GPU the context has no signal pad (the strategy needs no symmetric memory and
works across nodes), and the only way to compare the ranks' calls before the collectives
would be a host synchronisation per call: calls are not checked there, and a mismatch is
NCCL's to detect (its own timeout), as for the ``none`` strategy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import InterlaceTypeError, InterlaceValueError, WaitTimeoutError
from ..kernels.rmsnorm import reorder_rows_kernel
from ..kernels.signal_gemm import MAP_COLS, signal_gemm_kernel
from ..language.primitives import wait_kernel
from ..runtime import ErrorWord, Group, SignalPad, default_max_spins, fork, join, use_stream
from . import _trace
from . import segment_gemm as _gemm
from ._context import OpContext, cdiv, next_pow2, sm_count
from ._launch import install_scratch_allocator, launch

OPS = ("all_reduce", "reduce_scatter", "all_to_all")
#: Most wave groups per call (the counters a context owns).
MAX_GROUPS = 64
#: SMs left to the wait kernels and the collective while the GEMM runs (cuda).
DEFAULT_COMM_SMS = 16
#: GEMM programs under the interpreter: small, so tiny test shapes still have several waves.
CPU_PROGRAMS = 2
#: Largest row block (elements) the row kernel keeps in registers.
MAX_ROW_BLOCK = 16384
#: Capacity slack: tiles round rows and columns up by at most one block (<= 256).
_PAD = 256

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ----------------------------------------------------------------------------- layout
def tile_coords(t: int, tiles_m: int, tiles_n: int, group_m: int) -> tuple[int, int]:
    """Host twin of ``kernels.gemm._tile_coords``: the grouped order of the tile grid."""
    per_group = group_m * tiles_n
    first_m = (t // per_group) * group_m
    rows = min(tiles_m - first_m, group_m)
    return first_m + (t % per_group) % rows, (t % per_group) // rows


def strips_for(op: str, world: int) -> int:
    """Strips per tile: 1 (whole tiles) for all-reduce, else the world size rounded up to
    a power of two (strips past the world size hold no rows)."""
    return 1 if op == "all_reduce" else next_pow2(world)


@dataclass(frozen=True)
class Layout:
    """The tile grid of one call and the sizes of its reordered buffers (in elements)."""

    op: str
    m: int
    n: int
    world: int
    block_m: int
    block_n: int
    programs: int

    @property
    def strips(self) -> int:
        return strips_for(self.op, self.world)

    @property
    def sub_m(self) -> int:
        """Rows of a stored unit (a tile, or one strip of it)."""
        return self.block_m // self.strips

    @property
    def rows_per_rank(self) -> int:
        return self.m if self.strips == 1 else self.m // self.world

    @property
    def tiles_m(self) -> int:
        return cdiv(self.rows_per_rank, self.sub_m)

    @property
    def tiles_n(self) -> int:
        return cdiv(self.n, self.block_n)

    @property
    def n_tiles(self) -> int:
        return self.tiles_m * self.tiles_n

    @property
    def n_waves(self) -> int:
        return cdiv(self.n_tiles, self.programs)

    @property
    def unit(self) -> int:
        """Elements of one stored unit (slot)."""
        return self.sub_m * self.block_n

    @property
    def parts(self) -> int:
        """Units stored per tile."""
        return 1 if self.strips == 1 else self.world

    @property
    def sources(self) -> int:
        """Sets of tiles the result is read from (one per rank for all-to-all)."""
        return self.world if self.op == "all_to_all" else 1

    @property
    def send_numel(self) -> int:
        return self.n_tiles * self.parts * self.unit

    def group_bytes(self, count: int, itemsize: int) -> int:
        """Bytes each rank hands to the collective for a group of ``count`` tiles."""
        return count * self.parts * self.unit * itemsize


def make_layout(op: str, m: int, n: int, world: int, cfg, programs: int) -> Layout:
    """The layout of ``op`` on an ``m x n`` output with ``cfg``'s tiles."""
    return Layout(op, m, n, world, cfg.block_m, cfg.block_n, programs)


def default_partition(n_waves: int) -> list[int]:
    """Partition used when none is given: one wave first (communication starts early),
    one wave last (a short tail), the waves between in groups of about three (fewer,
    larger collectives run nearer full bandwidth)."""
    if n_waves <= 2:
        return [1] * n_waves
    middle = n_waves - 2
    k = cdiv(middle, 3)
    base, extra = divmod(middle, k)
    return [1] + [base + 1] * extra + [base] * (k - extra) + [1]


def check_partition(partition, n_waves: int, op: str = "signal_reorder") -> tuple[int, ...]:
    """``partition`` as a tuple, or a clear error if it does not cover ``n_waves`` waves."""
    try:
        sizes = tuple(int(s) for s in partition)
    except (TypeError, ValueError):
        raise InterlaceTypeError(
            f"{op}: partition must be a list of group sizes in waves, got {partition!r}"
        ) from None
    if not sizes or min(sizes) < 1 or sum(sizes) != n_waves:
        raise InterlaceValueError(
            f"{op}: partition {list(sizes)} must be positive group sizes summing to the "
            f"{n_waves} waves of this shape"
        )
    if len(sizes) > MAX_GROUPS:
        raise InterlaceValueError(f"{op}: partition has {len(sizes)} groups, at most {MAX_GROUPS}")
    return sizes


def wave_groups(partition, n_tiles: int, programs: int) -> list[tuple[int, int]]:
    """``(first tile, tiles)`` of each group: group sizes in waves of ``programs`` tiles."""
    groups, wave = [], 0
    for size in partition:
        first = wave * programs
        wave += size
        groups.append((first, min(wave * programs, n_tiles) - first))
    return groups


def mapping_tables(layout: Layout, groups, group_m: int) -> tuple[list, list]:
    """The GEMM's ``tile_map`` (per visit index: slot, stride, group; see
    ``kernels.signal_gemm``) and the row kernel's ``slots`` (per row block of the result
    and column tile: the unit holding it after the collective)."""
    lay, w = layout, layout.world
    tile_map = [[0, 0, 0] for _ in range(lay.n_tiles)]
    slots = [[0] * lay.tiles_n for _ in range(lay.sources * lay.tiles_m)]
    for i, (first, count) in enumerate(groups):
        for g in range(first, first + count):
            pid_m, pid_n = tile_coords(g, lay.tiles_m, lay.tiles_n, group_m)
            if lay.parts == 1:
                slot, stride = g, 0
            else:  # the group is [W pools][count tiles] units from unit first * W
                slot, stride = first * w + (g - first), count
            tile_map[g] = [slot, stride, i]
            if lay.op == "all_to_all":  # pool j of every source lands where it was sent
                for j in range(w):
                    slots[j * lay.tiles_m + pid_m][pid_n] = slot + j * stride
            else:  # all-reduce in place; reduce-scatter keeps one unit per tile, in order
                slots[pid_m][pid_n] = g
    return tile_map, slots


# ----------------------------------------------------------------------------- row kernel
def launch_rows(src, out, weight=None, eps=1e-6, *, slots=None, layout: Layout | None = None):
    """``out = RMSNorm(x) * weight`` (or ``x`` when ``weight`` is None) row by row, where
    ``x`` is ``src`` read through ``slots`` (a reordered buffer of ``layout``) or, without a
    layout, ``src`` itself ([rows, N] row-major): the fused reorder-RMSNorm, the plain
    un-reorder and the plain RMSNorm in one kernel."""
    rows, n = out.shape
    if layout is not None:
        tile_n, sub_m, tiles_m = layout.block_n, layout.sub_m, layout.tiles_m
        rows_per_src = layout.rows_per_rank
    else:
        tile_n, sub_m, tiles_m, rows_per_src = min(256, next_pow2(n)), 1, 1, rows
    tiles_n = cdiv(n, tile_n)
    nt = min(next_pow2(tiles_n), max(1, MAX_ROW_BLOCK // tile_n))
    launch(
        reorder_rows_kernel, rows, src, slots if slots is not None else src, out,
        weight if weight is not None else out,
        n, rows_per_src, tiles_m, tiles_n, float(eps),
        SUB_M=sub_m, TILE_N=tile_n, NT=nt, REORDER=layout is not None,
        HAS_NORM=weight is not None, ONE_PASS=tiles_n <= nt,
        num_warps=8 if nt * tile_n >= 4096 else 4,
    )  # fmt: skip
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out=None):
    """Plain RMSNorm of the rows of ``x [rows, n]`` (the reference the fused one is
    measured against, and the sequential path's norm)."""
    if out is None:
        out = torch.empty_like(x)
    return launch_rows(x, out, weight, eps)


# ----------------------------------------------------------------------------- context
@dataclass(frozen=True)
class Plan:
    """Everything a call of one shape and partition launches with."""

    layout: Layout
    cfg: _gemm.GemmConfig
    partition: tuple[int, ...]
    groups: tuple[tuple[int, int], ...]
    tile_map: torch.Tensor | None
    slots: torch.Tensor | None
    lanes: int  # what one finished tile adds to its group's counter
    use_tma: bool
    tma_store: bool  # tiles stored by TMA, counted per warp (all-reduce layout)


class _Counters:
    """Names the group counters in timeout reports (stands in for a signal pad)."""

    def describe(self, slot: int) -> str:
        return f"wave-group counter {slot}"

    def close(self) -> None:
        pass


#: the fields of a call's fingerprint
CALL_FIELDS = ("M", "N", "K", "groups", "partition")


class SignalReorderGemm(OpContext):
    """GEMM + ``collective`` overlapped by wave-group signals; see the module docstring.

    ``comm_sms``: SMs the GEMM leaves free (cuda; default ``DEFAULT_COMM_SMS``);
    ``config``: a fixed ``GemmConfig`` (default: ``ops.segment_gemm.gemm_config`` per shape);
    ``eps``: RMSNorm epsilon; ``comm_group``: the torch process group the collectives run
    on (default: the group's own), e.g. an NCCL group built with ``config.max_ctas`` below
    ``comm_sms`` so that every NCCL CTA finds a free SM beside the GEMM. Every call is
    collective: all ranks call with the same shapes and partition; on the ``cpu`` backend a
    call that differs raises ``CallMismatchError`` on every rank, on a GPU it is not checked
    (see the module docstring)."""

    op_name = "signal_reorder"
    collective = "all_reduce"

    def __init__(
        self, group: Group, max_m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16,
        *, comm_sms: int | None = None, config: _gemm.GemmConfig | None = None,
        eps: float = 1e-6, max_spins: int | None = None, comm_group=None,
        eager_graphs: bool | None = None,
    ):  # fmt: skip
        # OpContext without its signal pad: this strategy needs no symmetric memory.
        if not isinstance(group, Group):
            raise InterlaceTypeError(
                f"{self.op_name}: group must be an interlace Group, got {type(group).__name__}"
            )
        _gemm.check_gemm_shape(self.op_name, max_m, n, k, dtype)
        w = group.world_size
        if self.collective != "all_reduce" and int(max_m) % w:
            raise InterlaceValueError(
                f"{self.op_name}: max_m = {max_m} must be a multiple of the world size {w}"
            )
        self.group, self.dtype = group, dtype
        self.world_size, self.rank = w, group.rank
        self.max_m, self.n, self.k = int(max_m), int(n), int(k)
        self.max_numel = self.max_m * self.n
        self.max_spins = int(max_spins) if max_spins is not None else default_max_spins(group)
        self.comm_sms = self._check_comm_sms(comm_sms)
        self.config, self.eps = config, float(eps)
        self.comm_group = comm_group if comm_group is not None else group.process_group
        if dist.get_world_size(self.comm_group) != w:
            raise InterlaceValueError(
                f"{self.op_name}: comm_group has {dist.get_world_size(self.comm_group)} ranks, "
                f"the group {w}"
            )
        self.error = ErrorWord(group)
        self._closed, self._buffers = False, []
        # Call checks where a barrier's outcome is known on the host at once (cpu backend):
        # a pad whose first region stands for the counters (so that a timed-out counter
        # wait, which records the counter's index, is named) and a barrier region.
        self._checks_calls = group.backend == "cpu"
        if self._checks_calls:
            self.pad = SignalPad(group, {"wave-group counter": MAX_GROUPS, "barrier": w})
            self.error.attach(self.pad, self.op_name)
            self._barriers: dict = {}
            self._init_calls()
            self.pad.call_names = CALL_FIELDS  # (named before this rank's first call)
        else:
            self.pad = _Counters()
        dev = group.device
        self.counters = torch.zeros(MAX_GROUPS, dtype=torch.int32, device=dev)
        # Capacity for any tile config (blocks of at most _PAD rows and columns).
        cap = (self.max_m + _PAD) * (self.n + _PAD)
        self.send = torch.empty(cap, dtype=dtype, device=dev)
        recv = {"all_reduce": 0, "reduce_scatter": (self.max_m // w + _PAD) * (self.n + _PAD)}
        self.recv = torch.empty(recv.get(self.collective, cap), dtype=dtype, device=dev)
        self.partitions: dict[tuple[int, int], tuple[int, ...]] = {}
        self.last_partition: tuple[int, ...] | None = None
        self._plans: dict = {}
        self._layouts: dict = {}
        self._init_eager_graphs(eager_graphs, collectives=True)

    def _check_comm_sms(self, comm_sms) -> int:
        if self.group.backend != "cuda":
            return 0
        sms = sm_count(self.group.device.index)
        value = DEFAULT_COMM_SMS if comm_sms is None else int(comm_sms)
        if not 2 <= value < sms:
            raise InterlaceValueError(
                f"{self.op_name}: comm_sms must be in 2..{sms - 1} (the wait kernels and the "
                f"collective need free SMs while the GEMM runs), got {comm_sms}"
            )
        return value

    # ------------------------------------------------------------------ life cycle
    def close(self) -> None:
        super().close()
        self.send = self.recv = self.counters = None
        self._plans = {}

    def _report(self, step):
        try:
            return step()
        except WaitTimeoutError:
            # A timed-out wait left its counter raised: clear them for the next call.
            if self.counters is not None:
                self.counters.zero_()
            raise

    def _begin(self) -> None:
        self._report(super()._begin)
        if self._fault_at_begin:
            # raised now, not at the fingerprint: a call may run the partition search's
            # collectives before it (and on a GPU fingerprints nothing)
            self._fault_at_begin = False
            self._report(self._fail)

    def _end(self) -> None:
        self._report(super()._end)

    def check(self) -> None:
        self._report(super().check)

    # ------------------------------------------------------------------ shapes and plans
    def _config(self, m: int, n: int) -> _gemm.GemmConfig:
        cfg = self.config or _gemm.gemm_config(m, n, self.k, self.group.backend)
        strips = strips_for(self.collective, self.world_size)
        if cfg.block_m % strips or cfg.block_m > _PAD or cfg.block_n > _PAD:
            raise InterlaceValueError(
                f"{self.op_name}: tile {cfg.block_m}x{cfg.block_n} does not suit this op: "
                f"block_m must be a multiple of {strips}, blocks at most {_PAD}"
            )
        return cfg

    def layout(self, m: int, n: int | None = None) -> Layout:
        """The tile grid a call with ``M = m`` rows (and ``n`` columns) runs on."""
        n = self.n if n is None else n
        if (m, n) not in self._layouts:
            self._layouts[(m, n)] = self._make_layout(m, n)
        return self._layouts[(m, n)]

    def _make_layout(self, m: int, n: int) -> Layout:
        cfg = self._config(m, n)
        tiles = make_layout(self.collective, m, n, self.world_size, cfg, 1).n_tiles
        if self.group.backend == "cuda":
            programs = max(1, min(tiles, sm_count(self.group.device.index) - self.comm_sms))
        else:
            programs = min(tiles, CPU_PROGRAMS)
        return make_layout(self.collective, m, n, self.world_size, cfg, programs)

    def waves(self, m: int, n: int | None = None) -> int:
        """Waves of the GEMM for ``M = m``: what a partition's group sizes add up to."""
        return self.layout(m, n).n_waves

    def set_partition(self, m: int, partition, n: int | None = None) -> None:
        """Use ``partition`` for calls with ``M = m`` (and ``n``) that pass none."""
        n = self.n if n is None else n
        self.partitions[(m, n)] = check_partition(partition, self.waves(m, n), self.op_name)
        self._plans.pop((m, n, None), None)  # the default plan of this shape changed

    def partition_for(self, m: int, n: int | None = None) -> tuple[int, ...]:
        """The partition a call with ``M = m`` takes when it passes none."""
        n = self.n if n is None else n
        return self.partitions.get((m, n)) or tuple(default_partition(self.waves(m, n)))

    def plan(self, m: int, n: int, partition=None) -> Plan:
        """The launch plan of a call (cached per shape and partition; a call that passes
        no partition finds its plan in one lookup, until ``set_partition`` changes it)."""
        if partition is None:
            found = self._plans.get((m, n, None))
            if found is None:
                found = self._plans[(m, n, None)] = self.plan(m, n, self.partition_for(m, n))
            return found
        lay = self.layout(m, n)
        sizes = check_partition(partition, lay.n_waves, self.op_name)
        key = (m, n, sizes)
        if key in self._plans:
            return self._plans[key]
        cfg = self._config(m, n)
        groups = tuple(wave_groups(sizes, lay.n_tiles, lay.programs))
        tile_map = slots = None
        if len(groups) > 1:
            dev = self.group.device
            tmap, slot_rows = mapping_tables(lay, groups, cfg.group_m)
            tile_map = torch.tensor(tmap, dtype=torch.int32).reshape(-1, MAP_COLS.value).to(dev)
            slots = torch.tensor(slot_rows, dtype=torch.int32).to(dev)
        use_tma = _gemm.tma_ok(self.k, n, self.dtype)
        tma_store = use_tma and lay.strips == 1  # see ``signal_gemm_kernel``
        plan = Plan(
            lay, cfg, sizes, groups, tile_map, slots,
            cfg.num_warps if tma_store else 32 * cfg.num_warps, use_tma, tma_store,
        )  # fmt: skip
        self._plans[key] = plan
        return plan

    # ------------------------------------------------------------------ the call
    def _check_call(self, a, b, bias, norm_weight) -> tuple[int, int]:
        self._begin()
        if not _gemm.operands_fit(self, a, b, bias, self.max_m):  # the common case: one
            _gemm.check_gemm_call(self, a, b, bias)  # expression; else the clear errors
        m, n = a.shape[0], b.shape[1]
        if not 1 <= m <= self.max_m:
            raise InterlaceValueError(
                f"{self.op_name}: a has {m} rows; this context takes 1 to {self.max_m}"
            )
        if self.collective != "all_reduce" and m % self.world_size:
            raise InterlaceValueError(
                f"{self.op_name}: a has {m} rows, not a multiple of the world size "
                f"{self.world_size} (each rank gets an equal share of the rows)"
            )
        if norm_weight is not None:
            self._check_tensor("norm_weight", norm_weight)
            if tuple(norm_weight.shape) != (n,):
                raise InterlaceValueError(
                    f"{self.op_name}: norm_weight has shape {tuple(norm_weight.shape)}, "
                    f"expected ({n},)"
                )
        return m, n

    def out_shape(self, m: int, n: int) -> tuple[int, int]:
        return (m // self.world_size if self.collective == "reduce_scatter" else m, n)

    def __call__(self, a, b, bias=None, out=None, *, norm_weight=None, partition=None):
        """The op (see the module docstring); returns ``out`` or a new tensor."""
        m, n = self._check_call(a, b, bias, norm_weight)
        shape = self.out_shape(m, n)
        out = self._check_out(out, shape)
        if out is None:
            out = torch.empty(shape, dtype=self.dtype, device=self.group.device)
        plan = self.plan(m, n, partition)
        if self._checks_calls:
            self._check_peers(m, n, plan.partition)
        if len(plan.groups) == 1:
            self._sequential(a, b, bias, out, norm_weight)
        else:
            # the operands the launches read or write (the bias: only where it is added)
            used_bias = bias if self._adds_bias(plan.layout, bias) else None
            self._enqueue(
                ("signal_reorder", plan.partition),
                lambda: self._overlapped(plan, a, b, bias, out, norm_weight),
                a, b, used_bias, out, norm_weight,
            )  # fmt: skip
        self.last_partition = plan.partition
        self._end()
        return out

    def _check_peers(self, m: int, n: int, partition: tuple[int, ...]) -> None:
        """Fingerprint the call and run a device barrier that carries it (cpu backend: it
        has run when this returns), so that ranks that called with other shapes or
        partitions raise ``CallMismatchError`` on every rank before any collective."""
        fields = (m, n, self.k, len(partition), str(partition))
        self._begin_call(**dict(zip(CALL_FIELDS, fields, strict=True)))
        self._barrier()
        self._raise_pending()

    def _overlapped(self, plan: Plan, a, b, bias, out, norm_weight) -> None:
        # Fork before the GEMM: the comm stream waits for the inputs, not for the GEMM.
        stream = fork(self.group)
        self.launch_gemm(plan, a, b, bias)
        with use_stream(stream):
            for i, (first, count) in enumerate(plan.groups):
                self.enqueue_group(plan.layout, i, count * plan.lanes, first, count)
        join(self.group, stream)
        src = self.send if plan.layout.op == "all_reduce" else self.recv
        launch_rows(src, out, norm_weight, self.eps, slots=plan.slots, layout=plan.layout)

    def enqueue_group(self, lay: Layout, counter: int, expected: int, first: int, count: int):
        """On the current stream: wait until ``counters[counter] == expected`` and reset it
        (one program, bounded), then the collective on tiles ``[first, first + count)``.
        Where a recorder is in force, each is a span of the stream (``chunk_wait``, then
        the collective as a ``copy``)."""
        span = _trace.begin() if _trace.ACTIVE else None
        launch(
            wait_kernel, 1, self.counters, counter, 1, expected, self.error.address, self.rank,
            self.max_spins, RESET=True,
        )  # fmt: skip
        if span is not None:
            _trace.end(span, "chunk_wait", name=f"wait group {counter}", group=counter,
                       counter_slot=counter, tiles=count)  # fmt: skip
            span = _trace.begin()
        self._collective(lay, first, count)
        if span is not None:
            _trace.end(
                span, "copy", name=f"{lay.op} group {counter}", group=counter, tiles=count,
                collective=lay.op, peer=-1, bytes=lay.group_bytes(count, self.dtype.itemsize),
            )  # fmt: skip

    def _adds_bias(self, lay: Layout, bias) -> bool:
        """Bias once in a sum: rank 0 adds it before the reduction; all-to-all adds it on
        every rank (each sends its own rows)."""
        return bias is not None and (self.rank == 0 or lay.op == "all_to_all")

    def launch_gemm(self, plan: Plan, a, b, bias=None, signal: bool = True) -> None:
        """The signalling GEMM alone, on the current stream (it raises the counters; only
        the wait kernels reset them). ``signal=False``: no counters (probes only). Traced
        (``TRACE`` on) where a recorder is in force (``interlace.trace.record``)."""
        lay, cfg = plan.layout, plan.cfg
        if plan.use_tma and a.is_cuda:
            install_scratch_allocator()
        has_bias = self._adds_bias(lay, bias)
        traced = {}
        if _trace.ACTIVE:  # program p: tiles p, p + programs, ... (one per wave)
            info = dict(
                kernel=_trace.SIGNAL_GEMM, layout="tiles", slots="signal_gemm",
                grid=lay.programs, rank=self.rank, world=lay.world, n_tiles=lay.n_tiles,
                collective=lay.op, M=lay.m, N=lay.n, K=self.k, block_m=cfg.block_m,
                block_n=cfg.block_n, group_m=cfg.group_m, tiles_m=lay.tiles_m,
                tiles_n=lay.tiles_n, groups=[list(g) for g in plan.groups], signal=signal,
            )  # fmt: skip
            tbuf = _trace.buffer(lay.programs, lay.n_waves, info)
            if tbuf is not None:
                traced = dict(TRACE=True, tbuf=tbuf)
        launch(
            signal_gemm_kernel, lay.programs, a, b, self.send,
            bias if has_bias else self.send, lay.m, lay.n, self.k,
            lay.rows_per_rank, lay.world, plan.tile_map, lay.n_tiles, self.counters,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m, STRIPS=lay.strips, USE_TMA=plan.use_tma, HAS_BIAS=has_bias,
            LANES=plan.lanes, SIGNAL=signal, TMA_STORE=plan.tma_store, SUBTILE=cfg.subtile,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **traced,
        )  # fmt: skip

    def _collective(self, lay: Layout, first: int, count: int) -> None:
        """The stock collective on the contiguous slice of one group."""
        pg = self.comm_group
        lo, hi = first * lay.parts * lay.unit, (first + count) * lay.parts * lay.unit
        if lay.op == "all_reduce":
            dist.all_reduce(self.send[lo:hi], group=pg)
        elif lay.op == "reduce_scatter":
            recv = self.recv[first * lay.unit : (first + count) * lay.unit]
            _reduce_scatter(recv, self.send[lo:hi], group=pg)
        else:
            dist.all_to_all_single(self.recv[lo:hi], self.send[lo:hi], group=pg)

    def comm_only(self, nbytes: int) -> None:
        """The collective alone on ``nbytes`` per rank of the context's buffers (for the
        tuner's bandwidth curve)."""
        w, item = self.world_size, self.dtype.itemsize
        numel = max(w, min(nbytes // item, self.send.numel()) // w * w)
        pg = self.comm_group
        if self.collective == "all_reduce":
            dist.all_reduce(self.send[:numel], group=pg)
        elif self.collective == "reduce_scatter":
            _reduce_scatter(self.recv[: numel // w], self.send[:numel], group=pg)
        else:
            dist.all_to_all_single(self.recv[:numel], self.send[:numel], group=pg)

    def _sequential(self, a, b, bias, out, norm_weight) -> None:
        """cuBLAS, then the whole collective (a single group: nothing to overlap), on the
        caller's process group: ``comm_group`` caps NCCL's CTAs to leave SMs to the GEMM,
        which a collective that runs alone does not need."""
        pg = self.group.process_group
        res = out if norm_weight is None else torch.empty_like(out)
        if self.collective == "all_to_all":
            c = torch.addmm(bias, a, b) if bias is not None else torch.matmul(a, b)
            dist.all_to_all_single(res, c, group=pg)
        else:
            if self.collective == "all_reduce":
                torch.matmul(a, b, out=res)
                dist.all_reduce(res, group=pg)
            else:
                _reduce_scatter(res, torch.matmul(a, b), group=pg)
            if bias is not None:
                res += bias
        if norm_weight is not None:
            launch_rows(res, out, norm_weight, self.eps)


class SignalReorderGemmAR(SignalReorderGemm):
    """``all_reduce(a @ b) + bias`` (optionally RMSNorm'ed): ``[M, n]`` on every rank."""

    op_name = "gemm_ar"
    collective = "all_reduce"


class SignalReorderGemmRS(SignalReorderGemm):
    """``reduce_scatter(a @ b) + bias`` along rows: ``[M / W, n]``, rank ``r`` holding
    rows ``[r*M/W, (r+1)*M/W)`` of the sum."""

    op_name = "gemm_rs"
    collective = "reduce_scatter"


class SignalReorderGemmA2A(SignalReorderGemm):
    """``all_to_all_single(a @ b + bias)`` with equal row splits: ``[M, n]``, rows
    ``[j*M/W, (j+1)*M/W)`` from rank ``j``."""

    op_name = "gemm_a2a"
    collective = "all_to_all"


__all__ = [
    "OPS",
    "Layout",
    "Plan",
    "SignalReorderGemm",
    "SignalReorderGemmA2A",
    "SignalReorderGemmAR",
    "SignalReorderGemmRS",
    "check_partition",
    "default_partition",
    "launch_rows",
    "mapping_tables",
    "rms_norm",
    "tile_coords",
    "wave_groups",
]
