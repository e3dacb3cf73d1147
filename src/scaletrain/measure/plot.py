"""PNG plot of a memory timeline stacked by category (matplotlib, Agg backend: no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from scaletrain.measure.tracker import CATEGORIES, MemoryTracker

COLORS = {
    "parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_states": "#55a868",
    "activations": "#c44e52", "temporaries": "#8172b3", "other": "#937860",
}


def plot_timeline(source: MemoryTracker | Sequence[tuple[float, dict[str, int]]], path: str | Path, *,
                  title: str = "", marks: Sequence[tuple[float, str]] | None = None, max_points: int = 4000,
                  xlabel: str | None = None) -> Path:
    """Write a stacked-area PNG of bytes per category (shown in MiB) and return its path.

    ``source`` is a tracker (x = event index, its marks as vertical lines) or a list of
    (x, bytes per category) points, e.g. an estimate's phase timeline. Long timelines are thinned
    to ``max_points`` points, always keeping the peak.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if isinstance(source, MemoryTracker):
        points = [(float(i), cats) for i, _, cats in source.iter_timeline()]
        marks = list(marks) if marks is not None else [(float(i), lab) for i, lab in source.marks]
        if marks:  # start at the first mark: before it the tracker only registered existing tensors
            first = marks[0][0]
            points = [p for p in points if p[0] >= first - 1] or points
        xlabel = xlabel or "allocation/free event"
        peak_x = float(source.peak_event)
    else:
        points = [(float(x), cats) for x, cats in source]
        marks = list(marks or [])
        xlabel = xlabel or "step phase"
        peak_x = max(points, key=lambda p: sum(p[1].values()))[0] if points else 0.0
    if len(points) > max_points:
        stride = len(points) // max_points + 1
        keep = {i for i in range(0, len(points), stride)} | {len(points) - 1}
        keep |= {i for i, (x, _) in enumerate(points) if x == peak_x}
        points = [p for i, p in enumerate(points) if i in keep]
    xs = [x for x, _ in points]
    mib = 2.0**20
    ys = [[cats.get(c, 0) / mib for _, cats in points] for c in CATEGORIES]
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
    ax.stackplot(xs, ys, labels=list(CATEGORIES), colors=[COLORS[c] for c in CATEGORIES], step="post")
    top = max((sum(v) for v in zip(*ys)), default=0.0)
    for x, label in marks:
        ax.axvline(x, color="black", lw=0.6, alpha=0.5)
        ax.text(x, top * 1.01, label, rotation=60, fontsize=7, va="bottom")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("MiB")
    ax.set_title(title, pad=40 if marks else 6)
    ax.legend(loc="upper left", fontsize=7, ncol=3)
    ax.set_ylim(0, top * 1.08 if top else 1)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
