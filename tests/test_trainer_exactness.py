"""Every balancer at world 2 equals single-process training, step by step, and the check that
says so fails on a trainer that is wrong by 0.1%.

The runs come from the session's world-2 job (world2_job.py): two gloo processes under
DeepSpeed ZeRO-2 train each registered balancer (megatron where its extra is installed) and
three deliberately broken trainers on the same data. harness.check compares each run with the
single-process reference per step: loss (recorded and logged), gradient norm and gradients
before the optimizer, parameters after it.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from hf_cp.plan.chunks import dependent_chunk_sizes

from helpers.harness.check import GRAD_RTOL, LOSS_RTOL, PARAM_RTOL, ExactnessMismatch, check_run
from helpers.harness.models import IGNORE_INDEX, eval_rows, synthetic_rows, tiny_model, train_rows
from helpers.harness.reference import (
    reference_batches,
    reference_eval_loss,
    reference_steps,
    router_term,
    sample_loss_sum,
    sample_valid_targets,
)
from helpers.tiny_vlm import VISION_START
from helpers.world2_job import (
    BALANCERS,
    CHUNKFLOW_RUNS,
    FIXTURE_TIMEOUT,
    HYBRID_BALANCERS,
    MOE_BALANCERS,
    MUTATED_BALANCER,
    QWEN3_5_BALANCERS,
    QWEN3_VL_BALANCERS,
    VLM_BALANCERS,
    executed_plans,
)

REPO = Path(__file__).resolve().parent.parent


def placements(plans) -> tuple:
    """(samples distributed over a CP group of several ranks, samples kept on one rank)."""
    spread = sum(len(g.distributed) for p in plans for w in p.waves for g in w.groups if g.size > 1)
    local = sum(len(ids) for p in plans for w in p.waves for g in w.groups for ids in g.local.values())
    return spread, local


# ------------------------------------------------------------------ every balancer
@pytest.mark.timeout(FIXTURE_TIMEOUT)
@pytest.mark.parametrize("balancer", BALANCERS)
def test_balancer_equals_single_process_step_by_step(world2_job, balancer):
    spec = world2_job[f"balancer-{balancer}"]
    if balancer == "chunkflow":  # its own test below: chunked samples instead of CP groups
        return test_chunkflow_equals_single_process_step_by_step(world2_job, "balancer-chunkflow")
    spread, local = placements(executed_plans(spec))
    assert spread >= 1, f"{balancer} distributed no sample over a CP group: the CP path went untested"
    if balancer == "static":
        # one CP size for the whole run, sized for its longest sample: every sample is split;
        # static's all-local path is test_train_distributed's static test
        assert local == 0
    else:
        assert local >= 1, f"{balancer} kept no sample local: the local path went untested"
    report = check_run(spec)
    assert report.steps == list(range(spec["steps"]))


@pytest.mark.timeout(FIXTURE_TIMEOUT)
def test_a_hierarchical_plan_of_two_hosts_equals_single_process_step_by_step(world2_job):
    spec = world2_job["hierarchical-hosts"]
    plans = executed_plans(spec)
    assert all(p.balancer.startswith("hierarchical:") for p in plans)
    assert all(any("2 hosts of 1 ranks" in n for n in p.notes) for p in plans)
    spread, local = placements(plans)
    assert spread >= 1 and local >= 1  # a block of both hosts, and each host's own samples
    report = check_run(spec)
    assert report.steps == list(range(spec["steps"]))


@pytest.mark.timeout(FIXTURE_TIMEOUT)
@pytest.mark.parametrize("balancer", HYBRID_BALANCERS)
def test_gated_deltanet_hybrid_equals_single_process_step_by_step(world2_job, balancer):
    """Qwen3-Next (a Gated DeltaNet layer beside a gated attention layer, MoE MLPs) under CPTrainer
    and DeepSpeed ZeRO-2 on 2 processes: every step equals training each sample alone in one
    process, spread samples included (their recurrent layers see the whole document)."""
    spec = world2_job[f"qwen3_next-{balancer}"]
    spread, _ = placements(executed_plans(spec))
    assert spread >= 1, f"{balancer} distributed no sample over a CP group: the gathered path went untested"
    report = check_run(spec)
    assert report.steps == list(range(spec["steps"]))


@pytest.mark.timeout(FIXTURE_TIMEOUT)
@pytest.mark.parametrize("balancer", QWEN3_5_BALANCERS)
def test_qwen3_5_text_equals_single_process_step_by_step(world2_job, balancer):
    """Qwen3.5's text model (Gated DeltaNet beside gated attention, dense MLPs) under CPTrainer and
    ZeRO-2 on 2 processes: every step equals training each sample alone in one process, the spread
    sample passing state over its group, chunkflow's samples carrying it from chunk to chunk."""
    spec = world2_job[f"qwen3_5_text-{balancer}"]
    spread, _ = placements(executed_plans(spec))
    assert spread >= 1, f"{balancer} distributed no sample over a CP group"
    report = check_run(spec)
    assert report.steps == list(range(spec["steps"]))


@pytest.mark.timeout(FIXTURE_TIMEOUT)
@pytest.mark.parametrize("run", sorted(CHUNKFLOW_RUNS))
def test_chunkflow_equals_single_process_step_by_step(world2_job, run):
    """Long samples as dependent chunks on one rank (K/V state store, recompute of the first N-K),
    under DeepSpeed ZeRO-2 on 2 processes: every step equals single-process training."""
    spec = world2_job[run]
    plans = executed_plans(spec)
    lens = {s: n for p in plans for s, n in zip(p.sample_ids, p.lengths)}
    chunked = [c for p in plans for w in p.waves for g in w.groups for cs in g.chunked.values() for c in cs]
    assert chunked, f"{run}: no sample ran as dependent chunks"
    n_chunks = {c.sample: len(dependent_chunk_sizes(lens[c.sample], c.chunk_size)) for c in chunked}
    assert max(n_chunks.values()) >= 4  # several dependent chunks, not a trivial cut
    keep = spec["balancer_options"]["keep"]
    if keep == 1:
        assert any(n > 1 for n in n_chunks.values())  # recomputed chunks
    else:
        assert any(1 < n <= keep for n in n_chunks.values())  # K >= N: nothing recomputed
    _, local = placements(plans)
    assert local >= 1, f"{run}: no standalone chunk ran: the packed path went untested"
    report = check_run(spec)
    assert report.steps == list(range(spec["steps"]))


@pytest.mark.timeout(FIXTURE_TIMEOUT)
def test_ranks_whose_timing_dependent_plans_differ_run_rank_zeros_plan(world2_job):
    """Rank 1 plans every step otherwise (harness RankDependentBalancer, timing_dependent): every
    rank runs rank 0's plan, so the run still equals single-process training, and it records
    rank 0's plans."""
    spec = world2_job["rank-dependent-plans"]
    history = json.loads((Path(spec["out"]) / "history.json").read_text())
    assert all(r["balancer"] == "dynamic_cp" for r in history)  # rank 0's balancer, not rank 1's wlb
    report = check_run(spec)
    assert report.steps == list(range(spec["steps"]))


@pytest.mark.timeout(FIXTURE_TIMEOUT)
@pytest.mark.parametrize("balancer", MOE_BALANCERS)
def test_moe_router_loss_over_the_step_equals_single_process_step_by_step(world2_job, balancer):
    """Qwen3-MoE with output_router_logits=True and router_aux_loss_coef=0.5 under CPTrainer at
    world 2: the load-balancing term is one term over each whole step (every token of every rank
    and wave), as transformers computes it over one batch of the step's samples, and the loss and
    every gradient equal the single-process reference (helpers/harness/reference.py)."""
    spec = world2_job[f"qwen3_moe-{balancer}"]
    spread, _ = placements(executed_plans(spec))
    assert spread >= 1, f"{balancer} distributed no sample over a CP group: the CP path went untested"
    report = check_run(spec)
    assert report.steps == list(range(spec["steps"]))


@pytest.mark.timeout(FIXTURE_TIMEOUT)
@pytest.mark.parametrize("balancer", VLM_BALANCERS)
def test_vision_language_training_equals_the_models_own_forward_step_by_step(world2_job, balancer):
    """A tiny Qwen2.5-VL on samples with random images and a two-frame clip, under CPTrainer at
    world 2 (issue 38): loss, every gradient (the vision tower's too) and every parameter after
    AdamW equal single-process training on the model's own forward (its pixel columns, its own
    M-RoPE, helpers/harness/reference.py), with the 400-token sample and its clip over a CP group."""
    spec = world2_job[f"qwen2_5_vl-{balancer}"]
    spread, _ = placements(executed_plans(spec))
    assert spread >= 1, f"{balancer} distributed no sample over a CP group: the CP path went untested"
    rows = train_rows(spec)
    assert "pixel_values_videos" in rows[0] and sum("pixel_values" in r for r in rows) >= 3
    report = check_run(spec)
    assert report.steps == list(range(spec["steps"]))


@pytest.mark.timeout(FIXTURE_TIMEOUT)
@pytest.mark.parametrize("balancer", QWEN3_VL_BALANCERS)
def test_qwen3_vl_training_equals_the_models_own_forward_step_by_step(world2_job, balancer):
    """A tiny Qwen3-VL (DeepStack: the tower's layer features added after the first decoder layers;
    each clip frame between its own vision start/end pair after two timestamp tokens, as its
    processor writes it) under CPTrainer at world 2: every step equals single-process training on
    the model's own forward, the 400-token sample and its clip over the CP group of 2 (auto keeps
    the others local, static spreads every sample)."""
    spec = world2_job[f"qwen3_vl-{balancer}"]
    rows = train_rows(spec)
    assert "pixel_values_videos" in rows[0] and "second_per_grid_ts" not in rows[0]
    assert rows[0]["input_ids"].count(VISION_START) == 1 + int(rows[0]["video_grid_thw"][0][0])  # frames apart
    spread, local = placements(executed_plans(spec))
    assert spread >= 1 and (local == 0) == (balancer == "static"), (balancer, spread, local)
    report = check_run(spec)
    assert report.steps == list(range(spec["steps"]))


@pytest.mark.timeout(FIXTURE_TIMEOUT)
def test_planned_evaluation_of_vision_language_data_equals_the_models_own_forward(world2_job):
    spec = world2_job["qwen2_5_vl-eval"]
    out = Path(spec["out"])
    final = [json.loads((out / f"eval_rank{r}.json").read_text()) for r in range(2)]
    assert "pixel_values_videos" in eval_rows(spec)[0]  # the 400-token eval sample has a clip
    assert final[0]["eval_loss"] == final[1]["eval_loss"]
    assert final[0]["eval_loss"] == pytest.approx(reference_eval_loss(spec, spec["steps"]), rel=1e-5)
    logged = [rec for rec in json.loads((out / "log_history.json").read_text()) if "eval_loss" in rec]
    assert logged[0]["eval_loss"] == pytest.approx(reference_eval_loss(spec, 1), rel=1e-5)


def test_the_reference_router_term_is_a_real_share_of_the_loss():
    # not vacuous: the term moves the loss (the router's weights get most of their gradient from it)
    model = tiny_model(0, attn="sdpa", family="qwen3_moe")
    rows = synthetic_rows([40, 25, 60], seed=0)
    term = float(router_term(model, rows))
    ce = sum(float(sample_loss_sum(model, r)) for r in rows) / sum(sample_valid_targets(r) for r in rows)
    assert 0.05 * ce < term < ce, (term, ce)
    model.config.output_router_logits = False
    assert router_term(model, rows) is None


# ------------------------------------------------------------------ the check can fail
@pytest.mark.timeout(FIXTURE_TIMEOUT)
def test_check_fails_on_a_loss_scaled_by_one_part_in_a_thousand(world2_job):
    spec = world2_job["mutation-loss_scale"]
    assert spec["balancer"] == MUTATED_BALANCER
    with pytest.raises(ExactnessMismatch) as caught:
        check_run(spec)
    worst, failures = caught.value.report.worst, caught.value.failures
    assert worst["loss"] == pytest.approx(1e-3, rel=0.05) and worst["grads"] == pytest.approx(1e-3, rel=0.05)
    assert "step 1 loss: relative error" in "\n".join(failures)
    # what the old check saw (final parameters after AdamW, 1e-5): nothing. Adam divides each
    # update by the gradient's own magnitude, so only the loss and the gradients show the scale
    assert worst["final"] < PARAM_RTOL


@pytest.mark.timeout(FIXTURE_TIMEOUT)
def test_check_fails_on_gradients_scaled_by_one_part_in_a_thousand(world2_job):
    # the recorded loss is right; only the gradients (and their norm) are 0.1% off
    with pytest.raises(ExactnessMismatch) as caught:
        check_run(world2_job["mutation-grad_scale"])
    worst = caught.value.report.worst
    assert worst["loss"] < LOSS_RTOL and worst["logged_loss"] < LOSS_RTOL
    assert worst["grads"] == pytest.approx(1e-3, rel=0.05) and worst["grads"] > GRAD_RTOL
    assert worst["grad_norm"] == pytest.approx(1e-3, rel=0.05)


@pytest.mark.timeout(FIXTURE_TIMEOUT)
def test_check_fails_on_a_dropped_target(world2_job):
    with pytest.raises(ExactnessMismatch) as caught:
        check_run(world2_job["mutation-drop_target"])
    assert caught.value.report.worst["loss"] > 100 * LOSS_RTOL
    assert any(f.startswith("step 1 loss") for f in caught.value.failures)


@pytest.mark.timeout(FIXTURE_TIMEOUT)
def test_check_fails_on_router_counts_of_one_rank_only(world2_job):
    # each rank's router term weighted by its own expert counts: what a per-rank (or per-wave)
    # load-balancing loss computes; the step's loss and gradients are off
    with pytest.raises(ExactnessMismatch) as caught:
        check_run(world2_job["mutation-router_local_counts"])
    assert caught.value.report.worst["grads"] > 100 * GRAD_RTOL


# ------------------------------------------------------------------ the reference itself
def test_reference_batches_cut_in_data_order():
    lengths = [200, 150, 130, 250, 255, 90, 7, 33, 60, 40, 120, 100, 18, 5, 64, 21, 77]
    want = [[0, 1, 2], [3], [4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
    assert reference_batches(lengths, 500, 6) == want + want[:2]  # the second epoch cuts the same way
    assert reference_batches([10, 900, 20], 100, 3) == [[0], [1], [2]]  # a long sample is a batch alone


def test_reference_loss_is_transformers_own_causal_lm_loss():
    # the reference shifts and counts targets itself; transformers' loss (labels=...) agrees
    model = tiny_model(0, attn="sdpa")
    (row,) = synthetic_rows([40], seed=3, prompt_every=1)  # labels 0..12 masked (a prompt)
    assert sample_valid_targets(row) == 39 - 12  # targets are labels 1..39
    theirs = model(input_ids=torch.tensor([row["input_ids"]]), labels=torch.tensor([row["labels"]])).loss
    ours = sample_loss_sum(model, row) / sample_valid_targets(row)
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-6)
    assert row["labels"][12] == IGNORE_INDEX and row["labels"][13] != IGNORE_INDEX


def test_reference_trains_and_records_every_step():
    spec = dict(lengths=[30, 20, 50, 10], tokens_per_step=60, steps=3)
    steps = reference_steps(spec)
    assert [s.sample_ids for s in steps] == [(0, 1), (2, 3), (0, 1)]
    assert all(s.grad_norm > 0 and s.loss > 0 for s in steps)
    assert steps[0].params["lm_head.weight"].ne(steps[1].params["lm_head.weight"]).any()


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module


def test_reference_uses_nothing_of_hf_cp():
    # models.py may register hf_cp's attention, for the runs under test (never for the reference's "sdpa")
    allowed = {"reference.py": set(), "models.py": {"hf_cp.attention.interface"}}
    for name, ok in allowed.items():
        used = [
            m
            for m in _imports(REPO / "tests" / "helpers" / "harness" / name)
            if m.split(".")[0] == "hf_cp" and m not in ok
        ]
        assert used == [], f"tests/helpers/harness/{name} imports {used}: the reference must not share code it checks"


def test_package_imports_no_test_code():
    for path in sorted((REPO / "hf_cp").rglob("*.py")):
        bad = [m for m in _imports(path) if m.split(".")[0] in ("helpers", "harness", "tests", "conftest", "pytest")]
        assert bad == [], f"{path.relative_to(REPO)} imports test code: {bad}"
    assert not (REPO / "hf_cp" / "train" / "testing.py").exists()


def test_the_parameter_check_leaves_out_only_entries_whose_reference_gradient_is_within_eps_of_zero():
    """AdamW's update of an entry whose gradient is ~eps (1e-8) follows its fp32 noise: such entries
    are checked through their gradients only, from the step they were that small on; a gap on any
    other entry still fails."""
    from types import SimpleNamespace

    from helpers.harness.check import EPS_DOMINATED, eps_dominated, relative_errors

    grads = torch.full((4, 4), 1e-3)
    grads[1, 2] = 9.77e-9  # the measured case: one entry at fp32 noise
    ref = [SimpleNamespace(grads={"w": grads}), SimpleNamespace(grads={"w": torch.full((4, 4), 1e-3)})]
    want = {"w": torch.ones(4, 4)}
    near_zero = {"w": want["w"].clone()}
    near_zero["w"][1, 2] += 1.5e-5 * 4  # 1.5e-5 of the tensor's norm, above PARAM_RTOL
    assert relative_errors(near_zero, want)["w"] > PARAM_RTOL  # without the mask: fails
    for step in (0, 1):  # the entry stays left out after its gradient grows (its parameter moved)
        assert relative_errors(near_zero, want, eps_dominated(ref, step))["w"] == 0.0
    elsewhere = {"w": want["w"].clone()}
    elsewhere["w"][0, 0] += 1.5e-5 * 4
    assert relative_errors(elsewhere, want, eps_dominated(ref, 1))["w"] > PARAM_RTOL
    assert int(eps_dominated(ref, 1)["w"].sum()) == 1 and 9.77e-9 < EPS_DOMINATED
