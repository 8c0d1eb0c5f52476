"""CPTrainer: a `transformers.Trainer` whose every optimizer step follows a balanced plan.

Only the Trainer's hooks live here; they call components that hold the work. One item of the
training loader is one planned optimizer step (`RankStep`); `training_step` opens it with the
plan agreement (step/agreement.py, which also carries the stop decision and the online calibration's
new coefficients, measure/online_calibration.py), hands it to the step executor (step/executor.py: the waves, the
loss scaling, the dummy micro-batches that keep ZeRO-2's reduction in step), and leaves a
`StepRecord` (measure/record_builder.py, measure/step_record.py) for the logs, the per-rank history files and `hf-cp
report`. `evaluate` runs planned evaluation batches through the same executor (step/evaluation.py).
Planning comes from hf_cp.planning (the same setup as the dry run and `hf-cp plan`), set up once
when the trainer is built (setup/trainer_setup.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Dict, List, Optional, Tuple

import torch
from torch.utils.data import DataLoader, SequentialSampler
from transformers import Trainer

import hf_cp.attention.interface  # noqa: F401 - registers attn_implementation="hf_cp" with transformers
from hf_cp.attention.kernels import use_attention_kernel
from hf_cp.attention.recurrent import attach_recurrent_layers, recurrent_layers_line
from hf_cp.cost.simulate import forward_only_share
from hf_cp.train.checkpoint.fit import run_engine
from hf_cp.train.checkpoint.resolve import checkpoint_step
from hf_cp.train.checkpoint.run_lock import hold_run_lock
from hf_cp.train.checkpoint.schedule import schedule_record
from hf_cp.train.checkpoint.stop_signal import StopSignal, replace_jit_checkpoint
from hf_cp.train.checks.launch import check_launch_settings
from hf_cp.train.checks.model import check_model_supported, check_recurrent_layers_fit
from hf_cp.train.checks.setup import check_parallelism
from hf_cp.train.data.collator import PlanCollator, RankStep
from hf_cp.train.data.columns import eos_token_ids, model_vocab_size
from hf_cp.train.data.planned_steps import PlannedSteps, first_item
from hf_cp.train.data.streaming import attach_stream, check_streaming, read_training_data, start_stream
from hf_cp.train.data.vision_columns import has_vision_columns
from hf_cp.train.measure.gradient_norm import nonfinite_gradients
from hf_cp.train.measure.metrics import StepThroughput, aggregate, summary_lines
from hf_cp.train.measure.online_calibration import OnlineCalibration, save_run_calibrated_profile
from hf_cp.train.measure.record_builder import gather_measurements, step_record
from hf_cp.train.measure.step_record import StepRecord, append_record
from hf_cp.train.measure.trainer_numbers import DataEpochCallback, corrected_speed_metrics
from hf_cp.train.runtime.checkpoints import atomic_save, resume_point
from hf_cp.train.runtime.step_runtime import StepRuntime
from hf_cp.train.setup.args import CPTrainingArguments
from hf_cp.train.setup.sharding import (
    FSDP2Trainer,
    check_trainer_sharding,
    check_zero3_chunk_keep,
    sharding_of,
)
from hf_cp.train.setup.trainer_setup import (
    check_training_data,
    planning_vision_grids,
    prepare_deepspeed,
    start_warnings,
    trainer_planning_setup,
)
from hf_cp.train.setup.vision_setup import attach_vision
from hf_cp.train.step.evaluation import evaluation_data, evaluation_totals
from hf_cp.train.step.executor import WaveTotals
from hf_cp.train.step.gc_schedule import ScheduledGarbageCollection
from hf_cp.train.step.layer_compile import compile_decoder_layers
from hf_cp.train.step.loss import LIGER_LOSS_LINE

logger = logging.getLogger(__name__)


class CPTrainer(FSDP2Trainer, Trainer):
    """Trainer for long-tailed data with per-step load-balanced context parallelism.

    `train_dataset` needs `input_ids` (one tokenised sample per row); optional `labels`
    (HF convention, -100 = no loss, e.g. prompt tokens), `length` and `attn_mask` (a sample's
    mask, e.g. shared-prompt groups from `hf-cp preprocess --group-answers`). Row index = sample
    id, except for pre-packed rows (TRL's `seq_lengths`, `cu_seqlens`, restarting
    `position_ids`), which are unpacked into their documents (data/columns.py).
    Samples a plan distributes over a CP group need the model loaded with
    `attn_implementation="hf_cp"`. `balancer` (an object with `.plan(PlanRequest)`) replaces
    the registry lookup of `args.cp_balancer`, for balancers built in code. A streaming
    `train_dataset` (no length) is read as training goes, with max_steps set (data/streaming.py).
    """

    cp_shared_prompt_samples = False  # True where every sample shares a prompt between answers (DPO, GRPO)
    cp_vision_pairs = False  # True where those samples carry images in their prompt (DPO's pairs)

    def __init__(
        self, model=None, args: Optional[CPTrainingArguments] = None, train_dataset=None, balancer=None, **kwargs
    ):
        if not isinstance(args, CPTrainingArguments):
            raise TypeError(f"CPTrainer needs CPTrainingArguments, got {type(args).__name__}")
        if model is not None:  # token mixers and features hf_cp cannot keep exact, before any other work
            attach_recurrent_layers(model)  # Gated DeltaNet layers run one document at a time (attention/recurrent.py)
            check_model_supported(model, f"{type(self).__name__}: the model")
        # before accelerate or DeepSpeed act on them (DeepSpeed's SP ends in a bare assertion)
        check_parallelism(getattr(args, "parallelism_config", None))
        check_trainer_sharding(args)  # a leftover FSDP flag; FSDP1, FSDP with DeepSpeed, offload
        # the DeepSpeed JSON, ddp_timeout, output_dir, report_to: before the model is wrapped
        launch_warnings = check_launch_settings(args, int(args.world_size), type(self).__name__)
        # "fsdp2", "zero3" or None: sharded parameters make every pass a world-wide collective
        self.cp_sharding = sharding_of(args)
        check_streaming(train_dataset, args)  # a stream needs max_steps and cp_shuffle off (data/streaming.py)
        note = prepare_deepspeed(args)
        if note and int(args.process_index) == 0:
            logger.warning("hf_cp: %s", note)
        compiled = compile_decoder_layers(model) if args.cp_compile else None  # before DeepSpeed or DDP wrap it
        super().__init__(model=model, args=args, train_dataset=train_dataset, **kwargs)
        self.cp_world, self.cp_rank = int(args.world_size), int(args.process_index)
        self._cp_warn(use_attention_kernel(args.cp_attention_kernel, args.device))  # the kernel in use, said once
        self._cp_warn(recurrent_layers_line(self.model))  # a hybrid's recurrent layers and their kernel
        self._cp_warn(compiled)
        for warning in launch_warnings:  # DeepSpeed keys it never reads, an unused NVMe path
            self._cp_warn(warning)
        self._cp_warn(LIGER_LOSS_LINE if args.use_liger_kernel else None)
        self.cp_throughput = StepThroughput.for_model(self.model.config, args.device)  # cp/tflops, cp/mfu
        # A trainer this class is mixed into may prepare the data first (TRL's SFTTrainer tokenises
        # prompt/completion or messages into input_ids and labels): read what it left, not the argument.
        self._cp_warn(check_training_data(self.train_dataset, kwargs.get("data_collator")))
        self.model.config.use_cache = False  # with a cache, packed documents attend across boundaries
        if args.cp_gc_interval_steps > 0:
            self.add_callback(ScheduledGarbageCollection(args.cp_gc_interval_steps))
        # first, so that every other callback, log and checkpoint sees the epochs of data trained
        self.callback_handler.callbacks.insert(
            0, DataEpochCallback(lambda: self.cp_history[-1].data_epoch if self.cp_history else None)
        )
        self._cp_history_start = 0  # index in cp_history of the first step of the current train() call
        eos = eos_token_ids(self.processing_class, getattr(self.model, "config", None))
        vocab = model_vocab_size(self.model)  # ids outside it fail the embedding with "index out of range"
        self.cp_data = read_training_data(
            self.train_dataset, "train_dataset", eos, vocab
        )  # a stream: read as it trains
        for warning in self.cp_data.warnings:  # rows that look packed but carry no boundaries
            self._cp_warn(warning)
        # images and clips (setup/vision_setup.py): the model's tower, or None in a text-only run
        self.cp_vision = attach_vision(
            self.train_dataset,
            self.cp_data,
            self.model,
            type(self).__name__,
            sharding=self.cp_sharding,
            shared_prompts=self.cp_shared_prompt_samples,
            vision_pairs=self.cp_vision_pairs,
        )
        # the run's PlanningSettings, built once: cp_setup.settings from here on
        # the samples' image and clip grids: the planner prices their encoder work (cost/vision.py)
        vision_grids = planning_vision_grids(self.train_dataset, self.cp_vision)
        setup = self.cp_setup = trainer_planning_setup(args, self.model, self.cp_data, self.cp_world, vision_grids)
        check_zero3_chunk_keep(self.cp_sharding, setup.settings.balancer, setup.settings.balancer_kwargs())
        check_recurrent_layers_fit(
            self.model,
            type(self).__name__,
            {m.kind for m in self.cp_data.masks.values()}
            | ({"shared_prompt"} if self.cp_shared_prompt_samples else set()),
            setup.settings.balancer,
        )
        self.cp_cost, self.cp_cluster, self.cp_sampler = setup.cost, setup.cluster, setup.sampler
        self.cp_stream = attach_stream(self, balancer)  # a streaming train_dataset's StreamColumns, else None
        for warning in start_warnings(setup, args.device.type, getattr(self.model.config, "_name_or_path", "")):
            self._cp_warn(warning)
        # online calibration (measure/online_calibration.py): a refit rides on the next step's plan agreement
        self.cp_calibration = OnlineCalibration.for_run(args, self.cp_cost, len(self.cp_sampler), self.cp_rank)
        # The loader already spans every epoch: one Trainer "epoch" of exactly this many steps.
        self.args.max_steps = len(self.cp_sampler)
        self.cp_balancer = balancer
        # groups, planner, executor and plan agreement, built at the first loader or evaluation
        self.cp_runtime = StepRuntime(self, setup, balancer)
        self.cp_history: List[StepRecord] = []  # one record per step, identical on every rank
        self._cp_pending: List[StepRecord] = []  # records not yet logged
        self._cp_eval_data: Dict[int, tuple] = {}  # id(eval dataset) -> (dataset, TokenColumns, plans)
        self._cp_resumed_from: Optional[int] = None  # set by train() when it resumes a checkpoint
        self._cp_last_step: Optional[RankStep] = None  # the step the next grad-norm check is about
        # enable_jit_checkpoint: stop on SIGTERM after a step every rank agrees on (see stop_signal)
        self.cp_stop_signal: Optional[StopSignal] = None
        self.cp_stopped_early: Optional[dict] = None  # {"step", "signal", "ranks"} once stopped
        if args.enable_jit_checkpoint:
            self.cp_stop_signal = replace_jit_checkpoint(self.callback_handler)

    def _cp_warn(self, warning: Optional[str]) -> None:
        """A set-up warning, logged once (rank 0)."""
        if warning and self.cp_rank == 0:
            logger.warning("hf_cp: %s", warning)

    # ------------------------------------------------------------------ data
    def _cp_setup(self) -> None:
        """The runtime's groups, planner and executor: once, at the same point on every rank."""
        self.cp_runtime.start(self.model, self.cp_data.masks, self.cp_data.digest())

    def get_train_dataloader(self) -> DataLoader:
        self._cp_setup()
        # Trainer.train asks for the dataloader before DeepSpeed / accelerate set up the model and
        # optimizer: the planner's worker starts and warms up meanwhile (Planner.start)
        self.cp_runtime.planner.start()
        collator = PlanCollator(self.cp_data.fetch, self.cp_data.masks, self.cp_data.vision)
        self.cp_runtime.agreement_for(collator)
        steps = PlannedSteps(self.cp_runtime.planner, collator, self.cp_rank, self.cp_data.valid_counts)
        # Not accelerator.prepare()d: every rank iterates every step; the plan splits the work.
        return DataLoader(steps, batch_size=1, sampler=SequentialSampler(steps), collate_fn=first_item, num_workers=0)

    # ------------------------------------------------------------------ one step
    def _cp_agree(self, step: RankStep) -> RankStep:
        """Plan agreement (step/agreement.py) before any collective of the step. The stop decision (a
        SIGTERM seen by any rank stops every rank after this step) and the online calibration's
        new coefficients (rank 0's are adopted) ride on the same exchange."""
        sig = self.cp_stop_signal
        flag = bool(sig and sig.requested)
        rt = self.cp_runtime
        got = rt.agreement.agree(step, rt.planner.balancer, flag, self.cp_calibration.offer())
        self.cp_calibration.adopt(got.payload, step.index, rt.planner)
        if got.flagged and self.cp_stopped_early is None:
            self.cp_stopped_early = sig.stop_after(got.step.index + 1, got.flagged, self.cp_rank)
            self.control.should_save = True
            self.control.should_training_stop = True
        return got.step

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        step: RankStep = inputs["cp_step"]
        t_step = time.perf_counter()
        t_epoch = time.time()
        # before any collective of this step
        # errors count steps as the Trainer does (global_step, checkpoint-N): from 1
        step = self._cp_agree(step)
        self.cp_runtime.check_attention(self.model, step)
        model.train()
        cuda = self.args.device if self.args.device.type == "cuda" else None
        if cuda is not None:
            torch.cuda.reset_peak_memory_stats(cuda)
        self.cp_runtime.executor.start_step()
        totals, loss = self._cp_train_waves(model, step)
        wall_ms = (time.perf_counter() - t_step) * 1e3
        peak_bytes = float(torch.cuda.max_memory_allocated(cuda)) if cuda is not None else -1.0
        self._cp_record(step, totals, wall_ms, [t_epoch, t_epoch + wall_ms / 1e3], peak_bytes, loss)
        self._cp_last_step = step
        return totals.loss

    @property
    def cp_forward_only_passes(self) -> int:
        """Forward-only passes over each step's plan before its training pass, which the step's
        predicted time counts: the MoE router's census (a forward without the LM head) when the
        model has a router term. Sequence objectives add their log-prob and reference passes."""
        return 1 if self.cp_runtime.router is not None else 0

    def _cp_train_waves(self, model, step: RankStep) -> Tuple[WaveTotals, Optional[float]]:
        """The step's forward and backward passes: (what this rank did, the step's loss when it is
        not the mean token cross-entropy). Sequence-level trainers (objectives/dpo.py) replace it."""
        return self.cp_runtime.executor.train(model, step), None

    def _cp_record(
        self,
        step: RankStep,
        totals: WaveTotals,
        wall_ms: float,
        span: List[float],
        peak_bytes: float = -1.0,
        loss: Optional[float] = None,
    ) -> None:
        """One StepRecord per step, identical on every rank (one all-gather of the measurements).
        `peak_bytes`: the device's peak allocated memory in the step (-1: not measured, off CUDA).
        `loss`: the step's loss when it is not the mean token cross-entropy (DPO, GRPO)."""
        rows = gather_measurements(totals, wall_ms, peak_bytes, self.cp_world, self.cp_runtime.groups.control)
        rec = step_record(
            step,
            rows,
            self.cp_sampler,
            self.state.global_step + 1,
            self.cp_runtime.planner.compare_name,
            self._cp_resumed_from,  # the checkpoint step this process started from
            len(self.cp_data),
            self.cp_forward_only_passes,
            forward_only_share(self.cp_cost.profile.forward_share, bool(self.args.gradient_checkpointing)),
            balancer_name=self.cp_runtime.balancer_name,
        )
        if loss is not None:
            rec = dataclasses.replace(rec, loss=float(loss))
        elif totals.router_loss:  # the MoE router's term over the step (step/router_balance.py), on every rank
            rec = dataclasses.replace(rec, loss=rec.loss + totals.router_loss)
        self.cp_throughput.observe(step, self.cp_data.masks)
        self.cp_calibration.observe(rec, step.planned)
        self.cp_history.append(rec)
        self._cp_pending.append(rec)
        if self.args.cp_record_history:
            line = rec.for_rank(self.cp_rank, step.trained_sample_ids, span, totals.wave_timeline)
            append_record(self.args.output_dir, line)

    def cp_calibrated_profile(self) -> Optional[str]:
        """The latest calibrated profile as YAML (None before the first calibration)."""
        return self.cp_calibration.profile_yaml(self.args.cp_profile, self.args.output_dir)

    # ------------------------------------------------------------------ evaluation
    def _cp_evaluation_settings(self) -> tuple:
        """(tokens per batch, balancer, cluster, cost model, seed) of planned evaluation passes:
        the run's own (evaluation.evaluation_data / evaluation_plans)."""
        balancer = self.cp_balancer or self.cp_setup.balancer()
        return (
            self.cp_setup.settings.step_tokens(self.cp_world),
            balancer,
            self.cp_cluster,
            self.cp_cost,
            self.args.seed,
        )

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> Dict[str, float]:
        """Loss over the eval set (sum of token losses / valid targets), planned like training.

        Logs and returns {prefix}_loss, {prefix}_tokens, {prefix}_samples, {prefix}_runtime; a
        dict of datasets is evaluated one by one with prefix {prefix}_{name}."""
        ds = eval_dataset if eval_dataset is not None else self.eval_dataset
        if ds is None:
            raise ValueError("CPTrainer.evaluate: no eval_dataset (pass one to evaluate() or to the trainer)")
        if isinstance(ds, dict):
            metrics: Dict[str, float] = {}
            for name, part in ds.items():
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        self._cp_setup()
        cached = self._cp_eval_data.get(id(ds))
        if cached is None or cached[0] is not ds:
            data, plans = evaluation_data(
                ds, f"eval dataset {metric_key_prefix!r}", *self._cp_evaluation_settings(), model_vocab_size(self.model)
            )
            if self.cp_vision is not None or has_vision_columns(getattr(ds, "column_names", None) or []):
                attach_vision(
                    ds,
                    data,
                    self.model,
                    type(self).__name__,
                    f"eval dataset {metric_key_prefix!r}",
                    self.cp_sharding,
                    self.cp_shared_prompt_samples,
                    self.cp_vision,
                    self.cp_vision_pairs,
                )
            # kept with the dataset itself, so that its id cannot be reused by another one
            cached = self._cp_eval_data[id(ds)] = (ds, data, plans)
        _, data, plans = cached
        t0 = time.perf_counter()
        model = self.model
        if next(model.parameters()).device != self.args.device:
            # evaluate() before train() under DeepSpeed: the engine has not placed the model yet
            model.to(self.args.device)
        impl = getattr(model.config, "_attn_implementation", None)
        rt = self.cp_runtime
        totals = evaluation_totals(
            model, rt.executor, plans, data, self.cp_rank, self.cp_world, rt.groups.control, impl
        )
        metrics = {
            f"{metric_key_prefix}_loss": float(totals[0] / totals[1]),
            f"{metric_key_prefix}_tokens": int(totals[2]),
            f"{metric_key_prefix}_samples": len(data),
            f"{metric_key_prefix}_runtime": round(time.perf_counter() - t0, 4),
        }
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def predict(self, *args, **kwargs):
        raise NotImplementedError(
            "CPTrainer.predict: CP-planned prediction (gathering logits of sharded samples) "
            "is not supported; evaluate() gives the planned eval loss"
        )

    # ------------------------------------------------------------------ non-finite gradients
    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        # grad_norm is the global norm (DeepSpeed's, or clipping's over synchronised gradients):
        # the same number on every rank, so every rank stops together, before this step's save
        if grad_norm is not None and not math.isfinite(float(grad_norm)):
            self._cp_nonfinite_gradients(float(grad_norm))
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def _cp_nonfinite_gradients(self, norm: float) -> None:
        step = self._cp_last_step
        ids = list(step.plan.sample_ids) if step is not None else []
        stop = self.args.cp_stop_on_nonfinite_grad
        warning = nonfinite_gradients(norm, self.state.global_step, ids, self.is_deepspeed_enabled, stop)
        if self.cp_rank == 0:
            logger.warning("hf_cp: %s", warning)

    # ------------------------------------------------------------------ logging
    def log(self, logs: Dict[str, float], start_time: Optional[float] = None) -> None:
        if self._cp_pending and "loss" in logs:
            logs.update(aggregate(self._cp_pending, throughput=self.cp_throughput))
            self._cp_pending = []
        # in place: the same dict is train()'s TrainOutput.metrics
        corrected_speed_metrics(logs, self.cp_history[self._cp_history_start :])
        super().log(logs, start_time)

    def floating_point_ops(self, inputs) -> int:
        step = inputs.get("cp_step") if isinstance(inputs, dict) else None
        if step is None or not hasattr(self.model, "num_parameters"):
            return 0
        tokens = sum(mb.num_tokens for mb in step.waves if mb is not None)
        return 6 * tokens * self.model.num_parameters(exclude_embeddings=True)

    def cp_summary(self, compare: bool = True) -> List[str]:
        return summary_lines(
            self.cp_history,
            self.cp_runtime.balancer_name,
            self.args.cp_compare_balancer if compare else "",
            throughput=self.cp_throughput,
        )

    def cp_schedule(self) -> dict:
        """What decides the samples of every step: saved with each checkpoint, checked on resume."""
        if self.cp_stream is not None:  # with the position of the next step in the stream
            return self.cp_stream.schedule(self.cp_world, self.state.global_step)
        sm = self.cp_sampler
        return schedule_record(
            sm.lengths, sm.tokens_per_step, sm.seed, sm.shuffle, self.cp_world, self.cp_data.digest()
        )

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's save, made atomic (runtime/checkpoints.py atomic_save): complete once every
        rank has written its files and rank 0 has marked it; rotation over complete ones only."""
        atomic_save(self, trial, lambda: super(CPTrainer, self)._save_checkpoint(model, trial))

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`resume_from_checkpoint`: a complete checkpoint folder, True (the newest complete one,
        which must exist) or "latest" (the newest complete one, else a fresh start: what a
        restarted job passes). Partial checkpoints (a save that did not finish) are skipped with
        a warning naming them (checkpoint/). The run holds output_dir's lock meanwhile (checkpoint/run_lock.py):
        a second run on the same output_dir is refused on every rank with OutputDirLockedError."""
        # before resume_point, which cuts back or removes the history files of a run holding it
        with hold_run_lock(self.args.output_dir, self.cp_rank, self.cp_world, self.args.cp_break_lock):
            return self._cp_train(resume_from_checkpoint, *args, **kwargs)

    def _cp_train(self, resume_from_checkpoint=None, *args, **kwargs):
        ds = getattr(self.args, "hf_deepspeed_config", None) if self.is_deepspeed_enabled else None
        resume = resume_point(
            resume_from_checkpoint,
            self.args,
            self.cp_rank,
            self.cp_schedule(),
            self.cp_world,
            ds.config if ds is not None else None,
            self._cp_warn,
            engine=run_engine(self.cp_sharding, ds.config if ds is not None else None),
            model_config=getattr(self.model, "config", None),
        )
        self._cp_resumed_from = checkpoint_step(resume) if resume is not None else None
        if self.cp_stream is not None:  # from the stream's start, or where the checkpoint's next step starts
            start_stream(self, resume)
        self._cp_history_start = len(self.cp_history)
        if self.cp_stop_signal is not None and not self.cp_stop_signal.install():
            logger.warning(
                "hf_cp: enable_jit_checkpoint needs train() on the main thread (signal handlers "
                "live there); SIGTERM keeps its default action"
            )
        try:
            out = super().train(resume, *args, **kwargs)
            save_run_calibrated_profile(self.args, self.cp_calibrated_profile())
            return out
        finally:
            if self.cp_stop_signal is not None:
                self.cp_stop_signal.uninstall()
            self.cp_runtime.close()
