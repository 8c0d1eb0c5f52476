"""Parameter sharding (FSDP2, ZeRO-3) in the memory model: the executions a run maps to, the
model states per parameter, the gathered working set, the static bytes the planner uses, the
per-engine table and the largest model that fits, against hand computations."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from hf_cp.cli import main
from hf_cp.cost.config_files import ConfigError
from hf_cp.cost.dims import ModelDims
from hf_cp.cost.execution import (
    EXECUTIONS,
    StepExecution,
    execution_for_run,
    gathered_working_set_bytes,
    model_state_bytes_per_parameter,
)
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.planning.setup import (
    PlanningSettings,
    engine_memory,
    engine_memory_lines,
    planning_setup,
    static_memory,
)
from hf_cp.train.launch.dry_run import dry_run
from hf_cp.train.setup.args import CPTrainingArguments

# a small model whose sizes are easy to count by hand
DIMS = ModelDims(
    num_layers=4,
    hidden=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate=256,
    vocab_size=1000,
    tie_word_embeddings=False,
)
# per layer: q and o 64 x (4 x 16) each, k and v 64 x (2 x 16) each, gate/up/down 64 x 256 each
LAYER = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 256
ROOT = 2 * 1000 * 64  # embedding and an untied LM head
PARAMS = 4 * LAYER + ROOT


def test_hand_counts_of_the_small_model():
    assert LAYER == 61440 and ROOT == 128000
    assert DIMS.linear_params_per_layer == LAYER
    assert DIMS.embedding_parameters == ROOT
    assert DIMS.parameters == PARAMS
    assert replace(DIMS, tie_word_embeddings=True).embedding_parameters == 64000


def test_executions_of_a_run():
    assert execution_for_run(None, fsdp_version=2) == "fsdp2"
    assert execution_for_run({"zero_optimization": {"stage": 2}}, fsdp_version=2) == "fsdp2"
    assert execution_for_run({"zero_optimization": {"stage": 3}}) == "zero3"
    assert execution_for_run({"zero_optimization": {"stage": 2}}) == "zero2"
    assert execution_for_run(None) == "ddp"
    assert execution_for_run(None, fsdp_version=1) == "ddp"  # FSDP1: unchanged
    for name in ("fsdp2", "zero3"):
        ex = EXECUTIONS[name]
        assert ex.shards_parameters and ex.waves_synchronise and not ex.all_reduce
        assert StepExecution.from_dict(ex.to_dict()) == ex
    assert EXECUTIONS["fsdp2"].keeps_root_gathered and not EXECUTIONS["zero3"].keeps_root_gathered
    # a dict written before parameter sharding loads as a replicated-parameter execution
    old = {"name": "zero2", "waves_synchronise": True, "all_reduce": False, "overlaps_backward": False}
    assert StepExecution.from_dict(old) == EXECUTIONS["zero2"]


def test_model_states_per_parameter_by_hand():
    # FSDP2: fp32 sharded parameters, gradients and two Adam moments over the world
    assert model_state_bytes_per_parameter(False, 0, True, 8, sharding="fsdp2") == (4 + 4 + 8) / 8
    assert model_state_bytes_per_parameter(False, 0, False, 8, sharding="fsdp2") == (4 + 4 + 8) / 8
    assert model_state_bytes_per_parameter(False, 0, True, 4, param_bytes=2, sharding="fsdp2") == (2 + 2 + 4) / 4
    # ZeRO-3: bf16 parameters and gradients, fp32 master weights and moments, all sharded
    assert model_state_bytes_per_parameter(True, 3, True, 8, sharding="zero3") == (2 + 2 + 12) / 8
    assert model_state_bytes_per_parameter(True, 3, True, 8) == (2 + 2 + 12) / 8  # old dicts: no key
    assert model_state_bytes_per_parameter(True, 2, True, 8) == 2 + (2 + 12) / 8  # ZeRO-2 unchanged
    with pytest.raises(ValueError, match="unknown sharding 'fsdp9'"):
        model_state_bytes_per_parameter(False, 0, True, 8, sharding="fsdp9")


@pytest.mark.parametrize("sharding, deepspeed, stage", [("fsdp2", False, 0), ("zero3", True, 3)])
def test_sharded_states_shrink_with_the_world(sharding, deepspeed, stage):
    per = [model_state_bytes_per_parameter(deepspeed, stage, True, w, sharding=sharding) for w in (1, 2, 4, 8, 64)]
    assert all(a > b for a, b in zip(per, per[1:]))
    assert [p * w for p, w in zip(per, (1, 2, 4, 8, 64))] == pytest.approx([16.0] * 5)


def test_gathered_working_set_by_hand():
    # FSDP2 in bf16: the root (embedding + LM head) and its gradient, the computing layer and the
    # prefetched one, and the computing layer's gradient
    assert gathered_working_set_bytes(DIMS, "fsdp2", 2) == 2 * (ROOT + ROOT + LAYER + LAYER + LAYER)
    assert gathered_working_set_bytes(DIMS, "fsdp2", 4) == 4 * (2 * 128000 + 3 * 61440)
    # ZeRO-3: the largest module (the 1000 x 64 embedding) with its gradient, and the prefetch
    # bucket of 0.9 x 64^2 parameters
    assert gathered_working_set_bytes(DIMS, "zero3", 2) == pytest.approx(2 * (2 * 64000 + 0.9 * 64 * 64))
    # without a vocabulary the largest module is an MLP matrix (64 x 256)
    no_vocab = replace(DIMS, vocab_size=0)
    assert gathered_working_set_bytes(no_vocab, "zero3", 2) == pytest.approx(2 * (2 * 64 * 256 + 0.9 * 64 * 64))
    assert gathered_working_set_bytes(DIMS, None, 2) == 0.0


def test_static_memory_adds_states_gathered_set_and_logits():
    fsdp2 = {"deepspeed": False, "zero_stage": 0, "half_precision": True, "sharding": "fsdp2"}
    s = static_memory(DIMS, fsdp2, world_size=4, max_tokens_per_rank=2048, loss_chunk_tokens=512)
    assert s.model_states_bytes == PARAMS * 16 / 4
    assert s.gathered_bytes == 2 * (2 * ROOT + 3 * LAYER)
    assert s.logits_bytes == 512 * 1000 * 8
    assert s.total_bytes == PARAMS * 4 + 2 * (2 * ROOT + 3 * LAYER) + 512 * 1000 * 8
    # an old model_states dict of a ZeRO-3 run (no "sharding" key) gets ZeRO-3's working set
    old = static_memory(DIMS, {"deepspeed": True, "zero_stage": 3, "half_precision": True}, 4, 2048)
    assert old.gathered_bytes == pytest.approx(2 * (2 * 64000 + 0.9 * 64 * 64)) and old.logits_bytes == 0.0
    # ZeRO-2 gathers nothing: its parameters are replicated model states
    zero2 = static_memory(DIMS, {"deepspeed": True, "zero_stage": 2, "half_precision": True}, 4, 2048)
    assert zero2.gathered_bytes == 0.0 and zero2.model_states_bytes == PARAMS * (2 + 14 / 4)


def _training_args(**over):
    args = SimpleNamespace(
        cp_balancer="auto",
        cp_balancer_options=None,
        cp_compare_balancer="",
        cp_profile="h200-qwen2.5-7b",
        cp_model_dims="qwen2.5-0.5b",
        cp_max_tokens_per_rank=32768,
        cp_tokens_per_step=None,
        cp_tokens_per_rank_per_step=65536,
        cp_max_group_size=None,
        cp_gpus_per_node=None,
        cp_chunk_size=None,
        cp_chunk_keep=1,
        seed=0,
        cp_shuffle=True,
        deepspeed=None,
        bf16=True,
        cp_loss_chunk_tokens=None,
    )
    for k, v in over.items():
        setattr(args, k, v)
    return args


def test_training_args_of_fsdp2_and_zero3_runs_plan_with_their_memory(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    lengths = [100, 200, 300]
    fsdp = PlanningSettings.from_training_args(_training_args(fsdp="full_shard", fsdp_plugin_args={"fsdp_version": 2}))
    assert fsdp.execution == "fsdp2" and fsdp.model_states["sharding"] == "fsdp2"
    zero3 = PlanningSettings.from_training_args(_training_args(deepspeed={"zero_optimization": {"stage": 3}}))
    assert zero3.execution == "zero3" and zero3.model_states["sharding"] == "zero3"
    plain = PlanningSettings.from_training_args(_training_args())
    assert plain.execution == "ddp" and plain.model_states["sharding"] is None

    dims = ModelDims.load("qwen2.5-0.5b")
    per_layer, root = dims.linear_params_per_layer, dims.embedding_parameters
    setup = planning_setup(fsdp, lengths, 8)
    by_hand = dims.parameters * 16 / 8 + 2 * (2 * root + 3 * per_layer)
    assert setup.cost.profile.static_bytes == pytest.approx(by_hand)
    assert setup.cost.execution == EXECUTIONS["fsdp2"]
    # more ranks, fewer model-state bytes; the gathered working set stays
    assert planning_setup(fsdp, lengths, 16).cost.profile.static_bytes == pytest.approx(
        dims.parameters * 16 / 16 + 2 * (2 * root + 3 * per_layer)
    )


def _profile(**over) -> HardwareProfile:
    return replace(HardwareProfile.load("h200-qwen2.5-7b"), **over)


def test_largest_model_is_the_most_layers_whose_peak_fits():
    prof = _profile(activation_bytes_per_token=20_000.0, bytes_per_element=2, device_memory_gb=0.05)
    cap, world = 512, 4
    rows = {m.engine: m for m in engine_memory(DIMS, prof, world, cap, half_precision=True)}
    assert list(rows) == ["zero2", "zero3", "fsdp2"]

    def peak(engine: str, layers: int) -> float:  # by hand: activations + states + gathered
        alpha = 20_000 + (layers - 4) * 64 * 2  # each layer adds its checkpointed bf16 input
        params = layers * LAYER + ROOT
        states = {"zero2": params * (2 + 14 / world), "zero3": params * 16 / world, "fsdp2": params * 16 / world}
        gathered = {"zero2": 0.0, "zero3": 2 * (2 * 64000 + 0.9 * 64 * 64), "fsdp2": 2 * (2 * ROOT + 3 * LAYER)}
        return alpha * cap + states[engine] + gathered[engine]

    for engine, m in rows.items():
        assert m.peak_bytes == pytest.approx(peak(engine, 4))
        assert m.largest_layers > 4
        assert peak(engine, m.largest_layers) <= 0.05e9 < peak(engine, m.largest_layers + 1)
        assert m.largest_parameters == m.largest_layers * LAYER + ROOT
    # sharding the parameters fits more layers than ZeRO-2 on 4 ranks
    assert rows["fsdp2"].largest_layers > rows["zero2"].largest_layers
    assert rows["zero3"].largest_layers > rows["zero2"].largest_layers
    # unknown device memory: no largest model, and the table says how to give it
    unknown = engine_memory(DIMS, _profile(device_memory_gb=0.0), world, cap, True)
    assert all(m.largest_layers is None for m in unknown)
    lines = engine_memory_lines(unknown, world, cap, True, 0.0)
    assert "device memory unknown" in lines[-1]
    # a device too small for one layer says so
    tiny = engine_memory(DIMS, prof, world, cap, True, device_memory_gb=1e-6)
    assert all(m.largest_layers == 0 and m.largest_parameters == 0 for m in tiny)


def test_profile_reads_and_checks_device_memory():
    base = HardwareProfile.load("h200-qwen2.5-7b")
    assert base.device_memory_gb == 0.0 or base.device_memory_gb > 0
    prof = HardwareProfile.from_dict(dict(base.to_dict(), device_memory_gb=141), "p.yaml")
    assert prof.device_memory_gb == 141.0
    with pytest.raises(ConfigError, match="device_memory_gb must not be negative"):
        HardwareProfile.from_dict(dict(base.to_dict(), device_memory_gb=-1), "p.yaml")


def test_hf_cp_plan_prints_the_memory_table(capsys, tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [4000, 9000, 1200, 30000, 700, 15000, 2200, 6000]) + "\n")
    rc = main(
        [
            "plan",
            "--lengths",
            str(lengths),
            "--world",
            "8",
            "--steps",
            "1",
            "--model",
            "qwen2.5-7b",
            "--profile",
            "h200-qwen2.5-7b",
            "--device-memory-gb",
            "141",
            "--execution",
            "fsdp2",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    table = out[out.index("memory per rank at the cap") :].splitlines()
    assert "world 8" in table[0] and "32768 tokens/rank" in table[0] and "bf16" in table[0]
    assert "largest model in 141 GB" in table[1]
    dims, prof = ModelDims.load("qwen2.5-7b"), HardwareProfile.load("h200-qwen2.5-7b")
    activations = prof.activation_bytes_per_token * 32768
    by_hand = {
        "zero2": dims.parameters * (2 + 14 / 8),
        "zero3": dims.parameters * 16 / 8 + 2 * (2 * dims.vocab_size * dims.hidden + 0.9 * dims.hidden**2),
        "fsdp2": dims.parameters * 16 / 8 + 2 * (2 * dims.embedding_parameters + 3 * dims.linear_params_per_layer),
    }
    for line, engine in zip(table[2:5], ("zero2", "zero3", "fsdp2")):
        cells = line.split()
        assert cells[0] == engine
        assert float(cells[4]) == pytest.approx((activations + by_hand[engine]) / 1e9, abs=0.006)
        assert "B parameters (" in line and "layers)" in line


def test_dry_run_prints_the_memory_table(tmp_path):
    config = str(Path(__file__).resolve().parent.parent / "configs" / "tiny-cpu.yaml")
    profile = tmp_path / "cpu-with-memory.yaml"
    profile.write_text(yaml.safe_dump(dict(HardwareProfile.load("cpu").to_dict(), device_memory_gb=0.5)))
    out = [f"training.output_dir={tmp_path / 'out'}", f"training.cp_profile={profile}"]
    lines = dry_run(config, out, world_size=2, steps=2)
    start = next(i for i, line in enumerate(lines) if line.startswith("memory per rank at the cap"))
    assert "(4096 tokens/rank), world 2, fp32" in lines[start]
    assert "largest model in 0.5 GB" in lines[start + 1] and "peak MB" in lines[start + 1]
    rows = [line.split() for line in lines[start + 2 : start + 5]]
    assert [r[0] for r in rows] == ["zero2", "zero3", "fsdp2"]
    dims, prof = ModelDims.load("tiny-llama"), HardwareProfile.load("cpu")
    zero2_states = dims.parameters * (4 + 12 / 2)  # fp32 ZeRO-2 on 2 ranks
    assert float(rows[0][1]) == pytest.approx(zero2_states / 1e6, abs=0.006)
    # activations at the cap, and the chunked loss's fp32 logits and their gradient
    chunk = next(f.default for f in fields(CPTrainingArguments) if f.name == "cp_loss_chunk_tokens")
    activations = prof.activation_bytes_per_token * 4096 + min(chunk or 4096, 4096) * dims.vocab_size * 8
    assert float(rows[0][3]) == pytest.approx(activations / 1e6, abs=0.006)
    assert float(rows[0][4]) == pytest.approx((zero2_states + activations) / 1e6, abs=0.006)
    # fsdp2 in fp32 gathers fp32: the root and its gradient, two layers and one layer's gradient
    fsdp2_gathered = 4 * (2 * dims.embedding_parameters + 3 * dims.linear_params_per_layer)
    assert float(rows[2][2]) == pytest.approx(fsdp2_gathered / 1e6, abs=0.006)
    assert all("layers)" in line for line in lines[start + 2 : start + 5])
