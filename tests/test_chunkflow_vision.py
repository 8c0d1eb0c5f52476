"""ChunkFlow's dependent chunks with images and video equal the model's own forward on each sample
alone (issue 38).

A tiny Qwen2.5-VL, Qwen3-VL (DeepStack) and Qwen3.5 (Gated DeltaNet beside attention), random
weights, run a step through PlanCollator and StepExecutor on one rank: a sample with two images
whose placeholders cross chunk boundaries, a sample with a two-frame clip, and a text-only
sample, each as dependent chunks (K=1: every chunk but the last recomputed; K >= N: none), beside
a standalone micro-batch with an image. The reference is independent of hf_cp: transformers' own
forward of the family (its own M-RoPE, its own vision scatter, sdpa) on each sample alone. The
tower's calls are counted (a chunked sample's items: once without a graph, once with one), and the
break tests (a chunk's row gradient dropped, a chunk fed another chunk's rows) fail the check.
Below them: the chunk planner's count of a chunked sample's items, and CPTrainer at world 2 under
chunkflow (the shared world-2 job).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import hf_cp.attention.interface  # noqa: F401  (registers attn_implementation "hf_cp")
from hf_cp.balance.base import PlanRequest, SampleTooLongError
from hf_cp.balance.registry import get_balancer
from hf_cp.balance.toolkit.sample_limit import chunk_fits, sample_token_limit
from hf_cp.cost.dims import ModelDims, VisionDims
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.cost.model import CostModel
from hf_cp.cost.simulate import simulate
from hf_cp.plan.chunks import chunked_memory_bytes, chunked_vision_bytes, dependent_chunk_sizes, vision_rows_bytes
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import ChunkedSample, Group, PlanError, StepPlan, Wave
from hf_cp.train.data.collator import PlanCollator
from hf_cp.train.data.vision_columns import vision_reader
from hf_cp.train.step import chunk_vision
from hf_cp.train.step.executor import StepExecutor
from hf_cp.train.step.groups import CPGroups
from hf_cp.train.step.vision_tower import vision_tower_of

from helpers.harness.check import check_run
from helpers.harness.models import train_rows
from helpers.tiny_vlm import IMAGE_TOKEN, VIDEO_TOKEN, build_vlm, make_sample, reference_sample_loss
from helpers.world2_job import FIXTURE_TIMEOUT, executed_plans

CAP = 256
TOL = 2e-5  # relative to the largest reference gradient of each parameter (as tests/test_vision_exact.py)
CHUNK = 16
LAYOUTS = {
    # two images; chunks of 15-16 tokens cut through both images' placeholders
    0: [("text", 5), ("image", (1, 8, 8)), ("text", 6), ("image", (1, 4, 8)), ("text", 4)],
    # a two-frame clip, cut through too
    1: [("text", 3), ("video", (2, 4, 8)), ("text", 12)],
    2: [("text", 40)],  # text only, chunked, in a vision run
    3: [("text", 4), ("image", (1, 4, 4)), ("text", 3)],  # standalone, beside the chunked ones
}
CHUNKED = (0, 1, 2)
# the fast suite's families (plain, DeepStack, hybrid: tests/test_vision_exact.py's); the others slow
FAST = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")
FAMILIES = FAST + ("qwen2_vl", "qwen3_vl_moe", "qwen3_5_moe")
CASES = [f if f in FAST else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]


def _rows(family: str):
    return {s: make_sample(s, lay, frames_apart=family.startswith("qwen3")) for s, lay in LAYOUTS.items()}


def _plan(lengths, keep: int) -> StepPlan:
    ids = sorted(lengths)
    waves = [Wave([Group(ranks=(0,), chunked={0: [ChunkedSample(s, CHUNK, keep)]})]) for s in CHUNKED]
    waves.append(Wave([Group(ranks=(0,), local={0: [3]})]))
    return StepPlan(
        world_size=1,
        max_tokens_per_rank=CAP,
        sample_ids=ids,
        lengths=[lengths[s] for s in ids],
        balancer="test:chunkflow-vision",
        waves=waves,
    )


def reference(family: str, rows):
    model = build_vlm("sdpa", family=family)
    valid = sum(len(r["input_ids"]) - 1 for r in rows.values())
    total = sum(reference_sample_loss(model, rows[s], valid) for s in sorted(rows))
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run_chunked(family: str, rows, keep: int, patch=None, evaluate: bool = False):
    """(loss, per-parameter gradients, (patches, with a graph) of each tower call) of the step on
    one rank; with `evaluate`, its planned evaluation (forward only) instead."""
    model = build_vlm("hf_cp", family=family)
    tower = vision_tower_of(model, "test")
    encoded = []
    encode = tower.encode

    def counting(pixels, grid):
        encoded.append((int(pixels.shape[0]), torch.is_grad_enabled()))
        return encode(pixels, grid)

    tower.encode = counting
    vision = vision_reader(lambda s: rows[s], tower.token_ids, tower.merge, tower.rope_positions)
    collator = PlanCollator(lambda s: (rows[s]["input_ids"], None), vision=vision)
    lengths = {s: len(r["input_ids"]) for s, r in rows.items()}
    valid = sum(n - 1 for n in lengths.values())
    plan = _plan(lengths, keep)
    executor = StepExecutor(
        model,
        CPGroups(ClusterSpec(1, CAP)),
        1,
        0,
        torch.device("cpu"),
        0,
        lambda loss, last: loss.backward(),
        vision=tower,
    )
    step = collator.rank_step(plan, 0, valid)
    if evaluate:
        with torch.no_grad():
            return executor.evaluate(model, step).loss_sum / valid, None, encoded
    with patch if patch is not None else contextlib.nullcontext():
        totals = executor.train(model, step)
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    # the zero-weighted dummy image of the chunks after the first (4 patches) is not an item
    real = [e for e in encoded if e[0] != tower.merge**2]
    return totals.loss_sum / valid, grads, real


def _worst(grads, ref_grads):
    err, worst = 0.0, ""
    for name, g in grads.items():
        ref = ref_grads.get(name, torch.zeros_like(g))
        e = (g - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
        if e > err:
            err, worst = e, name
    return err, worst


def test_the_samples_placeholders_cross_chunk_boundaries():
    rows = _rows("qwen2_5_vl")
    for s in (0, 1):
        ids = torch.tensor(rows[s]["input_ids"])
        holder = (ids == IMAGE_TOKEN) | (ids == VIDEO_TOKEN)
        ends = torch.tensor(dependent_chunk_sizes(len(ids), CHUNK)).cumsum(0)[:-1]
        assert len(ends) >= 2
        assert any(bool(holder[e - 1] and holder[e]) for e in ends.tolist()), s  # one item spans a cut


@pytest.mark.parametrize("keep", [1, 8])
@pytest.mark.parametrize("family", CASES)
def test_chunked_vision_samples_equal_each_sample_alone(family, keep, one_torch_thread):
    rows = _rows(family)
    ref_loss, ref_grads = reference(family, rows)
    loss, grads, encoded = run_chunked(family, rows, keep)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    err, worst = _worst(grads, ref_grads)
    assert err <= TOL, (err, worst)
    # every tower parameter has a reference gradient, and is compared
    visual = [n for n in ref_grads if ".visual." in f".{n}"]
    assert len(visual) == sum(
        1 for n, _ in build_vlm("sdpa", family=family).named_parameters() if ".visual." in f".{n}"
    )
    # a chunked sample's items: encoded once without a graph (the rows every chunk reads) and once
    # with one (chunk 0's pass, whose backward runs the tower's); the standalone batch's once
    every = {s: len(r.get("pixel_values", ())) + len(r.get("pixel_values_videos", ())) for s, r in rows.items()}
    want = [(every[s], False) for s in CHUNKED if every[s]] + [(every[s], True) for s in every if every[s]]
    assert sorted(encoded) == sorted(want), encoded


def test_planned_evaluation_of_chunked_vision_samples_equals_each_sample_alone(one_torch_thread):
    family = "qwen3_vl"
    rows = _rows(family)
    ref_loss, _ = reference(family, rows)
    loss, _, encoded = run_chunked(family, rows, 1, evaluate=True)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    assert all(not graph for _, graph in encoded) and len(encoded) == 3  # two chunked samples, one standalone


def _dropping_a_chunks_row_gradient():
    """The break: chunk 1's rows reach the model, but their gradient never reaches the tower."""
    accumulate = chunk_vision.ChunkVision._accumulate

    def dropping(self, a, b):
        add = accumulate(self, a, b)
        return (lambda g: None) if self.bounds[1] == (a, b) else add

    return _patched(chunk_vision.ChunkVision, "_accumulate", dropping)


def _stale_rows():
    """The break: every chunk after the first is fed the sample's first rows, not its own."""
    forward = chunk_vision.ChunkVision.forward

    @contextlib.contextmanager
    def stale(self, i, graph):
        a, b = self.bounds[i]
        if i > 0:
            self.bounds[i] = (0, b - a)
        try:
            with forward(self, i, graph):
                yield
        finally:
            self.bounds[i] = (a, b)

    return _patched(chunk_vision.ChunkVision, "forward", stale)


class _patched:
    def __init__(self, owner, name, value):
        self.owner, self.name, self.value = owner, name, value

    def __enter__(self):
        self.old = getattr(self.owner, self.name)
        setattr(self.owner, self.name, self.value)
        return self

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self.old)
        return False


@pytest.mark.parametrize("brk", ["dropped gradient", "stale rows"])
def test_a_broken_chunk_fails_the_check(brk, one_torch_thread):
    family = "qwen3_vl"
    rows = _rows(family)
    ref_loss, ref_grads = reference(family, rows)
    patch = _dropping_a_chunks_row_gradient() if brk == "dropped gradient" else _stale_rows()
    loss, grads, _ = run_chunked(family, rows, 1, patch=patch)
    err, worst = _worst(grads, ref_grads)
    assert err > 100 * TOL, (err, worst)
    if brk == "stale rows":
        assert abs(loss - ref_loss) > 1e-4 * abs(ref_loss)


# ------------------------------------------------------------------ the chunk planner's memory
# Qwen2.5-VL-7B on the H200 profile: an image of 56 x 56 patches holds 1280 tokens of the tower's
# activations (tests/test_vision_memory.py) and 784 rows of 3584 (bf16, with a float32 gradient)
IMAGE = (1, 56, 56)
PLAN_CAP = 8192


@pytest.fixture(scope="module")
def vl_cost():
    return CostModel(
        ModelDims.load("qwen2.5-vl-7b"), HardwareProfile.load("h200-qwen2.5-7b"), None, VisionDims.load("qwen2.5-vl-7b")
    )


def test_held_rows_by_hand(vl_cost):
    assert vision_rows_bytes(vl_cost, 3136) == 784 * 3584 * (2 + 4)
    assert vision_rows_bytes(vl_cost, 0) == 0 == chunked_vision_bytes(vl_cost, 0)
    alpha = vl_cost.profile.activation_bytes_per_token
    assert chunked_vision_bytes(vl_cost, 3136) == 1280 * alpha + 784 * 3584 * 6


def test_chunkflow_plans_a_chunked_samples_items_beside_its_chunks(vl_cost):
    """A 12000-token sample at a cap of 8192 runs as chunks of 4000 as text; with an image its
    tower's activations and held rows leave room for chunks of 2400, which the plan takes, and the
    validator refuses the text-only chunking with the image."""
    cl = ClusterSpec(1, PLAN_CAP)
    balancer = get_balancer("chunkflow")
    limit = sample_token_limit(balancer, cl, vl_cost)
    assert chunk_fits(vl_cost, 12000, 1, PLAN_CAP, PLAN_CAP, 256) == 4000
    assert chunk_fits(vl_cost, 12000, 1, PLAN_CAP, PLAN_CAP, 256, 3136) == 2400
    req = PlanRequest([0, 1], [12000, 500], cl, vl_cost, max_sample_tokens=limit, vision={0: [IMAGE]})
    plan = balancer.plan(req).validate(cl, vl_cost)
    chunked = [c for w in plan.waves for g in w.groups for cs in g.chunked.values() for c in cs]
    assert [(c.sample, c.chunk_size) for c in chunked] == [(0, 2400)]
    peak = simulate(plan, vl_cost, cl).peak_memory_bytes[0]
    sizes = dependent_chunk_sizes(12000, 2400)
    assert peak == pytest.approx(chunked_memory_bytes(vl_cost, sizes, 1, 3136))
    assert peak <= vl_cost.memory_bytes(PLAN_CAP)
    text_chunks = StepPlan(
        1,
        PLAN_CAP,
        [0],
        [12000],
        vision={0: [IMAGE]},
        balancer="hand",
        waves=[Wave([Group(ranks=(0,), chunked={0: [ChunkedSample(0, 4000, 1)]})])],
    )
    with pytest.raises(PlanError, match=r"chunked sample 0 .*images' and clips' tower activations .*3136 patches"):
        text_chunks.validate(cl, vl_cost)


def test_a_chunked_sample_whose_items_leave_no_room_is_refused_by_name(vl_cost):
    cl = ClusterSpec(1, PLAN_CAP)
    balancer = get_balancer("chunkflow")
    limit = sample_token_limit(balancer, cl, vl_cost)
    req = PlanRequest([0], [16000], cl, vl_cost, max_sample_tokens=limit, vision={0: [IMAGE, IMAGE, IMAGE]})
    with pytest.raises(SampleTooLongError, match=r"sample 0 \(16000 tokens\) fits neither .*9408 patches"):
        balancer.plan(req)


# ------------------------------------------------------------------ CPTrainer at world 2
@pytest.mark.timeout(FIXTURE_TIMEOUT)
def test_chunkflow_with_images_and_clips_under_the_trainer_equals_single_process(world2_job):
    """CPTrainer at world 2 (DeepSpeed ZeRO-2, gloo), cp_balancer chunkflow, on the tiny
    Qwen2.5-VL's samples with random images and clips (world2_job: qwen2_5_vl-chunkflow): loss,
    every gradient (the tower's included) and every parameter after AdamW equal single-process
    training on the model's own forward, step by step."""
    spec = world2_job["qwen2_5_vl-chunkflow"]
    rows = train_rows(spec)
    items = {s for s, r in enumerate(rows) if "pixel_values" in r or "pixel_values_videos" in r}
    chunked = [
        (r, c.sample, len(dependent_chunk_sizes(spec["lengths"][c.sample], c.chunk_size)))
        for p in executed_plans(spec)
        for w in p.waves
        for g in w.groups
        for r, cs in g.chunked.items()
        for c in cs
    ]
    # the image-and-clip samples ran as dependent chunks, on both ranks, beside standalone ones
    assert {s for _, s, _ in chunked} == {0, 4, 6} <= items and {r for r, _, _ in chunked} == {0, 1}
    assert max(n for _, _, n in chunked) == 4
    assert all("pixel_values_videos" in rows[s] for _, s, _ in chunked)
    report = check_run(spec)
    assert report.steps == list(range(spec["steps"]))
