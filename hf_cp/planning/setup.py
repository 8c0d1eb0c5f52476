"""From planning settings, the model's dimensions and the sample lengths to everything planning
needs: the cost model, the cluster, the global batch sampler and the balancers.

One function with one set of defaults (`PlanningSettings`), shared by CPTrainer, the dry run
(`hf-cp train --dry-run`) and `hf-cp plan`, so that the three plan exactly the same steps for
the same settings. `CPTrainingArguments`' `cp_*` fields and `hf-cp plan`'s options take their
defaults from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from hf_cp.balance.registry import available_balancers, get_balancer
from hf_cp.cost.dims import ModelDims, VisionDims
from hf_cp.cost.execution import (
    MEMORY_ENGINES,
    engine_model_states,
    execution_for_run,
    execution_named,
    gathered_bytes_per_element,
    gathered_working_set_bytes,
    model_state_bytes_per_parameter,
    model_states_of_run,
    sharding_of,
)
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.cost.model import CostModel
from hf_cp.plan.cluster import ClusterSpec, is_power_of_two
from hf_cp.planning.sampler import GlobalBatchSampler
from hf_cp.readers import load_json
from hf_cp.samples.vision_grids import SampleGrids


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
    max_tokens_per_rank: Union[int, str] = 32768
    """Memory cap per rank per micro-batch, in tokens; "auto": the most that fit the device's memory
    by the memory model (fitting_tokens_per_rank), resolved by planning_setup."""
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
    """How the run's waves synchronise (hf_cp/cost/execution.py: zero2, zero2-overlap, zero3, fsdp2, ddp):
    plans are then priced by their wall time. None or "compute": the plan's compute alone."""
    model_states: Optional[Dict[str, Any]] = None
    """How the run keeps its model states, for the memory model's static bytes: {"deepspeed": bool,
    "zero_stage": int, "half_precision": bool, and optionally "param_bytes": the element size of
    the model's parameters, "sharding": "fsdp2" / "zero3" / None, the engine that shards the
    parameters} (static_memory). None: the profile's static_bytes as written (its nominal setting)."""
    loss_chunk_tokens: Optional[int] = None
    """Tokens per chunk of the chunked LM-head loss (0: full logits); with model_states, its working
    set, fp32 logits and their gradient over the vocabulary, joins the static bytes."""
    device_memory_gb: Optional[float] = None
    """Memory of one device, for max_tokens_per_rank "auto" (None: the profile's device_memory_gb)."""

    def __post_init__(self):
        if isinstance(self.max_tokens_per_rank, str):
            if self.max_tokens_per_rank.strip().lower() != AUTO_CAP:
                raise ValueError(
                    f"max_tokens_per_rank must be a positive integer or {AUTO_CAP!r}, got {self.max_tokens_per_rank!r}"
                )
            self.max_tokens_per_rank = AUTO_CAP
        elif isinstance(self.max_tokens_per_rank, bool) or self.max_tokens_per_rank <= 0:
            raise ValueError(f"max_tokens_per_rank must be positive, got {self.max_tokens_per_rank}")
        if self.device_memory_gb is not None and not self.device_memory_gb > 0:
            raise ValueError(f"device_memory_gb must be positive, got {self.device_memory_gb}")
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
        if self.balancer == "hierarchical":  # the settings reach the balancer each host plans with
            member = replace(self, balancer=str(opts.get("member", "auto")),
                             balancer_options=dict(opts.get("member_options") or {}))  # fmt: skip
            opts["member_options"] = member.balancer_kwargs()
            return opts
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
        ds = deepspeed_config_of(args)  # read once: it may be a JSON file
        fsdp_version = fsdp_version_of(args)
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
            execution=execution_for_run(ds, fsdp_version),
            model_states=model_states_of_run(
                ds, fsdp_version, bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))
            ),
            loss_chunk_tokens=getattr(args, "cp_loss_chunk_tokens", None),
        )


def fsdp_version_of(args, environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The FSDP version a run asks for (None without FSDP): from TrainingArguments' `fsdp` /
    `fsdp_config` (transformers turns them into fsdp_plugin_args; a bare `fsdp: full_shard` is
    version 2), else from the environment `accelerate launch` sets from an FSDP config
    (ACCELERATE_USE_FSDP, FSDP_VERSION)."""
    plugin = getattr(args, "fsdp_plugin_args", None)
    if getattr(args, "fsdp", None) and isinstance(plugin, Mapping):
        return int(plugin.get("fsdp_version", 1) or 1)
    env = os.environ if environ is None else environ
    if str(env.get("ACCELERATE_USE_FSDP", "false")).lower() in ("1", "true", "yes"):
        return int(env.get("FSDP_VERSION", "1") or 1)
    return None


def deepspeed_config_of(args) -> Optional[dict]:
    """The run's DeepSpeed config as a dict (None without DeepSpeed), from TrainingArguments."""
    ds = getattr(args, "hf_deepspeed_config", None)
    if ds is not None and isinstance(getattr(ds, "config", None), dict):
        return ds.config
    raw = getattr(args, "deepspeed", None)
    if not raw:
        return None
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        with open(raw) as f:
            return load_json(f.read())
    except (OSError, ValueError):
        return {}  # TrainingArguments reports an unreadable DeepSpeed config itself


@dataclass
class PlanningSetup:
    settings: PlanningSettings
    cost: CostModel
    cluster: ClusterSpec
    sampler: Optional[GlobalBatchSampler]  # None: every step's batch is given (GRPO's rollouts)
    cap_note: Optional[str] = None  # what max_tokens_per_rank "auto" chose and why (None: a number was given)
    # sample id -> the patch grids of its images and clips (a vision-language dataset); the
    # planner prices their encoder work (cost/vision.py). Absent: text only
    vision: Dict[int, SampleGrids] = field(default_factory=dict)

    def balancer(self):
        """The configured balancer, built with its options."""
        return get_balancer(self.settings.balancer, **self.settings.balancer_kwargs())


def load_profile(profile: Union[str, Mapping]) -> HardwareProfile:
    if isinstance(profile, Mapping):
        return HardwareProfile.from_dict(profile, source="profile")
    return HardwareProfile.load(profile)


def planning_setup(
    settings: PlanningSettings,
    lengths: Optional[Sequence[int]],
    world_size: int,
    model_config: Optional[Mapping] = None,
    num_epochs: float = 1.0,
    max_steps: Optional[int] = None,
    sampler: Optional[Callable[[int, int, Optional[int]], Any]] = None,
    vision: Optional[VisionDims] = None,
) -> PlanningSetup:
    """The cost model, cluster and sampler of a run of `world_size` ranks over `lengths`.

    Model dimensions come from `settings.model_dims` when set, else from `model_config` (the
    model's transformers config as a dict); one of the two is required. `sampler`: builds the
    run's sampler from (tokens per step, seed, max_steps) instead of a GlobalBatchSampler over
    `lengths` (a streaming dataset's: stream_sampler.StreamBatchSampler). `lengths` None: no
    sampler, every step's batch is given to the planner (a trainer that makes its batches as it
    trains, GRPO from its rollouts). `vision`: the vision tower's dimensions, for samples with
    images or clips (None: a text-only run).
    """
    if settings.model_dims:
        dims = ModelDims.load(settings.model_dims)
    elif model_config is not None:
        dims = ModelDims.from_hf_config(model_config, source="model config")
    else:
        raise ValueError("planning needs the model's dimensions: set model_dims (a name, config.json or folder)")
    profile = load_profile(settings.profile)
    cap_note = None
    if settings.max_tokens_per_rank == AUTO_CAP:  # every use below sees the resolved cap
        cap, cap_note = fitting_tokens_per_rank(settings, dims, profile, world_size)
        settings = replace(settings, max_tokens_per_rank=cap)
    if settings.model_states is not None:
        # the run's own model states, not the profile's nominal ones (memory reports only: the
        # token caps and chunk room subtract them out)
        static = static_memory(
            dims, settings.model_states, world_size, settings.max_tokens_per_rank, settings.loss_chunk_tokens
        )
        profile = replace(profile, static_bytes=static.total_bytes)
    # a balancer that plans groups of any size within a node (dynamic_cp's any_size_groups, FCP-style)
    # needs them in the registry, which holds only aligned power-of-two blocks otherwise
    # (a balancer built in code and passed to the trainer is not looked up: it plans aligned blocks)
    # and a world of one node that is not a power of two (six GPUs) has no aligned blocks to
    # tile it: its CP groups are the runs of any size in that node
    registered = settings.balancer in available_balancers()
    balancer = get_balancer(settings.balancer, **settings.balancer_kwargs()) if registered else None
    gpus_per_node = settings.gpus_per_node or profile.gpus_per_node
    unaligned_node = not is_power_of_two(world_size) and world_size <= gpus_per_node
    cluster = ClusterSpec(
        world_size,
        settings.max_tokens_per_rank,
        gpus_per_node,
        settings.max_group_size,
        any_size_groups=bool(getattr(balancer, "needs_any_size_groups", False)) or unaligned_node,
    )
    steps = max_steps if max_steps and max_steps > 0 else None
    if sampler is not None:
        batches = sampler(settings.step_tokens(world_size), settings.seed, steps)
    elif lengths is None:
        batches = None
    else:
        batches = GlobalBatchSampler(
            lengths,
            settings.step_tokens(world_size),
            seed=settings.seed,
            num_epochs=num_epochs,
            max_steps=steps,
            shuffle=settings.shuffle,
        )
    cost = CostModel(dims, profile, execution_named(settings.execution), vision)
    return PlanningSetup(settings, cost, cluster, batches, cap_note)


# --------------------------------------------------------------------------- the cap that fits
AUTO_CAP = "auto"
AUTO_CAP_HEADROOM = 0.10  # of the device's memory kept free: the allocator's fragmentation, kernels' workspaces
AUTO_CAP_MULTIPLE = 256  # the cap is rounded down to a multiple of this (kernels' tiles)


def fitting_tokens_per_rank(
    settings: PlanningSettings, dims: ModelDims, profile: HardwareProfile, world_size: int
) -> Tuple[int, str]:
    """(cap, what was chosen and why): the largest cap, a multiple of AUTO_CAP_MULTIPLE, whose
    peak by the memory model the planner then uses (CostModel.memory_bytes: alpha x cap plus
    the run's static bytes, static_memory: model states under its engine, gathered parameters,
    the loss's logits) stays within the device's memory less AUTO_CAP_HEADROOM. The device's
    memory: settings.device_memory_gb, else the profile's. ValueError naming what to set when it
    is unknown, or when not even AUTO_CAP_MULTIPLE tokens fit."""
    device_gb = settings.device_memory_gb or profile.device_memory_gb
    if not device_gb:
        raise ValueError(
            f"max_tokens_per_rank {AUTO_CAP!r} needs the device's memory: the profile {profile.name!r} has no "
            "device_memory_gb (set it in the profile, or give max_tokens_per_rank as a number)"
        )
    budget = device_gb * 1e9 * (1 - AUTO_CAP_HEADROOM)

    def peak(cap: int) -> float:
        static = profile.static_bytes
        if settings.model_states is not None:  # the run's own, as planning_setup gives the cost model
            static = static_memory(dims, settings.model_states, world_size, cap, settings.loss_chunk_tokens).total_bytes
        return profile.activation_bytes_per_token * cap + static

    step = AUTO_CAP_MULTIPLE
    if peak(step) > budget:
        raise ValueError(
            f"max_tokens_per_rank {AUTO_CAP!r}: not even {step} tokens per rank fit {device_gb:g} GB less "
            f"{AUTO_CAP_HEADROOM:.0%} headroom (the peak at {step} tokens is {peak(step) / 1e9:.2f} GB by the memory "
            "model): shard the model states (ZeRO-3, FSDP2), use more ranks, or a device with more memory"
        )
    lo, hi = 1, 2
    while peak(hi * step) <= budget and hi < 1 << 20:  # the peak grows with the cap: bracket, then bisect
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid * step) <= budget else (lo, mid)
    cap = lo * step
    note = (
        f"cp_max_tokens_per_rank auto: {cap} tokens per rank, the most (in steps of {step}) whose peak by the "
        f"memory model, {peak(cap) / 1e9:.2f} GB, fits {device_gb:g} GB less {AUTO_CAP_HEADROOM:.0%} headroom"
    )
    return cap, note


# --------------------------------------------------------------------------- memory per engine
@dataclass(frozen=True)
class StaticMemory:
    """What one rank holds besides its micro-batch's activations (the memory model's beta)."""

    model_states_bytes: float  # its parameters, gradients and Adam states (sharded or not)
    gathered_bytes: float  # unsharded parameters and gradients a sharding engine gathers at once
    logits_bytes: float  # the loss's fp32 logits and their gradient (with loss_chunk_tokens)

    @property
    def total_bytes(self) -> float:
        return self.model_states_bytes + self.gathered_bytes + self.logits_bytes


def static_memory(
    dims: ModelDims,
    model_states: Mapping[str, Any],
    world_size: int,
    max_tokens_per_rank: int,
    loss_chunk_tokens: Optional[int] = None,
) -> StaticMemory:
    """The static bytes of a run (PlanningSettings.model_states and loss_chunk_tokens) on one of
    `world_size` ranks: what planning_setup gives the memory model, and what `hf-cp plan` and
    the dry run print per engine (engine_memory).

    model states = parameters x model_state_bytes_per_parameter; gathered =
    gathered_working_set_bytes in the gather dtype (bf16 in a half-precision run); logits =
    rows x vocab x 8 (fp32 logits and their gradient) for a loss chunk of `loss_chunk_tokens`
    rows, or every token of the micro-batch (0: full logits); none when it is None."""
    states = dict(model_states)
    per_param = model_state_bytes_per_parameter(world_size=world_size, **states)
    sharding = sharding_of(bool(states["deepspeed"]), int(states["zero_stage"]), states.get("sharding"))
    gather_bytes = gathered_bytes_per_element(bool(states["half_precision"]), int(states.get("param_bytes", 4)))
    logits = 0.0
    if loss_chunk_tokens is not None:
        # a micro-batch's logits at once: a loss chunk, or every token of it (full logits)
        rows = loss_chunk_tokens or max_tokens_per_rank
        logits = float(min(rows, max_tokens_per_rank) * dims.vocab_size * 8)
    return StaticMemory(
        model_states_bytes=float(dims.parameters * per_param),
        gathered_bytes=gathered_working_set_bytes(dims, sharding, gather_bytes),
        logits_bytes=logits,
    )


def activation_bytes_per_token(profile: HardwareProfile, dims: ModelDims, num_layers: int) -> float:
    """The memory model's alpha for `dims` with `num_layers` decoder layers instead of its own:
    the profile's alpha (measured with full activation checkpointing: every layer's checkpointed
    input, hidden x element bytes per token, plus one layer's recompute working set) with the
    checkpointed inputs of the added (or removed) layers; never below those inputs alone."""
    per_layer = dims.hidden * profile.bytes_per_element
    alpha = profile.activation_bytes_per_token + (num_layers - dims.num_layers) * per_layer
    return max(alpha, float(num_layers * per_layer))


def peak_bytes_with_layers(
    dims: ModelDims,
    num_layers: int,
    profile: HardwareProfile,
    model_states: Mapping[str, Any],
    world_size: int,
    max_tokens_per_rank: int,
    loss_chunk_tokens: Optional[int] = None,
) -> float:
    """One rank's peak at the cap for `dims` with `num_layers` decoder layers: activations
    (activation_bytes_per_token x cap) plus static_memory."""
    static = static_memory(
        dims.with_layers(num_layers), model_states, world_size, max_tokens_per_rank, loss_chunk_tokens
    )
    return activation_bytes_per_token(profile, dims, num_layers) * max_tokens_per_rank + static.total_bytes


@dataclass(frozen=True)
class EngineMemory:
    """Peak memory of one rank at the cap under one engine, and the largest model that fits."""

    engine: str
    static: StaticMemory
    activation_bytes: float  # alpha x the cap
    largest_layers: Optional[int]  # decoder layers of the run's shape that fit (None: device memory unknown)
    largest_parameters: Optional[int]  # that model's parameters (0: not even one layer fits)

    @property
    def peak_bytes(self) -> float:
        return self.activation_bytes + self.static.total_bytes


def engine_memory(
    dims: ModelDims,
    profile: HardwareProfile,
    world_size: int,
    max_tokens_per_rank: int,
    half_precision: bool,
    loss_chunk_tokens: Optional[int] = None,
    param_bytes: int = 4,
    device_memory_gb: Optional[float] = None,
) -> List[EngineMemory]:
    """Per engine of MEMORY_ENGINES (ZeRO-2, ZeRO-3, FSDP2): one rank's peak at the cap (alpha x
    cap + static_memory) for the run's model, and the largest model that fits `device_memory_gb`
    (None: the profile's; 0: unknown) at the cap.

    The larger models keep the run's layer shape (hidden, heads, intermediate, vocabulary) and
    add decoder layers: that is how a model family deepens at one width, and the profile's
    alpha is known per layer of this width only (activation_bytes_per_token). Peak memory is
    linear in the layer count, so the largest count follows from the peaks at one and two."""
    device = profile.device_memory_gb if device_memory_gb is None else device_memory_gb
    budget = device * 1e9 if device else None
    out = []
    for engine in MEMORY_ENGINES:
        states = dict(engine_model_states(engine, half_precision), param_bytes=param_bytes)
        run = (profile, states, world_size, max_tokens_per_rank, loss_chunk_tokens)
        layers = parameters = None
        if budget is not None:
            one = peak_bytes_with_layers(dims, 1, *run)
            slope = peak_bytes_with_layers(dims, 2, *run) - one
            layers = 0 if one > budget else 1 + int((budget - one) // slope)
            while layers > 0 and peak_bytes_with_layers(dims, layers, *run) > budget:  # rounding at the boundary
                layers -= 1
            parameters = dims.with_layers(layers).parameters if layers else 0
        out.append(
            EngineMemory(
                engine,
                static_memory(dims, states, world_size, max_tokens_per_rank, loss_chunk_tokens),
                profile.activation_bytes_per_token * max_tokens_per_rank,
                layers,
                parameters,
            )
        )
    return out


def engine_memory_lines(
    rows: Sequence[EngineMemory],
    world_size: int,
    max_tokens_per_rank: int,
    half_precision: bool,
    device_memory_gb: float,
) -> List[str]:
    """engine_memory as a small table per rank: model states, gathered parameters, activations
    (with the loss's logits), their sum, and the largest model; in GB (1e9 bytes), or in MB
    for a model whose peak stays under a GB (a test model would read 0.00 throughout)."""
    unit, scale = ("GB", 1e9) if max((m.peak_bytes for m in rows), default=0.0) >= 1e9 else ("MB", 1e6)
    fit = f"largest model in {device_memory_gb:g} GB" if device_memory_gb else "largest model"
    lines = [
        f"memory per rank at the cap ({max_tokens_per_rank} tokens/rank), world {world_size}, "
        f"{'bf16/fp16' if half_precision else 'fp32'}; the largest model adds decoder layers of this shape:",
        f"{'engine':<7} {'states ' + unit:>9} {'gathered ' + unit:>11} {'activ. ' + unit:>9} {'peak ' + unit:>8}  {fit}",
    ]
    for m in rows:
        if m.largest_layers is None:
            largest = "-"
        elif m.largest_layers == 0:
            largest = "none (one layer does not fit)"
        else:
            largest = f"{m.largest_parameters / 1e9:.2f}B parameters ({m.largest_layers} layers)"
        lines.append(
            f"{m.engine:<7} {m.static.model_states_bytes / scale:>9.2f} {m.static.gathered_bytes / scale:>11.2f} "
            f"{(m.activation_bytes + m.static.logits_bytes) / scale:>9.2f} {m.peak_bytes / scale:>8.2f}  {largest}"
        )
    if not device_memory_gb:
        lines.append("device memory unknown: set device_memory_gb in the profile (hf-cp plan: --device-memory-gb)")
    return lines
