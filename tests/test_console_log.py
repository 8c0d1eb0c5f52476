"""What a training run prints per log line: the Trainer's keys and a handful of cp/ ones
(measure/console.py); every cp/ key still reaches the log history (trainer_state.json), which
`hf-cp report` reads; `cp_log_all_metrics: true` prints them all."""

from __future__ import annotations

import ast
import warnings

import pytest
import torch
from datasets import Dataset
from transformers.trainer_callback import PrinterCallback

from hf_cp.train import CPTrainer, CPTrainingArguments
from hf_cp.train.measure.console import CONSOLE_KEYS, QuietPrinterCallback, console_view
from hf_cp.train.setup.trainer_setup import quiet_engine_deprecations

from helpers.harness.models import synthetic_rows, tiny_model

LENGTHS = [40, 90, 200, 30, 120, 60]


def _train(tmp_path, capsys, **kw):
    args = CPTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        cp_balancer="static",
        cp_max_tokens_per_rank=256,
        cp_tokens_per_step=300,
        max_steps=2,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        cp_compare_balancer=None,
        cp_profile="cpu",
        **kw,
    )
    trainer = CPTrainer(model=tiny_model(0), args=args, train_dataset=Dataset.from_list(synthetic_rows(LENGTHS)))
    capsys.readouterr()
    trainer.train()
    printed = [ast.literal_eval(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{'loss'")]
    history = [h for h in trainer.state.log_history if "loss" in h]
    return trainer, printed, history


def test_the_console_shows_a_handful_of_cp_keys_and_the_history_keeps_all(tmp_path, capsys):
    trainer, printed, history = _train(tmp_path, capsys)
    assert sum(type(cb) is QuietPrinterCallback for cb in trainer.callback_handler.callbacks) == 1
    assert not any(type(cb) is PrinterCallback for cb in trainer.callback_handler.callbacks)
    assert printed and len(printed) == len(history)
    shown = {k for line in printed for k in line if k.startswith("cp/")}
    kept = {k for h in history for k in h if k.startswith("cp/")}
    assert shown and shown <= set(CONSOLE_KEYS), shown
    assert len(kept) >= len(shown) + 8, kept  # the spread, slowest rank, waves, planner time, ...
    assert {"cp/measured_max_ms", "cp/slowest_rank", "cp/world_size"} <= kept  # what hf-cp report reads
    assert "loss" in printed[0] and "grad_norm" in printed[0]


def test_cp_log_all_metrics_prints_every_key(tmp_path, capsys):
    _, printed, history = _train(tmp_path, capsys, cp_log_all_metrics=True)
    assert printed and {k for k in printed[0] if k.startswith("cp/")} == {k for k in history[0] if k.startswith("cp/")}


@pytest.mark.parametrize("key, shown", [("loss", True), ("cp/tokens_per_s", True), ("cp/measured_min_ms", False)])
def test_console_view(key, shown):
    assert (key in console_view({key: 1.0})) is shown


def _deprecations_seen(call) -> list:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # as the training loop's catch_warnings blocks leave it
        quiet_engine_deprecations()
        with pytest.raises((ValueError, RuntimeError)):  # no process group here: the call fails after warning
            call(torch.zeros(2), torch.zeros(1))
        warnings.warn("some other deprecation", FutureWarning, stacklevel=1)
    return [str(w.message) for w in seen]


@pytest.mark.parametrize("name", ["all_gather_into_tensor", "reduce_scatter_tensor"])
def test_torch_deprecations_of_deepspeeds_collectives_are_not_printed(name):
    """ZeRO-3 called them on every module gather: 254 warning lines in the CPU main job."""
    seen = _deprecations_seen(getattr(torch.distributed, name))
    assert seen == ["some other deprecation"]  # torch's own (the collective's) went, any other stays


def test_without_the_filter_torch_would_warn():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises((ValueError, RuntimeError)):
            torch.distributed.all_gather_into_tensor(torch.zeros(2), torch.zeros(1))
    assert any("all_gather_into_tensor` is deprecated" in str(w.message) for w in seen)


def test_every_trainer_prepares_deepspeed_through_one_function(monkeypatch):
    """CPTrainer and the rollout trainers (GRPO, RLOO) call prepare_deepspeed before DeepSpeed
    starts: the GRPO config printed torch's collective deprecations, CPTrainer's runs did not."""
    import inspect
    from types import SimpleNamespace

    from hf_cp.train import trainer
    from hf_cp.train.objectives import rollout
    from hf_cp.train.setup import trainer_setup

    calls = []
    monkeypatch.setattr(trainer_setup, "skip_deepspeed_shm_build", lambda: calls.append("shm"))
    monkeypatch.setattr(trainer_setup, "quiet_engine_deprecations", lambda: calls.append("quiet"))
    assert trainer_setup.prepare_deepspeed(SimpleNamespace(deepspeed=None)) is None and calls == []
    trainer_setup.prepare_deepspeed(SimpleNamespace(deepspeed="recipes/ds-zero2-cpu.json"))
    assert calls == ["shm", "quiet"]
    for module in (trainer, rollout):
        assert "prepare_deepspeed(args)" in inspect.getsource(module), module.__name__
