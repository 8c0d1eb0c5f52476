"""The step runtime: what every CP trainer composes, whatever its Trainer base (transformers'
Trainer, TRL's SFT, DPO or GRPO trainer).

It holds the CP process groups, the planner, the step executor and the plan agreement, built
once at the same point on every rank (`start`), and runs a step's passes through the trainer's
engine (`backward`, `wave_context`: DeepSpeed, DDP or FSDP2). Two ways to plan:
- ahead, over the run's sampler (`setup.sampler`): the planner plans the next steps in the
  background while this one trains (SFT, DPO: their batches are known before training);
- now, for a batch the trainer made as it trains (`plan_batch`: GRPO's rollouts), with one
  planner built at start (`setup.sampler` is None).
A trainer adapter keeps only its base's hooks: what a step's inputs are and what its loss is.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from hf_cp.planning.sampler import GlobalBatch
from hf_cp.planning.setup import PlanningSetup
from hf_cp.planning.worker import PlannedStep, Planner
from hf_cp.samples.masks import SampleMask
from hf_cp.train.checks.setup import SetupError, check_step_attention
from hf_cp.train.data.collator import PlanCollator, RankStep
from hf_cp.train.measure.console import quiet_console
from hf_cp.train.runtime.host_parts import host_parts_exchange
from hf_cp.train.setup.sharding import ZERO3, ZERO3_OPEN_GRAPHS, sharding_of
from hf_cp.train.step.agreement import PlanAgreement, assert_data_agrees
from hf_cp.train.step.executor import StepExecutor
from hf_cp.train.step.groups import CPGroups
from hf_cp.train.step.router_balance import router_balance_of


class StepRuntime:
    """The CP machinery of one trainer (`trainer`: a transformers Trainer, read for its
    arguments, accelerator and engine). `setup`: the run's PlanningSetup; `balancer`: an object
    with .plan(PlanRequest) replacing the configured one. The run's parameter sharding ("fsdp2",
    "zero3" or None) is read from the trainer's arguments: under it every pass aligns."""

    def __init__(self, trainer, setup: PlanningSetup, balancer=None):
        self.trainer = trainer
        args = trainer.args
        self.world, self.rank = int(args.world_size), int(args.process_index)
        self.setup, self.cost, self.cluster = setup, setup.cost, setup.cluster
        self.balancer, self.sharding = balancer, sharding_of(args)
        self.groups: Optional[CPGroups] = None
        self.planner: Optional[Planner] = None
        self.executor: Optional[StepExecutor] = None
        self.agreement: Optional[PlanAgreement] = None
        # the MoE router's load-balancing term, over each whole step (refused here when inexact)
        self.router = router_balance_of(trainer.model) if getattr(trainer, "model", None) is not None else None
        if self.router is not None and setup.settings.balancer == "chunkflow":
            raise SetupError(
                f"{self.router.family}: the MoE router's load-balancing term over the step is not computed on "
                "ChunkFlow's dependent chunks; choose another cp_balancer, or set output_router_logits=False"
            )
        if not args.cp_log_all_metrics:
            quiet_console(trainer.callback_handler)  # a handful of cp/ keys per console line

    # ------------------------------------------------------------------ set-up
    def start(
        self,
        model,
        masks: Optional[Mapping[int, SampleMask]] = None,
        data_digest: Optional[str] = None,
        logit_temperature: float = 1.0,
    ) -> None:
        """The process groups, the planner and the executor: once, at the same point on every
        rank. `masks`: the dataset's sample masks (planning ahead); `data_digest`: checked to be
        the same on every rank before any plan; `logit_temperature`: the executor's (GRPO scores
        completions under the distribution it sampled them from)."""
        args = self.trainer.args
        if self.groups is None:
            if self.world > 1 and dist.is_initialized() and dist.get_world_size() != self.world:
                raise RuntimeError(f"args.world_size {self.world} != torch.distributed world {dist.get_world_size()}")
            self.groups = CPGroups(self.cluster, timeout=timedelta(seconds=args.ddp_timeout))
            if data_digest is not None:
                assert_data_agrees(data_digest, "training data", group=self.groups.control)
        if self.planner is None:
            if self.setup.sampler is None:  # batches made as training goes: planned when given
                balancer = self.balancer if self.balancer is not None else self.setup.balancer()
                self.planner = Planner(
                    None,
                    balancer,
                    self.cluster,
                    self.cost,
                    seed=args.seed,
                    lookahead=0,
                    compare_balancer=self.setup.settings.compare_balancer,
                    compare_measured=args.cp_compare_measured,
                    balancer_name=self.setup.settings.balancer if self.balancer is None else None,
                )
            else:
                self.planner = Planner.from_setup(
                    self.setup,
                    balancer=self.balancer,
                    lookahead=args.cp_plan_lookahead,
                    in_subprocess=args.cp_plan_in_subprocess,
                    workers=args.cp_plan_workers,
                    masks=masks,
                    compare_measured=args.cp_compare_measured,
                )
            if self.world > 1 and self.groups.control is not None:
                # hierarchical planning over several hosts: each host plans its own parts, the
                # ranks exchange them when a step is taken (host_parts.py)
                self.planner.plan_own_host(self.rank, host_parts_exchange(self.groups.control))
        if self.executor is None:
            self.executor = StepExecutor(
                model,
                self.groups,
                self.world,
                self.rank,
                args.device,
                args.cp_loss_chunk_tokens,
                self.backward,
                self.wave_context,
                aligned_passes=self.sharding is not None,
                liger_loss=bool(getattr(args, "use_liger_kernel", False)),
                max_open_graphs=ZERO3_OPEN_GRAPHS if self.sharding == ZERO3 else None,
                logit_temperature=logit_temperature,
                router=self.router,
                vision=self.trainer.cp_vision,
            )

    @property
    def balancer_name(self) -> str:
        """The balancer's name as summaries give it: the object's `name`, else cp_balancer."""
        return getattr(self.balancer, "name", None) or self.setup.settings.balancer

    def agreement_for(self, collator: PlanCollator) -> PlanAgreement:
        """The plan agreement that opens each step (built once; `collator` re-collates rank 0's
        plan where a timing-dependent balancer planned otherwise here)."""
        if self.agreement is None or self.agreement.collator is not collator:
            self.agreement = PlanAgreement(self.groups.control, self.cluster, self.cost, self.rank, collator)
        return self.agreement

    def barrier(self) -> None:
        """Every rank here (the control group), once the groups exist."""
        if self.world > 1 and self.groups is not None and self.groups.control is not None:
            dist.barrier(group=self.groups.control)

    def close(self) -> None:
        if self.planner is not None:
            self.planner.close()
            self.planner = None

    # ------------------------------------------------------------------ planning now
    def plan_batch(
        self,
        index: int,
        lengths: Sequence[int],
        masks: Optional[Mapping[int, SampleMask]] = None,
        label: Optional[Callable[[int], str]] = None,
    ) -> PlannedStep:
        """The plan of step `index` (0-based) over samples 0..n-1 of `lengths`, made now (a
        batch the trainer made as it trains). `label` names a sample too long to train."""
        n = len(lengths)
        batch = GlobalBatch(index, 0, index, tuple(range(n)), tuple(int(x) for x in lengths))
        where = f"step {index + 1}: "  # the Trainer's count, from 1
        planned = self.planner.plan_now(index, batch=batch, masks=dict(masks or {}), label=label, where=where)
        planned.plan.step = index  # errors and collective scopes name the Trainer's step
        return planned

    # ------------------------------------------------------------------ the trainer's engine
    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Backward of one wave's loss; `last` is the gradient-accumulation boundary."""
        t = self.trainer
        if t.is_deepspeed_enabled:
            t.accelerator.deepspeed_engine_wrapped.backward(loss, sync_gradients=last, scale_wrt_gas=False)
        else:  # under DDP, wave_context has switched the reduction off for all but the last wave
            t.accelerator.backward(loss)

    def wave_context(self, last: bool):
        """Around a whole wave: DDP's no_sync for all but the last one. It must cover the forward,
        where DDP prepares the reduction; around the backward alone every wave would reduce."""
        t = self.trainer
        model = t.model_wrapped
        if not t.is_deepspeed_enabled and isinstance(model, torch.nn.parallel.DistributedDataParallel) and not last:
            return model.no_sync()
        return contextlib.nullcontext()

    def check_attention(self, model, step: RankStep, what: str = "step") -> None:
        """A step whose plan spreads a sample, or has masks, needs hf_cp's attention."""
        impl = getattr(model.config, "_attn_implementation", None)
        check_step_attention(step.plan, step.has_masks, step.index, impl, what)
