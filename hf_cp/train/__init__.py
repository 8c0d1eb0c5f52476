"""Training with per-step load-balanced context parallelism on the Hugging Face Trainer.

    from hf_cp.train import CPTrainer, CPTrainingArguments

    args = CPTrainingArguments(output_dir="out", deepspeed="recipes/ds-zero2-gpu.json", bf16=True,
                               cp_balancer="auto", cp_profile="h200-qwen2.5-7b",
                               cp_max_tokens_per_rank=32768, cp_tokens_per_rank_per_step=65536)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="hf_cp")
    CPTrainer(model=model, args=args, train_dataset=tokenised).train()

`tokenised` has input_ids (and optionally labels with -100 on prompt tokens) per row. From a
YAML config: `python -m hf_cp.train CONFIG` under a launcher, or `hf-cp train CONFIG`.

Rooms, by role, lowest first (each imports only the rooms before it; tests/test_layering.py):
checks/ (what is refused at set-up), checkpoint/ (resume, marks, integrity, the run lock),
data/ (collator, columns, streaming), step/ (one step's waves, agreement, loss, groups),
measure/ (the step record, metrics, online calibration), setup/ (arguments, config, sharding),
runtime/ (what every trainer composes), trainer.py (CPTrainer), objectives/ (SFT, DPO, KTO, GRPO,
RLOO over TRL), launch/ (`python -m hf_cp.train`, the dry run). Planning lives in hf_cp.planning.

Names are imported lazily: `hf_cp.train.measure.step_record` or `.config` do not load transformers.
"""

from importlib import import_module

_EXPORTS = {
    "CPTrainer": "trainer",
    "CPTrainingArguments": "setup.args",
    "CPGroups": "step.groups",
    "MicroBatch": "data.collator",
    "PlanCollator": "data.collator",
    "RankStep": "data.collator",
    "StepExecutor": "step.executor",
    "StepRecord": "measure.step_record",
    "CPSFTTrainer": "objectives.sft",
    "CPDPOTrainer": "objectives.dpo",
    "CPGRPOTrainer": "objectives.grpo",
    "CPKTOTrainer": "objectives.kto",
    "CPRLOOTrainer": "objectives.rloo",
    "CPSFTConfig": "objectives.sft",
    "CPDPOConfig": "objectives.dpo",
    "CPGRPOConfig": "objectives.grpo",
    "CPKTOConfig": "objectives.kto",
    "CPRLOOConfig": "objectives.rloo",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
