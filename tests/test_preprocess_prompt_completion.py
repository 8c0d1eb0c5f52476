"""hf-cp preprocess takes TRL's prompt-completion data (text or conversational) and tokenises it
as TRL's SFTTrainer does, so the two routes train the same tokens; and the length report prices
the data with the model the tokenizer belongs to."""

from __future__ import annotations

import json

import pytest

from hf_cp.cli import main
from hf_cp.data_prep import preprocess
from hf_cp.data_prep.encode import IGNORE_INDEX

from helpers.tiny_tokenizer import tiny_chat_model, tiny_chat_tokenizer

TEXT_ROWS = [
    {"prompt": "Question: what is 2+2?\nAnswer:", "completion": " 4"},
    {"prompt": "Translate to French: cat", "completion": " chat"},
    {"prompt": "Say hi", "completion": " hi<|endoftext|>"},  # already ends in EOS: not added twice
]
CHAT_ROWS = [
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
        "completion": [{"role": "assistant", "content": "4"}],
    },
    {
        "prompt": [{"role": "user", "content": "Name a colour."}],
        "completion": [{"role": "assistant", "content": "Red"}],
    },
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trl_prepared(rows, tmp_path):
    """What TRL's SFTTrainer makes of `rows` (its own preparation, nothing of hf_cp's)."""
    trl = pytest.importorskip("trl")  # the optional `trl` extra
    from datasets import Dataset

    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none", max_length=None)
    model = tiny_chat_model(0, attn="sdpa")
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tiny_chat_tokenizer()
    )
    return trainer.train_dataset


@pytest.mark.parametrize("rows", [TEXT_ROWS, CHAT_ROWS], ids=["text", "conversational"])
def test_prompt_completion_is_tokenised_as_trl_does(tmp_path, rows):
    tok = tiny_chat_tokenizer()
    res = preprocess(str(write_jsonl(tmp_path / "pc.jsonl", rows)), tok, tmp_path / "out")
    assert res.kind == "prompt-completion" and len(res.dataset) == len(rows)
    ours = res.dataset
    theirs = trl_prepared(rows, tmp_path)
    assert ours["input_ids"] == theirs["input_ids"]
    assert ours["labels"] == theirs["labels"]
    for row, raw in zip(ours, rows):  # the completion alone is trained
        trained = [t for t, y in zip(row["input_ids"], row["labels"]) if y != IGNORE_INDEX]
        completion = raw["completion"] if isinstance(raw["completion"], str) else raw["completion"][0]["content"]
        assert completion.replace("<|endoftext|>", "") in tok.decode(trained)
        assert row["labels"][0] == IGNORE_INDEX


def test_prompt_completion_from_the_command_line(tmp_path, capsys):
    tok_dir = tmp_path / "tok"
    tiny_chat_tokenizer().save_pretrained(tok_dir)
    src = write_jsonl(tmp_path / "pc.jsonl", TEXT_ROWS)
    assert (
        main(["preprocess", str(src), "--tokenizer", str(tok_dir), "--out", str(tmp_path / "o"), "--mask", "none"]) == 0
    )
    from datasets import load_from_disk

    ds = load_from_disk(str(tmp_path / "o"))
    assert ds["labels"] == ds["input_ids"], "--mask none trains every token"
    assert "3 input samples (prompt-completion), 3 kept" in capsys.readouterr().out
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "only a prompt"}])
    assert main(["preprocess", str(bad), "--tokenizer", str(tok_dir), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "need both a 'prompt' and a 'completion' column; 'completion' is missing" in err
    assert "GRPO data: give them raw to hf_cp.train.objectives.grpo.CPGRPOTrainer" in err, "which trainer prompts feed"
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}])
    assert main(["preprocess", str(pairs), "--tokenizer", str(tok_dir), "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "preference pairs" in err and "CPDPOTrainer" in err and "--group-answers" in err


def test_the_length_report_prices_the_tokenizer_s_model(tmp_path, capsys):
    """A tokenizer inside a model folder: the report uses that model's dimensions, not a 7B
    default; without a model config it says it fell back, and --model still wins."""
    folder = tmp_path / "model"
    tiny_chat_model(0).save_pretrained(folder)
    tiny_chat_tokenizer().save_pretrained(folder)
    src = write_jsonl(tmp_path / "pc.jsonl", TEXT_ROWS)
    assert main(["preprocess", str(src), "--tokenizer", str(folder), "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert f"cost shares predicted for {folder / 'config.json'} (the tokenizer's model)" in out
    assert "predicted for qwen2.5-7b" not in out
    tok_only = tmp_path / "tok"
    tiny_chat_tokenizer().save_pretrained(tok_only)
    assert main(["preprocess", str(src), "--tokenizer", str(tok_only), "--out", str(tmp_path / "b")]) == 0
    assert "qwen2.5-7b (no model config beside the tokenizer; pass --model" in capsys.readouterr().out
    args = ["preprocess", str(src), "--tokenizer", str(folder), "--out", str(tmp_path / "c"), "--model", "llama-3-8b"]
    assert main(args) == 0
    assert "cost shares predicted for llama-3-8b on" in capsys.readouterr().out
