"""What the generation trainers (GRPO, RLOO) share under hf_cp: TRL generates, scores and
computes the advantages; hf_cp plans the policy step. A trainer is this mixin before its TRL base
(`class CPGRPOTrainer(PlannedRollouts, GRPOTrainer)`) and states only its settings and its step.

Shared here:
- set-up checks (the model's token mixers and features, sharding, tools, MoE auxiliary losses,
  hf_cp's attention on the policy, prompts with images: rollout_vision.py) and the step runtime,
  built once;
- generation and scoring on `cp_generation_attn_implementation` (KV cache, padded batches);
- reward functions guarded so that one that raises stops every rank, naming the group;
- the generation batch gathered from every process into one rollout (grpo_generation.py);
- each prompt group (one prompt, its completions: TRL's "group") as one shared-prompt sample,
  planned by the runtime (`plan_batch`) onto CP groups, collated and agreed on every rank (its
  prompt's images, where TRL's vision rows gave some, encoded in the planned passes by the
  policy's tower, each completion's M-RoPE positions those of prompt+completion alone);
- a StepRecord per planned step (`cp_history`), measured over the step's planned passes alone
  (generation and TRL's scoring are outside the clock), which the online calibration observes
  (its fits ride on the next step's plan agreement and plan the step after it) and the end-of-run
  summary's balance lines read (metrics.balance_lines, as every trainer's).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field, replace
from typing import ClassVar, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from accelerate.utils import gather_object, is_peft_model

from hf_cp.attention.recurrent import attach_recurrent_layers, recurrent_layers_line
from hf_cp.cost.simulate import forward_only_share
from hf_cp.planning.worker import PlannedStep
from hf_cp.samples.masks import SampleMask
from hf_cp.train.checkpoint.fit import run_engine
from hf_cp.train.checkpoint.resolve import checkpoint_step
from hf_cp.train.checkpoint.run_lock import hold_run_lock
from hf_cp.train.checks.launch import check_launch_settings
from hf_cp.train.checks.model import check_model_supported, check_recurrent_layers_fit
from hf_cp.train.checks.setup import HF_CP_ATTENTION
from hf_cp.train.data.collator import IGNORE_INDEX, PlanCollator, RankStep
from hf_cp.train.measure.metrics import balance_lines, memory_lines, prediction_error_line
from hf_cp.train.measure.online_calibration import OnlineCalibration, save_run_calibrated_profile
from hf_cp.train.measure.record_builder import gather_measurements, predicted_step_ms, step_record
from hf_cp.train.measure.step_record import StepRecord, append_record
from hf_cp.train.objectives.grpo_generation import (
    GRPORollout,
    RewardFunctionError,
    gather_rollout,
    guarded_reward,
    keep_reference_loadable,
)
from hf_cp.train.objectives.rollout_vision import (
    check_image_prompts,
    group_images,
    refuse_completion_media,
    rollout_vision,
)
from hf_cp.train.runtime.checkpoints import atomic_save, resume_point
from hf_cp.train.runtime.step_runtime import StepRuntime
from hf_cp.train.setup.sharding import FSDP2Trainer, check_trainer_sharding, sharding_of
from hf_cp.train.setup.trainer_setup import prepare_deepspeed, trainer_planning_setup
from hf_cp.train.step.totals import WaveTotals
from hf_cp.train.step.vision_tower import vision_tower_of

logger = logging.getLogger(__name__)


def refuse_accumulation(config, name: str) -> None:
    """Before the TRL config's own checks: one optimizer step is one planned step over the whole
    generation batch."""
    if config.gradient_accumulation_steps != 1:
        raise ValueError(
            f"{name}: gradient_accumulation_steps={config.gradient_accumulation_steps}: one optimizer step is "
            "one planned step over the whole generation batch, whose plan (not accumulation) bounds each rank's "
            "memory; set gradient_accumulation_steps=1 and size the batch with per_device_train_batch_size"
        )
    if config.steps_per_generation not in (None, 1):
        raise ValueError(
            f"{name}: steps_per_generation={config.steps_per_generation}: hf_cp trains each generation batch "
            "in one planned step; set steps_per_generation=1 (num_iterations reuses a batch for several steps)"
        )


def refuse_split_generation(config, name: str) -> None:
    """After the TRL config's own checks, which derive steps_per_generation."""
    if config.steps_per_generation != 1:
        raise ValueError(
            f"{name}: generation_batch_size={config.generation_batch_size} makes steps_per_generation "
            f"{config.steps_per_generation}; hf_cp trains each generation batch in one planned step: leave "
            "generation_batch_size unset (it is per_device_train_batch_size x processes)"
        )


def refuse_vllm(args, name: str) -> None:
    """One refusal, before TRL's own ("vLLM is not available") or the importance-sampling one."""
    if getattr(args, "use_vllm", False):
        raise ValueError(
            f"{name}: use_vllm=True is not supported: the planned step does not carry vLLM's sampling log-probs "
            "(TRL's importance-sampling correction) and hf_cp does not sync the policy's weights to a vLLM engine; "
            "completions are generated through transformers on the policy itself (its attention switched to "
            "cp_generation_attn_implementation, default 'sdpa'): set use_vllm=False"
        )


@dataclass
class PassTiming:
    """A step's planned passes as PlannedRollouts._cp_timed_passes measured them."""

    wall_ms: float = 0.0
    peak_bytes: float = -1.0  # the device's peak allocated memory in them; -1: not measured (off CUDA)


@dataclass
class PromptGroups:
    """The prompt groups of a rollout that run (TRL's groups: one prompt and its completions),
    each one shared-prompt sample (sample id = index). "Group" alone in hf_cp means a plan's CP
    group (plan/step_plan.py) or a process group (step/groups.py); a rollout's are prompt groups."""

    samples: List[Tuple[List[int], List[int]]]  # (input_ids, labels)
    masks: Dict[int, SampleMask]
    rows_of: List[List[int]]  # sample id -> the rollout rows of its answers, in answer order
    prompt_group: List[int]  # sample id -> its prompt group's index in the generation batch
    skipped: List[int]  # prompt groups not run (no row that can move the policy)
    # sample id -> its prompt's images (pixel rows, grids), None without; empty in a text run
    images: List[Optional[tuple]] = field(default_factory=list)


class PlannedRollouts(FSDP2Trainer):
    """The mixin of a TRL generation trainer under planned CP (see the module's docstring).
    Subclasses set `cp_trainer_name`, `cp_objective` and `cp_config_class`, and define
    `_cp_loss_settings(args)` (read and refuse the loss's settings), `_cp_settings(args)` (keep
    cp_check_arguments' result, before any work) and `_cp_policy_step(model, rollout)`."""

    cp_trainer_name: ClassVar[str] = ""
    cp_objective: ClassVar[str] = ""  # how messages name a group: "GRPO group 3"
    cp_config_class: ClassVar[type] = object
    # forward-only passes over each step's plan before its training pass (RLOO: the policy's
    # log-probs), which cp/predicted_step_ms counts; TRL's own scoring passes are not planned
    cp_forward_only_passes: ClassVar[int] = 0

    def __init__(self, model=None, reward_funcs=None, args=None, train_dataset=None, balancer=None, **kwargs):
        name = self.cp_trainer_name
        if not isinstance(args, self.cp_config_class):
            raise TypeError(
                f"{name} needs {self.cp_config_class.__name__} (its TRL config + CPTrainingArguments), got "
                f"{type(args).__name__}"
            )
        if model is not None and not isinstance(model, str):  # a model name is checked once TRL has loaded it
            attach_recurrent_layers(model)  # a hybrid's layers run per document in the planned passes
            check_recurrent_layers_fit(model, name, {"shared_prompt"}, args.cp_balancer)
            check_model_supported(model, f"{name}: the policy")
        check_trainer_sharding(args)  # a leftover FSDP flag; FSDP1, FSDP with DeepSpeed, offload
        # the DeepSpeed JSON, ddp_timeout, output_dir, report_to, as CPTrainer checks them: before any work
        launch_warnings = check_launch_settings(args, int(args.world_size), name)
        launch_warnings.append(prepare_deepspeed(args))  # as CPTrainer: before TRL starts DeepSpeed
        self._cp_settings(args)  # refuses unsupported loss settings before any work
        for key in ("tools", "environment_factory"):
            if kwargs.get(key):
                raise ValueError(
                    f"{name}: {key} (multi-turn rollouts with tool or environment turns inside the "
                    "completion) is not supported yet; pass rollout_func for custom rollouts"
                )
        datasets = {"train_dataset": train_dataset, "eval_dataset": kwargs.get("eval_dataset")}
        # TRL's vision rows (images in the prompt), generated by TRL with the model's processor
        images = check_image_prompts(datasets, kwargs.get("processing_class"), args, name)
        if model is not None and not isinstance(model, str) and args.beta != 0.0 and kwargs.get("peft_config") is None:
            keep_reference_loadable(model, args.output_dir, int(args.process_index))
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset, **kwargs)
        if isinstance(model, str):  # TRL loaded it from the name
            attach_recurrent_layers(self.model)
            check_recurrent_layers_fit(self.model, name, {"shared_prompt"}, args.cp_balancer)
            check_model_supported(self.model, f"{name}: the policy")
        if self._is_vlm and not images:
            raise ValueError(
                f"{name}: processing_class is a processor ({type(self.processing_class).__name__}) but the prompts "
                "have no images: a vision-language policy trains text prompts with its tokenizer as "
                "processing_class"
            )
        if self.aux_loss_enabled:
            raise ValueError(
                f"{name}: the model returns a MoE router auxiliary loss (router_aux_loss_coef != 0), which hf_cp's "
                "planned forward does not collect; set router_aux_loss_coef=0"
            )
        impl = getattr(self._cp_base(self.model).config, "_attn_implementation", None)
        if impl != HF_CP_ATTENTION:
            raise ValueError(
                f"{name}: the policy uses attn_implementation={impl!r}; each group is one shared-prompt sample "
                f"whose mask only hf_cp's attention reads: load it with attn_implementation='{HF_CP_ATTENTION}' "
                f"(generation switches to cp_generation_attn_implementation={args.cp_generation_attn_implementation!r})"
            )
        self.cp_world, self.cp_rank = int(args.world_size), int(args.process_index)
        # DeepSpeed keys it never reads, a hybrid's recurrent layers and their kernel: once
        for warning in [*launch_warnings, recurrent_layers_line(self.model)] if self.cp_rank == 0 else ():
            if warning:
                logger.warning("hf_cp: %s", warning)
        # no sampler: the batches come from generation, each planned when it is made
        setup = self.cp_setup = trainer_planning_setup(args, self.model, None, self.cp_world)
        # prompts with images (rollout_vision.py): the policy's tower encodes them in the planned passes
        self.cp_vision = vision_tower_of(self._cp_base(self.model), f"{name}: the policy") if images else None
        self.cp_runtime = StepRuntime(self, setup, balancer)  # process groups, planner, executor, agreement
        self._cp_rollout: Optional[GRPORollout] = None
        self.cp_history: List[StepRecord] = []  # one record per planned step, identical on every rank
        # built at the first step, when the Trainer knows the run's steps (measure/online_calibration.py)
        self.cp_calibration: Optional[OnlineCalibration] = None
        self._cp_resumed_from: Optional[int] = None  # set by train() when it resumes a checkpoint

    @classmethod
    def cp_check_arguments(cls, args):
        """Every refusal that reads only `args` (the trainer's, and `hf-cp train --dry-run`'s, with no
        model built); returns the loss's settings (`_cp_loss_settings`)."""
        refuse_vllm(args, cls.cp_trainer_name)
        return cls._cp_loss_settings(args)

    @staticmethod
    def _cp_loss_settings(args):
        raise NotImplementedError

    def _cp_settings(self, args) -> None:
        raise NotImplementedError

    def _cp_policy_step(self, model, rollout: GRPORollout) -> torch.Tensor:
        raise NotImplementedError

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """The TRL trainer's train, holding output_dir's lock as CPTrainer.train does (checkpoint/run_lock.py).
        A resume is checked as CPTrainer checks one before anything loads (runtime/checkpoints.py
        resume_point): its files against their checksums, no code in its pickles, the engine and
        model it was saved by; "latest" resumes the newest complete checkpoint, else starts fresh.
        TRL's sampler has no hf_cp schedule to compare."""
        with hold_run_lock(self.args.output_dir, self.cp_rank, self.cp_world, self.args.cp_break_lock):
            ds = getattr(self.args, "hf_deepspeed_config", None) if self.is_deepspeed_enabled else None
            resume = resume_point(
                resume_from_checkpoint,
                self.args,
                self.cp_rank,
                None,
                self.cp_world,
                ds.config if ds is not None else None,
                lambda note: logger.warning("hf_cp: %s", note) if self.cp_rank == 0 else None,
                engine=run_engine(sharding_of(self.args), ds.config if ds is not None else None),
                model_config=getattr(self._cp_base(self.model), "config", None),
            )
            self._cp_resumed_from = checkpoint_step(resume) if resume is not None else None
            out = super().train(resume, *args, **kwargs)
            save_run_calibrated_profile(self.args, self.cp_calibrated_profile())
            return out

    def cp_schedule(self) -> dict:
        """What a checkpoint records of the sample schedule: TRL's sampler makes the batches, so no
        hf_cp schedule is compared on resume, only the world it was saved on."""
        return {"world_size": self.cp_world, "sampler": "TRL's (batches made as training goes: not compared)"}

    def _save_checkpoint(self, model, trial) -> None:
        """TRL's save made atomic as CPTrainer's (runtime/checkpoints.py atomic_save): complete once
        every rank has written its files and rank 0 has marked it, with the run's calibrated profile;
        rotation over complete checkpoints only."""
        atomic_save(self, trial, lambda: super(PlannedRollouts, self)._save_checkpoint(model, trial))

    def cp_summary(self) -> List[str]:
        """The end-of-run lines `hf-cp train` and the recipes print: the reward's first and last
        quarter and the completions' length (the log history), then the planned steps' balance,
        time and prediction error (their records, as every trainer's summary gives them)."""
        lines = rollout_summary(self.state.log_history, self.cp_history)
        if not self.cp_history:
            return lines
        lines += balance_lines(self.cp_history, self.cp_runtime.balancer_name, self.args.cp_compare_balancer or "")
        return lines + [prediction_error_line(self.cp_history)] + memory_lines(self.cp_history)

    def cp_calibrated_profile(self) -> Optional[str]:
        """The latest calibrated profile as YAML (None before the first calibration)."""
        if self.cp_calibration is None:
            return None
        return self.cp_calibration.profile_yaml(self.args.cp_profile, self.args.output_dir)

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def _cp_base(model):
        return model.get_base_model() if is_peft_model(model) else model

    def _cp_setup(self) -> None:
        """The runtime's process groups, planner and executor, and the online calibration: once, at
        the first step, on every rank."""
        # TRL scores completions under the distribution it sampled from
        self.cp_runtime.start(self.accelerator.unwrap_model(self.model), logit_temperature=self.temperature)
        if self.cp_calibration is None:
            self.cp_calibration = OnlineCalibration.for_run(
                self.args, self.cp_runtime.cost, self.state.max_steps, self.cp_rank
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
                # a vision-language policy's tower keeps the sdpa its VisionTower set (step/vision_tower.py)
                tower = getattr(base.config, "vision_config", None)
                base.set_attn_implementation(impl)
                changed.append((base, was, tower, getattr(tower, "_attn_implementation", None)))
        try:
            yield
        finally:
            for base, was, tower, tower_was in reversed(changed):
                base.set_attn_implementation(was)
                if tower is not None:
                    tower._attn_implementation = tower_was

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

    def _cp_describe_prompt_group(self, rollout: GRPORollout, g: int) -> str:
        prompt = rollout.prompts[g * rollout.num_generations]
        try:
            text = self.processing_class.decode(prompt[-60:])
        except Exception:  # noqa: BLE001 - only for a message
            text = str(prompt[-20:])
        return f"{self.cp_objective} group {g} (prompt of {len(prompt)} tokens ending {text!r})"

    def _cp_prompt_groups(self, rollout: GRPORollout, trainable: Sequence[bool], index: int) -> PromptGroups:
        """Each group with a row that can move the policy (`trainable`) as one shared-prompt
        sample of its prompt and those rows' completions; the same on every rank."""
        G, R = rollout.num_generations, rollout.rows
        out = PromptGroups([], {}, [], [], [])
        truncated: List[int] = []
        for g in range(R // G):
            members = list(range(g * G, (g + 1) * G))
            prompt = rollout.prompts[members[0]]
            for r in members[1:]:
                if rollout.prompts[r] != prompt:
                    raise ValueError(
                        f"step {index + 1}: rows {members[0]} and {r} of {self._cp_describe_prompt_group(rollout, g)} have "
                        "different prompt tokens; a group must be one prompt and its completions"
                    )
            if not prompt:
                raise ValueError(f"step {index + 1}: {self._cp_describe_prompt_group(rollout, g)} has an empty prompt")
            kept = [r for r in members if trainable[r]]
            if not kept:
                out.skipped.append(g)
                if self.mask_truncated_completions and all(len(rollout.completions[r]) == 0 for r in members):
                    truncated.append(g)
                continue
            ids, labels = list(prompt), [IGNORE_INDEX] * len(prompt)
            for r in kept:
                ids += rollout.completions[r]
                labels += [t if m > 0 else IGNORE_INDEX for t, m in zip(rollout.completions[r], rollout.loss_masks[r])]
            out.masks[len(out.samples)] = SampleMask.shared_prompt(
                len(prompt), [len(rollout.completions[r]) for r in kept]
            )
            out.samples.append((ids, labels))
            if self.cp_vision is not None:
                describe = lambda g=g: self._cp_describe_prompt_group(rollout, g)  # noqa: E731
                for r in kept:
                    refuse_completion_media(rollout.completions[r], self.cp_vision, r, describe)
                out.images.append(None if rollout.images is None else group_images(rollout.images, members, describe))
            out.rows_of.append(kept)
            out.prompt_group.append(g)
        if truncated and self.cp_rank == 0:
            logger.warning(
                "hf_cp: step %d: %s: every completion was truncated at max_completion_length=%s without EOS and "
                "mask_truncated_completions=True masks them all, so the group carries no training signal; skipped "
                "(TRL would run it with zero loss)",
                index + 1,
                ", ".join(self._cp_describe_prompt_group(rollout, g) for g in truncated),
                self.max_completion_length,
            )
        return out

    def _cp_rank_step(
        self, prompt_groups: PromptGroups, rollout: GRPORollout, index: int
    ) -> Tuple[RankStep, PlannedStep]:
        """The step's plan (the runtime's planner) and this rank's micro-batches of it."""
        lengths = [len(ids) for ids, _ in prompt_groups.samples]

        def label(sid: int) -> str:
            return self._cp_describe_prompt_group(rollout, prompt_groups.prompt_group[sid])

        planned = self.cp_runtime.plan_batch(index, lengths, prompt_groups.masks, label)
        vision = None
        if self.cp_vision is not None:  # a vision run: every micro-batch carries vision rows (None: a text group)
            images = prompt_groups.images or [None] * len(prompt_groups.samples)
            vision = rollout_vision(prompt_groups.samples, images, prompt_groups.masks, self.cp_vision)
        collate = PlanCollator(lambda sid: prompt_groups.samples[sid], prompt_groups.masks, vision)
        valid = sum(sum(1 for t in lab if t != IGNORE_INDEX) for _, lab in prompt_groups.samples)
        step = collate.rank_step(planned.plan, self.cp_rank, valid, planned=planned)
        # every rank planned the same samples; a balancer whose plans depend on timing (a solver's
        # deadline) may still differ, and then every rank runs rank 0's plan (step/agreement.py)
        # the online calibration's pending fit rides on the same exchange (every rank adopts rank 0's)
        runtime = self.cp_runtime
        agreed = runtime.agreement_for(collate).agree(
            step, runtime.planner.balancer, False, self.cp_calibration.offer()
        )
        self.cp_calibration.adopt(agreed.payload, index, runtime.planner)
        return agreed.step, planned

    @contextlib.contextmanager
    def _cp_timed_passes(self) -> Iterator[PassTiming]:
        """Around a step's planned passes (its forward-only passes, then its training pass): their
        wall time and the device's peak memory in them, filled in on exit. What the plan predicts
        is these passes, so generation and TRL's scoring stay outside."""
        executor = self.cp_runtime.executor
        cuda = self.args.device if self.args.device.type == "cuda" else None
        if cuda is not None:
            torch.cuda.reset_peak_memory_stats(cuda)
        executor.start_step()  # the forward-only passes from here on are this step's
        timing = PassTiming()
        t0 = executor.now()  # after the GPU's queued work: generation's kernels are not the step's
        yield timing
        timing.wall_ms = (executor.now() - t0) * 1e3
        if cuda is not None:
            timing.peak_bytes = float(torch.cuda.max_memory_allocated(cuda))

    def _cp_record(self, step: RankStep, totals: WaveTotals, timing: PassTiming, loss: float) -> None:
        """The step's StepRecord (one all-gather of every rank's measurements, as CPTrainer's),
        kept in cp_history and observed by the online calibration."""
        runtime = self.cp_runtime
        rows = gather_measurements(totals, timing.wall_ms, timing.peak_bytes, self.cp_world, runtime.groups.control)
        rec = step_record(
            step,
            rows,
            None,  # no sampler: TRL's batches are made as training goes
            self.state.global_step + 1,
            runtime.planner.compare_name,
            self._cp_resumed_from,
            dataset_samples=0,  # not read without a sampler
            forward_only_passes=self.cp_forward_only_passes,
            forward_share=forward_only_share(
                runtime.cost.profile.forward_share, bool(self.args.gradient_checkpointing)
            ),
            balancer_name=runtime.balancer_name,
        )
        rec = replace(rec, loss=float(loss))  # the objective's loss, not a token cross-entropy
        self.cp_calibration.observe(rec, step.planned)
        self.cp_history.append(rec)
        if self.args.cp_record_history:  # output_dir/cp_history/rank<R>.jsonl, as CPTrainer's (hf-cp report)
            # no sample ids: a rollout step's ids number its own prompt groups, not the dataset's
            # rows (TRL's sampler draws them), so hf-cp report's once-per-epoch audit has nothing
            # to check (it flagged every prompt group of a GRPO run as trained at every step)
            append_record(self.args.output_dir, rec.for_rank(self.cp_rank, None))

    def _cp_log_plan(
        self, prompt_groups: PromptGroups, step: Optional[RankStep], planned: Optional[PlannedStep], build_ms: float
    ) -> None:
        """The cp/ keys of the step's plan."""
        m = self._metrics["train"]
        m["cp/prompt_groups"].append(float(len(prompt_groups.prompt_group)))
        m["cp/skipped_prompt_groups"].append(float(len(prompt_groups.skipped)))
        m["cp/build_ms"].append(build_ms)
        if step is not None:
            plan = step.plan  # rank 0's, where a timing-dependent balancer planned otherwise here
            m["cp/tokens"].append(float(sum(plan.lengths)))
            m["cp/waves"].append(float(len(plan.waves)))
            m["cp/planner_ms"].append(float(planned.planner_ms))
            share = forward_only_share(
                self.cp_runtime.cost.profile.forward_share, bool(self.args.gradient_checkpointing)
            )
            m["cp/predicted_step_ms"].append(predicted_step_ms(planned.predicted, self.cp_forward_only_passes, share))
            for size, n in sorted(planned.predicted.cp_size_samples.items()):
                m[f"cp/cp_size{int(size)}_samples"].append(float(n))


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def rollout_summary(history: Sequence[dict], records: Sequence[StepRecord]) -> List[str]:
    """Summary lines over a generation trainer's logged steps (TRL's keys and the cp/ ones) and
    its planned steps' `records`."""
    logged = [r for r in history if "reward" in r and r["reward"] is not None]
    if not logged:
        return ["no step logged a reward (logging_steps larger than the run?)"]
    rewards = [float(r["reward"]) for r in logged]
    k = max(1, len(rewards) // 4)
    first, last = _mean(rewards[:k]), _mean(rewards[-k:])
    trend = "up" if last > first else "down" if last < first else "flat"
    lines = [
        f"logged steps {len(logged)}; mean reward: first {k} {first:.4f} -> last {k} {last:.4f} ({trend})",
    ]
    lengths = [float(r["completions/mean_length"]) for r in logged if "completions/mean_length" in r]
    if lengths:
        lines.append(
            f"completion length: mean {_mean(lengths):.1f} tokens (first {lengths[0]:.1f}, last {lengths[-1]:.1f})"
        )
    prompts = sum(float(r.get("cp/prompt_groups", 0.0)) for r in logged)
    skipped = sum(float(r.get("cp/skipped_prompt_groups", 0.0)) for r in logged)
    if skipped:  # a prompt group whose completions all scored alike has no advantage: nothing to train on
        lines.append(
            f"prompt groups trained: {prompts - skipped:.0f} of {prompts:.0f} ({skipped:.0f} with equal rewards skipped)"
        )
    walls = [1000.0 * float(r["step_time"]) for r in logged if "step_time" in r]
    if records:
        predicted = _mean([r.predicted_step_ms for r in records])
        measured = _mean([r.step_wall_ms for r in records])
        whole = f"; {_mean(walls):.0f} ms a step with generation (TRL's step_time)" if walls else ""
        lines.append(
            f"planned policy step: predicted {predicted:.0f} ms, measured {measured:.0f} ms over {len(records)} "
            f"step(s) (its planned passes){whole}"
        )
    return lines


def idle_rows(rollout: GRPORollout, beta: float) -> np.ndarray:
    """Rows that cannot move the policy: no loss token, or an advantage of exactly 0 with no KL
    term in the loss (beta == 0). Their gradient in TRL is exactly 0."""
    counts = rollout.counts()
    return np.asarray(
        [counts[r] == 0 or (beta == 0.0 and not np.any(rollout.advantages[r])) for r in range(rollout.rows)]
    )
