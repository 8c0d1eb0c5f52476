"""RLOO runs for the tests: hf_cp's CPRLOOTrainer (in this process, or as a rank of a torchrun job:
`python -m helpers.rloo_runs SPEC.json`) and TRL's own RLOOTrainer on the same rollouts, each
recording per step the loss and every parameter's gradient before the optimizer step.

As for GRPO (helpers/grpo_runs.py, whose prompts, fixed completions, reward and model these
runs share), both trainers are TRL's code up to the policy step; the only change, the same in
both, is generation: predetermined completions, a function of the prompt and the row's place
in its group, so both trainers at any world size see the same rollouts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import torch

from helpers.dpo_runs import GradTape
from helpers.grpo_runs import ROWS_PER_STEP, SETTINGS, _reset_accelerate, fixed_completion, load_model, reward_a
from helpers.tiny_tokenizer import tiny_chat_tokenizer


class FixedRLOOCompletions:
    """RLOO's generation replaced by fixed_completion (mixed in before the trainer class)."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
        first = self.accelerator.process_index * len(prompt_ids)  # global row of this process's first row
        G = self.num_generations
        out = [
            fixed_completion(self.processing_class, list(ids), (first + i) % G, self.max_completion_length)
            for i, ids in enumerate(prompt_ids)
        ]
        return out  # RLOO's returns the completion ids alone (GRPO's: with their log-probs)


def _settings(kw: dict, hf_cp: bool) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    s = dict(SETTINGS, per_device_train_batch_size=ROWS_PER_STEP // world)
    if hf_cp:
        s.update(cp_max_tokens_per_rank=512, cp_compare_balancer=None, cp_profile="cpu", cp_plan_lookahead=0)
        s.update(kw)
    else:
        s.update({k: v for k, v in kw.items() if not k.startswith("cp_")})
    return s


def hf_cp_trainer(rows, out: str, steps: int, model_path: str, tape: Optional[GradTape] = None, **kw):
    from datasets import Dataset

    from hf_cp.train.objectives.rloo import CPRLOOConfig, CPRLOOTrainer

    class FixedCPRLOOTrainer(FixedRLOOCompletions, CPRLOOTrainer):
        pass

    _reset_accelerate()
    args = CPRLOOConfig(output_dir=out, max_steps=steps, **_settings(kw, True))
    return FixedCPRLOOTrainer(
        model=load_model(model_path, "hf_cp"),
        reward_funcs=reward_a,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tiny_chat_tokenizer(),
        callbacks=[tape] if tape else None,
    )


def plan_sizes(trainer) -> List[List[int]]:
    """Record, per step, the CP group sizes that spread a sample (trainer._cp_rank_step wrapped)."""
    plans: List[List[int]] = []
    real = trainer._cp_rank_step

    def recording(groups, rollout, index):
        step, planned = real(groups, rollout, index)
        plans.append(sorted({len(g.ranks) for w in step.plan.waves for g in w.groups if g.distributed}))
        return step, planned

    trainer._cp_rank_step = recording
    return plans


def hf_cp_run(rows, out: str, steps: int, model_path: str, **kw):
    """(per-step losses, per-step gradients, logs, per-step spread group sizes, the trained
    trainer) of CPRLOOTrainer."""
    tape = GradTape()
    trainer = hf_cp_trainer(rows, out, steps, model_path, tape, **kw)
    plans = plan_sizes(trainer)
    trainer.train()
    return [x["loss"] for x in tape.logs if "loss" in x], tape.grads, tape.logs, plans, trainer


def trl_run(rows, out: str, steps: int, model_path: str, **kw):
    """(per-step losses, per-step gradients, logs) of TRL's RLOOTrainer on the same rollouts."""
    from datasets import Dataset
    from trl import RLOOConfig, RLOOTrainer

    class FixedRLOOTrainer(FixedRLOOCompletions, RLOOTrainer):
        pass

    _reset_accelerate()
    tape = GradTape()
    FixedRLOOTrainer(
        model=load_model(model_path, "sdpa"),
        reward_funcs=reward_a,
        args=RLOOConfig(output_dir=out, max_steps=steps, **_settings(kw, False)),
        train_dataset=Dataset.from_list(rows),
        processing_class=tiny_chat_tokenizer(),
        callbacks=[tape],
    ).train()
    return [x["loss"] for x in tape.logs if "loss" in x], tape.grads, tape.logs


def _job(spec_file: str) -> None:
    """A torchrun rank: the spec's CPRLOOTrainer runs; rank 0 saves each run's results, its
    summary and its step records."""
    from datetime import timedelta

    from accelerate import PartialState

    from hf_cp.train.launch.entry import shutdown_distributed

    spec = json.loads(Path(spec_file).read_text())
    PartialState(backend="gloo", timeout=timedelta(seconds=600))
    for run in spec["runs"]:
        losses, grads, logs, plans, trainer = hf_cp_run(
            spec["rows"], run["out"], spec["steps"], spec["model"], **run.get("settings", {})
        )
        if int(os.environ.get("RANK", "0")) == 0:
            records = [r.to_dict() for r in trainer.cp_history]
            result = dict(losses=losses, grads=grads, logs=logs, plans=plans, summary=trainer.cp_summary())
            torch.save(dict(result, records=records), Path(run["out"]) / "rloo.pt")
    shutdown_distributed()


if __name__ == "__main__":
    _job(sys.argv[1])
