"""What every op context shares: its signal pad, error word, barrier, argument checks,
call fingerprints and life cycle (``close()``, context-manager use, ``check()``).

Faults across ranks (``interlace.errors.CrossRankError``): every call of an op runs
``_begin()`` first (refuses a closed or failed context, notes a fault recorded since the
last call), then its argument checks, then ``_begin_call(**fields)`` just before it
enqueues device work (it raises the noted fault, named with this call's fields): the
fields the peers depend on (shapes, strategy, ...) become the call's fingerprint,
written in stream order into this rank's ``call`` slot, which device barriers carry (a
peer that called differently is reported at once) and which the host reads to name the
difference. ``_end()`` raises a fault the call's waits recorded (at once on the ``cpu``
backend; on ``cuda`` at the next call or ``check()``, which wait for the device). After
a fault the context refuses every call (``ContextFailedError``): close it and build a
new one on every rank. An exception other than these escaping a call on one rank after
``_begin_call`` is reported to the group as an abort, so its peers stop at once. A check
of the call's arguments that the kernels make alike on every rank
(``primitives.record_check``, e.g. an expert-parallel capacity overflow) raises the op's
own error (``_check_error``) instead, and leaves the context usable.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import warnings
import zlib

import torch

from ..errors import (
    ContextClosedError,
    ContextFailedError,
    CrossRankError,
    InterlaceTypeError,
    InterlaceValueError,
)
from ..language.primitives import barrier_kernel, call_bump_kernel
from ..runtime import ErrorWord, Group, SignalPad, default_max_spins, graphs
from ..runtime.signals import (
    CALL_WORDS,
    CAUSE_CHECK,
    CAUSE_MISMATCH,
    MAX_CALL_FIELDS,
    field_value,
    hash_text,
)
from ..runtime.streams import stream_write_value32
from ..runtime.symmetric import check_group
from . import _trace
from ._launch import PreparedLaunch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


def persistent_grid(
    group: Group, n_items: int, per_sm: int = 4, cpu_programs: int = 4
) -> tuple[int]:
    """Programs for a persistent kernel: enough to fill the GPU, never more than the work."""
    if group.backend == "cuda":
        limit = sm_count(group.device.index) * per_sm
    else:
        limit = cpu_programs  # the interpreter runs programs one after another
    return (max(1, min(n_items, limit)),)


@dataclasses.dataclass(slots=True)
class Armed:
    """A call kind whose later calls replay its graph directly (``OpContext._arm``): the
    graph, the buffer set it was captured for (None: the context has none), the call
    kind of ``_begin_call`` and its fingerprint base and field names; ``note``: what the
    op keeps for its replayed calls (e.g. the strategy that ran)."""

    graph: object
    set: int | None
    kind: tuple
    base: int
    names: tuple
    note: object = None


def replay_key(name, operands) -> tuple:
    """``(key, ptrs)`` of an eager call for ``OpContext._armed``: ``name`` (the call and
    any fields of its own) with each operand's dtype, shape, strides, device index and
    address modulo 16 (what Triton specialises on, and any coarser alignment an op's
    checks ask for), and the operands' addresses (``data_ptr()``, read once for the
    replay). ``(None, None)`` where an operand is not a tensor (the call goes the whole way
    and raises its own error)."""
    key, ptrs = [name], []
    try:
        for t in operands:  # (one loop: this is most of a replayed call's Python)
            p = t.data_ptr()
            ptrs.append(p)
            key.append((t.dtype, t.shape, t.stride(), t.get_device(), p & 15))
    except (AttributeError, TypeError):
        return None, None
    return tuple(key), tuple(ptrs)


#: Buffer / flag sets of an :class:`AlternatingSets` context: two for eager calls, one
#: for calls captured in a CUDA graph.
BUFFER_SETS = 3
GRAPH_SET = 2


class AlternatingSets:
    """Mixed into a context whose copy-engine transfers write into its peers' buffers: the
    buffer set each call uses. Consecutive eager calls alternate between two sets, so they
    need no device barrier: a rank writes a peer's set ``s`` again only two calls later,
    after that peer's call in between has consumed this rank's data, which it does after
    its own use of set ``s`` in stream order (flags are reset by whoever consumes them). A
    call captured in a CUDA graph cannot alternate (each replay repeats it): it uses a
    third set, behind a device barrier."""

    _next_set = 0

    def _buffer_set(self) -> int:
        """The set this call uses: eager calls alternate 0 and 1; a call being captured in
        a CUDA graph uses :data:`GRAPH_SET` and must run a device barrier first."""
        if self._capturing():
            return GRAPH_SET
        s = self._next_set
        self._next_set = 1 - s
        return s


def _checks_group_first(init):
    """Wrap a context's ``__init__`` so that its ``group`` argument is checked before
    anything else touches it (every public constructor raises InterlaceTypeError)."""

    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        group = args[0] if args else kwargs.get("group")
        check_group(type(self).op_name, group)
        return init(self, *args, **kwargs)

    wrapped._checks_group = True
    return wrapped


def _reports_aborts(call):
    """Wrap a context's call (``__call__`` and the names in ``CALLS``): an exception that
    escapes it on this rank after the call has begun on the device (``_begin_call``) is
    reported to the group, so that its peers' waits stop at once instead of running out of
    time. Where a cross-rank fault is already recorded for the call (ranks that called with
    different arguments: the host code of the mismatched call may fail on its own first),
    that fault is raised instead, from the exception, so that every rank names the same
    cause."""

    @functools.wraps(call)
    def wrapped(self, *args, **kwargs):
        try:
            return call(self, *args, **kwargs)
        except CrossRankError:
            raise
        except BaseException as exc:
            # (a call being captured in a CUDA graph ran nothing: nothing to report, and
            # no device sync is allowed)
            if self.error.in_call and not self._capture:
                recorded = self._recorded_fault()
                if recorded is not None:
                    self._failed = recorded
                    raise recorded from exc
                self.error.report()
                self._failed = self._failed or ContextFailedError(
                    self.op_name, RuntimeError("this rank aborted a call")
                )
            raise
        finally:
            self.error.in_call = False

    wrapped._reports_aborts = True
    return wrapped


class OpContext:
    """Base of the op contexts: owns a signal pad with a ``barrier`` region plus the
    op's own regions, and an error word that bounded waits report faults into (attached
    to the pad's group fault word and call slot, ``runtime.signals``)."""

    op_name = "op"
    _failed: BaseException | None = None  # (class defaults: for contexts that build
    _call_seq = 0  # their own state instead of calling OpContext.__init__)

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, "_checks_group", False):
            cls.__init__ = _checks_group_first(init)
        for name in ("__call__", *cls.__dict__.get("CALLS", ())):
            call = cls.__dict__.get(name)
            if call is not None and not getattr(call, "_reports_aborts", False):
                setattr(cls, name, _reports_aborts(call))

    def __init__(
        self, group: Group, dtype: torch.dtype, max_numel: int, regions: dict[str, int],
        max_spins=None,
    ):  # fmt: skip
        check_group(self.op_name, group)
        if dtype not in SUPPORTED_DTYPES:
            raise InterlaceTypeError(
                f"{self.op_name}: dtype must be one of {SUPPORTED_DTYPES}, got {dtype}"
            )
        if int(max_numel) <= 0:
            raise InterlaceValueError(
                f"{self.op_name}: max_numel must be positive, got {max_numel}"
            )
        self.group, self.dtype, self.max_numel = group, dtype, int(max_numel)
        self.world_size, self.rank = group.world_size, group.rank
        self.max_spins = int(max_spins) if max_spins is not None else default_max_spins(group)
        self.pad = SignalPad(group, {"barrier": group.world_size, **regions})
        self.error = ErrorWord(group)
        self.error.attach(self.pad, self.op_name)
        self._closed = False
        self._failed: BaseException | None = None
        self._buffers = []
        self._barriers: dict = {}  # (clear_first, clear_count) -> its prepared launch
        self._init_calls()

    # ------------------------------------------------------------------ life cycle
    def close(self) -> None:
        """Free the context's symmetric buffers and signals (collective: call on every
        rank). Idempotent; any call after it raises ContextClosedError."""
        if self._closed:
            return
        if self.group.backend == "cuda":
            torch.cuda.synchronize(self.group.device)  # every wait is bounded in time
        self._closed = True
        for buf in self._buffers:
            buf.close()
        self.error.detach()
        self.pad.close()
        self._buffers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check(self) -> None:
        """Wait for the device, then raise if a call of this context failed on any rank
        (the same error on every rank), or if the context was closed or failed before."""
        self._refuse_if_unusable()
        if self.group.backend == "cuda":
            torch.cuda.synchronize(self.group.device)
        self._raise_recorded_check()
        if self.error.fault_pending() or self.error.group_record() is not None:
            self._fail()

    def _recorded_fault(self) -> BaseException | None:
        """The cross-rank fault recorded for this context (by this rank's waits or in the
        group's fault word), after waiting for the device, or None. For the error path of
        a call; never raises."""
        try:
            if self.group.backend == "cuda":
                torch.cuda.synchronize(self.group.device)  # every wait is bounded in time
            if self.error.fault_pending() or self.error.group_record() is not None:
                return self.error.error(self.op_name, self.pad.describe)
        except Exception:  # noqa: BLE001 - the caller raises its own exception instead
            return None
        return None

    @property
    def failed(self) -> bool:
        """A call of this context failed across ranks: it refuses further calls."""
        return self._failed is not None

    def _refuse_if_unusable(self) -> None:
        if self._closed:
            raise ContextClosedError(
                f"{self.op_name}: the context was closed; build a new one to call it again"
            )
        if self._failed is not None:
            raise ContextFailedError(self.op_name, self._failed)

    def _check_error(self, rank: int, slot: int, seen: int) -> BaseException | None:
        """The op's own error for a device-side argument check its kernels recorded
        (``primitives.record_check``: ``rank`` and ``seen`` as the kernel gave them, at
        ``slot``), or None. Such a check is made alike on every rank, so every rank raises
        it and the context stays usable. Ops whose kernels record checks override this."""
        return None

    def _raise_recorded_check(self) -> None:
        """Raise the op's own error (``_check_error``) for a check recorded in this rank's
        error word, and clear the word; anything else is left to ``_fail``."""
        word = self.error
        if word._state.value == 0:  # the common case
            return
        _, rank, slot, seen, cause, _ = (int(v) for v in word.words[:6].tolist())
        if cause != CAUSE_CHECK:
            return
        exc = self._check_error(rank, slot, seen)
        if exc is not None:
            word.words[:6].zero_()
            raise exc

    def _fail(self):
        """Raise the recorded fault (and remember it: later calls are refused)."""
        err = self.error.error(self.op_name, self.pad.describe)
        self._failed = err
        self.error.in_call = False
        raise err

    def _begin(self) -> None:
        """Start of every call: refuse a closed or failed context, note a fault recorded
        since the last call (no device sync; ``_begin_call`` or ``_end`` raises it), and
        note whether this call is being captured in a CUDA graph."""
        self._refuse_if_unusable()
        self._fault_at_begin = False
        if self.error.fault_pending():
            self._raise_recorded_check()
            # raised by ``_begin_call``, once this call's field names are known, so that
            # a rank that had not begun this call names the peers' difference as they do
            self._fault_at_begin = True
        self._capture = self.group.backend == "cuda" and torch._C._cuda_isCurrentStreamCapturing()

    # ------------------------------------------------------------------ call fingerprints
    def _init_calls(self) -> None:
        self._call_seq = 0
        # fields -> (fingerprint base, values, staged copy, device count launch)
        self._call_kinds: dict = {}
        self._call_written = None  # the fields whose values the call slot holds
        self._pending_count = None  # a graphed call's device count launch (``_enqueue``)
        slot = self.pad.local("call")
        if self.group.backend == "cpu":
            self._call_host = (ctypes.c_int32 * CALL_WORDS).from_address(slot.data_ptr())
        else:
            self._call_slot = slot.view(torch.uint32)
        for name in getattr(self, "STRATEGIES", ()):
            hash_text(name)  # so a peer's strategy reads back as its name

    def _begin_call(self, *, graphed: bool = False, **fields) -> int:
        """Mark the start of a call's device work and fingerprint it: ``fields`` are the
        call's arguments that its peers depend on (shapes, strategy, buffer set; ints or
        strings; at most 14). Writes the fingerprint (and, when they changed, the field
        values) into this rank's ``call`` slot in stream order, before the call's kernels.
        Returns the fingerprint: ``(hash of op and fields) << 8 | call count mod 256``,
        positive and non-zero, so that ranks whose arguments or call counts differ
        disagree on it.

        Where eager calls replay CUDA graphs (``eager_graphs``) the call count is kept on
        the device: a one-program kernel (``call_bump_kernel``) writes the fingerprint
        from the last one, so every path of a call (eager, captured, replayed) advances
        it alike on every rank. ``graphed``: the call's next device work is
        :meth:`_enqueue`, which puts that kernel first in the graph it replays (the host
        writes nothing per call) or launches it before an eager run."""
        self._pending_count = self._launched = None
        key = tuple(fields.items())
        kind = self._call_kinds.get(key)
        if kind is None:
            kind = self._call_kinds[key] = self._new_call_kind(key)
        base, values, staged, count = kind
        self._kind_now = kind
        self._call_seq += 1
        self.call_flag = base
        fp = base << 8 | (self._call_seq & 0xFF)
        # the field values are written when the call's kind differs from the last one
        # written (``kind``: the one stored object per kind, compared by identity)
        if self.group.backend == "cpu":
            if self._call_written is not kind:
                self._call_host[1 : 1 + len(values)] = values
                self._call_written = kind
            self._call_host[0] = fp
        else:
            if self._call_written is not kind or self._capture:
                self._call_slot[1 : 1 + len(values)].copy_(staged, non_blocking=True)
                # a captured write replays only inside its graph
                self._call_written = None if self._capture else kind
            if count is None:
                stream_write_value32(self._call_slot, 0, fp)
            elif graphed and not self._capture and not _trace.ACTIVE:
                self._pending_count = count
            else:
                count()
        self.pad.call_names = tuple(fields)
        if self._fault_at_begin:
            self._fault_at_begin = False
            self._fail()
        self.error.in_call = True
        return fp

    def _new_call_kind(self, key: tuple) -> tuple:
        """``(base, values, staged, count)`` of a new call kind (``_begin_call``): the
        fingerprint's op-and-fields part, the field values (with their pinned copy on a
        GPU) and, where the count is kept on the device, its prepared launch."""
        if len(key) > MAX_CALL_FIELDS:
            raise InterlaceValueError(
                f"{self.op_name}: a call fingerprint takes at most {MAX_CALL_FIELDS} fields"
            )
        values = [len(key)] + [field_value(v) for _, v in key]
        base = zlib.crc32(repr((self.op_name, key)).encode()) & 0x7FFFFF or 1
        staged = count = None
        if self.group.backend == "cuda":
            staged = torch.tensor(values, dtype=torch.int32).pin_memory().view(torch.uint32)
            if self.eager_graphs:
                slot = self._call_slot.view(torch.int32)
                count = PreparedLaunch(call_bump_kernel, 1, (slot, base), {}, ())
                count.compile()
        return base, values, staged, count

    def _flush_count(self) -> None:
        """Launch a graphed call's pending device count now (device work of the call that
        reads its fingerprint comes before :meth:`_enqueue`)."""
        count, self._pending_count = self._pending_count, None
        if count is not None:
            count()

    _capture = False
    _fault_at_begin = False
    _pending_count = None
    _launched = None  # (graph, buffer set) this call replayed, for ``_arm``
    _kind_now = None  # this call's kind (``_begin_call``)
    _replays = None
    _next_set = None
    _stream_capturing = staticmethod(lambda: False)  # (no CUDA: nothing is captured)
    eager_graphs = False
    #: The value this call's copies raise their peers' flags to, where the consumer checks
    #: it (``primitives.call_flag``): the fingerprint's op-and-arguments part, the same
    #: for every call of one kind, so that a graph replaying the call writes it right.
    call_flag = 1

    def _capturing(self) -> bool:
        """This call is being captured in a CUDA graph (as noted by ``_begin``)."""
        return self._capture

    def _end(self) -> None:
        """End of every call: on the ``cpu`` backend everything already ran, so a fault
        any rank recorded raises now, on every rank. On ``cuda`` it raises at the next
        call or ``check()``."""
        self.error.in_call = False
        self._flush_count()  # (a graphed call that ran no ``_enqueue``)
        if self._fault_at_begin:  # a call that had no device work to fingerprint
            self._fault_at_begin = False
            self._fail()
        if self.group.backend == "cpu":
            self._raise_pending()

    def _raise_pending(self) -> None:
        """Where the host has seen this call's device work run (the ``cpu`` backend,
        host-synchronous transfers): raise a fault recorded since the call began, except a
        mismatch between later calls of peers that ran ahead (:meth:`_later_mismatch`),
        which this rank raises at its next call, the one in which those peers raise it."""
        if self.error.fault_pending():
            self._raise_recorded_check()
            if not self._later_mismatch():
                self._fail()

    def _later_mismatch(self) -> bool:
        """The group's fault is a call mismatch this rank's current call is not part of:
        its own waits all completed, and neither fingerprint the failed barrier compared
        (the record's ``seen`` and ``expected``) is this call's. Peers that finished this
        call and went on to the next one found it there."""
        host = getattr(self, "_call_host", None)
        if host is None or self.error._state.value != 0:
            return False
        record = self.error.group_record()
        if record is None or record[2] != CAUSE_MISMATCH:
            return False
        return host[0] not in (record[4], record[5])

    def _init_eager_graphs(self, eager_graphs: bool | None, collectives: bool = False) -> None:
        """``eager_graphs``: replay eager calls from CUDA graphs (:meth:`_enqueue`). None
        (the default): wherever the driver has the graph-update calls; True: raise where
        it has not; False: never. On the CPU backend there are no graphs and calls run as
        they are. ``collectives``: the calls run the process group's collectives, which a
        CUDA graph captures only on NCCL, not on the gloo group of ranks that share a GPU
        (``Group.shared_device``)."""
        cuda = self.group.backend == "cuda"
        capturable = not (collectives and self.group.shared_device)  # (a gloo group)
        if eager_graphs is None:
            eager_graphs = cuda and graphs.available() and capturable
        elif eager_graphs and cuda and not graphs.available():
            raise InterlaceValueError(
                f"{self.op_name}: eager_graphs needs a CUDA driver with the graph-update "
                "calls (CUDA 12.4 or later)"
            )
        elif eager_graphs and cuda and not capturable:
            raise InterlaceValueError(
                f"{self.op_name}: eager_graphs needs an NCCL process group (a CUDA graph "
                "cannot capture this group's collectives)"
            )
        self.eager_graphs = bool(eager_graphs) and cuda
        self._graphs: dict = {}  # call kind -> EagerGraph, or the reason it cannot be one
        self._replays = {} if self.eager_graphs else None  # replay_key -> Armed
        if cuda:  # (bound once: ``_armed`` asks it on every call)
            self._stream_capturing = torch._C._cuda_isCurrentStreamCapturing

    def _enqueue(self, strategy: str, run, *operands) -> None:
        """Enqueue this call's device work, ``run()``. With ``eager_graphs`` (an eager call
        on a GPU) the first call of each kind (strategy, buffer set, operand shapes and
        16-byte alignments) runs
        ``run()`` itself (it compiles, builds plans and runs their one-time waits); the
        second captures it into a CUDA graph (:class:`~interlace.runtime.graphs.EagerGraph`)
        and every call of that kind then replays the graph with its own ``operands``: one
        launch from the host instead of every kernel, copy and signal write. The device
        work is the same, so ranks need not agree on it."""
        count, self._pending_count = self._pending_count, None
        self._launched = None
        if not self.eager_graphs or self._capturing() or _trace.ACTIVE:  # (traced: eager)
            self._eager(count, run)
            return
        s = getattr(self, "_next_set", None)  # the buffer set this call will use
        # Triton specialises a kernel on its pointers' 16-byte alignment: a replay with an
        # operand aligned otherwise than the captured one would run the wrong kernel
        # (and on its dtype: the graph's kernels were compiled for the captured one)
        ptrs = tuple([None if t is None else t.data_ptr() for t in operands])
        kinds = [None if t is None else (t.shape, t.dtype, p % 16 == 0)
                 for t, p in zip(operands, ptrs)]  # fmt: skip
        key = (strategy, s, count, *kinds)
        graph = self._graphs.get(key)
        if graph is None:
            self._graphs[key] = "seen"  # the first call of this kind runs eagerly
            self._eager(count, run)
            return
        if isinstance(graph, str):
            if graph != "seen":  # this kind cannot be replayed (why: ``graph``)
                self._eager(count, run)
                return
            body = run if count is None else lambda: self._eager(count, run)
            try:
                graph = graphs.EagerGraph(body, operands)  # runs body's host code only
            except graphs.GraphUnsupported as e:
                self._graphs[key] = str(e)
                if s is not None:
                    self._next_set = s  # the capture advanced it; the eager call will
                warnings.warn(f"{self.op_name}: {e}; these calls run eagerly", stacklevel=3)
                self._eager(count, run)
                return
            graph.next_set = getattr(self, "_next_set", None)
            self._graphs[key] = graph
        graph.launch(operands, ptrs)
        if s is not None:
            self._next_set = graph.next_set  # as run() would have left it
        if count is not None:  # (the graph advances the call count itself: replayable)
            self._launched = (graph, s)

    # ------------------------------------------------------------------ replayed calls
    def _armed(self, key) -> Armed | None:
        """The short path of an eager call (``key`` from :func:`replay_key`): the graph a
        call with an equal key replayed after going the whole way (:meth:`_arm`), where
        this call may replay it at once with :meth:`_replay`, skipping the argument checks,
        the fingerprint's and the graph's lookups: ``key`` holds everything those read
        (each operand's dtype, shape, strides, device and address modulo 16, the op's own
        fields), so a call with an equal key passes them as the armed one did. None where
        the call must go the whole way: no such key, the context closed or failed, a fault
        pending, a CUDA graph being captured, a trace being recorded, the call slot holding
        another kind's fields, or another buffer set due."""
        replays = self._replays
        armed = replays.get(key) if replays else None
        if (
            armed is None
            or armed.kind is not self._call_written
            or armed.set != self._next_set
            or self._closed
            or self._failed is not None
            or _trace.ACTIVE
            or self.error.fault_pending()
            or self._stream_capturing()
        ):
            return None
        return armed

    def _replay(self, armed: Armed, operands, ptrs) -> None:
        """Replay ``armed``'s graph with ``operands`` (``ptrs``: their addresses), with
        the bookkeeping ``_begin`` .. ``_end`` do for a graph-replayed call: the call
        count (the graph advances the device's), the fingerprint's fields, the buffer set."""
        self._capture = False
        self._call_seq += 1
        self.call_flag = armed.base
        self.pad.call_names = armed.names
        self.error.in_call = True
        armed.graph.launch(operands, ptrs)
        if armed.set is not None:
            self._next_set = armed.graph.next_set
        self.error.in_call = False

    def _replayed_out(self, name, inputs: tuple, out, make):
        """The short path (:meth:`_armed`) of a call whose graph's operands are ``inputs``
        and then its output: ``(key, result)``. ``out`` where given is in the key (its
        dtype, shape, strides, device and alignment: all its checks read); else the result
        is ``make(armed)``, a fresh tensor. ``result`` None where the call must go the
        whole way (then arming ``key``)."""
        key, ptrs = replay_key(name, inputs if out is None else (*inputs, out))
        armed = self._armed(key)
        if armed is None:
            return key, None
        if out is None:
            out = make(armed)
            ptrs = (*ptrs, out.data_ptr())
        self._replay(armed, (*inputs, out), ptrs)
        return key, out

    def _arm(self, key, note=None) -> None:
        """After a call that went the whole way: where it replayed its kind's graph (with
        the call count in it), later calls with an equal ``key`` may replay it directly
        (:meth:`_armed`; ``note``: kept for them as ``Armed.note``). ``key`` None (an
        operand that is not a tensor) arms nothing."""
        launched, self._launched = self._launched, None
        if launched is not None and key is not None and self._replays is not None:
            graph, s = launched
            self._replays[key] = Armed(
                graph, s, self._kind_now, self.call_flag, self.pad.call_names, note
            )

    @staticmethod
    def _eager(count, run) -> None:
        """The call's device count (where ``_begin_call`` left it to ``_enqueue``), then
        ``run()``."""
        if count is not None:
            count()
        run()

    # ------------------------------------------------------------------ device helpers
    def _barrier(self, clear_first: int = 0, clear_count: int = 0) -> None:
        """Device-side barrier over the group on the current stream; optionally zeroes
        ``clear_count`` local signal slots from ``clear_first`` before arriving."""
        self._flush_count()  # (the barrier carries the call's fingerprint)
        self._barrier_launch(clear_first, clear_count)()

    def _barrier_launch(self, clear_first: int = 0, clear_count: int = 0) -> PreparedLaunch:
        """The barrier's prepared launch (compiled when first asked for)."""
        key = (clear_first, clear_count)
        run = self._barriers.get(key)
        if run is None:
            args = (
                self.pad.ptrs, self.pad.offset("barrier"), self.rank, self.world_size,
                self.error.address, self.max_spins, clear_first, clear_count,
            )  # fmt: skip
            run = self._barriers[key] = PreparedLaunch(barrier_kernel, 1, args, {}, ())
            if self.group.backend == "cuda":
                run.compile()
        return run

    def input_buffer(self, shape) -> torch.Tensor:
        """A tensor of ``shape`` that a call reads without copying: for methods that stage
        their input in symmetric memory it is the staging buffer itself, so a producer
        that writes its output there saves the staging copy. Write it, then pass it as the
        input; it may be written again once the call has returned (in stream order)."""
        staging = getattr(self, "staging", None)
        if staging is None:
            return torch.empty(shape, dtype=self.dtype, device=self.group.device)
        numel = math.prod(shape)
        if numel > staging.numel:
            raise InterlaceValueError(
                f"{self.op_name}: input_buffer of {numel} elements exceeds the staging "
                f"capacity of {staging.numel}"
            )
        return staging.local[:numel].view(shape)

    def _stage(self, x: torch.Tensor) -> None:
        """Copy ``x`` into the staging buffer unless it already is the staging buffer."""
        stage = self.staging.local
        if x.data_ptr() != stage.data_ptr():
            stage[: x.numel()].copy_(x.reshape(-1))

    def _track(self, buf):
        self._buffers.append(buf)
        return buf

    # ------------------------------------------------------------------ argument checks
    def _check_placed(self, name: str, t) -> None:
        """``t`` is a tensor of the context's dtype on the group's device."""
        if not isinstance(t, torch.Tensor):
            raise InterlaceTypeError(
                f"{self.op_name}: {name} must be a torch.Tensor, got {type(t).__name__}"
            )
        if t.dtype != self.dtype:
            raise InterlaceTypeError(
                f"{self.op_name}: {name} has dtype {t.dtype}, "
                f"the context was built for {self.dtype}"
            )
        if t.device != self.group.device:
            raise InterlaceValueError(
                f"{self.op_name}: {name} is on {t.device}, expected {self.group.device}"
            )

    def _check_tensor(self, name: str, t, *, max_numel: int | None = None, numel_multiple: int = 1):
        self._check_placed(name, t)
        if not t.is_contiguous():
            raise InterlaceValueError(f"{self.op_name}: {name} must be contiguous")
        if t.dim() == 0:
            raise InterlaceValueError(f"{self.op_name}: {name} must have at least one dimension")
        if max_numel is not None and t.numel() > max_numel:
            raise InterlaceValueError(
                f"{self.op_name}: {name} has {t.numel()} elements, more than the context's "
                f"capacity of {max_numel}"
            )
        if t.shape[0] % numel_multiple:
            raise InterlaceValueError(
                f"{self.op_name}: {name}.shape[0] = {t.shape[0]} is not divisible by the "
                f"world size {numel_multiple}"
            )

    def _check_out(self, out, shape) -> torch.Tensor | None:
        if out is None:
            return None
        self._check_tensor("out", out)
        if tuple(out.shape) != tuple(shape):
            raise InterlaceValueError(
                f"{self.op_name}: out has shape {tuple(out.shape)}, expected {tuple(shape)}"
            )
        return out


# --------------------------------------------------------------------- contexts kept by callers
def grown_capacity(need: int, multiple: int = 1) -> int:
    """The capacity a context is built for when a call needs ``need``: the next power of two
    at or above it, rounded up to ``multiple``, so that a few growing calls do not each
    rebuild it."""
    cap = next_pow2(need)
    return -(-cap // multiple) * multiple


class ContextSet:
    """Several op contexts used as one (e.g. the two halves of a MoE layer): ``failed``,
    ``check()`` and ``close()`` cover them all."""

    def __init__(self, *contexts):
        self.contexts = contexts

    @property
    def failed(self) -> bool:
        return any(c.failed for c in self.contexts)

    def check(self) -> None:
        for c in self.contexts:
            c.check()

    def close(self) -> None:
        for c in self.contexts:
            c.close()


class KeptContext:
    """An op context (or :class:`ContextSet`) that a layer builds on its first call and
    keeps: ``get(need, dtype)`` returns it, rebuilt by ``build(capacity, dtype)`` when a call
    needs more than its capacity (at least twice as large), another dtype, or after a
    failed call (a context that saw a fault refuses every later call). Every rank reaches
    the same decision when every rank calls with the same sizes."""

    def __init__(self, build):
        self._build = build
        self.current = None
        self.capacity = 0
        self.dtype = None

    def get(self, need: int, dtype: torch.dtype):
        cur = self.current
        usable = cur is not None and not cur.failed and self.dtype == dtype
        if usable and self.capacity >= need:
            return cur
        cap = grown_capacity(need)
        if usable:
            cap = max(cap, 2 * self.capacity)
        self.close()
        self.current = self._build(cap, dtype)
        self.capacity, self.dtype = cap, dtype
        return self.current

    def close(self) -> None:
        """Close the kept context (collective: every rank); the next ``get`` builds anew."""
        if self.current is not None:
            cur, self.current = self.current, None
            cur.close()
