"""The training engine's cost per gradient reduction: measured (`hf-cp profile --deepspeed`), kept in
the profile per GB of gradients, priced beside the link's bytes, and refitted online as part of
the fixed cost per reduction."""

import dataclasses
import json
import math

import pytest

from hf_cp.balance import PlanRequest, get_balancer
from hf_cp.cost.config_files import ConfigError, resolve_config
from hf_cp.cost.dims import ModelDims
from hf_cp.cost.execution import execution_named
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.cost.model import CostModel
from hf_cp.cost.simulate import forward_only_share, simulate
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.planning.calibration import CalibrationSettings, Calibrator, Coefficients, observe_step
from hf_cp.profiling.engine_reduction import (
    EngineReduction,
    EngineReductionError,
    engine_config,
    measure_engine_reduction,
)
from hf_cp.profiling.profile_file import ENGINE_REDUCTION_KEY, add_engine_reduction

SMOLLM2 = dict(
    model_type="llama",
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    tie_word_embeddings=True,
)


def cost_with(engine_ms_per_gb: float, overhead_ms: float = 0.0, execution: str = "zero2") -> CostModel:
    base = HardwareProfile.load("cpu")
    prof = dataclasses.replace(base, engine_reduction_ms_per_gb=engine_ms_per_gb, reduction_overhead_ms=overhead_ms)
    return CostModel(ModelDims.from_hf_config(SMOLLM2), prof, execution_named(execution))


def test_the_shipped_cpu_profile_carries_a_measured_engine_cost():
    # measured with SmolLM2-135M under recipes/ds-zero2-cpu.json: seconds per reduction there, not the
    # link's ~0.05 s for the same bytes
    prof = HardwareProfile.load("cpu")
    assert 1000 < prof.engine_reduction_ms_per_gb < 100000
    cost = CostModel(ModelDims.from_hf_config(SMOLLM2), prof, execution_named("zero2"))
    assert cost.gradient_reduction_ms(2) > 20 * (cost.gradient_reduction_ms(2) - cost.reduction_fixed_ms())


def test_a_reduction_costs_the_engine_per_gb_of_this_models_gradients():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(SMOLLM2, num_hidden_layers=2, vocab_size=512)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    # the gradients' GB counted independently, from the model itself (its norms, a few thousand
    # numbers, are what ModelDims leaves out)
    gb = sum(p.numel() for p in model.parameters()) * 4 / 1e9
    dims = ModelDims.from_hf_config(cfg)
    base = HardwareProfile.load("cpu")
    plain = CostModel(dims, dataclasses.replace(base, engine_reduction_ms_per_gb=0.0), execution_named("zero2"))
    engine = CostModel(dims, dataclasses.replace(base, engine_reduction_ms_per_gb=8000.0), execution_named("zero2"))
    for world in (1, 2, 8):
        added = engine.gradient_reduction_ms(world) - plain.gradient_reduction_ms(world)
        assert added == pytest.approx(8000.0 * gb, rel=1e-3)
    # and behind backward it is not hidden (the engine does it when the collective is due)
    overlap = CostModel(dims, engine.profile, execution_named("zero2-overlap"))
    assert overlap.gradient_reduction_ms(2, hidden_behind_ms=1e9) == pytest.approx(8000.0 * gb, rel=1e-3)


def test_the_engine_cost_is_refitted_as_the_fixed_cost_per_reduction():
    """A calibration whose observations are exactly what the base profile predicts keeps its
    predictions: the engine's per-GB prior is folded into the fixed cost it refits, and the
    calibrated profile (per-GB 0) prices a reduction as the base did."""
    cost = cost_with(8000.0, overhead_ms=120.0)
    gb = cost.gradient_bytes() / 1e9
    base = Coefficients.of(cost.profile, gb)
    assert base.reduction_overhead_ms == pytest.approx(120.0 + 8000.0 * gb)
    calibrated = CostModel(cost.dims, base.apply(cost.profile), cost.execution)
    assert calibrated.profile.engine_reduction_ms_per_gb == 0.0
    for world in (2, 4):
        assert calibrated.gradient_reduction_ms(world) == pytest.approx(cost.gradient_reduction_ms(world), rel=1e-12)


def test_observations_leave_the_engine_cost_to_the_wall_fit():
    cost = cost_with(8000.0)
    lens = [200, 120, 90, 60, 40, 30]
    plan = get_balancer("static").plan(PlanRequest(range(len(lens)), lens, ClusterSpec(2, 256, 8), cost))
    sim = simulate(plan, cost)
    red = sim.reductions
    assert red >= 1
    bytes_ms = cost.gradient_reduction_ms(2) - cost.reduction_fixed_ms()
    # a wall clock that is exactly critical path + reductions x (bytes + engine cost)
    waves = [max(r.duration_ms for r in sim.runs if r.wave == w) for w in range(len(plan.waves))]
    wall = sum(waves) + red * cost.gradient_reduction_ms(2)
    measured = [sim.occupied_ms[r] for r in range(2)]
    obs = [observe_step(i, sim, cost, 1.0, measured, wall, waves) for i in range(4)]
    assert obs[0].reduction_bytes_ms == pytest.approx(red * bytes_ms)
    cal = Calibrator(cost.profile, CalibrationSettings(min_steps=4, refit_every=4, window=16), gradient_gb=0.0)
    for o in obs:
        cal.add(o)
    fit = cal.refit()
    assert fit.coefficients.reduction_overhead_ms == pytest.approx(cost.reduction_fixed_ms(), rel=1e-4)


def test_profile_files_validate_the_field(tmp_path):
    d = HardwareProfile.load("cpu").to_dict()
    for bad in (-1.0, 1e12, float("nan")):
        with pytest.raises(ConfigError, match=ENGINE_REDUCTION_KEY):
            HardwareProfile.from_dict(dict(d, **{ENGINE_REDUCTION_KEY: bad}), source="p.yaml")
    assert (
        HardwareProfile.from_dict({k: v for k, v in d.items() if k != ENGINE_REDUCTION_KEY}).engine_reduction_ms_per_gb
        == 0
    )


def test_adding_a_measurement_to_a_profile_keeps_its_other_lines(tmp_path):
    src = HardwareProfile.load("cpu")
    path = tmp_path / "p.yaml"
    text = resolve_config("cpu", "profiles", (".yaml",)).read_text()
    path.write_text(text)
    r = EngineReduction("ds.json", 2, 1_000_000, 0.004, 64, 10.0, [30.0, 50.0, 40.0])
    for ms in (40.0, 90.0):  # a second measurement replaces the first
        r = dataclasses.replace(r, engine_ms=[ms, ms, ms])
        add_engine_reduction(path, r, "hf-cp profile ...")
    got = HardwareProfile.load(path)
    assert got.engine_reduction_ms_per_gb == pytest.approx((90.0 - 10.0) / 0.004, rel=1e-5)
    assert dataclasses.replace(got, engine_reduction_ms_per_gb=src.engine_reduction_ms_per_gb) == src
    out = path.read_text()
    assert out.count(ENGINE_REDUCTION_KEY + ":") == 1 and out.count("own work per gradient reduction") == 1
    assert out.index(ENGINE_REDUCTION_KEY + ":") < out.index("# What was measured")


def test_forward_only_share_under_checkpointing():
    assert forward_only_share(1 / 3, False) == pytest.approx(1 / 3)
    assert forward_only_share(1 / 3, True) == pytest.approx(1 / 4)


def test_engine_configs_are_made_concrete_or_refused(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": "auto"}, "gradient_clipping": "auto"}))
    cfg = engine_config(p, 3)
    assert cfg["gradient_accumulation_steps"] == 3 and "gradient_clipping" not in cfg
    assert "overlap_comm" not in cfg["zero_optimization"]
    p.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(ConfigError, match="stage 3"):
        engine_config(p, 2)
    p.write_text("[1]")
    with pytest.raises(ConfigError, match="JSON object"):
        engine_config(p, 2)
    with pytest.raises(EngineReductionError, match="world 1"):
        measure_engine_reduction("tiny-llama", "recipes/ds-zero2-cpu.json", world=1)


def test_the_cli_refuses_what_it_cannot_measure(tmp_path, capsys):
    from hf_cp.cli import main

    out = tmp_path / "p.yaml"
    base = ["profile", "--model", "tiny-llama", "--out", str(out)]
    assert main(base + ["--device", "cpu", "--only-engine-reduction"]) == 2
    assert "--deepspeed DS_CONFIG.json" in capsys.readouterr().err
    ds = ["--deepspeed", "recipes/ds-zero2-cpu.json"]
    assert main(base + ["--device", "cpu", "--only-engine-reduction"] + ds) == 2
    assert "not a profile file" in capsys.readouterr().err
    # a CUDA profile is not given a number measured on CPU ranks
    from argparse import Namespace

    from hf_cp.cli.profile import _engine_reduction

    with pytest.raises(ValueError, match="CPU ranks"):
        _engine_reduction(Namespace(deepspeed=ds[1], only_engine_reduction=False, reduction_ranks=2), "cuda")


def test_measuring_a_tiny_model_on_two_processes():
    r = measure_engine_reduction("tiny-llama", "recipes/ds-zero2-cpu.json", world=2, steps=3)
    from transformers import AutoModelForCausalLM

    from hf_cp.profiling.layers import load_hf_config

    n = sum(p.numel() for p in AutoModelForCausalLM.from_config(load_hf_config("tiny-llama")).parameters())
    assert r.parameters == n and r.gradient_gb == pytest.approx(n * 4 / 1e9)
    assert len(r.engine_ms) == 3 and all(t > 0 for t in r.engine_ms) and r.plain_ms > 0
    assert math.isfinite(r.ms_per_gb) and r.ms_per_gb >= 0
    assert "ms per GB" in r.describe()
