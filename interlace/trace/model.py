"""A recorded trace as spans and instants on tracks, every rank on rank 0's clock; decoding
of the kernels' event buffers; Chrome / Perfetto export.

Tracks per rank (Chrome ``tid``): one per program of the traced kernels (``program p``:
its launches' programs ``p`` in time order; a 2-D grid's programs numbered column by
column), one per stream that ran traced transfers, and ``exposed communication``
(computed, see ``summary``). Span categories: ``program`` (a program's whole run),
``compute`` (a tile: from the program's previous event to the tile's main-loop end),
``wait`` (a wait on a chunk, the entry barrier, the final waits), ``copy`` and
``chunk_wait`` (stream work), ``exposed``; instants: ``notify`` (a program released a
counter), ``signal`` (a stream wrote a peer's flag, at its copy's end). The grouped GEMM
(``wait tokens of rank q``, then its tile; reduce mode: its tiles, then ``notify every
rank``), ``MoERS``'s finish (``wait contributions of every rank``, then its tiles), the
attention forward and dQ (per query block and K/V chunk: ``wait chunk of rank q``, then
``block b chunk q``), dK/dV (``wait chunk of rank q``, ``dK/dV block j chunk q``, ``push
dK/dV to rank q``: a ``copy`` span, then ``notify rank q``) and its reduction (``wait
partials of rank q``, then ``add rank q``), the ``signal_reorder`` GEMM (``tile g``, then
``notify group i``: its wave group's counter, which the comm stream's ``wait group i``
waits for before the group's collective, a ``copy`` span), the split decode (``split s
(seq b, kv head h)``, ``combine (...)``, ``push (...)``: a ``copy`` span, the SM stores
into the merging ranks) and the decode merge (``wait partials of rank q``, then ``merge
rank q``) and the expert-parallel all-to-all (``wait data of rank q`` / ``wait slot of
rank q``, then ``push ...``: ``copy`` spans of SM stores into peers, or local ``expand`` /
``layout`` / ``sum`` work) and its low-latency mode (``push ...``, ``wait rows of rank
q`` / ``wait arrival of rank q``, ``receive rows ...`` / ``sum token t``) use the same
categories.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from ..kernels.gemm import (
    KIND_PUSH,
    KIND_REDUCE,
    KIND_STORE,
    KIND_STORE_OWN,
    SEG_KIND,
    SEG_OWNER,
    SEG_ROW0,
    SEG_ROWS,
    SEG_WAIT_COUNT,
)
from ..language.trace import HEADER, PER_TILE
from .spans import TID_EXPOSED, TID_STREAM, Instant, Span
from .summary import exposed_spans, summarize


@dataclass
class Trace:
    """The world's trace: spans and instants, track names, the clock alignment and what
    was traced (``meta``)."""

    world: int
    spans: list[Span]
    instants: list[Instant]
    tracks: dict[tuple[int, int], str]
    clock: dict
    label: str = ""
    meta: dict = field(default_factory=dict)

    @property
    def t_origin(self) -> int:
        times = [s.t0 for s in self.spans] + [i.t for i in self.instants]
        return min(times) if times else 0

    def of(self, rank: int, cat: str | None = None) -> list[Span]:
        return [s for s in self.spans if s.rank == rank and (cat is None or s.cat == cat)]

    # ------------------------------------------------------------------ export
    def to_chrome(self) -> dict:
        """Chrome trace-event JSON (``chrome://tracing``, https://ui.perfetto.dev): one
        process per rank, one thread per track; times in µs from the first event."""
        t0 = self.t_origin
        events = []
        for rank in range(self.world):
            events.append(dict(ph="M", name="process_name", pid=rank, tid=0,
                               args=dict(name=f"rank {rank}")))  # fmt: skip
            events.append(dict(ph="M", name="process_sort_index", pid=rank, tid=0,
                               args=dict(sort_index=rank)))  # fmt: skip
        for (rank, tid), name in sorted(self.tracks.items()):
            events.append(dict(ph="M", name="thread_name", pid=rank, tid=tid, args=dict(name=name)))
            events.append(dict(ph="M", name="thread_sort_index", pid=rank, tid=tid,
                               args=dict(sort_index=tid)))  # fmt: skip
        for s in sorted(self.spans, key=lambda s: (s.rank, s.tid, s.t0, -s.t1)):
            events.append(dict(
                ph="X", name=s.name, cat=s.cat, pid=s.rank, tid=s.tid,
                ts=round((s.t0 - t0) / 1e3, 3), dur=round(max(0, s.dur) / 1e3, 3), args=s.args,
            ))  # fmt: skip
        for i in self.instants:  # zero-length slices: shown on their track like the spans
            events.append(dict(
                ph="X", name=i.name, cat=i.cat, pid=i.rank, tid=i.tid,
                ts=round((i.t - t0) / 1e3, 3), dur=0.0, args=i.args,
            ))  # fmt: skip
        other = dict(self.meta, label=self.label, world=self.world, clock=self.clock)
        return dict(traceEvents=events, displayTimeUnit="ns", otherData=other)

    def save(self, prefix: str, png: bool = True, quiet: bool = False) -> dict[str, str]:
        """Write ``<prefix>.json`` (Chrome / Perfetto), ``<prefix>-summary.json`` and, with
        ``png`` and matplotlib installed, ``<prefix>.png``. Returns what was written (and
        ``png_skipped``: why no PNG)."""
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        out = {}
        with open(f"{prefix}.json", "w") as f:
            json.dump(self.to_chrome(), f, separators=(",", ":"))
        out["json"] = f"{prefix}.json"
        with open(f"{prefix}-summary.json", "w") as f:
            json.dump(summarize(self), f, indent=1)
            f.write("\n")
        out["summary"] = f"{prefix}-summary.json"
        if png:
            from .plot import plot

            try:
                plot(self, f"{prefix}.png")
                out["png"] = f"{prefix}.png"
            except ImportError as e:
                out["png_skipped"] = str(e)
                if not quiet:
                    print(f"trace: no PNG ({e})")
        return out

    def to_dict(self) -> dict:
        return dict(
            world=self.world, label=self.label, meta=self.meta, clock=self.clock,
            spans=[asdict(s) for s in self.spans], instants=[asdict(i) for i in self.instants],
            tracks=[[r, t, n] for (r, t), n in self.tracks.items()],
        )  # fmt: skip


# ---------------------------------------------------------------------- decoding
def _who(kind: int, owner: int, rank: int) -> str:
    """What a segment's wait waits for."""
    if kind == KIND_STORE.value:
        return f"rank {owner}'s chunk"
    if kind == KIND_REDUCE.value:
        return "peers' partials"
    if kind == KIND_PUSH.value:
        return "entry barrier (go)"
    return "own rows" if kind == KIND_STORE_OWN.value else "?"


def decode_launch(info: dict, rows: list, rank: int, shift: int, index: int):
    """Spans and instants of one traced launch (``rows``: its event buffer; ``shift``: ns
    to subtract to reach rank 0's clock), read as its layout (``ops._trace.LAYOUTS``)
    says: ``steps`` holds one block of programs per grid column."""
    if info.get("layout") == "steps":
        per = 1 + rows[0][0] * rows[0][1]
        spans, instants = [], []
        for col in range(info["columns"]):
            s, i = _decode_block(info, rows[col * per : (col + 1) * per], rank, shift, index, col)
            spans += s
            instants += i
        return spans, instants
    return _decode_block(info, rows, rank, shift, index, 0)


def _decode_block(info: dict, rows: list, rank: int, shift: int, index: int, col: int):
    """Spans and instants of one block of a trace buffer (header, then its programs)."""
    stride, grid, cap = rows[0][0], rows[0][1], rows[0][2]
    layout = info.get("layout", "segments")
    spans, instants = [], []
    name = info["kernel"]

    def t(ev):
        return ev[0] - shift

    tile_slots = _TILE_DECODERS[info.get("slots", layout)]
    for p in range(grid):
        ev = rows[1 + p * stride : 1 + (p + 1) * stride]
        start, end = ev[0], ev[1]
        if not start[1]:
            continue
        tid = col * grid + p  # the program's track: a 2-D grid's programs column by column
        args = dict(launch=index, kernel=name, program=tid)
        if layout == "steps":
            args.update(column=col)
            if "slots" not in info:  # the forward and dQ: their start names the block
                args.update(block=start[2], batch_head=start[3])
        if end[1]:
            spans.append(Span(rank, tid, f"{name} program {tid}", "program", t(start), t(end),
                              args))  # fmt: skip
        cursor = t(start)
        if ev[2][1] and ev[3][1]:
            spans.append(Span(rank, tid, "entry barrier", "wait", t(ev[2]), t(ev[3]),
                              dict(args, what="entry barrier")))  # fmt: skip
            cursor = t(ev[3])
        for j in range(cap):
            tile = _Tile(rank, tid, args, j * grid + p, j,
                         ev[HEADER.value + PER_TILE.value * j :][:4], cursor, t)  # fmt: skip
            tile_slots(info, tile)
            spans += tile.spans
            instants += tile.instants
            cursor = tile.cursor
        if ev[4][1] and ev[5][1]:
            what = "peers' broadcasts" if layout == "segments" else "every arrival (exit)"
            spans.append(Span(rank, tid, "final waits", "wait", t(ev[4]), t(ev[5]),
                              dict(args, what=what)))  # fmt: skip
    return spans, instants


class _Tile:
    """One tile's four event slots of program ``tid`` (``wb`` / ``we``: its wait's begin
    and end, ``te``: its work's end, ``nt``: its notify; each ``[time, set, a, b]``),
    made into spans and instants on the program's track by a decoder of its launch's
    layout. ``cursor``: where the program's next work span starts (its previous event);
    ``args``: what every span of the tile carries (``g``: the tile id, ``j``: the slot)."""

    def __init__(self, rank, tid, args, g, j, slots, cursor, t):
        self.rank, self.tid, self.args, self.g, self.j = rank, tid, args, g, j
        self.wb, self.we, self.te, self.nt = slots
        self.cursor, self.t = cursor, t
        self.spans: list[Span] = []
        self.instants: list[Instant] = []

    @property
    def waited(self) -> bool:
        """The tile recorded both ends of a wait."""
        return bool(self.wb[1] and self.we[1])

    def wait(self, name: str, move: bool = True, **extra) -> None:
        """A ``wait`` span from ``wb`` to ``we``; the program's work resumes after it
        (``move=False``: a wait at the launch's end, after the work)."""
        self.spans.append(Span(self.rank, self.tid, name, "wait", self.t(self.wb),
                               self.t(self.we), dict(self.args, **extra)))  # fmt: skip
        if move:
            self.cursor = max(self.cursor, self.t(self.we))

    def work(self, name: str, cat: str = "compute", **extra) -> None:
        """The tile's work (``compute``, or ``copy`` for SM stores into a peer) from the
        cursor to ``te``."""
        self.spans.append(Span(self.rank, self.tid, name, cat, self.cursor, self.t(self.te),
                               dict(self.args, **extra)))  # fmt: skip
        self.cursor = self.t(self.te)

    def notify(self, name: str, **extra) -> None:
        """A ``notify`` instant at ``nt``."""
        self.instants.append(Instant(self.rank, self.tid, name, "notify", self.t(self.nt),
                                     dict(self.args, **extra)))  # fmt: skip


def _segment_slots(info, s: _Tile) -> None:
    """One tile's slots of the segment GEMM (a wait where the program met a segment)."""
    table, g, rank = info["seg"], s.g, s.rank
    if s.we[1]:
        seg = s.we[2]
        waited = not info["one_loop"] or s.wb[2] != seg
        row = table[seg] if 0 <= seg < len(table) else None
        if waited and row is not None and row[SEG_WAIT_COUNT.value] > 0:
            kind, owner = row[SEG_KIND.value], row[SEG_OWNER.value]
            s.wait(f"wait chunk {seg}", segment=seg, tile=g, what=_who(kind, owner, rank),
                   peer=owner if kind == KIND_STORE.value else -1, kind=int(kind),
                   rows=[row[SEG_ROW0.value], row[SEG_ROW0.value] + row[SEG_ROWS.value]],
                   token=s.we[3])  # fmt: skip
        s.cursor = max(s.cursor, s.t(s.we))
    if s.te[1]:
        s.work(f"tile {g}", tile=g, segment=s.te[2])
    if s.nt[1]:
        dest = s.nt[3]
        label = "every peer" if dest == -1 else f"rank {dest}"
        s.notify(f"notify {label}", segment=s.nt[2], dest=dest)


def _sources(rank: int, world: int, lo: int, hi: int) -> list[int]:
    """Source ranks of arrival positions ``lo .. hi`` (position ``p``: rank ``rank + p``)."""
    return [(rank + p) % world for p in range(lo, hi + 1)]


def _tile_slots(info, s: _Tile) -> None:
    """One tile's slots of the grouped GEMM: its wait for the token shards it reads (where
    it reads a peer's), then its compute. Reduce mode (``MoERS``): no waits; a tile's rows
    belong to the tokens of ``owners``, and the last program's raise of every owner's
    contribution counter is a notify (in its first tile's slots)."""
    world, g, rank = info["world"], s.g, s.rank
    if s.waited:
        lo, hi = s.wb[2], s.wb[3]
        if hi >= lo:  # the tile reads peers' tokens: arrival positions lo .. hi
            peers = _sources(rank, world, lo, hi)
            who = ", ".join(str(q) for q in peers)
            s.wait(f"wait tokens of rank {who}", tile=g, positions=[lo, hi], peers=peers,
                   peer=peers[0] if len(peers) == 1 else -1, what=f"rank {who}'s tokens",
                   token=s.we[3])  # fmt: skip
        s.cursor = max(s.cursor, s.t(s.we))
    if s.te[1]:
        q, e = s.te[2], s.te[3]
        if info.get("mode") == "reduce":  # row tile q in row order, its rows' owners
            if "_row0" not in info:  # the table's entries by first row
                info["_row0"] = {t[0]: t for t in info["tiles"]}
            first, last = info["_row0"][q * info["block_m"]][2:4]
            who = dict(owners=_sources(rank, world, first, last))
        else:  # the table's q-th entry (arrival order), its rows gathered from these peers
            first, last = info["tiles"][q][2:4]
            who = dict(peers=_sources(rank, world, max(first, 1), last))
        s.work(f"tile {g}", tile=g, row_tile=q, expert=e, positions=[first, last], **who)
    if s.nt[1]:
        s.notify("notify every rank", slot=s.nt[2], dest=s.nt[3], what="contributions")


def _finish_slots(info, s: _Tile) -> None:
    """One tile of ``MoERS``'s finish kernel: the program's wait for every rank's
    contribution (in its first tile's slots), then the tile's sum of every rank's
    accumulator rows of this rank's tokens (peer reads)."""
    world, g = info["world"], s.g
    if s.waited:
        s.wait("wait contributions of every rank", tile=g, peer=-1,
               peers=[q for q in range(world) if q != s.rank],
               what="every rank's contributions", slot=s.wb[2], token=s.we[3])  # fmt: skip
    if s.te[1]:
        rt, ct = s.te[2], s.te[3]
        bm, bn = info["block_m"], info["block_n"]
        s.work(f"tile {g}", tile=g, rows=[rt * bm, min(info["M"], (rt + 1) * bm)],
               cols=[ct * bn, min(info["N"], (ct + 1) * bn)], peers=list(range(world)))  # fmt: skip


#: the split-decode kernel's tile slots of a program: its split, the combine, the push
_DECODE_STEPS = ("split", "combine", "push")


def _split_decode_slots(info, s: _Tile) -> None:
    """One of a split-decode program's three tiles: its split (``split s (seq b, kv head
    h)``); in the group's last program the combine of the splits and the push of the
    group's partial into the merging ranks (SM stores into their memory: a ``copy`` span,
    after a wait for the owner's acknowledgement in the one-owner mode; the owner's own,
    a ``store``); the launch's last program's arrival flags (a notify)."""
    world, owner, g, j = info["world"], info["owner"], s.g, s.j
    if s.waited:
        what = f"rank {owner}'s merge of this buffer parity"
        s.wait(f"wait ack of rank {owner}", tile=g, step="push", peer=owner, peers=[owner],
               ack_at_least=s.wb[3], what=what)  # fmt: skip
    if s.te[1]:
        bh, hkv = s.te[3], info["kv_heads"]
        where = f"seq {bh // hkv}, kv head {bh % hkv}"
        step = _DECODE_STEPS[j]
        name = f"split {s.te[2]} ({where})" if j == 0 else f"{step} ({where})"
        extra = dict(split=s.te[2]) if j == 0 else {}
        cat = "compute"
        if step == "push":
            dests = list(range(world)) if owner is None else [owner]
            peers = [q for q in dests if q != s.rank]
            if peers:  # (the owner's push stays in its own memory: a store)
                nbytes = info["group_heads"] * (info["head_dim"] + 1) * 4 * len(peers)
                extra = dict(peer=peers[0] if len(peers) == 1 else -1, peers=peers, bytes=nbytes)
                cat = "copy"
            else:
                name = f"store ({where})"
        s.work(name, cat, tile=g, step=step, seq=bh // hkv, kv_head=bh % hkv, **extra)
    if s.nt[1]:
        dest = s.nt[3]
        label = "every rank" if dest == -1 else f"rank {dest}"
        s.notify(f"notify {label}", dest=dest, epoch=s.nt[2], what="partials")


def _merge_slots(info, s: _Tile) -> None:
    """Step ``j`` of a decode-merge program: its wait for the partials of the step's
    source rank (its own, step 0, is not waited for), then their merge; the last
    program's acknowledgements in the one-owner mode (a notify)."""
    tid, g, j = s.tid, s.g, s.j
    block = tid * info["block_r"], min(info["rows"], (tid + 1) * info["block_r"])
    if s.waited:
        src = s.we[2]
        s.wait(f"wait partials of rank {src}", tile=g, step=j, peer=src, peers=[src],
               epoch=s.wb[3], token=s.we[3], what=f"rank {src}'s partials")  # fmt: skip
    if s.te[1]:
        src = s.te[2]
        s.work(f"merge rank {src}", tile=g, step=j, src=src, rows=list(block))
    if s.nt[1]:
        s.notify("notify every rank", dest=-1, epoch=s.nt[2], what="acknowledgement")


def _step_slots(info, s: _Tile) -> None:
    """One step of an attention program: its wait for a peer's K/V chunk (steps after the
    first), then the chunk's compute; tile ids number (program, step)."""
    s.args = dict(s.args, tile=s.tid * info["world"] + s.j, step=s.j)
    if s.waited:
        c = s.we[2]
        s.wait(f"wait chunk of rank {c}", chunk=c, peer=c, what=f"rank {c}'s K/V")
    if s.te[1]:
        c = s.te[2]
        s.work(f"block {s.te[3]} chunk {c}", chunk=c)


def _dkdv_slots(info, s: _Tile) -> None:
    """Step ``j`` of a dK/dV program (one per (chunk, key block), batch x kv head): step 0
    its wait for the chunk's K/V (a peer's chunk) and the key block's dK / dV; step 1 the
    push of the partial into the chunk owner's receive buffer (SM stores into its memory:
    a ``copy`` span, ``args.peers``; the owner's own, a ``store``) and the owner's counter
    raised (a notify); tile ids number (program, step)."""
    s.args = dict(s.args, tile=s.tid * 2 + s.j, step=s.j)
    if s.waited:
        c = s.we[2]
        s.wait(f"wait chunk of rank {c}", chunk=c, peer=c, peers=[c], token=s.we[3],
               what=f"rank {c}'s K/V")  # fmt: skip
    if s.te[1]:
        c = s.te[2]
        cat = "compute"
        if s.j == 0:
            name, extra = f"dK/dV block {s.te[3]} chunk {c}", dict(key_block=s.te[3])
        else:  # te[3]: the rows pushed (dK and dV)
            nbytes = 2 * s.te[3] * info["d"] * info["itemsize"]
            name, extra = "store dK/dV (own chunk)", dict(rows=s.te[3], bytes=nbytes)
            if c != s.rank:
                name, cat = f"push dK/dV to rank {c}", "copy"
                extra.update(peer=c, peers=[c])
        s.work(name, cat, chunk=c, **extra)
    if s.nt[1]:
        dest = s.nt[2]
        s.notify(f"notify rank {dest}", dest=dest, rows=s.nt[3], what="dK/dV partial rows")


def _attn_reduce_slots(info, s: _Tile) -> None:
    """Step ``j`` of a program of the attention backward's reduction: its wait for the
    dK/dV partials of source rank ``q`` (its counter reaching every row; this rank's own
    first), then their sum into the program's rows."""
    tid = s.tid
    rows = [tid * info["block_r"], min(info["rows"], (tid + 1) * info["block_r"])]
    s.args = dict(s.args, tile=tid * info["world"] + s.j, step=s.j)
    if s.waited:
        q = s.we[2]
        s.wait(f"wait partials of rank {q}", peer=q, peers=[q], token=s.we[3],
               what=f"rank {q}'s dK/dV partials")  # fmt: skip
    if s.te[1]:
        q = s.te[2]
        s.work(f"add rank {q}", src=q, rows=rows)


def _signal_gemm_slots(info, s: _Tile) -> None:
    """Tile ``g`` of the ``signal_reorder`` GEMM (program ``g % grid``): its main loop
    (``args.group``: its wave group, ``args.row_tile`` / ``col_tile``), then its group's
    counter raised (a notify to this rank's comm stream; with the TMA stores a tile is
    counted after the next tile's main loop, unless it is the program's last of its
    group)."""
    g = s.g
    if s.te[1]:
        tiles_m, tiles_n, group_m = info["tiles_m"], info["tiles_n"], info["group_m"]
        per = group_m * tiles_n  # (the grouped tile order, ``kernels.gemm._tile_coords``)
        first = (g // per) * group_m
        col = (g % per) // min(tiles_m - first, group_m)
        s.work(f"tile {g}", tile=g, group=s.te[2], row_tile=s.te[3], col_tile=col)
    if s.nt[1]:
        s.notify(f"notify group {s.nt[2]}", tile=g, group=s.nt[2], dest=s.rank,
                 what="wave-group counter")  # fmt: skip


#: expert-parallel all-to-all kernels: what a step's wait waits for (``data``: rows or
#: routing a peer pushes in this call; ``slot``: a peer freeing the slot written next)
_EP_WAITS = {
    "ep_route": ("slot", "routing slot of rank {q} freed"),
    "ep_layout": ("data", "rank {q}'s routing"),
    "ep_expand": ("data", "rank {q}'s tokens"),
    "ep_combine_send": ("slot", "rank {q}'s combine slot freed"),
    "ep_combine_recv": ("data", "rank {q}'s combined rows"),
}
#: what a kernel's notify raises
_EP_NOTIFIES = {
    "ep_route": "routing flag", "ep_send": "token counters", "ep_expand": "routing slots freed",
    "ep_combine_send": "combine counters", "ep_combine_recv": "combine slots freed",
}  # fmt: skip


def _push_or_store(s: _Tile, name: str, peers: list[int], extra: dict) -> None:
    """The tile's work that writes into ``peers``' memory: a ``copy`` span (SM stores)
    where a peer other than this rank is among them, a ``store`` where only this rank is,
    else local ``compute``."""
    others = [q for q in peers if q != s.rank]
    cat = "compute"
    if others:
        cat = "copy"
        extra = dict(extra, peer=others[0] if len(others) == 1 else -1, peers=others)
    elif peers:
        name = name.replace("push", "store", 1)
    s.work(name, cat, **extra)


def _ep_slots(info, s: _Tile) -> None:
    """Step ``j`` of a program of the expert-parallel dispatch / combine kernels
    (``kernels.ep``): its wait for a peer (``wait ... of rank q``: ``args.waits_for`` says
    whether for data pushed in this call or for a slot freed by the previous one), then
    its work: a push into peers' memory (SM stores: a ``copy`` span, ``args.peers``; into
    this rank's own memory, a ``store``), or local work (``compute``); a notify where the
    program raised peers' flags (``dest`` -1: every rank)."""
    kernel, world = info["kernel"], info["world"]
    s.args = dict(s.args, tile=s.g)
    if s.waited:
        q = s.we[2]
        waits_for, what = _EP_WAITS[kernel]
        s.wait(f"wait {'slot' if waits_for == 'slot' else 'data'} of rank {q}", step=s.j,
               peer=q, peers=[q], waits_for=waits_for, what=what.format(q=q))  # fmt: skip
    if s.te[1]:
        a, b = s.te[2], s.te[3]
        extra = dict(step=s.j)
        if kernel == "ep_route":  # routing (ids, weights, count) of b tokens into rank a
            name, peers = f"push routing to rank {a}", [a]
            extra.update(tokens=b, bytes=b * info["kp"] * 8 + 4)
        elif kernel == "ep_send":  # this program's token blocks into every rank using them
            name, peers = "push tokens", list(range(world))
            extra.update(blocks=a)
        elif kernel == "ep_combine_send":  # rows of home rank a's tokens (b: sent at all)
            name, peers = f"push rows to rank {a}", [a] if b else []
        elif kernel == "ep_expand":
            name, peers = f"expand rows of rank {a}", []
            extra.update(src=a)
        elif kernel == "ep_layout":
            last = a >= info["grid"] - 1  # (the last program checks the whole routing)
            name, peers = ("layout (check)" if last else f"layout (expert {a})"), []
        else:
            name, peers = "sum rows of every rank", []
        _push_or_store(s, name, peers, extra)
    if s.nt[1]:
        dest = s.nt[3]
        label = "every rank" if dest == -1 else f"rank {dest}"
        s.notify(f"notify {label}", dest=dest, slot=s.nt[2],
                 what=_EP_NOTIFIES.get(kernel, "flags"))  # fmt: skip


def _ep_ll_slots(info, s: _Tile) -> None:
    """Step ``j`` (tile ``g``) of a program of ``EPLowLatency``'s dispatch or combine
    kernel (``kernels.ep_low_latency``). Its first ``send_steps`` steps send: the rows of
    expert ``g`` (dispatch) or of segment ``g`` = (local expert, home rank) (combine) are
    pushed into the rank that reads them (SM stores: a ``copy`` span, ``args.peers``; into
    this rank's own memory, a ``store``); program 0 of combine first raises every rank's
    arrival word (a notify). Then the receives, each a wait and the work after it: the
    dispatch's segment (local expert, source rank) (``wait rows of rank s``, then
    ``receive rows of rank s``), or, after program 0's waits for every rank's arrival word
    (``wait arrival of rank q``, at the launch's end), the combine's home token (``wait
    rows of rank ...``: the ranks holding its experts, then ``sum token t``). A receive's
    wait ends when the last word it polls arrived; where the kernel works on the rows as
    they land (dispatch; combine with the flag in the data) the work before that falls
    inside it."""
    kernel, world, grid = info["kernel"], info["world"], info["grid"]
    sends, e_loc, wbytes = info["send_steps"], info["e_loc"], info["word_bytes"]
    dispatch = kernel == "ep_ll_dispatch"
    g, j, rank = s.g, s.j, s.rank
    s.args = dict(s.args, tile=g, step=j)
    if s.nt[1]:
        s.notify("notify every rank", dest=-1, epoch=s.nt[2], what="combine arrival words")
    if j < sends:
        if s.te[1]:
            dest, rows = s.te[2], s.te[3]
            if dispatch:  # count word, then each row and its meta word
                e = g
                name = f"push tokens to rank {dest} (expert {e})"
                nbytes = rows * (info["row_words"] * wbytes + 8) + 8
            else:  # each row and its meta word
                e = rank * e_loc + g // world
                name = f"push rows to rank {dest} (expert {e})"
                nbytes = rows * (info["row_words"] * wbytes + 8)
            _push_or_store(s, name, [dest], dict(expert=e, rows=rows, bytes=nbytes))
        return
    if not dispatch and j < sends + world:  # program 0: every rank's arrival word
        if s.waited:
            q = s.wb[2]
            s.wait(f"wait arrival of rank {q}", move=False, peer=q, peers=[q],
                   waits_for="arrival", what=f"rank {q} started this combine")  # fmt: skip
        return
    if dispatch:
        el, src = divmod(g - sends * grid, world)  # segment (local expert, source)
        e = rank * e_loc + el
        if s.waited:
            s.wait(f"wait rows of rank {src}", peer=src, peers=list(range(src + 1)),
                   waits_for="data", expert=e, rows_seen=s.we[3],
                   what=f"rank {src}'s rows of expert {e} (and the row counts of ranks 0 "
                   f".. {src})")  # fmt: skip
        if s.te[1]:
            s.work(f"receive rows of rank {src}", src=src, expert=e, rows=s.te[3])
        return
    if s.waited:
        mask = s.wb[3]
        peers = [q for q in range(min(world, 63)) if mask >> q & 1]
        who = ", ".join(str(q) for q in peers)
        s.wait(f"wait rows of rank {who}", token=s.wb[2],
               peer=peers[0] if len(peers) == 1 else -1, peers=peers, waits_for="data",
               what=f"rank {who}'s rows of token {s.wb[2]}")  # fmt: skip
    if s.te[1]:
        s.work(f"sum token {s.te[2]}", token=s.te[2])


#: how a launch's tile slots read: by ``info["slots"]`` where given, else by its layout
_TILE_DECODERS = {
    "segments": _segment_slots, "tiles": _tile_slots, "steps": _step_slots,
    "finish": _finish_slots, "split_decode": _split_decode_slots, "merge": _merge_slots,
    "ep": _ep_slots, "ep_ll": _ep_ll_slots, "dkdv": _dkdv_slots,
    "attn_reduce": _attn_reduce_slots, "signal_gemm": _signal_gemm_slots,
}  # fmt: skip


def _tiles_of(info: dict) -> int:
    """Tiles of a launch (every tile a trace must hold): ``n_tiles`` where the launch
    states it (known on the host); of its segments from ``seg_first`` on; of the grouped
    GEMM's tile table; one per (program, step)."""
    if "n_tiles" in info:
        return info["n_tiles"]
    layout = info.get("layout", "segments")
    if layout == "tiles":
        return info["tile_count"][0] * -(-info["N"] // info["block_n"])
    if layout == "steps":
        return info["grid"] * info["world"]
    tiles_n = -(-info["N"] // info["block_n"])
    return sum(
        -(-row[SEG_ROWS.value] // info["block_m"]) * tiles_n
        for row in info["seg"][info["seg_first"] : info["n_seg"]]
    )


def build_trace(everyone: list[dict], label: str = "", meta=None, shared: str | None = None):
    """The world's :class:`Trace` from every rank's ``Recorder.rank_data()`` (with its
    ``clock`` measurement), aligned to rank 0's clock."""
    world = len(everyone)
    deltas = [d["clock"]["delta_ns"] for d in everyone]
    windows = [d["clock"]["window_ns"] for d in everyone]
    measured = [x - deltas[0] for x in deltas]
    offsets = [0] * world if shared else measured
    clock = dict(
        method=f"same clock: {shared}" if shared else "host-bracketed timer reads",
        offsets_ns=offsets, measured_offsets_ns=measured,
        uncertainty_ns=[0 if shared else w + windows[0] for w in windows],
        stream_uncertainty_ns=[d.get("anchor_window_ns", 0) for d in everyone],
        timer_jump_ns=[d.get("timer_jump_ns", 0) for d in everyone],
    )  # fmt: skip
    spans, instants, tracks = [], [], {}
    for d in everyone:
        r, shift = d["rank"], offsets[d["rank"]]
        for index, (info, rows) in enumerate(d["launches"]):
            s, i = decode_launch(info, rows, r, shift, index)
            spans += s
            instants += i
            for p in range(info["grid"]):
                tracks[(r, p)] = f"program {p}"
        names = sorted({track for _, track, *_ in d["spans"]})
        for kind, track, t0, t1, m in d["spans"]:
            tid = TID_STREAM + names.index(track)
            tracks[(r, tid)] = track
            peer = m.get("peer")
            name = m.get("name") or (
                f"copy to rank {peer}" if kind == "copy" else kind.replace("_", " ")
            )
            spans.append(Span(r, tid, name, kind, t0 - shift, t1 - shift, dict(m)))
            if kind == "copy" and m.get("signal_slot") is not None:
                instants.append(Instant(r, tid, f"signal rank {peer}", "signal", t1 - shift,
                                        dict(dest=peer, slot=m["signal_slot"])))  # fmt: skip
    launches = [[dict(kernel=info["kernel"], layout=info.get("layout", "segments"),
                      grid=info["grid"], tiles=_tiles_of(info),
                      one_loop=info.get("one_loop", False),
                      **{k: info[k] for k in ("M", "N", "K") if k in info})
                 for info, _ in d["launches"]] for d in everyone]  # fmt: skip
    meta = dict(meta or {}, launches=launches)
    trace = Trace(world, spans, instants, tracks, clock, label, meta)
    for r in range(world):
        for s in exposed_spans(trace, r):
            trace.spans.append(s)
            trace.tracks[(r, TID_EXPOSED)] = "exposed communication"
    return trace
