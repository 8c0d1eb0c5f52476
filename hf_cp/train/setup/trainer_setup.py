"""What CPTrainer sets up when it is built, before any process group is used.

The run's planning setup comes from its arguments' `PlanningSettings`, built here once (the
setup keeps them: `PlanningSetup.settings`, what the trainer reads later) and completed with
the model's parameter dtype; the checks and warnings that belong to a run's start come with it.
Each function returns its warnings as sentences: the trainer logs them on rank 0.
"""

from __future__ import annotations

import importlib
import os
import warnings
from dataclasses import replace
from typing import Dict, List, Mapping, MutableMapping, Optional, Sequence, Union

import torch

from hf_cp.cost.dims import VisionDims, has_vision_tower
from hf_cp.planning.profile_check import available_cores, profile_warning, shared_cores_warning
from hf_cp.planning.setup import AUTO_CAP, PlanningSetup, planning_setup
from hf_cp.samples.plan_inputs import GRID_COLUMNS, grid_columns_vision
from hf_cp.samples.vision_grids import SampleGrids
from hf_cp.train.checks.setup import check_attention, deepspeed_arch_list
from hf_cp.train.data.columns import TokenColumns
from hf_cp.train.data.streaming import StreamColumns
from hf_cp.train.data.user_collator import check_data_collator


def deepspeed_arch_env(environ: Optional[MutableMapping[str, str]] = None) -> Optional[str]:
    """Rewrite TORCH_CUDA_ARCH_LIST as DeepSpeed's op builder can read it (setup_checks.
    deepspeed_arch_list); a warning saying so, None when it needed no change."""
    env = os.environ if environ is None else environ
    arch = deepspeed_arch_list(env.get("TORCH_CUDA_ARCH_LIST"))
    if arch is None:
        return None
    note = (
        f"TORCH_CUDA_ARCH_LIST={env['TORCH_CUDA_ARCH_LIST']} set to {arch} for DeepSpeed, whose op builder cannot "
        f"parse arch suffixes"
    )
    env["TORCH_CUDA_ARCH_LIST"] = arch
    return note


def check_training_data(dataset, data_collator) -> Optional[str]:
    """The dataset training reads (None is an error) and what the user's data collator means for
    it (user_collator.check_data_collator): a warning, or None. A streaming dataset's settings
    were checked before (streaming.check_streaming)."""
    if dataset is None:
        raise ValueError("CPTrainer: training needs a train_dataset")
    columns = getattr(dataset, "column_names", None) or []
    return check_data_collator(data_collator, has_labels="labels" in columns)


def device_memory_gb(device: torch.device, processes: Optional[int] = None) -> float:
    """The memory one rank trains in, for cp_max_tokens_per_rank auto: a GPU's own; on CPU, the
    host's physical memory shared by the node's `processes` (default: LOCAL_WORLD_SIZE)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 1e9
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if processes is None:
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return host / 1e9 / max(1, processes)


def planning_vision_grids(dataset, tower) -> Dict[int, SampleGrids]:
    """sample id -> the patch grids of its images and clips, read from a vision dataset's
    image_grid_thw / video_grid_thw columns (one sample a row: setup/vision_setup.py refuses
    packed rows and streams), for the planner to price their encoder work. Empty without a
    tower (`tower` None: a text-only run) or without grid columns."""
    names = list(getattr(dataset, "column_names", None) or [])
    present = [c for c in GRID_COLUMNS if c in names]
    if tower is None or not present:
        return {}
    return grid_columns_vision({c: dataset[c] for c in present}, "train dataset")


def trainer_planning_setup(
    args,
    model,
    lengths: Union[None, Sequence[int], TokenColumns, StreamColumns],
    world_size: int,
    vision: Optional[Mapping[int, SampleGrids]] = None,
) -> PlanningSetup:
    """The planning setup of a run of `args` (CPTrainingArguments) training `model` on samples of
    `lengths` (or a TokenColumns' samples), or on a stream (its StreamColumns, whose sampler reads
    it), or on batches it makes as it trains (None: no sampler); fails now if its plans need
    hf_cp's attention and the model does not use it. `vision`: sample id -> its images' and
    clips' patch grids (planning_vision_grids), priced with the tower of the model's config."""
    stream = lengths if isinstance(lengths, StreamColumns) else None
    if isinstance(lengths, TokenColumns):
        lengths = lengths.lengths
    settings = args.planning_settings()
    if settings.max_tokens_per_rank == AUTO_CAP and settings.device_memory_gb is None:
        settings = replace(settings, device_memory_gb=device_memory_gb(args.device))
    # the memory model's model states: in the dtype the model was built in (without DeepSpeed
    # they stay in it; DeepSpeed's own dtypes follow its config)
    param = next((p for p in model.parameters() if p.requires_grad), None)
    if settings.model_states is not None and param is not None:
        settings.model_states["param_bytes"] = param.element_size()
    config = model.config.to_dict()
    if vision and not has_vision_tower(config):
        raise ValueError(
            f"{len(vision)} training samples have images or clips, but the model's config has no vision_config "
            "with the tower's dimensions to plan their encoder work"
        )
    setup = planning_setup(
        settings,
        () if stream is not None else lengths,
        world_size,
        model_config=config,
        num_epochs=args.num_train_epochs,
        max_steps=args.max_steps,
        sampler=stream.make_sampler if stream is not None else None,
        vision=VisionDims.from_hf_config(config, source="model config") if vision else None,
    )
    setup.vision = dict(vision or {})
    # now, not at the first step that spreads a sample (after the model is placed and minutes in)
    check_attention(getattr(model.config, "_attn_implementation", None), setup.cluster.group_sizes[-1])
    return setup


def start_warnings(
    setup: PlanningSetup, device_type: str, model_name: str, environ: Optional[Mapping[str, str]] = None
) -> List[str]:
    """Whether the cost profile describes this run (profile_check), and on CPU whether the node's
    ranks share its cores."""
    env = os.environ if environ is None else environ
    settings, cost = setup.settings, setup.cost
    out = []
    warning = profile_warning(
        cost.profile,
        settings.profile if isinstance(settings.profile, str) else cost.profile.name,
        cost.dims,
        device_type,
        settings.model_dims or model_name or "",
    )
    if warning:
        out.append(warning)
    if setup.cap_note:  # what cp_max_tokens_per_rank: auto chose
        out.append(setup.cap_note)
    if device_type == "cpu":
        shared = shared_cores_warning(int(env.get("LOCAL_WORLD_SIZE", "1")), torch.get_num_threads(), available_cores())
        if shared:
            out.append(shared)
    return out


# torch 2.13 deprecates the collectives DeepSpeed's ZeRO stages call every step (all-gather and
# reduce-scatter into one tensor), and the warning came back call after call (254 lines in the
# ZeRO-3 main job): nothing a user can change, said of DeepSpeed's code, not theirs
ENGINE_DEPRECATIONS = (
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    r"`torch\.distributed\.(_all_gather_base|_reduce_scatter_base)` is a private function",
)


def quiet_engine_deprecations() -> None:
    """Ignore torch's deprecation warnings for the collectives DeepSpeed calls (ENGINE_DEPRECATIONS);
    every other warning is left as it is."""
    for message in ENGINE_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


def prepare_deepspeed(args) -> Optional[str]:
    """Before DeepSpeed starts, for every trainer of a run with `args.deepspeed`: no shared-memory
    op build, its collectives' deprecation warnings off, TORCH_CUDA_ARCH_LIST as its op builder
    reads it; the note of the last (deepspeed_arch_env), None without DeepSpeed or a change."""
    if not args.deepspeed:
        return None
    skip_deepspeed_shm_build()
    quiet_engine_deprecations()
    return deepspeed_arch_env()


def skip_deepspeed_shm_build() -> None:
    """DeepSpeed JIT-compiles a shared-memory comm op (~50 s) on every first init; CPU training
    over gloo does not use it."""
    try:
        # by module name: the package attribute `deepspeed.comm.torch` is torch itself
        ds_torch = importlib.import_module("deepspeed.comm.torch")
    except ImportError:  # pragma: no cover - deepspeed is a core dependency
        return
    ds_torch.build_shm_op = lambda: None
