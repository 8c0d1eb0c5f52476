"""Groups of three ranks train exactly like one process (issue 28: CP groups of any size).

Three gloo processes run planned steps through the training path itself: the process groups
come from the registry (CPGroups over ClusterSpec(3, any_size_groups=True): (0, 1), (1, 2)
and (0, 1, 2)), each rank's micro-batches from PlanCollator and its forward and backward from
StepExecutor, as CPTrainer runs them. One plan per shard mode puts two documents over all
three ranks (ring zigzag, ring per document, Ulysses on 6 query and 3 kv heads, blocks with
heads split across members) next to a local one, then a document over the unaligned pair
(1, 2) next to a local one on rank 0. The summed loss and the data-parallel average of the
gradients must equal a single-process model that runs every document alone.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

import hf_cp.attention.interface  # noqa: F401  (registers attn_implementation "hf_cp")
from hf_cp.attention import COMM_COUNTER
from hf_cp.cost.dims import ModelDims
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.cost.model import CostModel
from hf_cp.modes.segments import ShardMode
from hf_cp.plan.block_layout import doc_slices, random_layout
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import Group, StepPlan, Wave
from hf_cp.train.data.collator import PlanCollator
from hf_cp.train.step.executor import StepExecutor
from hf_cp.train.step.groups import CPGroups

from helpers.attention_pool import pools  # noqa: F401  (fixture)

WORLD = 3
CAP = 64  # tokens per rank and micro-batch
TOL = 1e-5
# heads divisible by 3 (Ulysses over three ranks); 3 kv heads: GQA, one per member
MODEL = dict(
    model_type="llama",
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=3,
    head_dim=8,
    vocab_size=128,
)
# sample id -> length: 0 and 1 over the three ranks, 2 local to rank 1; then 3 local to rank 0
# and 4 over the pair (1, 2)
LENGTHS = {0: 41, 1: 17, 2: 9, 3: 12, 4: 23}
MODES = [ShardMode.RING_ZIGZAG, ShardMode.RING_PER_DOC, ShardMode.ULYSSES, ShardMode.BLOCKS]


def build_model(attn: str):
    cfg = dict(MODEL)
    config = AutoConfig.for_model(
        cfg.pop("model_type"), **cfg, use_cache=False, attention_dropout=0.0, tie_word_embeddings=False
    )
    torch.manual_seed(1234)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).train()


def cost_model() -> CostModel:
    dims = ModelDims(
        num_layers=MODEL["num_hidden_layers"],
        hidden=MODEL["hidden_size"],
        num_heads=MODEL["num_attention_heads"],
        num_kv_heads=MODEL["num_key_value_heads"],
        head_dim=MODEL["head_dim"],
        intermediate=MODEL["intermediate_size"],
    )
    return CostModel(dims, HardwareProfile.load("h200-qwen2.5-7b"))


def tokens(sid: int) -> list:
    gen = torch.Generator().manual_seed(100 + sid)
    return torch.randint(0, MODEL["vocab_size"], (LENGTHS[sid],), generator=gen).tolist()


def plan_for(mode: ShardMode) -> StepPlan:
    trio = [0, 1]
    blocks = None
    if mode == ShardMode.BLOCKS:
        lens = [LENGTHS[s] for s in trio]
        blocks = random_layout(lens, WORLD, MODEL["num_attention_heads"], doc_slices(lens), seed=3, split_heads=True)
    return StepPlan(
        world_size=WORLD,
        max_tokens_per_rank=CAP,
        sample_ids=sorted(LENGTHS),
        lengths=[LENGTHS[s] for s in sorted(LENGTHS)],
        balancer=f"test:{mode.value}",
        waves=[
            Wave([Group(ranks=(0, 1, 2), distributed=trio, mode=mode, local={1: [2]}, blocks=blocks)]),
            Wave(
                [
                    Group(ranks=(0,), local={0: [3]}),
                    Group(ranks=(1, 2), distributed=[4], mode=ShardMode.RING_ZIGZAG),
                ]
            ),
        ],
    )


def reference(global_valid: int):
    """Summed loss and gradients of one process running every document alone (sdpa)."""
    model = build_model("sdpa")
    total = 0.0
    for sid in sorted(LENGTHS):
        ids = torch.tensor(tokens(sid))
        logits = model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None]).logits[0]
        loss = torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum") / global_valid
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def _train_on_three_ranks(rank, world, plans, loss_scale):
    """Every plan through CPGroups, PlanCollator and StepExecutor; per plan, this rank's view
    of the summed loss and the worst gradient difference against the reference."""
    cluster = ClusterSpec(world, CAP, any_size_groups=True)
    groups = CPGroups(cluster)
    global_valid = sum(n - 1 for n in LENGTHS.values())
    ref_loss, ref_grads = reference(global_valid)
    collator = PlanCollator(lambda sid: (tokens(sid), None))
    results = []
    for plan in plans:
        plan.validate(cluster, cost_model())
        model = build_model("hf_cp")
        executor = StepExecutor(
            model,
            groups,
            world,
            rank,
            torch.device("cpu"),
            loss_chunk_tokens=0,
            backward=lambda loss, last: (loss * loss_scale).backward(),
        )
        COMM_COUNTER.reset()
        totals = executor.train(model, collator.rank_step(plan, rank, global_valid))
        bytes_sent = COMM_COUNTER.snapshot().bytes_sent
        loss = torch.tensor(totals.loss_sum * loss_scale / global_valid, dtype=torch.float64)
        dist.all_reduce(loss)
        grad_err, worst = 0.0, ""
        for name, p in model.named_parameters():
            g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            g /= world  # the data-parallel average (each rank's loss is scaled by world / global_valid)
            err = (g - ref_grads[name]).abs().max().item()
            if err > grad_err:
                grad_err, worst = err, name
        results.append(
            dict(
                plan=plan.balancer,
                rank=rank,
                loss=loss.item(),
                ref_loss=ref_loss,
                grad_err=grad_err,
                worst_param=worst,
                grad_scale=max(v.abs().max().item() for v in ref_grads.values()),
                registry=[ranks for ranks in cluster.all_groups() if groups.get(ranks) is not None],
                groups_built=len(groups),
                tokens=totals.tokens,
                bytes_sent=bytes_sent,
            )
        )
    return results


def test_the_registry_of_a_world_of_three_holds_every_contiguous_group():
    cluster = ClusterSpec(WORLD, CAP, any_size_groups=True)
    assert cluster.all_groups() == [(0, 1), (1, 2), (0, 1, 2)]
    for mode in MODES:
        plan = plan_for(mode).validate(cluster, cost_model())
        assert {g.ranks for w in plan.waves for g in w.groups if g.distributed} == {(0, 1, 2), (1, 2)}


@pytest.mark.timeout(300)
def test_groups_of_three_ranks_train_exactly_like_one_process(pools):  # noqa: F811
    rows = pools(WORLD).run(_train_on_three_ranks, [plan_for(m) for m in MODES], 1.0, timeout_s=240)
    assert {r["plan"] for r in rows} == {f"test:{m.value}" for m in MODES}
    assert len(rows) == WORLD * len(MODES)
    for r in rows:
        assert r["registry"] == [(0, 1), (1, 2), (0, 1, 2)] and r["groups_built"] == 3, r
        assert r["tokens"] > 0 and r["bytes_sent"] > 0, r  # every rank ran rows of its own and exchanged
        assert r["grad_scale"] > 1e-3, "reference gradients vanish: the comparison would prove nothing"
        assert abs(r["loss"] - r["ref_loss"]) <= TOL, r
        assert r["grad_err"] <= TOL, r


@pytest.mark.timeout(300)
def test_the_check_fails_on_a_loss_scaled_by_one_part_in_a_thousand(pools):  # noqa: F811
    rows = pools(WORLD).run(_train_on_three_ranks, [plan_for(ShardMode.RING_ZIGZAG)], 1.001, timeout_s=240)
    # both checks of the exactness test reject it: the loss by ~5e-3, the gradients by ~6e-5
    assert rows and all(abs(r["loss"] - r["ref_loss"]) > TOL and r["grad_err"] > TOL for r in rows)
