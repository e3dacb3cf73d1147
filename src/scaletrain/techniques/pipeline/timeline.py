"""Draw a pipeline timeline (ranks × time) as a PNG, from simulated or measured events.

Events are tuples ``(rank, kind, microbatch, start_s, end_s)`` — optionally followed by
``stage`` and ``pipe`` as in :class:`.simulate.Event` — so a runtime that records its own
``time.perf_counter()`` intervals draws with the same function. Kinds F, B, I, W, OPT and
GRAD_SYNC are coloured; anything else (e.g. measured ``RECV`` waits) is drawn as idle, which
is also the background of every rank row. Chimera's up-pipeline passes are hatched; the
later model chunks of an interleaved schedule are drawn lighter.

Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend switch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

from scaletrain.errors import UserError

COLOURS = {
    "F": "#4C72B0",          # forward
    "B": "#55A868",          # full backward
    "I": "#8FD18F",          # input-gradient half of a split backward
    "W": "#DD8452",          # weight-gradient half
    "OPT": "#8172B2",        # optimizer step
    "GRAD_SYNC": "#937860",  # gradient all-reduce between Chimera replicas
}
IDLE = "#E6E6E6"
LABELS = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad", "OPT": "optimizer",
          "GRAD_SYNC": "grad sync", "idle": "idle"}


def _normalise(events: Iterable[Sequence]) -> list[tuple]:
    out = []
    for e in events:
        if len(e) < 5:
            raise UserError(f"timeline events need (rank, kind, microbatch, start_s, end_s); got {tuple(e)!r}")
        rank, kind, mb, start, end = e[:5]
        stage = e[5] if len(e) > 5 else -1
        pipe = e[6] if len(e) > 6 else 0
        if end < start:
            raise UserError(f"timeline event ends before it starts: {tuple(e)!r}")
        out.append((int(rank), str(kind), int(mb), float(start), float(end), int(pipe), int(stage)))
    return out


def draw(events: Iterable[Sequence], path: str | Path, title: str | None = None, n_ranks: int | None = None,
         time_unit: str | None = None, styles: dict[str, tuple[str, str]] | None = None,
         row_label: str = "rank") -> Path:
    """Write a PNG timeline of ``events`` to ``path`` and return the path.

    ``time_unit``: "s", "ms", "us", or "unit" (dimensionless simulated costs); chosen from the
    span when omitted (spans below 1e-3 assume seconds → "us", below 1 → "ms"). ``styles``: more
    kinds to colour, ``{kind: (colour, legend label)}`` (the planner's step adds recompute,
    communication and bubble segments); ``row_label`` names the rows ("rank", "stage").
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    evs = _normalise(events)
    if not evs:
        raise UserError("timeline has no events to draw")
    P = n_ranks if n_ranks is not None else 1 + max(e[0] for e in evs)
    t0 = min(e[3] for e in evs)
    span = max(e[4] for e in evs) - t0 or 1.0
    if time_unit is None:
        time_unit = "us" if span < 1e-3 else ("ms" if span < 1 else "s")
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6, "unit": 1.0}.get(time_unit)
    if scale is None:
        raise UserError(f"time_unit must be s, ms, us or unit (got {time_unit!r})")

    width = min(max(8.0, 0.35 * len(evs) / max(P, 1)), 28.0)
    fig = Figure(figsize=(width, 0.9 + 0.55 * P))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for r in range(P):  # idle background for each rank
        ax.broken_barh([(0, span * scale)], (r - 0.4, 0.8), facecolors=IDLE)
    colours = {**COLOURS, **{k: c for k, (c, _) in (styles or {}).items()}}
    labels = {**LABELS, **{k: lab for k, (_, lab) in (styles or {}).items()}}
    busy_kinds = set(colours)
    min_label = span * scale / (width * 9)  # boxes narrower than ~1/9 inch get no number
    # one broken_barh per (row, kind, pipe, chunk): a step of thousands of passes draws in a second
    bars: dict[tuple[int, str, bool, int], list[tuple[float, float]]] = {}
    for rank, kind, mb, start, end, pipe, stage in evs:
        if kind not in busy_kinds:
            continue
        x, w = (start - t0) * scale, (end - start) * scale
        chunk = stage // P if stage >= 0 else 0  # interleaved: model chunk, drawn lighter as it grows
        bars.setdefault((rank, kind, bool(pipe), chunk % 3), []).append((x, w))
        if w >= min_label and mb >= 0 and kind not in ("OPT", "GRAD_SYNC"):
            ax.text(x + w / 2, rank, str(mb), ha="center", va="center", fontsize=7, color="white")
    for (rank, kind, pipe, shade), xs in bars.items():
        ax.broken_barh(xs, (rank - 0.4, 0.8), facecolors=colours[kind], edgecolor="white", linewidth=0.5,
                       hatch="//" if pipe else None, alpha=1.0 - 0.25 * shade)
    ax.set_ylim(P - 0.5, -0.5)
    ax.set_yticks(range(P))
    ax.set_yticklabels([f"{row_label} {r}" for r in range(P)])
    ax.set_xlim(0, span * scale)
    ax.set_xlabel("time" if time_unit == "unit" else f"time ({time_unit})")
    present = [k for k in colours if any(e[1] == k and e[4] > e[3] for e in evs)]
    handles = [Patch(facecolor=colours[k], label=labels[k]) for k in present] + [Patch(facecolor=IDLE, label="idle")]
    if any(e[6] >= P for e in evs):
        handles.append(Patch(facecolor=COLOURS["F"], alpha=0.75, label="later chunk"))
    if any(e[5] for e in evs):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="up pipe"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    fig.set_size_inches(width, max(0.9 + 0.55 * P, 0.8 + 0.2 * len(handles)))  # tall enough for the legend
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
