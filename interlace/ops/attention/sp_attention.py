"""Sequence-parallel attention with the K/V all-gather hidden behind the attention kernel,
forward and backward.

Each rank holds ``S_loc`` tokens of the sequence: ``q [batch, heads, S_loc, d]``,
``k, v [batch, kv_heads, S_loc, d]`` (grouped-query attention when ``kv_heads < heads``).
Token layout (``layout.zigzag_shard`` / ``zigzag_unshard`` convert a whole sequence):

* non-causal: rank ``r`` holds positions ``[r * S_loc, (r + 1) * S_loc)``;
* causal: the zigzag layout: the sequence cut into ``2W`` chunks of ``S_loc / 2``, rank
  ``r`` holds chunks ``r`` and ``2W - 1 - r``, so every rank does the same causal work.

``cu_seqlens`` (int32, global boundaries ``0 = cu[0] < ... < cu[-1] = W * S_loc``, the same
on every rank) packs several documents in the sequence: a token attends only within its
document. It applies to every batch row alike.

::

    attn = interlace.ops.attention.SPAttention(group, heads=32, kv_heads=8, head_dim=128,
                                               max_tokens=8192)
    o = attn(q, k, v, causal=True)      # differentiable (autograd Function)
    o.backward(grad)                    # dq, dk, dv of this rank's tokens
    attn.close()

Strategies:

* ``fused`` (default): the copy engine pushes this rank's K and V into every peer's
  gathered buffer, peer by peer in rank-rotated order, raising the peer's arrival flag
  from the stream; the flash-attention kernel (``kernels.attention``) starts on the local
  chunk and takes each peer's chunk once its flag is up (on Hopper, where ``S_loc`` is a
  multiple of 128 and no trace is recorded, the forward is ``kernels.attention_hopper``'s
  warp-specialised Gluon kernel: ``hopper_forward``). Backward gathers K/V again the
  same way; its dK/dV kernel stores each chunk's partial gradient straight into the
  owner's receive buffer (NVLink stores) and counts it there; the dQ kernel runs beside
  it on a second stream (each fills the other's last wave, and the one that ends last
  hides the last transfers), and a reduction kernel sums the partials of this rank's
  chunk once they have all landed.
* ``none``: NCCL all-gather of K and V, then torch SDPA (differentiable: its backward
  reduces dK / dV over ranks).
* ``ring``: ring attention with torch ops: K/V passed to the next rank step by step
  (send/recv), SDPA partials merged by log-sum-exp (``ring.py``); differentiable (its
  backward passes K/V round the ring again and each chunk's dK/dV on to its owner).

Eager calls alternate between two buffer sets (``AlternatingSets``), so consecutive calls
need no device barrier; a call captured in a CUDA graph uses a third set behind one.
With ``eager_graphs`` (the default where the driver allows) the device work of an eager
``fused`` call, forward or backward, is replayed from a CUDA graph from the third call
of each kind on (``OpContext._enqueue``): one launch from the host instead of every
kernel, copy and signal write.
Every call is collective: all ranks call with the same shapes, which each call checks
(one small host all-reduce, ``validate=True``) before it launches anything.

Host order of a call: the copies to the peers are enqueued before any kernel that waits
for the peers' copies. The first launch of a kernel blocks the host while a kernel spins
on the device (benchmarks/NOTES.md, "A launch-order deadlock"): with the waiting kernels
first, the backward's later kernels (dQ, the reduction) blocked each rank's host before
its copies were enqueued, and every rank's dK/dV kernel waited for the others' copies
until its spin bound ran out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...errors import InterlaceTypeError, InterlaceValueError
from ...kernels import attention as K
from ...runtime import fork, join, symm_empty
from .. import _trace
from .._context import BUFFER_SETS, GRAPH_SET, AlternatingSets, OpContext, cdiv
from .._launch import host_descriptor, install_scratch_allocator
from .._trace import copy_and_signal  # recorded as a copy where a recorder is in force
from .layout import segment_ids
from .ring import _ring_backward, _ring_forward, gather_attention, ring_attention

try:  # the Hopper forward is written in Gluon (``triton.experimental.gluon``, Triton >= 3.5)
    from ...kernels import attention_hopper as KH
except ImportError:  # an older Triton: the Triton forward everywhere (``hopper_forward``)
    KH = None

HEAD_DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)
STRATEGIES = ("fused", "none", "ring")


@dataclass(frozen=True)
class AttnConfig:
    """Tile shape and launch parameters of one attention kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    #: forward only: the unmasked key loop warp-specialised (producer warps issue the
    #: K / V tensor-descriptor loads)
    warp_specialize: bool = False
    #: the unmasked blocks' exponential (``kernels.attention._exp2``): 0 float32, 1 packed
    #: float16 pairs, 2 packed bfloat16 pairs
    fast_exp: int = 0
    #: a register cap per thread (the launch's ``maxnreg``), so that two programs fit in
    #: one SM (the hardware then runs one's softmax beside the other's products)
    maxnreg: int | None = None


#: Kernel configs on a GPU per (kernel, head_dim): (query block, key block, warps,
#: stages, ...). Chosen by ``python -m interlace bench attention --tune`` (bf16, d 128, S
#: 16k as rank 0 of 4; records ``sp_attention_cfg`` of
#: benchmarks/results/2026-11-29-h200-w1.json, one H200). Forward: 64 x 64 blocks, 4
#: warps, 3 stages (2.22 ms non-causal, 1.17 causal, against 2.34 for 128 x 128 with 8
#: warps): two programs share an SM, so one's softmax runs beside the other's products
#: (128 x 64 with 8 warps capped at 128 registers, also two per SM: within 1-2 %).
#: dK / dV: 64 keys against 64 queries, 4 warps, 2 stages, likewise two programs per SM
#: (4.16 ms non-causal, 2.03 causal, against 4.27 / 2.35 with packed float16 exponentials
#: and 4.51 / 2.42 for 128 keys against 64 queries with 8 warps). dQ: 128 x 64 with 3
#: stages (2.59 / 1.34 ms; 64 x 64 with two programs per SM 14 % slower; packed float16
#: exponentials 2.46 / 1.32 ms, dQ's error 2.9e-3 against 2.4e-3, not taken). The d 64
#: configs are the same, not tuned apart.
GPU_CONFIGS = {
    ("fwd", 64): AttnConfig(64, 64, 4, 3),
    ("fwd", 128): AttnConfig(64, 64, 4, 3),
    ("dq", 64): AttnConfig(128, 64, 8, 3),
    ("dq", 128): AttnConfig(128, 64, 8, 3),
    ("dkdv", 64): AttnConfig(64, 64, 4, 2),
    ("dkdv", 128): AttnConfig(64, 64, 4, 2),
}
#: Overrides of ``GPU_CONFIGS`` where a query block sees more than ``LONG_KEYS`` keys
#: (``W x S_loc``): the forward's 128 x 128 blocks with 8 warps and 3 stages, faster there
#: than 64 x 64 (S 32k as rank 0 of 4: 8.75 against 9.27 ms non-causal, 4.45 against 4.75
#: causal; records ``sp_attention_cfg`` at S 32768 of the same file).
LONG_KEYS = 16384
GPU_CONFIGS_LONG = {
    ("fwd", 64): AttnConfig(128, 128, 8, 3),
    ("fwd", 128): AttnConfig(128, 128, 8, 3),
}
#: The interpreter (CPU emulation): small tiles, so that tiny test shapes have ragged
#: blocks and several blocks per chunk.
CPU_CONFIG = AttnConfig(16, 16, 4, 1)
DELTA_BLOCK = 64
REDUCE_BLOCK = 32


def config_of(kind: str, d: int, backend: str, keys: int = 0) -> AttnConfig:
    """The config of ``kind``'s kernel for head dim ``d``, causal or not (the same configs
    won both); ``keys``: the keys a query block may see (``W x S_loc``)."""
    if backend != "cuda":
        return CPU_CONFIG
    if keys > LONG_KEYS and (kind, d) in GPU_CONFIGS_LONG:
        return GPU_CONFIGS_LONG[(kind, d)]
    return GPU_CONFIGS[(kind, d)]


# ------------------------------------------------------------------------------ launches
@dataclass
class KernelArgs:
    """What every attention launch of one call shares."""

    rank: int
    world: int
    heads: int
    kv_heads: int
    d: int
    s_loc: int
    causal: bool
    varlen: bool
    sm_scale: float
    seg: torch.Tensor  # int32 document ids of positions (a dummy unless varlen)
    cu: torch.Tensor  # int32 cu_seqlens (a dummy unless varlen)
    sig: torch.Tensor  # this rank's signal pad (int32)
    err: int  # error word address
    max_spins: int
    backend: str

    @property
    def half(self) -> int:
        return self.s_loc // 2


def _common(a: KernelArgs, cfg: AttnConfig) -> dict:
    return dict(
        H=a.heads, HKV=a.kv_heads, D=a.d, WORLD=a.world, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, CAUSAL=a.causal, VARLEN=a.varlen, FAST_EXP=cfg.fast_exp,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )  # fmt: skip


def _traced(a: KernelArgs, kernel: str, grid_m: int, columns: int, steps: int,
            **info) -> dict:  # fmt: skip
    """``TRACE`` and a trace buffer for a launch of ``kernel`` on a ``(grid_m, columns)``
    grid of ``steps`` steps per program where a recorder is in force
    (``interlace.trace.record``); else nothing (an untraced launch)."""
    if not _trace.ACTIVE:
        return {}
    info = dict(
        info, kernel=kernel, layout="steps", grid=grid_m * columns, grid_m=grid_m,
        rank=a.rank, world=a.world, S_loc=a.s_loc, d=a.d, causal=a.causal,
    )  # fmt: skip
    tbuf = _trace.buffer(grid_m, steps, info, columns=columns)
    return {} if tbuf is None else dict(TRACE=True, tbuf=tbuf)


#: The Hopper forward (``kernels.attention_hopper``): key blocks, ring stages, the consumer
#: warpgroups' register count. On one H200, S 16k as rank 0 of 4 (benchmarks/results/
#: history/2026-11-29-h200-w1-gluon-attention.txt): 128-key blocks with 3 stages 1.683 ms,
#: with 2 stages 1.745, 64-key blocks with 4 stages 2.021. d 64: 4 stages (the ring a
#: shared memory of the same size holds; not timed apart).
HOPPER_BLOCK_N = 128
HOPPER_STAGES = {64: 4, 128: 3}
HOPPER_CONSUMER_REGS = 240
#: the loader warp's registers: more leave the consumers fewer and they spill (ptxas)
HOPPER_LOADER_REGS = 24


def hopper_forward(a: KernelArgs, q: torch.Tensor) -> bool:
    """Whether the forward runs the Hopper kernel: Gluon in the installed Triton, a Hopper
    GPU (compute capability 9), ``S_loc`` a multiple of its 128-row tiles, no trace
    recorder in force (traces record the Triton kernel's tiles) and
    ``SPAttention.HOPPER_FORWARD`` on."""
    return (
        SPAttention.HOPPER_FORWARD
        and KH is not None
        and a.backend == "cuda"
        and a.s_loc % KH.BLOCK_M.value == 0
        and _trace.hopper_untraced(q.device)
    )


def _descriptor(x: torch.Tensor, rows: int, d: int):
    """A host TMA descriptor over ``x`` (contiguous) as ``[-1, d]`` in blocks of ``rows``."""
    return host_descriptor(x.view(-1, d), [rows, d])


def _launch_fwd_hopper(a: KernelArgs, q, k, v, k_all, v_all, o, lse, arrival: int,
                       wait: bool, clear: bool) -> None:  # fmt: skip
    bn = HOPPER_BLOCK_N
    KH.sp_attn_fwd_hopper_kernel[(a.s_loc // KH.BLOCK_M.value, q.shape[0] * q.shape[1])](
        _descriptor(q, KH.WG_M.value, a.d), _descriptor(k, bn, a.d), _descriptor(v, bn, a.d),
        _descriptor(k_all, bn, a.d), _descriptor(v_all, bn, a.d),
        _descriptor(o, KH.WG_M.value, a.d), lse, a.seg,
        a.cu, a.sig, a.err, a.rank, a.max_spins, arrival, a.sm_scale * K.LOG2E, a.s_loc,
        a.half, a.heads, a.kv_heads, WORLD=a.world, CAUSAL=a.causal, VARLEN=a.varlen,
        WAIT=wait, CLEAR=clear, STAGES=HOPPER_STAGES[a.d],
        CONSUMER_REGS=HOPPER_CONSUMER_REGS, LOADER_REGS=HOPPER_LOADER_REGS, num_warps=4,
    )  # fmt: skip


def launch_fwd(a: KernelArgs, q, k, v, k_all, v_all, o, lse, arrival: int, wait: bool,
               clear: bool, cfg: AttnConfig | None = None) -> None:  # fmt: skip
    """The forward kernel: ``o`` and base-2 ``lse`` of this rank's queries against the local
    K/V and the peers' chunks in ``k_all`` / ``v_all`` ``[W * batch * kv_heads, S_loc, d]``;
    the Hopper kernel where ``hopper_forward`` holds and no ``cfg`` is given, else the
    Triton kernel, traced (``TRACE`` on) where a recorder is in force
    (``interlace.trace.record``)."""
    if cfg is None and hopper_forward(a, q):
        _launch_fwd_hopper(a, q, k, v, k_all, v_all, o, lse, arrival, wait, clear)
        return
    cfg = cfg or config_of("fwd", a.d, a.backend, a.world * a.s_loc)
    bh = q.shape[0] * q.shape[1]
    grid = (cdiv(a.s_loc, cfg.block_m), bh)
    traced = _traced(  # one step per K/V chunk
        a, _trace.ATTENTION_FWD, grid[0], bh, a.world, batch_heads=bh, block_m=cfg.block_m,
        block_n=cfg.block_n,
    )  # fmt: skip
    K.sp_attn_fwd_kernel[grid](
        q, k, v, k_all, v_all, o, lse, a.seg, a.cu, a.sig, a.err, a.rank, a.max_spins,
        arrival, a.sm_scale * K.LOG2E, a.s_loc, a.half, WAIT=wait, CLEAR=clear,
        WS=cfg.warp_specialize and a.backend == "cuda", **_common(a, cfg), **traced,
    )  # fmt: skip


def launch_delta(a: KernelArgs, o, do, delta) -> None:
    bh = o.shape[0] * o.shape[1]
    block = DELTA_BLOCK if a.backend == "cuda" else 16
    K.sp_attn_bwd_delta_kernel[(cdiv(a.s_loc, block), bh)](
        o, do, delta, a.s_loc, D=a.d, BLOCK=block
    )


def launch_dkdv(a: KernelArgs, q, k, v, k_all, v_all, do, lse, delta, recv, recv_table,
                sig_table, arrival: int, dkv_slot: int, wait: bool,
                cfg: AttnConfig | None = None) -> None:  # fmt: skip
    """The dK/dV kernel: partials of every chunk into its owner's ``recv`` slot ``rank``;
    traced where a recorder is in force (two steps per program: its key block, then the
    push to the chunk's owner)."""
    cfg = cfg or config_of("dkdv", a.d, a.backend, a.world * a.s_loc)
    bkv = k.shape[0] * k.shape[1]
    n_kb = cdiv(a.s_loc, cfg.block_n)
    traced = _traced(
        a, _trace.ATTENTION_DKDV, n_kb * a.world, bkv, 2, slots="dkdv",
        n_tiles=2 * n_kb * a.world * bkv, key_blocks=n_kb, block_n=cfg.block_n,
        itemsize=recv.element_size(),
    )  # fmt: skip
    K.sp_attn_bwd_dkdv_kernel[(n_kb * a.world, bkv)](
        q, k, v, k_all, v_all, do, lse, delta, recv, recv_table, a.seg, a.cu, a.sig,
        sig_table, a.err, a.rank, a.max_spins, arrival, dkv_slot, a.sm_scale,
        a.sm_scale * K.LOG2E, a.s_loc, a.half, n_kb, WAIT=wait, **_common(a, cfg), **traced,
    )  # fmt: skip


def launch_dq(a: KernelArgs, q, k, v, k_all, v_all, do, lse, delta, dq, arrival: int,
              wait: bool, clear: bool, cfg: AttnConfig | None = None) -> None:  # fmt: skip
    """The dQ kernel; traced as the forward where a recorder is in force (one step per
    K/V chunk)."""
    cfg = cfg or config_of("dq", a.d, a.backend, a.world * a.s_loc)
    bh = q.shape[0] * q.shape[1]
    grid_m = cdiv(a.s_loc, cfg.block_m)
    traced = _traced(
        a, _trace.ATTENTION_DQ, grid_m, bh, a.world, batch_heads=bh, block_m=cfg.block_m,
        block_n=cfg.block_n,
    )  # fmt: skip
    K.sp_attn_bwd_dq_kernel[(grid_m, bh)](
        q, k, v, k_all, v_all, do, lse, delta, dq, a.seg, a.cu, a.sig, a.err, a.rank,
        a.max_spins, arrival, a.sm_scale, a.sm_scale * K.LOG2E, a.s_loc, a.half, WAIT=wait,
        CLEAR=clear, **_common(a, cfg), **traced,
    )  # fmt: skip


def launch_reduce(a: KernelArgs, recv, dk, dv, dkv_slot: int, n_rows: int) -> None:
    """The owner's sum of every source's dK/dV partials; traced where a recorder is in
    force (one step per source)."""
    block = REDUCE_BLOCK if a.backend == "cuda" else 16
    grid = cdiv(n_rows, block)
    traced = _traced(
        a, _trace.ATTENTION_REDUCE, grid, 1, a.world, slots="attn_reduce",
        n_tiles=grid * a.world, rows=n_rows, block_r=block,
    )  # fmt: skip
    K.sp_attn_bwd_reduce_kernel[(grid,)](
        recv, dk, dv, a.sig, a.err, a.rank, a.max_spins, dkv_slot, n_rows, n_rows,
        D=a.d, WORLD=a.world, BLOCK=block, num_warps=4, **traced,
    )  # fmt: skip


_side_streams: dict = {}


def side_stream(device: torch.device):
    """The stream the backward's dQ kernel runs on beside the dK / dV kernel (one per
    device, normal priority; None on the cpu backend, where kernels run one by one)."""
    if device.type != "cuda":
        return None
    if device.index not in _side_streams:
        _side_streams[device.index] = torch.cuda.Stream(device)
    return _side_streams[device.index]


@dataclass(frozen=True)
class BackwardBuffers:
    """What the backward's kernels read and write besides the call's tensors: the gathered
    K / V views, this rank's dK / dV receive buffer with every rank's (``recv_table``)
    and every rank's signal pad (``sig_table``), the arrival flags' first slot and the
    dK / dV counters' first slot."""

    k_all: torch.Tensor
    v_all: torch.Tensor
    recv: torch.Tensor
    recv_table: torch.Tensor
    sig_table: torch.Tensor
    arrival: int
    dkv_slot: int


def launch_backward(a: KernelArgs, q, k, v, o, do, lse, delta, dq, dk, dv,
                    bufs: BackwardBuffers, wait: bool, clear: bool, side=None,
                    cfg_dkdv: AttnConfig | None = None,
                    cfg_dq: AttnConfig | None = None) -> None:  # fmt: skip
    """The backward's kernels on the current stream: delta; then dK / dV and dQ, the dQ
    kernel on the CUDA stream ``side`` beside the dK / dV kernel where given (each fills
    the other's last wave; joined before the reduction), else after it; ``clear``: the
    arrival flags zeroed once both are done; the reduction of this rank's dK / dV."""
    launch_delta(a, o, do, delta)
    if side is not None:  # the side stream starts after delta, not after dK / dV
        main = torch.cuda.current_stream(q.device)
        side.wait_stream(main)
    launch_dkdv(
        a, q, k, v, bufs.k_all, bufs.v_all, do, lse, delta, bufs.recv, bufs.recv_table,
        bufs.sig_table, bufs.arrival, bufs.dkv_slot, wait=wait, cfg=cfg_dkdv,
    )  # fmt: skip
    dq_args = (a, q, k, v, bufs.k_all, bufs.v_all, do, lse, delta, dq, bufs.arrival)
    if side is None:
        launch_dq(*dq_args, wait=wait, clear=clear, cfg=cfg_dq)
    else:
        with torch.cuda.stream(side):
            launch_dq(*dq_args, wait=wait, clear=False, cfg=cfg_dq)
        main.wait_stream(side)
        if clear:
            K.sp_attn_clear_kernel[(1,)](
                a.sig, bufs.arrival, a.err, a.rank, a.max_spins, WORLD=a.world, num_warps=1
            )
    launch_reduce(a, bufs.recv, dk, dv, bufs.dkv_slot, k.shape[0] * k.shape[1] * a.s_loc)


# ------------------------------------------------------------------------------ context
@dataclass(frozen=True)
class CallShape:
    """What every rank must agree on for one call."""

    batch: int
    s_loc: int
    causal: bool
    docs: int  # documents in cu_seqlens (0: none)


class SPAttention(AlternatingSets, OpContext):
    """Sequence-parallel attention over ``group``; see the module docstring.

    ``max_tokens``: the most ``batch * S_loc`` a call takes on one rank (sizes the
    gathered K/V and the backward's receive buffers). ``validate``: every call exchanges
    its shape with the other ranks (one small host all-reduce) so that a rank called with
    other shapes raises on every rank; False skips it. ``eager_graphs``: replay eager
    ``fused`` calls from CUDA graphs (``OpContext._enqueue``; None: where the driver
    allows)."""

    op_name = "sp_attention"
    STRATEGIES = STRATEGIES
    #: the backward's dQ kernel beside its dK / dV kernel, on a second stream
    #: (``launch_backward``; ``bench attention`` times it both ways: ``t_serial_ms``)
    SIDE_DQ = True
    #: the forward on the Hopper kernel where it applies (``hopper_forward``); off, the
    #: Triton kernel everywhere (``bench attention`` times both)
    HOPPER_FORWARD = True

    def __init__(
        self, group, heads: int, kv_heads: int, head_dim: int, max_tokens: int,
        dtype: torch.dtype = torch.bfloat16, strategy: str = "fused", max_spins=None,
        validate: bool = True, eager_graphs: bool | None = None,
    ):  # fmt: skip
        name = self.op_name
        if strategy not in STRATEGIES:
            raise InterlaceValueError(
                f"{name}: strategy must be one of {STRATEGIES}, got {strategy!r}"
            )
        if dtype not in DTYPES:
            raise InterlaceTypeError(f"{name}: dtype must be one of {DTYPES}, got {dtype}")
        heads, kv_heads, head_dim = int(heads), int(kv_heads), int(head_dim)
        if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
            raise InterlaceValueError(
                f"{name}: heads = {heads} must be a positive multiple of kv_heads = {kv_heads}"
            )
        if head_dim not in HEAD_DIMS:
            raise InterlaceValueError(
                f"{name}: head_dim must be one of {HEAD_DIMS}, got {head_dim}"
            )
        if int(max_tokens) <= 0:
            raise InterlaceValueError(f"{name}: max_tokens must be positive, got {max_tokens}")
        w = group.world_size
        regions = {"arrival": BUFFER_SETS * (w + 1), "dkv": BUFFER_SETS * (w + 1)}
        kv_numel = int(max_tokens) * kv_heads * head_dim
        super().__init__(group, dtype, kv_numel, regions, max_spins)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.max_tokens, self.strategy = int(max_tokens), strategy
        self.validate = bool(validate)
        self._init_eager_graphs(eager_graphs)
        self._dummy = torch.zeros(2, dtype=torch.int32, device=group.device)
        self._seg_cache: dict = {}
        if strategy == "fused":
            # per buffer set: [K | V] x [W sources] x (batch * kv_heads * S_loc * d), packed
            self.gathered = self._track(symm_empty((BUFFER_SETS, 2 * w * kv_numel), dtype, group))
            self.recv = self._track(symm_empty((BUFFER_SETS, 2 * w * kv_numel), dtype, group))

    # ------------------------------------------------------------------ checks
    def _check_inputs(self, q, k, v, causal, cu_seqlens) -> CallShape:
        self._begin()
        name = self.op_name
        for label, t in (("q", q), ("k", k), ("v", v)):
            self._check_placed(label, t)
            if t.dim() != 4:
                raise InterlaceValueError(
                    f"{name}: {label} must be [batch, heads, S_loc, d], got shape {tuple(t.shape)}"
                )
            if not t.is_contiguous():
                raise InterlaceValueError(f"{name}: {label} must be contiguous")
        b, h, s_loc, d = q.shape
        if h != self.heads or d != self.head_dim:
            raise InterlaceValueError(
                f"{name}: q has {h} heads of dim {d}, the context was built for "
                f"{self.heads} heads of dim {self.head_dim}"
            )
        want = (b, self.kv_heads, s_loc, d)
        for label, t in (("k", k), ("v", v)):
            if tuple(t.shape) != want:
                raise InterlaceValueError(
                    f"{name}: {label} has shape {tuple(t.shape)}, expected {want} "
                    f"([batch, kv_heads, S_loc, d] matching q)"
                )
        if b * s_loc == 0 or b * s_loc > self.max_tokens:
            raise InterlaceValueError(
                f"{name}: batch * S_loc = {b * s_loc}; this context takes 1 to {self.max_tokens}"
            )
        if causal and s_loc % 2:
            raise InterlaceValueError(
                f"{name}: causal attention uses the zigzag layout (two chunks per rank): "
                f"S_loc = {s_loc} must be even"
            )
        docs = 0
        if cu_seqlens is not None:
            docs = self._check_cu(cu_seqlens, s_loc)
        shape = CallShape(b, s_loc, bool(causal), docs)
        self._check_agree(shape)
        return shape

    def _check_cu(self, cu, s_loc) -> int:
        name = self.op_name
        if not isinstance(cu, torch.Tensor) or cu.dtype not in (torch.int32, torch.int64):
            raise InterlaceTypeError(f"{name}: cu_seqlens must be an int32 or int64 tensor")
        if cu.dim() != 1 or cu.numel() < 2:
            raise InterlaceValueError(f"{name}: cu_seqlens must be 1-D with at least 2 entries")
        vals = cu.tolist()
        total = self.world_size * s_loc
        if vals[0] != 0 or vals[-1] != total or any(x >= y for x, y in zip(vals, vals[1:])):
            raise InterlaceValueError(
                f"{name}: cu_seqlens must rise strictly from 0 to W * S_loc = {total}, got {vals}"
            )
        return len(vals) - 1

    def _check_agree(self, shape: CallShape) -> None:
        """Every rank calls with the same shape: a host all-reduce of (min, max) per field,
        so every rank raises alike. Skipped inside a CUDA-graph capture and without
        ``validate``."""
        if self._capturing() or self.world_size == 1 or not self.validate:
            return
        vals = [shape.batch, shape.s_loc, int(shape.causal), shape.docs]
        dev = self.group.device if self.group.nccl else "cpu"
        t = torch.tensor(vals + [-x for x in vals], dtype=torch.int64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group.process_group)
        hi, lo = t[: len(vals)].tolist(), [-x for x in t[len(vals) :].tolist()]
        if hi != lo:
            raise InterlaceValueError(
                f"{self.op_name}: ranks called with different shapes (batch, S_loc, causal, "
                f"documents) from {lo} to {hi}; this rank: {vals}"
            )

    def _fingerprint(self, shape: CallShape) -> None:
        """``_begin_call`` of a forward or backward: the shape every rank shares (the same
        fields for both, so that alternating steps rewrite only the fingerprint; a rank
        that skipped a step differs in its call count)."""
        self._begin_call(
            batch=shape.batch, s_loc=shape.s_loc, causal=shape.causal, docs=shape.docs,
            strategy=self.strategy,
        )  # fmt: skip

    # ------------------------------------------------------------------ public call
    def __call__(self, q, k, v, causal: bool = False, cu_seqlens=None, sm_scale=None):
        """Attention of this rank's queries over the whole sequence; differentiable for
        every strategy."""
        shape = self._check_inputs(q, k, v, causal, cu_seqlens)
        self._fingerprint(shape)
        scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(self.head_dim)
        if self.strategy == "none":
            out = gather_attention(self.group, q, k, v, shape.causal, cu_seqlens, scale)
        elif self.strategy == "ring":
            out = ring_attention(self.group, q, k, v, shape.causal, cu_seqlens, scale)
        else:
            out = _SPAttentionFn.apply(self, q, k, v, shape, cu_seqlens, scale)
        self._end()
        return out

    # ------------------------------------------------------------------ custom-op steps
    #: the calls whose exceptions are reported to the peers (``OpContext``)
    CALLS = ("forward_with_lse", "backward_with_lse")

    def forward_with_lse(self, q, k, v, causal: bool, cu_seqlens, sm_scale: float):
        """``(out, lse)`` of one forward, not recorded by autograd (for the custom op,
        ``ops.attention.library``): ``lse`` the natural-log log-sum-exp of every query
        row's scaled logits over the whole sequence, float32 ``[batch, heads, S_loc]``;
        empty for ``none``, which keeps no softmax statistics."""
        shape = self._check_inputs(q, k, v, causal, cu_seqlens)
        self._fingerprint(shape)
        b, h, s_loc, _ = q.shape
        if self.strategy == "none":
            out = gather_attention(self.group, q, k, v, shape.causal, cu_seqlens, sm_scale)
            lse = q.new_empty(0, dtype=torch.float32)
        elif self.strategy == "ring":
            out, lse = _ring_forward(self.group, q, k, v, shape.causal, cu_seqlens, sm_scale)
            out = out.to(q.dtype)
        else:  # the kernel's lse is base 2, [batch x heads, S_loc]
            out, lse2 = self._forward(q, k, v, shape, cu_seqlens, sm_scale)
            lse = lse2.view(b, h, s_loc) / K.LOG2E
        self._end()
        return out, lse

    def backward_with_lse(self, dout, q, k, v, out, lse, causal: bool, cu_seqlens,
                          sm_scale: float):  # fmt: skip
        """``(dq, dk, dv)`` of this rank's tokens from a forward's ``out`` and ``lse``
        (:meth:`forward_with_lse`), by the strategy's own backward; ``none``, which kept
        no ``lse``, recomputes it by the ring forward and runs the ring backward (the same
        gradients, from torch ops)."""
        shape = self._check_inputs(q, k, v, causal, cu_seqlens)
        if tuple(dout.shape) != tuple(q.shape) or tuple(out.shape) != tuple(q.shape):
            raise InterlaceValueError(
                f"{self.op_name}: dout {tuple(dout.shape)} and out {tuple(out.shape)} must "
                f"have q's shape {tuple(q.shape)}"
            )
        self._fingerprint(shape)
        b, h, s_loc, _ = q.shape
        dout, cu = dout.contiguous(), cu_seqlens
        if self.strategy == "none":
            out, lse = _ring_forward(self.group, q, k, v, shape.causal, cu, sm_scale)
        if self.strategy in ("none", "ring"):
            grads = _ring_backward(
                self.group, q, k, v, out.float(), lse, dout, shape.causal, cu, sm_scale
            )
        else:
            lse2 = (lse * K.LOG2E).reshape(b * h, s_loc).contiguous()
            grads = self._backward(q, k, v, out.contiguous(), lse2, dout, shape, cu, sm_scale)
        self._end()
        return grads

    # ------------------------------------------------------------------ fused
    def _args(self, shape: CallShape, cu, scale: float) -> KernelArgs:
        seg, cu_t = self._dummy, self._dummy
        if cu is not None:
            key = (cu.data_ptr(), tuple(cu.tolist()), shape.s_loc)
            found = self._seg_cache.get(key)
            if found is None:
                cu_t = cu.to(device=self.group.device, dtype=torch.int32)
                seg = segment_ids(cu_t, self.world_size * shape.s_loc)
                found = self._seg_cache[key] = (seg, cu_t)
                if len(self._seg_cache) > 16:
                    self._seg_cache.pop(next(iter(self._seg_cache)))
            seg, cu_t = found
        return KernelArgs(
            self.rank, self.world_size, self.heads, self.kv_heads, self.head_dim, shape.s_loc,
            shape.causal, cu is not None, scale, seg, cu_t, self.pad.buffer.local,
            self.error.address, self.max_spins, self.group.backend,
        )  # fmt: skip

    def _set_views(self, buf, s: int, numel: int):
        """Set ``s`` of ``buf`` as its two halves ``[W * numel]`` (K, V or dK, dV)."""
        w = self.world_size
        flat = buf.local[s]
        return flat[: w * numel], flat[w * numel : 2 * w * numel]

    def _gather(self, s: int, k, v, arrival: int, consumer) -> None:
        """Push this rank's K and V into slot ``rank`` of every peer's set ``s``, peer by
        peer in rank-rotated order, each peer's flag raised from the comm stream after
        both land, then enqueue ``consumer()`` (the kernels, which wait for the peers'
        flags) on the current stream: the copies first (see the module docstring).

        Set ``GRAPH_SET`` (a call being captured): a device barrier on the current stream
        first, so that every peer is done with the previous replay's chunks (and partial
        gradients) before this replay writes them again. It runs before the consumer, not
        beside it on the comm stream: a barrier kernel there could find no SM free while
        the consumer's programs fill the GPU waiting for flags behind it."""
        w, r = self.world_size, self.rank
        numel = k.numel()
        if s == GRAPH_SET:
            self._barrier()
        stream = fork(self.group)
        for i in range(1, w):
            dst = (r + i) % w
            flat = self.gathered.peers[dst][s]
            signal = self.pad.buffer.peers[dst].view(torch.uint32)
            copy_and_signal(flat[r * numel : (r + 1) * numel], k.view(-1), stream=stream)
            lo = (w + r) * numel
            copy_and_signal(flat[lo : lo + numel], v.view(-1), signal, arrival + r, stream=stream)
        consumer()
        join(self.group, stream)

    def _arrival(self, s: int) -> int:
        return self.pad.offset("arrival") + s * (self.world_size + 1)

    def _kind(self, step: str, shape: CallShape, a: KernelArgs):
        """What, besides the operands' shapes, a graph-replayed call must share with the
        captured one (``OpContext._enqueue``): the kernels' specialisation and scalars."""
        return (step, shape.causal, a.varlen, a.sm_scale)

    @staticmethod
    def _operands(a: KernelArgs, *tensors) -> list:
        """The call's tensors for ``_enqueue`` (re-pointed at each replay): each distinct
        one once (``v`` may be ``k``), then the document tables when ``varlen``."""
        seen, out = set(), []
        for t in tensors:
            key = (t.data_ptr(), t.numel())
            out.append(None if key in seen else t)
            seen.add(key)
        return out + ([a.seg, a.cu] if a.varlen else [None, None])

    def _forward(self, q, k, v, shape: CallShape, cu, scale):
        if self.group.backend == "cuda":
            install_scratch_allocator()
        a = self._args(shape, cu, scale)
        o = torch.empty_like(q)
        lse = torch.empty(
            q.shape[0] * q.shape[1], shape.s_loc, dtype=torch.float32, device=q.device
        )

        def run():
            s = self._buffer_set()
            arrival = self._arrival(s)
            k_all, v_all = self._set_views(self.gathered, s, k.numel())

            def consumer():
                launch_fwd(a, q, k, v, k_all, v_all, o, lse, arrival, wait=True, clear=True)

            self._gather(s, k, v, arrival, consumer)

        self._enqueue(self._kind("fwd", shape, a), run, *self._operands(a, q, k, v, o, lse))
        return o, lse

    def _backward(self, q, k, v, o, lse, do, shape: CallShape, cu, scale):
        if self.group.backend == "cuda":
            install_scratch_allocator()
        a = self._args(shape, cu, scale)
        do = do.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        delta = torch.empty_like(lse)
        numel = k.numel()

        def run():
            s = self._buffer_set()
            arrival = self._arrival(s)
            dkv_slot = self.pad.offset("dkv") + s * (self.world_size + 1)
            k_all, v_all = self._set_views(self.gathered, s, numel)
            recv = self.recv.local[s]

            bufs = BackwardBuffers(
                k_all, v_all, recv, self.recv.ptrs, self.pad.ptrs, arrival, dkv_slot
            )

            def consumer():
                launch_backward(
                    a, q, k, v, o, do, lse, delta, dq, dk, dv, bufs, wait=True, clear=True,
                    side=side_stream(self.group.device) if self.SIDE_DQ else None,
                )  # fmt: skip

            self._gather(s, k, v, arrival, consumer)

        operands = self._operands(a, q, k, v, o, lse, do, dq, dk, dv, delta)
        self._enqueue(self._kind("bwd", shape, a), run, *operands)
        return dq, dk, dv


class _SPAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(fctx, op: SPAttention, q, k, v, shape, cu, scale):
        o, lse = op._forward(q, k, v, shape, cu, scale)
        fctx.save_for_backward(q, k, v, o, lse)
        fctx.op, fctx.shape, fctx.cu, fctx.scale = op, shape, cu, scale
        return o

    @staticmethod
    def backward(fctx, do):
        q, k, v, o, lse = fctx.saved_tensors
        op = fctx.op
        op._begin()
        op._fingerprint(fctx.shape)
        dq, dk, dv = op._backward(q, k, v, o, lse, do, fctx.shape, fctx.cu, fctx.scale)
        op._end()
        return None, dq, dk, dv, None, None, None


__all__ = [
    "AttnConfig",
    "KernelArgs",
    "SPAttention",
    "launch_delta",
    "launch_dkdv",
    "launch_dq",
    "launch_fwd",
    "launch_reduce",
]
