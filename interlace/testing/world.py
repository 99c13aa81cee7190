"""Run test bodies on W ranks: spawned processes, started once, reused for many bodies.

``World(4)`` starts four rank processes. On a machine without GPUs (or with
``backend="cpu"``) they use gloo and the CPU emulation (``TRITON_INTERPRET=1``, symmetric
buffers in /dev/shm); with ``backend="cuda"`` each rank owns one GPU and uses NCCL.
``World(4, "cuda", share_device=True)`` puts every rank on GPU 0 (gloo for the host
collectives): the ranks' kernels then time-slice one GPU, so it checks the cross-rank
protocol (signals, copies, waits) where a machine has one GPU, never speed.
``world.run(fn, *args)`` calls ``fn(group, *args)`` on every rank and returns the per-rank
results; a rank's exception is re-raised here with that rank's traceback. Each run has a
time limit; a world whose ranks did not all answer, or in which a body failed on some rank,
is torn down (and restarted by the next ``run``). While a body runs, each rank rewrites its
Python stack a little more often than the time it could be given (:class:`_StackWriter`),
so the error shows where each rank that did not answer last was. ``close()`` removes every
/dev/shm file the world made, also after failures.
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import queue
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from contextlib import contextmanager

from ..errors import InterlaceError, InterlaceValueError

#: After one rank fails, how long the others get to finish before the world is torn down.
ERROR_GRACE_S = 20.0
#: A rank running a body writes its stack every ``min(time limit, ERROR_GRACE_S)`` less
#: this, so that a rank that does not answer has written it at most that long ago.
STACK_MARGIN_S = 3.0


class WorldError(InterlaceError):
    """A test body failed (or timed out) on one or more ranks."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stack_file(prefix: str, rank: int | str) -> str:
    """Where rank ``rank`` of the world named ``prefix`` writes its stack (see ``run``)."""
    return os.path.join(tempfile.gettempdir(), f"{prefix}-stack-r{rank}.txt")


class _StackWriter:
    """While a body runs: a daemon thread that rewrites ``file`` with the calling thread's
    Python stack every ``period`` s, most recent call first (``File "...", line N in
    name``). It reads the stack through ``sys._current_frames()`` with the GIL held, so it
    never sees a frame being torn down (``faulthandler``'s watchdog reads them without the
    GIL and crashed ranks of long CPU-emulation bodies). A body stuck in C code that holds
    the GIL leaves the stack of the period before."""

    def __init__(self, file, period: float):
        self.file, self.period = file, period
        self.target = threading.get_ident()
        self.start = time.monotonic()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="stack-writer", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.wait(self.period):
            frame = sys._current_frames().get(self.target)
            lines = [f"Stack after {time.monotonic() - self.start:.1f} s of the body "
                     "(most recent call first):"]  # fmt: skip
            while frame is not None:
                code = frame.f_code
                where = f'File "{code.co_filename}", line {frame.f_lineno}'
                lines.append(f"  {where} in {code.co_name}")
                frame = frame.f_back
            self.file.seek(0)
            self.file.truncate()
            self.file.write("\n".join(lines) + "\n")
            self.file.flush()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def _worker(
    rank: int, world_size: int, backend: str, port: int, inbox, outbox, share_device: bool
) -> None:
    """Rank process: set up torch.distributed and a Group, then serve test bodies."""
    import torch
    import torch.distributed as dist

    try:  # (without it, a hung body is reported without its stack)
        stacks = open(_stack_file(os.environ["INTERLACE_SHM_PREFIX"], rank), "w")  # noqa: SIM115
    except OSError:
        stacks = None

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        init = dict(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        if backend == "cuda" and not share_device:
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", device_id=torch.device("cuda", rank), **init)
        else:  # the CPU emulation, or ranks sharing GPU 0 (NCCL refuses two on one GPU)
            if share_device:
                torch.cuda.set_device(0)
            else:
                torch.set_num_threads(1)
            dist.init_process_group("gloo", **init)
        from ..runtime.group import Group

        group = Group(backend=backend)
        if share_device:
            _warm_comm_path(group)
        outbox.put((rank, "ready", None))
    except BaseException:  # noqa: BLE001 - report any start-up failure to the parent
        outbox.put((rank, "error", traceback.format_exc()))
        return
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, kwargs, period = job
        # this thread's stack, rewritten every ``period`` s of the body
        writer = None
        if stacks is not None:
            stacks.seek(0)
            stacks.truncate()
            writer = _StackWriter(stacks, period)
        try:
            try:
                result = fn(group, *args, **kwargs)
            finally:
                if writer is not None:
                    writer.close()
            outbox.put((rank, "ok", result))
        except BaseException:  # noqa: BLE001 - the parent re-raises it with the traceback
            text = traceback.format_exc()
            # This rank gives up on the body: its peers' waits in any of its contexts
            # stop at once (an abort in the group's fault word), not at their time bound.
            from ..runtime.signals import abort_open_calls

            try:
                abort_open_calls(every=True)
            except Exception:  # noqa: BLE001 - the body's error is the one to report
                pass
            outbox.put((rank, "error", text))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at shutdown
        pass


def _warm_comm_path(group) -> None:
    """One copy and stream write on the comm stream before any test kernel runs. (Ranks on
    one GPU: a cold world's first fused AG+GEMM call timed out, each rank's first copy
    waiting behind kernels that spun for it; benchmarks/NOTES.md, "The GPU suite with ranks
    sharing one GPU".)"""
    import torch

    from ..runtime import comm_stream
    from ..runtime.streams import copy_and_signal

    src = torch.zeros(1 << 16, device=group.device)
    flag = torch.zeros(1, dtype=torch.int32, device=group.device)
    copy_and_signal(torch.empty_like(src), src, flag.view(torch.uint32), stream=comm_stream(group))
    torch.cuda.synchronize(group.device)


@contextmanager
def _child_env(extra: dict[str, str]):
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class World:
    """W rank processes that run test bodies; see the module docstring."""

    def __init__(
        self,
        world_size: int,
        backend: str = "auto",
        timeout: float = 300.0,
        share_device: bool = False,
    ):
        if backend == "auto":
            import torch

            backend = "cuda" if torch.cuda.device_count() >= world_size else "cpu"
        if share_device and backend != "cuda":
            raise InterlaceValueError("share_device=True needs backend='cuda'")
        self.world_size, self.backend, self.timeout = world_size, backend, timeout
        self.share_device = share_device
        self.shm_prefix = f"interlace-test-{uuid.uuid4().hex[:10]}"
        self._procs: list = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        self._outbox = ctx.Queue()
        env = {"INTERLACE_SHM_PREFIX": self.shm_prefix, "PYTHONUNBUFFERED": "1"}
        env["TRITON_INTERPRET"] = "1" if self.backend == "cpu" else "0"
        with _child_env(env):
            self._procs = [
                ctx.Process(
                    target=_worker,
                    args=(
                        r,
                        self.world_size,
                        self.backend,
                        port,
                        self._inboxes[r],
                        self._outbox,
                        self.share_device,
                    ),  # fmt: skip
                    daemon=True,
                )
                for r in range(self.world_size)
            ]
            for p in self._procs:
                p.start()
        replies = self._collect("start-up", self.timeout)
        self._raise_errors("start-up", replies)

    def _collect(self, what: str, timeout: float) -> dict[int, tuple[str, object]]:

        deadline = time.monotonic() + timeout
        replies: dict[int, tuple[str, object]] = {}
        while len(replies) < self.world_size:
            left = deadline - time.monotonic()
            try:
                rank, status, payload = self._outbox.get(timeout=min(max(left, 0.01), 1.0))
            except queue.Empty:
                if left <= 0 or not all(p.is_alive() for p in self._procs):
                    break
                continue
            replies[rank] = (status, payload)
            if status == "error":
                if what == "start-up":
                    break
                # The other ranks may now wait forever on the failed one (in a collective
                # or a device wait): give them a short grace, then tear the world down.
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        if len(replies) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(replies))
            errors = {r: v for r, v in replies.items() if v[0] == "error"}
            stacks = self._stacks(missing)
            alive = [r for r in missing if self._procs[r].is_alive()]
            why = [f"rank {r} exited with code {self._procs[r].exitcode}"
                   for r in missing if r not in alive]  # fmt: skip
            if alive:
                why.append(f"ranks {alive} within {timeout:.0f} s (hung)")
            self.close()
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, (_, tb) in sorted(errors.items()))
            detail += "".join(
                f"\n--- rank {r}, where it was (Python stack) ---\n{text}"
                for r, text in sorted(stacks.items())
            )  # fmt: skip
            raise WorldError(f"{what}: ranks {missing} did not answer: {'; '.join(why)}{detail}")
        return replies

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """The last stack each of ``ranks`` wrote (see :data:`STACK_MARGIN_S`)."""
        out: dict[int, str] = {}
        for r in ranks:
            try:
                with open(_stack_file(self.shm_prefix, r)) as f:
                    text = f.read()
            except OSError:
                continue
            if text.strip():
                out[r] = text
        return out

    @staticmethod
    def _raise_errors(what: str, replies) -> None:
        errors = {r: tb for r, (status, tb) in replies.items() if status == "error"}
        if errors:
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise WorldError(f"{what} failed on ranks {sorted(errors)}:{detail}")

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        """Call ``fn(group, *args, **kwargs)`` on every rank; return the results by rank.

        A body that fails on any rank ends the world (the next ``run`` starts fresh ranks):
        the failing rank aborted its open contexts, and contexts kept between bodies (the
        op library's cache) would otherwise fail the next, unrelated body."""
        if not self._procs:
            self._start()
        timeout = timeout or self.timeout
        period = max(min(timeout, ERROR_GRACE_S) - STACK_MARGIN_S, 0.5)
        for box in self._inboxes:
            box.put((fn, args, kwargs, period))
        what = getattr(fn, "__name__", "test body")
        replies = self._collect(what, timeout)
        if any(status == "error" for status, _ in replies.values()):
            self.close()
        self._raise_errors(what, replies)
        return [replies[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the rank processes and remove every /dev/shm file this world made."""
        for box in getattr(self, "_inboxes", []):
            try:
                box.put(None)
            except Exception:  # noqa: BLE001 - the queue may be broken after a crash
                pass
        for p in self._procs:
            if p.pid is None:
                continue
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
        leftovers = glob.glob(f"/dev/shm/{self.shm_prefix}-*")
        leftovers += glob.glob(_stack_file(self.shm_prefix, "*"))
        for path in leftovers:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_world(fn, world_size: int, *args, backend: str = "auto", timeout: float = 300.0, **kwargs):
    """Start a world, run one body on it, tear it down: for one-off scripts."""
    with World(world_size, backend, timeout) as world:
        return world.run(fn, *args, **kwargs)
