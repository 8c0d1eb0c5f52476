"""CPRLOOTrainer: TRL's RLOOTrainer whose policy step is planned by hf_cp.

    from hf_cp.train.objectives.rloo import CPRLOOConfig, CPRLOOTrainer

    args = CPRLOOConfig(output_dir="out", num_generations=8, per_device_train_batch_size=8,
                        cp_max_tokens_per_rank=32768)
    CPRLOOTrainer(model=model, reward_funcs=my_reward, args=args, train_dataset=prompts,
                  processing_class=tokenizer).train()

The model must be loaded with attn_implementation="hf_cp". TRL's: generation, rewards, the KL to
the reference folded into the reward (beta) and the leave-one-out advantages, on
`cp_generation_attn_implementation` ("sdpa"). The ratio's old log-probs (TRL's `old_logps`) are
those of the policy that generated the rollout: hf_cp takes them from the rollout's first planned
step, which trains that policy, so that no other kernel's fp32 noise enters the ratio.
hf_cp's: the policy step (objectives/rollout.py, as for GRPO). Each prompt group (one prompt, its G
completions) is one shared-prompt sample; the step's prompt groups are planned by the configured
balancer over all ranks; and since RLOO's loss is per sequence, the step runs through the
sequence-objective seam (step/sequence_objective.py): every completion's summed log-prob now,
without gradient, then TRL's clipped loss on the whole-step vectors (objectives/rloo_loss.py),
then one weighted token pass. Rows that cannot move the policy (no completion token, or an
advantage of exactly 0) are not run; their share of TRL's loss is added as a constant.

The step's loss and gradients equal TRL's RLOOTrainer on the same rollouts at any world size.
Refused by name: gradient_accumulation_steps or steps_per_generation other than 1, Liger
kernels, MoE auxiliary losses, tools and environments. Prompts with images train as
CPGRPOTrainer's do (objectives/rollout_vision.py; tests/test_grpo_vision.py). Under FSDP2 and
ZeRO-3 the planned passes run the wave's pass count on every rank, as CPTrainer's do. Each
planned step's record times its log-prob pass (forward-only, predicted as one) and its token
pass; the online calibration and the end-of-run balance summary read it (rollout.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

try:
    from trl import RLOOConfig, RLOOTrainer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "hf_cp.train.objectives.rloo needs TRL: pip install 'hf_cp[trl]' (or pip install 'trl>=1.16,<2')"
    ) from e

from hf_cp.train.objectives.grpo_generation import GRPORollout
from hf_cp.train.objectives.rloo_loss import RLOOSettings, rloo_loss
from hf_cp.train.objectives.rollout import PlannedRollouts, idle_rows, refuse_accumulation, refuse_split_generation
from hf_cp.train.setup.args import CPTrainingArguments, keep_defaults_of
from hf_cp.train.step.sequence_objective import answer_logps_everywhere, train_sequence_objective


@dataclass
@keep_defaults_of(RLOOConfig)
class CPRLOOConfig(CPTrainingArguments, RLOOConfig):
    """RLOOConfig (generation, rewards, the loss) plus CPTrainingArguments (planning).

    cp_tokens_per_step does not apply: a step is TRL's generation batch
    (per_device_train_batch_size x processes rows, num_generations per prompt)."""

    cp_loader_items_are_steps: ClassVar[bool] = False  # the loader yields TRL's prompt batches

    per_device_train_batch_size: int = field(
        default=8,
        metadata={
            "help": "rows (completions) of the generation batch per process; the step's prompt groups are then planned "
            "over all ranks, so a rank's memory is set by cp_max_tokens_per_rank, not by this"
        },
    )
    cp_generation_attn_implementation: str = field(
        default="sdpa",
        metadata={
            "help": "attention implementation of the policy and reference models while TRL generates and scores "
            "completions (KV cache, padded batches); the planned policy step uses hf_cp's"
        },
    )

    def __post_init__(self):
        refuse_accumulation(self, "CPRLOOConfig")  # before TRL and CPTrainingArguments check them
        super().__post_init__()
        refuse_split_generation(self, "CPRLOOConfig")


class CPRLOOTrainer(PlannedRollouts, RLOOTrainer):
    """RLOOTrainer's generation, rewards and advantages; hf_cp's planned policy step. Takes
    RLOOTrainer's arguments plus `balancer`; `args` must be a CPRLOOConfig."""

    cp_forward_only_passes = 1  # the policy's log-probs of the step (`now`) before its token pass

    cp_trainer_name = "CPRLOOTrainer"
    cp_objective = "RLOO"
    cp_config_class = CPRLOOConfig

    _cp_loss_settings = staticmethod(RLOOSettings.from_config)

    def _cp_settings(self, args) -> None:
        self.cp_rloo = self.cp_check_arguments(args)

    def _cp_policy_step(self, model, rollout: GRPORollout) -> torch.Tensor:
        t0 = time.perf_counter()
        index = self.state.global_step  # 0-based: the step's errors count from 1
        rows = rollout.rows
        advantages = np.asarray([float(a[0]) for a in rollout.advantages], dtype=np.float64)
        idle = idle_rows(rollout, 0.0)  # the KL is in the reward: an advantage of 0 moves nothing
        counts = rollout.counts()
        # a row without completion tokens: ratio exp(0 - 0) = 1, TRL's loss -A, no gradient
        constant = float(sum(-advantages[r] for r in range(rows) if idle[r] and counts[r] == 0))
        prompt_groups = self._cp_prompt_groups(rollout, ~idle, index)
        step = planned = None
        build_ms = (time.perf_counter() - t0) * 1e3
        if not prompt_groups.samples:  # nothing can move the policy: a zero gradient, as TRL's step has
            self.cp_runtime.executor._dummy_backward(model, index + 1, 0, True)
            loss = constant / rows
        else:
            step, planned = self._cp_rank_step(prompt_groups, rollout, index)
            build_ms = (time.perf_counter() - t0) * 1e3
            self.cp_runtime.check_attention(self.model, step)
            executor = self.cp_runtime.executor
            slot_rows = [prompt_groups.rows_of[sid][a] for sid, a in step.answer_slots]
            adv = torch.as_tensor(advantages[slot_rows], dtype=torch.float64)
            with self._cp_timed_passes() as timing, self.accelerator.autocast():
                now = answer_logps_everywhere(executor, self.accelerator.unwrap_model(model), step, self.cp_world)
                # a rollout's first step trains the policy that generated it (a generation batch is
                # never split over steps here): TRL's old log-probs are `now`, exactly, where the
                # generation pass's carry its kernels' fp32 noise into the ratio; later reuses
                # (num_iterations) keep the first step's
                if rollout.policy_sums is None:
                    rollout.policy_sums = np.full(rows, np.nan)
                    rollout.policy_sums[slot_rows] = now.detach().cpu().numpy()
                old = torch.as_tensor(rollout.policy_sums[slot_rows], dtype=torch.float64)

                def loss_of(logps: torch.Tensor):
                    return rloo_loss(self.cp_rloo, logps, old.to(logps.device), adv.to(logps.device), rows, constant)

                totals, loss, metrics = train_sequence_objective(executor, model, step, now, loss_of)
            self._cp_record(step, totals, timing, loss)
            for name, value in metrics.items():
                self._metrics["train"][name].append(value)
        self._cp_log_plan(prompt_groups, step, planned, build_ms)
        return torch.tensor(loss, dtype=torch.float32, device=self.args.device)
