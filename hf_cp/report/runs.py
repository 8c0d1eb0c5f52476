"""Pictures of a training run: per-step predicted vs measured rank times, imbalance, CP sizes,
and the training and evaluation loss.

A CPTrainer run directory (the Trainer's output_dir) holds the same metrics three ways; the
first found is read (or the one asked for):
  cp_history/rank<R>.jsonl   one JSON line per optimizer step (per-rank lists), every rank
                             writes the same records - the finest source;
  trainer_state.json         the Trainer's log_history, one entry per logging interval with
                             `cp/...` keys averaged over the interval (also in checkpoint-*/);
  runs/*/events.out.tfevents TensorBoard scalars `train/cp/...`, same values as log_history.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from hf_cp.cost.simulate import max_over_mean
from hf_cp.figures import pyplot, save_figure
from hf_cp.readers import load_json
from hf_cp.train.measure.step_record import HistoryError, latest_records

SOURCES = ("history", "trainer-state", "tensorboard")


class RunLogError(ValueError):
    """A run directory has no readable metrics; the message says what was looked for."""


@dataclass
class RunSeries:
    """Per-point metrics: a point is one optimizer step (history) or one logging interval."""

    source: str
    per_step: bool
    steps: List[int] = field(default_factory=list)
    # [point][rank]; empty rows when the source keeps only the spread over ranks (the logs)
    predicted_ms: List[List[float]] = field(default_factory=list)
    measured_ms: List[List[float]] = field(default_factory=list)
    # [point] = (min, mean, max) over ranks
    predicted_spread: List[Tuple[float, float, float]] = field(default_factory=list)
    measured_spread: List[Tuple[float, float, float]] = field(default_factory=list)
    slowest_rank: List[Optional[int]] = field(default_factory=list)
    predicted_imbalance: List[float] = field(default_factory=list)  # max/mean over ranks
    measured_imbalance: List[float] = field(default_factory=list)
    cp_size_samples: List[Dict[int, float]] = field(default_factory=list)
    loss: List[Optional[float]] = field(default_factory=list)
    predicted_step_ms: List[Optional[float]] = field(default_factory=list)
    compare_step_ms: List[Optional[float]] = field(default_factory=list)
    compare_balancer: Optional[str] = None  # the balancer compare_step_ms is of, when recorded
    world_size: int = 0
    # evaluation name ("eval", "eval_chat", ...) -> [(optimizer step, loss)], from log_history
    eval_loss: Dict[str, List[Tuple[int, float]]] = field(default_factory=dict)
    # per-step history only: (first step, last step, torchrun attempt, checkpoint step resumed
    # from or None) for each stretch trained by one process launch
    segments: List[Tuple[int, int, int, Optional[int]]] = field(default_factory=list)

    @property
    def world(self) -> int:
        if self.world_size:
            return self.world_size
        return len(self.measured_ms[0]) if self.measured_ms else 0

    @property
    def per_rank(self) -> bool:
        """Every point has each rank's numbers (not only their spread)."""
        return bool(self.measured_ms) and all(self.measured_ms)

    def add_point(self, step: int, predicted: List[float], measured: List[float]) -> None:
        """A point with per-rank numbers: the spread and the slowest rank follow from them."""
        self.steps.append(int(step))
        self.predicted_ms.append(predicted)
        self.measured_ms.append(measured)
        self.predicted_spread.append(_spread(predicted))
        self.measured_spread.append(_spread(measured))
        self.slowest_rank.append(max(range(len(measured)), key=lambda k: (measured[k], -k)))

    def __len__(self) -> int:
        return len(self.steps)


# points fewer than this give no correlation (or other statistic): 2 steps make any two series look related
MIN_POINTS_FOR_STATISTICS = 5
# beyond this many ranks the per-rank time plot is a rank x step heatmap, not one line per rank
MAX_RANK_LINES = 16


def _spread(values: List[float]) -> Tuple[float, float, float]:
    return (min(values), statistics.mean(values), max(values))


# ------------------------------------------------------------------------------ readers
def read_history(run_dir: Path) -> RunSeries:
    files = sorted((run_dir / "cp_history").glob("rank*.jsonl"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    if not files:
        raise RunLogError(f"{run_dir}: no cp_history/rank*.jsonl")
    try:  # every rank records the same step metrics
        records = latest_records(files[0])
    except HistoryError as e:
        raise RunLogError(str(e)) from None
    s = RunSeries(source=str(files[0].relative_to(run_dir)), per_step=True)
    for r in records:
        pred, meas = [float(x) for x in r.predicted_ms], [float(x) for x in r.measured_ms]
        s.add_point(r.global_step, pred, meas)
        s.compare_balancer = r.compare_balancer or s.compare_balancer
        s.predicted_imbalance.append(max_over_mean(pred))
        s.measured_imbalance.append(max_over_mean(meas))
        s.cp_size_samples.append({int(g): float(n) for g, n in (r.cp_size_samples or {}).items()})
        s.loss.append(r.loss)
        s.predicted_step_ms.append(r.predicted_step_ms)
        s.compare_step_ms.append(r.compare_step_ms)
        run = (int(r.attempt or 0), r.resumed_from)
        if s.segments and s.segments[-1][2:] == run:
            s.segments[-1] = (s.segments[-1][0], s.steps[-1]) + run
        else:
            s.segments.append((s.steps[-1], s.steps[-1]) + run)
    return s


def _series_from_logs(entries: List[dict], source: str, prefix: str) -> RunSeries:
    """Entries: dicts with `step` and the keys metrics.aggregate logs: the spread over ranks
    (`<prefix>measured_max_ms`, ..._mean_ms, ..._min_ms, the same for predicted, slowest_rank,
    world_size), or, from hf_cp versions that logged every rank, `<prefix>measured_ms_rank<k>`."""
    rank_key = re.compile(re.escape(prefix) + r"measured_ms_rank(\d+)$")
    size_key = re.compile(re.escape(prefix) + r"cp_size(\d+)_samples$")
    s = RunSeries(source=source, per_step=False)
    for e in sorted(entries, key=lambda e: e["step"]):
        ranks = sorted(int(m.group(1)) for k in e if (m := rank_key.match(k)))
        g = lambda name, e=e: e.get(prefix + name)  # noqa: E731
        if ranks:  # an older log line with every rank's numbers
            meas = [float(e[f"{prefix}measured_ms_rank{k}"]) for k in ranks]
            pred = [float(e.get(f"{prefix}predicted_ms_rank{k}", 0.0)) for k in ranks]
            s.add_point(e["step"], pred, meas)
            meas_ratio, pred_ratio = max_over_mean(meas), max_over_mean(pred)
        elif g("measured_max_ms") is not None and g("measured_mean_ms") is not None:
            s.steps.append(int(e["step"]))
            s.measured_ms.append([])
            s.predicted_ms.append([])
            mean = float(g("measured_mean_ms"))
            s.measured_spread.append((float(g("measured_min_ms") or mean), mean, float(g("measured_max_ms"))))
            pmean = float(g("predicted_mean_ms") or 0.0)
            s.predicted_spread.append(
                (float(g("predicted_min_ms") or pmean), pmean, float(g("predicted_max_ms") or pmean))
            )
            s.slowest_rank.append(int(g("slowest_rank")) if g("slowest_rank") is not None else None)
            s.world_size = int(g("world_size") or s.world_size)
            meas_ratio = s.measured_spread[-1][2] / mean if mean > 0 else 1.0
            pred_ratio = s.predicted_spread[-1][2] / pmean if pmean > 0 else 1.0
        else:
            continue
        # the logged ratios are means of per-step ratios, finer than the ratio of the means
        s.measured_imbalance.append(float(g("measured_max_over_mean") or meas_ratio))
        s.predicted_imbalance.append(float(g("predicted_max_over_mean") or pred_ratio))
        s.cp_size_samples.append({int(m.group(1)): float(v) for k, v in e.items() if (m := size_key.match(k))})
        s.loss.append(e.get("loss", e.get("train/loss")))
        s.predicted_step_ms.append(g("predicted_step_ms"))
        s.compare_step_ms.append(g("compare_predicted_step_ms"))
    if not s.steps:
        raise RunLogError(f"{source}: no entries with {prefix}measured_max_ms (was the run trained with CPTrainer?)")
    return s


def _log_history(run_dir: Path):
    """(path, log_history) of the newest trainer_state.json: the run's own, else the last checkpoint's."""
    cands = [run_dir / "trainer_state.json"] + sorted(
        run_dir.glob("checkpoint-*/trainer_state.json"),
        key=lambda p: int(re.sub(r"\D", "", p.parent.name) or 0),
        reverse=True,
    )
    path = next((p for p in cands if p.exists()), None)
    if path is None:
        raise RunLogError(f"{run_dir}: no trainer_state.json (nor in checkpoint-*/)")
    try:
        return path, load_json(path.read_text())["log_history"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise RunLogError(f"{path}: no readable log_history ({e})") from None


def read_trainer_state(run_dir: Path) -> RunSeries:
    path, hist = _log_history(run_dir)
    return _series_from_logs([e for e in hist if "step" in e], str(path.relative_to(run_dir)), "cp/")


EVAL_LOSS_KEY = re.compile(r"^(eval(?:_.+)?)_loss$")


def read_eval_losses(run_dir: Path) -> Dict[str, List[Tuple[int, float]]]:
    """Evaluation losses logged by the Trainer ({name}_loss), by evaluation name; {} when the
    run has no trainer_state.json or did not evaluate."""
    try:
        _, hist = _log_history(run_dir)
    except RunLogError:
        return {}
    out: Dict[str, List[Tuple[int, float]]] = {}
    for e in hist:
        for k, v in e.items():
            m = EVAL_LOSS_KEY.match(k)
            if m and "step" in e and isinstance(v, (int, float)):
                out.setdefault(m.group(1), []).append((int(e["step"]), float(v)))
    return out


def read_tensorboard(run_dir: Path) -> RunSeries:
    files = sorted(run_dir.rglob("events.out.tfevents.*"))
    if not files:
        raise RunLogError(f"{run_dir}: no TensorBoard event files")
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise RunLogError(f"{run_dir}: reading TensorBoard events needs the tensorboard package") from None
    by_step: Dict[int, dict] = {}
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            for ev in acc.Scalars(tag):
                by_step.setdefault(int(ev.step), {"step": int(ev.step)})[tag] = float(ev.value)
    # the Trainer's TensorBoard callback prefixes training logs with "train/"
    for e in by_step.values():
        if "train/loss" in e:
            e["loss"] = e["train/loss"]
    rel = ", ".join(str(f.relative_to(run_dir)) for f in files[:2]) + (" ..." if len(files) > 2 else "")
    return _series_from_logs(list(by_step.values()), rel, "train/cp/")


READERS = {"history": read_history, "trainer-state": read_trainer_state, "tensorboard": read_tensorboard}


def read_run(run_dir: Union[str, Path], source: str = "auto") -> RunSeries:
    d = Path(run_dir)
    if not d.is_dir():
        raise RunLogError(f"run directory {d} does not exist")
    if source != "auto":
        if source not in READERS:
            raise RunLogError(f"unknown source {source!r}; choose auto or one of {', '.join(SOURCES)}")
        s = READERS[source](d)
    else:
        tried = []
        for name in SOURCES:
            try:
                s = READERS[name](d)
                break
            except RunLogError as e:
                tried.append(str(e))
        else:
            raise RunLogError("no CP metrics found: " + "; ".join(tried))
    s.eval_loss = read_eval_losses(d)
    return s


# ------------------------------------------------------------------------------ summary and plots
def summary_lines(s: RunSeries) -> List[str]:
    unit = "steps" if s.per_step else "logging intervals"
    lines = [f"{len(s)} {unit} from {s.source}, {s.world} ranks"]
    lines.append(
        f"per-rank time, mean: predicted {statistics.mean(p[1] for p in s.predicted_spread):.1f} ms, "
        f"measured {statistics.mean(m[1] for m in s.measured_spread):.1f} ms"
    )
    if s.per_rank:
        pairs = rank_time_pairs(s)
        if len(s) < MIN_POINTS_FOR_STATISTICS:
            lines.append(
                f"correlation of predicted and measured rank times: not computed from {len(s)} {unit} "
                f"(needs at least {MIN_POINTS_FOR_STATISTICS})"
            )
        elif len({p for p, _ in pairs}) > 1 and len({m for _, m in pairs}) > 1:
            lines.append(f"correlation of predicted and measured rank times: {correlation(pairs):.3f}")
    lines.append(
        f"max/mean over ranks, mean over {unit}: predicted {statistics.mean(s.predicted_imbalance):.3f}, "
        f"measured {statistics.mean(s.measured_imbalance):.3f}"
    )
    slow = [r for r in s.slowest_rank if r is not None]
    if slow and s.world > 1:
        rank, n = Counter(slow).most_common(1)[0]
        lines.append(f"slowest rank: {rank} in {n} of {len(slow)} {unit}")
    total: Dict[int, float] = {}
    for h in s.cp_size_samples:
        for g, n in h.items():
            total[g] = total.get(g, 0.0) + n
    if total:
        lines.append("samples per CP size: " + " ".join(f"{g}:{n:g}" for g, n in sorted(total.items())))
    if len(s.segments) > 1:

        def how(attempt, resumed):
            start = f"resumed from checkpoint-{resumed}" if resumed is not None else "fresh start"
            return start + (f", torchrun restart {attempt}" if attempt else "")

        lines.append(
            f"trained in {len(s.segments)} runs: "
            + "; ".join(f"steps {a}-{b} ({how(attempt, resumed)})" for a, b, attempt, resumed in s.segments)
        )
    losses = [v for v in s.loss if v is not None]
    if losses:
        lines.append(f"training loss: {losses[0]:.4f} at step {s.steps[0]} -> {losses[-1]:.4f} at step {s.steps[-1]}")
    for name, points in sorted(s.eval_loss.items()):
        lines.append(
            f"{name} loss: {points[0][1]:.4f} at step {points[0][0]} -> {points[-1][1]:.4f} at step "
            f"{points[-1][0]} ({len(points)} evaluations)"
        )
    return lines


def rank_time_pairs(s: RunSeries) -> List[Tuple[float, float]]:
    """(predicted, measured) of every (point, rank)."""
    return [(p, m) for ps, ms in zip(s.predicted_ms, s.measured_ms) for p, m in zip(ps, ms)]


def correlation(pairs) -> float:
    xs, ys = [p for p, _ in pairs], [m for _, m in pairs]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else float("nan")


def integer_steps(ax) -> None:
    """Step axes show whole steps only (a 2-step run would otherwise tick at 1.25, 1.5, ...)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _step_label(s: RunSeries) -> str:
    return "optimizer step" if s.per_step else "optimizer step (end of logging interval)"


def draw_rank_times(s: RunSeries):
    """Per-rank time per step, measured vs predicted: one line per rank up to MAX_RANK_LINES
    ranks, a rank x step heatmap beyond, the min/mean/max band when the source keeps only the
    spread; beside it, predicted against measured for every (step, rank)."""
    plt = pyplot()
    W = s.world
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2, 1]})
    x = s.steps
    if s.per_rank and W <= MAX_RANK_LINES:
        cmap = plt.get_cmap("tab10" if W <= 10 else "tab20", max(W, 2))
        for r in range(W):
            c = cmap(r)
            ax1.plot(x, [m[r] for m in s.measured_ms], "-o", color=c, ms=3, label=f"rank {r}")
            ax1.plot(x, [p[r] for p in s.predicted_ms], "--", color=c, alpha=0.7)
        ax1.set_title("per-rank time: measured (solid) vs predicted (dashed)")
        ax1.legend(fontsize=7, ncol=2 if W > 8 else 1, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax1.set_ylabel("compute time per step (ms)")
        integer_steps(ax1)
        ax1.set_xlabel(_step_label(s))
    elif s.per_rank:
        # rows are ranks, columns steps: a straggler is a bright cell, a slow rank a bright row
        grid = [[m[r] for m in s.measured_ms] for r in range(W)]
        im = ax1.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis", origin="upper")
        fig.colorbar(im, ax=ax1, label="measured compute per step (ms)")
        cols = list(range(len(x)))
        shown = cols if len(cols) <= 20 else cols[:: max(1, len(cols) // 10)]
        ax1.set_xticks(shown, [str(x[k]) for k in shown])
        ax1.set_ylabel("rank")
        ax1.set_xlabel(_step_label(s))
        ax1.set_title(f"measured time per rank and step ({W} ranks)")
    else:
        for spread, style, name in ((s.measured_spread, "-", "measured"), (s.predicted_spread, "--", "predicted")):
            ax1.fill_between(x, [v[0] for v in spread], [v[2] for v in spread], alpha=0.2)
            ax1.plot(x, [v[1] for v in spread], style, marker="o", ms=3, label=f"{name}: mean (band: min-max)")
        ax1.set_title(f"time over {W} ranks, mean per logging interval")
        ax1.set_ylabel("compute time per step (ms)")
        ax1.legend(fontsize=8)
        integer_steps(ax1)
        ax1.set_xlabel(_step_label(s))
    if s.per_rank:
        pairs = rank_time_pairs(s)
        ax2.scatter([p for p, _ in pairs], [m for _, m in pairs], s=10, alpha=0.7)
        hi = max(max(p for p, _ in pairs), max(m for _, m in pairs), 1e-9)
        ax2.plot([0, hi], [0, hi], color="grey", linewidth=0.8, linestyle=":")
        ax2.set_xlabel("predicted (ms)")
        ax2.set_ylabel("measured (ms)")
        if len(s) >= MIN_POINTS_FOR_STATISTICS:
            ax2.set_title(f"every (step, rank); corr {correlation(pairs):.2f}")
        else:
            ax2.set_title(f"every (step, rank); {len(s)} steps, too few for a correlation")
    else:
        ax2.plot([v[2] for v in s.predicted_spread], [v[2] for v in s.measured_spread], "o", ms=4)
        ax2.set_xlabel("slowest rank, predicted (ms)")
        ax2.set_ylabel("slowest rank, measured (ms)")
        ax2.set_title("per logging interval")
    return fig


def plot_rank_times(s: RunSeries, out: Path) -> Path:
    return save_figure(draw_rank_times(s), out)


def draw_imbalance(s: RunSeries):
    plt = pyplot()
    has_step = any(v is not None for v in s.predicted_step_ms)
    fig, axes = plt.subplots(1, 2 if has_step else 1, figsize=(13 if has_step else 8, 4.5), squeeze=False)
    ax = axes[0][0]
    ax.plot(s.steps, s.measured_imbalance, "-o", ms=3, label="measured")
    ax.plot(s.steps, s.predicted_imbalance, "--s", ms=3, label="predicted")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel(_step_label(s))
    integer_steps(ax)
    ax.set_ylabel("max / mean rank time")
    ax.set_title("load imbalance (1.0 = perfectly balanced)")
    ax.legend()
    if has_step:
        ax = axes[0][1]
        ax.plot(
            s.steps,
            [v if v is not None else float("nan") for v in s.predicted_step_ms],
            "-o",
            ms=3,
            label="planned (predicted)",
        )
        if any(v is not None for v in s.compare_step_ms):
            name = s.compare_balancer or "comparison balancer"
            ax.plot(
                s.steps,
                [v if v is not None else float("nan") for v in s.compare_step_ms],
                "--",
                ms=3,
                label=f"{name} (predicted, not run)",
            )
        ax.plot(s.steps, [v[2] for v in s.measured_spread], ":^", ms=3, label="slowest rank (measured)")
        ax.set_xlabel(_step_label(s))
        integer_steps(ax)
        ax.set_ylabel("ms")
        ax.set_title("step time")
        ax.legend(fontsize=8)
    return fig


def plot_imbalance(s: RunSeries, out: Path) -> Path:
    return save_figure(draw_imbalance(s), out)


def plot_cp_sizes(s: RunSeries, out: Path) -> Path:
    plt = pyplot()
    sizes = sorted({g for h in s.cp_size_samples for g in h})
    fig, ax = plt.subplots(figsize=(10, 4.5))
    if not sizes:
        ax.text(0.5, 0.5, "no CP-size counts in the logs", ha="center", va="center", transform=ax.transAxes)
        return save_figure(fig, out)
    cmap = plt.get_cmap("viridis", max(len(sizes), 2))
    bottom = [0.0] * len(s.steps)
    xs = list(range(len(s.steps)))
    for i, g in enumerate(sizes):
        vals = [h.get(g, 0.0) for h in s.cp_size_samples]
        ax.bar(xs, vals, bottom=bottom, color=cmap(i), label=f"CP size {g}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(xs, [str(t) for t in s.steps], rotation=90 if len(xs) > 30 else 0, fontsize=7)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("samples")
    ax.set_title("samples per CP group size" + ("" if s.per_step else " (per logging interval)"))
    ax.legend(fontsize=8)
    return save_figure(fig, out)


def draw_loss(s: RunSeries):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    pts = [(x, v) for x, v in zip(s.steps, s.loss) if v is not None]
    if pts:
        ax.plot(
            [x for x, _ in pts],
            [v for _, v in pts],
            "-",
            marker="o" if len(pts) < 60 else None,
            ms=3,
            label="training" + ("" if s.per_step else " (logging intervals)"),
        )
    for name, points in sorted(s.eval_loss.items()):
        ax.plot([x for x, _ in points], [v for _, v in points], "--s", ms=5, label=name)
    for k, segment in enumerate(s.segments[1:]):  # where a restarted or relaunched run took over
        ax.axvline(segment[0] - 0.5, color="grey", ls=":", lw=1, label="resumed" if k == 0 else None)
    ax.set_xlabel("optimizer step")
    integer_steps(ax)
    ax.set_ylabel("loss per valid token")
    ax.set_title("loss")
    ax.legend()
    return fig


def plot_loss(s: RunSeries, out: Path) -> Path:
    return save_figure(draw_loss(s), out)


def write_report(s: RunSeries, out_dir: Union[str, Path]) -> List[Path]:
    d = Path(out_dir)
    paths = [
        plot_rank_times(s, d / "rank_times.png"),
        plot_imbalance(s, d / "imbalance.png"),
        plot_cp_sizes(s, d / "cp_sizes.png"),
    ]
    if any(v is not None for v in s.loss) or s.eval_loss:
        paths.append(plot_loss(s, d / "loss.png"))
    return paths
