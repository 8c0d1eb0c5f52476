"""Training objectives, each a thin adapter of its Trainer or TRL base over the step runtime
(runtime/step_runtime.py): SFT (sft.py), DPO (dpo.py, its loss dpo_loss.py, trained through the
sequence-objective seam step/sequence_objective.py) and GRPO (grpo.py; grpo_generation.py: TRL's
rollouts gathered, rewards guarded; grpo_step.py: the step's tables and objective; grpo_loss.py)."""
