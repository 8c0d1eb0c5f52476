"""The main job: config loading errors (fast) and the README command end to end (slow)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_cp.train.setup.config import TrainConfigError, load_config

from helpers.harness.job import run_recipe

ROOT = Path(__file__).resolve().parent.parent


def test_config_errors_name_file_and_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {config: tiny-llama}\noptimizer: {}\n")
    with pytest.raises(TrainConfigError, match=r"bad.yaml: unknown section\(s\) \['optimizer'\]"):
        load_config(str(bad))
    with pytest.raises(TrainConfigError, match="expected section.key=value"):
        load_config(str(ROOT / "configs/tiny-cpu.yaml"), ["max_steps=3"])
    cfg = load_config(
        str(ROOT / "configs/tiny-cpu.yaml"),
        [
            "training.max_steps=3",
            "training.cp_balancer=static",
            "training.eval_strategy=no",
            "training.save_strategy=no",
        ],
    )
    assert cfg["training"]["max_steps"] == 3 and cfg["training"]["cp_balancer"] == "static"
    from hf_cp.train.setup.config import training_arguments

    args = training_arguments(
        dict(cfg["training"], output_dir=str(tmp_path), use_cpu=True, deepspeed=None), "tiny-cpu.yaml"
    )  # YAML's `no` is False: still the strategy "no"
    assert str(args.eval_strategy.value) == "no" and str(args.save_strategy.value) == "no"


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_every_shipped_config_builds_its_training_arguments(config, tmp_path):
    # a setting transformers renamed or dropped (warmup_ratio in v5) must fail here, not on a
    # GPU node; GPU configs are built for the CPU (bf16 needs a GPU to validate)
    from hf_cp.train.launch.trainers import TRAINERS
    from hf_cp.train.setup.config import training_arguments

    cfg = load_config(
        str(ROOT / "configs" / config),
        ["training.bf16=false", "training.use_cpu=true", f"training.output_dir={tmp_path}"],
        TRAINERS,
    )
    args = training_arguments(dict(cfg["training"]), config, TRAINERS.config_class(cfg["trainer"]))
    assert args.cp_balancer and type(args).__name__ == TRAINERS.config_class(cfg["trainer"]).__name__
    if cfg["trainer"] == "cp":
        assert args.per_device_train_batch_size == 1


def test_eval_data_from_a_held_out_split_or_a_file(tmp_path):
    from hf_cp.train.setup.config import load_datasets

    train, held = load_datasets({"bundled": "longtail_sample", "eval_split": 0.05}, "cfg.yaml")
    assert (len(train), len(held)) == (228, 12)
    ids = {tuple(r) for r in train["input_ids"]}
    assert not any(tuple(r) in ids for r in held["input_ids"]), "held-out samples are not trained on"
    f = tmp_path / "eval.jsonl"
    f.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [4, 5]}\n')
    train, ev = load_datasets({"bundled": "longtail_sample", "eval_path": str(f)}, "cfg.yaml")
    assert len(train) == 240 and ev["input_ids"] == [[1, 2, 3], [4, 5]]
    (tmp_path / "x.csv").write_text("input_ids\n")  # a header and no rows: datasets reads nothing
    for bad, message in [
        ({"eval_split": 1.5}, "data.eval_split must be a fraction"),
        ({"eval_split": 0.1, "eval_path": str(f)}, "data.eval_path and data.eval_split both set"),
        ({"eval_path": str(tmp_path / "x.csv")}, "data.eval_path: .*x.csv: could not read it as csv"),
        ({"eval_path": str(tmp_path / "y.jsonl")}, "data.eval_path .*y.jsonl does not exist"),
    ]:
        with pytest.raises(TrainConfigError, match=f"cfg.yaml: {message}"):
            load_datasets(dict({"bundled": "longtail_sample"}, **bad), "cfg.yaml")


def test_bundled_dataset_is_long_tailed_and_byte_level():
    from hf_cp.data import load_sample_dataset

    ds = load_sample_dataset()
    lengths = sorted(ds["length"])
    assert len(lengths) == 240
    assert lengths[-1] > 4096 > 10 * lengths[len(lengths) // 2]  # a long tail over a short median
    row = ds[0]
    assert max(row["input_ids"]) < 256 and len(row["labels"]) == row["length"]
    assert row["labels"][0] == -100 and row["labels"][-1] == row["input_ids"][-1]  # prompt masked


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_readme_main_job_trains_and_reports(tmp_path):
    out = tmp_path / "tiny-cpu"
    t0 = time.perf_counter()
    proc = run_recipe("configs/tiny-cpu.yaml", out, timeout=400)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-6000:]
    text = proc.stdout
    assert "hf_cp training summary" in text and "2 process(es)" in text
    m = re.search(r"loss: first \d+ step\(s\) ([\d.]+) -> last \d+ step\(s\) ([\d.]+) \(down\)", text)
    assert m and float(m.group(2)) < float(m.group(1)) - 0.5, text
    assert re.search(r"balance \(auto\): per-rank compute max/mean predicted [\d.]+, measured [\d.]+", text)
    assert re.search(r"static would take [\d.]+ ms", text)
    evals = [
        float(x) for x in re.findall(r"([\d.]+) at step \d+", text.split("eval loss (12 samples):")[1].splitlines()[0])
    ]
    assert len(evals) >= 3 and evals[-1] < evals[0] - 0.5, text  # held-out loss falls too
    assert (out / "cp_history" / "rank1.jsonl").exists()
    print(f"main job wall time {wall:.0f} s")


# slow (~18 s, a launcher job of its own): a refusal at a rank's set-up, said once by rank 0
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_rank_refusal_at_set_up_is_said_once(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    cmd = [
        sys.executable,
        "-c",
        "import sys; from hf_cp.cli import main; sys.exit(main())",
        "train",
        "configs/tiny-cpu.yaml",
        "--nproc",
        "2",
        "--skip-checks",  # past the launcher's own checks: the ranks meet the refusal
        "--set",
        f"training.output_dir={tmp_path / 'out'}",
        "--set",
        f"training.resume_from_checkpoint={missing}",
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=220,
        env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"),
    )
    assert proc.returncode != 0
    said = f"resume_from_checkpoint '{missing}' is not a checkpoint folder"
    assert proc.stderr.count(said) == 1 and proc.stderr.count("hf-cp train: error: ") == 1, proc.stderr[-3000:]
    assert "hf_cp/train/" not in proc.stderr  # no rank's traceback


def test_one_process_with_deepspeed_needs_no_launcher_and_no_mpi(tmp_path):
    """`hf-cp train CONFIG` in one process with the main job's DeepSpeed config (before:
    ModuleNotFoundError: mpi4py, DeepSpeed's MPI discovery); 2 steps, ~20 s."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "hf_cp", "train", "configs/tiny-cpu.yaml"]
    for o in ("max_steps=2", f"output_dir={tmp_path / 'out'}", "save_strategy=no", "cp_save_final_model=false"):
        cmd += ["--set", f"training.{o}"]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(env, PYTHONWARNINGS="ignore")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hf_cp training summary: tiny-cpu.yaml, 1 process(es)" in proc.stdout


def _custom_code_model(folder: Path) -> None:
    """A model folder whose config names Python shipped in the folder (auto_map), as Hub repos
    with custom architectures do: a Llama under another model_type."""
    from helpers.harness.models import tiny_model

    tiny_model().save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(
        model_type="hfcp_custom_llama",
        architectures=["CustomLlamaForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_custom.CustomLlamaConfig",
            "AutoModelForCausalLM": "modeling_custom.CustomLlamaForCausalLM",
        },
    )
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "configuration_custom.py").write_text(
        "from transformers import LlamaConfig\n\n\n"
        "class CustomLlamaConfig(LlamaConfig):\n    model_type = 'hfcp_custom_llama'\n"
    )
    (folder / "modeling_custom.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_custom import CustomLlamaConfig\n\n\n"
        "class CustomLlamaForCausalLM(LlamaForCausalLM):\n    config_class = CustomLlamaConfig\n"
    )


def test_remote_code_runs_only_when_the_config_trusts_it(tmp_path):
    from hf_cp.train.setup.config import build_model, model_config

    folder = tmp_path / "custom"
    _custom_code_model(folder)
    with pytest.raises(ValueError, match="trust_remote_code"):  # transformers refuses; nothing ran
        model_config({"pretrained": str(folder)}, "cfg.yaml")
    with pytest.raises(TrainConfigError, match="model.trust_remote_code must be true or false"):
        model_config({"pretrained": str(folder), "trust_remote_code": "yes"}, "cfg.yaml")
    model = build_model(
        {"pretrained": str(folder), "trust_remote_code": True, "attn_implementation": "sdpa"}, "cfg.yaml"
    )
    assert type(model).__name__ == "CustomLlamaForCausalLM"


# slow (~40 s, a launch of its own): a scheduler's SIGTERM to `hf-cp train --nproc 2`
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sigterm_to_the_launcher_stops_cleanly_with_a_checkpoint_and_rc_0(tmp_path):
    """With enable_jit_checkpoint the workers finish the step, save and exit; the launcher
    then ends with rc 0 (before: rc 1 and torchrun's SignalException traceback after the save)."""
    import signal

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "hf_cp", "train", "configs/tiny-cpu.yaml", "--nproc", "2"]
    for o in (
        "enable_jit_checkpoint=true",
        "num_train_epochs=30",
        f"output_dir={out}",
        "save_strategy=no",
        "eval_strategy=no",
    ):
        cmd += ["--set", f"training.{o}"]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    history = out / "cp_history" / "rank0.jsonl"
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline and (not history.exists() or len(history.read_text().splitlines()) < 2):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=200)
    assert proc.returncode == 0, stderr[-3000:]
    assert "stopped early by SIGTERM" in stdout, stdout[-2000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert list(out.glob("checkpoint-*")), "the stop saves a checkpoint"
