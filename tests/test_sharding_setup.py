"""Parameter-sharding set-ups CPTrainer honours or refuses by name, without processes
(hf_cp/train/setup/sharding.py): FSDP2 and ZeRO-3 are recognised from the Trainer's arguments and from
accelerate's environment; FSDP1, FSDP with DeepSpeed, offload, FSDP's own activation
checkpointing and ZeRO-3 with several open ChunkFlow graphs are refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hf_cp.train.checks.setup import SetupError
from hf_cp.train.setup.schema import check_training_keys
from hf_cp.train.setup.sharding import (
    FSDP2,
    ZERO3,
    check_sharding,
    check_zero3_chunk_keep,
    chunk_keep_of,
    clear_leftover_fsdp_env,
    sharding_of,
)


def args(**kw):
    base = dict(fsdp=None, fsdp_plugin_args=None, fsdp_config=None, deepspeed=None)
    base.update(kw)
    return SimpleNamespace(**base)


def fsdp_args(version=2, **plugin):
    return args(fsdp=True, fsdp_plugin_args={"fsdp_version": version, **plugin}, fsdp_config={})


def test_sharding_is_read_from_trainer_arguments_and_accelerates_environment():
    assert sharding_of(args(), environ={}) is None
    assert sharding_of(fsdp_args(), environ={}) == FSDP2
    assert sharding_of(args(deepspeed={"zero_optimization": {"stage": 3}}), environ={}) == ZERO3
    assert sharding_of(args(deepspeed={"zero_optimization": {"stage": 2}}), environ={}) is None
    # accelerate launch --config_file recipes/cpu-2proc-fsdp2.yaml sets these
    assert sharding_of(args(), environ={"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}) == FSDP2


def test_the_transformers_arguments_for_fsdp2_are_recognised():
    from transformers import TrainingArguments

    a = TrainingArguments(output_dir="/tmp/unused", use_cpu=True, fsdp=True, fsdp_config={"fsdp_version": 2})
    assert sharding_of(a, environ={}) == FSDP2
    check_sharding(a, environ={})  # accepted


@pytest.mark.parametrize(
    "bad, words",
    [
        (fsdp_args(version=1), ["FSDP version 1", "fsdp_version: 2"]),
        (args(fsdp=True, fsdp_plugin_args={"fsdp_version": 2}, deepspeed="ds.json"), ["deepspeed", "choose one"]),
        (fsdp_args(cpu_offload=True), ["CPU offload", "not supported"]),
        (fsdp_args(activation_checkpointing=True), ["activation_checkpointing", "gradient_checkpointing"]),
    ],
)
def test_unsupported_fsdp_set_ups_are_refused_by_name(bad, words):
    with pytest.raises(SetupError) as err:
        check_sharding(bad, environ={})
    for w in words:
        assert w in str(err.value)


def test_fsdp1_from_accelerates_environment_is_refused():
    with pytest.raises(SetupError, match="FSDP version 1"):
        check_sharding(args(), environ={"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"})


def test_the_flag_an_earlier_fsdp2_trainer_left_does_not_make_a_zero3_trainer_fsdp():
    # accelerate's Accelerator sets ACCELERATE_USE_FSDP in-process (no FSDP_VERSION): a ZeRO-3
    # trainer built after an FSDP2 one in the same process was refused as "FSDP version 1"
    zero3 = args(deepspeed={"zero_optimization": {"stage": 3}})
    env = {"ACCELERATE_USE_FSDP": "true"}
    with pytest.raises(SetupError, match="FSDP version 1"):
        check_sharding(zero3, environ=dict(env))
    assert clear_leftover_fsdp_env(zero3, env) and env == {}
    check_sharding(zero3, environ=env)
    assert sharding_of(zero3, environ=env) == ZERO3
    # what accelerate launch sets is kept: its FSDP1 is still refused
    launched = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}
    assert not clear_leftover_fsdp_env(zero3, launched) and "ACCELERATE_USE_FSDP" in launched
    # and a run that asks for fsdp itself keeps it
    assert not clear_leftover_fsdp_env(fsdp_args(), {"ACCELERATE_USE_FSDP": "true"})


def test_zero3_refuses_chunkflow_keeping_several_chunks():
    assert chunk_keep_of({"keep": 3}) == 3
    assert chunk_keep_of({"member_options": {"chunkflow": {"keep": 2}}}) == 2
    assert chunk_keep_of({}) == 1
    check_zero3_chunk_keep(ZERO3, "chunkflow", {"keep": 1})
    check_zero3_chunk_keep(FSDP2, "chunkflow", {"keep": 4})  # FSDP2 is exact there
    check_zero3_chunk_keep(ZERO3, "dcp", {})
    for balancer, opts in (("chunkflow", {"keep": 2}), ("auto", {"member_options": {"chunkflow": {"keep": 4}}})):
        with pytest.raises(SetupError, match="cp_chunk_keep: 1"):
            check_zero3_chunk_keep(ZERO3, balancer, opts)


def test_a_training_config_turns_fsdp_on_with_true():
    out = check_training_keys({"fsdp": True, "fsdp_config": {"fsdp_version": 2}}, "config.yaml")
    assert out["fsdp"] is True
