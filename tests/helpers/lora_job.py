"""LoRA (peft) under CPTrainer: the LoRA model, its CPTrainer run (train_lora: in this process,
or as a rank of the shared world-2 job, which hands it every run marked "lora"), and a
single-process reference built from torch, transformers and peft alone (nothing of hf_cp).

Keys of a run: lengths, tokens_per_step,
max_tokens_per_rank, steps, balancer (registered name or harness.balancers' scripted one), out;
optional deepspeed (ZeRO-2, harness.job.zero2_config; default plain DDP), save_steps,
activation_checkpointing, mutation ("loss_scale": a deliberate bug, every wave's loss x 1.001,
for the test that shows the comparison fails), lr, model_seed, data_seed. Each run writes on rank 0: steps.pt (per step: gradients of the
trainable parameters before clipping, trainable parameters after the optimizer step),
params.pt (every parameter at the end, trainable or not), history.json, log_history.json,
engine.json (DeepSpeed or not, and the model's wrapper), and trainer.save_model's output in
out/adapter.

The reference trains the same LoRA model (same seeds, SDPA attention) one sample at a time on
the same global batches: loss = sum of token losses / valid targets of the global batch,
global-norm clipping over the trainable parameters, AdamW over the trainable parameters.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Dict, List

import torch

from helpers.harness.models import synthetic_rows, tiny_model
from helpers.harness.reference import reference_batches, sample_loss_sum, sample_valid_targets

Tensors = Dict[str, torch.Tensor]

# LoRA on the attention's query and value projections, no dropout (the trainer and the reference
# must compute the same function)
LORA_RANK = 4
LORA_ALPHA = 8
LORA_TARGETS = ("q_proj", "v_proj")
# At 600 tokens per step, unshuffled: [0 1 2 3] (sample 0 has 400 tokens, over the 256-token cap
# of a rank at world 2: a CP group of both ranks holds it, the others run local) and [4..9];
# step 3 is [0..3] again (the second epoch)
LENGTHS = [400, 60, 30, 90, 120, 100, 150, 90, 60, 70]
TOKENS_PER_STEP = 600


def lora_spec(**kw) -> dict:
    """A LoRA run (without its output folder): `lora: True` sends it to train_lora in a job."""
    spec = dict(
        lora=True, lengths=LENGTHS, tokens_per_step=TOKENS_PER_STEP, max_tokens_per_rank=256, steps=3, balancer="auto"
    )
    spec.update(kw)
    return spec


# the world-2 runs (trained by the session's shared world-2 job, tests/helpers/world2_job.py):
# DeepSpeed ZeRO-2 with a checkpoint after the last step, plain DDP with activation
# checkpointing and a checkpoint after every step
WORLD2_LORA_RUNS = {
    "lora-zero2": lora_spec(deepspeed=True, save_steps=3),
    "lora-ddp": lora_spec(save_steps=1, activation_checkpointing=True),
}


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=list(LORA_TARGETS), lora_dropout=0.0)


def lora_model(seed: int = 0, attn: str = "hf_cp"):
    """The harness's tiny Llama (seed `seed`, attention `attn`) wrapped by peft.get_peft_model:
    lora_A from seed + 1 (lora_B starts at zero, peft's default), base weights frozen."""
    from peft import get_peft_model

    base = tiny_model(seed, attn=attn)
    torch.manual_seed(seed + 1)
    return get_peft_model(base, lora_config())


def trainable(model) -> Tensors:
    return {n: p.detach().clone().cpu() for n, p in model.named_parameters() if p.requires_grad}


def frozen(model) -> Tensors:
    return {n: p.detach().clone().cpu() for n, p in model.named_parameters() if not p.requires_grad}


# --------------------------------------------------------------------- the reference
@dataclass(frozen=True)
class LoraStep:
    sample_ids: tuple
    loss: float
    grad_norm: float  # over the trainable parameters, before clipping
    grads: Tensors  # trainable parameters, before clipping
    params: Tensors  # trainable parameters, after the optimizer step


def reference_steps(spec: dict) -> List[LoraStep]:
    keys = ("lengths", "tokens_per_step", "steps", "lr", "model_seed", "data_seed")
    return list(_reference(json.dumps({k: spec.get(k) for k in keys}, sort_keys=True)))


@lru_cache(maxsize=8)
def _reference(key: str) -> tuple:
    spec = json.loads(key)
    rows = synthetic_rows(spec["lengths"], spec["data_seed"] or 0)
    model = lora_model(spec["model_seed"] or 0, attn="sdpa")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    lr = spec["lr"] if spec["lr"] is not None else 1e-3
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    out = []
    for batch in reference_batches(spec["lengths"], spec["tokens_per_step"], spec["steps"]):
        opt.zero_grad()
        weight = 1.0 / sum(sample_valid_targets(rows[s]) for s in batch)
        total = 0.0
        for s in batch:
            part = sample_loss_sum(model, rows[s])
            (part * weight).backward()
            total += float(part.detach())
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        opt.step()
        out.append(LoraStep(tuple(batch), total * weight, norm, grads, trainable(model)))
    return tuple(out)


# --------------------------------------------------------------------- one CPTrainer run
def _capture(trainer) -> dict:
    """records[k] = {"grads", "params"} of the trainable parameters at 0-based step k."""
    records: Dict[int, dict] = {}
    if trainer.is_deepspeed_enabled:
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.utils import safe_get_full_grad

        original = DeepSpeedEngine.step

        def step(engine, *args, **kwargs):
            index = trainer.state.global_step
            grads = {}
            for n, p in engine.module.named_parameters():
                if p.requires_grad:  # a collective: every rank, same order
                    grads[n] = safe_get_full_grad(p).detach().clone().float().cpu()
            result = original(engine, *args, **kwargs)
            records[index] = {"grads": grads, "params": trainable(engine.module)}
            return result

        DeepSpeedEngine.step = step
        return records, lambda: setattr(DeepSpeedEngine, "step", original)

    from transformers import TrainerCallback

    pending: Dict[str, Tensors] = {}

    class _Record(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            pending["grads"] = {
                n.removeprefix("module."): p.grad.detach().clone().cpu()
                for n, p in model.named_parameters()
                if p.requires_grad
            }

        def on_optimizer_step(self, args, state, control, **kw):
            records[state.global_step] = {"grads": pending.pop("grads"), "params": trainable(trainer.model)}

    callback = _Record()
    trainer.add_callback(callback)
    return records, lambda: trainer.remove_callback(callback)


def train_lora(spec: dict, model=None):
    """Train the run `spec` with CPTrainer in this process (a world of one, or one rank of a
    torchrun job); save what the tests read (rank 0) and return the trainer."""
    from accelerate.state import AcceleratorState, GradientState
    from datasets import Dataset

    from hf_cp.train import CPTrainer, CPTrainingArguments

    from helpers.harness.balancers import balancer_for
    from helpers.harness.job import zero2_config

    # an earlier run's Accelerator state (its DeepSpeed plugin) must not leak into this one
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    if not spec.get("deepspeed"):  # a DeepSpeed run before it in this process leaves it set
        os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    model = lora_model(spec.get("model_seed") or 0) if model is None else model
    args = CPTrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        deepspeed=zero2_config() if spec.get("deepspeed") else None,
        seed=42,
        cp_balancer=spec["balancer"],
        cp_max_tokens_per_rank=spec["max_tokens_per_rank"],
        cp_tokens_per_step=spec["tokens_per_step"],
        cp_shuffle=False,
        cp_compare_balancer=None,
        max_steps=spec["steps"],
        learning_rate=spec.get("lr") or 1e-3,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        report_to="none",
        save_strategy="steps" if spec.get("save_steps") else "no",
        save_steps=spec.get("save_steps") or 500,
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_timeout=120,
        activation_checkpointing=bool(spec.get("activation_checkpointing")),
    )
    trainer = CPTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(synthetic_rows(spec["lengths"], spec.get("data_seed") or 0)),
        balancer=balancer_for(spec["balancer"]),
    )
    if spec.get("mutation") == "loss_scale":
        _scale_wave_losses(trainer)
    elif spec.get("mutation"):
        raise ValueError(f"mutation {spec['mutation']!r}: expected loss_scale")
    records, stop = _capture(trainer)
    try:
        trainer.train()
    finally:
        stop()
    if spec.get("activation_checkpointing") and not trainer.model.is_activation_checkpointing:
        raise RuntimeError("activation_checkpointing was asked for but the model trained without it")
    trainer.save_model(str(out / "adapter"))  # every rank (a collective under some DeepSpeed stages)
    if trainer.cp_rank == 0:
        torch.save(records, out / "steps.pt")
        torch.save({n: p.detach().clone().cpu() for n, p in trainer.model.named_parameters()}, out / "params.pt")
        (out / "history.json").write_text(json.dumps([r.to_dict() for r in trainer.cp_history]))
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
        engine = dict(deepspeed=trainer.is_deepspeed_enabled, wrapper=type(trainer.model_wrapped).__name__)
        (out / "engine.json").write_text(json.dumps(engine))
    return trainer


def _scale_wave_losses(trainer) -> None:
    """Every wave's summed loss x 1.001 (what the trainer records, logs and backpropagates), in
    this trainer's step executor only (built by _cp_setup)."""
    from helpers.harness.job import MUTATION_SCALE

    setup = trainer._cp_setup

    def scaled_setup():
        setup()
        executor = trainer.cp_runtime.executor
        if "wave_loss" not in vars(executor):
            wave_loss = executor.wave_loss
            executor.wave_loss = lambda model, mb: wave_loss(model, mb) * MUTATION_SCALE

    trainer._cp_setup = scaled_setup


# --------------------------------------------------------------------- the comparison
def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-30))


def compare_with_reference(spec: dict) -> Dict[str, float]:
    """Every step of the run in spec['out'] against reference_steps(spec), with the tolerances
    of the trainer exactness check (harness.check); the worst relative errors. Raises
    AssertionError naming every quantity out of tolerance."""
    from helpers.harness.check import GRAD_NORM_RTOL, GRAD_RTOL, LOSS_RTOL, PARAM_RTOL

    out = Path(spec["out"])
    history = json.loads((out / "history.json").read_text())
    logged = {r["step"] - 1: r for r in json.loads((out / "log_history.json").read_text()) if "grad_norm" in r}
    steps = torch.load(out / "steps.pt")
    ref = reference_steps(spec)
    assert [r["index"] for r in history] == sorted(steps) == sorted(logged) == list(range(spec["steps"]))
    worst: Dict[str, float] = {}
    failures: List[str] = []

    def note(what: str, err: float, tol: float, where: str) -> None:
        worst[what] = max(worst.get(what, 0.0), err)
        if not err <= tol:
            failures.append(f"{where}: relative error {err:.3g} > {tol:g}")

    for k, r in enumerate(ref):
        note("loss", abs(history[k]["loss"] - r.loss) / r.loss, LOSS_RTOL, f"step {k + 1} loss")
        note("logged_loss", abs(logged[k]["loss"] - r.loss) / r.loss, LOSS_RTOL, f"step {k + 1} logged loss")
        note(
            "grad_norm",
            abs(logged[k]["grad_norm"] - r.grad_norm) / r.grad_norm,
            GRAD_NORM_RTOL,
            f"step {k + 1} grad_norm",
        )
        got = steps[k]
        assert set(got["grads"]) == set(r.grads) and set(got["params"]) == set(r.params), "different parameters"
        for n in r.grads:
            note("grads", relative_error(got["grads"][n], r.grads[n]), GRAD_RTOL, f"step {k + 1} gradient of {n}")
            note("params", relative_error(got["params"][n], r.params[n]), PARAM_RTOL, f"step {k + 1} {n}")
    if failures:
        raise AssertionError("LoRA run differs from the single-process reference:\n  " + "\n  ".join(failures))
    return worst
