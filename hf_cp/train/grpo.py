"""CPGRPOTrainer: TRL's GRPOTrainer whose policy step is planned by hf_cp.

    from hf_cp.train.grpo import CPGRPOConfig, CPGRPOTrainer

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
   (grpo_loss.py), weighted by its row's normaliser, which is known before the forward from
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
from datetime import timedelta
from pathlib import Path
from typing import Callable, ClassVar, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_model

try:
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import is_async_callable
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("hf_cp.train.grpo needs TRL: pip install 'hf_cp[trl]' (or pip install 'trl>=1.16,<2')") from e
from accelerate.utils import gather_object, is_peft_model

from hf_cp.attention.recurrent import attach_recurrent_layers
from hf_cp.balance.toolkit.sample_limit import check_sample_lengths
from hf_cp.planning.sampler import GlobalBatchSampler
from hf_cp.planning.worker import PlannedStep, Planner
from hf_cp.samples.masks import SampleMask
from hf_cp.train.agreement import PlanAgreement
from hf_cp.train.args import CPTrainingArguments
from hf_cp.train.collator import IGNORE_INDEX, MicroBatch, PlanCollator, RankStep
from hf_cp.train.groups import CPGroups
from hf_cp.train.grpo_loss import GRPOSettings, row_weights, token_losses
from hf_cp.train.model_checks import check_model_supported, check_recurrent_layers_fit
from hf_cp.train.run_lock import hold_run_lock
from hf_cp.train.setup_checks import HF_CP_ATTENTION
from hf_cp.train.sharding import refuse_sharding
from hf_cp.train.step import StepExecutor
from hf_cp.train.trainer import CPTrainer
from hf_cp.train.trainer_setup import trainer_planning_setup

logger = logging.getLogger(__name__)


@dataclass
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


class RewardFunctionError(RuntimeError):
    """A reward function raised; raised on every rank, naming the function and the group."""


@dataclass
class GRPORollout:
    """Every row of one generation batch (all processes, TRL's order): rows p*B_p .. (p+1)*B_p - 1
    came from process p, and rows g*G .. (g+1)*G - 1 are group g (one prompt, G completions)."""

    prompts: List[List[int]]  # prompt tokens, padding removed
    completions: List[List[int]]  # completion tokens (completion_mask), padding removed
    loss_masks: List[np.ndarray]  # per completion token: 1 where TRL takes loss (completion x tool mask)
    advantages: List[np.ndarray]  # per row: [1] (a row's advantage) or [n] (per token)
    old: Optional[List[np.ndarray]]  # TRL's per-token log-probs at generation (None: on-policy)
    ref: Optional[List[np.ndarray]]  # the reference's (None: beta == 0)
    processes: List[int]
    num_generations: int
    per_token_advantages: bool = False  # advantages of shape [rows, tokens] (a GRPOTrainer subclass's)

    @property
    def rows(self) -> int:
        return len(self.prompts)

    def counts(self) -> np.ndarray:
        return np.asarray([float(m.sum()) for m in self.loss_masks], dtype=np.float64)


@dataclass
class _StepTables:
    """One planned step and, on this rank's device, what the objective looks up per target."""

    step: RankStep
    planned: Optional[PlannedStep]
    slot_row: torch.Tensor  # [slots] answer slot -> row of the rollout
    slot_prompt: torch.Tensor  # [slots] prompt length of the slot's group
    weight: torch.Tensor  # [rows] the row's normaliser (grpo_loss.row_weights)
    advantages: torch.Tensor  # [rows, C]
    old: Optional[torch.Tensor]  # [rows, C]
    ref: Optional[torch.Tensor]  # [rows, C]
    groups: List[int]  # sample id -> group of the generation batch
    skipped: List[int]  # groups not run (no row that can move the policy)
    sums: Dict[str, torch.Tensor] = field(default_factory=dict)  # per-row sums of logged statistics
    loss: float = 0.0


REFERENCE_INIT = "reference_init"  # in output_dir: the initial policy, where TRL loads the reference from


def keep_reference_loadable(model, output_dir: str, rank: int) -> Optional[str]:
    """TRL builds GRPO's reference model (beta > 0) by loading the policy's `_name_or_path` again.
    A policy built in memory, or read from a GGUF file (the bundled SmolLM2: a package folder
    without config.json), has no loadable path there, and TRL failed with "Unrecognized model".
    Such a policy is saved as it is now, before training (the reference a KL term wants), to
    output_dir/reference_init/rank<r> (every rank its own copy: no barrier before TRL loads it),
    and its `_name_or_path` points there. Returns that folder, or None when the path loads."""
    config = getattr(model, "config", None)
    name = str(getattr(config, "_name_or_path", "") or "")
    path = Path(name).expanduser()
    if name and (path / "config.json").is_file():
        return None  # a model folder: TRL loads it
    if name and not path.exists() and "/" in name and not name.startswith(("/", ".")):
        return None  # a hub id: TRL loads it (offline from the cache)
    folder = Path(output_dir) / REFERENCE_INIT / f"rank{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    # not model.save_pretrained: under torch.distributed it writes on global rank 0 only
    if not getattr(config, "architectures", None):  # TRL picks the reference's class from it
        config.architectures = [type(model).__name__]
    config.save_pretrained(str(folder))
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})  # tied weights once
    config._name_or_path = str(folder)
    logger.info("hf_cp: the GRPO reference model is the initial policy, saved to %s (%r does not load)", folder, name)
    return str(folder)


class CPGRPOTrainer(GRPOTrainer):
    """GRPOTrainer's generation, rewards and advantages; hf_cp's planned policy step. Takes
    GRPOTrainer's arguments plus `balancer` (an object with .plan(PlanRequest), replacing
    args.cp_balancer); `args` must be a CPGRPOConfig."""

    # CPTrainer's backward and DDP wave context (they read only the Trainer's own state)
    _cp_backward = CPTrainer._cp_backward
    _cp_wave_context = CPTrainer._cp_wave_context
    _cp_check_attention = CPTrainer._cp_check_attention

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
        # the cost model and the cluster (the setup's sampler is not used: GRPO's batches come from generation)
        setup = self.cp_setup = trainer_planning_setup(args, self.model, [1], self.cp_world)
        self.cp_cost, self.cp_cluster = setup.cost, setup.cluster
        self.cp_balancer = balancer if balancer is not None else setup.balancer()
        self.cp_groups: Optional[CPGroups] = None
        self.cp_executor: Optional[StepExecutor] = None
        self._cp_rollout: Optional[GRPORollout] = None
        self.cp_last_step: Optional[_StepTables] = None  # the latest planned step (for tests and debugging)

    def train(self, *args, **kwargs):
        """GRPOTrainer's train, holding output_dir's lock as CPTrainer.train does (run_lock.py)."""
        with hold_run_lock(self.args.output_dir, self.cp_rank, self.cp_world, self.args.cp_break_lock):
            return super().train(*args, **kwargs)

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def _cp_base(model):
        return model.get_base_model() if is_peft_model(model) else model

    def _cp_setup(self) -> None:
        """The group registry and the step executor: once, at the first step, on every rank."""
        if self.cp_groups is None:  # CPGroups checks torch.distributed's world against the cluster's
            self.cp_groups = CPGroups(self.cp_cluster, timeout=timedelta(seconds=self.args.ddp_timeout))
        if self.cp_executor is None:
            self.cp_executor = StepExecutor(
                self.accelerator.unwrap_model(self.model),
                self.cp_groups,
                self.cp_world,
                self.cp_rank,
                self.args.device,
                self.args.cp_loss_chunk_tokens,
                self._cp_backward,
                self._cp_wave_context,
                logit_temperature=self.temperature,  # TRL scores completions under the distribution it sampled from
            )

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
            self._cp_guarded_reward(f, name, failures, len(prompts)) for f, name in zip(funcs, self.reward_func_names)
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

    def _cp_guarded_reward(self, func, name: str, failures: List[str], rows: int):
        if isinstance(func, torch.nn.Module):  # a reward model: TRL runs it as a module
            return func
        first = self.accelerator.process_index * rows  # this process's first row of the generation batch
        size = self.num_generations

        def groups_of(kwargs):
            """(group, its rows' keyword arguments) of this process's rows."""
            local = list(range(rows))
            for g in sorted({(first + i) // size for i in local}):
                mine = [i for i in local if (first + i) // size == g]
                yield (
                    g,
                    {
                        k: ([v[i] for i in mine] if isinstance(v, list) and len(v) == rows else v)
                        for k, v in kwargs.items()
                    },
                )

        def describe(g, kwargs, err: BaseException) -> str:
            prompt = kwargs.get("prompts", [None])[0]
            return (
                f"step {self.state.global_step + 1}: reward function {name!r} raised {type(err).__name__}: {err} on "
                f"GRPO group {g} of the generation batch (rows {g * size}..{(g + 1) * size - 1}, process "
                f"{self.accelerator.process_index}, prompt {str(prompt)[:80]!r})"
            )

        if is_async_callable(func):

            async def guarded(**kwargs):
                try:
                    return await func(**kwargs)
                except Exception as err:  # noqa: BLE001 - re-raised on every rank by _calculate_rewards
                    for g, part in groups_of(kwargs):
                        try:
                            await func(**part)
                        except Exception as one:  # noqa: BLE001
                            failures.append(describe(g, part, one))
                            break
                    else:
                        failures.append(describe(first // size, kwargs, err) + " (no group alone raised)")
                    return [None] * rows

            return guarded

        def guarded(**kwargs):
            try:
                return func(**kwargs)
            except Exception as err:  # noqa: BLE001 - re-raised on every rank by _calculate_rewards
                for g, part in groups_of(kwargs):
                    try:
                        func(**part)
                    except Exception as one:  # noqa: BLE001
                        failures.append(describe(g, part, one))
                        break
                else:
                    failures.append(describe(first // size, kwargs, err) + " (no group alone raised)")
                return [None] * rows

        return guarded

    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        # TRL's schedule: generate every num_iterations steps (steps_per_generation is 1), else reuse
        if self._step % (self.args.steps_per_generation * self.num_iterations) == 0 or self._cp_rollout is None:
            self._cp_rollout = self._cp_gather(self._generate_and_score_completions(generation_batch))
        return self._cp_rollout

    def _cp_gather(self, out: dict) -> GRPORollout:
        """Every process's rows of TRL's generation output, padding removed, on every rank."""
        prompt_mask = out["prompt_mask"].bool().cpu()
        completion_mask = out["completion_mask"].cpu()
        loss_mask = completion_mask * out["tool_mask"].cpu() if "tool_mask" in out else completion_mask
        adv = out["advantages"].detach().float().cpu()
        old, ref = out.get("old_per_token_logps"), out.get("ref_per_token_logps")
        old = None if old is None else old.detach().float().cpu()
        ref = None if ref is None else ref.detach().float().cpu()
        prompt_ids, completion_ids = out["prompt_ids"].cpu(), out["completion_ids"].cpu()
        rows = []
        for i in range(prompt_ids.shape[0]):
            n = int(completion_mask[i].sum())
            a = adv[i].reshape(-1)[:n] if adv.dim() == 2 else adv[i].reshape(1)
            rows.append(
                (
                    prompt_ids[i][prompt_mask[i]].tolist(),
                    completion_ids[i, :n].tolist(),
                    loss_mask[i, :n].float().numpy(),
                    a.numpy(),
                    None if old is None else old[i, :n].numpy(),
                    None if ref is None else ref[i, :n].numpy(),
                )
            )
        per_process = gather_object([rows]) if self.cp_world > 1 else [rows]
        flat = [(p, r) for p, part in enumerate(per_process) for r in part]
        return GRPORollout(
            prompts=[r[0] for _, r in flat],
            completions=[r[1] for _, r in flat],
            loss_masks=[r[2] for _, r in flat],
            advantages=[r[3] for _, r in flat],
            old=None if old is None else [r[4] for _, r in flat],
            ref=None if ref is None else [r[5] for _, r in flat],
            processes=[p for p, _ in flat],
            num_generations=self.num_generations,
            per_token_advantages=adv.dim() == 2,
        )

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

    def _cp_build_step(self, rollout: GRPORollout) -> _StepTables:
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
            return _StepTables(step=None, planned=None, slot_row=empty, slot_prompt=empty, **base)
        planned = self._cp_plan(samples, masks, groups, rollout, index)
        collate = PlanCollator(lambda sid: samples[sid], masks)
        valid = sum(sum(1 for t in lab if t != IGNORE_INDEX) for _, lab in samples)
        step = collate.rank_step(planned.plan, self.cp_rank, valid, planned=planned)
        # every rank planned the same samples; a balancer whose plans depend on timing (a solver's
        # deadline) may still differ, and then every rank runs rank 0's plan (agreement.py)
        agreement = PlanAgreement(self.cp_groups.control, self.cp_cluster, self.cp_cost, self.cp_rank, collate)
        step = agreement.agree(step, self.cp_balancer, False, ()).step
        slot_row = [rows_of[sid][a] for sid, a in step.answer_slots]
        slot_prompt = [masks[sid].prompt for sid, _ in step.answer_slots]
        return _StepTables(
            step=step,
            planned=planned,
            slot_row=torch.tensor(slot_row, dtype=torch.long, device=device),
            slot_prompt=torch.tensor(slot_prompt, dtype=torch.long, device=device),
            **base,
        )

    def _cp_plan(self, samples, masks, groups, rollout: GRPORollout, index: int) -> PlannedStep:
        """The balancer's plan of the step's samples (validated and simulated by the Planner)."""
        lengths = [len(ids) for ids, _ in samples]
        check_sample_lengths(
            self.cp_balancer,
            range(len(lengths)),
            lengths,
            self.cp_cluster,
            self.cp_cost,
            masked=masks,
            where=f"step {index + 1}: ",
            label=lambda sid: self._cp_describe_group(rollout, groups[sid]),
        )
        sampler = GlobalBatchSampler(lengths, sum(lengths), seed=self.args.seed, num_epochs=1, shuffle=False)
        planner = Planner(
            sampler, self.cp_balancer, self.cp_cluster, self.cp_cost, seed=self.args.seed, lookahead=0, masks=masks
        )
        planned = planner.plan_now(0)
        planned.plan.step = index  # errors and collective scopes name the Trainer's step
        return planned

    def _cp_targets(self, mb: MicroBatch, own: torch.Tensor, extra: torch.Tensor, t: _StepTables):
        """(row, token index in its completion, log-prob) of every target of the micro-batch: an
        ordinary target at rotary position p of a group with prompt length P is completion token
        p - P + 1; an extra target (the prompt's last token predicting another completion's
        first token) is token 0."""
        dev = own.device
        slots = mb.target_slots[0].to(dev)
        keep = slots >= 0
        s = slots[keep]
        rows = t.slot_row[s]
        tok = mb.position_ids[0].to(dev)[keep] - t.slot_prompt[s] + 1
        logp = own[keep]
        if extra.numel():
            xs = mb.extra_slots.to(dev)
            xk = xs >= 0
            rows = torch.cat([rows, t.slot_row[xs[xk]]])
            tok = torch.cat([tok, torch.zeros_like(xs[xk])])
            logp = torch.cat([logp, extra[xk]])
        return rows, tok, logp

    def _cp_objective(self, t: _StepTables) -> Callable[[MicroBatch, torch.Tensor, torch.Tensor], torch.Tensor]:
        s = self.cp_grpo

        def objective(mb, own, extra):
            rows, tok, logp = self._cp_targets(mb, own, extra, t)
            adv = t.advantages[rows, tok if t.advantages.shape[1] > 1 else 0]
            old = None if t.old is None else t.old[rows, tok]
            ref = None if t.ref is None else t.ref[rows, tok]
            got = token_losses(s, logp, adv.to(logp.dtype), old, ref)
            value = (got.pop("loss") * t.weight[rows].to(logp.dtype)).sum()
            for key, v in got.items():
                acc = t.sums.setdefault(key, torch.zeros(len(t.weight), dtype=torch.float64, device=v.device))
                acc.index_add_(0, rows, v.double())
            t.loss += float(value.detach())
            return value

        return objective

    def _cp_policy_step(self, model, rollout: GRPORollout) -> torch.Tensor:
        t0 = time.perf_counter()
        tables = self._cp_build_step(rollout)
        build_ms = (time.perf_counter() - t0) * 1e3
        self.cp_last_step = tables
        if tables.step is None:  # nothing can move the policy: a zero gradient, as TRL's step has
            self.cp_executor._dummy_backward(model, self.state.global_step + 1, 0, True)
        else:
            step = tables.step
            self._cp_check_attention(step)
            with self.accelerator.autocast():
                self.cp_executor.train(model, step, self._cp_objective(tables))
        loss = self._cp_log(rollout, tables, build_ms)
        return torch.tensor(loss, dtype=torch.float32, device=self.args.device)

    def _cp_log(self, rollout: GRPORollout, t: _StepTables, build_ms: float) -> float:
        """The step's loss (every rank) and TRL's loss metrics from every rank's per-row sums."""
        keys = self._cp_stat_keys()
        R = rollout.rows
        flat = [torch.tensor([t.loss], dtype=torch.float64)]
        for k in keys:
            v = t.sums.get(k)
            flat.append(v.cpu() if v is not None else torch.zeros(R, dtype=torch.float64))
        vec = torch.cat(flat)
        if self.cp_world > 1:
            dist.all_reduce(vec, group=self.cp_groups.control)
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
