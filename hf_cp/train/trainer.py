"""CPTrainer: a `transformers.Trainer` whose every optimizer step follows a balanced plan.

Only the Trainer's hooks live here: one item of the training loader is one planned optimizer
step (`RankStep`), `training_step` hands it to the step executor (step.py: the waves, the loss
scaling, the dummy micro-batches that keep ZeRO-2's reduction in step), `evaluate` runs planned
evaluation batches through the same executor, and every step leaves a `StepRecord`
(history.py) for the logs, the per-rank history files and `hf-cp report`. Planning comes from
hf_cp.planning (the same setup as the dry run and `hf-cp plan`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, SequentialSampler
from transformers import Trainer

from ..consistency import agree_on_plan_and_payload, assert_data_agrees, assert_plans_agree
from ..cost import CostModel
from ..plan import StepPlan
from ..planning import Planner, planning_setup
from ..planning.calibration import (
    CalibrationSettings,
    Calibrator,
    Coefficients,
    calibrated_profile_yaml,
    observe_step,
)
from ..planning.evaluation import plan_evaluation
from ..planning.profile_check import available_cores, profile_warning, shared_cores_warning
from .args import CPTrainingArguments
from .collator import IGNORE_INDEX, PlanCollator, RankStep
from .columns import read_token_columns
from .evaluation import evaluation_rank_steps
from .gc_schedule import ScheduledGarbageCollection
from .groups import CPGroups
from .history import StepRecord, append_record, history_path
from .metrics import aggregate, summary_lines
from .resume import (
    check_resume,
    checkpoint_step,
    resolve_resume,
    restart_attempt,
    restart_problems,
    schedule_record,
    truncate_history,
    write_schedule,
)
from .setup_checks import check_attention, check_parallelism, deepspeed_arch_list
from .step import StepExecutor, WaveTotals
from .stop_signal import StopSignal
from .trainer_numbers import DataEpochCallback, corrected_speed_metrics, data_epoch
from .user_collator import check_data_collator

logger = logging.getLogger(__name__)

try:  # registers attn_implementation="hf_cp" with transformers
    from ..attention.interface import ATTN_IMPLEMENTATION as HF_CP_ATTENTION
except ImportError:  # pragma: no cover - the attention package is part of hf_cp
    HF_CP_ATTENTION = "hf_cp"


# the online calibration's profile, in each checkpoint and in output_dir at the end of training
CALIBRATED_PROFILE = "cp_profile_calibrated.yaml"


class NonFiniteGradientError(RuntimeError):
    """A step's global gradient norm was NaN or infinite."""


def skip_deepspeed_shm_build() -> None:
    """DeepSpeed JIT-compiles a shared-memory comm op (~50 s) on every first init; CPU training
    over gloo does not use it."""
    import importlib

    try:
        # by module name: the package attribute `deepspeed.comm.torch` is torch itself
        ds_torch = importlib.import_module("deepspeed.comm.torch")
    except ImportError:  # pragma: no cover - deepspeed is a core dependency
        return
    ds_torch.build_shm_op = lambda: None


def _first(items):
    return items[0]


class _PlannedSteps(Dataset):
    """Map-style dataset of planned steps for one rank: item k is global step k."""

    def __init__(self, planner: Planner, collator: PlanCollator, rank: int, valid_counts: np.ndarray):
        self.planner, self.collator, self.rank, self.valid_counts = planner, collator, rank, valid_counts

    def __len__(self) -> int:
        return len(self.planner.sampler)

    def __getitem__(self, index: int) -> Dict[str, RankStep]:
        ps = self.planner.get(int(index))
        gv = int(self.valid_counts[list(ps.batch.sample_ids)].sum())
        return {"cp_step": self.collator.rank_step(ps.plan, self.rank, gv, ps.batch.epoch, ps)}


class CPTrainer(Trainer):
    """Trainer for long-tailed data with per-step load-balanced context parallelism.

    `train_dataset` needs `input_ids` (one tokenised sample per row); optional `labels`
    (HF convention, -100 = no loss, e.g. prompt tokens), `length` and `attn_mask` (a sample's
    mask, e.g. shared-prompt groups from `hf-cp preprocess --group-answers`). Row index = sample
    id, except for pre-packed rows (TRL's `seq_lengths`, `cu_seqlens`, restarting
    `position_ids`), which are unpacked into their documents (columns.py).
    Samples a plan distributes over a CP group need the model loaded with
    `attn_implementation="hf_cp"`. `balancer` (an object with `.plan(PlanRequest)`) replaces
    the registry lookup of `args.cp_balancer`, for balancers built in code.
    """

    def __init__(
        self, model=None, args: Optional[CPTrainingArguments] = None, train_dataset=None, balancer=None, **kwargs
    ):
        if not isinstance(args, CPTrainingArguments):
            raise TypeError(f"CPTrainer needs CPTrainingArguments, got {type(args).__name__}")
        # before accelerate or DeepSpeed act on them (DeepSpeed's SP ends in a bare assertion)
        check_parallelism(getattr(args, "parallelism_config", None))
        if args.deepspeed:
            skip_deepspeed_shm_build()
            arch = deepspeed_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST"))
            if arch is not None:
                if int(args.process_index) == 0:
                    logger.warning(
                        "hf_cp: TORCH_CUDA_ARCH_LIST=%s set to %s for DeepSpeed, whose op builder cannot parse "
                        "arch suffixes",
                        os.environ["TORCH_CUDA_ARCH_LIST"],
                        arch,
                    )
                os.environ["TORCH_CUDA_ARCH_LIST"] = arch
        super().__init__(model=model, args=args, train_dataset=train_dataset, **kwargs)
        # A trainer this class is mixed into may prepare the data first (TRL's SFTTrainer tokenises
        # prompt/completion or messages into input_ids and labels): read what it left, not the argument.
        train_dataset = self.train_dataset
        if train_dataset is None:
            raise ValueError("CPTrainer: training needs a train_dataset")
        columns = getattr(train_dataset, "column_names", None) or []
        collator_note = check_data_collator(kwargs.get("data_collator"), has_labels="labels" in columns)
        if collator_note and int(args.process_index) == 0:
            logger.warning("hf_cp: %s", collator_note)
        self.model.config.use_cache = False  # with a cache, packed documents attend across boundaries
        if args.cp_gc_interval_steps > 0:
            self.add_callback(ScheduledGarbageCollection(args.cp_gc_interval_steps))
        # first, so that every other callback, log and checkpoint sees the epochs of data trained
        self.callback_handler.callbacks.insert(
            0, DataEpochCallback(lambda: self.cp_history[-1].data_epoch if self.cp_history else None)
        )
        self._cp_history_start = 0  # index in cp_history of the first step of the current train() call
        self.cp_world = int(args.world_size)
        self.cp_rank = int(args.process_index)
        self.cp_data = read_token_columns(train_dataset, "train_dataset")
        settings = args.planning_settings()
        # the memory model's model states: in the dtype the model was built in (without DeepSpeed
        # they stay in it; DeepSpeed's own dtypes follow its config)
        param = next((p for p in self.model.parameters() if p.requires_grad), None)
        if settings.model_states is not None and param is not None:
            settings.model_states["param_bytes"] = param.element_size()
        setup = planning_setup(
            settings,
            self.cp_data.lengths,
            self.cp_world,
            model_config=self.model.config.to_dict(),
            num_epochs=args.num_train_epochs,
            max_steps=args.max_steps,
        )
        self.cp_setup = setup
        self.cp_cost, self.cp_cluster, self.cp_sampler = setup.cost, setup.cluster, setup.sampler
        # now, not at the first step that spreads a sample (after the model is placed and minutes in)
        check_attention(getattr(self.model.config, "_attn_implementation", None), self.cp_cluster.group_sizes[-1])
        if self.cp_rank == 0:
            settings = setup.settings
            warning = profile_warning(
                setup.cost.profile,
                settings.profile if isinstance(settings.profile, str) else setup.cost.profile.name,
                setup.cost.dims,
                args.device.type,
                settings.model_dims or getattr(self.model.config, "_name_or_path", "") or "",
            )
            if warning:
                logger.warning("hf_cp: %s", warning)
            if args.device.type == "cpu":
                shared = shared_cores_warning(
                    int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.get_num_threads(), available_cores()
                )
                if shared:
                    logger.warning("hf_cp: %s", shared)
        # online calibration (hf_cp/planning/calibration.py): version -> (coefficients, cost model)
        self.cp_calibrator: Optional[Calibrator] = None
        if args.cp_calibrate and not args.full_determinism:
            self.cp_calibrator = Calibrator(
                setup.cost.profile,
                CalibrationSettings(
                    args.cp_calibrate_min_steps, args.cp_calibrate_every, max(16, args.cp_calibrate_min_steps)
                ),
            )
        self._cp_models: Dict[int, tuple] = {0: (Coefficients.of(setup.cost.profile), setup.cost)}
        self._cp_pending_fit = None  # a fit made after the last step, offered at the next agreement
        # The loader already spans every epoch: one Trainer "epoch" of exactly this many steps.
        self.args.max_steps = len(self.cp_sampler)
        self.cp_balancer = balancer
        self.cp_planner: Optional[Planner] = None
        self.cp_groups: Optional[CPGroups] = None
        self.cp_history: List[StepRecord] = []  # one record per step, identical on every rank
        self._cp_pending: List[StepRecord] = []  # records not yet logged
        self.cp_executor: Optional[StepExecutor] = None
        self._cp_eval_data: Dict[int, tuple] = {}  # id(eval dataset) -> (dataset, TokenColumns, plans)
        self._cp_resumed_from: Optional[int] = None  # set by train() when it resumes a checkpoint
        self._cp_last_step: Optional[RankStep] = None  # the step the next grad-norm check is about
        # enable_jit_checkpoint: stop on SIGTERM after a step every rank agrees on (see stop_signal)
        self.cp_stop_signal: Optional[StopSignal] = None
        self.cp_stopped_early: Optional[dict] = None  # {"step", "signal", "ranks"} once stopped
        if args.enable_jit_checkpoint:
            self._cp_replace_jit_checkpoint()

    # ------------------------------------------------------------------ data
    def _cp_setup(self) -> None:
        """Build the group registry and the planner: once, at the same point on every rank."""
        if self.cp_groups is None:
            if self.cp_world > 1 and dist.is_initialized() and dist.get_world_size() != self.cp_world:
                raise RuntimeError(
                    f"args.world_size {self.cp_world} != torch.distributed world {dist.get_world_size()}"
                )
            self.cp_groups = CPGroups(self.cp_cluster, timeout=timedelta(seconds=self.args.ddp_timeout))
            assert_data_agrees(self.cp_data.digest(), "training data", group=self.cp_groups.control)
        if self.cp_planner is None:
            a = self.args
            self.cp_planner = Planner.from_setup(
                self.cp_setup,
                balancer=self.cp_balancer,
                lookahead=a.cp_plan_lookahead,
                in_process=a.cp_plan_in_process,
                workers=a.cp_plan_workers,
                masks=self.cp_data.masks,
            )
        if self.cp_executor is None:
            self.cp_executor = StepExecutor(
                self.model,
                self.cp_groups,
                self.cp_world,
                self.cp_rank,
                self.args.device,
                self.args.cp_loss_chunk_tokens,
                self._cp_backward,
                self._cp_wave_context,
            )

    def get_train_dataloader(self) -> DataLoader:
        self._cp_setup()
        # Trainer.train asks for the dataloader before DeepSpeed / accelerate set up the model and
        # optimizer: the planner's worker starts and warms up meanwhile (Planner.start)
        self.cp_planner.start()
        self._cp_collator = PlanCollator(self.cp_data.fetch, self.cp_data.masks)
        steps = _PlannedSteps(
            self.cp_planner,
            self._cp_collator,
            self.cp_rank,
            self.cp_data.valid_counts,
        )
        # Not accelerator.prepare()d: every rank iterates every step; the plan splits the work.
        return DataLoader(steps, batch_size=1, sampler=SequentialSampler(steps), collate_fn=_first, num_workers=0)

    # ------------------------------------------------------------------ one step
    def _cp_backward(self, loss: torch.Tensor, last: bool) -> None:
        """Backward of one wave's loss; `last` is the gradient-accumulation boundary."""
        if self.is_deepspeed_enabled:
            self.accelerator.deepspeed_engine_wrapped.backward(loss, sync_gradients=last, scale_wrt_gas=False)
        else:  # under DDP, _cp_wave_context has switched the reduction off for all but the last wave
            self.accelerator.backward(loss)

    def _cp_wave_context(self, last: bool):
        """Around a whole wave: DDP's no_sync for all but the last one. It must cover the forward,
        where DDP prepares the reduction; around the backward alone every wave would reduce."""
        model = self.model_wrapped
        if not self.is_deepspeed_enabled and isinstance(model, torch.nn.parallel.DistributedDataParallel) and not last:
            return model.no_sync()
        return contextlib.nullcontext()

    def _cp_replace_jit_checkpoint(self) -> None:
        """transformers' JIT checkpoint decides per rank, at different steps: a hang under
        distributed saving. Its callback goes; the agreed stop of training_step replaces it."""
        import signal

        for cb in list(self.callback_handler.callbacks):
            if type(cb).__name__ == "JITCheckpointCallback":
                manager = getattr(cb, "jit_manager", None)
                if manager is not None and manager._original_sigterm_handler is not None:
                    signal.signal(signal.SIGTERM, manager._original_sigterm_handler)
                self.callback_handler.remove_callback(cb)
        self.cp_stop_signal = StopSignal(signal.SIGTERM)

    def _cp_agree(self, step: RankStep) -> RankStep:
        """Plan agreement (before any collective of the step) and, in the same exchange, the
        stop decision: a SIGTERM seen by any rank stops every rank after this step. A balancer
        whose plans may depend on timing (balancer.timing_dependent: a solver's time limit or
        deadline) makes ranks that disagree run the first rank's plan instead of failing."""
        sig = self.cp_stop_signal
        adopt = bool(getattr(self.cp_planner.balancer, "timing_dependent", False))
        plan_json = step.plan.to_json() if adopt else ""
        # the online calibration's new coefficients ride on the same exchange (rank 0's are adopted)
        fit, self._cp_pending_fit = self._cp_pending_fit, None
        offer = fit.coefficients.to_payload(fit.version) if fit is not None else [0.0] * Coefficients.PAYLOAD_SIZE
        theirs, flagged, adopted = agree_on_plan_and_payload(
            plan_json,
            step.plan.digest(),
            step.index + 1,
            group=self.cp_groups.control,
            flag=bool(sig and sig.requested),
            adopt_first=adopt,
            payload=offer,
        )
        version, coefficients = Coefficients.from_payload(adopted)
        if coefficients is not None:
            self._cp_adopt(version, coefficients, step.index)
        if theirs is not None:  # this rank planned otherwise (a solver's time limit): run rank 0's plan
            plan = StepPlan.from_json(theirs, f"step {step.index + 1}: rank 0's plan")
            plan.validate(self.cp_cluster, self.cp_cost)
            logger.warning(
                "hf_cp: step %d: rank %d planned this step otherwise (%s depends on timing); running rank 0's plan",
                step.index + 1,
                self.cp_rank,
                step.plan.balancer,
            )
            step = self._cp_collator.rank_step(plan, self.cp_rank, step.global_valid_tokens, step.epoch, step.planned)
        if flagged and self.cp_stopped_early is None:
            self.cp_stopped_early = {"step": step.index + 1, "signal": sig.name, "ranks": flagged}
            self.control.should_save = True
            self.control.should_training_stop = True
            if self.cp_rank == 0:
                logger.warning(
                    "hf_cp: %s on rank(s) %s: stopping after step %d with checkpoint-%d; resume with "
                    "resume_from_checkpoint: latest",
                    sig.name,
                    flagged,
                    step.index + 1,
                    step.index + 1,
                )
        return step

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        step: RankStep = inputs["cp_step"]
        t_step = time.perf_counter()
        t_epoch = time.time()
        # before any collective of this step
        # errors count steps as the Trainer does (global_step, checkpoint-N): from 1
        step = self._cp_agree(step)
        self._cp_check_attention(step)
        model.train()
        cuda = self.args.device if self.args.device.type == "cuda" else None
        if cuda is not None:
            torch.cuda.reset_peak_memory_stats(cuda)
        totals = self.cp_executor.train(model, step)
        wall_ms = (time.perf_counter() - t_step) * 1e3
        peak_bytes = float(torch.cuda.max_memory_allocated(cuda)) if cuda is not None else -1.0
        self._cp_record(step, totals, wall_ms, [t_epoch, t_epoch + wall_ms / 1e3], peak_bytes)
        self._cp_last_step = step
        return totals.loss

    def _cp_check_attention(self, step: RankStep, what: str = "step") -> None:
        chunked = step.plan.chunked_samples
        if step.plan.spreads_samples or step.has_masks or chunked:
            impl = getattr(self.model.config, "_attn_implementation", None)
            if impl != HF_CP_ATTENTION:
                why = (
                    f"the {step.plan.balancer!r} plan distributes samples over CP groups"
                    if step.plan.spreads_samples
                    else f"the {step.plan.balancer!r} plan runs samples {chunked[:10]} as dependent chunks (ChunkFlow)"
                    if chunked
                    else "samples carry attention masks (e.g. shared-prompt) that only it reads"
                )
                raise ValueError(
                    f"{what} {step.index + 1}: {why}, which needs attn_implementation='{HF_CP_ATTENTION}' (the "
                    f"model uses {impl!r}); load it with attn_implementation='{HF_CP_ATTENTION}'"
                )

    def _cp_record(
        self, step: RankStep, totals: WaveTotals, wall_ms: float, span: List[float], peak_bytes: float = -1.0
    ) -> None:
        """One StepRecord per step, identical on every rank (one all-gather of the measurements).
        `peak_bytes`: the device's peak allocated memory in the step (-1: not measured, off CUDA)."""
        wave_ms = [(c - a) * 1e3 for a, c, _ in totals.wave_timeline]  # every rank has every wave
        mine = torch.tensor(
            [totals.compute_ms, float(totals.tokens), totals.loss_sum, wall_ms, peak_bytes, *wave_ms],
            dtype=torch.float64,
        )
        if self.cp_world > 1:
            got = [torch.zeros_like(mine) for _ in range(self.cp_world)]
            dist.all_gather(got, mine, group=self.cp_groups.control)
        else:
            got = [mine]
        rows = torch.stack(got).tolist()
        ps = step.planned
        gv = step.global_valid_tokens
        rec = StepRecord(
            index=step.index,
            epoch=step.epoch,
            step_in_epoch=ps.batch.step_in_epoch if ps is not None else None,
            # epochs of data trained: also the Trainer's `epoch` (trainer_numbers.DataEpochCallback)
            data_epoch=(
                data_epoch(
                    step.epoch,
                    sum(map(len, self.cp_sampler.epoch_batches(step.epoch)[: ps.batch.step_in_epoch + 1])),
                    len(self.cp_sampler.lengths),
                )
                if ps is not None
                else float(step.epoch)
            ),
            global_step=self.state.global_step + 1,
            num_samples=len(step.plan.sample_ids),
            global_tokens=step.plan.total_tokens,
            global_valid_tokens=gv,
            loss=sum(r[2] for r in rows) / gv if gv else 0.0,
            measured_ms=[r[0] for r in rows],
            rank_tokens=[int(r[1]) for r in rows],
            step_wall_ms=max(r[3] for r in rows),
            # what the rank's measured time is: its micro-batches' durations (a group's members
            # wait for its slowest at every layer), not its own work alone
            predicted_ms=list(ps.predicted.occupied_ms) if ps is not None else [0.0] * self.cp_world,
            predicted_step_ms=ps.predicted.makespan_ms if ps is not None else 0.0,
            compare_step_ms=ps.compare.makespan_ms if ps is not None and ps.compare is not None else None,
            compare_balancer=self.cp_planner.compare_name if ps is not None and ps.compare is not None else None,
            planner_ms=ps.planner_ms if ps is not None else 0.0,
            cp_size_samples={str(k): v for k, v in (ps.predicted.cp_size_samples if ps is not None else {}).items()},
            waves=len(step.waves),
            plan_digest=step.plan.digest(),
            balancer=step.plan.balancer,
            plan_notes=list(getattr(step.plan, "notes", None) or []),
            chunked=step.plan.chunking_summary(),
            attempt=restart_attempt(),  # torchrun restarts so far: which run trained this step
            resumed_from=self._cp_resumed_from,  # the checkpoint step this process started from
            dataset_samples=len(self.cp_data),  # for the exactly-once audit of hf-cp report
            wave_max_ms=[max(r[5 + w] for r in rows) for w in range(len(wave_ms))],
            calibration=ps.cost_version if ps is not None else 0,
            peak_memory_gb=[r[4] / 1e9 for r in rows] if all(r[4] >= 0 for r in rows) else [],
            predicted_peak_memory_gb=[b / 1e9 for b in ps.predicted.peak_memory_bytes] if ps is not None else [],
        )
        self._cp_calibrate(rec, ps)
        self.cp_history.append(rec)
        self._cp_pending.append(rec)
        if self.args.cp_record_history:
            line = rec.for_rank(self.cp_rank, step.trained_sample_ids, span, totals.wave_timeline)
            append_record(self.args.output_dir, line)

    # ------------------------------------------------------------------ online calibration
    def _cp_calibrate(self, rec: StepRecord, ps) -> None:
        """Observe a step; when a refit is due, fit and offer the result at the next agreement."""
        cal = self.cp_calibrator
        if cal is None or ps is None:
            return
        coefficients, cost = self._cp_models[ps.cost_version]
        cal.add(
            observe_step(
                rec.index,
                ps.predicted,
                cost,
                coefficients.comm_scale,
                rec.measured_ms,
                rec.step_wall_ms,
                rec.wave_max_ms,
            )
        )
        if cal.due():
            self._cp_pending_fit = cal.refit(prior=self._cp_models[max(self._cp_models)][0])

    def _cp_adopt(self, version: int, coefficients: Coefficients, index: int) -> None:
        """Rank 0's fit, the same on every rank: plan the steps not yet planned with it."""
        cal = self.cp_calibrator
        base = self.cp_cost
        cost = CostModel(base.dims, cal.profile(coefficients), base.execution)
        first = index + self.args.cp_plan_lookahead + 1
        if first >= len(self.cp_sampler):
            return  # no step left to plan with it
        self._cp_models[version] = (coefficients, cost)
        self.cp_planner.set_cost(first, version, cost)
        fit = cal.fits[version - 1]
        fit.applies_from = first
        if self.cp_rank == 0:
            logger.warning(
                "hf_cp: %s; steps from %d on are planned with it", fit.describe(cal.base_coefficients), first + 1
            )

    def cp_calibrated_profile(self) -> Optional[str]:
        """The latest calibrated profile as YAML (None before the first calibration)."""
        cal = self.cp_calibrator
        latest = max(self._cp_models)
        if cal is None or latest == 0:
            return None
        coefficients, _ = self._cp_models[latest]
        base = self.args.cp_profile if isinstance(self.args.cp_profile, str) else cal.base.name
        return calibrated_profile_yaml(cal.profile(coefficients), cal.fits[latest - 1], base, self.args.output_dir)

    def _cp_write_calibrated_profile(self, folder: Path, name: str) -> Optional[Path]:
        text = self.cp_calibrated_profile()
        if text is None:
            return None
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        path.write_text(text)
        return path

    # ------------------------------------------------------------------ evaluation
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
        name = f"eval dataset {metric_key_prefix!r}"
        cached = self._cp_eval_data.get(id(ds))
        if cached is None or cached[0] is not ds:
            data = read_token_columns(ds, name)
            if int(data.valid_counts.sum()) == 0:
                raise ValueError(f"CPTrainer.evaluate: {name} has no target tokens (every label is {IGNORE_INDEX})")
            plans = plan_evaluation(
                data.lengths,
                data.valid_counts,
                self.args.tokens_per_step(self.cp_world),
                self.cp_balancer or self.cp_setup.balancer(),
                self.cp_cluster,
                self.cp_cost,
                self.args.seed,
                name,
                masks=data.masks,
            )
            # kept with the dataset itself, so that its id cannot be reused by another one
            cached = self._cp_eval_data[id(ds)] = (ds, data, plans)
        _, data, plans = cached
        t0 = time.perf_counter()
        device = self.args.device
        model = self.model
        if next(model.parameters()).device != device:
            # evaluate() before train() under DeepSpeed: the engine has not placed the model yet
            model.to(device)
        was_training = model.training
        model.eval()
        loss_sum, valid, tokens = 0.0, 0, 0
        try:
            with torch.no_grad():
                for step in evaluation_rank_steps(plans, data, self.cp_rank):
                    # as in training: a rank with another plan would wait in the wrong group
                    assert_plans_agree(
                        step.plan.digest(), step.index + 1, group=self.cp_groups.control, phase="evaluation batch"
                    )
                    self._cp_check_attention(step, "evaluation batch")
                    got = self.cp_executor.evaluate(model, step)
                    loss_sum, valid, tokens = loss_sum + got.loss_sum, valid + got.valid, tokens + got.tokens
        finally:
            model.train(was_training)
        totals = torch.tensor([loss_sum, float(valid), float(tokens)], dtype=torch.float64)
        if self.cp_world > 1:
            dist.all_reduce(totals, group=self.cp_groups.control)
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
        shown = ", ".join(map(str, ids[:20])) + (f", ... ({len(ids)} in all)" if len(ids) > 20 else "")
        what = (
            f"step {self.state.global_step}: the gradient norm is {norm} (non-finite gradients on some rank). "
            + (
                "DeepSpeed skipped the update, so the step's samples were not learned"
                if self.is_deepspeed_enabled
                else "the parameters may no longer be finite"
            )
            + f"; its samples: [{shown}]"
        )
        if self.args.cp_stop_on_nonfinite_grad:
            raise NonFiniteGradientError(
                f"{what}. Stopped before this step's checkpoint: the newest checkpoint holds the last good state. "
                f"Common causes: a learning rate too high, fp16 overflow, a corrupt sample. "
                f"cp_stop_on_nonfinite_grad: false skips such steps with a warning instead"
            )
        if self.cp_rank == 0:
            logger.warning("hf_cp: %s; continuing (cp_stop_on_nonfinite_grad is false)", what)

    # ------------------------------------------------------------------ logging
    def log(self, logs: Dict[str, float], start_time: Optional[float] = None) -> None:
        if self._cp_pending and "loss" in logs:
            logs.update(aggregate(self._cp_pending))
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
        name = getattr(self.cp_balancer, "name", None) or self.args.cp_balancer
        return summary_lines(self.cp_history, name, self.args.cp_compare_balancer if compare else "")

    def cp_schedule(self) -> dict:
        """What decides the samples of every step: saved with each checkpoint, checked on resume."""
        sm = self.cp_sampler
        return schedule_record(
            sm.lengths, sm.tokens_per_step, sm.seed, sm.shuffle, self.cp_world, self.cp_data.digest()
        )

    def _save_checkpoint(self, model, trial) -> None:
        if self.args.should_save:  # first, so a checkpoint folder never lacks it
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            write_schedule(str(folder), self.cp_schedule())
            # the calibrated cost model (hf-cp plan --profile FILE reads it)
            self._cp_write_calibrated_profile(folder, CALIBRATED_PROFILE)
        super()._save_checkpoint(model, trial)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`resume_from_checkpoint`: a checkpoint folder, True (the newest one, which must exist)
        or "latest" (the newest one, else a fresh start: what a restarted job passes)."""
        if self.cp_rank == 0:
            for problem in restart_problems(self.args.save_strategy, resume_from_checkpoint):
                logger.warning("hf_cp: %s", problem)
        resume = resolve_resume(resume_from_checkpoint, self.args.output_dir)
        if resume is not None:  # on every rank, before any collective: all raise or none
            ds = getattr(self.args, "hf_deepspeed_config", None) if self.is_deepspeed_enabled else None
            for note in check_resume(
                resume,
                self.cp_schedule(),
                self.cp_world,
                ds.config if ds is not None else None,
                self.args.cp_allow_schedule_change,
            ):
                if self.cp_rank == 0:
                    logger.warning("hf_cp: %s", note)
        if self.args.cp_record_history:
            hist = history_path(self.args.output_dir, self.cp_rank)
            if resume is None:
                hist.unlink(missing_ok=True)  # a fresh run starts a fresh history
            else:
                # a resumed one continues it from the checkpoint: steps after it run again
                truncate_history(hist, checkpoint_step(resume))
        self._cp_resumed_from = checkpoint_step(resume) if resume is not None else None
        self._cp_history_start = len(self.cp_history)
        if self.cp_stop_signal is not None and not self.cp_stop_signal.install():
            logger.warning(
                "hf_cp: enable_jit_checkpoint needs train() on the main thread (signal handlers "
                "live there); SIGTERM keeps its default action"
            )
        try:
            out = super().train(resume, *args, **kwargs)
            if self.args.should_save:
                path = self._cp_write_calibrated_profile(Path(self.args.output_dir), CALIBRATED_PROFILE)
                if path is not None:
                    logger.warning("hf_cp: calibrated cost profile written to %s (hf-cp plan --profile %s)", path, path)
            return out
        finally:
            if self.cp_stop_signal is not None:
                self.cp_stop_signal.uninstall()
            if self.cp_planner is not None:
                self.cp_planner.close()
                self.cp_planner = None
