"""Expert-parallel dispatch and combine over symmetric memory (DeepEP's normal mode)::

    ep = interlace.EPAllToAll(group, max_tokens=4096, hidden=7168, experts=256, topk=8)
    h = ep.dispatch(x, topk_idx, topk_weights)   # rows grouped by local expert
    y_rows = expert_fn(h.recv_x, h.expert_offsets)   # e.g. torch._grouped_mm
    y = ep.combine(y_rows, h)                    # top-k weighted sum at the home rank

Dispatch is four launches and no host synchronisation:

1. ``ep_route_kernel``: every rank writes its routing (expert ids, weights, token count)
   into a slot of every rank (a few KB), waiting first for that slot to be free.
2. ``ep_send_kernel``: each token's row is stored once into each rank that holds one of
   its experts (NVLink stores from SMs, destinations rank-rotated), FP8-quantised on the
   way when asked; per source a count of finished programs is raised on the receiver.
3. ``ep_layout_kernel``: from the routing of every rank, each rank computes the rows per
   local expert, each pair's row in the expanded output (prefix sums on the GPU) and
   checks every rank's rows against the capacity: an overflow (or an expert id out of
   range) is found by every rank alike, recorded in each rank's error word and raised on
   every rank (:class:`EPCapacityError`); nothing is then written, and nobody hangs.
4. ``ep_expand_kernel``: each source's staged tokens, once they landed, are copied into
   the expanded output once per local expert (a local copy at HBM speed).

Combine is two launches: every expert rank sums, in fp32 and weighted, its experts' rows
of each token and stores one row per token into the token's home rank; the home rank
adds the rows of the ranks that hold its token's experts in fp32, in rank order.

Every buffer is sized by the worst case given at construction (``max_tokens`` per rank;
``capacity`` expanded rows, default the bound that cannot overflow), so calls can be
captured in a CUDA graph and replayed with new routing. Eager calls replay from CUDA
graphs (``eager_graphs``). One dispatch's handle is valid until the next dispatch; ranks
call dispatch and combine alike and in the same order.

Inside ``interlace.trace.record`` every launch of dispatch and combine is traced
(``TRACE`` on, eager: no graph replay; the kernels' slots in ``kernels.ep``, their
reading in ``interlace.trace.model``).
"""

from __future__ import annotations

import torch

from ...errors import InterlaceValueError
from ...kernels.ep import (
    ep_expand_kernel,
    ep_layout_kernel,
    ep_route_kernel,
    ep_send_kernel,
)
from ...runtime import symm_empty
from .. import _trace
from .._context import OpContext, sm_count
from .._launch import launch
from . import combine as _combine
from .layout import (
    EPCallChecks,
    EPCapacityError,
    EPHandle,
    check_routing_args,
    ep_config,
    next_pow2,
)

FP8_GROUP = 128
#: the kernels' names in traces (``interlace.trace``), in launch order
EP_ROUTE, EP_SEND, EP_LAYOUT, EP_EXPAND = "ep_route", "ep_send", "ep_layout", "ep_expand"


class EPAllToAll(EPCallChecks, OpContext):
    """Dispatch tokens to the ranks of their top-k experts and combine the experts'
    outputs back (see the module docstring). ``experts`` is the global expert count, a
    multiple of the world size; rank ``r`` holds experts ``r * E/W .. (r + 1) * E/W - 1``.
    ``fp8``: dispatch sends e4m3 values with one fp32 scale per 128 (``hidden`` a multiple
    of 128); combine stays in ``dtype``."""

    #: the calls whose exceptions are reported to the peers (``OpContext``)
    CALLS = ("dispatch", "combine")

    op_name = "ep_dispatch"

    def __init__(
        self, group, max_tokens: int, hidden: int, experts: int, topk: int,
        dtype: torch.dtype = torch.bfloat16, capacity: int | None = None, fp8: bool = False,
        max_spins=None, eager_graphs: bool | None = None,
    ):  # fmt: skip
        w = group.world_size
        max_tokens, hidden, experts, topk = int(max_tokens), int(hidden), int(experts), int(topk)
        if max_tokens < 1 or hidden < 1 or topk < 1:
            raise InterlaceValueError(
                f"{self.op_name}: max_tokens, hidden and topk must be positive, got "
                f"{max_tokens}, {hidden}, {topk}"
            )
        if experts < 1 or experts % w:
            raise InterlaceValueError(
                f"{self.op_name}: experts = {experts} must be a positive multiple of the "
                f"world size {w}"
            )
        if topk > 16:
            raise InterlaceValueError(f"{self.op_name}: topk = {topk}, at most 16 supported")
        if fp8 and hidden % FP8_GROUP:
            raise InterlaceValueError(
                f"{self.op_name}: fp8 dispatch needs hidden a multiple of {FP8_GROUP}, got {hidden}"
            )
        self.e_loc = experts // w
        # every (token, k) pair is a row, also where a token names one expert twice
        bound = w * max_tokens * topk
        capacity = bound if capacity is None else int(capacity)
        if capacity < 1:
            raise InterlaceValueError(f"{self.op_name}: capacity must be positive, got {capacity}")
        regions = {
            "route": w, "data": w, "comb": w, "done": 2, "overflow": 1, "bad_index": 1,
            "src_done": w,
        }  # fmt: skip
        super().__init__(group, dtype, max_tokens * hidden, regions, max_spins)
        self.max_tokens, self.hidden, self.experts, self.topk = max_tokens, hidden, experts, topk
        self.capacity, self.fp8 = capacity, bool(fp8)
        self.kp = max(2, next_pow2(topk))
        sms = sm_count(group.device.index) if group.backend == "cuda" else 0
        self.cfg = ep_config(group.backend, max_tokens, hidden, self.fp8, sms)
        dev, t, kp, h = group.device, max_tokens, self.kp, hidden
        stage_dtype = torch.uint8 if self.fp8 else dtype  # fp8: raw e4m3 bytes
        self.route_idx = self._track(symm_empty((w, t, kp), torch.int32, group))
        self.route_w = self._track(symm_empty((w, t, kp), torch.float32, group))
        self.route_n = self._track(symm_empty((w,), torch.int32, group))
        self.stage = self._track(symm_empty((w, t, h), stage_dtype, group))
        groups = h // FP8_GROUP if self.fp8 else 1
        self.stage_scale = self._track(symm_empty((w, t, groups), torch.float32, group))
        self.comb = self._track(symm_empty((w, t, h), dtype, group))
        self.pair_rel = torch.full((w, t, kp), -1, dtype=torch.int32, device=dev)
        self.counts = torch.zeros(self.e_loc, dtype=torch.int32, device=dev)
        self.seg_counts = torch.zeros(self.e_loc, w, dtype=torch.int32, device=dev)
        self.status = torch.zeros(1, dtype=torch.int32, device=dev)
        self._recv = torch.empty(capacity, h, dtype=stage_dtype, device=dev)
        self.recv_x = self._recv.view(torch.float8_e4m3fn) if self.fp8 else self._recv
        self.recv_scale = (
            torch.empty(capacity, groups, dtype=torch.float32, device=dev) if self.fp8 else None
        )
        self.expert_counts = torch.zeros(self.e_loc, dtype=torch.int32, device=dev)
        self.expert_offsets = torch.zeros(self.e_loc, dtype=torch.int32, device=dev)
        self._calls = 0
        self._dispatched = None  # (call number, tokens) of the last dispatch
        self._init_eager_graphs(eager_graphs)
        group.host_barrier()  # every rank's buffers exist before any peer writes them

    # ------------------------------------------------------------------ errors
    def _check_error(self, rank: int, slot: int, seen: int):
        """Capacity overflow and a bad expert id, found by the layout kernel alike on every
        rank (``OpContext._check_error``); a timed-out wait fails the context as usual."""
        if slot == self.pad.offset("overflow"):
            return EPCapacityError(
                f"{self.op_name}: rank {rank} would receive {seen} (token, expert) rows, "
                f"more than the capacity of {self.capacity} given at construction; the call "
                "moved no rows (build the context with a larger capacity)"
            )
        return self._bad_index_error(rank, slot, "the call moved no rows")

    # ------------------------------------------------------------------ dispatch
    def _common(self) -> dict:
        return dict(err=self.error.address, rank=self.rank, world=self.world_size)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        """Send each token of ``x [tokens, hidden]`` to the ranks holding its experts
        ``topk_idx [tokens, topk]`` (int64 or int32, -1 = no expert), with
        ``topk_weights`` (fp32 or the context dtype) kept for combine. Returns an
        :class:`EPHandle`. Collective."""
        key, n = self._replayed_dispatch(x, topk_idx, topk_weights)
        if n is None:  # (else a call like one that went the whole way replayed its graph)
            self._begin()
            check_routing_args(self.op_name, x, topk_idx, topk_weights, self)
            self._fingerprint(graphed=True)
            n = x.shape[0]
            if n == 0:
                run = lambda: self._dispatch(n, None, None, None)  # noqa: E731
                run() if self.group.backend == "cpu" else self._enqueue("dispatch0", run)
            else:
                run = lambda: self._dispatch(n, x, topk_idx, topk_weights)  # noqa: E731
                self._enqueue("dispatch", run, x, topk_idx, topk_weights)
            self._end()
            if n:
                self._arm(key)
        self._calls += 1
        self._dispatched = (self._calls, n)
        return EPHandle(
            self.recv_x, self.recv_scale, self.expert_counts, self.expert_offsets, n, self._calls
        )

    def _dispatch(self, n, x, topk_idx, topk_weights, src_major=None) -> None:
        """The four launches. ``src_major = (recv, src_offs, cap_s)``: the expansion
        writes the source-major layout into ``recv`` instead (see ``EPMoE``)."""
        cfg, w, c = self.cfg, self.world_size, self._common()
        pad = self.pad
        sig_tab, sig = pad.ptrs, pad.buffer.local
        if x is None:  # no tokens on this rank: placeholders the kernels never read
            x = self.comb.local[0]
            topk_idx = self.route_idx.local[0]
            topk_weights = self.route_w.local[0]
        tr = ({}, {}, {}, {})  # the launches' trace arguments: none unless recording
        if _trace.ACTIVE:
            tr = self._trace_args(
                (EP_ROUTE, w, 1, w), (EP_SEND, cfg.programs, 1, cfg.programs),
                (EP_LAYOUT, self.e_loc + 1, w, self.e_loc + 1),
                (EP_EXPAND, cfg.programs, w, cfg.programs * w),
            )  # fmt: skip
        launch(
            ep_route_kernel, w, topk_idx, topk_weights, n,
            self.route_idx.local, self.route_idx.ptrs, self.route_w.local, self.route_w.ptrs,
            self.route_n.local, self.route_n.ptrs, sig_tab, pad.offset("route"),
            c["err"], c["rank"], c["world"], self.experts, self.topk, self.max_tokens,
            self.max_spins, KP=self.kp, BT=cfg.layout_tokens, **tr[0],
        )  # fmt: skip
        launch(
            ep_send_kernel, cfg.programs, x, n, self.route_idx.local, self.stage.local,
            self.stage.ptrs, self.stage_scale.local, self.stage_scale.ptrs, sig_tab,
            pad.offset("data"), c["rank"], c["world"], self.hidden, self.max_tokens,
            E_LOC=self.e_loc, KP=self.kp, BT=cfg.block_tokens, BH=cfg.block_hidden,
            FP8=self.fp8, num_warps=cfg.num_warps, **tr[1],
        )  # fmt: skip
        launch(
            ep_layout_kernel, self.e_loc + 1, self.route_idx.local, self.route_n.local,
            self.pair_rel, self.counts, self.seg_counts, self.status, sig, pad.offset("route"),
            c["err"],
            c["rank"], c["world"], self.max_tokens, self.capacity, pad.offset("overflow"),
            pad.offset("bad_index"), self.max_spins,
            E_LOC=self.e_loc, KP=self.kp, BT=cfg.layout_tokens, WP=max(2, next_pow2(w)),
            **tr[2],
        )  # fmt: skip
        recv_scale = self.recv_scale if self.recv_scale is not None else self.status
        recv, src_offs, cap_s = (self._recv, self.status, 0) if src_major is None else src_major
        launch(
            ep_expand_kernel, cfg.programs, self.stage.local, self.stage_scale.local,
            self.route_idx.local, self.route_n.local, self.pair_rel, self.counts,
            self.status, recv, recv_scale, self.expert_counts, self.expert_offsets,
            sig, pad.offset("route"), pad.offset("data"), pad.offset("done"), cfg.programs,
            c["err"], c["rank"], c["world"], self.hidden, self.max_tokens, self.max_spins,
            self.seg_counts, src_offs, cap_s, pad.offset("src_done"),
            E_LOC=self.e_loc, KP=self.kp, BT=cfg.block_tokens, BH=cfg.block_hidden,
            EP2=max(2, next_pow2(self.e_loc)), WP=max(2, next_pow2(w)), FP8=self.fp8,
            SRC_MAJOR=src_major is not None, num_warps=cfg.num_warps, **tr[3],
        )  # fmt: skip

    def _trace_args(self, *launches) -> list[dict]:
        """Per launch ``(kernel name, grid, steps per program, tiles)``: the ``TRACE`` /
        ``tbuf`` arguments that trace it into a buffer of the recorder in force (none where
        none is: the launch runs untraced). Program ``p`` of ``P`` fills tile ``p + j P`` at
        its step ``j`` (``kernels.ep``)."""
        out = []
        for kernel, grid, steps, tiles in launches:
            info = dict(
                kernel=kernel, layout="tiles", slots="ep", rank=self.rank,
                world=self.world_size, grid=grid, n_tiles=tiles, hidden=self.hidden,
                kp=self.kp, elem=1 if self.fp8 else self.comb.local.element_size(),
            )  # fmt: skip
            tbuf = _trace.buffer(grid, steps, info)
            out.append({} if tbuf is None else dict(TRACE=True, tbuf=tbuf))
        return out

    # ------------------------------------------------------------------ combine
    def combine(self, expert_out: torch.Tensor, handle: EPHandle, out=None) -> torch.Tensor:
        """``out[t] = sum_k topk_weights[t, k] * expert_out[row of (t, k)]`` for this
        rank's tokens of the dispatch that returned ``handle``; ``expert_out
        [capacity, hidden]`` holds one row per row of ``handle.recv_x`` (in the context
        dtype). Sums are fp32; tokens routed nowhere get 0. Collective."""
        return _combine.combine(self, expert_out, handle, out)

    def __repr__(self) -> str:
        return (
            f"EPAllToAll(world={self.world_size}, max_tokens={self.max_tokens}, hidden="
            f"{self.hidden}, experts={self.experts}, topk={self.topk}, capacity="
            f"{self.capacity}, fp8={self.fp8})"
        )
