"""A training config's data section preprocesses raw rows itself (hf_cp/train/setup/data_section.py):
the same token ids as `hf-cp preprocess`, cached under output_dir and reused, the main process
first, and every key it cannot honour refused by name."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
from pathlib import Path

import pytest

from hf_cp.train.setup.config import load_config
from hf_cp.train.setup.data_section import (
    CACHE_FOLDER,
    DataPreparation,
    apply_template,
    in_config_words,
    load_datasets,
)
from hf_cp.train.setup.schema import TrainConfigError

REPO = Path(__file__).resolve().parent.parent
CHAT_SAMPLE = REPO / "hf_cp" / "data" / "chat_sample.jsonl"


def _rows(ds):
    return [(list(r["input_ids"]), list(r["labels"])) for r in ds]


def _cli_preprocess(tmp_path, tokenizer_dir, source, *flags):
    from hf_cp.cli import main

    out = tmp_path / "cli"
    assert main(["preprocess", str(source), "--tokenizer", str(tokenizer_dir), "--out", str(out), *flags]) == 0
    from datasets import load_from_disk

    return load_from_disk(str(out))


def test_raw_chat_rows_become_the_token_ids_hf_cp_preprocess_writes(tmp_path, smol_tokenizer, smol_tokenizer_dir):
    prep = DataPreparation("cp", smol_tokenizer, tmp_path / CACHE_FOLDER)
    train, evaluation = load_datasets(
        {"bundled": "chat_sample", "max_length": 1024, "overlong": "truncate"}, "run.yaml", prep
    )
    expected = _cli_preprocess(
        tmp_path, smol_tokenizer_dir, CHAT_SAMPLE, "--max-length", "1024", "--overlong", "truncate"
    )
    assert evaluation is None and len(train) == len(expected) == 33
    assert _rows(train) == _rows(expected)
    assert max(train["length"]) == 1024  # three samples were cut, as the CLI cuts them
    # the copy under output_dir holds the same rows
    (cached,) = (tmp_path / CACHE_FOLDER).iterdir()
    from datasets import load_from_disk

    assert _rows(load_from_disk(str(cached))) == _rows(expected)


def test_a_second_run_reads_the_cached_copy_and_a_changed_setting_or_file_makes_a_new_one(
    tmp_path, smol_tokenizer, monkeypatch
):
    import hf_cp.train.setup.data_section as section

    data = tmp_path / "chat.jsonl"
    lines = CHAT_SAMPLE.read_text().splitlines()[:6]
    data.write_text("\n".join(lines) + "\n")
    said = []
    prep = DataPreparation("cp", smol_tokenizer, tmp_path / CACHE_FOLDER, say=said.append)
    first, _ = load_datasets({"path": str(data)}, "run.yaml", prep)
    assert any("preprocessed with the run's tokenizer, saved to" in s for s in said)

    def no_preprocessing(*a, **k):
        raise AssertionError("preprocessed again")

    monkeypatch.setattr(section, "preprocess", no_preprocessing)
    said.clear()
    again, _ = load_datasets({"path": str(data)}, "run.yaml", prep)
    assert _rows(again) == _rows(first) and any("preprocessed earlier" in s for s in said)
    monkeypatch.undo()
    # a setting that changes the rows, the file's contents and the chat template each make a new copy
    load_datasets({"path": str(data), "mask": "none"}, "run.yaml", prep)
    assert len(list((tmp_path / CACHE_FOLDER).iterdir())) == 2
    rec = json.loads(lines[0])
    rec["messages"][-1]["content"] = "Something else entirely."
    data.write_text("\n".join([json.dumps(rec)] + lines[1:]) + "\n")
    changed, _ = load_datasets({"path": str(data)}, "run.yaml", prep)
    assert len(list((tmp_path / CACHE_FOLDER).iterdir())) == 3
    assert _rows(changed)[0] != _rows(first)[0] and _rows(changed)[1:] == _rows(first)[1:]


def test_a_template_file_is_the_tokenizer_s_chat_template_and_changes_the_tokens(tmp_path, smol_tokenizer):
    import copy

    tok = copy.deepcopy(smol_tokenizer)
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}{% endfor %}"
    )
    apply_template({"template": str(template)}, tok, "run.yaml")
    assert tok.chat_template == template.read_text()
    prep = DataPreparation("cp", tok, tmp_path / CACHE_FOLDER)
    train, _ = load_datasets({"bundled": "chat_sample", "limit": 2}, "run.yaml", prep)
    first = json.loads(CHAT_SAMPLE.read_text().splitlines()[0])["messages"]
    text = "".join(f"{m['role']}: {m['content']}\n" for m in first)
    assert train[0]["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    # the template has no generation prompt, so the assistant's turn is "assistant: ...\n", all of it trained
    prompt = len(tok(f"user: {first[0]['content']}\n", add_special_tokens=False)["input_ids"])
    assert train[0]["labels"] == [-100] * prompt + train[0]["input_ids"][prompt:]


def test_every_run_process_reads_the_main_process_s_copy(tmp_path, smol_tokenizer_dir):
    """Two gloo processes: the main one preprocesses while the other waits (here the barrier of
    TrainingArguments.main_process_first's shape); the other then reads the copy, preprocessing nothing."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_two_ranks, args=(port, str(smol_tokenizer_dir), str(tmp_path)), nprocs=2, start_method="spawn")
    said = {r: json.loads((tmp_path / f"said-{r}.json").read_text()) for r in (0, 1)}
    assert any("saved to" in s for s in said[0]) and not any("earlier" in s for s in said[0])
    assert any("preprocessed earlier" in s for s in said[1]) and not any("saved to" in s for s in said[1])
    assert said[0][-1] == said[1][-1]  # the same rows on both
    assert len(list((tmp_path / "out" / CACHE_FOLDER).iterdir())) == 1


def _two_ranks(rank, port, tokenizer_dir, root):
    import torch.distributed as dist
    from transformers import AutoTokenizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    @contextlib.contextmanager
    def main_first(desc):
        if rank != 0:
            dist.barrier()
        yield
        if rank == 0:
            dist.barrier()

    said = []
    prep = DataPreparation(
        "cp", AutoTokenizer.from_pretrained(tokenizer_dir), Path(root) / "out" / CACHE_FOLDER, main_first, True,
        said.append,
    )  # fmt: skip
    train, _ = load_datasets({"bundled": "chat_sample", "limit": 5}, "run.yaml", prep)
    said.append(json.dumps(_rows(train)))
    Path(root, f"said-{rank}.json").write_text(json.dumps(said))
    dist.destroy_process_group()


def test_a_copy_renamed_by_another_process_first_is_kept(tmp_path, smol_tokenizer):
    from datasets import Dataset, load_from_disk

    target = tmp_path / "train-abc"
    DataPreparation.save(Dataset.from_list([{"input_ids": [1, 2]}]), target)
    DataPreparation.save(Dataset.from_list([{"input_ids": [1, 2]}]), target)  # a second writer: dropped
    assert [p.name for p in tmp_path.iterdir()] == ["train-abc"]
    assert load_from_disk(str(target))[0]["input_ids"] == [1, 2]


def test_token_id_rows_are_used_as_they_are(tmp_path, smol_tokenizer):
    prep = DataPreparation("cp", smol_tokenizer, tmp_path / CACHE_FOLDER)
    train, _ = load_datasets({"bundled": "longtail_sample", "limit": 3}, "run.yaml", prep)
    assert len(train) == 3 and not (tmp_path / CACHE_FOLDER).exists()
    with pytest.raises(TrainConfigError, match=r"data\.max_length: the bundled longtail_sample is already token ids"):
        load_datasets({"bundled": "longtail_sample", "max_length": 100}, "run.yaml", prep)


def test_eval_split_is_drawn_from_the_preprocessed_rows(tmp_path, smol_tokenizer):
    prep = DataPreparation("cp", smol_tokenizer, None)
    train, evaluation = load_datasets(
        {"bundled": "chat_sample", "eval_split": 0.25, "max_length": 1024, "overlong": "drop"}, "run.yaml", prep
    )
    assert "input_ids" in evaluation.column_names and len(train) + len(evaluation) == 30  # 3 dropped


@pytest.mark.parametrize(
    "dcfg, message",
    [
        ({"bundled": "chat_sample", "format": "tokens"}, r"data\.format tokens, but the bundled chat_sample has no input_ids"),
        ({"bundled": "longtail_sample", "format": "chat"}, r"data\.format chat, but .* already holds token ids"),
        ({"bundled": "chat_sample", "format": "text"}, r"data: --text-field|data\.text_field 'text' is not a column"),
        ({"bundled": "chat_sample", "max_length": 100}, r"sample \d+ has \d+ tokens, more than data\.max_length 100.*data\.overlong: drop"),
        ({"bundled": "chat_sample", "format": "prompt-completion"}, r"data\.format prompt-completion, but .* reads as chat"),
        ({"path": "x", "name": "y"}, r"data\.path and data\.name both set"),
        ({}, r"data needs one of bundled: .*path: .*name:"),
    ],
)  # fmt: skip
def test_what_cannot_be_preprocessed_is_refused_naming_the_key(smol_tokenizer, dcfg, message):
    with pytest.raises(TrainConfigError, match=message):
        load_datasets(dcfg, "run.yaml", DataPreparation("cp", smol_tokenizer, None))


def test_raw_rows_without_a_tokenizer_and_media_columns_are_refused(tmp_path):
    with pytest.raises(TrainConfigError, match=r"raw rows .*need a tokenizer: give model\.tokenizer"):
        load_datasets({"bundled": "chat_sample"}, "run.yaml", DataPreparation("cp", None, None))
    data = tmp_path / "vlm.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "images": ["a.png"]}) + "\n")
    with pytest.raises(
        TrainConfigError, match=r"column\(s\) \['images'\] of images.*hf-cp preprocess DATA --processor"
    ):
        load_datasets({"path": str(data)}, "run.yaml", DataPreparation("cp", object(), None))


def test_template_errors_name_the_key(tmp_path, smol_tokenizer):
    with pytest.raises(TrainConfigError, match=r"data\.template nope\.jinja is no file"):
        apply_template({"template": "nope.jinja"}, smol_tokenizer, "run.yaml")
    flat = tmp_path / "flat.jinja"
    flat.write_text("just text")
    with pytest.raises(TrainConfigError, match=r"data\.template .*flat\.jinja holds no Jinja"):
        apply_template({"template": str(flat)}, smol_tokenizer, "run.yaml")
    with pytest.raises(TrainConfigError, match=r"data\.template .* this run has none: give model\.tokenizer"):
        apply_template({"template": str(flat)}, None, "run.yaml")


def _config(tmp_path, text):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize(
    "trainer, data, message",
    [
        ("dpo", "{bundled: toy_preferences, max_length: 512}", r"data\.max_length is hf_cp's preprocessing, for trainer: cp; trainer: dpo gives the rows to TRL"),
        ("sft", "{bundled: chat_sample, mask: assistant}", r"data\.mask is hf_cp's preprocessing, for trainer: cp; trainer: sft"),
        ("cp", "{bundled: chat_sample, overlong: drop}", r"data\.overlong 'drop' says what to do with samples over data\.max_length, which is not set"),
        ("cp", "{bundled: chat_sample, format: jsonl}", r"data\.format must be one of auto, tokens, chat"),
        ("cp", "{bundled: chat_sample, max_length: 0}", r"data\.max_length must be > 0"),
    ],
)  # fmt: skip
def test_the_config_refuses_what_its_trainer_cannot_honour_when_read(tmp_path, trainer, data, message):
    from hf_cp.train.launch.trainers import TRAINERS

    text = f"trainer: {trainer}\nmodel: {{config: tiny-llama}}\ndata: {data}\ntraining: {{use_cpu: true}}\n"
    with pytest.raises(TrainConfigError, match=message):
        load_config(_config(tmp_path, text), None, TRAINERS)


def test_a_trl_trainer_takes_the_raw_rows_as_read(smol_tokenizer):
    prep = DataPreparation("sft", smol_tokenizer, None)
    train, _ = load_datasets({"bundled": "chat_sample", "limit": 4}, "run.yaml", prep)
    assert train.column_names == ["messages"] and len(train) == 4


def test_pipeline_messages_name_the_config_keys():
    assert in_config_words("choose --overlong drop or raise --max-length") == (
        "choose data.overlong: drop or raise data.max_length"
    )


def test_the_shipped_smollm2_config_preprocesses_the_bundled_chat_itself():
    cfg = load_config(str(REPO / "configs" / "smollm2-cpu.yaml"))
    assert cfg["data"] == {"bundled": "chat_sample", "max_length": 1024, "overlong": "truncate"}
    assert os.path.exists(REPO / "hf_cp" / "data" / "chat_sample.jsonl")


@pytest.fixture
def model_folder(tmp_path, smol_tokenizer_dir):
    """SmolLM2's tokenizer and a small Llama config of its vocabulary: what a dry run reads (no weights)."""
    import shutil

    from transformers import LlamaConfig

    folder = tmp_path / "model"
    shutil.copytree(smol_tokenizer_dir, folder)
    LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    ).save_pretrained(str(folder))  # fmt: skip
    return folder


def test_the_dry_run_preprocesses_in_memory_and_the_launch_check_keeps_its_copy(tmp_path, model_folder, capsys):
    """`hf-cp train --dry-run` writes nothing; `hf-cp train --nproc`'s checks keep what they preprocessed
    for the launch."""
    from hf_cp.train.launch.dry_run import dry_run

    folder = model_folder
    out = tmp_path / "run"
    config = _config(
        tmp_path,
        f"model: {{pretrained: {folder}, attn_implementation: hf_cp}}\n"
        "data: {bundled: chat_sample, max_length: 1024, overlong: drop}\n"
        f"training: {{output_dir: {out}, use_cpu: true, max_steps: 2, cp_max_tokens_per_rank: 512, "
        "cp_tokens_per_step: 1024, report_to: none}\n",
    )
    lines = dry_run(config, world_size=2, steps=2)
    assert any("the bundled chat_sample preprocessed with the run's tokenizer" in line for line in lines)
    assert any("dropped 3" in line for line in lines) and not (out / CACHE_FOLDER).exists()
    capsys.readouterr()
    kept = dry_run(config, world_size=2, steps=1, keep_preprocessed=True)
    assert len(list((out / CACHE_FOLDER).iterdir())) == 1
    # the launch's preprocessing, said when it happens (the launch then reads the copy silently)
    assert "dropped 3" in capsys.readouterr().out and not any("preprocessed" in line for line in kept)


@pytest.mark.parametrize(
    "key, says",
    [
        ("chat_template", r"data\.chat_template is another trainer's setting: here it is data\.template"),
        ("sequence_len", r"data\.sequence_len is another trainer's setting: here it is data\.max_length"),
        ("dataset_name", r"data\.dataset_name is another trainer's setting: here it is data\.name"),
        ("train_on_inputs", r"data\.train_on_inputs .* data\.mask: none"),
    ],
)
def test_other_trainers_data_keys_get_their_hf_cp_key_in_one_line(tmp_path, key, says):
    text = f"model: {{config: tiny-llama}}\ndata: {{bundled: chat_sample, {key}: 1}}\ntraining: {{use_cpu: true}}\n"
    with pytest.raises(TrainConfigError, match=says) as err:
        load_config(_config(tmp_path, text))
    assert "valid keys" not in str(err.value)


@pytest.mark.parametrize("trainer, rows, refusal", [
    # DPO trains image pairs with the model's processor, which a config's tokenizer is not
    ("dpo", {"prompt": "Q?", "chosen": "a", "rejected": "b", "images": ["x.png"]},
     "CPDPOTrainer: pairs with images need the model's processor as processing_class, got none"),
    ("sft", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "images": ["x.png"]},
     "CPSFTTrainer: train_dataset has the column 'images'"),
])  # fmt: skip
def test_the_dry_run_refuses_trls_image_rows_as_the_trainer_does(tmp_path, model_folder, trainer, rows, refusal):
    from hf_cp.train.launch.dry_run import dry_run

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(rows) + "\n")
    config = _config(
        tmp_path,
        f"trainer: {trainer}\nmodel: {{pretrained: {model_folder}, attn_implementation: hf_cp}}\n"
        f"data: {{path: {data}}}\ntraining: {{output_dir: {tmp_path / 'run'}, use_cpu: true, report_to: none}}\n",
    )
    with pytest.raises(ValueError, match=f"trainer: {trainer}: " + re.escape(refusal)):
        dry_run(config, world_size=2)


def test_an_empty_saved_dataset_is_refused_for_training_and_evaluation(tmp_path):
    from datasets import Dataset

    empty = tmp_path / "empty"
    Dataset.from_dict({"input_ids": []}).save_to_disk(str(empty))
    # (datasets itself fails on such a folder with an IndexError: named, not a traceback)
    with pytest.raises(TrainConfigError, match=r"data\.path .*empty: datasets could not load .*holds rows"):
        load_datasets({"path": str(empty)}, "run.yaml")
    with pytest.raises(TrainConfigError, match=r"data\.eval_path .*empty: datasets could not load"):
        load_datasets({"bundled": "longtail_sample", "eval_path": str(empty)}, "run.yaml")


def test_a_hub_name_is_read_with_its_split_and_subset_and_a_failed_download_names_the_key(monkeypatch):
    import datasets
    from datasets import Dataset

    import hf_cp.train.setup.data_section as section

    asked = []

    def fake_load_input(name, split="train", subset=None):
        asked.append((name, split, subset))
        return Dataset.from_list([{"input_ids": [1, 2, 3]}])

    monkeypatch.setattr(section, "load_input", fake_load_input)
    train, _ = load_datasets({"name": "org/chat", "split": "validation", "subset": "en"}, "run.yaml")
    assert asked == [("org/chat", "validation", "en")] and len(train) == 1
    monkeypatch.undo()

    def offline(*a, **k):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(TrainConfigError, match=r"run\.yaml: data\.name: 'org/chat' is not a local file .*Hub failed"):
        load_datasets({"name": "org/chat"}, "run.yaml")


def test_a_saved_folder_of_splits_is_read_at_data_split(tmp_path):
    from datasets import Dataset, DatasetDict

    folder = tmp_path / "splits"
    DatasetDict(
        train=Dataset.from_list([{"input_ids": [1]}] * 3), test=Dataset.from_list([{"input_ids": [2]}] * 2)
    ).save_to_disk(str(folder))
    assert len(load_datasets({"path": str(folder)}, "run.yaml")[0]) == 3
    assert load_datasets({"path": str(folder), "split": "test"}, "run.yaml")[0]["input_ids"] == [[2], [2]]
    with pytest.raises(TrainConfigError, match=r"has no split 'dev' \(splits: \['test', 'train'\]\)"):
        load_datasets({"path": str(folder), "split": "dev"}, "run.yaml")


@pytest.mark.parametrize(
    "rows, dcfg, flags",
    [
        ([{"body": "plain text one"}, {"body": "and two"}], {"text_field": "body", "add_eos": False},
         ["--text-field", "body", "--no-eos"]),
        ([{"q": "Say hi.", "a": " Hi!"}, {"q": "Count.", "a": " 1 2 3"}],
         {"prompt_field": "q", "completion_field": "a", "num_proc": 2}, ["--prompt-field", "q", "--completion-field", "a"]),
    ],
)  # fmt: skip
def test_field_eos_and_process_keys_give_what_the_cli_flags_give(
    tmp_path, smol_tokenizer, smol_tokenizer_dir, rows, dcfg, flags
):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, _ = load_datasets(dict(dcfg, path=str(data)), "run.yaml", DataPreparation("cp", smol_tokenizer, None))
    assert _rows(train) == _rows(_cli_preprocess(tmp_path, smol_tokenizer_dir, data, *flags))
    if dcfg.get("add_eos") is False:  # the key changes the rows: with the EOS each sample is one token longer
        with_eos, _ = load_datasets({"path": str(data), "text_field": "body"}, "run.yaml",
                                    DataPreparation("cp", smol_tokenizer, None))  # fmt: skip
        assert [len(r) for r, _ in _rows(with_eos)] == [len(r) + 1 for r, _ in _rows(train)]
