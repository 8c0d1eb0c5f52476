"""cp_max_tokens_per_rank: auto (planning/setup.py fitting_tokens_per_rank): the largest cap, in
steps of 256, whose peak by the memory model the planner uses fits the device's memory less 10%
headroom; said at set-up; refused by name when the device's memory is unknown or nothing fits."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from hf_cp.cost.dims import ModelDims
from hf_cp.planning.setup import (
    AUTO_CAP_HEADROOM,
    AUTO_CAP_MULTIPLE,
    PlanningSettings,
    fitting_tokens_per_rank,
    load_profile,
    planning_setup,
)

ZERO2_BF16 = {"deepspeed": True, "zero_stage": 2, "half_precision": True}


@pytest.mark.parametrize("states", [None, ZERO2_BF16, {"deepspeed": True, "zero_stage": 3, "half_precision": True}])
@pytest.mark.parametrize("world", [1, 8])
def test_the_cap_is_the_largest_whose_peak_fits(states, world):
    settings = PlanningSettings(max_tokens_per_rank="auto", model_dims="qwen2.5-7b", model_states=states)
    setup = planning_setup(settings, [100] * 8, world)
    cap = setup.cluster.max_tokens_per_rank
    budget = setup.cost.profile.device_memory_gb * 1e9 * (1 - AUTO_CAP_HEADROOM)
    assert cap % AUTO_CAP_MULTIPLE == 0 and cap > 0
    # the cost model the planner got (its static bytes at this cap) says the peak fits ...
    assert setup.cost.memory_bytes(cap) <= budget
    # ... and one more step of tokens would not
    bigger = planning_setup(replace(settings, max_tokens_per_rank=cap + AUTO_CAP_MULTIPLE), [100] * 8, world)
    assert bigger.cost.memory_bytes(cap + AUTO_CAP_MULTIPLE) > budget
    assert setup.settings.max_tokens_per_rank == cap and f"{cap} tokens per rank" in setup.cap_note


def test_sharded_states_leave_room_for_more_tokens():
    def cap(states, world=8):
        s = PlanningSettings(max_tokens_per_rank="auto", model_dims="qwen2.5-7b", model_states=states)
        return planning_setup(s, [100], world).cluster.max_tokens_per_rank

    assert cap({**ZERO2_BF16, "zero_stage": 3}) > cap(ZERO2_BF16)


def test_an_unknown_device_memory_and_a_device_too_small_are_refused_by_name():
    with pytest.raises(ValueError, match="'auto' needs the device's memory: the profile 'cpu' has no device_memory_gb"):
        planning_setup(PlanningSettings(max_tokens_per_rank="auto", model_dims="qwen2.5-7b", profile="cpu"), [1], 2)
    small = PlanningSettings(
        max_tokens_per_rank="auto", model_dims="qwen2.5-7b", model_states=ZERO2_BF16, device_memory_gb=8
    )
    with pytest.raises(ValueError, match="not even 256 tokens per rank fit 8 GB"):
        fitting_tokens_per_rank(small, ModelDims.load("qwen2.5-7b"), load_profile(small.profile), 1)
    with pytest.raises(ValueError, match="a positive integer or 'auto', got '8k'"):
        PlanningSettings(max_tokens_per_rank="8k")


def test_cptrainer_sizes_the_cap_from_this_hosts_memory_and_says_so(tmp_path, caplog):
    from datasets import Dataset

    from hf_cp.train import CPTrainer, CPTrainingArguments
    from hf_cp.train.setup.trainer_setup import device_memory_gb

    from helpers.harness.models import synthetic_rows, tiny_model

    args = CPTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        cp_max_tokens_per_rank="auto",
        cp_tokens_per_step=400,
        max_steps=1,
        report_to="none",
        save_strategy="no",
        cp_compare_balancer=None,
        cp_profile="cpu",
    )
    with caplog.at_level(logging.WARNING):
        trainer = CPTrainer(model=tiny_model(0), args=args, train_dataset=Dataset.from_list(synthetic_rows([50, 90])))
    cap = trainer.cp_cluster.max_tokens_per_rank
    memory = device_memory_gb(args.device)
    assert trainer.cp_cost.memory_bytes(cap) <= memory * 1e9 * (1 - AUTO_CAP_HEADROOM)
    assert f"cp_max_tokens_per_rank auto: {cap} tokens per rank" in caplog.text
    assert f"fits {memory:g} GB" in caplog.text


def test_the_dry_run_sizes_the_cap_as_the_trainer_would(tmp_path):
    from pathlib import Path

    import torch

    from hf_cp.train.launch.dry_run import dry_run
    from hf_cp.train.setup.trainer_setup import device_memory_gb

    tiny = str(Path(__file__).resolve().parent.parent / "configs" / "tiny-cpu.yaml")
    overrides = ["training.cp_max_tokens_per_rank=auto", f"training.output_dir={tmp_path}"]
    lines = dry_run(tiny, overrides, world_size=2, steps=2)
    note = next(line for line in lines if line.startswith("cp_max_tokens_per_rank auto:"))
    cap = int(note.split(": ")[1].split()[0])
    assert f"a rank holds {cap}," in "\n".join(lines)
    assert f"fits {device_memory_gb(torch.device('cpu'), 2):g} GB" in note
