"""CPTrainer as a mixin with TRL's SFTTrainer (hf_cp.train.objectives.sft): it trains from raw
prompt/completion data that SFTTrainer prepares, with the same losses as the same data
preprocessed by `hf-cp preprocess` and trained by CPTrainer. TRL is an optional extra: these
tests run when it is installed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from helpers import load_file_module
from helpers.harness.job import run_launcher
from helpers.tiny_tokenizer import tiny_chat_model, tiny_chat_tokenizer

pytest.importorskip("trl")  # the optional `trl` extra

ROOT = Path(__file__).resolve().parent.parent
CAP = 128  # tokens per rank: the longest samples need a CP group of 2
TOKENS_PER_STEP = 512
SETTINGS = dict(
    seed=42,
    learning_rate=1e-3,
    lr_scheduler_type="constant",
    weight_decay=0.0,
    max_grad_norm=1.0,
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    cp_max_tokens_per_rank=CAP,
    cp_tokens_per_step=TOKENS_PER_STEP,
    cp_compare_balancer=None,
    cp_profile="cpu",
)


def raw_rows(n: int = 14):
    """Prompt/completion samples of 20 to ~200 byte tokens."""
    rows = []
    for i in range(n):
        prompt = f"Q{i}: " + "what comes next? " * (1 + (i * 5) % 9)
        completion = " " + "ab cd " * (1 + (i * 7) % 13)
        rows.append({"prompt": prompt, "completion": completion})
    return rows


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft_trainer(tmp_path, rows, **kw):
    from datasets import Dataset

    from hf_cp.train.objectives.sft import CPSFTConfig, CPSFTTrainer

    args = CPSFTConfig(
        output_dir=str(tmp_path / "sft"),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        max_steps=2,
        **dict(SETTINGS, **kw),
    )
    return CPSFTTrainer(
        model=tiny_chat_model(0),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tiny_chat_tokenizer(),
    )


def test_the_mixin_trains_from_raw_prompt_completion_like_the_preprocessed_data(tmp_path):
    from hf_cp.data_prep import preprocess
    from hf_cp.train import CPTrainer, CPTrainingArguments

    rows = raw_rows()
    one_rank = dict(SETTINGS, cp_max_tokens_per_rank=2 * CAP)  # one process holds the longest sample
    sft = sft_trainer(tmp_path, rows, cp_max_tokens_per_rank=2 * CAP)
    assert "input_ids" in sft.train_dataset.column_names and len(sft.cp_data) == len(rows)  # the prepared data
    sft.train()
    pre = preprocess(str(write_jsonl(tmp_path / "raw.jsonl", rows)), tiny_chat_tokenizer(), tmp_path / "pre")
    args = CPTrainingArguments(output_dir=str(tmp_path / "cp"), use_cpu=True, max_steps=2, **one_rank)
    plain = CPTrainer(model=tiny_chat_model(0), args=args, train_dataset=pre.dataset)
    plain.train()
    assert sft.cp_data.digest() == plain.cp_data.digest(), "the same tokens and targets"
    assert [r.plan_digest for r in sft.cp_history] == [r.plan_digest for r in plain.cp_history]
    assert [r.loss for r in sft.cp_history] == pytest.approx([r.loss for r in plain.cp_history], rel=1e-6)


def test_the_mixin_needs_its_config_and_prepares_eval_data(tmp_path):
    from datasets import Dataset

    from hf_cp.train import CPTrainingArguments
    from hf_cp.train.objectives.sft import CPSFTTrainer

    with pytest.raises(TypeError, match="CPSFTTrainer needs CPSFTConfig"):
        CPSFTTrainer(
            model=tiny_chat_model(0),
            args=CPTrainingArguments(output_dir=str(tmp_path), use_cpu=True),
            train_dataset=Dataset.from_list(raw_rows()),
            processing_class=tiny_chat_tokenizer(),
        )
    sft = sft_trainer(tmp_path, raw_rows(), cp_max_tokens_per_rank=2 * CAP)
    assert sft.args.max_length is None, "no silent truncation to SFTConfig's 1024 tokens"
    metrics = sft.evaluate(Dataset.from_list(raw_rows(4)))  # raw: prepared by SFTTrainer first
    assert metrics["eval_samples"] == 4 and metrics["eval_loss"] > 0


def recipe_flags(**extra):
    flags = []
    for k, v in dict(SETTINGS, max_steps=2, bf16=False, gradient_checkpointing=False, **extra).items():
        flags += [f"--{k}", "none" if v is None else str(v)]
    return flags


def test_the_recipe_reads_trl_and_hf_cp_flags(tmp_path):
    from transformers import HfArgumentParser

    from hf_cp.train.objectives.sft import CPSFTConfig

    recipe = load_file_module("trl_sft_recipe", "recipes/trl_sft.py")
    flags = ["--model_path", "m", "--dataset_path", "d.jsonl", "--output_dir", str(tmp_path), "--use_cpu"]
    flags += recipe_flags(cp_balancer_options='{"outlier_fraction": 0.05}', cp_balancer="wlb")
    script, args = HfArgumentParser((recipe.ScriptArguments, CPSFTConfig)).parse_args_into_dataclasses(flags)
    assert script.model_path == "m" and script.attn_implementation == "hf_cp"
    assert args.cp_profile == "cpu" and args.cp_compare_balancer is None and args.cp_max_tokens_per_rank == CAP
    assert args.cp_balancer_options == {"outlier_fraction": 0.05} and args.max_length is None and not args.bf16


def _launch(cmd, log: Path, timeout: float = 540):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    p = run_launcher(cmd, env, timeout)
    out = p.stdout + p.stderr
    log.write_text(out)
    assert p.returncode == 0, out[-6000:]
    return out


def _history(out_dir: Path):
    lines = (out_dir / "cp_history" / "rank0.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_trl_recipe_on_two_processes_matches_hf_cp_train_on_preprocessed_data(tmp_path):
    """The acceptance run: recipes/trl_sft.py (CPSFTTrainer, raw prompt/completion) and
    `hf-cp train` (CPTrainer, the same data through `hf-cp preprocess`), 2 gloo processes each,
    DeepSpeed ZeRO-2, 2 steps, a sample spread over a CP group of 2: the same losses."""
    from helpers.harness.job import free_port

    model_dir = tmp_path / "model"
    tiny_chat_model(0).save_pretrained(model_dir)
    tiny_chat_tokenizer().save_pretrained(model_dir)
    raw = write_jsonl(tmp_path / "raw.jsonl", raw_rows())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    flags = recipe_flags()
    trl_out = tmp_path / "trl"
    _launch(
        torchrun
        + ["--master_port", str(free_port()), "recipes/trl_sft.py", "--model_path", str(model_dir)]
        + ["--dataset_path", str(raw), "--output_dir", str(trl_out), "--use_cpu", "--deepspeed"]
        + ["recipes/ds-zero2-cpu.json", *flags],
        tmp_path / "trl.log",
    )
    from hf_cp.cli import main as cli

    assert cli(["preprocess", str(raw), "--tokenizer", str(model_dir), "--out", str(tmp_path / "pre")]) == 0
    cfg = {
        "model": {"pretrained": str(model_dir)},
        "data": {"path": str(tmp_path / "pre")},
        "training": dict(
            SETTINGS,
            output_dir=str(tmp_path / "cp"),
            use_cpu=True,
            max_steps=2,
            deepspeed="recipes/ds-zero2-cpu.json",
        ),
    }
    (tmp_path / "cp.yaml").write_text(yaml.safe_dump(cfg))
    _launch(
        torchrun + ["--master_port", str(free_port()), "-m", "hf_cp.train", str(tmp_path / "cp.yaml")],
        tmp_path / "cp.log",
    )
    ours, theirs = _history(trl_out), _history(tmp_path / "cp")
    assert len(ours) == len(theirs) == 2
    assert [r["plan_digest"] for r in ours] == [r["plan_digest"] for r in theirs]
    assert any(int(g) > 1 for r in ours for g in r["cp_size_samples"]), "a sample ran over a CP group"
    print("losses: TRL recipe", [r["loss"] for r in ours], "hf-cp train", [r["loss"] for r in theirs])
    assert [r["loss"] for r in ours] == pytest.approx([r["loss"] for r in theirs], rel=1e-6)
    assert (trl_out / "model.safetensors").exists() and (trl_out / "tokenizer_config.json").exists()


def test_packing_is_refused_with_what_hf_cp_does_instead(tmp_path):
    """Before: TRL's 'packing needs max_length' error; hf_cp packs per step itself."""
    from hf_cp.train.objectives.sft import CPSFTConfig

    with pytest.raises(ValueError, match="packing=True: hf_cp already packs, per step"):
        CPSFTConfig(output_dir=str(tmp_path), packing=True, use_cpu=True, **SETTINGS)


def test_the_mixin_trains_preprocessed_vision_language_data_as_cptrainer_does(tmp_path):
    """A dataset of a Qwen2-VL processor's columns (images, a clip) through CPSFTTrainer: SFTTrainer
    leaves it as it is, CPTrainer's vision set-up reads it, and the steps equal CPTrainer's own
    (issue 38). SFTConfig's bf16 default is turned off: autocast would be the difference."""
    from datasets import Dataset

    from hf_cp.train import CPTrainer, CPTrainingArguments
    from hf_cp.train.objectives.sft import CPSFTConfig, CPSFTTrainer

    from helpers.harness.models import vision_rows
    from helpers.tiny_vlm import build_vlm

    rows = vision_rows([120, 40, 60, 30, 90, 50], seed=0)
    common = dict(SETTINGS, cp_max_tokens_per_rank=256, cp_tokens_per_step=256, max_steps=2, use_cpu=True)
    sft = CPSFTTrainer(
        model=build_vlm("hf_cp"),
        args=CPSFTConfig(output_dir=str(tmp_path / "sft"), bf16=False, gradient_checkpointing=False, **common),
        train_dataset=Dataset.from_list(rows),
        processing_class=tiny_chat_tokenizer(),
    )
    assert sft.cp_vision is not None and sft.cp_data.vision(0) is not None
    sft.train()
    plain = CPTrainer(
        model=build_vlm("hf_cp"),
        args=CPTrainingArguments(output_dir=str(tmp_path / "cp"), **common),
        train_dataset=Dataset.from_list(rows),
    )
    plain.train()
    assert sft.cp_data.digest() == plain.cp_data.digest()
    assert [r.loss for r in sft.cp_history] == pytest.approx([r.loss for r in plain.cp_history], rel=1e-12)
    assert len(sft.cp_history) == 2


def _image_rows(n: int = 3):
    """TRL's vision SFT format: messages with an image part, the row's `images`."""
    import numpy as np
    from PIL import Image

    rows = []
    for i in range(n):
        image = Image.fromarray((np.random.default_rng(i).random((16, 16, 3)) * 255).astype("uint8"))
        user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Q{i}: what is it?"}]}
        answer = {"role": "assistant", "content": [{"type": "text", "text": "a square " * (1 + i)}]}
        rows.append({"messages": [user, answer], "images": [image]})
    return rows


def test_trls_vision_rows_are_refused_by_name_with_the_path_that_trains_them(tmp_path):
    """Rows with an `images` column (TRL turns them into pixels per batch in its collator). Before
    (measured, issue 38): CPTrainer's "train_dataset has no 'input_ids' column ... tokenise it
    first" at set-up. Now refused naming the trainer, the column and `hf-cp preprocess --processor`,
    at construction and by evaluate()."""
    from datasets import Dataset

    from hf_cp.train.objectives.sft import CPSFTConfig, CPSFTTrainer

    from helpers.tiny_vlm import build_vlm

    def trainer(out, train, eval_dataset=None):
        args = CPSFTConfig(output_dir=str(tmp_path / out), max_steps=1, use_cpu=True, bf16=False, **SETTINGS)
        return CPSFTTrainer(
            model=build_vlm("hf_cp"),
            args=args,
            train_dataset=Dataset.from_list(train),
            eval_dataset=eval_dataset,
            processing_class=tiny_chat_tokenizer(),
        )

    refusal = "CPSFTTrainer: {} has the column 'images' \\(TRL's vision-language rows\\)"
    with pytest.raises(ValueError, match=refusal.format("train_dataset")) as caught:
        trainer("train", _image_rows())
    assert "hf-cp preprocess DATA --processor DIR" in str(caught.value) and "trainer: cp" in str(caught.value)
    text = [{"prompt": f"Q{i}: ", "completion": "yes " * (1 + i)} for i in range(3)]
    with pytest.raises(ValueError, match=refusal.format("eval_dataset\\['pics'\\]")):
        trainer("eval", text, eval_dataset={"pics": Dataset.from_list(_image_rows())})
    with pytest.raises(ValueError, match=refusal.format("eval_dataset")):
        trainer("evaluate", text).evaluate(Dataset.from_list(_image_rows()))
