"""`netdsl plan --plot`: device memory over the schedule, stacked by kind, unplanned
(left) against planned (right), with the budget as a line. Needs matplotlib (the `plot`
extra); it lives with the other tools, the one layer allowed to import it."""
from __future__ import annotations

from pathlib import Path

from netdsl.memory.search import PlanResult
from netdsl.memory.simulate import KINDS, simulate
from netdsl.sizes import format_bytes
from netdsl.tooling.curves import _pyplot, save_figure


def plot_memory(res: PlanResult, path: str | Path) -> None:
    plt = _pyplot()
    prep = res.prep
    dec = {prep.pos[k]: d for k, d in res.decisions.items()}
    panels = [("without a plan", simulate(prep, {}, by_kind=True)),
              (f"{res.strategy} plan", simulate(prep, dec, res.prefetch, by_kind=True))]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    gb = 1e9
    for ax, (title, sim) in zip(axes, panels):
        x = range(len(sim.entries))
        layers = [[res.state_bytes / gb] * len(x), [res.workspace_bytes / gb] * len(x)]
        layers += [[b / gb for b in sim.kinds[k]] for k in KINDS]
        ax.stackplot(x, layers, labels=["state (params, buffers, optimizer)", "workspace",
                                        *KINDS], linewidth=0)
        ax.axhline(res.budget_bytes / gb, color="black", linestyle="--", label="budget")
        ax.set_title(f"{res.network}: {title}, peak {format_bytes(sim.peak_bytes)}")
        ax.set_xlabel("schedule step")
        ax.set_ylabel("device memory (GB)")
    axes[1].legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    save_figure(plt, fig, path)
