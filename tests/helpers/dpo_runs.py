"""DPO runs for the tests: hf_cp's CPDPOTrainer (in this process, or as a rank of a torchrun job:
`python -m helpers.dpo_runs SPEC.json`) and TRL's own DPOTrainer on the same global batches, each
recording per step the loss and every parameter's gradient before the optimizer step.

TRL's trainer is TRL's code (its tokenisation, collator, padded batches, fused LM head and
loss); the only change is the loader, which yields hf_cp's steps' pairs in the same order, so
both see the same batches. Models: the tiny chat Llama (eager attention for TRL, hf_cp's for
hf_cp), same seed; the reference model is a copy of the initial policy.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch
from transformers import TrainerCallback

from helpers.tiny_tokenizer import tiny_chat_model, tiny_chat_tokenizer

SETTINGS = dict(
    seed=0,
    learning_rate=2e-3,
    lr_scheduler_type="constant",
    weight_decay=0.0,
    max_grad_norm=0.0,  # no clipping: the comparison is of raw gradients
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    use_cpu=True,
    bf16=False,
    gradient_checkpointing=False,
    beta=0.1,
)
TOKENS_PER_STEP = 700  # 2-3 steps of pairs


def preference_rows(n: int = 8, long_prompt: int = 0) -> List[dict]:
    """Prompt/chosen/rejected text pairs of 10 to ~120 byte tokens; with `long_prompt`, pair 1's
    prompt is that many bytes (over a rank's cap at world 2 and 4)."""
    rows = []
    for i in range(n):
        prompt = f"Q{i}: " + "which is right? " * (1 + i % 3)
        if long_prompt and i == 1:
            prompt = ("long context " * (long_prompt // 13 + 1))[:long_prompt]
        chosen = " yes, " + "the first one " * (1 + (i * 3) % 4)
        rejected = " no: " + "maybe the other " * (1 + (i * 5) % 3)
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


class GradTape(TrainerCallback):
    """Every parameter's gradient just before each optimizer step (after the data-parallel
    reduction), and the logged losses."""

    def __init__(self):
        self.grads: List[Dict[str, torch.Tensor]] = []
        self.logs: List[dict] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append(dict(logs or {}))


def grad_gap(ours, theirs) -> float:
    """The worst relative gradient difference over steps and parameters (each parameter's
    largest difference over its reference's largest entry)."""
    assert len(ours) == len(theirs) and ours, (len(ours), len(theirs))
    worst = 0.0
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys()
        for name in b:
            scale = float(b[name].abs().max()) or 1.0
            worst = max(worst, float((a[name] - b[name]).abs().max()) / scale)
    return worst


def hf_cp_trainer(
    rows, out: str, steps: int, tape: Optional[GradTape] = None, ref: bool = True, family: str = "llama", **kw
):
    from datasets import Dataset

    from hf_cp.train.objectives.dpo import CPDPOConfig, CPDPOTrainer

    settings = dict(
        SETTINGS,
        cp_max_tokens_per_rank=512,
        cp_tokens_per_step=TOKENS_PER_STEP,
        cp_compare_balancer=None,
        cp_profile="cpu",
        cp_shuffle=False,
        cp_plan_lookahead=0,
    )
    settings.update(kw)
    args = CPDPOConfig(output_dir=out, max_steps=steps, **settings)
    model = tiny_chat_model(0, family=family)
    return CPDPOTrainer(
        model=model,
        ref_model=copy.deepcopy(model) if ref else None,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tiny_chat_tokenizer(),
        callbacks=[tape] if tape else None,
    )


def hf_cp_run(rows, out: str, steps: int, **kw):
    """(step batches as sample ids, per-step losses, per-step gradients) of CPDPOTrainer."""
    tape = GradTape()
    trainer = hf_cp_trainer(rows, out, steps, tape, **kw)
    trainer.train()
    batches = [list(trainer.cp_sampler[i].sample_ids) for i in range(steps)]
    return batches, [r.loss for r in trainer.cp_history], tape.grads, tape.logs


def trl_run(rows, batches: List[List[int]], out: str, precompute: bool = False, family: str = "llama", **kw):
    """(per-step losses, per-step gradients) of TRL's DPOTrainer on the given step batches."""
    from datasets import Dataset
    from torch.utils.data import DataLoader
    from trl import DPOConfig, DPOTrainer

    class SteppedDPOTrainer(DPOTrainer):
        def get_train_dataloader(self):
            cols = ["prompt_ids", "chosen_ids", "rejected_ids"]
            cols += [c for c in ("ref_chosen_logps", "ref_rejected_logps") if c in self.train_dataset.column_names]
            data = self.train_dataset.select_columns(cols)
            return DataLoader(data, batch_sampler=batches, collate_fn=self.data_collator)

    settings = dict(SETTINGS, per_device_train_batch_size=max(len(b) for b in batches), max_length=None)
    settings.update(kw)
    settings["precompute_ref_log_probs"] = precompute
    args = DPOConfig(output_dir=out, max_steps=len(batches), **settings)
    model = tiny_chat_model(0, attn="eager", family=family)
    tape = GradTape()
    trainer = SteppedDPOTrainer(
        model=model,
        ref_model=None if precompute else copy.deepcopy(model),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tiny_chat_tokenizer(),
        callbacks=[tape],
    )
    trainer.train()
    losses = [x["loss"] for x in tape.logs if "loss" in x]
    return losses, tape.grads, tape.logs


def _job(spec_file: str) -> None:
    """A torchrun rank: CPDPOTrainer on the spec's rows and settings; rank 0 saves the results."""
    spec = json.loads(Path(spec_file).read_text())
    for run in spec["runs"]:
        batches, losses, grads, logs = hf_cp_run(
            spec["rows"], run["out"], spec["steps"], ref=run.get("ref", True), **run.get("settings", {})
        )
        if int(os.environ.get("RANK", "0")) == 0:
            torch.save(
                {"batches": batches, "losses": losses, "grads": grads, "logs": logs}, Path(run["out"]) / "dpo.pt"
            )


if __name__ == "__main__":
    _job(sys.argv[1])
