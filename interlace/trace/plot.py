"""A PNG timeline of a trace (matplotlib): per rank, one row per program and per stream
and a last row of exposed communication; compute tiles, waits and transfers in their own
colours, exposed communication also shaded across the rank's rows."""

from __future__ import annotations

COLORS = {
    "compute": "#4C78A8",
    "wait": "#F58518",
    "copy": "#54A24B",
    "chunk_wait": "#B279A2",
    "exposed": "#E45756",
}
EXPOSED = "#E45756"


def plot(trace, path: str, title: str | None = None) -> str:
    """Draw ``trace`` into ``path`` (PNG). Raises ImportError (with how to install it) where
    matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the trace PNG needs matplotlib (pip install 'interlace[plot]' or matplotlib)"
        ) from e
    t0 = trace.t_origin
    rows: list[tuple[int, int]] = []  # (rank, tid) top to bottom
    for rank in range(trace.world):
        tids = sorted({tid for (r, tid) in trace.tracks if r == rank})
        rows += [(rank, tid) for tid in tids]
    index = {key: i for i, key in enumerate(rows)}
    height = max(3.0, min(16.0, 0.05 * len(rows) + 1.5 * trace.world))
    fig, ax = plt.subplots(figsize=(14, height))
    for cat, color in COLORS.items():
        bars: dict[int, list] = {}
        for s in trace.spans:
            if s.cat == cat and (s.rank, s.tid) in index:
                bars.setdefault(index[(s.rank, s.tid)], []).append(
                    ((s.t0 - t0) / 1e3, max(s.dur, 1) / 1e3)
                )
        for row, segs in bars.items():
            ax.broken_barh(segs, (row - 0.4, 0.8), facecolors=color, linewidth=0)
    for rank in range(trace.world):
        own = [i for (r, _), i in index.items() if r == rank]
        if not own:
            continue
        lo, hi = min(own) - 0.5, max(own) + 0.5
        for s in trace.of(rank, "exposed"):
            ax.fill_between([(s.t0 - t0) / 1e3, (s.t1 - t0) / 1e3], lo, hi, color=EXPOSED,
                            alpha=0.15, linewidth=0, zorder=0)  # fmt: skip
        if rank:
            ax.axhline(lo, color="black", linewidth=0.6)
        ax.text(1.002, 1 - (lo + hi) / 2 / max(1, len(rows)), f"rank {rank}",
                transform=ax.transAxes, va="center", fontsize=9)  # fmt: skip
    notes = [i for i in trace.instants if (i.rank, i.tid) in index]
    if notes:
        ax.scatter([(i.t - t0) / 1e3 for i in notes], [index[(i.rank, i.tid)] for i in notes],
                   marker="|", s=30, color="black", linewidths=0.6)  # fmt: skip
    ax.set_ylim(len(rows) - 0.5, -0.5)
    step = max(1, len(rows) // 24)
    ax.set_yticks(range(0, len(rows), step))
    ax.set_yticklabels([trace.tracks[rows[i]] for i in range(0, len(rows), step)], fontsize=6)
    ax.set_xlabel("time (us, rank 0's clock)")
    ax.set_title(title or f"{trace.label or 'trace'}: world {trace.world}")
    handles = [Patch(color=c, label=k.replace("_", " ")) for k, c in COLORS.items()]
    handles[-1] = Patch(color=EXPOSED, label="exposed communication (row, and shaded)")
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.08), fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
