"""Low-latency expert-parallel dispatch and combine, for decoding (DeepEP's low-latency
mode)::

    ep = interlace.EPLowLatency(group, max_tokens=128, hidden=7168, experts=256, topk=8)
    h = ep.dispatch(x, topk_idx, topk_weights)   # h.recv_x [local experts, W * T, H]
    y_rows = expert_fn(h.recv_x, h.expert_counts)   # rows past a count are unspecified
    y = ep.combine(y_rows, h)                    # top-k weighted sum at the home rank

One kernel per direction (``kernels.ep_low_latency``): every rank stores each token
straight into a segment of each rank holding one of its experts (once per expert), and
the receiver recognises arrivals by the call's epoch carried in the words themselves, so
there is no routing exchange, no layout pass and no host synchronisation. Two arrival
protocols, ``protocol=``:

* ``"flag_in_data"``: each 8-byte word carries 4 bytes of the row and the epoch; the
  receiver polls the row itself (twice the bytes on the wire).
* ``"token_flag"``: plain rows, one release-stored flag word per row.

``"auto"`` (the default) picks :data:`DEFAULT_PROTOCOL`, the one measured faster.

``fp8=True`` (as DeepEP's low-latency dispatch): the sender quantises each token's row
to e4m3 with one float32 scale per 128 values (``amax / 448``; the quantiser of
:class:`~interlace.ops.ep.dispatch.EPAllToAll`'s FP8 mode, ``kernels.ep.quantise_e4m3``)
and sends the codes and the scales in one message (``hidden / 4 + hidden / 128`` 4-byte
words instead of ``hidden / 2``); the handle's ``recv_x`` is then ``float8_e4m3fn`` and
``recv_scale [local experts, W * max_tokens, hidden / 128]`` holds the scales, the names
of ``EPAllToAll``'s FP8 mode. ``hidden`` must be a multiple of 128. Both protocols carry
it: the message is 4-byte words either way, so flag-in-data pairs each word (four codes
or one scale) with the epoch as it does a word of two 16-bit values. Combine stays in
``dtype``: ``expert_out`` is a ``dtype`` tensor shaped as ``recv_x``.

The output is laid out per local expert with a fixed stride of ``W * max_tokens`` rows
(expert ``e``'s rows are ``recv_x[e, :expert_counts[e]]``, by source rank, then token),
so rows land where they belong without waiting for other experts' counts: the input of a
masked grouped GEMM. A token that names one expert in several top-k slots reaches it
once; combine adds that row with the sum of those slots' weights. Epochs are counted on
the device, so calls can be captured in a CUDA graph and replayed; eager calls replay
from CUDA graphs (``eager_graphs``). Ranks call dispatch and combine in the same order;
a handle is valid until the next dispatch. ``max_tokens`` is at most 256; the dtype is
bfloat16 or float16; ``hidden`` is even (a multiple of 128 with ``fp8``).

Inside ``interlace.trace.record`` both launches are traced (``TRACE`` on, eager: no graph
replay; the kernels' slots in ``kernels.ep_low_latency``, their reading in
``interlace.trace.model``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import InterlaceTypeError, InterlaceValueError
from ...kernels.ep_low_latency import ll_combine_kernel, ll_dispatch_kernel
from ...runtime import symm_empty
from .. import _trace
from .._context import OpContext, sm_count
from .._launch import launch
from .dispatch import FP8_GROUP
from .layout import EPCallChecks, check_routing_args, next_pow2

#: The arrival protocol ``protocol="auto"`` uses: one flag per token measured faster than
#: flag-in-data on one H100 (hidden 7168, top-8, 256 experts, waits met): dispatch 0.092
#: vs 0.134 ms at 128 tokens, 0.164 vs 0.214 ms at 256; combine 0.092 vs 0.106 and 0.168
#: vs 0.172 ms (flag-in-data moves twice the bytes). Records: op ``ep_dispatch`` /
#: ``ep_combine``, mode ``low_latency``, in
#: benchmarks/results/2026-11-25-h100-80gb-hbm3-w1.json. Across four H200s (one rank each,
#: eager calls) the same: dispatch 0.146 vs 0.254 ms at 128 tokens, 0.273 vs 0.344 at 256;
#: combine 0.142 vs 0.251 and 0.323 vs 0.321 ms (benchmarks/results/2026-11-28-h200-w4.json).
DEFAULT_PROTOCOL = "token_flag"
PROTOCOLS = ("flag_in_data", "token_flag")
MAX_TOKENS = 256


@dataclass
class EPLowLatencyHandle:
    """What :meth:`EPLowLatency.dispatch` returns on each rank.

    * ``recv_x [local experts, W * max_tokens, hidden]``: expert ``e``'s rows are
      ``recv_x[e, :expert_counts[e]]``, by source rank, then by the token's index there.
      FP8 dispatch: e4m3 values, with ``recv_scale [local experts, W * max_tokens,
      hidden / 128]`` (fp32, one per 128 values; ``None`` otherwise).
    * ``expert_counts`` int32 ``[local experts]``, on the device.
    * ``layout`` int32 ``[local experts, W, 2]``: first row and rows of each source rank.
    * ``src_info`` int32 ``[local experts, W * max_tokens]``: ``(source * max_tokens +
      token) * KP + k`` of each row (``KP`` = top-k rounded up to a power of two).

    The views alias the context's buffers: valid until the next dispatch."""

    recv_x: torch.Tensor
    recv_scale: torch.Tensor | None
    expert_counts: torch.Tensor
    layout: torch.Tensor
    src_info: torch.Tensor
    num_tokens: int
    call: int


class EPLowLatency(EPCallChecks, OpContext):
    """See the module docstring. ``experts`` is the global expert count, a multiple of
    the world size; rank ``r`` holds experts ``r * E/W .. (r + 1) * E/W - 1``. ``fp8``:
    dispatch sends e4m3 values with one fp32 scale per 128 (``hidden`` a multiple of
    128); combine stays in ``dtype``."""

    #: the calls whose exceptions are reported to the peers (``OpContext``)
    CALLS = ("dispatch", "combine")

    op_name = "ep_low_latency"

    def __init__(
        self, group, max_tokens: int, hidden: int, experts: int, topk: int,
        dtype: torch.dtype = torch.bfloat16, protocol: str = "auto", fp8: bool = False,
        max_spins=None, eager_graphs: bool | None = None,
    ):  # fmt: skip
        w = group.world_size
        max_tokens, hidden, experts, topk = int(max_tokens), int(hidden), int(experts), int(topk)
        op = self.op_name
        if not 1 <= max_tokens <= MAX_TOKENS:
            raise InterlaceValueError(
                f"{op}: max_tokens must be in [1, {MAX_TOKENS}], got {max_tokens}"
            )
        if hidden < 2 or hidden % 2:
            raise InterlaceValueError(f"{op}: hidden must be even and positive, got {hidden}")
        if fp8 and hidden % FP8_GROUP:
            raise InterlaceValueError(
                f"{op}: fp8 dispatch needs hidden a multiple of {FP8_GROUP}, got {hidden}"
            )
        if experts < 1 or experts % w:
            raise InterlaceValueError(
                f"{op}: experts = {experts} must be a positive multiple of the world size {w}"
            )
        if not 1 <= topk <= 16:
            raise InterlaceValueError(f"{op}: topk = {topk}, must be in [1, 16]")
        if dtype not in (torch.bfloat16, torch.float16):
            raise InterlaceTypeError(f"{op}: dtype must be bfloat16 or float16, got {dtype}")
        if protocol == "auto":
            protocol = DEFAULT_PROTOCOL
        if protocol not in PROTOCOLS:
            raise InterlaceValueError(
                f"{op}: protocol must be 'auto' or one of {PROTOCOLS}, got {protocol!r}"
            )
        self.e_loc = experts // w
        regions = {"count": w, "combine": 16, "arrive": w, "bad_index": 1}
        super().__init__(group, dtype, max_tokens * hidden, regions, max_spins)
        self.max_tokens, self.hidden, self.experts, self.topk = max_tokens, hidden, experts, topk
        self.protocol, self.fp8 = protocol, bool(fp8)
        self.flag_in_data = protocol == "flag_in_data"
        self.kp = max(2, next_pow2(topk))
        self.hw = hidden // 2  # 4-byte words of a row (combine; dispatch without fp8)
        # dispatch message: QW words of values (four e4m3 codes each with fp8), SW of scales
        self.qw = hidden // 4 if self.fp8 else self.hw
        self.sw = hidden // FP8_GROUP if self.fp8 else 0
        t, e, kp, hw, dev = max_tokens, self.e_loc, self.kp, self.hw, group.device
        word = torch.int64 if self.flag_in_data else torch.int32
        # receive buffers start zeroed: epoch 0 is never a call's
        self.d_count = self._track(_zeros((2, e, w), group))
        self.d_meta = self._track(_zeros((2, e, w, t), group))
        self.d_data = self._track(symm_empty((2, e, w, t, self.qw + self.sw), word, group))
        self.c_arrive = self._track(_zeros((w,), group))
        self.c_meta = self._track(_zeros((2, kp, t), group))
        self.c_data = self._track(symm_empty((2, kp, t, hw), word, group))
        if self.flag_in_data:
            self.d_data.local.zero_()
            self.c_data.local.zero_()
        # fp8: raw e4m3 bytes, exposed as a float8_e4m3fn view (as EPAllToAll)
        self._recv = torch.empty(
            e, w * t, hidden, dtype=torch.uint8 if self.fp8 else dtype, device=dev
        )
        self.recv_x = self._recv.view(torch.float8_e4m3fn) if self.fp8 else self._recv
        self.recv_scale = (
            torch.empty(e, w * t, self.sw, dtype=torch.float32, device=dev) if self.fp8 else None
        )
        self._stub = torch.zeros(1, hidden, dtype=dtype, device=dev)  # placeholder operand
        self.recv_src = torch.zeros(e, w * t, dtype=torch.int32, device=dev)
        self.layout = torch.zeros(e, w, 2, dtype=torch.int32, device=dev)
        self.expert_counts = torch.zeros(e, dtype=torch.int32, device=dev)
        self.home_idx = torch.full((t, kp), -1, dtype=torch.int32, device=dev)
        self.home_w = torch.zeros(t, kp, dtype=torch.float32, device=dev)
        self.epochs = torch.zeros(4, dtype=torch.int32, device=dev)  # epochs, arrival counters
        sms = sm_count(dev.index) if group.backend == "cuda" else 0
        # the interpreter runs programs one after another: one program sends everything
        # before it receives; on a GPU every program is resident at once (<= one per SM)
        self.programs = max(1, min(sms, max(experts, e * w, t))) if sms else 1
        self.block_words = min(1024 if sms else 64, next_pow2(hw))
        # fp8: values quantised per chunk (a multiple of 128; the interpreter's ragged
        # last chunk is exercised by hidden 384)
        self.block_values = min(1024 if sms else 256, next_pow2(hidden))
        self._calls = 0
        self._dispatched = None
        self._init_eager_graphs(eager_graphs)
        group.host_barrier()  # every rank's buffers exist (and are zeroed) before any write

    # ------------------------------------------------------------------ errors
    def _check_error(self, rank: int, slot: int, seen: int):
        """A bad expert id, found alike on every rank (``OpContext._check_error``)."""
        return self._bad_index_error(rank, slot, "its tokens were not sent")

    # ------------------------------------------------------------------ calls
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        """Send each token of ``x [tokens, hidden]`` (tokens <= max_tokens) to the ranks
        of its experts ``topk_idx [tokens, topk]`` (-1 = none); ``topk_weights`` are kept
        for combine. Returns an :class:`EPLowLatencyHandle`. Collective."""
        key, n = self._replayed_dispatch(x, topk_idx, topk_weights)
        if n is None:  # (else a call like one that went the whole way replayed its graph)
            self._begin()
            check_routing_args(self.op_name, x, topk_idx, topk_weights, self)
            _check_words(self.op_name, "x", x)
            self._fingerprint(graphed=True)
            n = x.shape[0]
            if n == 0:  # placeholders the kernel never reads
                x, topk_idx, topk_weights = self._stub, self.home_idx, self.home_w
            run = lambda: self._dispatch(n, x, topk_idx, topk_weights)  # noqa: E731
            self._enqueue(f"dispatch{n == 0}", run, x, topk_idx, topk_weights)
            self._end()
            if n:
                self._arm(key)
        self._calls += 1
        self._dispatched = (self._calls, n)
        return EPLowLatencyHandle(
            self.recv_x, self.recv_scale, self.expert_counts, self.layout, self.recv_src, n,
            self._calls,
        )  # fmt: skip

    def _trace_args(self, kernel: str, sends: int, tokens: int) -> dict:
        """The ``TRACE`` / ``tbuf`` arguments that trace a launch of ``kernel`` into a
        buffer of the recorder in force (none where none is: the launch runs untraced).
        Its programs' steps (``kernels.ep_low_latency``): ``sends`` units dealt round robin
        (experts, or segments), then the dispatch's segments received, or the combine's
        arrival waits (program 0, one per rank) and this rank's ``tokens``."""
        g, w = self.programs, self.world_size
        segments = self.e_loc * w
        dispatch = kernel == _trace.EP_LL_DISPATCH
        after = -(-segments // g) if dispatch else w + -(-tokens // g)
        info = dict(
            kernel=kernel, layout="tiles", slots="ep_ll", rank=self.rank, world=w, grid=g,
            n_tiles=sends + (segments if dispatch else tokens), send_steps=-(-sends // g),
            experts=self.experts, e_loc=self.e_loc, tokens=tokens, protocol=self.protocol,
            fp8=self.fp8, word_bytes=8 if self.flag_in_data else 4,
            row_words=self.qw + self.sw if dispatch else self.hw,
        )  # fmt: skip
        tbuf = _trace.buffer(g, -(-sends // g) + after, info)
        return {} if tbuf is None else dict(TRACE=True, tbuf=tbuf)

    def _dispatch(self, n, x, topk_idx, topk_weights) -> None:
        scale = self.recv_scale if self.fp8 else self.recv_src  # placeholder without fp8
        tr = {}  # the launch's trace arguments: none unless recording
        if _trace.ACTIVE:  # (the call then runs eagerly, not from its graph: ``_enqueue``)
            tr = self._trace_args(_trace.EP_LL_DISPATCH, self.experts, n)
        launch(
            ll_dispatch_kernel, self.programs, x, n, topk_idx, topk_weights, self.home_idx,
            self.home_w, self.d_count.local, self.d_count.ptrs, self.d_meta.local,
            self.d_meta.ptrs, self.d_data.local, self.d_data.ptrs, self._recv, scale,
            self.recv_src, self.layout, self.expert_counts, self.epochs, self.error.address,
            self.rank, self.world_size, self.experts, self.topk, self.max_tokens, self.hidden,
            self.qw, self.sw, self.pad.offset("bad_index"), self.pad.offset("count"),
            self.max_spins, E_LOC=self.e_loc, KP=self.kp, TP=max(2, next_pow2(self.max_tokens)),
            BW=self.block_words, BQ=self.block_values, FLAG_IN_DATA=self.flag_in_data,
            FP8=self.fp8, num_warps=4, **tr,
        )  # fmt: skip

    def combine(self, expert_out: torch.Tensor, handle: EPLowLatencyHandle, out=None):
        """``out[t] = sum_k topk_weights[t, k] * expert_out[row of (t, k)]`` (fp32 sums)
        for this rank's tokens of the dispatch that returned ``handle``; ``expert_out``
        is laid out as ``handle.recv_x``. Collective."""
        key, result = self._replayed_combine(expert_out, handle, out, EPLowLatencyHandle)
        if result is not None:
            return result
        out = self._combine_call(expert_out, handle, out)
        self._arm(key)
        return out

    def _combine_call(self, expert_out, handle, out):
        """:meth:`combine` the whole way: checks, fingerprint, the enqueued launch."""
        self._begin()
        op = self.op_name
        if not isinstance(handle, EPLowLatencyHandle):
            raise InterlaceValueError(f"{op}: handle must be the handle a dispatch returned")
        if self._dispatched is None or handle.call != self._dispatched[0]:
            raise InterlaceValueError(
                f"{op}: the handle is not from this context's latest dispatch (a handle is "
                "valid until the next dispatch)"
            )
        self._check_placed("expert_out", expert_out)
        want = tuple(self.recv_x.shape)
        if tuple(expert_out.shape) != want or not expert_out.is_contiguous():
            raise InterlaceValueError(
                f"{op}: expert_out must be a contiguous {list(want)} tensor, got "
                f"{tuple(expert_out.shape)}"
            )
        _check_words(op, "expert_out", expert_out)
        n = handle.num_tokens
        if out is None:
            out = torch.empty(n, self.hidden, dtype=self.dtype, device=self.group.device)
        else:
            self._check_placed("out", out)
            if tuple(out.shape) != (n, self.hidden) or not out.is_contiguous():
                raise InterlaceValueError(
                    f"{op}: out must be a contiguous [{n}, {self.hidden}] tensor"
                )
            _check_words(op, "out", out)
        self._fingerprint(graphed=True)
        dst = out if n else self._stub  # placeholder, never written
        run = lambda: self._combine(n, expert_out, dst)  # noqa: E731
        self._enqueue(f"combine{n == 0}", run, expert_out, dst)
        self._end()
        return out

    def _combine(self, n, expert_out, out) -> None:
        tr = {}  # the launch's trace arguments: none unless recording
        if _trace.ACTIVE:
            tr = self._trace_args(_trace.EP_LL_COMBINE, self.e_loc * self.world_size, n)
        launch(
            ll_combine_kernel, self.programs, expert_out, out, n, self.home_idx, self.home_w,
            self.recv_src, self.layout, self.c_arrive.local, self.c_arrive.ptrs,
            self.c_meta.local, self.c_meta.ptrs, self.c_data.local, self.c_data.ptrs,
            self.epochs, self.error.address, self.rank, self.world_size, self.max_tokens,
            self.hw, self.pad.offset("combine"), self.pad.offset("arrive"), self.max_spins,
            E_LOC=self.e_loc, KP=self.kp, BW=self.block_words, IS_BF16=self.dtype == torch.bfloat16,
            FLAG_IN_DATA=self.flag_in_data, num_warps=4, **tr,
        )  # fmt: skip

    def __repr__(self) -> str:
        return (
            f"EPLowLatency(world={self.world_size}, max_tokens={self.max_tokens}, hidden="
            f"{self.hidden}, experts={self.experts}, topk={self.topk}, protocol="
            f"{self.protocol!r}, fp8={self.fp8})"
        )


def _check_words(op: str, name: str, t: torch.Tensor) -> None:
    """The kernels move rows as 4-byte words: ``t`` must start on a 4-byte boundary (a
    tensor of its own always does; a view at an odd element offset does not)."""
    if t.data_ptr() % 4:
        raise InterlaceValueError(
            f"{op}: {name} must start at a 4-byte boundary (the kernels move rows as "
            f"4-byte words); this view starts {t.data_ptr() % 4} bytes past one "
            f"(pass {name}.clone())"
        )


def _zeros(shape, group):
    buf = symm_empty(shape, torch.int64, group)
    buf.local.zero_()
    return buf
