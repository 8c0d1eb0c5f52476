"""One config for every trainer: `trainer: cp | sft | dpo | kto | grpo | rloo` at the top of a
training config (hf_cp/train/launch/trainers.py). The training section is checked against the
trainer's own config class; a key of another trainer is refused naming it; the data's columns and
the reward functions are checked; and a run from YAML equals the same trainer built in Python."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

pytest.importorskip("trl")  # the optional `trl` extra

from hf_cp.train.launch.dry_run import dry_run  # noqa: E402
from hf_cp.train.launch.entry import run  # noqa: E402
from hf_cp.train.launch.trainers import TRAINERS  # noqa: E402
from hf_cp.train.setup.config import TrainConfigError, load_config  # noqa: E402

from helpers.tiny_tokenizer import tiny_chat_model, tiny_chat_tokenizer  # noqa: E402

TRAINING = dict(
    use_cpu=True,
    bf16=False,
    seed=0,
    learning_rate=2e-3,
    lr_scheduler_type="constant",
    weight_decay=0.0,
    max_grad_norm=0.0,
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    gradient_checkpointing=False,
    max_steps=2,
    cp_max_tokens_per_rank=512,
    cp_compare_balancer="none",
    cp_profile="cpu",
    cp_shuffle=False,
    cp_plan_lookahead=0,
    cp_save_final_model=False,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tiny_chat_model(0).save_pretrained(path)
    tiny_chat_tokenizer().save_pretrained(path)
    return str(path)


def write_config(tmp_path: Path, trainer: str, model: str, rows, training: dict, **sections) -> str:
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = dict(
        trainer=trainer,
        model={"pretrained": model},
        data={"path": str(data)},
        training={**TRAINING, "output_dir": str(tmp_path / "out"), **training},
        **sections,
    )
    path = tmp_path / f"{trainer}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def yaml_losses(path: str):
    started: dict = {}
    run(path, [], started)
    return [r.loss for r in started["trainer"].cp_history]


def test_dpo_from_yaml_equals_the_trainer_built_in_python(model_dir, tmp_path):
    from helpers.dpo_runs import hf_cp_run, preference_rows

    rows = preference_rows(8)
    ours = yaml_losses(write_config(tmp_path, "dpo", model_dir, rows, dict(beta=0.1, cp_tokens_per_step=700)))
    _, python, _, _ = hf_cp_run(rows, str(tmp_path / "python"), 2)
    assert ours == python and ours[0] != ours[1], (ours, python)


def test_kto_from_yaml_equals_the_trainer_built_in_python(model_dir, tmp_path):
    import helpers.kto_runs as kto_runs

    rows = kto_runs.kto_rows(12)
    settings = dict(cp_tokens_per_step=kto_runs.TOKENS_PER_STEP, cp_kl_batch_size=kto_runs.KL_BATCH)
    ours = yaml_losses(write_config(tmp_path, "kto", model_dir, rows, settings))
    _, python, _, _ = kto_runs.hf_cp_run(rows, str(tmp_path / "python"), 2)
    assert ours == python and ours[0] != ours[1], (ours, python)


def test_a_key_of_another_trainer_is_refused_naming_it(model_dir, tmp_path):
    path = write_config(tmp_path, "cp", model_dir, [{"input_ids": [1, 2, 3]}], dict(beta=0.1))
    with pytest.raises(TrainConfigError, match=r"training.beta is a setting of trainer: dpo / kto / grpo / rloo"):
        load_config(path, [], TRAINERS)
    path = write_config(tmp_path, "dpo", model_dir, [{"input_ids": [1]}], dict(num_generations=4))
    with pytest.raises(TrainConfigError, match=r"training.num_generations is a setting of trainer: grpo / rloo"):
        load_config(path, [], TRAINERS)


def test_trainer_names_data_columns_and_rewards_are_checked(model_dir, tmp_path):
    bad = write_config(tmp_path, "ppo", model_dir, [{"prompt": "x"}], {})
    with pytest.raises(TrainConfigError, match="trainer: 'ppo' is not one of cp, sft, dpo, kto, grpo, rloo"):
        load_config(bad, [], TRAINERS)
    no_reward = write_config(tmp_path, "grpo", model_dir, [{"prompt": "x"}], {})
    with pytest.raises(TrainConfigError, match="trainer: grpo needs a reward section"):
        load_config(no_reward, [], TRAINERS)
    stray = write_config(tmp_path, "dpo", model_dir, [{"prompt": "x"}], {}, reward={"functions": ["m:f"]})
    with pytest.raises(TrainConfigError, match="a reward section is for trainer: grpo or rloo"):
        load_config(stray, [], TRAINERS)
    columns = write_config(tmp_path, "dpo", model_dir, [{"prompt": "x", "answer": "y"}], dict(beta=0.1))
    with pytest.raises(TrainConfigError, match=r"trainer: dpo trains on rows with chosen/rejected; the data has"):
        dry_run(columns, [], world_size=2)
    missing = write_config(
        tmp_path, "grpo", model_dir, [{"prompt": "x"}], {}, reward={"functions": ["helpers.grpo_runs:no_such"]}
    )
    with pytest.raises(TrainConfigError, match="reward.functions: 'helpers.grpo_runs:no_such' does not import"):
        dry_run(missing, [], world_size=2)


def test_the_dry_run_checks_a_trl_trainers_config(model_dir, tmp_path):
    from helpers.grpo_runs import prompt_rows

    path = write_config(
        tmp_path,
        "grpo",
        model_dir,
        prompt_rows(),
        dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=8),
        reward={"functions": ["helpers.grpo_runs:reward_a"]},
    )
    lines = dry_run(path, [], world_size=2)
    assert lines[0].startswith("config grpo.yaml: trainer grpo, 2 rank(s)") and "['prompt']" in lines[0]


def test_grpo_from_yaml_on_the_bundled_prompts_and_reward_ends_with_its_summary(model_dir, tmp_path, capsys):
    cfg = dict(
        trainer="grpo",
        model={"pretrained": model_dir},
        data={"bundled": "toy_prompts", "limit": 16},
        reward={"functions": ["hf_cp.data.toy_prompts:share_of_a"]},
        training=dict(
            TRAINING,
            output_dir=str(tmp_path / "out"),
            num_generations=8,
            per_device_train_batch_size=16,
            max_completion_length=32,
        ),
    )
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    started: dict = {}
    run(str(path), [], started)
    assert type(started["trainer"]).__name__ == "CPGRPOTrainer"
    out = capsys.readouterr().out
    summary = out[out.index("==== hf_cp training summary: grpo.yaml, 1 process(es), trainer grpo") :]
    # two logged steps, each with TRL's reward and hf_cp's planned step
    assert "logged steps 2; mean reward: first 1 " in summary, summary
    assert "planned policy step: predicted" in summary and "completion length: mean" in summary, summary


# ------------------------------------------------------------------ the dry run of a TRL trainer checks what its launch would
RECIPE = json.loads((Path(__file__).resolve().parents[1] / "recipes" / "ds-zero2-cpu.json").read_text())


def _deepspeed(tmp_path: Path, **edits) -> dict:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(dict(RECIPE, **edits)))
    return dict(deepspeed=str(path))


def _a_file(tmp_path: Path) -> dict:
    (tmp_path / "afile").write_text("x")
    return dict(output_dir=str(tmp_path / "afile"))


@pytest.mark.parametrize(
    "training, message",
    [
        (lambda p: dict(report_to="wandbx"), "report_to 'wandbx' is not a reporting integration"),
        (lambda p: dict(ddp_timeout=0), "ddp_timeout 0 must be a positive number of seconds"),
        (
            lambda p: _deepspeed(p, train_micro_batch_size_per_gpu=4),
            "the DeepSpeed config contradicts the training arguments at 2 rank",
        ),
        (lambda p: _deepspeed(p, zero_optimization={"stage": 7}), "DeepSpeed refuses its config: .*stage"),
        (_a_file, "output_dir '.*afile' is a file, not a folder"),
        (lambda p: dict(fsdp="full_shard", **_deepspeed(p)), "fsdp together with deepspeed"),
    ],
    ids=["report_to", "ddp_timeout", "deepspeed-micro-batch", "stage-7", "output_dir-file", "fsdp-and-deepspeed"],
)
@pytest.mark.parametrize("trainer", ["dpo", "grpo"])
def test_the_dry_run_of_a_trl_trainer_refuses_the_launch_settings_its_launch_refuses(
    model_dir, tmp_path, trainer, training, message
):
    """Before, `trainer: dpo` passed each of these with rc 0 (the launch refused them)."""
    from helpers.dpo_runs import preference_rows
    from helpers.grpo_runs import prompt_rows

    if trainer == "dpo":
        path = write_config(tmp_path, "dpo", model_dir, preference_rows(4), dict(beta=0.1, **training(tmp_path)))
    else:
        path = write_config(
            tmp_path,
            "grpo",
            model_dir,
            prompt_rows(),
            dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=8, **training(tmp_path)),
            reward={"functions": ["helpers.grpo_runs:reward_a"]},
        )
    with pytest.raises(ValueError, match=message):
        dry_run(path, [], world_size=2)


@pytest.mark.parametrize("trainer, column", [("dpo", "chosen"), ("dpo", "rejected"), ("kto", "completion")])
def test_the_dry_run_refuses_an_empty_preference_answer_naming_the_row(model_dir, tmp_path, trainer, column):
    from helpers.dpo_runs import preference_rows

    rows = preference_rows(4)
    if trainer == "kto":
        rows = [dict(prompt=r["prompt"], completion=r["chosen"], label=i % 2 == 0) for i, r in enumerate(rows)]
    rows[2][column] = "  "
    path = write_config(tmp_path, trainer, model_dir, rows, dict(beta=0.1))
    item = "pair" if trainer == "dpo" else "example"
    with pytest.raises(ValueError, match=f"train_dataset {item} 2: the {column} answer is empty"):
        dry_run(path, [], world_size=2)


def test_the_dry_run_of_sft_on_token_ids_refuses_an_id_outside_the_vocabulary(model_dir, tmp_path):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    rows = [{"input_ids": [1, 2, 3, 4]} for _ in range(4)]
    rows[3]["input_ids"][1] = vocab
    path = write_config(tmp_path, "sft", model_dir, rows, {})
    with pytest.raises(ValueError, match=f"train_dataset row 3.*{vocab}"):
        dry_run(path, [], world_size=2)


def test_the_dry_run_of_a_trl_trainer_reads_output_dir_as_a_resume_would(model_dir, tmp_path):
    """Another run's lock is an error line; a complete checkpoint of another engine (here a plain
    one, under the ZeRO-2 recipe) is refused; one that fits is named as the resume point."""
    import torch

    from hf_cp.train.checkpoint.marks import mark_complete
    from hf_cp.train.checkpoint.run_lock import LOCK_FILE

    from helpers.dpo_runs import preference_rows

    out = tmp_path / "out"
    ckpt = out / "checkpoint-2"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    torch.save({}, ckpt / "optimizer.pt")
    mark_complete(ckpt, 2, 2)
    resume = dict(beta=0.1, resume_from_checkpoint="latest")
    path = write_config(tmp_path, "dpo", model_dir, preference_rows(4), dict(resume, **_deepspeed(tmp_path)))
    with pytest.raises(ValueError, match=f"checkpoint {ckpt} was saved under no parameter sharding"):
        dry_run(path, [], world_size=2)
    lines = dry_run(write_config(tmp_path, "dpo", model_dir, preference_rows(4), resume), [], world_size=2)
    assert any(line.startswith(f"resume: a launch or restart resumes from {ckpt}") for line in lines), lines
    (out / LOCK_FILE).write_text(json.dumps(dict(host="node-7", pid=1, started=0, command="train.py", run_id="r0")))
    lines = dry_run(write_config(tmp_path, "dpo", model_dir, preference_rows(4), resume), [], world_size=2)
    assert any(line.startswith("error: ") and "node-7" in line for line in lines), lines


def trl_config(tmp_path, trainer: str, model_dir: str, training: dict) -> str:
    """A `trainer:` config of each TRL trainer over its bundled or helper rows."""
    from helpers.dpo_runs import preference_rows
    from helpers.grpo_runs import prompt_rows

    if trainer in ("grpo", "rloo"):
        rollout = dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=8)
        reward = {"functions": ["helpers.grpo_runs:reward_a"]}
        return write_config(tmp_path, trainer, model_dir, prompt_rows(), {**rollout, **training}, reward=reward)
    rows = preference_rows(4)
    if trainer == "kto":
        rows = [dict(prompt=r["prompt"], completion=r["chosen"], label=i % 2 == 0) for i, r in enumerate(rows)]
    return write_config(tmp_path, trainer, model_dir, rows, dict(beta=0.1, **training))


@pytest.mark.parametrize(
    "trainer, training, message",
    [
        ("dpo", dict(padding_free=True), "CPDPOTrainer: padding_free=True asks TRL for padding-free batches"),
        ("dpo", dict(max_length=1024), "CPDPOTrainer: max_length=1024 would truncate pairs"),
        ("kto", dict(max_length=512), "CPKTOTrainer: max_length=512 would truncate examples"),
        ("kto", dict(precompute_ref_log_probs=True), "CPKTOTrainer: precompute_ref_log_probs=True is not supported"),
        ("grpo", dict(loss_type="vespo"), "CPGRPOTrainer: loss_type='vespo' is not supported"),
        ("grpo", dict(importance_sampling_level="sequence"), "CPGRPOTrainer: importance_sampling_level='sequence'"),
    ],
)
def test_the_dry_run_makes_the_argument_checks_the_trainer_makes_when_built(
    model_dir, tmp_path, trainer, training, message
):
    """Before, each of these printed "dry run passed" and was refused only when the trainer was built:
    the dry run now calls the trainer's own cp_check_arguments, and building the trainer from the
    same arguments raises the same words (one function, no copy)."""
    from hf_cp.train.launch.dry_run import login_node_arguments

    path = trl_config(tmp_path, trainer, model_dir, training)
    with pytest.raises(ValueError, match=f"trainer: {trainer}: {re.escape(message)}"):
        dry_run(path, [], world_size=2)
    cfg = load_config(path, [], TRAINERS)
    args, _, _ = login_node_arguments(cfg, TRAINERS.config_class(trainer))
    with pytest.raises(ValueError, match=re.escape(message)):
        TRAINERS.trainer_class(trainer)(model=None, args=args)


@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_use_vllm_is_refused_in_one_message_in_the_dry_run_and_at_set_up(model_dir, tmp_path, trainer):
    """Before: GRPO asked to turn off TRL's importance-sampling correction, then TRL failed with
    "vLLM is not available"; now one refusal naming what works (generation through transformers)."""
    from hf_cp.train.launch.dry_run import login_node_arguments

    path = trl_config(tmp_path, trainer, model_dir, dict(use_vllm=True))
    message = f"CP{trainer.upper()}Trainer: use_vllm=True is not supported"
    with pytest.raises(
        ValueError, match=f"trainer: {trainer}: {message}.*generated through transformers on the policy"
    ):
        dry_run(path, [], world_size=2)
    args, _, _ = login_node_arguments(load_config(path, [], TRAINERS), TRAINERS.config_class(trainer))
    with pytest.raises(ValueError, match=message):
        TRAINERS.trainer_class(trainer)(model=None, args=args)


@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_a_calibration_schedule_passes_the_rollout_trainers_checks(model_dir, tmp_path, trainer):
    """Before, the dry run and the trainer refused cp_calibrate_* for GRPO/RLOO, which did not
    calibrate; they calibrate now (test_grpo.py runs the schedule), so both checks take it."""
    from hf_cp.train.launch.dry_run import login_node_arguments

    path = trl_config(tmp_path, trainer, model_dir, {"cp_calibrate_every": 2, "cp_calibrate_min_steps": 3})
    dry_run(path, [], world_size=2)
    args, _, _ = login_node_arguments(load_config(path, [], TRAINERS), TRAINERS.config_class(trainer))
    assert (args.cp_calibrate_min_steps, args.cp_calibrate_every) == (3, 2)
    TRAINERS.trainer_class(trainer).cp_check_arguments(args)


LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


def lora_only(model) -> list:
    """The names of the trainable parameters that are not LoRA's (empty: only the adapter trains)."""
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable, "nothing trains"
    return [n for n in trainable if "lora_" not in n]


@pytest.mark.parametrize("trainer", ["cp", "dpo"])
def test_a_peft_section_dry_runs_and_trains_only_the_lora_adapter(model_dir, tmp_path, trainer):
    """`peft:` in the YAML: the dry run wraps its meta model and names what the adapter trains; the
    launch trains only LoRA's parameters (trainer cp: the entry wraps the model; dpo: TRL's
    peft_config, with no copied reference: the disabled adapter is the reference)."""
    from helpers.dpo_runs import preference_rows

    if trainer == "cp":
        rows = [{"input_ids": list(range(1 + i, 40 + 3 * i))} for i in range(8)]
        path = write_config(tmp_path, "cp", model_dir, rows, dict(max_steps=1), peft=LORA)
    else:
        path = write_config(tmp_path, "dpo", model_dir, preference_rows(4), dict(beta=0.1, max_steps=1), peft=LORA)
    lines = dry_run(path, [], world_size=2)
    assert any(line.startswith("peft: LoRA r=4 on q_proj, v_proj: ") for line in lines), lines
    started: dict = {}
    assert run(path, [], started) == 0
    built = started["trainer"]
    assert lora_only(built.model) == []
    assert built.cp_history and all(r.loss == r.loss for r in built.cp_history)  # a step ran, finite
    if trainer == "dpo":
        assert built.ref_model is None  # the policy with its adapter disabled


def test_a_peft_key_loraconfig_lacks_and_target_modules_that_match_nothing_are_refused(model_dir, tmp_path):
    rows = [{"input_ids": [1, 2, 3]}]
    path = write_config(tmp_path, "cp", model_dir, rows, {}, peft={"rank": 4, "target_modules": ["q_proj"]})
    with pytest.raises(TrainConfigError, match=r"unknown key peft\.rank: .*LoraConfig's fields: .*lora_alpha.*\br\b"):
        load_config(path, [], TRAINERS)
    path = write_config(tmp_path, "cp", model_dir, rows, {}, peft={"layers_pattern": "layers"})
    with pytest.raises(TrainConfigError, match=r"peft: LoraConfig refused the section: .*layers_to_transform"):
        load_config(path, [], TRAINERS)
    path = write_config(tmp_path, "cp", model_dir, rows, {}, peft={"r": 0, "target_modules": ["q_proj"]})
    with pytest.raises(TrainConfigError, match=r"peft: .*`r` should be a positive integer"):
        dry_run(path, [], world_size=1)
    path = write_config(tmp_path, "cp", model_dir, rows, {}, peft={"r": 4, "target_modules": ["qkv"]})
    with pytest.raises(TrainConfigError, match=r"peft: Target modules \{'qkv'\} not found in the base model"):
        dry_run(path, [], world_size=1)
