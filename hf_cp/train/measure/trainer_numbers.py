"""The Trainer's own progress numbers, made true for token-budget steps.

CPTrainer's loader yields one planned step per item and spans the whole run, so the Trainer
counts one "epoch" of `max_steps` items of `world` samples each. Every dashboard shows what it
derives from that: `epoch` reaches 1.0 after one pass of a 3-epoch run, and
`train_samples_per_second` counts world x steps samples where a step holds as many whole
samples as fit its token budget. Here `epoch` is the fraction of the dataset's samples trained
so far (epoch e plus the share of epoch e's samples in its steps so far), and the speed
metrics count the samples and steps the run actually trained.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

from transformers import TrainerCallback

from hf_cp.train.measure.step_record import StepRecord


def data_epoch(epoch: int, samples_so_far_in_epoch: int, dataset_samples: int) -> float:
    """Epochs of data trained at the end of a step: complete epochs plus the share of this
    epoch's samples trained so far."""
    if dataset_samples <= 0:
        raise ValueError(f"data_epoch: the dataset has {dataset_samples} samples")
    return epoch + samples_so_far_in_epoch / dataset_samples


class DataEpochCallback(TrainerCallback):
    """Sets `state.epoch` to the epochs of data trained, at the end of every step, before
    anything logs or saves it (inserted first among the callbacks)."""

    def __init__(self, current: Callable[[], Optional[float]]):
        self.current = current

    def on_step_end(self, args, state, control, **kwargs):
        value = self.current()
        if value is not None:
            state.epoch = value


def corrected_speed_metrics(logs: Dict[str, float], records: Sequence[StepRecord]) -> None:
    """Rewrite, in place, the Trainer's end-of-training speed metrics (`train_samples_per_second`,
    `train_steps_per_second`) from the steps this train() call ran (`records`), and add
    `train_tokens_per_second`."""
    runtime = logs.get("train_runtime")
    if not runtime or runtime <= 0 or "train_samples_per_second" not in logs:
        return
    logs["train_samples_per_second"] = round(sum(r.num_samples for r in records) / runtime, 3)
    logs["train_steps_per_second"] = round(len(records) / runtime, 3)
    logs["train_tokens_per_second"] = round(sum(r.global_tokens for r in records) / runtime, 3)
