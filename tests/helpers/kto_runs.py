"""KTO runs for the tests: hf_cp's CPKTOTrainer (in this process, or as a rank of a torchrun job:
`python -m helpers.kto_runs SPEC.json`) and TRL's own KTOTrainer on the same global batches, each
recording per step the loss and every parameter's gradient before the optimizer step.

TRL's trainer is TRL's code (its tokenisation, mismatched KL completions, collator, padded
batches, fused LM head and loss); the only change is the loader, which yields hf_cp's steps'
examples in the same order, so both see the same batches. TRL rotates the KL completions within
runs of its per_device_train_batch_size, which is set to hf_cp's cp_kl_batch_size. Models: the
tiny chat Llama (eager attention for TRL, hf_cp's for hf_cp), same seed; the reference model is
a copy of the initial policy.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import List

import torch

from helpers.dpo_runs import SETTINGS, GradTape
from helpers.tiny_tokenizer import tiny_chat_model, tiny_chat_tokenizer

TOKENS_PER_STEP = 420  # 2-3 steps of examples
KL_BATCH = 4


def kto_rows(n: int = 12, long_prompt: int = 0) -> List[dict]:
    """Prompt/completion/label examples of 10 to ~120 byte tokens, more desirable than not; with
    `long_prompt`, example 1's prompt is that many bytes (over a rank's cap at world 2)."""
    rows = []
    for i in range(n):
        prompt = f"Q{i}: " + "is this right? " * (1 + i % 3)
        if long_prompt and i == 1:
            prompt = ("long context " * (long_prompt // 13 + 1))[:long_prompt]
        good = i % 3 != 2
        completion = (" yes, " + "the first one " * (1 + (i * 3) % 4)) if good else (" no: " + "maybe " * (1 + i % 3))
        rows.append({"prompt": prompt, "completion": completion, "label": good})
    return rows


def hf_cp_trainer(rows, out: str, steps: int, tape=None, family: str = "llama", **kw):
    from datasets import Dataset

    from hf_cp.train.objectives.kto import CPKTOConfig, CPKTOTrainer

    settings = dict(
        SETTINGS,
        cp_max_tokens_per_rank=512,
        cp_tokens_per_step=TOKENS_PER_STEP,
        cp_kl_batch_size=KL_BATCH,
        cp_compare_balancer=None,
        cp_profile="cpu",
        cp_shuffle=False,
        cp_plan_lookahead=0,
    )
    settings.update(kw)
    args = CPKTOConfig(output_dir=out, max_steps=steps, **settings)
    model = tiny_chat_model(0, family=family)
    return CPKTOTrainer(
        model=model,
        ref_model=copy.deepcopy(model),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tiny_chat_tokenizer(),
        callbacks=[tape] if tape else None,
    )


def hf_cp_run(rows, out: str, steps: int, **kw):
    """(step batches as sample ids, per-step losses, per-step gradients, logs) of CPKTOTrainer."""
    tape = GradTape()
    trainer = hf_cp_trainer(rows, out, steps, tape, **kw)
    trainer.train()
    batches = [list(trainer.cp_sampler[i].sample_ids) for i in range(steps)]
    return batches, [r.loss for r in trainer.cp_history], tape.grads, tape.logs


def trl_run(rows, batches: List[List[int]], out: str, family: str = "llama", **kw):
    """(per-step losses, per-step gradients, logs) of TRL's KTOTrainer on the given step batches."""
    from datasets import Dataset
    from torch.utils.data import DataLoader
    from trl import KTOConfig, KTOTrainer

    class SteppedKTOTrainer(KTOTrainer):
        def get_train_dataloader(self):
            cols = [c for c in ("prompt_ids", "completion_ids", "KL_completion_ids", "label")]
            data = self.train_dataset.select_columns([c for c in cols if c in self.train_dataset.column_names])
            return DataLoader(data, batch_sampler=batches, collate_fn=self.data_collator)

    settings = dict(SETTINGS, per_device_train_batch_size=KL_BATCH, max_length=None)
    settings.update(kw)
    args = KTOConfig(output_dir=out, max_steps=len(batches), **settings)
    model = tiny_chat_model(0, attn="eager", family=family)
    tape = GradTape()
    trainer = SteppedKTOTrainer(
        model=model,
        ref_model=copy.deepcopy(model),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tiny_chat_tokenizer(),
        callbacks=[tape],
    )
    trainer.train()
    losses = [x["loss"] for x in tape.logs if "loss" in x]
    return losses, tape.grads, tape.logs


def _job(spec_file: str) -> None:
    """A torchrun rank: CPKTOTrainer on the spec's rows and settings; rank 0 saves the results."""
    spec = json.loads(Path(spec_file).read_text())
    for run in spec["runs"]:
        batches, losses, grads, logs = hf_cp_run(spec["rows"], run["out"], spec["steps"], **run.get("settings", {}))
        if int(os.environ.get("RANK", "0")) == 0:
            torch.save(
                {"batches": batches, "losses": losses, "grads": grads, "logs": logs}, Path(run["out"]) / "kto.pt"
            )


if __name__ == "__main__":
    _job(sys.argv[1])
