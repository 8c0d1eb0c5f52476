"""Vision-language training under planned CP equals the model's own forward on each sample alone
(issue 38).

Tiny Qwen2-VL, Qwen2.5-VL, Qwen3-VL (DeepStack), Qwen3.5 (Gated DeltaNet beside attention) and the two
MoE variants (random weights) train on samples with random images and a video clip. The
hf_cp side runs the training path itself: PlanCollator with the dataset's vision columns
(vision_columns.vision_reader), StepExecutor with the model's VisionTower, in gloo processes at
worlds 1, 2 and 4, a sample with an image and a clip spread over a CP group in every shard mode
(ring zigzag, ring per document, Ulysses, blocks with heads split), beside local samples. The
reference is independent of all of it: transformers' own forward of the family (its own M-RoPE from
mm_token_type_ids, its own vision scatter, sdpa) on each sample alone, in one process. Each item
is encoded on exactly one rank of its group. The break test detaches one rank's encoder output
(an image's embedding gradient dropped) and must fail the check.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hf_cp.attention.interface  # noqa: F401  (registers attn_implementation "hf_cp")
from hf_cp.attention import COMM_COUNTER
from hf_cp.modes.segments import ShardMode
from hf_cp.plan.block_layout import doc_slices, random_layout
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import Group, StepPlan, Wave
from hf_cp.train.data.collator import PlanCollator
from hf_cp.train.data.vision_columns import vision_reader
from hf_cp.train.step.executor import StepExecutor
from hf_cp.train.step.groups import CPGroups
from hf_cp.train.step.vision_tower import vision_tower_of

from helpers.attention_pool import pools  # noqa: F401  (fixture)
from helpers.tiny_vlm import build_vlm, make_sample, reference_sample_loss

CAP = 256
TOL = 2e-5  # relative to the largest reference gradient of each parameter
HEADS = 4
LAYOUTS = {
    # an image and a two-frame clip: spread over the CP group
    0: [("text", 5), ("image", (1, 4, 4)), ("text", 6), ("video", (2, 4, 8)), ("text", 4)],
    # two images
    1: [("text", 3), ("image", (1, 4, 8)), ("text", 2), ("image", (1, 8, 4)), ("text", 7)],
    2: [("text", 13)],  # text only, in a vision run
    3: [("image", (1, 8, 8)), ("text", 9)],  # an image first
}
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe")
# Qwen3-VL's and Qwen3.5's processors (and their MoE variants') put each frame of a clip between its own start/end tokens
ROWS = {f: {s: make_sample(s, lay, frames_apart=f.startswith("qwen3")) for s, lay in LAYOUTS.items()} for f in FAMILIES}
# the fast suite's families (one per kind of language model: plain, DeepStack, hybrid); the others slow
FAST = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")
CASES = [f if f in FAST else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]
MODES = [ShardMode.RING_ZIGZAG, ShardMode.RING_PER_DOC, ShardMode.ULYSSES, ShardMode.BLOCKS]


def _lengths(family: str):
    return {s: len(r["input_ids"]) for s, r in ROWS[family].items()}


def _plan(world: int, lengths, waves) -> StepPlan:
    ids = sorted(lengths)
    return StepPlan(
        world_size=world,
        max_tokens_per_rank=CAP,
        sample_ids=ids,
        lengths=[lengths[s] for s in ids],
        balancer="test:vision",
        waves=waves,
    )


def plans(world: int, family: str):
    """(name, plan): every sample at least once, the image-and-clip sample spread over a group."""
    lengths = _lengths(family)
    if world == 1:
        return [("local", _plan(1, lengths, [Wave([Group(ranks=(0,), local={0: [0, 1, 2, 3]})])]))]
    out = []
    ranks = tuple(range(world))
    for mode in MODES:
        dist_docs = [0, 1] if world > 2 else [0]
        blocks = None
        if mode == ShardMode.BLOCKS:
            lens = [lengths[s] for s in dist_docs]
            blocks = random_layout(lens, world, HEADS, doc_slices(lens), seed=5, split_heads=True)
        first = Group(ranks=ranks, distributed=dist_docs, mode=mode, local={world - 1: [2]}, blocks=blocks)
        rest = [s for s in (1, 3) if s not in dist_docs]
        second = [Group(ranks=(r,), local={r: [s]}) for r, s in enumerate(rest)]
        out.append((mode.value, _plan(world, lengths, [Wave([first]), Wave(second)])))
    return out


def _global_valid(family: str) -> int:
    return sum(n - 1 for n in _lengths(family).values())


def reference(family: str):
    model = build_vlm("sdpa", family=family)
    rows = ROWS[family]
    total = sum(reference_sample_loss(model, rows[s], _global_valid(family)) for s in sorted(rows))
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _train(rank, world, family, named_plans, break_rank):
    """Each plan through PlanCollator (vision columns) and StepExecutor (vision tower); per plan,
    this rank's view of the loss, the worst relative gradient error and its encoder work."""
    cluster = ClusterSpec(world, CAP)
    groups = CPGroups(cluster)
    ref_loss, ref_grads = reference(family)
    rows_of = ROWS[family]
    valid = _global_valid(family)
    results = []
    for name, plan in named_plans:
        model = build_vlm("hf_cp", family=family)
        tower = vision_tower_of(model, "test")
        if rank == break_rank:  # the break: the first item this rank encodes loses its rows' gradient
            encode = tower.encode

            def encode_dropping_first(pixels, grid, encode=encode, merge=tower.merge):
                rows = encode(pixels, grid)
                k = int(grid[0].prod()) // merge**2
                # the graph stays whole (every rank still joins the exchange's backward)
                return torch.cat([rows[:k].detach() + rows[:k] * 0.0, rows[k:]])

            tower.encode = encode_dropping_first
        vision = vision_reader(lambda s: rows_of[s], tower.token_ids, tower.merge, tower.rope_positions)
        collator = PlanCollator(lambda s: (rows_of[s]["input_ids"], None), vision=vision)
        executor = StepExecutor(
            model,
            groups,
            world,
            rank,
            torch.device("cpu"),
            0,
            backward=lambda loss, last: loss.backward(),
            vision=tower,
        )
        step = collator.rank_step(plan, rank, valid)
        encoded = sum(int(mb.vision.encoded_patches) for mb in step.waves if mb is not None)
        COMM_COUNTER.reset()
        totals = executor.train(model, step)
        loss = torch.tensor(totals.loss_sum / valid, dtype=torch.float64)
        if world > 1:
            dist.all_reduce(loss)
        err, worst = 0.0, ""
        for pname, p in model.named_parameters():
            g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            if world > 1:
                dist.all_reduce(g)
            g /= world
            ref = ref_grads.get(pname, torch.zeros_like(p))
            e = (g - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
            if e > err:
                err, worst = e, pname
        visual = [ref_grads[n].abs().max().item() for n in ref_grads if ".visual." in f".{n}"]
        results.append(
            dict(
                family=family,
                plan=name,
                rank=rank,
                loss=loss.item(),
                ref_loss=ref_loss,
                grad_err=err,
                worst=worst,
                encoded=encoded,
                visual_grad=min(visual) if visual else 0.0,
                visual_params=len(visual),
                bytes=COMM_COUNTER.snapshot().bytes_sent,
            )
        )
    return results


def _check(results, family: str):
    assert results
    n_visual = sum(1 for n, _ in build_vlm("sdpa", family=family).named_parameters() if ".visual." in f".{n}")
    for r in results:
        # every tower parameter (DeepStack mergers included) has a reference gradient to compare
        assert r["visual_params"] == n_visual and r["visual_grad"] > 1e-6, r
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), r
        assert r["grad_err"] <= TOL, r
    # each item encoded exactly once across the world
    rows = ROWS[family].values()
    every_patch = sum(len(r.get("pixel_values", ())) + len(r.get("pixel_values_videos", ())) for r in rows)
    for name in {r["plan"] for r in results}:
        assert sum(r["encoded"] for r in results if r["plan"] == name) == every_patch, name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", CASES)
def test_vision_training_on_one_rank_equals_the_models_own_forward(pools, family):  # noqa: F811
    _check(pools(1).run(_train, family, plans(1, family), -1, timeout_s=240), family)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", CASES)
def test_vision_training_over_two_ranks_in_every_shard_mode_is_exact(pools, family):  # noqa: F811
    results = pools(2).run(_train, family, plans(2, family), -1, timeout_s=240)
    assert {r["plan"] for r in results} == {m.value for m in MODES}
    _check(results, family)
    assert all(r["bytes"] > 0 for r in results)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("family", FAMILIES)
def test_vision_training_over_four_ranks_in_every_shard_mode_is_exact(pools, family):  # noqa: F811
    _check(pools(4).run(_train, family, plans(4, family), -1, timeout_s=360), family)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", FAST)
def test_the_check_fails_when_an_images_embedding_gradient_is_dropped(pools, family):  # noqa: F811
    results = pools(2).run(_train, family, plans(2, family)[:1], 0, timeout_s=240)
    assert results and all(r["grad_err"] > 1e-2 for r in results), results
