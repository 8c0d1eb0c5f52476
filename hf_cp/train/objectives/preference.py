"""What TRL's preference trainers (DPO, KTO) share under hf_cp: the reference model's log-prob
pass under the step's plan, and the data and settings refused before any work.

The reference is TRL's: a separate `ref_model`, or a PEFT policy with its adapter disabled (or
its "ref" adapter), or, for a pass before the first update, the policy itself. Its forward runs
the same plan as the policy's, so each answer's reference log-prob is summed over the ranks
that hold its tokens like the policy's.
"""

from __future__ import annotations

import contextlib
import os
from typing import List, Optional, Tuple

import torch
from accelerate.utils import is_peft_model
from trl.trainer.utils import use_adapter  # trl

from hf_cp.attention.recurrent import attach_recurrent_layers
from hf_cp.train.checks.setup import HF_CP_ATTENTION
from hf_cp.train.data.collator import RankStep
from hf_cp.train.setup.sharding import FSDP2, sharding_of
from hf_cp.train.step.executor import StepExecutor
from hf_cp.train.step.loss import chunkable_head
from hf_cp.train.step.sequence_objective import all_reduce_sum
from hf_cp.train.step.vision_tower import VisionTower


def reference_forward(executor: StepExecutor, accelerator, policy, ref_model):
    """(model, its LM head for the chunked log-prob path, context) of the reference forward."""
    if ref_model is not None:
        ref = accelerator.unwrap_model(ref_model)
        head = chunkable_head(ref) if executor.loss_head() is not None else None
        return ref, head, contextlib.nullcontext()
    if is_peft_model(policy):
        name = "ref" if "ref" in policy.peft_config else None
        return policy, "policy", use_adapter(policy, adapter_name=name)
    return policy, "policy", contextlib.nullcontext()  # the policy before its first update


def refuse_reference_without_path(args, model, ref_model, trainer: str) -> None:
    """Under FSDP2 with precompute_ref_log_probs and no ref_model, TRL loads a reference from the
    policy's path for its own precompute pass (hf_cp's planned pass uses the policy itself and
    needs none): a policy built in memory, or read from a GGUF file, has no such path, and TRL
    would fail deep in the hub's loader. Refused by name at set-up instead."""
    if isinstance(model, str) or ref_model is not None or not getattr(args, "precompute_ref_log_probs", False):
        return  # a policy given by its path: TRL loads the reference from it
    if is_peft_model(model):
        return
    if sharding_of(args) != FSDP2:
        return
    path = str(getattr(model.config, "_name_or_path", "") or "")
    if path and (not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json"))):
        return
    where = f"its path {path!r} holds no config.json" if path else "it was built in memory, without a path"
    raise ValueError(
        f"{trainer} under FSDP2 with precompute_ref_log_probs=True and no ref_model: TRL loads a reference model "
        f"from the policy's path, and {where}. Pass ref_model (a copy of the initial policy), or save the policy "
        "with save_pretrained and load it from there"
    )


def reference_logps(
    executor: StepExecutor, accelerator, policy, ref_model, step: RankStep, ref_vision: Optional[VisionTower] = None
) -> torch.Tensor:
    """This rank's part of every answer's summed reference log-prob (forward only). `ref_vision`:
    a separate reference model's own vision tower (a vision-language run), which encodes the
    step's images with the reference's weights."""
    model, head, ctx = reference_forward(executor, accelerator, policy, ref_model)
    tower = ref_vision if ref_model is not None else None  # a PEFT or initial policy: the policy's tower
    with torch.no_grad(), ctx, executor.using_vision(tower):
        return executor.answer_logps(model, step, head)


def policy_and_reference_logps(
    executor: StepExecutor,
    accelerator,
    policy,
    ref_model,
    step: RankStep,
    world: int,
    group=None,
    ref_vision: Optional[VisionTower] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every answer's summed log-prob under the policy and under the reference (no gradient),
    the same on every rank: both passes, then one all-reduce."""
    with torch.no_grad():
        own = executor.answer_logps(policy, step)
    ref = reference_logps(executor, accelerator, policy, ref_model, step, ref_vision)
    both = all_reduce_sum(torch.stack([own, ref]), world, group)
    return both[0], both[1]


def refuse_truncation(args, trainer: str, items: str) -> None:
    """TRL's max_length truncates each `items` (pairs, examples); hf_cp spreads long ones instead."""
    if args.max_length is not None:
        raise ValueError(
            f"{trainer}: max_length={args.max_length} would truncate {items}; hf_cp places long {items} over CP "
            "groups instead (cp_max_tokens_per_rank, cp_max_group_size): set max_length=None"
        )


def check_policy_and_reference(trainer, name: str, config: str) -> None:
    """After TRL built `trainer` (DPO, KTO): both models on hf_cp's attention, the reference's
    recurrent layers attached as the policy's are, and no active dropout (`config`: where to turn
    it off)."""
    ref = trainer.ref_model
    reference = trainer.accelerator.unwrap_model(ref) if ref is not None else None
    refuse_other_attention(trainer.model, reference, name)
    attach_reference_recurrent_layers(trainer.accelerator, ref)
    refuse_active_dropout(trainer.model, name, config)


def refuse_padded_batch_settings(args, trainer: str) -> None:
    """Settings of TRL's padded batches and its own training step, which the planned steps
    replace: refused by name when set, rather than silently ignored."""
    if getattr(args, "activation_offloading", False):
        raise ValueError(
            f"{trainer}: activation_offloading=True wraps TRL's training step, which hf_cp's planned step replaces; "
            "bound activation memory with cp_max_tokens_per_rank instead"
        )
    if getattr(args, "padding_free", False):
        raise ValueError(
            f"{trainer}: padding_free=True asks TRL for padding-free batches, which hf_cp's planned steps already are "
            "(every example is one unpadded sample, placed by the plan); leave padding_free unset"
        )
    for name in ("pad_to_multiple_of", "precompute_ref_batch_size"):
        if getattr(args, name, None) is not None:
            raise ValueError(
                f"{trainer}: {name}={getattr(args, name)!r} shapes TRL's padded batches, which hf_cp does not build "
                f"(every example is one unpadded sample of a planned step); leave {name} unset"
            )


def attach_reference_recurrent_layers(accelerator, ref_model) -> None:
    """A hybrid reference model's recurrent layers run per document, as the policy's do (CPTrainer
    attaches the policy's): a reference scoring the packed row as one sequence would carry its
    state across pairs and answers (attention/recurrent.py)."""
    if ref_model is not None:
        ref = accelerator.unwrap_model(ref_model)
        attach_recurrent_layers(ref.get_base_model() if is_peft_model(ref) else ref)


def refuse_other_attention(model, ref_model, trainer: str) -> None:
    """Each example is one shared-prompt sample whose mask only hf_cp's attention reads: a policy
    or reference loaded with another attention is refused when the trainer is built (before: at
    the first step)."""
    for who, m in (("the policy", model), ("the reference model", ref_model)):
        if m is None:
            continue
        base = m.get_base_model() if is_peft_model(m) else m
        impl = getattr(getattr(base, "config", None), "_attn_implementation", None)
        if impl != HF_CP_ATTENTION:
            raise ValueError(
                f"{trainer}: {who} uses attn_implementation={impl!r}; each example is one shared-prompt sample "
                f"whose mask only hf_cp's attention reads: load it with attn_implementation='{HF_CP_ATTENTION}'"
            )


def active_dropout(model: torch.nn.Module) -> List[str]:
    """Names of the model's dropout modules with p > 0."""
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]


def refuse_active_dropout(model: torch.nn.Module, trainer: str, config: str) -> None:
    """The log-prob pass and the gradient pass of a sequence objective must see the same network."""
    dropout = active_dropout(model)
    if dropout:
        raise ValueError(
            f"{trainer}: {len(dropout)} dropout modules are active (e.g. {dropout[0]!r}); the log-prob pass and "
            f"the gradient pass must see the same network: set disable_dropout=True ({config}'s default)"
        )
