"""CPDPOTrainer (hf_cp.train.objectives.dpo) against TRL's own DPOTrainer on the same global batches: per-step
losses and every parameter's gradient within fp32 noise at world 1, for several loss types, a
combination with loss_weights, precomputed reference log-probs and evaluation; the hf_cp trainer
at worlds 2 and 4 (gloo processes, a prompt longer than one rank's cap) against world 1; a
deliberately wrong loss (the rejected answers' log-probs x 1.001) caught by the same comparison;
and the settings and data it refuses, by name."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")  # the optional `trl` extra

from helpers.dpo_runs import grad_gap, hf_cp_run, preference_rows, trl_run  # noqa: E402
from helpers.harness.job import free_port, run_distributed, run_launcher  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STEPS = 2
GRAD_TOL = 2e-5  # max |difference| / max |gradient| of a parameter: fp32 noise is ~1e-6


def compare(tmp_path, rows=None, trl_kw=None, **kw):
    rows = rows or preference_rows(8)
    batches, losses, grads, logs = hf_cp_run(rows, str(tmp_path / "hf_cp"), STEPS, **kw)
    assert len(batches) == STEPS and all(batches)
    trl_losses, trl_grads, trl_logs = trl_run(
        rows, batches, str(tmp_path / "trl"), **dict(kw_for_trl(kw), **(trl_kw or {}))
    )
    return losses, grads, logs, trl_losses, trl_grads, trl_logs


def kw_for_trl(kw: dict) -> dict:
    """The DPOConfig settings of an hf_cp run (without hf_cp's own and the runner's keys)."""
    return {k: v for k, v in kw.items() if not k.startswith("cp_") and k not in ("ref", "precompute_ref_log_probs")}


@pytest.mark.parametrize(
    "loss",
    [
        dict(loss_type=["sigmoid"]),
        dict(loss_type=["ipo"]),
        dict(loss_type=["hinge"]),
        dict(loss_type=["apo_zero"]),
        dict(loss_type=["sft"]),
        dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]),
    ],
    ids=["sigmoid", "ipo", "hinge", "apo_zero", "sft", "sigmoid+0.5sft"],
)
def test_losses_and_gradients_equal_trls_dpo_trainer(tmp_path, loss):
    losses, grads, logs, trl_losses, trl_grads, trl_logs = compare(tmp_path, **loss)
    print(loss, "losses", losses, trl_losses, "gradient gap", grad_gap(grads, trl_grads))
    assert losses == pytest.approx(trl_losses, rel=1e-5, abs=1e-6)
    assert grad_gap(grads, trl_grads) < GRAD_TOL
    assert losses[0] != pytest.approx(losses[1]), "the steps differ: the policy moved"
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        ours = [x[key] for x in logs if key in x]
        theirs = [x[key] for x in trl_logs if key in x]
        assert len(ours) == STEPS and ours == pytest.approx(theirs, rel=1e-4, abs=1e-5), key


def test_a_gated_deltanet_hybrid_equals_trls_dpo_trainer(tmp_path):
    """Qwen3-Next's shared-prompt pairs: each answer runs through the Gated DeltaNet layer after
    the prompt (attention/recurrent.py), as TRL runs prompt+chosen and prompt+rejected apart."""
    losses, grads, logs, trl_losses, trl_grads, trl_logs = compare(tmp_path, family="qwen3_next")
    print("hybrid losses", losses, trl_losses, "gradient gap", grad_gap(grads, trl_grads))
    assert losses == pytest.approx(trl_losses, rel=1e-5, abs=1e-6)
    assert grad_gap(grads, trl_grads) < GRAD_TOL
    assert losses[0] != pytest.approx(losses[1]), "the steps differ: the policy moved"


@pytest.mark.slow
@pytest.mark.parametrize(
    "loss",
    [
        dict(loss_type=["exo_pair"], label_smoothing=0.1),
        dict(loss_type=["nca_pair"]),
        dict(loss_type=["robust"], label_smoothing=0.2),
        dict(loss_type=["bco_pair"]),
        dict(loss_type=["sppo_hard"]),
        dict(loss_type=["aot"]),
        dict(loss_type=["aot_unpaired"]),
        dict(loss_type=["apo_down"]),
        dict(loss_type=["discopop"]),
        dict(loss_type=["sigmoid_norm"]),
        dict(loss_type=["sigmoid"], f_divergence_type="forward_kl"),
        dict(loss_type=["sigmoid"], f_divergence_type="js_divergence"),
        dict(loss_type=["hinge"], f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.5),
    ],
    ids=lambda d: "+".join(d["loss_type"]) + ("-" + d["f_divergence_type"] if "f_divergence_type" in d else ""),
)
def test_every_other_supported_loss_equals_trls(tmp_path, loss):
    """The remaining TRL 1.16 loss types and f-divergences objectives/dpo_loss.py reproduces. The first step
    (same parameters) to 1e-6; after one AdamW step, whose update turns fp32 noise in near-zero
    gradient entries into whole steps, the loss to 1e-4 and the gradients to 1e-3 (sppo_hard's
    large gradients measured 1.2e-4 there; 6e-7 at the first step)."""
    losses, grads, _, trl_losses, trl_grads, _ = compare(tmp_path, **loss)
    first, later = grad_gap(grads[:1], trl_grads[:1]), grad_gap(grads[1:], trl_grads[1:])
    print(loss, "losses", losses, trl_losses, "gradient gap", first, later)
    assert losses[0] == pytest.approx(trl_losses[0], rel=1e-6, abs=1e-7)
    assert first < GRAD_TOL
    assert losses[1:] == pytest.approx(trl_losses[1:], rel=1e-4, abs=1e-6)
    assert later < 1e-3


def test_precomputed_reference_log_probs_equal_trls_precompute(tmp_path):
    losses, grads, _, trl_losses, trl_grads, _ = compare(
        tmp_path, ref=False, precompute_ref_log_probs=True, trl_kw=dict(precompute=True)
    )
    assert losses == pytest.approx(trl_losses, rel=1e-5, abs=1e-6)
    assert grad_gap(grads, trl_grads) < GRAD_TOL
    saved = json.loads((tmp_path / "hf_cp" / "cp_reference_logps.json").read_text())
    assert len(saved["pairs"]) == 8, "every training pair's reference log-probs, for resumed runs"


@pytest.mark.parametrize("precompute, passes, checkpointing", [(False, 2, False), (True, 1, False), (False, 2, True)])
def test_the_predicted_step_counts_the_log_prob_and_reference_passes(tmp_path, precompute, passes, checkpointing):
    # a DPO step runs the policy's log-prob pass and the reference's (unless precomputed) over the
    # plan before its training pass: the prediction counts them, the record measures them, and the
    # calibration fits the training pass alone (its wall less theirs). Under activation
    # checkpointing the training pass runs its forward twice: a forward-only pass is then
    # share / (1 + share) of it (1/4 for the default 1/3)
    from helpers.dpo_runs import hf_cp_trainer

    kw = dict(ref=False, precompute_ref_log_probs=True) if precompute else {}
    trainer = hf_cp_trainer(preference_rows(8), str(tmp_path), 2, gradient_checkpointing=checkpointing, **kw)
    seen = []
    observe = trainer.cp_calibration.observe
    trainer.cp_calibration.observe = lambda rec, ps: seen.append((rec, ps)) or observe(rec, ps)
    trainer.train()
    fs = trainer.cp_cost.profile.forward_share
    share = fs / (1 + fs) if checkpointing else fs
    for rec, ps in seen:
        assert rec.forward_only_passes == passes
        assert 0 < rec.forward_only_ms < rec.step_wall_ms
        extra = passes * share * max(ps.predicted.occupied_ms)
        assert rec.predicted_step_ms == pytest.approx(ps.predicted.makespan_ms + extra)
    # the training pass's own time is still what the per-rank compute measures
    assert all(max(rec.measured_ms) < rec.step_wall_ms - rec.forward_only_ms + 1.0 for rec, _ in seen)


def test_a_wrong_rejected_log_prob_is_caught(tmp_path, monkeypatch):
    """The comparison's power: the rejected answers' log-probs x 1.001 before the loss."""
    import hf_cp.train.objectives.dpo as dpo

    real = dpo.dpo_loss

    def broken(s, chosen, rejected, *rest):
        return real(s, chosen, rejected * 1.001, *rest)

    monkeypatch.setattr(dpo, "dpo_loss", broken)
    losses, grads, _, trl_losses, trl_grads, _ = compare(tmp_path)
    print("with the rejected log-probs x 1.001: gradient gap", grad_gap(grads, trl_grads), losses, trl_losses)
    assert grad_gap(grads, trl_grads) > 10 * GRAD_TOL


def test_evaluation_gives_trls_loss_and_reward_metrics(tmp_path):
    from datasets import Dataset

    from helpers.dpo_runs import hf_cp_trainer

    rows = preference_rows(8)
    ours = hf_cp_trainer(rows, str(tmp_path / "hf_cp"), 1)
    metrics = ours.evaluate(Dataset.from_list(rows[:5]))  # raw pairs: TRL's pipeline first
    assert metrics["eval_samples"] == 5
    # TRL: its own eval on one batch of the same 5 pairs
    import copy

    from trl import DPOConfig, DPOTrainer

    from helpers.dpo_runs import SETTINGS
    from helpers.tiny_tokenizer import tiny_chat_model, tiny_chat_tokenizer

    model = tiny_chat_model(0, attn="eager")
    trl = DPOTrainer(
        model=model,
        ref_model=copy.deepcopy(model),
        args=DPOConfig(output_dir=str(tmp_path / "trl"), per_device_eval_batch_size=5, max_length=None, **SETTINGS),
        train_dataset=Dataset.from_list(rows),
        processing_class=tiny_chat_tokenizer(),
    )
    theirs = trl.evaluate(Dataset.from_list(rows[:5]))
    assert metrics["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-5)
    for key in ("eval_rewards/margins", "eval_logps/chosen", "eval_logps/rejected"):
        assert metrics[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-5), key


# ---------------------------------------------------------------- vision-language policies (issue 38)
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
def test_a_vision_language_policy_on_text_pairs_equals_trls_dpo_trainer(tmp_path, family):
    """A tiny Qwen2.5-VL (M-RoPE) or Qwen3.5 (M-RoPE beside a Gated DeltaNet layer) policy on
    text-only pairs: each answer's M-RoPE positions continue from the prompt's end on every row,
    as in TRL's prompt+answer rows; the tower, unused, gets no gradient in either. Measured: step
    1's gradients within 7.2e-7 (Qwen2.5-VL), after one AdamW step within 5.7e-6 (Qwen2.5-VL) and
    1.4e-5 (Qwen3.5; 2.4e-5 on another CPU: AdamW's first update is about +-lr for every entry
    whatever its gradient's size, so step 1's fp32 noise on near-zero entries moves step 2 by
    more than noise; step 1 itself stays within 2e-6, which a loss scaled by 1.001 fails)."""
    losses, grads, _, trl_losses, trl_grads, _ = compare(tmp_path, family=family)
    print(
        family,
        "losses",
        losses,
        trl_losses,
        "gradient gap",
        grad_gap(grads[:1], trl_grads[:1]),
        grad_gap(grads, trl_grads),
    )
    assert losses == pytest.approx(trl_losses, rel=1e-5, abs=1e-6)
    assert grad_gap(grads[:1], trl_grads[:1]) < 2e-6
    assert grad_gap(grads, trl_grads) < (5e-5 if family == "qwen3_5" else GRAD_TOL)
    assert not any("visual" in name for name in grads[0]), "text pairs leave the tower without gradients"
    assert losses[0] != pytest.approx(losses[1]), "the steps differ: the policy moved"


def test_a_vision_language_policy_on_text_pairs_at_world_2_equals_world_1(tmp_path):
    """The tiny Qwen2.5-VL on text pairs at world 2 (gloo), the long pair over a CP group of 2."""
    rows = preference_rows(8, long_prompt=300)
    run = dict(out=str(tmp_path / "w2"), settings=dict(family="qwen2_5_vl", cp_max_tokens_per_rank=256))
    run_distributed(dict(rows=rows, steps=STEPS, runs=[run]), 2, timeout=600, module="helpers.dpo_runs")
    batches, losses, grads, _ = hf_cp_run(rows, str(tmp_path / "w1"), STEPS, family="qwen2_5_vl")
    got = torch.load(Path(run["out"]) / "dpo.pt")
    print("world 2 losses", got["losses"], losses, "gradient gap", grad_gap(got["grads"], grads))
    assert got["batches"] == batches
    assert got["losses"] == pytest.approx(losses, rel=1e-5)
    assert grad_gap(got["grads"], grads) < GRAD_TOL
    history = [json.loads(x) for x in (Path(run["out"]) / "cp_history" / "rank0.jsonl").read_text().splitlines()]
    assert any(int(g) > 1 for r in history for g in r["cp_size_samples"]), "the long pair ran over a group"


def _image(i: int):
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.default_rng(i).random((16, 16, 3)) * 255).astype("uint8"))


def _image_pairs(n: int = 4):
    """TRL's vision preference format: a conversational prompt with an image part, its `images`."""
    return [
        dict(
            prompt=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Q{i}: what is it?"}]}],
            chosen=[{"role": "assistant", "content": " a square" * (1 + i)}],
            rejected=[{"role": "assistant", "content": " a disc" * (2 + i)}],
            images=[_image(i)],
        )
        for i in range(n)
    ]


def _vlm_dpo_trainer(tmp_path, train, eval_dataset=None):
    from datasets import Dataset

    from hf_cp.train.objectives.dpo import CPDPOConfig, CPDPOTrainer

    from helpers.dpo_runs import SETTINGS
    from helpers.tiny_tokenizer import tiny_chat_tokenizer
    from helpers.tiny_vlm import build_vlm

    args = CPDPOConfig(output_dir=str(tmp_path), max_steps=1, cp_profile="cpu", cp_shuffle=False, **SETTINGS)
    model = build_vlm("hf_cp")
    return CPDPOTrainer(
        model=model,
        ref_model=copy.deepcopy(model),
        args=args,
        train_dataset=Dataset.from_list(train),
        eval_dataset=None if eval_dataset is None else Dataset.from_list(eval_dataset),
        processing_class=tiny_chat_tokenizer(),
    )


IMAGE_PAIRS = "CPDPOTrainer: pairs with images need the model's processor as processing_class, got TokenizersBackend"


def test_pairs_with_images_and_a_bare_tokenizer_are_refused_by_name_before_any_work(tmp_path):
    """TRL's vision pairs train with the model's processor as processing_class
    (tests/test_dpo_vision.py); with a tokenizer alone, train or eval pairs with images are refused
    at set-up, and evaluate() on them after text training too. Before issue 38's image pairs
    (measured): CPTrainer's "train_dataset has no 'input_ids' column ... tokenise it first" at
    set-up; an eval dataset with images beside text pairs failed in TRL's text pipeline ("Number
    of images provided (0) does not match ...")."""
    with pytest.raises(ValueError, match=IMAGE_PAIRS) as caught:
        _vlm_dpo_trainer(tmp_path / "train", _image_pairs())
    assert "load_vision_processor" in str(caught.value)
    with pytest.raises(ValueError, match=IMAGE_PAIRS):
        _vlm_dpo_trainer(tmp_path / "eval", preference_rows(4), eval_dataset=_image_pairs())
    trainer = _vlm_dpo_trainer(tmp_path / "evaluate", preference_rows(4))
    from datasets import Dataset

    with pytest.raises(ValueError, match="eval has pairs with images, but the training pairs have none"):
        trainer.evaluate(Dataset.from_list(_image_pairs()))


def test_pairs_with_a_processors_pixel_columns_are_refused_by_name(tmp_path):
    """Text pairs carrying pixel_values / image_grid_thw (a processor's columns) have no image
    placeholders in their prompts: refused at set-up naming the trainer and the columns, and
    TRL's vision pairs named instead."""
    import numpy as np

    rows = [
        dict(r, pixel_values=np.zeros((16, 96), np.float32).tolist(), image_grid_thw=[[1, 4, 4]])
        for r in preference_rows(4)
    ]
    with pytest.raises(ValueError, match="CPDPOTrainer: train has vision columns .*give TRL's vision pairs instead"):
        _vlm_dpo_trainer(tmp_path, rows)


# ---------------------------------------------------------------- refusals, by name
def _trainer(tmp_path, rows=None, **kw):
    from helpers.dpo_runs import hf_cp_trainer

    return hf_cp_trainer(rows or preference_rows(4), str(tmp_path), 1, **kw)


@pytest.mark.parametrize(
    "setting, message",
    [
        (dict(use_weighting=True), "use_weighting"),
        (dict(ld_alpha=0.5), "ld_alpha"),
        (dict(max_length=512), "max_length=512"),
        (dict(loss_type=["bco"]), "loss_type"),
        (dict(activation_offloading=True), "activation_offloading=True"),
        (dict(pad_to_multiple_of=8), "pad_to_multiple_of=8"),
        (dict(precompute_ref_batch_size=4), "precompute_ref_batch_size=4"),
        (dict(padding_free=True), "padding_free=True asks TRL for padding-free batches"),
    ],
)
def test_unsupported_settings_are_refused_by_name(tmp_path, setting, message):
    with pytest.raises((ValueError, TypeError), match=message):
        _trainer(tmp_path, **setting)


def test_a_streaming_dataset_is_refused_by_name(tmp_path):
    from datasets import Dataset

    from hf_cp.train.objectives.dpo import CPDPOConfig, CPDPOTrainer

    from helpers.dpo_runs import SETTINGS
    from helpers.tiny_tokenizer import tiny_chat_model, tiny_chat_tokenizer

    stream = Dataset.from_list(preference_rows(4)).to_iterable_dataset()
    args = CPDPOConfig(output_dir=str(tmp_path), max_steps=1, cp_profile="cpu", cp_shuffle=False, **SETTINGS)
    with pytest.raises(ValueError, match="CPDPOTrainer: a streaming train_dataset is not supported"):
        CPDPOTrainer(model=tiny_chat_model(0), args=args, train_dataset=stream, processing_class=tiny_chat_tokenizer())


def test_bad_pairs_are_refused_naming_the_pair(tmp_path):
    rows = preference_rows(4)
    rows[2] = dict(rows[2], rejected=rows[2]["chosen"])
    with pytest.raises(ValueError, match="DPO pair 2: the chosen and rejected answers are the same"):
        _trainer(tmp_path, rows)
    from hf_cp.train.objectives.dpo import pair_sample

    with pytest.raises(ValueError, match="DPO pair 7: the rejected answer has no tokens"):
        pair_sample({"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": []}, 7)
    with pytest.raises(ValueError, match="DPO pair 3: the prompt has no tokens"):
        pair_sample({"prompt_ids": [], "chosen_ids": [3], "rejected_ids": [4]}, 3)


@pytest.mark.parametrize("column", ["chosen", "rejected"])
def test_an_empty_answer_is_refused_before_tokenisation_turns_it_into_eos(tmp_path, column):
    # before: TRL tokenised "" to [EOS], and the pair trained with EOS as its answer
    rows = preference_rows(4)
    rows[1] = dict(rows[1], **{column: "   "})
    with pytest.raises(ValueError, match=f"train pair 1: the {column} answer is empty"):
        _trainer(tmp_path, rows)
    from datasets import Dataset

    from hf_cp.train.checks.answers import refuse_empty_answers

    chat = [{"prompt": [{"role": "user", "content": "hi"}], column: [{"role": "assistant", "content": ""}]}]
    with pytest.raises(ValueError, match=f"eval pair 0: the {column} answer is empty"):
        refuse_empty_answers(Dataset.from_list(chat), "eval")


def test_a_pair_longer_than_every_cp_group_is_refused_by_name(tmp_path):
    rows = preference_rows(4, long_prompt=700)
    trainer = _trainer(tmp_path, rows, cp_max_tokens_per_rank=128)  # world 1: one rank holds 128 tokens
    with pytest.raises(ValueError, match=r"sample 1\b"):
        trainer.train()


def test_active_dropout_is_refused(tmp_path):
    """The log-prob pass and the gradient pass must compute one function."""
    from datasets import Dataset

    from hf_cp.train.objectives.dpo import CPDPOConfig, CPDPOTrainer

    from helpers.dpo_runs import SETTINGS
    from helpers.tiny_tokenizer import tiny_chat_model, tiny_chat_tokenizer

    model = tiny_chat_model(0)
    model.model.layers[0].mlp.add_module("drop", torch.nn.Dropout(0.1))  # kept: disable_dropout=False
    args = CPDPOConfig(output_dir=str(tmp_path), max_steps=1, disable_dropout=False, cp_profile="cpu", **SETTINGS)
    with pytest.raises(ValueError, match="disable_dropout=True"):
        CPDPOTrainer(
            model=model,
            ref_model=tiny_chat_model(0),
            args=args,
            train_dataset=Dataset.from_list(preference_rows(4)),
            processing_class=tiny_chat_tokenizer(),
        )


# ---------------------------------------------------------------- worlds 2 and 4 against world 1
# name -> (the world-1 run it must equal, its settings): every way a pair can be placed, the
# long pair over a CP group: auto's choice, blocks (magi), ring zigzag (static), Ulysses (usp)
WORLD_RUNS = {
    "ref": ("ref", {}),
    "pre_magi": ("pre", dict(ref=False, precompute_ref_log_probs=True, cp_balancer="magi")),
    "static_ring": ("ref", dict(cp_balancer="static")),
    "usp_ulysses": ("ref", dict(cp_balancer="usp")),
}


def _check_world(tmp_path: Path, world: int, cap: int):
    rows = preference_rows(8, long_prompt=300)  # pair 1 is over one rank's cap
    runs = []
    for name, (_, settings) in WORLD_RUNS.items():
        settings = dict(settings, cp_max_tokens_per_rank=cap)
        ref = settings.pop("ref", True)
        runs.append(dict(out=str(tmp_path / f"w{world}_{name}"), ref=ref, settings=settings))
    run_distributed(dict(rows=rows, steps=STEPS, runs=runs), world, timeout=900, module="helpers.dpo_runs")
    one = {
        "ref": hf_cp_run(rows, str(tmp_path / "w1_ref"), STEPS),
        "pre": hf_cp_run(rows, str(tmp_path / "w1_pre"), STEPS, ref=False, precompute_ref_log_probs=True),
    }
    for run, (name, (key, _)) in zip(runs, WORLD_RUNS.items()):
        got = torch.load(Path(run["out"]) / "dpo.pt")
        batches, losses, grads, _ = one[key]
        assert got["batches"] == batches
        assert got["losses"] == pytest.approx(losses, rel=1e-5)
        gap = grad_gap(got["grads"], grads)
        print(f"world {world} {name}: losses {got['losses']} gradient gap {gap:.2e}")
        assert gap < GRAD_TOL, name
        history = [json.loads(x) for x in (Path(run["out"]) / "cp_history" / "rank0.jsonl").read_text().splitlines()]
        assert any(int(g) > 1 for r in history for g in r["cp_size_samples"]), f"{name}: the long pair ran over a group"


def test_world_2_equals_world_1(tmp_path):
    _check_world(tmp_path, 2, cap=256)


@pytest.mark.slow
def test_world_4_equals_world_1(tmp_path):
    _check_world(tmp_path, 4, cap=128)


# ---------------------------------------------------------------- the recipe
@pytest.mark.slow
def test_the_recipe_on_two_processes_learns_the_toy_preferences(tmp_path):
    """recipes/trl_dpo.py under `accelerate launch` on 2 CPU processes (DeepSpeed ZeRO-2, gloo),
    the built-in toy preference task, a tiny model: the DPO loss falls from log 2 and the
    preference accuracy rises; the long pairs ran over a CP group of 2."""
    from helpers.tiny_tokenizer import tiny_chat_model, tiny_chat_tokenizer

    model_dir = tmp_path / "model"
    tiny_chat_model(0).save_pretrained(model_dir)
    tiny_chat_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "recipes/cpu-2proc-zero2.yaml"]
    cmd += ["--main_process_port", str(free_port()), "recipes/trl_dpo.py", "--model_path", str(model_dir)]
    cmd += ["--output_dir", str(out), "--use_cpu", "--deepspeed", "recipes/ds-zero2-cpu.json", "--bf16", "false"]
    cmd += ["--cp_max_tokens_per_rank", "640", "--cp_tokens_per_step", "8192", "--cp_profile", "cpu"]
    cmd += ["--max_steps", "16", "--learning_rate", "2e-3", "--logging_steps", "4", "--report_to", "none"]
    cmd += ["--save_strategy", "no", "--cp_compare_balancer", "none"]
    import os

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    p = run_launcher(cmd, env, 1500)
    log = p.stdout + p.stderr
    (tmp_path / "recipe.log").write_text(log)
    assert p.returncode == 0, log[-6000:]
    assert "==== hf_cp + TRL DPO: 2 process(es)" in log
    history = [json.loads(x) for x in (out / "cp_history" / "rank0.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in history]
    print("DPO losses", [round(x, 4) for x in losses])
    assert losses[0] == pytest.approx(0.6931, abs=1e-3), "policy = reference at step 1"
    assert sum(losses[-4:]) / 4 < 0.6, losses
    assert any(int(g) > 1 for r in history for g in r["cp_size_samples"]), "a long pair ran over a CP group"
    accuracy = [line for line in log.splitlines() if "preference accuracy" in line]
    assert accuracy, log[-3000:]
    first, last = (float(x) for x in accuracy[-1].split("preference accuracy ")[1].split(",")[0].split(" -> "))
    assert last > first and last >= 0.75, accuracy[-1]


def test_conversational_pairs_equal_trls(tmp_path):
    """TRL's conversational format (the prompt a list of messages, each answer an assistant
    message), rendered by the chat template in TRL's pipeline: the same steps as TRL's trainer."""
    rows = [
        {
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "chosen": [{"role": "assistant", "content": r["chosen"]}],
            "rejected": [{"role": "assistant", "content": r["rejected"]}],
        }
        for r in preference_rows(8)
    ]
    losses, grads, _, trl_losses, trl_grads, _ = compare(tmp_path, rows=rows)
    assert losses == pytest.approx(trl_losses, rel=1e-5, abs=1e-6)
    assert grad_gap(grads, trl_grads) < GRAD_TOL
