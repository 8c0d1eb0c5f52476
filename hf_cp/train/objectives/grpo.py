"""CPGRPOTrainer: TRL's GRPOTrainer whose policy step is planned by hf_cp.

    from hf_cp.train.objectives.grpo import CPGRPOConfig, CPGRPOTrainer

    args = CPGRPOConfig(output_dir="out", num_generations=8, per_device_train_batch_size=8,
                        cp_max_tokens_per_rank=32768)
    CPGRPOTrainer(model=model, reward_funcs=my_reward, args=args, train_dataset=prompts,
                  processing_class=tokenizer).train()

The model must be loaded with attn_implementation="hf_cp". Generation, rewards, advantages and
the log-probs TRL scores at generation (the old policy's, when num_iterations > 1, and the
reference's, when beta != 0) stay TRL's: during them the policy and the reference model switch
to `cp_generation_attn_implementation` ("sdpa"), since generation uses a KV cache and padded
batches that hf_cp's attention refuses. Only the policy step changes:

1. every process's rows of the generation batch are gathered to every rank (token ids, masks,
   advantages, TRL's old and reference per-token log-probs);
2. each group (one prompt and its G completions) becomes one shared-prompt sample
   [prompt][c1]...[cG] (samples/masks.py): the prompt's left padding and each completion's
   right padding removed (completion_mask), the prompt computed once, each completion
   attending to the prompt and itself, positions continuing from the prompt's end; so each
   completion's per-token log-probs are exactly those of prompt+completion as its own sequence;
3. the step's prompt groups are planned across ranks by the configured balancer (Planner: local,
   Ulysses, ring or blocks), collated (PlanCollator) and run by the step executor
   (StepExecutor.train) with a per-token objective: TRL's GRPO loss of each token
   (objectives/grpo_loss.py), weighted by its row's normaliser, which is known before the forward from
   the completion masks. One forward and backward per wave, so dropout may stay on.

The step's loss and gradients equal TRL's for loss types dapo (TRL's default), grpo, dr_grpo,
bnpo (normalised by the loss tokens of the row's original process), cispo, sapo and luspo
(token-level importance sampling); with beta > 0 (KL to the reference) and num_iterations > 1
(ratio and clipping against the log-probs at generation). Rows that cannot move the policy (no
loss token; advantage exactly 0 with beta == 0) are not run: their TRL gradient is exactly 0.
A group left without any such row is skipped; when that is because every completion was
truncated under mask_truncated_completions, a warning names the group.

Refused by name (grpo_loss.check_supported, and below): gradient_accumulation_steps or
steps_per_generation other than 1 (one optimizer step is one planned step over the whole
generation batch: size it with per_device_train_batch_size; the plan, not accumulation, bounds
a rank's memory), sequence-level importance sampling, an entropy quantile or bonus, the
off-policy mask, use_vllm (generation is through transformers on the policy), loss_type vespo, cast_lm_head_to_fp32,
Liger kernels, MoE auxiliary losses, tools and environments; with images: video, a
processing_class that is not a Qwen2-VL-family processor, an image placeholder in a completion,
FSDP2 and ZeRO-3 (objectives/rollout_vision.py).

Images in the prompt (TRL's vision rows: an `image` or `images` column, a Qwen2-VL-family policy,
the model's transformers processor as processing_class): TRL generates and scores as it does;
the planned step encodes each group's images once per pass with the policy's tower and gives
each completion the M-RoPE positions of prompt+completion alone (rollout_vision.py). Against
TRL's GRPOTrainer on the same rollouts, tiny Qwen2.5-VL (tests/test_grpo_vision.py): gradients
within 7.6e-7 relative, the tower's included. TRL's own loss forward is right only with a
tokenizer that pads on the left (with a right-padding one its image token types miss the image
tokens of left-padded prompts); hf_cp's does not depend on it.

A reward function that raises stops the step on every rank (no rank waits in a collective),
naming the function, the group and the prompt.

Logged: TRL's generation and reward metrics as TRL logs them; the loss's clip ratios, CISPO's
clip ratio and the KL (TRL's names; not the entropy); and cp/ keys about the step's plan. Each
planned step's record (`cp_history`: its training pass timed alone, TRL's scoring at generation
being unplanned) feeds the online calibration and the end-of-run balance summary (rollout.py).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import ClassVar, List, Optional

import numpy as np
import torch
import torch.distributed as dist

try:
    from trl import GRPOConfig, GRPOTrainer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "hf_cp.train.objectives.grpo needs TRL: pip install 'hf_cp[trl]' (or pip install 'trl>=1.16,<2')"
    ) from e

from hf_cp.train.objectives.grpo_generation import (
    GRPORollout,
)
from hf_cp.train.objectives.grpo_loss import GRPOSettings, row_weights
from hf_cp.train.objectives.grpo_step import StepTables, step_objective
from hf_cp.train.objectives.rollout import PlannedRollouts, idle_rows, refuse_accumulation, refuse_split_generation
from hf_cp.train.setup.args import CPTrainingArguments, keep_defaults_of

logger = logging.getLogger(__name__)


@dataclass
@keep_defaults_of(GRPOConfig)
class CPGRPOConfig(CPTrainingArguments, GRPOConfig):
    """GRPOConfig (generation, rewards, the loss) plus CPTrainingArguments (planning).

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
        refuse_accumulation(self, "CPGRPOConfig")  # before TRL and CPTrainingArguments check them
        super().__post_init__()
        refuse_split_generation(self, "CPGRPOConfig")
        if self.cast_lm_head_to_fp32:
            raise ValueError(
                "CPGRPOConfig: cast_lm_head_to_fp32=True replaces the LM head's forward, which hf_cp's chunked "
                "log-prob path bypasses; set cast_lm_head_to_fp32=False"
            )


class CPGRPOTrainer(PlannedRollouts, GRPOTrainer):
    """GRPOTrainer's generation, rewards and advantages; hf_cp's planned policy step. Takes
    GRPOTrainer's arguments plus `balancer` (an object with .plan(PlanRequest), replacing
    args.cp_balancer); `args` must be a CPGRPOConfig."""

    cp_trainer_name = "CPGRPOTrainer"
    cp_objective = "GRPO"
    cp_config_class = CPGRPOConfig

    def __init__(self, model=None, reward_funcs=None, args: Optional[CPGRPOConfig] = None, train_dataset=None, **kw):
        self.cp_last_step: Optional[StepTables] = None  # the latest planned step (for tests and debugging)
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset, **kw)

    _cp_loss_settings = staticmethod(GRPOSettings.from_config)

    def _cp_settings(self, args) -> None:
        self.cp_grpo = self.cp_check_arguments(args)

    # ------------------------------------------------------------------ the planned step
    def _cp_build_step(self, rollout: GRPORollout) -> StepTables:
        """The step's shared-prompt samples, their plan, this rank's micro-batches and the
        per-row tables of the objective; the same on every rank."""
        R = rollout.rows
        s = self.cp_grpo
        weights = row_weights(s, rollout.counts(), rollout.processes, self.cp_world)
        index = self.state.global_step  # 0-based: the step's errors count from 1
        prompt_groups = self._cp_prompt_groups(rollout, ~idle_rows(rollout, s.beta), index)
        self._cp_prompt_groups_of_step = prompt_groups
        device = self.args.device
        cmax = max([len(c) for c in rollout.completions] + [1])

        def table(values: Optional[List[np.ndarray]]) -> Optional[torch.Tensor]:
            if values is None:
                return None
            out = np.zeros((R, cmax), dtype=np.float32)
            for r, v in enumerate(values):
                out[r, : len(v)] = v
            return torch.from_numpy(out).to(device)

        adv = (
            table(rollout.advantages)
            if rollout.per_token_advantages
            else torch.tensor(
                np.asarray([float(a[0]) for a in rollout.advantages], dtype=np.float32), device=device
            ).unsqueeze(1)
        )
        base = dict(
            weight=torch.tensor(weights, dtype=torch.float32, device=device),
            advantages=adv,
            old=table(rollout.old),
            ref=table(rollout.ref),
            groups=prompt_groups.prompt_group,
            skipped=prompt_groups.skipped,
        )
        if not prompt_groups.samples:
            empty = torch.zeros(0, dtype=torch.long, device=device)
            return StepTables(step=None, planned=None, slot_row=empty, slot_prompt=empty, **base)
        step, planned = self._cp_rank_step(prompt_groups, rollout, index)
        slot_row = [prompt_groups.rows_of[sid][a] for sid, a in step.answer_slots]
        slot_prompt = [prompt_groups.masks[sid].prompt for sid, _ in step.answer_slots]
        return StepTables(
            step=step,
            planned=planned,
            slot_row=torch.tensor(slot_row, dtype=torch.long, device=device),
            slot_prompt=torch.tensor(slot_prompt, dtype=torch.long, device=device),
            **base,
        )

    def _cp_policy_step(self, model, rollout: GRPORollout) -> torch.Tensor:
        t0 = time.perf_counter()
        tables = self._cp_build_step(rollout)
        build_ms = (time.perf_counter() - t0) * 1e3
        self.cp_last_step = tables
        if tables.step is None:  # nothing can move the policy: a zero gradient, as TRL's step has
            self.cp_runtime.executor._dummy_backward(model, self.state.global_step + 1, 0, True)
            loss = self._cp_log(rollout, tables)
        else:
            step = tables.step
            self.cp_runtime.check_attention(self.model, step)
            with self._cp_timed_passes() as timing, self.accelerator.autocast():
                totals = self.cp_runtime.executor.train(model, step, step_objective(self.cp_grpo, tables))
            loss = self._cp_log(rollout, tables)
            self._cp_record(step, totals, timing, loss)
        self._cp_log_plan(self._cp_prompt_groups_of_step, tables.step, tables.planned, build_ms)
        return torch.tensor(loss, dtype=torch.float32, device=self.args.device)

    def _cp_log(self, rollout: GRPORollout, t: StepTables) -> float:
        """The step's loss (every rank) and TRL's loss metrics from every rank's per-row sums."""
        keys = self._cp_stat_keys()
        R = rollout.rows
        flat = [torch.tensor([t.loss], dtype=torch.float64)]
        for k in keys:
            v = t.sums.get(k)
            flat.append(v.cpu() if v is not None else torch.zeros(R, dtype=torch.float64))
        vec = torch.cat(flat)
        if self.cp_world > 1:
            dist.all_reduce(vec, group=self.cp_runtime.groups.control)
        loss = float(vec[0])
        counts = torch.from_numpy(rollout.counts())
        total = float(counts.sum())
        m = self._metrics["train"]
        for i, k in enumerate(keys):
            per_row = vec[1 + i * R : 1 + (i + 1) * R]
            mean = float(per_row.sum()) / max(total, 1.0)
            if k == "kl":
                m["kl"].append(mean)
            elif k == "cispo":
                m["cispo_clip_ratio"].append(mean)
            else:
                m[f"clip_ratio/{k}_mean"].append(mean)
                seq = per_row / counts  # NaN for rows without loss tokens, as TRL's
                seq = seq[~torch.isnan(seq)]
                if k == "low":
                    m["clip_ratio/low_min"].append(float(seq.min()) if seq.numel() else math.nan)
                elif k == "high":
                    m["clip_ratio/high_max"].append(float(seq.max()) if seq.numel() else math.nan)
        return loss

    def _cp_stat_keys(self) -> List[str]:
        """The per-token statistics the loss type logs (token_losses), in a fixed order."""
        keys = []
        if self.cp_grpo.loss_type == "cispo":
            keys.append("cispo")
        elif self.cp_grpo.loss_type != "sapo":
            keys += ["high", "low", "region"]
        if self.cp_grpo.beta != 0.0:
            keys.append("kl")
        return keys
