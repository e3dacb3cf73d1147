"""The study's figures (matplotlib, Agg), as the survey draws them, each returned as PNG bytes.

Measured values are solid; the cost model's predictions are hollow markers on dashed lines of the
same colour. Only cells with status ``ok`` are drawn (the report's table lists the others).
"""

from __future__ import annotations

import io
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from scaletrain.compare.matrix import STRATEGIES  # noqa: E402
from scaletrain.measure.phases import PHASES  # noqa: E402

Cells = list[dict[str, Any]]
MEMORY_PARTS = ("model_states", "activations", "other")
"""The tracked peak's categories drawn (bytes): parameters + gradients + optimizer states; saved
activations; temporaries and the rest."""


def _colour(strategy: str) -> Any:
    names = list(STRATEGIES)
    return plt.get_cmap("tab20")(2 * names.index(strategy) % 20 + (names.index(strategy) >= 10)
                                 if strategy in names else 19)


def _ok(cells: Cells, model: str) -> Cells:
    return [c for c in cells if c["model"] == model and c["status"] == "ok"]


def models_of(cells: Cells) -> list[str]:
    """The models of ``cells`` in first-seen order."""
    return list(dict.fromkeys(c["model"] for c in cells))


def _png(fig: Any) -> bytes:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _legend(ax: Any, **kw: Any) -> None:
    """A legend when something was drawn, else a note that no cell of this model ran."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)
    else:
        ax.text(0.5, 0.5, "no cell ran (see the table of cells)", ha="center", transform=ax.transAxes)


def _grid(rows: int, cols: int, w: float = 5.2, h: float = 3.6) -> tuple[Any, Any]:
    fig, axes = plt.subplots(rows, cols, figsize=(w * cols, h * rows), squeeze=False)
    return fig, axes


def best_one_device(cells: Cells, model: str) -> float | None:
    """Seconds per 1,000 samples of the fastest one-device run of ``model`` (None without one)."""
    one = [c["seconds_per_1000_samples"] for c in _ok(cells, model) if c["devices"] == 1
           and c.get("seconds_per_1000_samples")]
    return min(one) if one else None


MARGIN = 1.5
"""The time axis spans the measured bars x/÷ this; a prediction beyond is drawn at the edge."""


def clip_to_measured(measured: list[float], points: list[tuple[int, float]]) -> tuple[tuple[float, float],
                                                                                       list[tuple[int, float, bool]]]:
    """((low, high) of a log time axis around the ``measured`` seconds, the ``points`` (devices,
    predicted seconds) with each y clipped into it and whether it was).

    Why: one prediction 8.7x off set the axis and squashed every measured line to the bottom; the
    measured figures are what the page is read for, so they set the axis, and an off-scale prediction
    is marked at the edge with its value in a note.
    """
    lo, hi = min(measured) / MARGIN, max(measured) * MARGIN
    return (lo, hi), [(x, min(max(y, lo), hi), not lo <= y <= hi) for x, y in points]


def scaling(cells: Cells) -> bytes:
    """Seconds per 1,000 samples vs devices (25th-75th percentile bars, predictions hollow; log axis
    set by the measured figures, off-scale predictions at its edge with a note), and the speedup
    over the best one-device run, one column per model."""
    models = models_of(cells)
    fig, ax = _grid(2, len(models))
    for j, model in enumerate(models):
        ok = _ok(cells, model)
        base = best_one_device(cells, model)
        spans = [c["step_time_spread_s"][i] * 1000 / c["global_batch"] for c in ok for i in (0, 1)]
        measured = [y for y in spans + [c["seconds_per_1000_samples"] for c in ok] if y and y > 0]
        notes: list[str] = []
        for s in dict.fromkeys(c["strategy"] for c in ok):
            row = sorted((c for c in ok if c["strategy"] == s), key=lambda c: c["devices"])
            xs = [c["devices"] for c in row]
            ys = [c["seconds_per_1000_samples"] for c in row]
            k = [1000 / c["global_batch"] for c in row]
            lo = [y - c["step_time_spread_s"][0] * f for y, c, f in zip(ys, row, k)]
            hi = [c["step_time_spread_s"][1] * f - y for y, c, f in zip(ys, row, k)]
            ax[0, j].errorbar(xs, ys, yerr=[lo, hi], marker="o", color=_colour(s), label=s, capsize=3)
            pred = [(c["devices"], c["predicted_step_time_s"] * f) for c, f in zip(row, k)
                    if c.get("predicted_step_time_s")]
            if pred and measured:
                (lo, hi), shown = clip_to_measured(measured, pred)
                ax[0, j].plot([x for x, _, _ in shown], [y for _, y, _ in shown], ls="--", marker="o", mfc="none",
                              color=_colour(s), alpha=0.6)
                for (x, y, off), (_, real) in zip(shown, pred):
                    if off:
                        ax[0, j].plot([x], [y], marker="^" if real > y else "v", color=_colour(s), ms=9)
                        notes.append(f"{'▲' if real > y else '▼'} {s} at {x}: predicted {real:.3g} s (off scale)")
            if base:
                ax[1, j].plot(xs, [base / y for y in ys], marker="o", color=_colour(s), label=s)
        ax[0, j].set(title=f"{model}: time per 1,000 samples", xlabel="devices (processes)", ylabel="seconds",
                     xscale="log", yscale="log")
        if measured:
            ax[0, j].set_ylim(min(measured) / MARGIN, max(measured) * MARGIN)
        if notes:  # under the axis, where no legend or line covers it
            ax[0, j].set_xlabel("devices (processes)\n" + "\n".join(notes), fontsize=7)
        ax[1, j].set(title=f"{model}: speedup over the best 1-device run", xlabel="devices (processes)",
                     ylabel="speedup", xscale="log")
        ax[1, j].axhline(1.0, color="grey", lw=0.8)
        for a in ax[:, j]:
            ticks = sorted({c["devices"] for c in cells})
            a.set_xticks(ticks, [str(d) for d in ticks])
            a.minorticks_off()
            _legend(a, fontsize=7)
    fig.suptitle("measured (solid, 25th-75th percentile of timed steps) vs predicted (hollow, dashed)", fontsize=9)
    return _png(fig)


def validation(cells: Cells) -> bytes:
    """The validation metric vs step (top) and vs training seconds (bottom), one column per model."""
    models = models_of(cells)
    fig, ax = _grid(2, len(models))
    styles = {1: ":", 2: "--", 4: "-"}
    for j, model in enumerate(models):
        for c in _ok(cells, model):
            if not c.get("val"):
                continue
            steps, secs, vals = zip(*c["val"])
            kw = dict(color=_colour(c["strategy"]), ls=styles.get(c["devices"], "-."), marker=".",
                      label=f"{c['strategy']} {c['devices']}d")
            ax[0, j].plot(steps, vals, **kw)
            ax[1, j].plot(secs, vals, **kw)
        metric = next((c["metric"] for c in cells if c["model"] == model), "val_loss")
        ax[0, j].set(title=f"{model}: {metric} vs step", xlabel="optimizer step", ylabel=metric)
        ax[1, j].set(title=f"{model}: {metric} vs training seconds", xlabel="seconds (evaluation excluded)",
                     ylabel=metric)
        for a in ax[:, j]:
            _legend(a, fontsize=6, ncol=2)
    return _png(fig)


def memory(cells: Cells) -> bytes:
    """Per-device peak (heaviest rank, tracked) by category vs devices, per strategy; predicted peak as a
    hollow diamond."""
    models = models_of(cells)
    fig, ax = _grid(1, len(models), w=6.5, h=4.2)
    hatch = {"model_states": "", "activations": "//", "other": ".."}
    for j, model in enumerate(models):
        ok = [c for c in _ok(cells, model) if c.get("peak_breakdown")]
        labels = []
        for i, c in enumerate(sorted(ok, key=lambda c: (list(STRATEGIES).index(c["strategy"])
                                                        if c["strategy"] in STRATEGIES else 99, c["devices"]))):
            bottom = 0.0
            for part in MEMORY_PARTS:
                v = c["peak_breakdown"][part] / 2**20
                ax[0, j].bar(i, v, bottom=bottom, color=_colour(c["strategy"]), hatch=hatch[part], edgecolor="k",
                             lw=0.4, label=part if i == 0 else None)
                bottom += v
            if c.get("predicted_peak_bytes"):
                ax[0, j].plot(i, c["predicted_peak_bytes"] / 2**20, marker="D", mfc="none", color="k",
                              label="predicted peak" if i == 0 else None)
            labels.append(f"{c['strategy']} {c['devices']}d")
        ax[0, j].set_xticks(range(len(labels)), labels, fontsize=7, rotation=45, ha="right")
        ax[0, j].set(title=f"{model}: per-device peak memory", ylabel="MiB (heaviest rank)")
        _legend(ax[0, j], fontsize=7)
    return _png(fig)


def breakdown(cells: Cells) -> bytes:
    """Seconds per phase of the profiled step (rank 0, torch.profiler), one bar per cell; beside it (thin,
    hatched) the cost model's forward+backward, optimizer and exposed communication where it has them."""
    models = models_of(cells)
    fig, ax = _grid(1, len(models), w=6.5, h=4.2)
    colours = plt.get_cmap("Set2")
    for j, model in enumerate(models):
        ok = [c for c in _ok(cells, model) if c.get("time_breakdown_s")]
        shown = False
        for i, c in enumerate(ok):
            left = 0.0
            for k, phase in enumerate(PHASES):
                v = c["time_breakdown_s"].get(phase, 0.0) * 1e3
                ax[0, j].barh(i, v, height=0.5, left=left, color=colours(k), label=phase if i == 0 else None)
                left += v
            left = 0.0
            for phase, v in (c.get("predicted_time_breakdown_s") or {}).items():  # the cost model's, hatched
                k = PHASES.index("backward" if phase == "forward+backward" else phase)
                ax[0, j].barh(i + 0.38, v * 1e3, height=0.22, left=left, color=colours(k), hatch="///",
                              edgecolor="k", lw=0.3, label=None if shown else "predicted (hatched)")
                left, shown = left + v * 1e3, True
        ax[0, j].set_yticks(range(len(ok)), [f"{c['strategy']} {c['devices']}d" for c in ok], fontsize=7)
        ax[0, j].set(title=f"{model}: one step by phase (rank 0)", xlabel="milliseconds")
        _legend(ax[0, j], fontsize=7)
    return _png(fig)


FIGURES = {"scaling": ("Time per 1,000 samples and speedup vs devices", scaling),
           "validation": ("Validation metric vs step and vs wall-clock seconds", validation),
           "memory": ("Per-device peak memory vs devices (model states, activations, other)", memory),
           "breakdown": ("Time breakdown of one step (forward, backward, optimizer, data, exposed communication)",
                         breakdown)}
"""Figure id -> (caption, function of the cells returning PNG bytes), in the page's order."""
