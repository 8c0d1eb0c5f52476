"""Planner scale (issue 28): the batched LPT, the per-size block maxima of place_distributed
and the bulk checks of StepPlan.validate are exact rewrites of what they replaced; plans of
the shared traces are byte-identical to those made before the rewrite."""

import hashlib
import heapq
import importlib.util
import sys

import numpy as np
import pytest

from hf_cp.balance import PlanRequest, get_balancer
from hf_cp.balance.toolkit.assign import least_loaded_first
from hf_cp.balance.toolkit.costs import cost_memo
from hf_cp.balance.toolkit.cp_candidates import local_micro_batches, per_rank_ms, place_distributed
from hf_cp.balance.toolkit.packing import split_to_cap
from hf_cp.cost.model import CostModel
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import Group, PlanError, StepPlan, Wave
from hf_cp.samples.lengths import read_lengths

from helpers import REPO

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron", "ignore::DeprecationWarning")


def heap_lpt(items, load):
    """The heap least_loaded_first replaced: each item onto the least (load, index) bin."""
    heap = [(l, b) for b, l in enumerate(load.tolist())]
    heapq.heapify(heap)
    out = []
    for x in items.tolist():
        l, b = heap[0]
        out.append(b)
        heapq.heapreplace(heap, (l + x, b))
    final = load.copy()
    for l, b in heap:
        final[b] = l
    return np.asarray(out, dtype=np.int64), final


def test_batched_lpt_makes_the_heaps_choices_ties_and_uneven_loads_included():
    rng = np.random.default_rng(7)
    for trial in range(600):
        bins, n = int(rng.integers(1, 80)), int(rng.integers(0, 500))
        if trial % 3 == 0:  # integer weights and loads: many exact ties
            items = np.sort(rng.integers(1, 5, n).astype(float))[::-1].copy()
            load = rng.integers(0, 4, bins).astype(float)
        elif trial % 3 == 1:  # a few bins far below the rest: rounds of one item, the heap takes over
            items = np.sort(rng.random(n))[::-1].copy()
            load = np.where(rng.random(bins) < 0.3, 0.0, 40.0)
        else:
            items = rng.lognormal(0, 1, n)
            load = rng.random(bins)
        mine = load.copy()
        got = least_loaded_first(items, mine)
        want, final = heap_lpt(items, load)
        assert np.array_equal(got, want) and np.array_equal(mine, final)


def naive_place(memo, lengths, sizes, world, loads):
    """place_distributed as it was: every block's maximum recomputed for every sample."""
    dist = np.nonzero(sizes > 1)[0]
    times = np.array([per_rank_ms(memo, int(lengths[i]), int(sizes[i])) for i in dist.tolist()])
    placed = {}
    for k in np.argsort(-times, kind="stable").tolist():
        i, g = int(dist[k]), int(sizes[dist[k]])
        b = int(np.argmin(loads.reshape(world // g, g).max(axis=1)))
        loads[b * g : (b + 1) * g] += times[k]
        placed.setdefault((g, b), []).append(i)
    return placed


def test_place_distributed_keeps_the_blocks_it_chose_by_recomputed_maxima():
    memo = cost_memo(CostModel.load("qwen2.5-7b", "h200-qwen2.5-7b"))
    rng = np.random.default_rng(3)
    for world in (8, 64, 256):
        for _ in range(5):
            n = 300
            lengths = rng.integers(500, 60000, n)
            sizes = np.where(rng.random(n) < 0.5, 1, 2 ** rng.integers(1, int(np.log2(world)) + 1, n))
            start = np.round(rng.random(world) * 50, 1)  # equal loads in places: ties go to the lowest block
            a, b = start.copy(), start.copy()
            assert place_distributed(memo, lengths, sizes, world, a) == naive_place(memo, lengths, sizes, world, b)
            assert np.array_equal(a, b)


def test_local_micro_batches_are_under_the_cap_and_overflowing_ranks_pack_first_fit_decreasing():
    rng = np.random.default_rng(5)
    ranks = rng.integers(0, 16, 2000)
    lengths = rng.integers(1, 4000, 2000)
    ids = np.arange(2000) * 3 + 11
    out = local_micro_batches(ranks, lengths, 8192, ids)
    assert [r for r, _ in out] == sorted(r for r, _ in out)
    by_id = dict(zip(ids.tolist(), lengths.tolist()))
    assert sorted(s for _, mb in out for s in mb) == sorted(ids.tolist())
    assert all(sum(by_id[s] for s in mb) <= 8192 for _, mb in out)
    for r in range(16):  # a rank whose snake overflows is packed exactly as split_to_cap packs it
        mine = [mb for q, mb in out if q == r]
        idx = np.flatnonzero(ranks == r)
        ffd = split_to_cap(ids[idx].tolist(), lengths[idx].tolist(), 8192)
        if len(mine) != -(-int(lengths[idx].sum()) // 8192):
            assert mine == ffd


def local_plan(groups_per_wave, ids, lens, cap=100, world=4):
    plan = StepPlan(world_size=world, max_tokens_per_rank=cap, sample_ids=list(ids), lengths=list(lens))
    plan.waves = [Wave([Group(ranks=(r,), local={r: v}) for r, v in w]) for w in groups_per_wave]
    return plan


@pytest.mark.parametrize(
    "waves, message",
    [
        ([[(0, [1, 2]), (1, [3])], [(0, [4])]], None),
        ([[(0, [1, 2]), (1, [3])], [(0, [4, 2])]], "sample 2 is scheduled twice (waves 0 and 1)"),
        ([[(0, [1, 2]), (1, [3])], [(0, [4, 9])]], "wave 1: sample 9 is not in the step's global batch"),
        ([[(0, [1, 2]), (1, [3])]], "samples [4] (1 in all) are never scheduled"),
        ([[(0, [1, 2, 3]), (1, [4])]], "wave 0: rank 0 holds 120 tokens, over the cap of 100"),
        ([[(0, [1, 2]), (1, [3, 3])], [(0, [4])]], "sample 3 is scheduled twice (waves 0 and 0)"),
    ],
)
def test_validate_names_the_first_broken_invariant_as_before(waves, message):
    plan = local_plan(waves, [1, 2, 3, 4], [40, 50, 30, 20])
    if message is None:
        assert plan.validate() is plan
    else:
        with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            plan.validate()


def test_validate_still_refuses_a_batch_with_an_id_twice_or_a_length_below_one():
    with pytest.raises(PlanError, match="sample 2 appears twice in the global batch"):
        local_plan([[(0, [1, 2])]], [1, 2, 2], [10, 10, 10]).validate()
    with pytest.raises(PlanError, match="sample 2 has length 0"):
        local_plan([[(0, [1, 2])]], [1, 2], [10, 0]).validate()


# sha256 of plan.to_json() made before the rewrite (world 64, full step 0, H200 profile, 32K cap,
# 64K tokens per rank per step): the planner's output must not change with its speed
PINNED = {
    ("chat_lmsys_chat1m_191conv", "auto"): "fcd68775464490e4e8f23ed80aacf306ef6eeca064f3aea3edd321fc9d794a4e",
    ("longdoc_leval_multiturn", "auto"): "3dbe820868e11868eb2951116bc76bef889792676490ae4479cef6161e566036",
    ("code_numpy_files", "auto"): "2c1dc2504de88782533e6267f962618364558569f938c5014eb4e247a784e5fd",
}


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_balancers", REPO / "scripts" / "bench_balancers.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_balancers"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("trace, balancer", sorted(PINNED))
def test_plans_are_byte_identical_to_those_before_the_rewrite(bench, traces_dir, trace, balancer):
    cost = CostModel.load("qwen2.5-7b", "h200-qwen2.5-7b")
    cluster = ClusterSpec(64, 32768, cost.profile.gpus_per_node)
    lengths = [n for n in read_lengths(traces_dir / f"{trace}.txt") if n <= cluster.largest_capacity]
    ids = bench.full_step_ids(lengths, 65536 * 64, 0, [0])[0]
    req = PlanRequest(ids, [lengths[i % len(lengths)] for i in ids], cluster, cost, dataset_max_length=max(lengths))
    plan = get_balancer(balancer).plan(req).validate(cluster, cost)
    assert hashlib.sha256(plan.to_json().encode()).hexdigest() == PINNED[(trace, balancer)]
