"""Settings CPTrainer cannot run with are refused when it is set up, by name: DeepSpeed's
sequence parallelism (sp_size > 1, which otherwise ends in a bare assertion inside DeepSpeed),
accelerate's own CP, and a model without hf_cp attention when plans may spread samples (which
otherwise fails at the first step that spreads one)."""

from __future__ import annotations

import pytest

from hf_cp.train.checks.setup import HF_CP_ATTENTION, SetupError, check_attention, check_parallelism

from helpers import REPO
from helpers.harness.models import synthetic_rows, tiny_model


def test_the_attention_name_is_the_registered_one():
    from hf_cp.attention.interface import ATTN_IMPLEMENTATION

    assert HF_CP_ATTENTION == ATTN_IMPLEMENTATION


def test_sequence_parallelism_is_refused_clearly(tmp_path, monkeypatch):
    from accelerate.parallelism_config import ParallelismConfig

    from hf_cp.train import CPTrainingArguments

    with pytest.raises(
        SetupError, match=r"sp_size=2 \(DeepSpeed Ulysses / ALST.*Set sp_size=1.*cp_max_tokens_per_rank"
    ):
        CPTrainingArguments(output_dir=str(tmp_path), use_cpu=True, parallelism_config=ParallelismConfig(sp_size=2))
    with pytest.raises(SetupError, match=r"cp_size=2: CPTrainer plans its own CP groups"):
        CPTrainingArguments(output_dir=str(tmp_path), use_cpu=True, parallelism_config=ParallelismConfig(cp_size=2))
    # accelerate launch passes its config file's parallelism sizes through the environment
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "4")
    with pytest.raises(SetupError, match="sp_size=4"):
        CPTrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "1")
    check_parallelism(None)
    check_parallelism(ParallelismConfig(dp_shard_size=1))


def test_attention_is_checked_when_the_trainer_is_built(tmp_path, monkeypatch):
    from datasets import Dataset

    from hf_cp.train import CPTrainer, CPTrainingArguments

    args = CPTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        cp_max_tokens_per_rank=256,
        cp_tokens_per_step=500,
        cp_compare_balancer=None,
        cp_profile="cpu",
    )
    # a world of 2 as the planner sees it (no process group is needed to build the trainer)
    monkeypatch.setattr(type(args), "world_size", property(lambda self: 2))
    ds = Dataset.from_list(synthetic_rows([100, 80, 300]))
    with pytest.raises(
        SetupError, match=r"attn_implementation='sdpa', but plans may spread samples over CP groups of up to 2"
    ):
        CPTrainer(model=tiny_model(0, attn="sdpa"), args=args, train_dataset=ds)
    CPTrainer(model=tiny_model(0, attn="hf_cp"), args=args, train_dataset=ds)  # the fix
    args.cp_max_group_size = 1  # or keep every sample on one rank: any attention implementation will do
    CPTrainer(model=tiny_model(0, attn="sdpa"), args=args, train_dataset=Dataset.from_list(synthetic_rows([100, 80])))
    check_attention("sdpa", 1)


def test_arch_suffixes_deepspeed_cannot_parse_are_dropped():
    """DeepSpeed 0.19's FusedAdam build failed on an H200 image's TORCH_CUDA_ARCH_LIST=9.0a
    ("invalid literal for int() with base 10: '0a'"); CPTrainer hands it the plain arch."""
    from hf_cp.train.checks.setup import deepspeed_arch_list

    assert deepspeed_arch_list("9.0a") == "9.0"
    assert deepspeed_arch_list("8.0;9.0a;10.0f") == "8.0;9.0;10.0"
    assert deepspeed_arch_list("9.0a+PTX") == "9.0+PTX"
    assert deepspeed_arch_list("8.0;9.0") is None  # nothing to change
    assert deepspeed_arch_list("") is None and deepspeed_arch_list(None) is None


def test_a_parallelism_config_mapping_from_yaml_is_refused_with_the_fix(tmp_path):
    from hf_cp.train.setup.args import CPTrainingArguments

    with pytest.raises(SetupError, match=r"training.parallelism_config \{'dp_shard_size': 2\}.*remove it"):
        CPTrainingArguments(output_dir=str(tmp_path), use_cpu=True, parallelism_config={"dp_shard_size": 2})


def test_a_parallelism_config_in_a_training_config_fails_the_dry_run(tmp_path, capsys):
    import yaml

    from hf_cp.cli import main

    cfg = yaml.safe_load((REPO / "configs" / "tiny-cpu.yaml").read_text())
    cfg["training"]["parallelism_config"] = {"cp_size": 1}
    cfg["training"]["output_dir"] = str(tmp_path / "out")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path), "--dry-run", "--world", "2"]) != 0
    assert "error: training.parallelism_config {'cp_size': 1}" in capsys.readouterr().err


def test_use_liger_kernel_is_refused_by_name(tmp_path):
    from hf_cp.train.setup.args import CPTrainingArguments

    with pytest.raises(ValueError, match="use_liger_kernel is not supported"):
        CPTrainingArguments(output_dir=str(tmp_path), use_cpu=True, use_liger_kernel=True)
