"""CPKTOTrainer (hf_cp.train.objectives.kto) against TRL's own KTOTrainer on the same global
batches: per-step losses, TRL's metrics and every parameter's gradient within fp32 noise at
world 1, for both loss types, class weights and paired data that TRL unpairs; the steps do not
line up with the runs the mismatched KL completions rotate within, so the KL term is TRL's, not a
per-step one. The hf_cp trainer at world 2 (gloo processes, a prompt longer than one rank's cap)
against world 1; a deliberately wrong KL estimate (x 1.001) and a wrong desirable weight caught by
the same comparison; evaluation against TRL's; the settings and data it refuses, by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")  # the optional `trl` extra

import helpers.kto_runs as kto_runs  # noqa: E402
from helpers.dpo_runs import grad_gap  # noqa: E402
from helpers.harness.job import run_distributed  # noqa: E402

STEPS = 3
GRAD_TOL = 2e-5  # max |difference| / max |gradient| of a parameter: fp32 noise is ~1e-6
LR = 5e-4


def compare(tmp_path, rows=None, **kw):
    rows = rows or kto_runs.kto_rows(12)
    kw.setdefault("learning_rate", LR)
    batches, losses, grads, logs = kto_runs.hf_cp_run(rows, str(tmp_path / "hf_cp"), STEPS, **kw)
    assert len(batches) == STEPS and all(batches)
    trl_kw = {k: v for k, v in kw.items() if not k.startswith("cp_")}
    trl_losses, trl_grads, trl_logs = kto_runs.trl_run(rows, batches, str(tmp_path / "trl"), **trl_kw)
    return batches, losses, grads, logs, trl_losses, trl_grads, trl_logs


METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.mark.parametrize(
    "settings",
    [dict(), dict(loss_type="apo_zero_unpaired"), dict(desirable_weight=0.6, undesirable_weight=1.3, beta=0.3)],
    ids=["kto", "apo_zero_unpaired", "class_weights"],
)
def test_losses_metrics_and_gradients_equal_trls_kto_trainer(tmp_path, settings):
    batches, losses, grads, logs, trl_losses, trl_grads, trl_logs = compare(tmp_path, **settings)
    runs = kto_runs.KL_BATCH
    assert any(b[0] % runs or len(b) % runs for b in batches), "a step that does not line up with the KL runs"
    gap = grad_gap(grads, trl_grads)
    print(settings, "batches", batches, "losses", losses, trl_losses, "gradient gap", gap)
    assert losses == pytest.approx(trl_losses, rel=1e-5, abs=1e-6)
    assert gap < GRAD_TOL
    assert len(set(round(x, 6) for x in losses)) == STEPS, "the steps differ: the policy moved"
    for key in METRICS:
        ours = [x[key] for x in logs if key in x]
        theirs = [x[key] for x in trl_logs if key in x]
        assert ours and len(ours) == len(theirs) and ours == pytest.approx(theirs, rel=1e-4, abs=1e-5), key
    if settings.get("loss_type") != "apo_zero_unpaired":
        assert max(x["kl"] for x in logs if "kl" in x) > 0.1, "the KL term was exercised"


def test_a_gated_deltanet_hybrid_equals_trls_kto_trainer(tmp_path):
    """Qwen3-Next: each completion (and KL completion) runs through the Gated DeltaNet layer
    after its prompt, the reference's layers per document too, as TRL runs every row apart."""
    batches, losses, grads, logs, trl_losses, trl_grads, trl_logs = compare(tmp_path, family="qwen3_next")
    gap = grad_gap(grads, trl_grads)
    print("hybrid losses", losses, trl_losses, "gradient gap", gap)
    assert losses == pytest.approx(trl_losses, rel=1e-5, abs=1e-6)
    assert gap < GRAD_TOL
    assert len(set(round(x, 6) for x in losses)) == STEPS, "the steps differ: the policy moved"


def test_paired_data_is_unpaired_as_trl_does(tmp_path):
    from helpers.dpo_runs import preference_rows

    batches, losses, grads, _, trl_losses, trl_grads, _ = compare(tmp_path, rows=preference_rows(6))
    assert sum(len(b) for b in batches) <= 12  # 6 pairs -> 12 examples
    assert losses == pytest.approx(trl_losses, rel=1e-5, abs=1e-6)
    assert grad_gap(grads, trl_grads) < GRAD_TOL


@pytest.mark.parametrize("break_kind", ["kl", "desirable_weight"])
def test_a_wrong_kl_or_weight_is_caught(tmp_path, monkeypatch, break_kind):
    """The comparison has teeth: the KL estimate x 1.001, or the desirable weight x 1.001."""
    import hf_cp.train.objectives.kto as kto
    import hf_cp.train.objectives.kto_loss as kto_loss

    if break_kind == "kl":
        real = kto_loss.kl_estimate
        monkeypatch.setattr(kto, "kl_estimate", lambda p, r: real(p, r) * 1.001)
    else:
        real_from = kto_loss.KTOSettings.from_config.__func__

        def off(cls, args):
            s = real_from(cls, args)
            return kto_loss.KTOSettings(s.beta, s.loss_type, s.desirable_weight * 1.001, s.undesirable_weight)

        monkeypatch.setattr(kto_loss.KTOSettings, "from_config", classmethod(off))
    _, losses, grads, _, trl_losses, trl_grads, _ = compare(tmp_path)
    wrong = losses != pytest.approx(trl_losses, rel=1e-5, abs=1e-6) or grad_gap(grads, trl_grads) >= GRAD_TOL
    assert wrong, f"a {break_kind} off by 0.1% went unnoticed"


def test_evaluation_gives_trls_loss_and_metrics(tmp_path):
    """hf_cp's evaluate estimates the KL over the whole eval set; TRL's over each eval batch: with
    one eval batch of the whole set, the two are one computation."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    from helpers.dpo_runs import SETTINGS
    from helpers.tiny_tokenizer import tiny_chat_model, tiny_chat_tokenizer

    rows = kto_runs.kto_rows(12)
    trainer = kto_runs.hf_cp_trainer(rows, str(tmp_path / "hf_cp"), 1)
    ours = trainer.evaluate(Dataset.from_list(rows[:7]))
    model = tiny_chat_model(0, attn="eager")
    args = KTOConfig(
        output_dir=str(tmp_path / "trl"),
        max_steps=1,
        **dict(SETTINGS, per_device_train_batch_size=kto_runs.KL_BATCH, per_device_eval_batch_size=7, max_length=None),
    )
    trl = KTOTrainer(
        model=model,
        ref_model=tiny_chat_model(0, attn="eager"),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tiny_chat_tokenizer(),
    )
    with torch.no_grad():  # move the policy off the reference so that the KL and rewards are not 0
        for a, b in zip(trainer.model.parameters(), trl.model.parameters()):
            a.add_(torch.randn_like(a) * 0.02, alpha=1.0)
            b.copy_(a)
    ours = trainer.evaluate(Dataset.from_list(rows[:7]))
    theirs = trl.evaluate(Dataset.from_list(rows[:7]))
    print("ours", ours, "theirs", theirs)
    assert ours["eval_samples"] == 7
    assert ours["eval_kl"] > 0.01
    for key in ("loss",) + METRICS:
        assert ours[f"eval_{key}"] == pytest.approx(theirs[f"eval_{key}"], rel=1e-4, abs=1e-5), key


# ---------------------------------------------------------------- refusals
def _trainer(tmp_path, rows=None, **kw):
    return kto_runs.hf_cp_trainer(rows or kto_runs.kto_rows(6), str(tmp_path), 1, **kw)


@pytest.mark.parametrize(
    "setting, message",
    [
        (dict(precompute_ref_log_probs=True), "precompute_ref_log_probs=True is not supported yet"),
        (dict(max_length=64), "max_length=64 would truncate examples"),
        (dict(pad_to_multiple_of=8), "pad_to_multiple_of=8 shapes TRL's padded batches"),
        (dict(activation_offloading=True), "activation_offloading=True"),
        (dict(cp_kl_batch_size=1), "cp_kl_batch_size=1"),
    ],
)
def test_unsupported_settings_are_refused_by_name(tmp_path, setting, message):
    with pytest.raises(ValueError, match=message):
        _trainer(tmp_path, **setting)


def test_data_it_cannot_train_is_refused_naming_the_example(tmp_path):
    from datasets import Dataset

    from hf_cp.train.objectives.kto import CPKTOConfig, CPKTOTrainer, kto_sample

    rows = kto_runs.kto_rows(6)
    rows[4] = dict(rows[4], completion="  ")
    with pytest.raises(ValueError, match="train example 4: the completion answer is empty"):
        _trainer(tmp_path, rows)
    with pytest.raises(ValueError, match="KTO example 3: the prompt has no tokens"):
        kto_sample({"prompt_ids": [], "completion_ids": [5], "KL_completion_ids": [6]}, 3)
    stream = Dataset.from_list(kto_runs.kto_rows(4)).to_iterable_dataset()
    args = CPKTOConfig(output_dir=str(tmp_path), max_steps=1, cp_profile="cpu", use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="CPKTOTrainer: a streaming train_dataset is not supported"):
        CPKTOTrainer(model=None, args=args, train_dataset=stream)
    long = kto_runs.kto_rows(6, long_prompt=700)
    trainer = _trainer(tmp_path / "long", long, cp_max_tokens_per_rank=128)  # world 1: one rank holds 128
    with pytest.raises(ValueError, match=r"sample 1\b"):
        trainer.train()


@pytest.mark.parametrize("trainer", ["dpo", "kto"])
@pytest.mark.parametrize("which", ["policy", "reference model"])
def test_a_model_without_hf_cp_attention_is_refused_when_the_trainer_is_built(tmp_path, trainer, which):
    """Before: refused only at the first step, as 'samples carry attention masks ... that only it reads'."""
    import copy

    import helpers.dpo_runs as dpo_runs
    from helpers.tiny_tokenizer import tiny_chat_model

    runs = dpo_runs if trainer == "dpo" else kto_runs
    rows = dpo_runs.preference_rows(4) if trainer == "dpo" else kto_runs.kto_rows(4)
    real = copy.deepcopy

    def sdpa(seed=0, attn="hf_cp", family="llama"):
        return tiny_chat_model(seed, "sdpa" if which == "policy" else attn, family)

    def sdpa_copy(m, *a):
        out = real(m, *a)
        if which == "reference model" and hasattr(out, "set_attn_implementation"):
            out.set_attn_implementation("sdpa")
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runs, "tiny_chat_model", sdpa)
        mp.setattr(runs.copy, "deepcopy", sdpa_copy)
        with pytest.raises(ValueError, match=f"{which} uses attn_implementation='sdpa'"):
            runs.hf_cp_trainer(rows, str(tmp_path), 1)


def test_active_dropout_is_refused(tmp_path):
    from datasets import Dataset

    from hf_cp.train.objectives.kto import CPKTOConfig, CPKTOTrainer

    from helpers.dpo_runs import SETTINGS
    from helpers.tiny_tokenizer import tiny_chat_model, tiny_chat_tokenizer

    model = tiny_chat_model(0)
    model.model.layers[0].mlp.add_module("drop", torch.nn.Dropout(0.1))  # kept: disable_dropout=False
    args = CPKTOConfig(output_dir=str(tmp_path), max_steps=1, disable_dropout=False, cp_profile="cpu", **SETTINGS)
    with pytest.raises(ValueError, match="disable_dropout=True"):
        CPKTOTrainer(
            model=model,
            ref_model=tiny_chat_model(0),
            args=args,
            train_dataset=Dataset.from_list(kto_runs.kto_rows(4)),
            processing_class=tiny_chat_tokenizer(),
        )


HF_CP_OWN = {"per_device_train_batch_size", "max_length", "remove_unused_columns"}


@pytest.mark.parametrize(
    "name, trl_name, own",
    [
        ("kto.CPKTOConfig", "KTOConfig", HF_CP_OWN),
        ("dpo.CPDPOConfig", "DPOConfig", HF_CP_OWN),
        ("sft.CPSFTConfig", "SFTConfig", HF_CP_OWN),
        ("grpo.CPGRPOConfig", "GRPOConfig", set()),
    ],
)
def test_trls_defaults_are_kept(name, trl_name, own):
    """A CP config has its TRL config's defaults (DPOConfig's learning rate 1e-6, logging_steps 10,
    gradient_checkpointing True, ...), except the settings hf_cp sets itself. Before, the Trainer's
    defaults (5e-5, 500, False) silently replaced them."""
    import dataclasses
    import importlib

    import trl

    module, cls = name.split(".")
    ours = getattr(importlib.import_module(f"hf_cp.train.objectives.{module}"), cls)
    theirs = getattr(trl, trl_name)
    a = ours(output_dir="unused", use_cpu=True, bf16=False)
    b = theirs(output_dir="unused", use_cpu=True, bf16=False)
    differ = {f.name for f in dataclasses.fields(theirs) if getattr(a, f.name) != getattr(b, f.name)}
    assert differ == own, differ
    assert a.learning_rate == b.learning_rate and a.logging_steps == b.logging_steps


# ---------------------------------------------------------------- world 2 against world 1
WORLD_RUNS = {
    "auto": {},
    "static_ring": dict(cp_balancer="static"),
    "usp_ulysses": dict(cp_balancer="usp"),
    "magi_blocks": dict(cp_balancer="magi"),
}


def test_world_2_equals_world_1(tmp_path):
    rows = kto_runs.kto_rows(12, long_prompt=300)  # example 1 is over one rank's cap
    cap = 256
    runs = [
        dict(out=str(tmp_path / f"w2_{name}"), settings=dict(s, cp_max_tokens_per_rank=cap, learning_rate=LR))
        for name, s in WORLD_RUNS.items()
    ]
    run_distributed(dict(rows=rows, steps=2, runs=runs), 2, timeout=900, module="helpers.kto_runs")
    batches, losses, grads, _ = kto_runs.hf_cp_run(rows, str(tmp_path / "w1"), 2, learning_rate=LR)
    for run, name in zip(runs, WORLD_RUNS):
        got = torch.load(Path(run["out"]) / "kto.pt")
        assert got["batches"] == batches
        assert got["losses"] == pytest.approx(losses, rel=1e-5)
        gap = grad_gap(got["grads"], grads)
        print(f"world 2 {name}: losses {got['losses']} gradient gap {gap:.2e}")
        assert gap < GRAD_TOL, name
        history = [json.loads(x) for x in (Path(run["out"]) / "cp_history" / "rank0.jsonl").read_text().splitlines()]
        assert any(int(g) > 1 for r in history for g in r["cp_size_samples"]), f"{name}: the long example was spread"
