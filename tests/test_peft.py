"""PEFT / LoRA under CPTrainer: a tiny Llama wrapped by peft.get_peft_model(LoraConfig on q_proj
and v_proj) trains exactly as the same LoRA model trained on one process, sample by sample,
by torch, transformers and peft alone (helpers.lora_job's reference): per step the loss, the
gradient norm, the LoRA gradients before the optimizer and the LoRA weights after it. The
base weights stay frozen and bit-identical, and trainer.save_model / checkpoints save the
adapter, which loads back into the base model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.harness.check import PARAM_RTOL
from helpers.lora_job import (
    LORA_TARGETS,
    compare_with_reference,
    frozen,
    lora_model,
    reference_steps,
    relative_error,
    train_lora,
)
from helpers.lora_job import lora_spec as run_spec
from helpers.world2_job import FIXTURE_TIMEOUT


def lora_spec(out: Path, **kw) -> dict:
    return dict(run_spec(**kw), out=str(out))


def assert_adapter_saved(folder: Path, final: dict) -> None:
    """`folder` holds a peft adapter (no base weights) that loads back into the base model with
    the trained LoRA weights."""
    from peft import PeftModel

    names = sorted(p.name for p in folder.iterdir())
    assert "adapter_config.json" in names and "adapter_model.safetensors" in names, names
    assert not any(n.startswith("model") for n in names), f"the base model was saved too: {names}"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(LORA_TARGETS) and config["r"] == 4
    from helpers.harness.models import tiny_model

    loaded = PeftModel.from_pretrained(tiny_model(0, attn="sdpa"), str(folder))
    lora = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert lora and set(lora) == {n for n in final if "lora_" in n}
    for n, p in lora.items():
        assert torch.equal(p.detach(), final[n]), n


def assert_only_lora_trained(final: dict) -> None:
    """The base weights are the untrained model's, bit for bit; every LoRA weight moved."""
    init = lora_model(0, attn="sdpa")
    base = frozen(init)
    assert set(base) | {n for n in final if "lora_" in n} == set(final)
    for n, p in base.items():
        assert torch.equal(final[n], p), f"frozen {n} changed"
    moved = {n: float((final[n] - p.detach()).norm()) for n, p in init.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in moved) and len(moved) == 2 * len(LORA_TARGETS) * 2  # A and B, 2 layers
    assert all(m > 0 for m in moved.values()), moved


def test_lora_model_trains_under_cptrainer_like_one_plain_process(tmp_path):
    """World 1 (this process), with activation checkpointing: three CPTrainer steps of the LoRA
    model equal the reference; only LoRA weights train; save_model writes the adapter."""
    spec = lora_spec(tmp_path / "w1", max_tokens_per_rank=512, activation_checkpointing=True)
    model = lora_model(0)
    assert model.config._attn_implementation == "hf_cp"
    trainer = train_lora(spec, model)
    assert trainer.model is model  # a plain PeftModel, not unwrapped or rebuilt
    worst = compare_with_reference(spec)
    assert worst["params"] < PARAM_RTOL
    final = torch.load(Path(spec["out"]) / "params.pt")
    assert_only_lora_trained(final)
    assert_adapter_saved(Path(spec["out"]) / "adapter", final)


def test_comparison_fails_on_a_loss_scaled_by_one_part_in_a_thousand(tmp_path):
    spec = lora_spec(tmp_path / "scaled", max_tokens_per_rank=512, mutation="loss_scale")
    train_lora(spec)
    with pytest.raises(AssertionError) as caught:
        compare_with_reference(spec)
    assert "step 1 loss: relative error 0.001" in str(caught.value)
    assert "step 1 gradient of" in str(caught.value)


def test_reference_trains_lora_only():
    """The reference is not vacuous: its LoRA B weights get gradients from step 1, lora_A from
    step 2 (B starts at zero), and the loss moves."""
    steps = reference_steps(lora_spec(Path("unused")))
    a = [n for n in steps[0].grads if "lora_A" in n]
    b = [n for n in steps[0].grads if "lora_B" in n]
    assert a and b and len(steps[0].grads) == len(a) + len(b)
    assert all(steps[0].grads[n].norm() > 0 for n in b) and all(steps[0].grads[n].norm() == 0 for n in a)
    assert all(steps[1].grads[n].norm() > 0 for n in a)
    assert steps[0].loss != steps[2].loss  # the same batch, one epoch later


@pytest.mark.timeout(FIXTURE_TIMEOUT)
def test_lora_trains_at_world_2_exactly_as_one_process(world2_job):
    """World 2 (the session's torchrun job, gloo): the 400-token sample on a CP group of both
    ranks, the rest local, under DeepSpeed ZeRO-2 (a checkpoint after the last step) and under
    plain DDP (with activation checkpointing, a checkpoint after every step): every step equals
    the single-process reference, base weights untouched; checkpoints and save_model hold the adapter."""
    zero2, ddp = world2_job["lora-zero2"], world2_job["lora-ddp"]
    engines = {k: json.loads((Path(s["out"]) / "engine.json").read_text()) for k, s in (("zero2", zero2), ("ddp", ddp))}
    assert engines == {
        "zero2": {"deepspeed": True, "wrapper": "DeepSpeedEngine"},
        "ddp": {"deepspeed": False, "wrapper": "DistributedDataParallel"},
    }
    for spec in (zero2, ddp):
        out = Path(spec["out"])
        history = json.loads((out / "history.json").read_text())
        assert sum(r["cp_size_samples"].get("2", 0) for r in history) >= 2, "no sample ran on a CP group"
        assert sum(r["cp_size_samples"].get("1", 0) for r in history) >= 1, "no sample ran locally"
        compare_with_reference(spec)
        final = torch.load(out / "params.pt")
        assert_only_lora_trained(final)
        assert_adapter_saved(out / "adapter", final)
    # the checkpoints hold the adapter of their step (not the base weights), marked complete
    from safetensors.torch import load_file

    steps = reference_steps(ddp)
    for spec, k in ((ddp, 1), (ddp, 3), (zero2, 3)):
        ckpt = Path(spec["out"]) / f"checkpoint-{k}"
        assert (ckpt / "hf_cp_complete.json").exists()
        saved = load_file(str(ckpt / "adapter_model.safetensors"))
        # peft drops the adapter name ("default") from the saved keys
        want = {n.replace(".default", ""): p for n, p in steps[k - 1].params.items()}
        assert set(saved) == set(want)
        assert max(relative_error(saved[n], want[n]) for n in want) < PARAM_RTOL
        engine_files = list(ckpt.glob("global_step*/mp_rank_00_model_states.pt"))
        if spec is ddp:
            assert not engine_files  # plain DDP: no DeepSpeed checkpoint
        else:  # DeepSpeed's own copy of the module: the trainable (LoRA) weights only
            (states,) = engine_files
            module = torch.load(states, weights_only=False)["module"]
            assert set(module) == set(steps[k - 1].params)
