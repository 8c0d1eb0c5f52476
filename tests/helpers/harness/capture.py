"""Record what a CPTrainer run did at every optimizer step: the gradients before clipping and
the optimizer, and the parameters after the optimizer step.

Under DeepSpeed the optimizer step runs inside the last wave's backward (accelerate calls
engine.step() there) and ZeRO-2 keeps each rank's gradient partition only, so the engine's
step is wrapped and the full gradients are assembled with deepspeed's own
`safe_get_full_grad` (a collective: every rank calls it, in the same order). Without
DeepSpeed the Trainer clips in `_clip_grad_norm` just before the optimizer step; under FSDP2
the gradients and parameters there are shards, gathered whole.
"""

from __future__ import annotations

from typing import Dict

import torch

Tensors = Dict[str, torch.Tensor]


def _full(t: torch.Tensor) -> torch.Tensor:
    # an FSDP2 shard (DTensor) gathered whole: a collective, which every rank runs here in the same order
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _snapshot(module: torch.nn.Module) -> Tensors:
    return {n: _full(p).detach().clone().cpu() for n, p in module.named_parameters()}


def deepspeed_snapshot(module: torch.nn.Module) -> Tensors:
    """Every parameter whole under DeepSpeed: ZeRO-3 keeps each rank's partition only (the
    module's tensors are empty), gathered by deepspeed's safe_get_full_fp32_param (a collective)."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for n, p in module.named_parameters():
        whole = safe_get_full_fp32_param(p) if hasattr(p, "ds_id") else p
        out[n] = whole.detach().clone().float().cpu()
    return out


def capture_steps(trainer) -> tuple:
    """Start recording; returns (records, stop). records[k] = {"grads": ..., "params": ...} for
    0-based global step k, filled as training runs; stop() undoes the wrapping."""
    records: Dict[int, dict] = {}
    if trainer.is_deepspeed_enabled:
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.utils import safe_get_full_grad

        original = DeepSpeedEngine.step

        def step(engine, *args, **kwargs):
            index = trainer.state.global_step  # steps completed before this one
            grads = {}
            for n, p in engine.module.named_parameters():
                g = safe_get_full_grad(p)
                if g is None:
                    raise RuntimeError(f"step {index}: DeepSpeed holds no gradient for {n}")
                grads[n] = g.detach().clone().float().cpu()
            result = original(engine, *args, **kwargs)
            records[index] = {"grads": grads, "params": deepspeed_snapshot(engine.module)}
            return result

        DeepSpeedEngine.step = step

        def stop() -> None:
            DeepSpeedEngine.step = original

        return records, stop

    clip = trainer._clip_grad_norm
    pending: Dict[str, Tensors] = {}

    def clip_and_record(model):
        pending["grads"] = {n: _full(p.grad).detach().clone().cpu() for n, p in model.named_parameters()}
        return clip(model)

    from transformers import TrainerCallback

    class _AfterOptimizer(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kw):
            if "grads" not in pending:
                raise RuntimeError("no gradients recorded before the optimizer step (max_grad_norm must be > 0)")
            records[state.global_step] = {"grads": pending.pop("grads"), "params": _snapshot(trainer.model)}

    callback = _AfterOptimizer()
    trainer._clip_grad_norm = clip_and_record
    trainer.add_callback(callback)

    def stop_plain() -> None:
        del trainer._clip_grad_norm
        trainer.remove_callback(callback)

    return records, stop_plain
