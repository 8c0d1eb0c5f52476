"""A tiny Qwen2.5-VL and a tiny Qwen3-VL (DeepStack; each clip frame apart) under CPTrainer and
DeepSpeed ZeRO-2 on 4 gloo processes (issue 38's world 4), for static, auto, magi and chunkflow:
one torchrun job a family (about 40 s on 2 cores) trains its four runs one after the other, on the
world-2 VLM runs' data (tests/helpers/world2_job.py: BALANCE_LENGTHS, random images and two-frame
clips, tests/helpers/harness/models.py vision_rows in the family's layout) at a cap of 144 tokens a
rank.
Each step's loss, every gradient (the vision tower's too) and every parameter after AdamW equal
single-process training on the model's own forward, each sample alone (helpers/harness/reference.py),
at the world-2 VLM runs' tolerances (harness.check, AdamW eps CHUNKFLOW_ADAM_EPSILON).

At 144 tokens a rank the 400-token sample (an image and a clip: 440 tokens with its items'
activations) fits only a CP group of all 4 ranks, and every balancer spreads it there. Then, for
both families alike, as the executed plans show (re-planned and matched to the digests the runs
recorded):
static keeps that CP size for every sample of the run; auto and magi keep short samples on one
rank and spread step 2's 150- and 120-token samples (each an image and a clip) over CP groups of
2; chunkflow (64-token chunks, K=1, stragglers spread) spreads the 150-token one over 2 ranks and
runs the others, the 120-token image-and-clip sample among them, as dependent chunks on one rank.
Worst errors measured on Qwen3-VL: gradients 2.7e-6 (static), parameters 1.7e-6 (static).
"""

from __future__ import annotations

import time

import pytest

from hf_cp.plan.chunks import dependent_chunk_sizes

from helpers.harness.check import check_run
from helpers.harness.job import run_distributed
from helpers.harness.models import tiny_model, train_rows, vision_rows
from helpers.harness.reference import sample_loss_sum
from helpers.tiny_vlm import VISION_START
from helpers.world2_job import (
    BALANCE_LENGTHS,
    CHUNKFLOW_ADAM_EPSILON,
    COLLECTIVE_TIMEOUT,
    VLM_BALANCERS,
    balance_spec,
    executed_plans,
)

WORLD = 4
WORLD4_CAP = 144
BALANCERS = VLM_BALANCERS + ("chunkflow",)
FAMILIES = ("qwen2_5_vl", "qwen3_vl")
CHUNKFLOW_OPTIONS = dict(chunk_size=64, keep=1)  # spread_stragglers: its default (on)
JOB_TIMEOUT = 600


@pytest.fixture(scope="module", params=FAMILIES)
def world4_vlm_runs(request, tmp_path_factory):
    """{balancer: spec} of one family's runs, trained by one job (one family's job at a time)."""
    family = request.param
    root = tmp_path_factory.mktemp(f"vision_world4_{family}")
    runs = {
        b: dict(
            # AdamW eps as the world-2 VLM runs'
            balance_spec(b, model=family, adam_epsilon=CHUNKFLOW_ADAM_EPSILON),
            max_tokens_per_rank=WORLD4_CAP,
            out=str(root / f"{family}-{b}"),
            ddp_timeout=COLLECTIVE_TIMEOUT,
        )
        for b in BALANCERS
    }
    runs["chunkflow"]["balancer_options"] = dict(CHUNKFLOW_OPTIONS)
    t0 = time.perf_counter()
    proc = run_distributed({"runs": list(runs.values())}, WORLD, timeout=JOB_TIMEOUT)
    print(f"world-4 {family} job: {len(runs)} runs in {time.perf_counter() - t0:.1f} s")
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("harness.job:")))
    return runs


def placement(plans) -> list:
    """Per step, what ran where: each group's ranks with its spread, local and chunked samples."""
    return [
        sorted(
            (
                g.ranks,
                tuple(sorted(g.distributed)),
                tuple(sorted((r, tuple(s)) for r, s in g.local.items())),
                tuple(sorted((r, tuple((c.sample, c.chunk_size) for c in cs)) for r, cs in g.chunked.items())),
            )
            for w in p.waves
            for g in w.groups
        )
        for p in plans
    ]


def spread_sizes(plans) -> dict:
    """{sample: size of the CP group that holds it} for the samples spread over several ranks."""
    return {s: g.size for p in plans for w in p.waves for g in w.groups if g.size > 1 for s in g.distributed}


def chunk_counts(spec, plans) -> dict:
    """{sample: number of dependent chunks} for the samples run as chunks."""
    return {
        c.sample: len(dependent_chunk_sizes(spec["lengths"][c.sample], c.chunk_size))
        for p in plans
        for w in p.waves
        for g in w.groups
        for cs in g.chunked.values()
        for c in cs
    }


def local_samples(plans) -> set:
    return {s for p in plans for w in p.waves for g in w.groups for ids in g.local.values() for s in ids}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_harness_vision_rows_keep_their_lengths_in_each_familys_layout(family):
    """vision_rows writes each family's processor layout at the requested lengths: Qwen3-VL's clip
    frames apart (per frame two timestamp tokens and its own start/end pair), no second_per_grid_ts;
    the model's own forward takes the rows (its placeholder counts match its features)."""
    lengths = list(range(1, 420, 11)) + BALANCE_LENGTHS
    rows = vision_rows(lengths, seed=3, family=family)
    assert [len(r["input_ids"]) for r in rows] == [r["length"] for r in rows] == lengths
    clips = [r for r in rows if "pixel_values_videos" in r]
    assert clips and all("pixel_values" in r for r in clips)
    for r in clips:  # one image and one clip: its frames apart for Qwen3-VL
        frames = int(r["video_grid_thw"][0][0]) if family == "qwen3_vl" else 1
        assert r["input_ids"].count(VISION_START) == 1 + frames
        assert ("second_per_grid_ts" in r) == (family == "qwen2_5_vl")
    model = tiny_model(0, attn="sdpa", family=family)
    assert float(sample_loss_sum(model, train_rows(dict(balance_spec("auto"), model=family))[4])) > 0


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.parametrize("balancer", BALANCERS)
def test_vision_language_training_at_world_4_equals_single_process_step_by_step(world4_vlm_runs, balancer):
    spec = world4_vlm_runs[balancer]
    rows = train_rows(spec)
    clips = {s for s, r in enumerate(rows) if "pixel_values_videos" in r}
    assert {0, 4, 6} <= clips and "pixel_values" in rows[0]  # the 400-token sample: an image and a clip
    plans = executed_plans(spec, world=WORLD)
    sizes, chunks, local = spread_sizes(plans), chunk_counts(spec, plans), local_samples(plans)
    assert sizes.get(0) == WORLD, f"{balancer}: the clip's 400-token sample ran over {sizes.get(0)} ranks"
    every = set(range(len(spec["lengths"])))
    if balancer == "static":  # one CP size for the run: every sample over all 4 ranks
        assert sizes == dict.fromkeys(every, WORLD) and not local and not chunks
    elif balancer in ("auto", "magi"):  # short samples on one rank, the clips over groups of 4 and 2
        assert {sizes[s] for s in clips if s in sizes} == {2, WORLD} and local and not chunks, sizes
    else:  # chunkflow: the clip's sample spread (a straggler), dependent chunks, one with a clip
        assert chunks and max(chunks.values()) >= 2 and clips & set(chunks), (sizes, chunks)
    report = check_run(spec)
    assert report.steps == list(range(spec["steps"]))
    print(f"{spec['model']} {balancer}: spread {sizes}, chunked {chunks}, worst {report.worst}")


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_the_world_4_runs_plans_differ_where_their_balancers_do(world4_vlm_runs):
    placed = {b: placement(executed_plans(spec, world=WORLD)) for b, spec in world4_vlm_runs.items()}
    # static against every planner that keeps short samples local; chunkflow's chunks against auto's
    # and magi's groups. (auto may pick magi's plan: it plans the best of its members)
    for b in ("auto", "magi", "chunkflow"):
        assert placed[b][0] != placed["static"][0] and placed[b][1] != placed["static"][1], b
    for b in ("auto", "magi"):
        assert placed[b] != placed["chunkflow"], b
    for b, steps in placed.items():
        assert steps[0] != steps[1], b  # each step planned for its own samples
