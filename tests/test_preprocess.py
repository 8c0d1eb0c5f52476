"""hf-cp preprocess: chat/text encoding and SFT masks with the SmolLM2 tokenizer, every input
format, every over-long policy, the length report, and what the planner and trainer read."""

import json
from pathlib import Path

import pytest

from hf_cp.cli import main
from hf_cp.data_prep import length_report, preprocess
from hf_cp.data_prep.encode import IGNORE_INDEX, SampleEncoder

CHAT_SAMPLE = Path(__file__).resolve().parent.parent / "hf_cp" / "data" / "chat_sample.jsonl"


@pytest.fixture(scope="session")
def chat_records():
    return [json.loads(line) for line in CHAT_SAMPLE.read_text().splitlines() if line.strip()]


def cli(capsys, *args):
    rc = main(["preprocess", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def load(path):
    from datasets import load_from_disk

    return load_from_disk(str(path))


def trained_text(tokenizer, ids, labels):
    """The decoded runs of consecutive trained tokens."""
    runs, cur = [], []
    for t, y in zip(ids, labels):
        if y == IGNORE_INDEX:
            if cur:
                runs.append(tokenizer.decode(cur))
                cur = []
        else:
            assert y == t, "a trained label must equal its input token (labels are not shifted)"
            cur.append(t)
    if cur:
        runs.append(tokenizer.decode(cur))
    return runs


# ----------------------------------------------------------------------------- the acceptance test
def test_bundled_chat_file_round_trips_and_masks_prompts(
    capsys, tmp_path, smol_tokenizer, smol_tokenizer_dir, chat_records
):
    out = tmp_path / "chat"
    rc, stdout, err = cli(capsys, CHAT_SAMPLE, "--tokenizer", smol_tokenizer_dir, "--out", out)
    assert rc == 0, err
    ds = load(out)
    assert ds.column_names == ["input_ids", "labels", "length"]
    assert len(ds) == len(chat_records) >= 24
    lengths = ds["length"]
    assert max(lengths) > 1500 and min(lengths) < 100  # varied, some long
    n_assistant_tokens = 0
    for i, (row, rec) in enumerate(zip(ds, chat_records)):
        msgs = rec["messages"]
        rendered = smol_tokenizer.apply_chat_template(msgs, tokenize=False)
        assert smol_tokenizer.decode(row["input_ids"]) == rendered, f"sample {i} does not round-trip"
        assert len(row["labels"]) == len(row["input_ids"]) == row["length"]
        # trained tokens are exactly the assistant turns, each with its end-of-turn marker
        want = [m["content"] + "<|im_end|>\n" for m in msgs if m["role"] == "assistant"]
        assert trained_text(smol_tokenizer, row["input_ids"], row["labels"]) == want, f"sample {i}"
        # every system and user content is masked
        masked = smol_tokenizer.decode([t for t, y in zip(row["input_ids"], row["labels"]) if y == IGNORE_INDEX])
        for m in msgs:
            if m["role"] != "assistant":
                assert m["content"] in masked
        n_assistant_tokens += sum(y != IGNORE_INDEX for y in row["labels"])
    assert 0 < n_assistant_tokens < sum(lengths)
    assert f"{len(chat_records)} input samples (chat), {len(chat_records)} kept" in stdout
    assert "no --max-length given" in stdout
    assert "length report:" in stdout and "p50" in stdout and "attn%" in stdout


def test_plan_reads_the_preprocessed_folder(capsys, tmp_path, smol_tokenizer_dir):
    out = tmp_path / "chat"
    assert cli(capsys, CHAT_SAMPLE, "--tokenizer", smol_tokenizer_dir, "--out", out)[0] == 0
    rc = main(
        [
            "plan",
            "--lengths",
            str(out),
            "--world",
            "4",
            "--max-tokens-per-rank",
            "2048",
            "--steps",
            "2",
            "--tokens-per-step",
            "4096",
        ]
    )
    o = capsys.readouterr()
    assert rc == 0, o.err
    n = len(load(out))
    assert f"({n} samples, longest {max(load(out)['length'])})" in o.out


def test_trainer_reads_the_output_with_the_same_label_convention(tmp_path, smol_tokenizer):
    """The trainer's loader and collator take our columns as they are: its shifted targets are
    our labels moved by one token, inside each document."""
    from hf_cp.train.data.collator import shifted_targets, valid_targets
    from hf_cp.train.setup.config import load_datasets

    res = preprocess(str(CHAT_SAMPLE), smol_tokenizer, tmp_path / "chat", limit=5)
    ds, _ = load_datasets({"path": str(tmp_path / "chat")}, "test")
    assert len(ds) == 5 and {"input_ids", "labels", "length"} <= set(ds.column_names)
    total = 0
    for row in ds:
        x, y = row["input_ids"], row["labels"]
        t = shifted_targets(x, y)
        assert list(t[:-1]) == list(y[1:]) and t[-1] == IGNORE_INDEX
        total += valid_targets(x, y)
    assert total == res.trained_tokens > 0


def test_the_output_says_its_rows_are_documents_so_chat_eos_is_no_packing_alarm(tmp_path, smol_tokenizer):
    """A chat's turns end with EOS inside its row: before, every row of preprocess's own output
    was warned about as looking packed. The output now says its rows are documents; the same
    rows without that word still get the warning."""
    from datasets import Dataset

    from hf_cp.train.data.columns import check_interior_eos, eos_token_ids
    from hf_cp.train.setup.config import load_datasets

    preprocess(str(CHAT_SAMPLE), smol_tokenizer, tmp_path / "chat", limit=20)
    ds, _ = load_datasets({"path": str(tmp_path / "chat")}, "test")
    eos = eos_token_ids(smol_tokenizer)
    rows = list(range(len(ds)))
    assert check_interior_eos(ds, rows, eos, "train_dataset") is None
    plain = Dataset.from_dict({"input_ids": ds["input_ids"]})  # the same rows, no word about them
    warning = check_interior_eos(plain, rows, eos, "train_dataset")
    assert warning and "rows hold the EOS token" in warning


# ----------------------------------------------------------------------------- over-long policies
@pytest.fixture(scope="session")
def full_lengths(smol_tokenizer, tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    res = preprocess(str(CHAT_SAMPLE), smol_tokenizer, d)
    return res.dataset["length"], res.dataset


def test_overlong_error_names_sample_and_length(capsys, tmp_path, smol_tokenizer_dir, full_lengths):
    lengths, _ = full_lengths
    over = [i for i, n in enumerate(lengths) if n > 1024]
    assert len(over) >= 2
    rc, _, err = cli(
        capsys, CHAT_SAMPLE, "--tokenizer", smol_tokenizer_dir, "--out", tmp_path / "x", "--max-length", 1024
    )
    assert rc == 2
    assert f"sample {over[0]} has {lengths[over[0]]} tokens, more than --max-length 1024" in err
    assert f"({len(over) - 1} more: sample {over[1]} has {lengths[over[1]]}" in err
    assert not (tmp_path / "x").exists()


def test_overlong_drop(capsys, tmp_path, smol_tokenizer_dir, full_lengths):
    lengths, full = full_lengths
    keep = [i for i, n in enumerate(lengths) if n <= 1024]
    rc, out, err = cli(
        capsys,
        CHAT_SAMPLE,
        "--tokenizer",
        smol_tokenizer_dir,
        "--out",
        tmp_path / "d",
        "--max-length",
        1024,
        "--overlong",
        "drop",
    )
    assert rc == 0, err
    n_over = len(lengths) - len(keep)
    assert f"over-long (> --max-length 1024): {n_over} samples, policy drop: dropped {n_over}" in out
    ds = load(tmp_path / "d")
    assert ds["length"] == [lengths[i] for i in keep]
    assert ds["input_ids"] == [full[i]["input_ids"] for i in keep]


def test_overlong_truncate(capsys, tmp_path, smol_tokenizer_dir, full_lengths):
    lengths, full = full_lengths
    n_over = sum(n > 1024 for n in lengths)
    rc, out, err = cli(
        capsys,
        CHAT_SAMPLE,
        "--tokenizer",
        smol_tokenizer_dir,
        "--out",
        tmp_path / "t",
        "--max-length",
        1024,
        "--overlong",
        "truncate",
    )
    assert rc == 0, err
    assert f"over-long (> --max-length 1024): {n_over} samples, policy truncate: truncated {n_over}" in out
    ds = load(tmp_path / "t")
    assert ds["length"] == [min(n, 1024) for n in lengths]
    for row, ref in zip(ds, full):
        n = row["length"]
        assert row["input_ids"] == ref["input_ids"][:n] and row["labels"] == ref["labels"][:n]


def test_no_overlong_sample_reports_zero(capsys, tmp_path, smol_tokenizer_dir, full_lengths):
    lengths, _ = full_lengths
    rc, out, err = cli(
        capsys,
        CHAT_SAMPLE,
        "--tokenizer",
        smol_tokenizer_dir,
        "--out",
        tmp_path / "z",
        "--max-length",
        max(lengths),
        "--overlong",
        "error",
    )
    assert rc == 0, err
    assert f"over-long (> --max-length {max(lengths)}): 0 samples, policy error" in out


# ----------------------------------------------------------------------------- input formats
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Short.",
    "A somewhat longer line of text, with punctuation; numbers like 42 and 3.14; and unicode: café, naïve.",
]
CHATS = [
    [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
    ],
]


def write_format(fmt, rows, path):
    import pandas as pd
    from datasets import Dataset, DatasetDict

    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        Dataset.from_list(rows).to_parquet(str(path))
    elif fmt == "csv":  # CSV has no nested values: messages go in as a JSON string
        pd.DataFrame([{k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()} for r in rows]).to_csv(
            path, index=False
        )
    elif fmt == "saved":
        Dataset.from_list(rows).save_to_disk(str(path))
    elif fmt == "saved-dict":
        DatasetDict({"train": Dataset.from_list(rows[:1]), "validation": Dataset.from_list(rows)}).save_to_disk(
            str(path)
        )
    return path


FORMATS = [
    ("jsonl", "data.jsonl"),
    ("json", "data.json"),
    ("parquet", "data.parquet"),
    ("csv", "data.csv"),
    ("saved", "saved"),
    ("saved-dict", "saved_dict"),
]


@pytest.mark.parametrize("fmt,name", FORMATS)
def test_every_input_format_text_and_chat(capsys, tmp_path, fmt, name, smol_tokenizer, smol_tokenizer_dir):
    text_rows = [{"body": t, "id": i} for i, t in enumerate(TEXTS)]
    chat_rows = [{"messages": m} for m in CHATS]
    split = ["--split", "validation"] if fmt == "saved-dict" else []
    eos = smol_tokenizer.eos_token_id
    src = write_format(fmt, text_rows, tmp_path / f"text_{name}")
    rc, out, err = cli(
        capsys, src, "--tokenizer", smol_tokenizer_dir, "--out", tmp_path / "o_text", "--text-field", "body", *split
    )
    assert rc == 0, err
    ds = load(tmp_path / "o_text")
    assert ds["input_ids"] == [smol_tokenizer(t)["input_ids"] + [eos] for t in TEXTS]
    assert ds["labels"] == ds["input_ids"]  # text: every token trained
    assert f"{len(TEXTS)} input samples (text)" in out

    src = write_format(fmt, chat_rows, tmp_path / f"chat_{name}")
    rc, out, err = cli(capsys, src, "--tokenizer", smol_tokenizer_dir, "--out", tmp_path / "o_chat", *split)
    assert rc == 0, err
    ds = load(tmp_path / "o_chat")
    assert [smol_tokenizer.decode(x) for x in ds["input_ids"]] == [
        smol_tokenizer.apply_chat_template(m, tokenize=False) for m in CHATS
    ]
    assert [trained_text(smol_tokenizer, r["input_ids"], r["labels"]) for r in ds] == [
        ["Hi!<|im_end|>\n"],
        ["4<|im_end|>\n", "6<|im_end|>\n"],
    ]


def test_hub_name_without_network_is_a_clear_error(capsys, tmp_path, smol_tokenizer_dir, monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    # both libraries read the offline switch at import time
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    rc, _, err = cli(
        capsys, "no-such-user/no-such-dataset-xyz", "--tokenizer", smol_tokenizer_dir, "--out", tmp_path / "o"
    )
    assert rc == 2
    assert "'no-such-user/no-such-dataset-xyz' is not a local file or folder" in err and "Hub" in err


# ----------------------------------------------------------------------------- masks, num_proc, errors
def test_mask_variants(smol_tokenizer):
    conv = CHATS[1]
    rows = {}
    for mask in ("assistant", "last-assistant", "none"):
        enc = SampleEncoder(smol_tokenizer, "chat", "messages", mask=mask)
        out = enc({"messages": [conv]}, [0])
        rows[mask] = (out["input_ids"][0], out["labels"][0])
    ids = rows["none"][0]
    assert rows["assistant"][0] == rows["last-assistant"][0] == ids
    assert rows["none"][1] == ids
    assert trained_text(smol_tokenizer, *rows["assistant"]) == ["4<|im_end|>\n", "6<|im_end|>\n"]
    assert trained_text(smol_tokenizer, *rows["last-assistant"]) == ["6<|im_end|>\n"]
    with pytest.raises(ValueError, match="does not apply to text samples"):
        SampleEncoder(smol_tokenizer, "text", "text", mask="assistant")


def test_chat_template_failure_names_the_sample(smol_tokenizer_dir):
    from transformers import AutoTokenizer

    from hf_cp.data_prep.encode import EncodeError

    tok = AutoTokenizer.from_pretrained(str(smol_tokenizer_dir))
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
        "{% endif %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    )
    enc = SampleEncoder(tok, "chat", "messages")
    out = enc({"messages": [CHATS[0]]}, [0])
    assert tok.decode(out["input_ids"][0]) == "user: Say hi.\nassistant: Hi!\n"
    assert trained_text(tok, out["input_ids"][0], out["labels"][0]) == ["assistant: Hi!\n"]
    with pytest.raises(EncodeError, match="sample 7: the chat template failed: .*no system role"):
        enc({"messages": [CHATS[1]]}, [7])


@pytest.mark.parametrize(
    "message, error",
    [
        ({"role": "assistant", "content": "  "}, r"sample 4: messages\[1\] \(assistant\) has empty content"),
        ({"role": "user", "content": ""}, r"sample 4: messages\[1\] \(user\) has empty content"),
        ({"role": "assistent", "content": "Hi"}, r"sample 4: messages\[1\] has role 'assistent'; chat templates know"),
    ],
)
def test_empty_content_and_unknown_roles_are_refused_naming_the_sample(smol_tokenizer, message, error):
    from hf_cp.data_prep.encode import EncodeError

    enc = SampleEncoder(smol_tokenizer, "chat", "messages")
    with pytest.raises(EncodeError, match=error):
        enc({"messages": [[{"role": "user", "content": "Say hi."}, message]]}, [4])


def test_num_proc_gives_the_same_dataset(tmp_path, smol_tokenizer):
    one = preprocess(str(CHAT_SAMPLE), smol_tokenizer, None, max_length=512, overlong="truncate")
    two = preprocess(str(CHAT_SAMPLE), smol_tokenizer, None, max_length=512, overlong="truncate", num_proc=2)
    assert one.truncated == two.truncated > 0
    assert one.dataset["input_ids"] == two.dataset["input_ids"]
    assert one.dataset["labels"] == two.dataset["labels"]


@pytest.mark.parametrize(
    "rows, args, message",
    [
        (
            [
                {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
                {"messages": [{"role": "user"}]},
            ],
            [],
            "sample 1: messages[0] must have 'role' and 'content'",
        ),
        ([{"messages": "[not json"}], [], "sample 0: field 'messages' is a string but not JSON"),
        (
            [{"messages": [{"role": "assistant", "content": "I speak first"}]}],
            [],
            "sample 0: message 0 is an assistant",
        ),
        (
            [{"prompt": "a", "answer": "b"}],
            [],
            "need both a 'prompt' and a 'completion' column; 'completion' is missing",
        ),
        ([{"question": "a"}], [], "no 'messages' column (chat), no 'prompt' and 'completion' columns and no 'text'"),
        ([{"text": "a"}], ["--text-field", "body"], "--text-field 'body' is not a column"),
        ([{"text": "a"}], ["--mask", "assistant"], "--mask 'assistant' does not apply to text samples"),
        ([{"text": "a"}], ["--max-length", "0"], "--max-length must be positive"),
    ],
)
def test_bad_input_is_named(capsys, tmp_path, smol_tokenizer_dir, rows, args, message):
    src = tmp_path / "bad.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, _, err = cli(capsys, src, "--tokenizer", smol_tokenizer_dir, "--out", tmp_path / "o", *args)
    assert rc == 2 and message in err, err


def test_missing_and_unsupported_files(capsys, tmp_path, smol_tokenizer_dir):
    rc, _, err = cli(capsys, tmp_path / "nope.jsonl", "--tokenizer", smol_tokenizer_dir, "--out", tmp_path / "o")
    assert rc == 2 and "does not exist" in err
    (tmp_path / "data.xml").write_text("<a/>")
    rc, _, err = cli(capsys, tmp_path / "data.xml", "--tokenizer", smol_tokenizer_dir, "--out", tmp_path / "o")
    assert rc == 2 and "unsupported file type .xml" in err


# ----------------------------------------------------------------------------- the length report
def test_length_report_buckets_and_shares(h200_cost):
    from hf_cp.modes.segments import doc_pairs

    lengths = [100, 120, 128, 129, 300, 1000, 5000]
    rep = length_report(lengths, h200_cost, trained_tokens=1234, model="qwen2.5-7b", profile="h200")
    by_label = {b.label: b for b in rep.buckets}
    assert [b.label for b in rep.buckets] == ["1-128", "129-256", "257-512", "513-1K", "1025-2K", "2049-4K", "4097-8K"]
    assert by_label["1-128"].samples == 3 and by_label["1-128"].tokens == 348
    assert by_label["129-256"].samples == 1 and by_label["4097-8K"].tokens == 5000
    assert sum(b.samples for b in rep.buckets) == 7 and sum(b.tokens for b in rep.buckets) == sum(lengths)
    L, c2 = h200_cost.dims.num_layers, h200_cost.c2
    want = L * c2 * doc_pairs(5000) / h200_cost.chunk_efficiency(5000)
    assert by_label["4097-8K"].attention_ms == pytest.approx(want)
    assert by_label["4097-8K"].compute_ms == pytest.approx(h200_cost.sample_local_ms(5000))
    # the longest sample holds far more of the attention time than of the tokens
    share_attn = by_label["4097-8K"].attention_ms / rep.attention_ms
    share_tok = 5000 / sum(lengths)
    assert share_attn > 0.9 > share_tok > 0.5
    assert dict(rep.percentiles)[50] == 129 and rep.maximum == 5000 and rep.minimum == 100
    text = rep.text()
    assert "7 samples, 6777 tokens (1234 trained" in text and "p50 129" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("4097-8K"))
    assert f"{100 * share_attn:.1f}" in row


def test_length_plot_and_json(capsys, tmp_path, smol_tokenizer_dir):
    png, js = tmp_path / "len.png", tmp_path / "len.json"
    rc, out, err = cli(
        capsys,
        CHAT_SAMPLE,
        "--tokenizer",
        smol_tokenizer_dir,
        "--out",
        tmp_path / "o",
        "--plot",
        png,
        "--report-json",
        js,
        "--model",
        "qwen2.5-0.5b",
        "--max-length",
        1024,
        "--overlong",
        "drop",
    )
    assert rc == 0, err
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 15_000
    rep = json.loads(js.read_text())
    ds = load(tmp_path / "o")
    assert rep["samples"] == len(ds) and rep["tokens"] == sum(ds["length"]) and rep["model"] == "qwen2.5-0.5b"
    assert rep["dropped_overlong"] == rep["overlong"] > 0
    assert sum(b["samples"] for b in rep["buckets"]) == len(ds)
    assert sum(b["tokens"] for b in rep["buckets"]) == rep["tokens"]
    assert max(b["high"] for b in rep["buckets"] if b["samples"]) >= max(ds["length"]) > 512


@pytest.mark.parametrize(
    "name, shown",
    [
        ("/home/me/models/SmolLM2-135M-Instruct/", "SmolLM2-135M-Instruct"),
        ("./data/chat.jsonl", "chat.jsonl"),
        ("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M"),
        ("cpu", "cpu"),
        # the model a tokenizer folder's report is priced with: its folder, not "config.json"
        ("/home/me/models/SmolLM2-135M-Instruct/config.json", "SmolLM2-135M-Instruct"),
        ("outputs/smollm2-135m-instruct/config.json", "smollm2-135m-instruct"),
        ("smollm2/tokenizer.json", "smollm2"),
    ],
)
def test_the_length_plot_names_a_path_by_its_last_part(name, shown):
    from hf_cp.data_prep.length_report import display_name

    assert display_name(name) == shown
