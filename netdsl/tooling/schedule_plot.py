"""`netdsl split --plot`: the predicted schedule as a Gantt chart, one row per device:
forward and backward compute, optimizer updates, recomputation and host copies of a
memory plan, receives and collectives, from `parallel.predict.simulate`'s timeline.
Needs matplotlib (the `plot` extra)."""
from __future__ import annotations

from pathlib import Path

from netdsl.tooling.curves import _pyplot, save_figure

COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868",
           "recompute": "#937860", "recv": "#c44e52", "collective": "#8172b3",
           "copy": "#da8bc3"}
NARROW = ("recv", "collective", "copy")  # off the compute lane: links and copy streams


def plot_schedule(timeline: list[tuple], path: str | Path, title: str = "") -> None:
    """Draw `(device, start, end, kind, node)` entries; kinds as in COLOURS."""
    plt = _pyplot()
    devices = sorted({d for d, *_ in timeline})
    fig, ax = plt.subplots(figsize=(13, 1.0 + 0.6 * len(devices)))
    for kind, colour in COLOURS.items():
        for row, d in enumerate(devices):
            bars = [(s * 1e3, (e - s) * 1e3) for dd, s, e, k, _ in timeline
                    if dd == d and (k == kind or (kind == "forward" and k not in COLOURS))]
            if bars:
                lane = (row - 0.35, 0.7) if kind not in NARROW else (
                    row + 0.2, 0.2)
                ax.broken_barh(bars, lane, facecolors=colour, label=kind)
    ax.set_yticks(range(len(devices)), [f"device {d}" for d in devices])
    ax.invert_yaxis()
    ax.set_xlabel("predicted time (ms)")
    ax.set_title(title)
    handles, labels = ax.get_legend_handles_labels()
    seen = {}
    for h, lab in zip(handles, labels, strict=True):
        seen.setdefault(lab, h)
    ax.legend(seen.values(), seen.keys(), loc="upper right", fontsize=8)
    fig.tight_layout()
    save_figure(plt, fig, path)
