"""Training objectives, each a thin adapter of its Trainer or TRL base over the step runtime
(runtime/step_runtime.py): SFT (sft.py); the sequence objectives DPO (dpo.py, its loss
dpo_loss.py) and KTO (kto.py, kto_loss.py), trained through the seam step/sequence_objective.py,
with what preference trainers share (the reference pass, refused data and settings) in
preference.py; the generation objectives GRPO (grpo.py, grpo_step.py: the step's tables and
objective, grpo_loss.py) and RLOO (rloo.py, rloo_loss.py: a sequence objective too), with what
they share in rollout.py (set-up, generation attention, groups planned as shared-prompt samples)
and grpo_generation.py (TRL's rollouts gathered, rewards guarded)."""
