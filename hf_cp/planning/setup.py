"""From planning settings, the model's dimensions and the sample lengths to everything planning
needs: the cost model, the cluster, the global batch sampler and the balancers.

One function with one set of defaults (`PlanningSettings`), shared by CPTrainer, the dry run
(`hf-cp train --dry-run`) and `hf-cp plan`, so that the three plan exactly the same steps for
the same settings. `CPTrainingArguments`' `cp_*` fields and `hf-cp plan`'s options take their
defaults from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Union

from hf_cp.balance.registry import get_balancer
from hf_cp.cost.execution import execution_for_run, execution_named, model_state_bytes_per_parameter, zero_stage_of
from hf_cp.cost.model import CostModel, HardwareProfile, ModelDims
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.planning.sampler import GlobalBatchSampler


@dataclass
class PlanningSettings:
    """What decides the plans of a run, apart from the data and the world size."""

    balancer: str = "auto"
    """Balancer name (hf_cp.balance registry)."""
    balancer_options: Dict[str, Any] = field(default_factory=dict)
    """Keyword options of the balancer (its own dataclass checks them; unknown keys are errors)."""
    compare_balancer: Optional[str] = "static"
    """Also plan every step with this balancer (never run) to report what it would cost; None: off."""
    profile: Union[str, Mapping] = "h200-qwen2.5-7b"
    """Hardware profile: a built-in name, a YAML path, or a dict of its fields."""
    model_dims: Optional[str] = None
    """Model dimensions for the cost model: a name, config.json or folder (None: the model's own config)."""
    max_tokens_per_rank: int = 32768
    """Memory cap per rank per micro-batch, in tokens."""
    tokens_per_step: Optional[int] = None
    """Tokens of one global batch, all ranks together (None: tokens_per_rank_per_step x world)."""
    tokens_per_rank_per_step: int = 65536
    """Used when tokens_per_step is unset."""
    max_group_size: Optional[int] = None
    """Largest CP group a plan may use (None: the world)."""
    gpus_per_node: Optional[int] = None
    """Ranks per node (None: the profile's)."""
    chunk_size: Optional[int] = None
    """ChunkFlow: most tokens of a dependent chunk (None: the cap divided by chunk_keep)."""
    chunk_keep: int = 1
    """ChunkFlow: K, dependent chunks whose activations are kept (the first N-K are recomputed)."""
    seed: int = 0
    """Seed of the epoch order and of seeded balancers."""
    shuffle: bool = True
    """Shuffle the epoch order."""
    execution: Optional[str] = None
    """How the run's waves synchronise (hf_cp/execution.py: zero2, zero2-overlap, ddp): plans are then
    priced by their wall time. None or "compute": the plan's compute alone."""
    model_states: Optional[Dict[str, Any]] = None
    """How the run keeps its model states, for the memory model's static bytes: {"deepspeed": bool,
    "zero_stage": int, "half_precision": bool, and optionally "param_bytes": the element size of
    the model's parameters} (execution.model_state_bytes_per_parameter). None:
    the profile's static_bytes as written (its nominal setting)."""
    loss_chunk_tokens: Optional[int] = None
    """Tokens per chunk of the chunked LM-head loss (0: full logits); with model_states, its working
    set, fp32 logits and their gradient over the vocabulary, joins the static bytes."""

    def __post_init__(self):
        if self.max_tokens_per_rank <= 0:
            raise ValueError(f"max_tokens_per_rank must be positive, got {self.max_tokens_per_rank}")
        if self.tokens_per_step is not None and self.tokens_per_step <= 0:
            raise ValueError(f"tokens_per_step must be positive, got {self.tokens_per_step}")
        if self.tokens_per_rank_per_step <= 0:
            raise ValueError(f"tokens_per_rank_per_step must be positive, got {self.tokens_per_rank_per_step}")
        if self.chunk_size is not None and self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")
        if self.chunk_keep <= 0:
            raise ValueError(f"chunk_keep must be positive, got {self.chunk_keep}")
        if not isinstance(self.balancer_options, Mapping):
            raise ValueError(
                f"balancer_options must be a mapping of option names to values, got {self.balancer_options!r}"
            )
        self.balancer_options = dict(self.balancer_options)
        execution_named(self.execution)  # an unknown name fails here, naming the known ones

    def balancer_kwargs(self) -> Dict[str, Any]:
        """The balancer's options, with the ChunkFlow settings passed to chunkflow (directly, or
        as auto's member options) unless the options already set them."""
        opts = dict(self.balancer_options)
        chunk = {"keep": self.chunk_keep, **({"chunk_size": self.chunk_size} if self.chunk_size else {})}
        if self.balancer == "chunkflow":
            return {**chunk, **opts}
        if self.balancer == "auto":
            members = opts.get("members")
            if members is None or "chunkflow" in members:
                member_options = {k: dict(v) for k, v in dict(opts.get("member_options") or {}).items()}
                member_options["chunkflow"] = {**chunk, **member_options.get("chunkflow", {})}
                opts["member_options"] = member_options
        return opts

    def step_tokens(self, world_size: int) -> int:
        return self.tokens_per_step or self.tokens_per_rank_per_step * world_size

    @classmethod
    def default(cls, name: str):
        """The default of one setting (for the trainer's arguments and the CLI's options)."""
        for f in fields(cls):
            if f.name == name:
                return f.default_factory() if callable(f.default_factory) else f.default
        raise KeyError(name)

    @classmethod
    def from_training_args(cls, args) -> PlanningSettings:
        """The settings of CPTrainingArguments (its cp_* fields)."""
        ds = _deepspeed_config(args)  # read once: it may be a JSON file
        return cls(
            balancer=args.cp_balancer,
            balancer_options=dict(args.cp_balancer_options or {}),
            compare_balancer=args.cp_compare_balancer or None,
            profile=args.cp_profile,
            model_dims=args.cp_model_dims,
            max_tokens_per_rank=args.cp_max_tokens_per_rank,
            tokens_per_step=args.cp_tokens_per_step,
            tokens_per_rank_per_step=args.cp_tokens_per_rank_per_step,
            max_group_size=args.cp_max_group_size,
            gpus_per_node=args.cp_gpus_per_node,
            chunk_size=args.cp_chunk_size,
            chunk_keep=args.cp_chunk_keep,
            seed=args.seed,
            shuffle=args.cp_shuffle,
            execution=execution_for_run(ds),
            model_states={
                "deepspeed": ds is not None,
                "zero_stage": zero_stage_of(ds),
                "half_precision": bool(getattr(args, "bf16", False) or getattr(args, "fp16", False)),
            },
            loss_chunk_tokens=getattr(args, "cp_loss_chunk_tokens", None),
        )


def _deepspeed_config(args) -> Optional[dict]:
    """The run's DeepSpeed config as a dict (None without DeepSpeed), from TrainingArguments."""
    ds = getattr(args, "hf_deepspeed_config", None)
    if ds is not None and isinstance(getattr(ds, "config", None), dict):
        return ds.config
    raw = getattr(args, "deepspeed", None)
    if not raw:
        return None
    if isinstance(raw, Mapping):
        return dict(raw)
    import json

    try:
        with open(raw) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}  # TrainingArguments reports an unreadable DeepSpeed config itself


@dataclass
class PlanningSetup:
    settings: PlanningSettings
    cost: CostModel
    cluster: ClusterSpec
    sampler: GlobalBatchSampler

    def balancer(self):
        """The configured balancer, built with its options."""
        return get_balancer(self.settings.balancer, **self.settings.balancer_kwargs())


def load_profile(profile: Union[str, Mapping]) -> HardwareProfile:
    if isinstance(profile, Mapping):
        return HardwareProfile.from_dict(profile, source="profile")
    return HardwareProfile.load(profile)


def planning_setup(
    settings: PlanningSettings,
    lengths: Sequence[int],
    world_size: int,
    model_config: Optional[Mapping] = None,
    num_epochs: float = 1.0,
    max_steps: Optional[int] = None,
    sampler: Optional[Callable[[int, int, Optional[int]], Any]] = None,
) -> PlanningSetup:
    """The cost model, cluster and sampler of a run of `world_size` ranks over `lengths`.

    Model dimensions come from `settings.model_dims` when set, else from `model_config` (the
    model's transformers config as a dict); one of the two is required. `sampler`: builds the
    run's sampler from (tokens per step, seed, max_steps) instead of a GlobalBatchSampler over
    `lengths` (a streaming dataset's: stream_sampler.StreamBatchSampler).
    """
    if settings.model_dims:
        dims = ModelDims.load(settings.model_dims)
    elif model_config is not None:
        dims = ModelDims.from_hf_config(model_config, source="model config")
    else:
        raise ValueError("planning needs the model's dimensions: set model_dims (a name, config.json or folder)")
    profile = load_profile(settings.profile)
    if settings.model_states is not None:
        # the run's own model states, not the profile's nominal ones (memory reports only: the
        # token caps and chunk room subtract them out)
        per_param = model_state_bytes_per_parameter(world_size=world_size, **settings.model_states)
        static = dims.parameters * per_param
        if settings.loss_chunk_tokens is not None:
            # a micro-batch's logits at once: a loss chunk, or every token of it (full logits)
            rows = settings.loss_chunk_tokens or settings.max_tokens_per_rank
            static += min(rows, settings.max_tokens_per_rank) * dims.vocab_size * 8
        profile = replace(profile, static_bytes=float(static))
    cluster = ClusterSpec(
        world_size,
        settings.max_tokens_per_rank,
        settings.gpus_per_node or profile.gpus_per_node,
        settings.max_group_size,
    )
    steps = max_steps if max_steps and max_steps > 0 else None
    if sampler is not None:
        batches = sampler(settings.step_tokens(world_size), settings.seed, steps)
    else:
        batches = GlobalBatchSampler(
            lengths,
            settings.step_tokens(world_size),
            seed=settings.seed,
            num_epochs=num_epochs,
            max_steps=steps,
            shuffle=settings.shuffle,
        )
    return PlanningSetup(settings, CostModel(dims, profile, execution_named(settings.execution)), cluster, batches)
