"""Per-step measurements of a CP training run and their aggregation for logs and summaries."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Dict, List, Mapping, Optional, Sequence

import torch

from hf_cp.cost.flops import DevicePeak, ModelFlops, achieved_tflops, device_peak, mfu
from hf_cp.cost.simulate import max_over_mean
from hf_cp.samples.masks import SampleMask
from hf_cp.train.data.collator import RankStep
from hf_cp.train.measure.record_builder import step_model_flops
from hf_cp.train.measure.step_record import StepRecord


def device_name(device: torch.device) -> str:
    """What a device calls itself: the GPU's name on CUDA (its peak is looked up by it), else the
    device type ("cpu")."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


class StepThroughput:
    """Model FLOPs of every step (cost/flops.py) and the peak they are measured against: what
    turns the step records' wall times into achieved TFLOP/s and MFU for the logs (`cp/tflops`,
    `cp/mfu`) and the run summary. The records carry no FLOPs: the trainer hands every step here
    as it records it (`observe`), and the aggregations look the FLOPs up by step index."""

    def __init__(self, model: ModelFlops, peak: DevicePeak):
        self.model = model
        self.peak = peak
        self.step_flops: Dict[int, float] = {}  # StepRecord.index -> the step's model FLOPs

    @classmethod
    def for_model(cls, model_config, device: torch.device) -> StepThroughput:
        """From the model's transformers config (a PretrainedConfig or its dict) and the run's device."""
        config = model_config.to_dict() if hasattr(model_config, "to_dict") else model_config
        return cls(ModelFlops.from_config(config), device_peak(device_name(device)))

    def observe(self, step: RankStep, masks: Mapping[int, SampleMask]) -> None:
        """Count the model FLOPs of `step` (its samples under `masks`, by sample id)."""
        self.step_flops[step.index] = step_model_flops(step, self.model, masks)

    def entries(self, records: Sequence[StepRecord]) -> Dict[str, float]:
        """`tflops` (model TFLOP/s per GPU) and, with a known peak, `mfu` (a fraction of it) over
        the steps of `records` whose FLOPs were observed; {} when none was."""
        counted = [r for r in records if r.index in self.step_flops]
        wall_s = sum(r.step_wall_ms for r in counted) / 1e3
        if not counted or wall_s <= 0:
            return {}
        flops, gpus = sum(self.step_flops[r.index] for r in counted), len(counted[0].measured_ms)
        out = {"tflops": achieved_tflops(flops, wall_s, gpus)}
        util = mfu(flops, wall_s, gpus, self.peak)
        if util is not None:
            out["mfu"] = util
        return out

    def summary_line(self, records: Sequence[StepRecord]) -> Optional[str]:
        got = self.entries(records)
        if not got:
            return None
        gpus = len(records[0].measured_ms)
        line = (
            f"model FLOPs: {got['tflops']:.3g} TFLOP/s per {'GPU' if self.peak.tflops else 'device'} over "
            f"{gpus} rank(s) (6 x matmul parameters per token + attention over the masked area; recompute not "
            f"counted; time: the steps' wall clock)"
        )
        if "mfu" in got:
            return line + f", MFU {100 * got['mfu']:.1f}% of the {self.peak.describe()}"
        return line + f"; MFU not reported: {self.peak.describe()}"


def aggregate(
    records: Sequence[StepRecord], prefix: str = "cp/", throughput: Optional[StepThroughput] = None
) -> Dict[str, float]:
    """Log entries for the steps in `records` (one StepRecord per step); with `throughput`, also
    the model TFLOP/s per GPU (`tflops`) and the MFU (`mfu`, where the device's peak is known)."""
    if not records:
        return {}
    world = len(records[0].measured_ms)
    wall_s = sum(r.step_wall_ms for r in records) / 1e3
    # per-rank values stay in the history files and the reports; a log line keeps their spread
    # (max, mean, min) and the slowest rank: a fixed number of keys at any world size
    out: Dict[str, float] = {
        "tokens_per_s": sum(r.global_tokens for r in records) / wall_s if wall_s > 0 else 0.0,
        "measured_max_over_mean": statistics.mean(max_over_mean(r.measured_ms) for r in records),
        "predicted_max_over_mean": statistics.mean(max_over_mean(r.predicted_ms) for r in records),
        "measured_max_ms": statistics.mean(max(r.measured_ms) for r in records),
        "measured_mean_ms": statistics.mean(statistics.mean(r.measured_ms) for r in records),
        "measured_min_ms": statistics.mean(min(r.measured_ms) for r in records),
        "predicted_max_ms": statistics.mean(max(r.predicted_ms) for r in records),
        "predicted_mean_ms": statistics.mean(statistics.mean(r.predicted_ms) for r in records),
        "predicted_min_ms": statistics.mean(min(r.predicted_ms) for r in records),
        "slowest_rank": slowest_rank(records),
        "world_size": world,
        "predicted_step_ms": statistics.mean(r.predicted_step_ms for r in records),
        "planner_ms": statistics.mean(r.planner_ms for r in records),
        "waves": statistics.mean(r.waves for r in records),
        "step_wall_ms": statistics.mean(r.step_wall_ms for r in records),
        "data_epoch": records[-1].data_epoch if records[-1].data_epoch is not None else records[-1].epoch,
    }
    # the comparison balancer's prediction, on the steps that ran the run's own balancer
    compared = [r.compare_step_ms for r in records if not r.ran_compare]
    if compared and all(c is not None for c in compared):
        out["compare_predicted_step_ms"] = statistics.mean(compared)
    hist: Counter = Counter()
    for r in records:
        hist.update({int(g): n for g, n in r.cp_size_samples.items()})
    for g, n in sorted(hist.items()):
        out[f"cp_size{g}_samples"] = float(n)
    if throughput is not None:
        out.update(throughput.entries(records))
    return {prefix + k: float(v) for k, v in out.items()}


def rank_means(records: Sequence[StepRecord], what: str = "measured_ms") -> List[float]:
    """Per rank: the mean over `records` of its measured (or predicted) time."""
    world = len(getattr(records[0], what))
    return [statistics.mean(getattr(r, what)[k] for r in records) for k in range(world)]


def slowest_rank(records: Sequence[StepRecord]) -> int:
    """The rank with the most measured compute over `records`: the one the others waited for."""
    totals = [sum(col) for col in zip(*(r.measured_ms for r in records))]
    return max(range(len(totals)), key=lambda k: (totals[k], -k))


# per-rank numbers in the end-of-run summary up to this many ranks; beyond, their spread
SUMMARY_MAX_RANKS = 16


def summary_lines(
    records: Sequence[StepRecord], balancer: str, compare: str = "", throughput: Optional[StepThroughput] = None
) -> List[str]:
    """Human-readable end-of-run summary (printed by the main job on rank 0); with `throughput`,
    a line of model TFLOP/s and MFU (with the peak it is a fraction of)."""
    if not records:
        return ["no steps were trained"]
    n = len(records)
    head = max(1, min(3, n // 4 or 1))
    loss_first = statistics.mean(r.loss for r in records[:head])
    loss_last = statistics.mean(r.loss for r in records[-head:])
    agg = aggregate(records, prefix="")
    lines = [
        f"steps {n}, samples {sum(r.num_samples for r in records)}, tokens {sum(r.global_tokens for r in records)}, "
        f"{agg['tokens_per_s']:.0f} tokens/s",
        f"loss: first {head} step(s) {loss_first:.4f} -> last {head} step(s) {loss_last:.4f}"
        f" ({'down' if loss_last < loss_first else 'NOT down'})",
        *balance_lines(records, balancer, compare),
        f"planner {agg['planner_ms']:.1f} ms/step (planned ahead, off the training thread), waves/step {agg['waves']:.2f}, cp-size:samples "
        + " ".join(
            f"{k[len('cp_size') : -len('_samples')]}:{int(v)}" for k, v in agg.items() if k.startswith("cp_size")
        ),
    ]
    chunked = [r.chunked for r in records if r.chunked]
    if chunked:
        lines.append(
            f"ChunkFlow: {sum(c['samples'] for c in chunked)} sample(s) in {len(chunked)} step(s) ran as "
            f"{sum(c['chunks'] for c in chunked)} dependent chunks on one rank each (chunks of at most "
            f"{max(c['max_chunk_tokens'] for c in chunked)} tokens, K={max(c['keep'] for c in chunked)}; "
            f"{sum(c['recomputed'] for c in chunked)} recomputed in backward) instead of a CP group"
        )
    flops_line = throughput.summary_line(records) if throughput is not None else None
    return lines + memory_lines(records) + wall_clock_lines(records) + ([flops_line] if flops_line else [])


def balance_lines(records: Sequence[StepRecord], balancer: str, compare: str = "") -> List[str]:
    """The balance of the steps of `records` (every trainer's summary has these lines): per-rank
    compute max/mean predicted and measured, each rank's mean (or their spread and the slowest
    rank), and the step time `compare` (the comparison balancer) was predicted to take."""
    own = [r for r in records if not r.ran_compare]  # cp_compare_measured: the other steps ran `compare`
    if not own:
        return [measured_comparison_line(records, balancer, compare)]
    agg = aggregate(own, prefix="")
    lines = [
        f"balance ({balancer}): per-rank compute max/mean predicted {agg['predicted_max_over_mean']:.3f}, "
        f"measured {agg['measured_max_over_mean']:.3f}",
        per_rank_line(own),
    ]
    if len(own) < len(records):
        lines.append(measured_comparison_line(records, balancer, compare))
    elif compare and "compare_predicted_step_ms" in agg:
        ours, theirs = agg["predicted_step_ms"], agg["compare_predicted_step_ms"]
        lines.append(
            f"predicted step time: {balancer} {ours:.1f} ms, {compare} would take {theirs:.1f} ms "
            f"({theirs / ours if ours else float('nan'):.2f}x; predicted only: {compare} was not run; "
            f"a run with cp_balancer: {compare} measures it)"
        )
    return lines


def measured_comparison_line(records: Sequence[StepRecord], balancer: str, compare: str) -> str:
    """cp_compare_measured: the measured time of the steps that ran `balancer`'s plan against
    that of the steps that ran `compare`'s (they alternate), after the first step of `records`
    (its start-up: the allocator, the engine's first pass). The steps differ in size (an epoch's
    last step may hold a few samples), so each side's measured time is taken per ms that
    `balancer`'s plan was predicted to take on the same steps (every step is planned by both):
    the ratio of the two is the measured `compare` / `balancer` on equal work, beside the
    predicted ratio on the same steps. Each side's ratio is of predictions by one cost model: a
    step planned with a calibration only the other side's steps were planned with is left out
    (with the early scale, step 2 alone ran `compare` on the profile as given, 2x off: with it a
    DPO run read static / auto 0.923x, without it 1.095x)."""
    compare = compare or next(r.balancer for r in records if r.ran_compare)
    # each step's prediction of both plans: the one that ran, and the other (compare_step_ms)
    later = [r for r in records[1:] if r.compare_step_ms is not None]
    both = {r.calibration for r in later if r.ran_compare} & {r.calibration for r in later if not r.ran_compare}
    if not both:
        n_own = sum(not r.ran_compare for r in later)
        return (
            f"measured in this run: too few steps to compare {balancer} and {compare} after the first "
            f"({n_own} and {len(later) - n_own}"
            + (", planned with different cost models" if n_own and len(later) > n_own else "")
            + "): cp_compare_measured needs at least 3 steps"
        )
    left_out = sum(r.calibration not in both for r in later)
    later = [r for r in later if r.calibration in both]
    own = [(r.step_wall_ms, r.predicted_step_ms) for r in later if not r.ran_compare]
    ran = [(r.step_wall_ms, r.compare_step_ms) for r in later if r.ran_compare]
    own_ms, own_pred = map(sum, zip(*own))
    ran_ms, ran_own_pred = map(sum, zip(*ran))
    per_own, per_ran = own_ms / own_pred, ran_ms / ran_own_pred
    pred_own = sum(r.compare_step_ms if r.ran_compare else r.predicted_step_ms for r in later)
    pred_ran = sum(r.predicted_step_ms if r.ran_compare else r.compare_step_ms for r in later)
    unpaired = f" ({left_out} step(s) planned with a cost model only one side's steps had left out)" if left_out else ""
    return (
        f"measured in this run, steps alternating after the first{unpaired}: {balancer} {own_ms:.0f} ms over "
        f"{len(own)} step(s) it was predicted to take {own_pred:.0f} ms ({per_own:.3f}x), {compare} "
        f"{ran_ms:.0f} ms over {len(ran)} step(s) {balancer} was predicted to take {ran_own_pred:.0f} ms "
        f"({per_ran:.3f}x): {compare} / {balancer} {per_ran / per_own:.3f}x measured on equal work, "
        f"{pred_ran / pred_own:.3f}x predicted on the same steps"
    )


def memory_lines(records: Sequence[StepRecord]) -> List[str]:
    """The largest measured peak memory of any rank in any step (CUDA runs only) beside what the
    memory model predicted for that rank and step."""
    measured = [(gb, r, k) for r in records for k, gb in enumerate(r.peak_memory_gb)]
    if not measured:
        return []
    gb, rec, rank = max(measured, key=lambda m: m[0])
    pred = rec.predicted_peak_memory_gb[rank] if rank < len(rec.predicted_peak_memory_gb) else float("nan")
    return [
        f"peak memory: measured {gb:.2f} GB (rank {rank}, step {rec.index + 1}; CUDA max allocated in the step), "
        f"memory model {pred:.2f} GB for that rank's plan ({100 * (pred - gb) / gb:+.0f}%)"
    ]


def _relative_errors(pairs) -> List[float]:
    return [abs(p - m) / m for p, m in pairs if m > 0]


def prediction_errors(records: Sequence[StepRecord]) -> Dict[str, float]:
    """Median relative errors of the predictions of `records`: per-rank compute (over every rank
    with work in every step) and step wall time."""
    compute = _relative_errors((p, m) for r in records for p, m in zip(r.predicted_ms, r.measured_ms))
    wall = _relative_errors((r.predicted_step_ms, r.step_wall_ms) for r in records)
    return {
        "compute": statistics.median(compute) if compute else float("nan"),
        "wall": statistics.median(wall) if wall else float("nan"),
    }


def _span(records: Sequence[StepRecord]) -> str:
    return f"steps {records[0].index + 1}-{records[-1].index + 1}"


def wall_clock_lines(records: Sequence[StepRecord]) -> List[str]:
    """Measured wall clock beside the prediction, and the prediction error before and after the
    online calibration (prediction_error_line)."""
    wall_ms = statistics.mean(r.step_wall_ms for r in records)
    tokens_s = sum(r.global_tokens for r in records) / (sum(r.step_wall_ms for r in records) / 1e3 or float("nan"))
    latest = max(r.calibration for r in records)
    last = [r for r in records if r.calibration > 0] or records
    pred_ms = statistics.mean(r.predicted_step_ms for r in last)
    return [
        f"wall clock, measured: {tokens_s:.0f} tokens/s, {wall_ms:.0f} ms/step; predicted step "
        f"{pred_ms:.0f} ms against {statistics.mean(r.step_wall_ms for r in last):.0f} ms measured "
        f"({_span(last)}{', calibrated' if latest else ''})",
        prediction_error_line(records),
    ]


def prediction_error_line(records: Sequence[StepRecord]) -> str:
    """The median prediction error of `records` with the profile as given and, once the online
    calibration refitted it, with the fits (StepRecord.calibration: the cost model each step was
    planned with)."""
    latest = max(r.calibration for r in records)
    first = [r for r in records if r.calibration == 0]
    e0 = prediction_errors(first)
    if latest == 0:
        return (
            f"prediction error (median |predicted - measured| / measured): per-rank compute {100 * e0['compute']:.1f}%, "
            f"step wall {100 * e0['wall']:.1f}% (not calibrated: cp_calibrate off or too few steps)"
        )
    last = [r for r in records if r.calibration > 0]
    e1 = prediction_errors(last)
    return (
        f"prediction error (median |predicted - measured| / measured): per-rank compute "
        f"{100 * e0['compute']:.1f}% with the profile as given ({_span(first)}) -> {100 * e1['compute']:.1f}% "
        f"calibrated ({_span(last)}, {latest} calibration(s)); step wall {100 * e0['wall']:.1f}% -> "
        f"{100 * e1['wall']:.1f}%"
    )


def per_rank_line(records: Sequence[StepRecord]) -> str:
    """Per-rank compute, mean per step: every rank up to SUMMARY_MAX_RANKS, else min/mean/max and
    the slowest rank (the history files keep every rank's numbers)."""
    pred, meas = rank_means(records, "predicted_ms"), rank_means(records, "measured_ms")
    if len(meas) <= SUMMARY_MAX_RANKS:
        return (
            "per-rank compute, mean per step (ms): predicted "
            + " ".join(f"{v:.0f}" for v in pred)
            + " | measured "
            + " ".join(f"{v:.0f}" for v in meas)
        )
    return (
        f"per-rank compute, mean per step (ms) over {len(meas)} ranks: predicted min/mean/max "
        f"{min(pred):.0f}/{statistics.mean(pred):.0f}/{max(pred):.0f} | measured min/mean/max "
        f"{min(meas):.0f}/{statistics.mean(meas):.0f}/{max(meas):.0f}, slowest rank {slowest_rank(records)} "
        f"(every rank: cp_history/rank<R>.jsonl, hf-cp report)"
    )
