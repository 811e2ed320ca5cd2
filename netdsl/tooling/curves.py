"""Training curves from `netdsl run --log` files: loss, accuracy, learning rate and images/s
against step, several runs overlaid (`netdsl report`, `netdsl run --plot`).

Reading and summarising a log needs nothing; drawing needs matplotlib (the `plot` extra),
imported only there, with the Agg backend so it works without a display.
"""
from __future__ import annotations

import base64
import html
import io
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from netdsl.errors import NetdslError

# the figure: 2 x 2 panels, 12 x 8 inches at 100 dpi = 1200 x 800 pixels
FIG_INCHES, DPI = (12.0, 8.0), 100
PLOT_HINT = "install the plot extra: pip install 'netdsl[plot]' (it brings matplotlib)"
SERIES = ("loss", "accuracy", "lr", "images_per_s", "test_loss", "test_accuracy")


@dataclass
class Run:
    """One log: for each series, its (step, value) points."""

    name: str
    path: str
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return max((s for s, _ in self.series.get("loss", [])), default=0)

    def last(self, key: str) -> float | None:
        pts = self.series.get(key)
        return pts[-1][1] if pts else None

    def summary(self) -> dict:
        losses = [v for _, v in self.series.get("loss", [])]
        speeds = [v for _, v in self.series.get("images_per_s", [])][1:]  # the 1st warms up
        return {"run": self.name, "log": self.path, "steps": self.steps,
                "final_loss": losses[-1] if losses else None,
                "min_loss": min(losses) if losses else None,
                "accuracy": self.last("accuracy"), "test_accuracy": self.last("test_accuracy"),
                "test_loss": self.last("test_loss"), "final_lr": self.last("lr"),
                "images_per_s": statistics.median(speeds) if speeds else self.last(
                    "images_per_s")}


def run_from_records(records: list[dict], name: str, path: str = "") -> Run:
    run = Run(name, path)
    for rec in records:
        step = rec["step"]
        for key in SERIES:
            v = rec.get(key)
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                run.series.setdefault(key, []).append((step, float(v)))
    return run


def read_log(path: str | Path, name: str | None = None) -> Run:
    """A `netdsl run --log` file; NetdslError naming the file and line if it is not one."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise NetdslError(f"{path}: cannot read the log ({e.__class__.__name__}: "
                          f"{getattr(e, 'strerror', None) or e})") from None
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise NetdslError(f"{path}:{i}: not a JSON line ({e.msg}); a log is what "
                              "`netdsl run --log FILE` writes, one JSON object per step") \
                from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or \
                not isinstance(rec.get("loss"), int | float):
            raise NetdslError(f"{path}:{i}: a log line must be an object with an integer "
                              "`step` and a number `loss`, as `netdsl run --log` writes")
        records.append(rec)
    if not records:
        raise NetdslError(f"{path}: the log is empty (no steps recorded)")
    return run_from_records(records, name or path.stem, str(path))


def unique_names(paths: list[Path]) -> list[str]:
    """Labels for the runs: file stems, with the parent folder where stems repeat."""
    stems = [p.stem for p in paths]
    return [f"{p.parent.name}/{p.stem}" if stems.count(p.stem) > 1 else p.stem for p in paths]


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise NetdslError(f"plotting needs matplotlib, which is not installed; {PLOT_HINT}") \
            from None
    matplotlib.use("Agg", force=True)  # files only: no display needed
    import matplotlib.pyplot as plt
    return plt


def save_figure(plt, fig, path, dpi: int = 110) -> None:
    """Write `fig` to `path` (an unwritable path is a NetdslError) and close it."""
    try:
        fig.savefig(path, dpi=dpi)
    except OSError as e:
        raise NetdslError(f"--plot: cannot write {path}: {e}") from None
    finally:
        plt.close(fig)


def require_matplotlib() -> None:
    """Fail now, before a long run, when the plot could not be drawn at its end."""
    _pyplot()


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def figure_png(runs: list[Run]) -> bytes:
    """The 2 x 2 panel figure (loss, accuracy, learning rate, images/s) as PNG bytes."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=FIG_INCHES, dpi=DPI)
    try:
        panels = ((axes[0][0], "loss", "test_loss", "loss"),
                  (axes[0][1], "accuracy", "test_accuracy", "accuracy"),
                  (axes[1][0], "lr", None, "learning rate"),
                  (axes[1][1], "images_per_s", None, "images/s"))
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for ax, key, test_key, title in panels:
            drawn = False
            for k, run in enumerate(runs):
                color = colors[k % len(colors)]
                pts = run.series.get(key, [])
                if pts:
                    xs, ys = zip(*pts)
                    window = max(1, len(ys) // 50)
                    if window > 1:  # noisy per-step values: faint raw, a moving average
                        ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
                        ys = _smooth(list(ys), window)
                    ax.plot(xs, ys, color=color, label=run.name, linewidth=1.5)
                    drawn = True
                tpts = run.series.get(test_key, []) if test_key else []
                if tpts:
                    xs, ys = zip(*tpts)
                    ax.plot(xs, ys, color=color, linestyle="--", marker="o", markersize=3,
                            label=f"{run.name} (test)")
                    drawn = True
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(True, alpha=0.3)
            if drawn:
                ax.legend(fontsize="small")
            else:
                ax.text(0.5, 0.5, "not in the log", ha="center", va="center",
                        transform=ax.transAxes, color="gray")
        for ax, key in ((axes[0][0], "loss"), (axes[1][1], "images_per_s")):
            vals = [v for run in runs for _, v in run.series.get(key, [])]
            if vals and min(vals) > 0 and max(vals) / min(vals) > 100:
                ax.set_yscale("log")  # values over decades (runs on a CPU and a GPU)
        fig.suptitle(", ".join(r.name for r in runs))
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=DPI)
        return buf.getvalue()
    finally:
        plt.close(fig)


def write_png(runs: list[Run], path: str | Path) -> Path:
    return _write(Path(path), figure_png(runs))


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def report_html(runs: list[Run]) -> str:
    """A self-contained page: the figure (inline PNG) and a table of each run's summary."""
    png = base64.b64encode(figure_png(runs)).decode("ascii")
    cols = ("run", "steps", "final_loss", "min_loss", "accuracy", "test_accuracy",
            "final_lr", "images_per_s")
    head = "".join(f"<th>{html.escape(c.replace('_', ' '))}</th>" for c in cols)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.summary()[c]))}</td>"
                                    for c in cols) + "</tr>" for r in runs)
    title = html.escape("netdsl report: " + ", ".join(r.name for r in runs))
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title>"
            "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}</style></head>"
            f"<body><h1>{title}</h1><table><tr>{head}</tr>{rows}</table>"
            f"<p><img alt=\"training curves\" src=\"data:image/png;base64,{png}\"></p>"
            "</body></html>\n")


def write_html(runs: list[Run], path: str | Path) -> Path:
    return _write(Path(path), report_html(runs).encode("utf-8"))


def _write(path: Path, data: bytes) -> Path:
    try:
        path.write_bytes(data)
    except OSError as e:
        raise NetdslError(f"{path}: cannot write it ({e.strerror or e})") from None
    return path
