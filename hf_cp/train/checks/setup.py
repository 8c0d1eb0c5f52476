"""Checks made when a CP run is set up, before a model is moved or a process group is used:
what would otherwise fail at step 1 (the attention implementation), or deep inside another
library with a bare assertion (DeepSpeed's sequence parallelism). Shared by CPTrainer and the
dry run, so both refuse the same settings with the same words.
"""

from __future__ import annotations

import os
import re
from typing import Mapping, Optional

HF_CP_ATTENTION = "hf_cp"  # the name hf_cp.attention.interface registers


class SetupError(ValueError):
    """A setting CPTrainer cannot run with; the message names it and the fix."""


def parallelism_sizes(parallelism_config, environ: Optional[Mapping[str, str]] = None) -> dict:
    """cp_size and sp_size asked for, from a ParallelismConfig or from the environment that
    `accelerate launch` sets from its config file (PARALLELISM_CONFIG_*_SIZE)."""
    env = os.environ if environ is None else environ
    out = {}
    for name in ("cp_size", "sp_size"):
        value = getattr(parallelism_config, name, None) if parallelism_config is not None else None
        if value is None:
            value = env.get(f"PARALLELISM_CONFIG_{name.upper()}")
        out[name] = int(value) if value not in (None, "") else 1
    return out


def deepspeed_arch_list(value: Optional[str]) -> Optional[str]:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's op builder can read it. DeepSpeed 0.19 JIT-builds
    FusedAdam at its first step and parses every arch as numbers, so an arch-specific suffix
    ("9.0a", which CUDA images for Hopper set) fails with "invalid literal for int() ... '0a'"
    (seen on an H200). None when the value needs no change."""
    if not value:
        return None
    fixed = re.sub(r"(\d)[a-z]+", r"\1", value)
    return fixed if fixed != value else None


def check_parallelism(parallelism_config, environ: Optional[Mapping[str, str]] = None) -> None:
    """hf_cp plans its own context-parallel groups per step; accelerate's CP (cp_size, FSDP2) and
    DeepSpeed's Ulysses sequence parallelism (sp_size, ALST) would shard the same sequences again."""
    if isinstance(parallelism_config, Mapping):
        # a YAML mapping reaches TrainingArguments as a dict, which accelerate cannot use ("'dict' object
        # has no attribute 'get_device_mesh'", at launch): refused here, where the config is read
        raise SetupError(
            f"training.parallelism_config {dict(parallelism_config)!r}: hf_cp plans its context-parallel groups "
            f"per step and takes the data-parallel size from the launcher (its world size), so a training config "
            f"takes no parallelism_config; remove it, and size CP with cp_max_tokens_per_rank (what one rank holds) "
            f"and cp_max_group_size (the largest group)"
        )
    sizes = parallelism_sizes(parallelism_config, environ)
    if sizes["sp_size"] > 1:
        raise SetupError(
            f"ParallelismConfig sp_size={sizes['sp_size']} (DeepSpeed Ulysses / ALST sequence parallelism): "
            f"hf_cp already splits long sequences over CP groups it plans per step (Ulysses or ring inside "
            f"each group). Set sp_size=1 (or drop parallelism_config_sp_size from the accelerate config) and "
            f"size CP with cp_max_tokens_per_rank (what one rank holds) and cp_max_group_size (the largest group)"
        )
    if sizes["cp_size"] > 1:
        raise SetupError(
            f"ParallelismConfig cp_size={sizes['cp_size']}: CPTrainer plans its own CP groups per step; set "
            f"cp_size=1 (dp_shard/dp_replicate only) and size CP with cp_max_tokens_per_rank / cp_max_group_size"
        )


def check_attention(impl: Optional[str], largest_group: int, where: str = "the model") -> None:
    """A run whose plans may spread a sample over a CP group needs hf_cp's attention: any other
    implementation would attend within each rank's shard only. Checked when the trainer is built
    (not at the first step that spreads a sample, minutes into the run)."""
    if largest_group > 1 and impl != HF_CP_ATTENTION:
        raise SetupError(
            f"{where} uses attn_implementation={impl!r}, but plans may spread samples over CP groups of up to "
            f"{largest_group} ranks, which needs attn_implementation='{HF_CP_ATTENTION}': load the model with "
            f"attn_implementation='{HF_CP_ATTENTION}' (model.attn_implementation: {HF_CP_ATTENTION} in a config), "
            f"or set cp_max_group_size: 1 to keep every sample on one rank"
        )


def check_step_attention(plan, has_masks: bool, index: int, impl: Optional[str], what: str = "step") -> None:
    """Before a step (or evaluation batch) `index` runs `plan` (a StepPlan): a plan that spreads
    samples over CP groups or runs them as dependent chunks, or samples with attention masks,
    need hf_cp's attention (`impl`: the model's attention implementation)."""
    chunked = plan.chunked_samples
    if (plan.spreads_samples or has_masks or chunked) and impl != HF_CP_ATTENTION:
        why = (
            f"the {plan.balancer!r} plan distributes samples over CP groups"
            if plan.spreads_samples
            else f"the {plan.balancer!r} plan runs samples {chunked[:10]} as dependent chunks (ChunkFlow)"
            if chunked
            else "its samples carry attention masks (shared-prompt samples: DPO pairs, KTO examples, grouped answers) "
            "that only hf_cp's attention reads"
        )
        raise ValueError(
            f"{what} {index + 1}: {why}, which needs attn_implementation='{HF_CP_ATTENTION}' (the "
            f"model uses {impl!r}); load it with attn_implementation='{HF_CP_ATTENTION}'"
        )
