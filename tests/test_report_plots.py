"""The pictures of hf-cp report and hf-cp plan: whole-step ticks, a named comparison balancer,
no statistic from a handful of points, a heatmap instead of spaghetti beyond 16 ranks, and a
timeline legend that covers no rank."""

import pytest

from hf_cp.report.runs import (
    MAX_RANK_LINES,
    RunSeries,
    draw_imbalance,
    draw_loss,
    draw_rank_times,
    read_run,
    summary_lines,
)


def series(world: int, steps: int, compare: str = "static") -> RunSeries:
    s = RunSeries(source="test", per_step=True, compare_balancer=compare)
    for k in range(steps):
        pred = [100.0 + r + 3 * k for r in range(world)]
        meas = [p * 1.05 + (r % 2) for r, p in enumerate(pred)]
        s.add_point(k + 1, pred, meas)
        s.predicted_imbalance.append(max(pred) / (sum(pred) / world))
        s.measured_imbalance.append(max(meas) / (sum(meas) / world))
        s.cp_size_samples.append({1: 3.0})
        s.loss.append(3.0 - 0.1 * k)
        s.predicted_step_ms.append(max(pred))
        s.compare_step_ms.append(max(pred) * 1.4)
    return s


def visible_ticks(ax):
    lo, hi = sorted(ax.get_xlim())
    return [t for t in ax.get_xticks() if lo - 1e-9 <= t <= hi + 1e-9]


@pytest.mark.parametrize("draw", [draw_rank_times, draw_imbalance, draw_loss])
def test_a_two_step_run_ticks_whole_steps(draw):
    fig = draw(series(2, 2))
    fig.canvas.draw()
    ax = fig.axes[0]
    ticks = visible_ticks(ax)
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_the_comparison_balancer_is_named():
    fig = draw_imbalance(series(2, 6, compare="static"))
    labels = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert any(label.startswith("static") for label in labels), labels
    # unknown (logs of an older run): still said to be the comparison, not left unnamed
    fig = draw_imbalance(series(2, 6, compare=None))
    labels = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert any("comparison balancer" in label for label in labels), labels


def test_no_correlation_from_fewer_than_five_steps():
    short = "\n".join(summary_lines(series(2, 2)))
    assert "not computed from 2 steps (needs at least 5)" in short
    assert "correlation of predicted and measured rank times: 0" not in short
    fig = draw_rank_times(series(2, 2))
    assert "corr " not in fig.axes[1].get_title() and "too few" in fig.axes[1].get_title()
    five = "\n".join(summary_lines(series(2, 5)))
    assert "correlation of predicted and measured rank times: 0.9" in five


def test_beyond_16_ranks_a_heatmap_replaces_one_line_per_rank():
    fig = draw_rank_times(series(MAX_RANK_LINES, 4))
    assert len(fig.axes[0].get_lines()) == 2 * MAX_RANK_LINES and not fig.axes[0].images
    fig = draw_rank_times(series(32, 4))
    ax = fig.axes[0]
    assert len(ax.images) == 1 and not ax.get_lines()
    assert ax.images[0].get_array().shape == (32, 4)  # ranks x steps


def test_the_timeline_legend_covers_no_rank():
    from hf_cp.balance import PlanRequest, get_balancer
    from hf_cp.cost.model import CostModel
    from hf_cp.cost.simulate import simulate
    from hf_cp.plan.cluster import ClusterSpec
    from hf_cp.report.timeline import draw_timeline

    cost = CostModel.load("qwen2.5-7b", "h200-qwen2.5-7b")
    cluster = ClusterSpec(8, 32768, 8)
    lengths = [30000, 20000, 9000] + [800] * 40
    req = PlanRequest(tuple(range(len(lengths))), tuple(lengths), cluster, cost)
    fig = draw_timeline(simulate(get_balancer("dynamic_cp").plan(req), cost))
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent()
    assert not legend.overlaps(ax.get_window_extent()), "the legend sits outside the ranks' rows"


def test_report_reads_the_spread_logged_by_a_new_run(tmp_path):
    """A run whose logs keep only the spread (trainer_state.json): the report still draws it."""
    import json

    from hf_cp.train.measure.metrics import aggregate

    from helpers.step_records import records

    recs = records(32, steps=8)
    entries = [dict(aggregate(recs[k : k + 2]), loss=2.0, step=k + 2) for k in range(0, 8, 2)]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": entries}))
    s = read_run(tmp_path)
    assert s.world == 32 and not s.per_rank and len(s) == 4
    assert s.slowest_rank == [5, 5, 5, 5]
    assert "slowest rank: 5 in 4 of 4 logging intervals" in "\n".join(summary_lines(s))
    fig = draw_rank_times(s)
    assert fig.axes[0].collections, "a min-max band"
