"""The record of one training step, identical on every rank: every rank's measurements (one
all-gather over the control group) and the plan's predictions, as a StepRecord (measure/step_record.py)."""

from __future__ import annotations

from typing import List, Mapping, Optional

import torch
import torch.distributed as dist

from hf_cp.cost.flops import ModelFlops
from hf_cp.planning.sampler import GlobalBatchSampler
from hf_cp.samples.masks import SampleMask
from hf_cp.train.checkpoint.resolve import restart_attempt
from hf_cp.train.data.collator import RankStep
from hf_cp.train.measure.step_record import StepRecord
from hf_cp.train.measure.trainer_numbers import data_epoch
from hf_cp.train.step.executor import WaveTotals


def gather_measurements(
    totals: WaveTotals, wall_ms: float, peak_bytes: float, world: int, group=None
) -> List[List[float]]:
    """Per rank: [compute ms, tokens, loss sum, wall ms, peak bytes, forward-only ms, then each
    wave's ms]; one all-gather over `group` when `world` > 1 (every rank has every wave)."""
    wave_ms = [(c - a) * 1e3 for a, c, _ in totals.wave_timeline]
    mine = torch.tensor(
        [
            totals.compute_ms,
            float(totals.tokens),
            totals.loss_sum,
            wall_ms,
            peak_bytes,
            totals.forward_only_ms,
            *wave_ms,
        ],
        dtype=torch.float64,
    )
    if world > 1:
        got = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(got, mine, group=group)
    else:
        got = [mine]
    return torch.stack(got).tolist()


FIRST_WAVE_COLUMN = 6  # of a gather_measurements row: the waves' ms come after the step's numbers


def predicted_step_ms(sim, forward_only_passes: int, forward_share: float) -> float:
    """A step's predicted wall time: the plan's makespan (its training pass) plus the trainer's
    forward-only passes over the same plan."""
    return sim.makespan_ms + sim.forward_only_ms(forward_only_passes, forward_share)


def step_record(
    step: RankStep,
    rows: List[List[float]],
    sampler: Optional[GlobalBatchSampler],
    global_step: int,
    compare_name: Optional[str],
    resumed_from: Optional[int],
    dataset_samples: int,
    forward_only_passes: int = 0,
    forward_share: float = 1.0 / 3.0,
    balancer_name: Optional[str] = None,
) -> StepRecord:
    """The record of `step` from every rank's measurements (`rows`, gather_measurements's).
    `sampler`: the run's, or None for batches made as training goes (the rollout trainers');
    `global_step`: the Trainer's step counter after it; `compare_name`: the comparison
    balancer's name; `resumed_from`: the checkpoint step this process started from;
    `forward_only_passes`: the trainer's forward-only passes over the plan before its training
    pass, predicted at `forward_share` of a forward+backward (SimResult.forward_only_ms);
    `balancer_name`: the run's balancer, which compare_step_ms is of on a step that ran the
    comparison balancer's plan (Planner.compare_runs)."""
    ps = step.planned
    gv = step.global_valid_tokens
    waves = len(rows[0]) - FIRST_WAVE_COLUMN
    # epochs of data trained: also the Trainer's `epoch` (trainer_numbers.DataEpochCallback);
    # unknown for a stream (no length), as its number of samples is, and without a sampler (rollouts)
    unknown_data = sampler is None or bool(getattr(sampler, "streaming", False))
    if unknown_data:
        epochs = None
    elif ps is not None:
        done = sum(map(len, sampler.epoch_batches(step.epoch)[: ps.batch.step_in_epoch + 1]))
        epochs = data_epoch(step.epoch, done, len(sampler.lengths))
    else:
        epochs = float(step.epoch)
    return StepRecord(
        index=step.index,
        epoch=step.epoch,
        step_in_epoch=ps.batch.step_in_epoch if ps is not None else None,
        data_epoch=epochs,
        global_step=global_step,
        num_samples=len(step.plan.sample_ids),
        global_tokens=step.plan.total_tokens,
        global_valid_tokens=gv,
        loss=sum(r[2] for r in rows) / gv if gv else 0.0,
        measured_ms=[r[0] for r in rows],
        rank_tokens=[int(r[1]) for r in rows],
        step_wall_ms=max(r[3] for r in rows),
        # what the rank's measured time is: its micro-batches' durations (a group's members
        # wait for its slowest at every layer), not its own work alone
        predicted_ms=list(ps.predicted.occupied_ms) if ps is not None else [0.0] * len(rows),
        predicted_step_ms=predicted_step_ms(ps.predicted, forward_only_passes, forward_share)
        if ps is not None
        else 0.0,
        compare_step_ms=(
            predicted_step_ms(ps.compare, forward_only_passes, forward_share)
            if ps is not None and ps.compare is not None
            else None
        ),
        compare_balancer=(balancer_name if ps.ran_compare else compare_name)
        if ps is not None and ps.compare is not None
        else None,
        ran_compare=ps is not None and ps.ran_compare,
        planner_ms=ps.planner_ms if ps is not None else 0.0,
        cp_size_samples={str(k): v for k, v in (ps.predicted.cp_size_samples if ps is not None else {}).items()},
        waves=len(step.waves),
        plan_digest=step.plan.digest(),
        balancer=step.plan.balancer,
        plan_notes=list(getattr(step.plan, "notes", None) or []),
        chunked=step.plan.chunking_summary(),
        attempt=restart_attempt(),  # torchrun restarts so far: which run trained this step
        resumed_from=resumed_from,
        dataset_samples=None if unknown_data else dataset_samples,  # for the exactly-once audit of hf-cp report
        wave_max_ms=[max(r[FIRST_WAVE_COLUMN + w] for r in rows) for w in range(waves)],
        forward_only_ms=max(r[5] for r in rows),
        forward_only_passes=int(forward_only_passes),
        calibration=ps.cost_version if ps is not None else 0,
        peak_memory_gb=[r[4] / 1e9 for r in rows] if all(r[4] >= 0 for r in rows) else [],
        predicted_peak_memory_gb=[b / 1e9 for b in ps.predicted.peak_memory_bytes] if ps is not None else [],
    )


def step_model_flops(step: RankStep, flops: ModelFlops, masks: Mapping[int, SampleMask]) -> float:
    """Model FLOPs of the whole step, all ranks together (cost/flops.py): the step's samples, each
    under its mask from `masks` (by sample id; causal without one). The same on every rank."""
    plan = step.plan
    return flops.samples(plan.lengths, [masks.get(s) for s in plan.sample_ids])
