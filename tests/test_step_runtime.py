"""The step runtime every trainer composes (hf_cp/train/runtime/step_runtime.py): planning a batch
given at the step with one planner built at start, no trainer borrowing another's methods."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers.trainer_callback import CallbackHandler, ProgressCallback

from hf_cp.balance.toolkit.sample_limit import SampleTooLongError
from hf_cp.planning.worker import Planner
from hf_cp.samples.masks import SampleMask
from hf_cp.train.runtime.step_runtime import StepRuntime
from hf_cp.train.setup.args import CPTrainingArguments
from hf_cp.train.setup.trainer_setup import trainer_planning_setup

from helpers.masked_training import tiny_llama

TRAIN = Path(__file__).resolve().parent.parent / "hf_cp" / "train"


def _runtime(tmp_path, balancer: str = "static") -> StepRuntime:
    args = CPTrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, cp_balancer=balancer, cp_max_tokens_per_rank=256, cp_shuffle=False
    )
    model = tiny_llama()
    setup = trainer_planning_setup(args, model, None, 1)  # no sampler: batches come with each step
    assert setup.sampler is None
    trainer = SimpleNamespace(
        args=args, callback_handler=CallbackHandler([ProgressCallback], None, None, None, None), cp_vision=None
    )
    runtime = StepRuntime(trainer, setup)
    assert [type(cb).__name__ for cb in trainer.callback_handler.callbacks] == ["QuietProgressCallback"]
    runtime.start(model)
    return runtime


def test_batches_given_at_each_step_are_planned_by_the_one_planner_built_at_start(tmp_path):
    runtime = _runtime(tmp_path)
    planner = runtime.planner
    first = runtime.plan_batch(0, [100, 60, 30])
    masks = {1: SampleMask.shared_prompt(20, [30, 40])}
    second = runtime.plan_batch(7, [50, 90], masks)
    assert runtime.planner is planner  # not rebuilt per step (GRPO built one, and a sampler, per step)
    assert first.plan.step == 0 and second.plan.step == 7
    assert sorted(first.plan.sample_ids) == [0, 1, 2] and list(second.batch.lengths) == [50, 90]
    assert second.batch.sample_ids == (0, 1)
    runtime.start(tiny_llama())  # a second start builds nothing again
    assert runtime.planner is planner


def test_a_given_sample_too_long_is_named_with_the_step_and_the_callers_label(tmp_path):
    runtime = _runtime(tmp_path)
    with pytest.raises(SampleTooLongError) as err:
        runtime.plan_batch(4, [100, 5000], label=lambda sid: f"GRPO group {sid} (prompt of 12 tokens)")
    text = str(err.value)
    assert text.startswith("step 5: ") and "GRPO group 1 (prompt of 12 tokens)" in text, text


def test_a_planner_without_a_sampler_plans_only_what_it_is_given(tmp_path):
    runtime = _runtime(tmp_path)
    with pytest.raises(ValueError, match="this planner has no sampler; pass the step's batch"):
        runtime.planner.plan_now(0)
    with pytest.raises(ValueError, match="lookahead must be 0"):
        Planner(None, "static", runtime.cluster, runtime.cost, lookahead=2)


def _borrowed_methods(root: Path):
    """`name = SomeTrainer.method` in a class body: a method borrowed by assignment."""
    found = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Attribute):
                    owner = stmt.value.value
                    if isinstance(owner, ast.Name) and owner.id.endswith("Trainer"):
                        found.append(f"{path.name}: {node.name}.{stmt.targets[0].id} = {owner.id}.{stmt.value.attr}")
    return found


def test_no_trainer_borrows_another_trainers_methods_and_grpo_builds_no_planner_in_its_step(tmp_path):
    assert _borrowed_methods(TRAIN) == []
    grpo = (TRAIN / "objectives" / "grpo.py").read_text()
    assert "Planner(" not in grpo and "GlobalBatchSampler(" not in grpo
    # the check sees a borrowed method
    copy = tmp_path / "train"
    copy.mkdir()
    (copy / "x.py").write_text("class A:\n    _cp_backward = CPTrainer._cp_backward\n")
    assert _borrowed_methods(copy) == ["x.py: A._cp_backward = CPTrainer._cp_backward"]
