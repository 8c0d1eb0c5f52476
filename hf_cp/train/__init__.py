"""Training with per-step load-balanced context parallelism on the Hugging Face Trainer.

    from hf_cp.train import CPTrainer, CPTrainingArguments

    args = CPTrainingArguments(output_dir="out", deepspeed="recipes/ds-zero2-gpu.json", bf16=True,
                               cp_balancer="auto", cp_profile="h200-qwen2.5-7b",
                               cp_max_tokens_per_rank=32768, cp_tokens_per_rank_per_step=65536)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="hf_cp")
    CPTrainer(model=model, args=args, train_dataset=tokenised).train()

`tokenised` has input_ids (and optionally labels with -100 on prompt tokens) per row. From a
YAML config: `python -m hf_cp.train CONFIG` under a launcher, or `hf-cp train CONFIG`.

Modules, by role: trainer.py (the Trainer's hooks), trainer_setup.py (what it sets up when
built), step.py (one step's waves, for training and evaluation), agreement.py (the plan
agreement that opens each step), online_calibration.py (refits of the cost model during the
run), evaluation.py (planned evaluation), collator.py / columns.py (data), loss.py (chunked
LM-head loss), history.py / step_record.py (the typed step record), metrics.py (logged
aggregates), groups.py (CP process groups), config.py and launch.py (YAML config, entry point),
dry_run.py (`hf-cp train --dry-run`), resume.py (restarts, resumption), stop_signal.py,
gc_schedule.py. Planning lives in hf_cp.planning.

Names are imported lazily: `hf_cp.train.history` or `.config` do not load transformers.
"""

from importlib import import_module

_EXPORTS = {
    "CPTrainer": "trainer",
    "CPTrainingArguments": "args",
    "CPGroups": "groups",
    "MicroBatch": "collator",
    "PlanCollator": "collator",
    "RankStep": "collator",
    "StepExecutor": "step",
    "StepRecord": "history",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
