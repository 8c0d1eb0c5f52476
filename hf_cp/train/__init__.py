"""Training with per-step load-balanced context parallelism on the Hugging Face Trainer.

    from hf_cp.train import CPTrainer, CPTrainingArguments

    args = CPTrainingArguments(output_dir="out", deepspeed="recipes/ds-zero2-gpu.json", bf16=True,
                               cp_balancer="auto", cp_profile="h200-qwen2.5-7b",
                               cp_max_tokens_per_rank=32768, cp_tokens_per_rank_per_step=65536)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="hf_cp")
    CPTrainer(model=model, args=args, train_dataset=tokenised).train()

`tokenised` has input_ids (and optionally labels with -100 on prompt tokens) per row. From a
YAML config: `python -m hf_cp.train CONFIG` under a launcher, or `hf-cp train CONFIG`.
"""

from .args import CPTrainingArguments
from .collator import MicroBatch, PlanCollator, RankStep
from .groups import CPGroups
from .planner import PlannedStep, Planner
from .sampler import GlobalBatch, GlobalBatchSampler
from .trainer import CPTrainer

__all__ = [
    "CPGroups",
    "CPTrainer",
    "CPTrainingArguments",
    "GlobalBatch",
    "GlobalBatchSampler",
    "MicroBatch",
    "PlanCollator",
    "PlannedStep",
    "Planner",
    "RankStep",
]
