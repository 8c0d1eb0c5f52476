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
3. the step's groups are planned across ranks by the configured balancer (Planner: local,
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
off-policy mask, vLLM importance-sampling correction, loss_type vespo, cast_lm_head_to_fp32,
Liger kernels, MoE auxiliary losses, vision-language models, tools and environments.

A reward function that raises stops the step on every rank (no rank waits in a collective),
naming the function, the group and the prompt.

Logged: TRL's generation and reward metrics as TRL logs them; the loss's clip ratios, CISPO's
clip ratio and the KL (TRL's names; not the entropy); and cp/ keys about the step's plan.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import ClassVar, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

try:
    from trl import GRPOConfig, GRPOTrainer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "hf_cp.train.objectives.grpo needs TRL: pip install 'hf_cp[trl]' (or pip install 'trl>=1.16,<2')"
    ) from e
from accelerate.utils import gather_object, is_peft_model

from hf_cp.attention.recurrent import attach_recurrent_layers
from hf_cp.planning.worker import PlannedStep
from hf_cp.samples.masks import SampleMask
from hf_cp.train.checkpoint.run_lock import hold_run_lock
from hf_cp.train.checks.model import check_model_supported, check_recurrent_layers_fit
from hf_cp.train.checks.setup import HF_CP_ATTENTION
from hf_cp.train.data.collator import IGNORE_INDEX, PlanCollator
from hf_cp.train.objectives.grpo_generation import (
    GRPORollout,
    RewardFunctionError,
    gather_rollout,
    guarded_reward,
    keep_reference_loadable,
)
from hf_cp.train.objectives.grpo_loss import GRPOSettings, row_weights
from hf_cp.train.objectives.grpo_step import StepTables, step_objective
from hf_cp.train.runtime.step_runtime import StepRuntime
from hf_cp.train.setup.args import CPTrainingArguments, keep_defaults_of
from hf_cp.train.setup.sharding import refuse_sharding
from hf_cp.train.setup.trainer_setup import trainer_planning_setup

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
            "help": "rows (completions) of the generation batch per process; the step's groups are then planned "
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
        # before TRL and CPTrainingArguments check them, with GRPO's reasons
        if self.gradient_accumulation_steps != 1:
            raise ValueError(
                f"CPGRPOConfig: gradient_accumulation_steps={self.gradient_accumulation_steps}: one optimizer step is "
                "one planned step over the whole generation batch, whose plan (not accumulation) bounds each rank's "
                "memory; set gradient_accumulation_steps=1 and size the batch with per_device_train_batch_size"
            )
        if self.steps_per_generation not in (None, 1):
            raise ValueError(
                f"CPGRPOConfig: steps_per_generation={self.steps_per_generation}: hf_cp trains each generation batch "
                "in one planned step; set steps_per_generation=1 (num_iterations reuses a batch for several steps)"
            )
        super().__post_init__()
        if self.steps_per_generation != 1:
            raise ValueError(
                f"CPGRPOConfig: generation_batch_size={self.generation_batch_size} makes steps_per_generation "
                f"{self.steps_per_generation}; hf_cp trains each generation batch in one planned step: leave "
                "generation_batch_size unset (it is per_device_train_batch_size x processes)"
            )
        if self.cast_lm_head_to_fp32:
            raise ValueError(
                "CPGRPOConfig: cast_lm_head_to_fp32=True replaces the LM head's forward, which hf_cp's chunked "
                "log-prob path bypasses; set cast_lm_head_to_fp32=False"
            )


class CPGRPOTrainer(GRPOTrainer):
    """GRPOTrainer's generation, rewards and advantages; hf_cp's planned policy step. Takes
    GRPOTrainer's arguments plus `balancer` (an object with .plan(PlanRequest), replacing
    args.cp_balancer); `args` must be a CPGRPOConfig."""

    def __init__(
        self,
        model=None,
        reward_funcs=None,
        args: Optional[CPGRPOConfig] = None,
        train_dataset=None,
        balancer=None,
        **kwargs,
    ):
        if not isinstance(args, CPGRPOConfig):
            raise TypeError(
                f"CPGRPOTrainer needs CPGRPOConfig (GRPOConfig + CPTrainingArguments), got {type(args).__name__}"
            )
        if model is not None and not isinstance(model, str):  # a model name is checked once TRL has loaded it
            attach_recurrent_layers(model)  # so that a hybrid is refused for its shared prompts, by that name
            check_recurrent_layers_fit(model, "CPGRPOTrainer", True, "")
            check_model_supported(model, "CPGRPOTrainer: the policy")
        refuse_sharding(
            args,
            "CPGRPOTrainer",
            "TRL's generation and scoring passes run outside the per-wave pass sequence that sharded parameters need "
            "on every rank",
        )
        self.cp_grpo = GRPOSettings.from_config(args)  # refuses unsupported loss settings before any work
        for name in ("tools", "environment_factory"):
            if kwargs.get(name):
                raise ValueError(
                    f"CPGRPOTrainer: {name} (multi-turn rollouts with tool or environment turns inside the "
                    "completion) is not supported yet; pass rollout_func for custom rollouts"
                )
        if model is not None and not isinstance(model, str) and args.beta != 0.0 and kwargs.get("peft_config") is None:
            keep_reference_loadable(model, args.output_dir, int(args.process_index))
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset, **kwargs)
        if isinstance(model, str):  # TRL loaded it from the name
            attach_recurrent_layers(self.model)
            check_recurrent_layers_fit(self.model, "CPGRPOTrainer", True, "")
            check_model_supported(self.model, "CPGRPOTrainer: the policy")
        if self._is_vlm:
            raise ValueError(
                "CPGRPOTrainer: vision-language models are not supported (image features cannot be placed in a "
                "planned token layout); pass a text tokenizer as processing_class"
            )
        if self.aux_loss_enabled:
            raise ValueError(
                "CPGRPOTrainer: the model returns a MoE router auxiliary loss (router_aux_loss_coef != 0), which hf_cp's "
                "planned forward does not collect; set router_aux_loss_coef=0"
            )
        impl = getattr(self._cp_base(self.model).config, "_attn_implementation", None)
        if impl != HF_CP_ATTENTION:
            raise ValueError(
                f"CPGRPOTrainer: the policy uses attn_implementation={impl!r}; each group is one shared-prompt sample "
                f"whose mask only hf_cp's attention reads: load it with attn_implementation='{HF_CP_ATTENTION}' "
                f"(generation switches to cp_generation_attn_implementation={args.cp_generation_attn_implementation!r})"
            )
        self.cp_world, self.cp_rank = int(args.world_size), int(args.process_index)
        # no sampler: GRPO's batches come from generation, each planned when it is made
        setup = self.cp_setup = trainer_planning_setup(args, self.model, None, self.cp_world)
        self.cp_runtime = StepRuntime(self, setup, balancer)  # groups, planner, executor, agreement
        self._cp_rollout: Optional[GRPORollout] = None
        self.cp_last_step: Optional[StepTables] = None  # the latest planned step (for tests and debugging)

    def train(self, *args, **kwargs):
        """GRPOTrainer's train, holding output_dir's lock as CPTrainer.train does (checkpoint/run_lock.py)."""
        with hold_run_lock(self.args.output_dir, self.cp_rank, self.cp_world, self.args.cp_break_lock):
            return super().train(*args, **kwargs)

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def _cp_base(model):
        return model.get_base_model() if is_peft_model(model) else model

    def _cp_setup(self) -> None:
        """The runtime's groups, planner and executor: once, at the first step, on every rank."""
        # TRL scores completions under the distribution it sampled from
        self.cp_runtime.start(self.accelerator.unwrap_model(self.model), logit_temperature=self.temperature)

    @contextlib.contextmanager
    def _cp_generation_attention(self):
        """The policy and the reference model on the generation attention meanwhile (TRL generates
        with a KV cache and scores padded batches; hf_cp's attention refuses both)."""
        impl = self.args.cp_generation_attn_implementation
        changed = []
        for m in (self.model, self.ref_model):
            if m is None:
                continue
            base = self._cp_base(self.accelerator.unwrap_model(m))
            was = base.config._attn_implementation
            if was != impl:
                base.set_attn_implementation(impl)
                changed.append((base, was))
        try:
            yield
        finally:
            for base, was in reversed(changed):
                base.set_attn_implementation(was)

    # ------------------------------------------------------------------ generation (TRL's)
    def _generate_and_score_completions(self, inputs):
        with self._cp_generation_attention():
            return super()._generate_and_score_completions(inputs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # evaluation is TRL's own (generation and its padded loss), on the generation attention
        with self._cp_generation_attention():
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards, with each reward function guarded: one that raises on some process gives
        that process NaN rewards so that TRL's gather still completes everywhere, and then every
        rank raises RewardFunctionError naming the function, the group and the prompt."""
        failures: List[str] = []
        funcs = self.reward_funcs
        self.reward_funcs = [
            guarded_reward(
                f,
                name,
                failures,
                len(prompts),
                self.accelerator.process_index,
                self.num_generations,
                self.state.global_step + 1,
            )
            for f, name in zip(funcs, self.reward_func_names)
        ]
        try:
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        finally:
            self.reward_funcs = funcs
        if self.cp_world > 1:
            failures = list(gather_object(failures))
        if failures:
            raise RewardFunctionError("; ".join(failures))
        return rewards

    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        # TRL's schedule: generate every num_iterations steps (steps_per_generation is 1), else reuse
        if self._step % (self.args.steps_per_generation * self.num_iterations) == 0 or self._cp_rollout is None:
            out = self._generate_and_score_completions(generation_batch)
            self._cp_rollout = gather_rollout(out, self.cp_world, self.num_generations)
        return self._cp_rollout

    # ------------------------------------------------------------------ the planned step
    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        t0 = time.perf_counter()
        self._cp_setup()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        rollout = self._prepare_inputs(inputs)
        loss = self._cp_policy_step(model, rollout)
        self._step += 1
        self._metrics["train"]["step_time"].append(time.perf_counter() - t0)
        return loss

    def _cp_describe_group(self, rollout: GRPORollout, g: int) -> str:
        prompt = rollout.prompts[g * rollout.num_generations]
        try:
            text = self.processing_class.decode(prompt[-60:])
        except Exception:  # noqa: BLE001 - only for a message
            text = str(prompt[-20:])
        return f"GRPO group {g} (prompt of {len(prompt)} tokens ending {text!r})"

    def _cp_build_step(self, rollout: GRPORollout) -> StepTables:
        """The step's shared-prompt samples, their plan, this rank's micro-batches and the
        per-row tables of the objective; the same on every rank."""
        G, R = rollout.num_generations, rollout.rows
        s = self.cp_grpo
        counts = rollout.counts()
        weights = row_weights(s, counts, rollout.processes, self.cp_world)
        index = self.state.global_step  # 0-based: the step's errors count from 1
        trainable = []
        for r in range(R):
            idle = counts[r] == 0 or (s.beta == 0.0 and not np.any(rollout.advantages[r]))
            trainable.append(not idle)
        samples: List[Tuple[List[int], List[int]]] = []  # (input_ids, labels)
        masks: Dict[int, SampleMask] = {}
        rows_of: List[List[int]] = []
        groups: List[int] = []
        skipped: List[int] = []
        truncated: List[int] = []
        for g in range(R // G):
            members = list(range(g * G, (g + 1) * G))
            prompt = rollout.prompts[members[0]]
            for r in members[1:]:
                if rollout.prompts[r] != prompt:
                    raise ValueError(
                        f"step {index + 1}: rows {members[0]} and {r} of {self._cp_describe_group(rollout, g)} have "
                        "different prompt tokens; a group must be one prompt and its completions"
                    )
            if not prompt:
                raise ValueError(f"step {index + 1}: {self._cp_describe_group(rollout, g)} has an empty prompt")
            kept = [r for r in members if trainable[r]]
            if not kept:
                skipped.append(g)
                if self.mask_truncated_completions and all(len(rollout.completions[r]) == 0 for r in members):
                    truncated.append(g)
                continue
            ids, labels = list(prompt), [IGNORE_INDEX] * len(prompt)
            for r in kept:
                ids += rollout.completions[r]
                labels += [t if m > 0 else IGNORE_INDEX for t, m in zip(rollout.completions[r], rollout.loss_masks[r])]
            masks[len(samples)] = SampleMask.shared_prompt(len(prompt), [len(rollout.completions[r]) for r in kept])
            samples.append((ids, labels))
            rows_of.append(kept)
            groups.append(g)
        if truncated and self.cp_rank == 0:
            logger.warning(
                "hf_cp: step %d: %s: every completion was truncated at max_completion_length=%s without EOS and "
                "mask_truncated_completions=True masks them all, so the group carries no training signal; skipped "
                "(TRL would run it with zero loss)",
                index + 1,
                ", ".join(self._cp_describe_group(rollout, g) for g in truncated),
                self.max_completion_length,
            )
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
            groups=groups,
            skipped=skipped,
        )
        if not samples:
            empty = torch.zeros(0, dtype=torch.long, device=device)
            return StepTables(step=None, planned=None, slot_row=empty, slot_prompt=empty, **base)
        planned = self._cp_plan(samples, masks, groups, rollout, index)
        collate = PlanCollator(lambda sid: samples[sid], masks)
        valid = sum(sum(1 for t in lab if t != IGNORE_INDEX) for _, lab in samples)
        step = collate.rank_step(planned.plan, self.cp_rank, valid, planned=planned)
        # every rank planned the same samples; a balancer whose plans depend on timing (a solver's
        # deadline) may still differ, and then every rank runs rank 0's plan (step/agreement.py)
        runtime = self.cp_runtime
        step = runtime.agreement_for(collate).agree(step, runtime.planner.balancer, False, ()).step
        slot_row = [rows_of[sid][a] for sid, a in step.answer_slots]
        slot_prompt = [masks[sid].prompt for sid, _ in step.answer_slots]
        return StepTables(
            step=step,
            planned=planned,
            slot_row=torch.tensor(slot_row, dtype=torch.long, device=device),
            slot_prompt=torch.tensor(slot_prompt, dtype=torch.long, device=device),
            **base,
        )

    def _cp_plan(self, samples, masks, groups, rollout: GRPORollout, index: int) -> PlannedStep:
        """The balancer's plan of the step's samples (validated and simulated by the runtime's planner)."""
        lengths = [len(ids) for ids, _ in samples]

        def label(sid: int) -> str:
            return self._cp_describe_group(rollout, groups[sid])

        return self.cp_runtime.plan_batch(index, lengths, masks, label)

    def _cp_policy_step(self, model, rollout: GRPORollout) -> torch.Tensor:
        t0 = time.perf_counter()
        tables = self._cp_build_step(rollout)
        build_ms = (time.perf_counter() - t0) * 1e3
        self.cp_last_step = tables
        if tables.step is None:  # nothing can move the policy: a zero gradient, as TRL's step has
            self.cp_runtime.executor._dummy_backward(model, self.state.global_step + 1, 0, True)
        else:
            step = tables.step
            self.cp_runtime.check_attention(self.model, step)
            with self.accelerator.autocast():
                self.cp_runtime.executor.train(model, step, step_objective(self.cp_grpo, tables))
        loss = self._cp_log(rollout, tables, build_ms)
        return torch.tensor(loss, dtype=torch.float32, device=self.args.device)

    def _cp_log(self, rollout: GRPORollout, t: StepTables, build_ms: float) -> float:
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
        m["cp/groups"].append(float(len(t.groups)))
        m["cp/skipped_groups"].append(float(len(t.skipped)))
        m["cp/build_ms"].append(build_ms)
        if t.step is not None:
            plan = t.step.plan  # rank 0's, where a timing-dependent balancer planned otherwise here
            m["cp/tokens"].append(float(sum(plan.lengths)))
            m["cp/waves"].append(float(len(plan.waves)))
            m["cp/planner_ms"].append(float(t.planned.planner_ms))
            m["cp/predicted_step_ms"].append(float(t.planned.predicted.makespan_ms))
            for size, n in sorted(t.planned.predicted.cp_size_samples.items()):
                m[f"cp/cp_size{int(size)}_samples"].append(float(n))
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
