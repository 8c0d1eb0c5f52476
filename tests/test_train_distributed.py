"""CPTrainer on real gloo process groups (torchrun) against a single-process reference.

Every job runs DeepSpeed ZeRO-2 through the Trainer's own DeepSpeed path; the reference trains
the same model on the same global batches sample by sample (tests/helpers/harness/reference.py), and
harness.check compares every step: loss, gradients before the optimizer, parameters after it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_cp.cost.model import CostModel
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.planning import GlobalBatchSampler, Planner

from helpers.harness.balancers import balancer_for
from helpers.harness.job import run_distributed
from helpers.harness.reference import reference_eval_loss
from helpers.world2_job import (
    BALANCERS,
    CAP,
    COLLECTIVE_TIMEOUT,
    EVAL_LENGTHS,
    JOB_TIMEOUT,
    LENGTHS,
    TOKENS_PER_STEP,
    WORLD2_JOB_TIMEOUT,
    assert_matches_reference,
    empty_shard_spec,
    shared_or_own_run,
    spec_for,
)

MODES = ["fixed_ulysses", "fixed_ring_zigzag", "fixed_ring_per_doc"]


def plans(balancer: str, world: int, steps: int = 3):
    sampler = GlobalBatchSampler(LENGTHS, TOKENS_PER_STEP, seed=42, max_steps=steps, shuffle=False)
    planner = Planner(
        sampler,
        balancer_for(balancer) or balancer,
        ClusterSpec(world, CAP),
        CostModel.load("tiny-llama", "h200-qwen2.5-7b"),
        seed=42,
        lookahead=0,
    )
    return [planner.get(k).plan for k in range(steps)]


def idle_cases(balancer: str, world: int):
    """(waves where some rank has no work, steps where some rank has no sample at all)."""
    idle_waves = no_sample_steps = 0
    for plan in plans(balancer, world):
        busy_in_step = set()
        for wave in plan.waves:
            busy = {r for g in wave.groups for r in g.ranks if g.distributed or g.local.get(r)}
            busy_in_step |= busy
            idle_waves += len(busy) < world
        no_sample_steps += len(busy_in_step) < world
    return idle_waves, no_sample_steps


def history(spec: dict):
    return json.loads((Path(spec["out"]) / "history.json").read_text())


# ---------------------------------------------------------------------------------- fast
# The fast cases read their runs from the session's world-2 job (world2_job.py: one pair of
# processes trains them all); their slow variants start a job of their own.
SHARED_TIMEOUT = WORLD2_JOB_TIMEOUT + 60  # the first test to ask for the job waits for it


@pytest.mark.timeout(SHARED_TIMEOUT)
def test_two_processes_static_equal_single_process(world2_job):
    waves, steps = idle_cases("static", 2)
    assert waves >= 1 and steps >= 1, "the data must give a rank an idle wave and a sample-free step"
    spec = world2_job["static"]
    assert spec["lengths"] == LENGTHS and spec["balancer"] == "static"
    assert_matches_reference(spec)
    h = history(spec)
    assert [r["index"] for r in h] == [0, 1, 2]
    assert h[1]["rank_tokens"] == [250, 0]  # step 1: one sample, rank 1 ran only a dummy micro-batch
    assert all(r["waves"] >= 1 and len(r["measured_ms"]) == 2 for r in h)


@pytest.mark.timeout(SHARED_TIMEOUT)
def test_two_processes_ring_zigzag_equal_single_process(world2_job):
    waves, _ = idle_cases("fixed_ring_zigzag", 2)
    assert waves >= 1
    spec = world2_job["fixed_ring_zigzag"]
    assert spec["lengths"] == LENGTHS and spec["balancer"] == "fixed_ring_zigzag"
    assert_matches_reference(spec)
    assert any(int(g) == 2 for r in history(spec) for g in r["cp_size_samples"])  # really distributed


@pytest.mark.timeout(SHARED_TIMEOUT)
@pytest.mark.parametrize(
    "mode",
    [
        "ring_per_doc",
        pytest.param("ulysses", marks=pytest.mark.slow),
        pytest.param("ring_zigzag", marks=pytest.mark.slow),
    ],
)
def test_members_with_empty_shards_run_padding_and_stay_exact(request, tmp_path, mode):
    # every sample distributed over both ranks on its own: the 1-token ones leave rank 1 empty
    spec = dict(empty_shard_spec(mode), out=str(tmp_path / mode))
    empty = [s for s, n in enumerate(spec["lengths"]) if n == 1]
    assert empty, "the case needs samples shorter than the split"
    spec = shared_or_own_run(request, f"empty-shards-{mode}", spec, JOB_TIMEOUT)
    assert_matches_reference(spec)


@pytest.mark.timeout(SHARED_TIMEOUT)
@pytest.mark.parametrize("chunk", [0, 16])
def test_full_logits_and_small_loss_chunks_equal_single_process(world2_job, chunk):
    # 0: the model's own logits; 16: many chunks per shard (the default 2048 covers a whole shard)
    spec = world2_job[f"loss-chunks-{chunk}"]
    assert spec["loss_chunk_tokens"] == chunk and spec["balancer"] == "fixed_ring_zigzag"
    assert_matches_reference(spec)


@pytest.mark.timeout(SHARED_TIMEOUT)
@pytest.mark.parametrize("balancer, eval_lengths", [("auto", EVAL_LENGTHS), ("static", [5])])
def test_planned_evaluation_equals_single_process(world2_job, balancer, eval_lengths):
    # ("static", [5]): one short sample, so rank 1 has no evaluation work at all
    spec = world2_job[f"eval-{balancer}"]
    assert spec["eval_lengths"] == eval_lengths and spec["eval_steps"] == 2 and spec["balancer"] == balancer
    out = Path(spec["out"])
    final = [json.loads((out / f"eval_rank{r}.json").read_text()) for r in range(2)]
    for m in final:
        m.pop("eval_runtime")
    assert final[0] == final[1], "every rank reports the same evaluation"
    assert final[0]["eval_samples"] == len(eval_lengths) and final[0]["eval_tokens"] >= sum(eval_lengths)
    assert final[0]["eval_loss"] == pytest.approx(reference_eval_loss(spec, 3), rel=1e-5)
    # the Trainer's own evaluations (eval_steps=2, and at the last step) went through the same path
    logged = [rec for rec in json.loads((out / "log_history.json").read_text()) if "eval_loss" in rec]
    assert [rec["step"] for rec in logged] == [2, 3, 3]  # the last one is the evaluate() call above
    assert logged[0]["eval_loss"] == pytest.approx(reference_eval_loss(spec, 2), rel=1e-5)
    assert logged[1]["eval_loss"] == pytest.approx(final[0]["eval_loss"], rel=1e-12)
    assert logged[0]["eval_loss"] != pytest.approx(logged[1]["eval_loss"], rel=1e-6), "training moved the loss"
    assert_matches_reference(spec)  # evaluating between steps leaves training exact


@pytest.mark.timeout(SHARED_TIMEOUT)
@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("fixed_ulysses", marks=pytest.mark.slow),
        "fixed_ring_zigzag",
        pytest.param("fixed_ring_per_doc", marks=pytest.mark.slow),
    ],
)
def test_activation_checkpointing_equals_single_process(request, tmp_path, mode):
    # the recomputed forward runs the CP collectives again inside backward (the CP context is
    # still open there): it must give the same gradients as the stored activations
    spec = spec_for(tmp_path, mode, tag="ckpt", activation_checkpointing=True)
    spec = shared_or_own_run(request, f"ckpt-{mode}", spec, JOB_TIMEOUT)
    assert_matches_reference(spec)


# ---------------------------------------------------------------------------------- slow matrix
MATRIX_TIMEOUT = 1800  # one job per world trains every balancer and mode; the first test waits for it


@pytest.fixture(scope="module")
def matrix_runs(tmp_path_factory):
    """world -> {balancer or mode: spec}: one job per world size trains them all, in sequence."""
    done = {}

    def runs_at(world: int) -> dict:
        if world not in done:
            folder = tmp_path_factory.mktemp(f"matrix-w{world}")
            runs = {b: dict(spec_for(folder, b), ddp_timeout=COLLECTIVE_TIMEOUT) for b in BALANCERS + MODES}
            run_distributed({"runs": list(runs.values())}, world, timeout=MATRIX_TIMEOUT)
            done[world] = runs
        return done[world]

    return runs_at


@pytest.mark.slow
@pytest.mark.timeout(MATRIX_TIMEOUT + 120)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("balancer", BALANCERS + MODES)
def test_balancer_and_mode_equal_single_process(matrix_runs, balancer, world):
    spec = matrix_runs(world)[balancer]
    assert_matches_reference(spec)
    assert [r["index"] for r in history(spec)] == [0, 1, 2]


@pytest.mark.slow
def test_static_on_four_ranks_leaves_ranks_without_samples():
    waves, steps = idle_cases("static", 4)
    assert waves >= 2 and steps >= 2


# ---------------------------------------------------------------------------------- resume
def _trained_ids(out: Path, below: int = None, from_index: int = 0):
    ids = []
    for f in sorted((out / "cp_history").glob("rank*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if rec["index"] >= from_index and (below is None or rec["index"] < below):
                ids += rec["trained_sample_ids"]
    return ids


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_TIMEOUT + 120)
@pytest.mark.parametrize("balancer", ["auto", "fixed_ring_per_doc"])
def test_resume_after_step_two_equals_uninterrupted_run(tmp_path, balancer):
    sampler = GlobalBatchSampler(LENGTHS, TOKENS_PER_STEP, shuffle=False)
    assert len(sampler.epoch_batches(0)) == 4  # steps 1-4 are exactly one epoch
    full = spec_for(tmp_path, balancer, steps=4, save_steps=2, tag="full")
    run_distributed(full, 2, timeout=JOB_TIMEOUT)
    ckpt = Path(full["out"]) / "checkpoint-2"
    assert ckpt.is_dir()
    resumed = spec_for(tmp_path, balancer, steps=4, resume_from=str(ckpt), tag="resumed")
    run_distributed(resumed, 2, timeout=JOB_TIMEOUT)
    a = torch.load(Path(full["out"]) / "params.pt")
    b = torch.load(Path(resumed["out"]) / "params.pt")
    for k in a:
        assert float((a[k] - b[k]).norm() / a[k].norm()) < 1e-6, k
    ha, hb = history(full), history(resumed)
    assert [r["index"] for r in hb] == [2, 3]  # only steps 3-4 ran after the resume
    assert_matches_reference(full)
    assert_matches_reference(resumed)  # steps 3-4 step by step: the optimizer state came back whole
    assert [r["loss"] for r in hb] == pytest.approx([r["loss"] for r in ha[2:]], rel=1e-6)
    trained = _trained_ids(Path(full["out"]), below=2) + _trained_ids(Path(resumed["out"]))
    assert sorted(trained) == list(range(len(LENGTHS))), "every sample of the epoch exactly once"
