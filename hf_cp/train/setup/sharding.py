"""Parameter sharding under planned steps: FSDP2 and DeepSpeed ZeRO-3.

Both engines turn every forward and backward pass into world-wide collectives (each layer's
parameters all-gathered, its gradients reduce-scattered), so every rank must run the same
sequence of passes in each wave: the executor follows StepPlan.wave_passes (plan/passes.py)
when `shards_parameters` says so.

FSDP2 comes from accelerate (`fsdp_version: 2` in an accelerate config, or the Trainer's `fsdp`
/ `fsdp_config` arguments): it applies `fully_shard` to each decoder layer and the root, builds
the optimizer over the shards, clips over DTensors and saves sharded checkpoints through torch
distributed checkpoint. accelerate only routes FSDP for GPU-type backends; on CPU (gloo) it
falls back to DDP without a word. FSDP2 itself runs on gloo, so `route_fsdp_on_cpu` marks the
accelerate state FSDP there, and the CPU run is the same code path as a GPU one.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.fsdp import MixedPrecisionPolicy

from hf_cp.cost.execution import zero_stage_of
from hf_cp.planning.setup import deepspeed_config_of, fsdp_version_of
from hf_cp.train.checks.setup import SetupError

FSDP2 = "fsdp2"
ZERO3 = "zero3"


def sharding_of(args, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """ "fsdp2", "zero3" or None (parameters replicated: DDP, ZeRO-0/1/2) for a run's arguments."""
    if fsdp_version_of(args, environ) == 2:
        return FSDP2
    if zero_stage_of(deepspeed_config_of(args)) >= 3:
        return ZERO3
    return None


def _plugin_flag(args, environ: Mapping[str, str], keys, env_key: str) -> bool:
    plugin = getattr(args, "fsdp_plugin_args", None) or {}
    config = getattr(args, "fsdp_config", None) or {}
    for source in (plugin, config):
        for key in keys:
            if key in source and source[key] not in (None, False, "false", "False", ""):
                return True
    return str(environ.get(env_key, "false")).lower() in ("1", "true", "yes")


def clear_leftover_fsdp_env(args, environ=None) -> bool:
    """Drop ACCELERATE_USE_FSDP that an earlier trainer of this process left behind: accelerate's
    Accelerator sets it in-process when given an FSDP plugin, and a later trainer without fsdp
    (ZeRO-3 after FSDP2, in one notebook) would then be read as FSDP version 1 and get an FSDP
    plugin too. `accelerate launch` with an FSDP config sets FSDP_VERSION beside it, so a flag
    without FSDP_VERSION, in a run whose arguments ask for no fsdp, is such a leftover. True when
    it was dropped."""
    env = os.environ if environ is None else environ
    flag = str(env.get("ACCELERATE_USE_FSDP", "")).lower() in ("1", "true", "yes")
    if flag and "FSDP_VERSION" not in env and not getattr(args, "fsdp", None):
        env.pop("ACCELERATE_USE_FSDP", None)
        return True
    return False


def check_sharding(args, environ: Optional[Mapping[str, str]] = None) -> None:
    """Refuse, by name and with the fix, the sharding set-ups CPTrainer cannot honour."""
    env = os.environ if environ is None else environ
    version = fsdp_version_of(args, env)
    if version is None:
        return
    if version != 2:
        raise SetupError(
            f"FSDP version {version} (fsdp_config.fsdp_version / FSDP_VERSION): CPTrainer shards parameters with "
            f"FSDP2 only (torch fully_shard: per-parameter sharding, the pass-by-pass collectives hf_cp aligns "
            f"across ranks). Set fsdp_config: {{fsdp_version: 2}} (fsdp_version: 2 in an accelerate config)"
        )
    if getattr(args, "deepspeed", None):
        raise SetupError(
            "fsdp together with deepspeed: choose one engine. FSDP2 (fsdp: true, fsdp_config: {fsdp_version: 2}) "
            "or DeepSpeed (training.deepspeed: a ZeRO-2 or ZeRO-3 JSON), not both"
        )
    if _plugin_flag(args, env, ("cpu_offload", "offload_params"), "FSDP_OFFLOAD_PARAMS"):
        raise SetupError(
            "FSDP2 CPU offload (fsdp offload / fsdp_config.offload_params / FSDP_OFFLOAD_PARAMS): not supported by "
            "hf_cp; its memory model and pass alignment assume parameters on the device. Remove the offload "
            "setting; for a model that does not fit, raise the shard group (more ranks) or use ZeRO-3"
        )
    if _plugin_flag(args, env, ("activation_checkpointing",), "FSDP_ACTIVATION_CHECKPOINTING"):
        raise SetupError(
            "fsdp_config.activation_checkpointing: FSDP's own checkpoint wrapper is not supported by hf_cp (its "
            "recompute passes are not in the plan's pass count). Use the Trainer's gradient_checkpointing: true, "
            "or ChunkFlow (cp_balancer: chunkflow) for long samples"
        )


def route_fsdp_on_cpu(accelerator, plugin_args: Optional[Mapping]) -> bool:
    """On a CPU (gloo) run asking for FSDP2, mark accelerate's state FSDP with the run's plugin,
    as accelerate does itself for GPU backends. Both states: AcceleratorState copies
    PartialState's fields whenever it is rebuilt, so setting it alone would not last.
    Returns whether it changed anything."""
    state = accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin = FullyShardedDataParallelPlugin(**dict(plugin_args or {}))
    if str(getattr(accelerator, "mixed_precision", "no")) != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return True


# the most forward graphs ZeRO-3 may hold open at once (StepExecutor.max_open_graphs)
ZERO3_OPEN_GRAPHS = 1


def chunk_keep_of(balancer_options: Mapping) -> int:
    """K, the dependent chunks ChunkFlow keeps, from a balancer's options (chunkflow's own, or
    auto's member options; PlanningSettings.balancer_kwargs fills both in)."""
    member = (balancer_options.get("member_options") or {}).get("chunkflow") or {}
    return int(balancer_options.get("keep", member.get("keep", 1)) or 1)


def check_zero3_chunk_keep(sharding: Optional[str], balancer: str, balancer_options: Mapping) -> None:
    """ZeRO-3 with ChunkFlow keeping several chunks is refused at set-up (StepExecutor checks
    every wave's passes too)."""
    if sharding != ZERO3 or balancer not in ("chunkflow", "auto"):
        return
    keep = chunk_keep_of(balancer_options)
    if keep > ZERO3_OPEN_GRAPHS:
        raise SetupError(
            f"cp_chunk_keep {keep} (ChunkFlow keeping {keep} chunks' graphs before their backwards) under DeepSpeed "
            f"ZeRO-3: ZeRO-3 computes wrong gradients with several forward graphs open at once. Set cp_chunk_keep: 1 "
            f"(recompute all but the last chunk), or use FSDP2 (fsdp: true, fsdp_config: {{fsdp_version: 2}})"
        )


def check_trainer_sharding(args) -> None:
    """What every hf_cp trainer checks of its sharding before accelerate acts on it: an FSDP flag
    an earlier trainer of this process left behind is dropped, then the set-ups hf_cp cannot
    honour are refused (check_sharding)."""
    clear_leftover_fsdp_env(args)
    check_sharding(args)


class FSDP2Trainer:
    """The Trainer hooks of FSDP2 under hf_cp, mixed into every hf_cp trainer (CPTrainer and the
    TRL generation trainers) ahead of transformers' Trainer: accelerate's CPU gap routed
    (route_fsdp_on_cpu; without it a CPU run silently trains plain DDP), checkpoints of sharded
    state dicts, bf16 compute with fp32 reduction, and a full model from save_model."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if sharding_of(self.args) != FSDP2:
            return
        if route_fsdp_on_cpu(self.accelerator, self.args.fsdp_plugin_args):
            self.is_fsdp_enabled = True
        # checkpoints hold each rank's shards (torch distributed checkpoint); save_model gathers a full
        # one. The configs of the Trainer's default (FULL_STATE_DICT) would otherwise stay in place.
        plugin = self.accelerator.state.fsdp_plugin
        plugin.state_dict_config = plugin.optim_state_dict_config = None
        plugin.set_state_dict_type("SHARDED_STATE_DICT")
        policy = fsdp2_mixed_precision(self.accelerator, self.args.fsdp_plugin_args)
        if policy is not None:
            plugin.mixed_precision_policy = policy

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Under FSDP2 a checkpoint's model is sharded (the Trainer's _save_checkpoint writes it);
        the model saved on its own is a full one, gathered to rank 0, loadable with from_pretrained."""
        if not (self.is_fsdp_enabled and not _internal_call):
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        state_dict = self.accelerator.get_state_dict(self.model)  # collective: every rank takes part
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)


def fsdp2_mixed_precision(accelerator, plugin_args: Optional[Mapping]) -> Optional[MixedPrecisionPolicy]:
    """FSDP2's policy for a half-precision run: parameters gathered in bf16 (fp16) for compute,
    gradients reduced in fp32 (accelerate's own default reduces in the half type, which rounds the
    sum over ranks). None: keep what is set (no mixed precision, or the user's own
    fsdp_config.mixed_precision_policy)."""
    if (plugin_args or {}).get("mixed_precision_policy") is not None:
        return None
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(getattr(accelerator, "mixed_precision", "no")))
    if half is None:
        return None
    return MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
