"""What a launch would trip over, refused by `hf-cp train --dry-run` (and by CPTrainer at set-up,
through the same functions: hf_cp/train/checks/launch.py, checkpoint/fit.py). Before, each of
these passed the dry run and failed the launch with a traceback on every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_cp.train.checkpoint.fit import check_checkpoint_fits, checkpoint_engine, run_engine
from hf_cp.train.checks.setup import SetupError
from hf_cp.train.launch.dry_run import dry_run

from helpers.checkpoint_runs import train_with_checkpoints
from helpers.harness.models import ROOT, tiny_config

TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
RECIPE = json.loads((ROOT / "recipes" / "ds-zero2-cpu.json").read_text())


def _dry(tmp_path, *overrides, world: int = 2):
    return dry_run(TINY, [f"training.output_dir={tmp_path / 'out'}", *overrides], world_size=world, steps=1)


def _deepspeed(tmp_path, **edits) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(dict(RECIPE, **edits)))
    return f"training.deepspeed={path}"


@pytest.mark.parametrize(
    "edits, message",
    [
        (
            dict(train_micro_batch_size_per_gpu=4),
            "ds train_micro_batch_size_per_gpu=4 vs hf per_device_train_batch_size=1",
        ),
        (dict(gradient_accumulation_steps=3), "ds gradient_accumulation_steps=3 vs hf gradient_accumulation_steps=1"),
        (dict(train_batch_size=1), r"ds train_batch_size=1 vs hf train_batch_size \(calculated\)=2"),  # 2 ranks
        (dict(optimizer={"type": "AdamW", "params": {"lr": 0.5}}), "ds optimizer.params.lr=0.5 vs hf learning_rate"),
        (dict(gradient_clipping=0.3), "ds gradient_clipping=0.3 vs hf max_grad_norm=1.0"),
        (dict(bf16={"enabled": True}), r"ds bf16.enabled=True vs hf bf16\|bf16_full_eval=False"),
        (dict(zero_optimization={"stage": 7}), "DeepSpeed refuses its config: .*stage.*input_value=7"),
        (dict(zero_optimization={"stage": 2, "bogus": 1}), "DeepSpeed refuses its config: .*bogus.*Extra inputs"),
        (
            dict(zero_optimization={"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/no/such"}}),
            r"zero_optimization.offload_optimizer.nvme_path '/no/such' is not a folder",
        ),
    ],
    ids=["micro", "accumulation", "train-batch", "lr", "clipping", "bf16", "stage-7", "unknown-zero-key", "nvme"],
)
def test_a_deepspeed_json_that_contradicts_the_config_is_refused(tmp_path, edits, message):
    with pytest.raises(SetupError, match=message):
        _dry(tmp_path, _deepspeed(tmp_path, **edits))


def test_an_optimizer_that_the_deepspeed_section_would_replace_is_refused(tmp_path):
    # the recipe's AdamW section would silently replace optim=sgd (what transformers does)
    with pytest.raises(SetupError, match=r"optim='sgd' is not what would run: .*type 'AdamW'"):
        _dry(tmp_path, _deepspeed(tmp_path), "training.optim=sgd")
    # without the section DeepSpeed wraps the Trainer's SGD; an AdamW optim beside an AdamW section agrees
    plain = {k: v for k, v in RECIPE.items() if k != "optimizer"}
    path = tmp_path / "no-optimizer.json"
    path.write_text(json.dumps(plain))
    assert "planned and valid" in "\n".join(_dry(tmp_path, f"training.deepspeed={path}", "training.optim=sgd"))
    assert "planned and valid" in "\n".join(_dry(tmp_path, _deepspeed(tmp_path), "training.optim=adamw_torch"))


def test_the_shipped_recipe_and_bf16_auto_pass_and_an_ignored_key_is_warned_about(tmp_path):
    text = "\n".join(_dry(tmp_path, _deepspeed(tmp_path, zero_optimizationx={})))
    assert "warning: " in text and "'zero_optimizationx' is not one DeepSpeed reads" in text
    assert "did you mean 'zero_optimization'?" in text
    # the launch's bf16 (the dry run itself plans in fp32) matches the recipe's bf16 "auto"
    bf16 = _deepspeed(tmp_path, bf16={"enabled": "auto"})
    assert "first 1 step(s) planned and valid" in "\n".join(_dry(tmp_path, bf16, "training.bf16=true"))
    # and a DeepSpeed bf16 the launch does not have is a contradiction of the launch's config
    with pytest.raises(SetupError, match="ds bf16.enabled=True vs hf"):
        _dry(tmp_path, _deepspeed(tmp_path, bf16={"enabled": True}), "training.bf16=false")


@pytest.mark.parametrize(
    "override, message",
    [
        ("training.ddp_timeout=0", "ddp_timeout 0 must be a positive number of seconds"),
        ("training.ddp_timeout=-5", "ddp_timeout -5 must be a positive number of seconds"),
        ("training.report_to=wandbb", "report_to 'wandbb' is not a reporting integration.*did you mean 'wandb'"),
        ("training.fsdp=full_shard", "fsdp together with deepspeed: choose one engine"),
    ],
)
def test_launch_settings_are_refused_by_name(tmp_path, override, message):
    with pytest.raises(SetupError, match=message):
        _dry(tmp_path, override)


def test_an_output_dir_that_is_a_file_or_under_one_is_refused(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(SetupError, match=f"output_dir '{afile}' is a file, not a folder"):
        dry_run(TINY, [f"training.output_dir={afile}"], world_size=2, steps=1)
    under = f"output_dir '{afile / 'run'}' cannot be created: '{afile}' on its path is a file, not a folder"
    with pytest.raises(SetupError, match=under):
        dry_run(TINY, [f"training.output_dir={afile / 'run'}"], world_size=2, steps=1)
    with pytest.raises(SetupError, match="output_dir is empty"):
        dry_run(TINY, ["training.output_dir=' '"], world_size=2, steps=1)


# ------------------------------------------------------------------ checkpoints of another engine or model
def _layout(folder: Path, engine: str) -> Path:
    folder.mkdir(parents=True)
    if engine in ("zero", "zero3"):
        (folder / "latest").write_text("global_step2")
        (folder / "global_step2").mkdir()
        name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if engine == "zero3" else "mp_rank_00_model_states.pt"
        (folder / "global_step2" / name).write_bytes(b"")
    elif engine == "fsdp2":
        (folder / "pytorch_model_fsdp_0").mkdir()
    else:
        (folder / "optimizer.pt").write_bytes(b"")
    return folder


@pytest.mark.parametrize("saved", ["zero", "zero3", "fsdp2", "plain"])
@pytest.mark.parametrize("running", ["zero", "zero3", "fsdp2", "plain"])
def test_a_checkpoint_resumes_only_under_its_own_engine(tmp_path, saved, running):
    ckpt = _layout(tmp_path / "checkpoint-2", saved)
    assert checkpoint_engine(ckpt) == saved
    if saved == running:
        check_checkpoint_fits(ckpt, running)
        return
    with pytest.raises(SetupError, match=f"checkpoint {ckpt} was saved under .*, and this run trains under"):
        check_checkpoint_fits(ckpt, running)


def test_the_run_engine_comes_from_sharding_and_the_zero_stage():
    assert run_engine("fsdp2", None) == "fsdp2"
    assert run_engine(None, {"zero_optimization": {"stage": 3}}) == "zero3"
    assert run_engine(None, {"zero_optimization": {"stage": 2}}) == "zero"
    assert run_engine(None, None) == "plain"


def test_a_checkpoint_of_another_model_is_named_by_the_field_that_differs(tmp_path):
    ckpt = _layout(tmp_path / "checkpoint-2", "plain")
    ours = tiny_config("llama")
    (ckpt / "config.json").write_text(json.dumps(dict(ours.to_dict(), hidden_size=ours.hidden_size * 2)))
    with pytest.raises(SetupError, match=rf"another model than this run's \(hidden_size {ours.hidden_size * 2} there"):
        check_checkpoint_fits(ckpt, "plain", ours)
    (ckpt / "config.json").write_text(json.dumps(ours.to_dict()))
    check_checkpoint_fits(ckpt, "plain", ours)


def test_the_dry_run_refuses_a_plain_checkpoint_under_deepspeed(tmp_path):
    """A real world-1 checkpoint without DeepSpeed (~5 s), resumed by the ZeRO-2 config."""
    out = tmp_path / "out"
    train_with_checkpoints(out, steps=2)
    with pytest.raises(SetupError, match="saved under no parameter sharding .* trains under DeepSpeed ZeRO-1/2"):
        _dry(tmp_path, "training.resume_from_checkpoint=latest")


# ------------------------------------------------------------------ one message, from one rank
def _hf_cp_train(tmp_path, *extra):
    cmd = [sys.executable, "-m", "hf_cp", "train", TINY, "--nproc", "2", *extra]
    cmd += ["--set", f"training.output_dir={tmp_path / 'out'}", "--set", "training.report_to=wandbb"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(ROOT), env=env)


def test_a_launch_refusal_is_one_message_before_any_process_starts(tmp_path):
    proc = _hf_cp_train(tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("hf-cp train: error: ") == 1 and "report_to 'wandbb'" in proc.stderr
    assert "Traceback" not in proc.stderr and "torch.distributed" not in proc.stderr, proc.stderr[-3000:]


def test_without_the_checks_rank_0_says_it_once_and_no_rank_prints_a_traceback(tmp_path):
    proc = _hf_cp_train(tmp_path, "--skip-checks")  # torchrun starts both ranks (~10 s)
    assert proc.returncode != 0
    assert proc.stderr.count("hf-cp train: error: ") == 1, proc.stderr[-3000:]
    assert "CPTrainer: report_to 'wandbb'" in proc.stderr
    # the only traceback is torchrun's own summary (its launcher process), none from a rank
    assert "hf_cp/train/" not in proc.stderr, proc.stderr[-3000:]
    # rank 0's status (the other rank may be stopped by torchrun first, under load)
    assert "exitcode  : 2" in proc.stderr
