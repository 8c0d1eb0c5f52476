"""CPTrainer on real gloo process groups (torchrun) against a single-process reference.

Every job runs DeepSpeed ZeRO-2 through the Trainer's own DeepSpeed path; the reference trains
the same model on the same global batches sample by sample (hf_cp.train.testing). Parameters
are compared per tensor as ||distributed - reference|| / ||reference|| (fp32).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from hf_cp.balance import available_balancers
from hf_cp.cluster import ClusterSpec
from hf_cp.cost import CostModel
from hf_cp.planning import GlobalBatchSampler, Planner
from hf_cp.train.testing import balancer_for, reference_eval_loss, reference_params, run_distributed

# Unshuffled at 500 tokens per step: [0 1 2] (three packs at a 256 cap: a rank idles in one
# wave of static), [3] alone (a step that gives ranks no sample), [4..9], [10..16].
LENGTHS = [200, 150, 130, 250, 255, 90, 7, 33, 60, 40, 120, 100, 18, 5, 64, 21, 77]
CAP = 256
TOKENS_PER_STEP = 500
REL_TOL = 1e-5
JOB_TIMEOUT = 300

HAS_MEGATRON = importlib.util.find_spec("megatron") is not None
BALANCERS = [b for b in available_balancers() if b != "megatron" or HAS_MEGATRON]
MODES = ["fixed_ulysses", "fixed_ring_zigzag", "fixed_ring_per_doc"]


def spec_for(tmp_path: Path, balancer: str, steps: int = 3, **kw) -> dict:
    return dict(
        lengths=LENGTHS,
        tokens_per_step=TOKENS_PER_STEP,
        max_tokens_per_rank=CAP,
        steps=steps,
        balancer=balancer,
        out=str(tmp_path / f"{balancer}-{kw.pop('tag', 'run')}"),
        **kw,
    )


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


def assert_matches_reference(spec: dict) -> float:
    got = torch.load(Path(spec["out"]) / "params.pt")
    ref = reference_params(spec)
    assert set(got) == set(ref)
    rel = {k: float((got[k] - ref[k]).norm() / ref[k].norm()) for k in ref}
    worst = max(rel, key=rel.get)
    assert rel[worst] < REL_TOL, f"{worst}: relative error {rel[worst]:.3g} (all: {rel})"
    init = reference_params(dict(spec, steps=0))
    moved = sum(float((ref[k] - init[k]).norm()) for k in ref)
    assert moved > 0, "the reference did not train: the comparison would be vacuous"
    return rel[worst]


def history(spec: dict):
    return json.loads((Path(spec["out"]) / "history.json").read_text())


# ---------------------------------------------------------------------------------- fast
@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_two_processes_static_equal_single_process(tmp_path):
    waves, steps = idle_cases("static", 2)
    assert waves >= 1 and steps >= 1, "the data must give a rank an idle wave and a sample-free step"
    spec = spec_for(tmp_path, "static")
    run_distributed(spec, 2, timeout=JOB_TIMEOUT)
    assert_matches_reference(spec)
    h = history(spec)
    assert [r["index"] for r in h] == [0, 1, 2]
    assert h[1]["rank_tokens"] == [250, 0]  # step 1: one sample, rank 1 ran only a dummy micro-batch
    assert all(r["waves"] >= 1 and len(r["measured_ms"]) == 2 for r in h)


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_two_processes_ring_zigzag_equal_single_process(tmp_path):
    waves, _ = idle_cases("fixed_ring_zigzag", 2)
    assert waves >= 1
    spec = spec_for(tmp_path, "fixed_ring_zigzag")
    run_distributed(spec, 2, timeout=JOB_TIMEOUT)
    assert_matches_reference(spec)
    assert any(int(g) == 2 for r in history(spec) for g in r["cp_size_samples"])  # really distributed


@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.parametrize(
    "mode",
    [
        "ring_per_doc",
        pytest.param("ulysses", marks=pytest.mark.slow),
        pytest.param("ring_zigzag", marks=pytest.mark.slow),
    ],
)
def test_members_with_empty_shards_run_padding_and_stay_exact(tmp_path, mode):
    # every sample distributed over both ranks on its own: the 1-token ones leave rank 1 empty
    lengths = [1, 40, 2, 1, 30, 3]
    spec = dict(
        lengths=lengths,
        tokens_per_step=40,
        max_tokens_per_rank=64,
        steps=3,
        balancer=f"spread_{mode}",
        out=str(tmp_path / mode),
    )
    empty = [s for s, n in enumerate(lengths) if n == 1]
    assert empty, "the case needs samples shorter than the split"
    run_distributed(spec, 2, timeout=JOB_TIMEOUT)
    assert_matches_reference(spec)


@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.parametrize("chunk", [0, 16])
def test_full_logits_and_small_loss_chunks_equal_single_process(tmp_path, chunk):
    # 0: the model's own logits; 16: many chunks per shard (the default 2048 covers a whole shard)
    spec = spec_for(tmp_path, "fixed_ring_zigzag", tag=f"chunk{chunk}", loss_chunk_tokens=chunk)
    run_distributed(spec, 2, timeout=JOB_TIMEOUT)
    assert_matches_reference(spec)


# 400 and 260 tokens exceed one rank's cap (256): evaluated over a CP group of 2
EVAL_LENGTHS = [400, 30, 7, 120, 90, 260, 5]


@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.parametrize("balancer, eval_lengths", [("auto", EVAL_LENGTHS), ("static", [5])])
def test_planned_evaluation_equals_single_process(tmp_path, balancer, eval_lengths):
    # ("static", [5]): one short sample, so rank 1 has no evaluation work at all
    spec = spec_for(tmp_path, balancer, tag="eval", eval_lengths=eval_lengths, eval_steps=2)
    run_distributed(spec, 2, timeout=JOB_TIMEOUT)
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


@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("fixed_ulysses", marks=pytest.mark.slow),
        "fixed_ring_zigzag",
        pytest.param("fixed_ring_per_doc", marks=pytest.mark.slow),
    ],
)
def test_activation_checkpointing_equals_single_process(tmp_path, mode):
    # the recomputed forward runs the CP collectives again inside backward (the CP context is
    # still open there): it must give the same gradients as the stored activations
    spec = spec_for(tmp_path, mode, tag="ckpt", activation_checkpointing=True)
    run_distributed(spec, 2, timeout=JOB_TIMEOUT)
    assert_matches_reference(spec)


# ---------------------------------------------------------------------------------- slow matrix
@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT + 120)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("balancer", BALANCERS + MODES)
def test_balancer_and_mode_equal_single_process(tmp_path, balancer, world):
    spec = spec_for(tmp_path, balancer, tag=f"w{world}")
    run_distributed(spec, world, timeout=JOB_TIMEOUT)
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
    assert [r["loss"] for r in hb] == pytest.approx([r["loss"] for r in ha[2:]], rel=1e-6)
    trained = _trained_ids(Path(full["out"]), below=2) + _trained_ids(Path(resumed["out"]))
    assert sorted(trained) == list(range(len(LENGTHS))), "every sample of the epoch exactly once"
