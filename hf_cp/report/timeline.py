"""Per-rank timeline of one simulated step (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Union

from hf_cp.cost.simulate import SimResult
from hf_cp.figures import pyplot, save_figure


def plot_timeline(sim: SimResult, out: Union[str, Path], title: str = "") -> Path:
    return save_figure(draw_timeline(sim, title), out)


def draw_timeline(sim: SimResult, title: str = ""):
    """One bar row per rank over the step's time; the legend sits outside the axes, right of
    them, so that it covers no rank."""
    plt = pyplot()
    from matplotlib.patches import Patch

    W = sim.world_size
    sizes = sorted({len(r.ranks) for r in sim.runs}) or [1]
    cmap = plt.get_cmap("viridis", max(len(sizes), 2))
    color = {g: cmap(i) for i, g in enumerate(sizes)}
    height = min(max(3.0, 0.18 * W + 1.5), 24.0)
    fig, ax = plt.subplots(figsize=(12, height))
    for run in sim.runs:
        g = len(run.ranks)
        for m, r in enumerate(run.ranks):
            busy = run.member_compute_ms[m] + run.member_comm_ms[m]
            # the group occupies all members for its duration; the member's own work is solid
            ax.barh(r, run.duration_ms, left=run.start_ms, height=0.8, color=color[g], alpha=0.25, linewidth=0)
            ax.barh(
                r,
                busy,
                left=run.start_ms,
                height=0.8,
                color=color[g],
                edgecolor="black",
                linewidth=0.3 if W <= 64 else 0,
            )
    ax.axvline(sim.makespan_ms, color="red", linestyle="--", linewidth=1)
    ax.set_xlabel("time in the step (ms)")
    ax.set_ylabel("rank")
    ax.set_ylim(W - 0.5, -0.5)
    ax.set_title(title or f"per-rank timeline: makespan {sim.makespan_ms:.1f} ms, max/mean {sim.imbalance:.3f}")
    handles = [Patch(color=color[g], label=f"group of {g}") for g in sizes]
    handles.append(Patch(color="grey", alpha=0.25, label="waiting on group / idle inside group"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8)
    return fig
