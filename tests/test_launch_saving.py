"""`hf-cp train` ends with a model: the final model and the run's tokenizer are saved by default,
whatever save_strategy says about checkpoints, the summary says where, and they load back and
generate. The shipped configs save and show progress."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from helpers.harness.models import synthetic_rows
from helpers.tiny_tokenizer import tiny_chat_model, tiny_chat_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def write_run(tmp_path: Path, **training) -> Path:
    folder = tmp_path / "pretrained"
    tiny_chat_model(0).save_pretrained(folder)
    tiny_chat_tokenizer().save_pretrained(folder)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic_rows([60, 40, 90, 30])))
    cfg = {
        "model": {"pretrained": str(folder), "attn_implementation": "hf_cp"},
        "data": {"path": str(data)},
        "training": dict(
            output_dir=str(tmp_path / "out"),
            use_cpu=True,
            max_steps=1,
            save_strategy="no",  # no checkpoints: the final model is saved all the same
            report_to="none",
            cp_profile="cpu",
            cp_max_tokens_per_rank=256,
            cp_tokens_per_step=300,
            cp_compare_balancer=None,
            **training,
        ),
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_run_saves_its_final_model_and_tokenizer_and_says_where(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_cp.train.launch.entry import run

    assert run(str(write_run(tmp_path))) == 0
    out = capsys.readouterr().out
    final = tmp_path / "out" / "final"
    assert f"final model and tokenizer saved to {final}" in out, out[-2000:]
    model = AutoModelForCausalLM.from_pretrained(final, attn_implementation="sdpa")
    tok = AutoTokenizer.from_pretrained(final)
    assert tok.chat_template and len(tok) == model.config.vocab_size
    ids = tok("hello", return_tensors="pt")["input_ids"]
    generated = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    assert generated.shape[1] == ids.shape[1] + 3


def test_saving_the_final_model_can_be_turned_off(tmp_path, capsys):
    from hf_cp.train.launch.entry import run

    assert run(str(write_run(tmp_path, cp_save_final_model=False))) == 0
    assert "final model not saved (cp_save_final_model: false)" in capsys.readouterr().out
    assert not (tmp_path / "out" / "final").exists()


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_shipped_configs_save_their_model_and_show_progress(config, tmp_path):
    from hf_cp.train.launch.trainers import TRAINERS
    from hf_cp.train.setup.config import load_config, training_arguments

    cfg = load_config(str(ROOT / "configs" / config), [], TRAINERS)
    assert "disable_tqdm" not in cfg["training"], "training for minutes without a progress bar"
    t = dict(cfg["training"], bf16=False, use_cpu=True, output_dir=str(tmp_path))
    assert training_arguments(t, config, TRAINERS.config_class(cfg["trainer"])).cp_save_final_model


def test_the_shipped_chunkflow_config_trains_chunked_and_its_summary_says_so(tmp_path, capsys):
    # configs/tiny-cpu-chunkflow.yaml, the first steps on one process: long samples run as
    # dependent chunks (issue 17), and the end-of-run summary counts them
    from hf_cp.train.launch.entry import run

    overrides = [f"training.output_dir={tmp_path / 'out'}", "training.max_steps=4", "training.eval_strategy=no"]
    overrides.append("training.deepspeed=null")  # one process without a launcher
    assert run(str(ROOT / "configs" / "tiny-cpu-chunkflow.yaml"), overrides) == 0
    out = capsys.readouterr().out
    summary = out[out.index("==== hf_cp training summary") :]
    assert "balancer chunkflow" in summary
    line = next(x for x in summary.splitlines() if x.strip().startswith("ChunkFlow:"))
    assert "ran as" in line and "dependent chunks on one rank each" in line and "K=1" in line, line
    records = [json.loads(x) for x in (tmp_path / "out" / "cp_history" / "rank0.jsonl").read_text().splitlines()]
    assert sum(bool(r["chunked"]) for r in records) >= 1
