"""Shared property checks for balancers: random length distributions and the plan invariants."""

from collections import Counter

from hypothesis import strategies as st

from hf_cp.balance import PlanRequest, get_balancer, max_member_tokens
from hf_cp.cost.model import CostModel
from hf_cp.modes.registry import mode_spec, rank_segments
from hf_cp.modes.segments import segment_tokens
from hf_cp.plan.block_layout import received_token_equivalent
from hf_cp.plan.cluster import ClusterSpec

from helpers import load_file_module


@st.composite
def step_cases(draw, max_world=64):
    """(world, cap, lengths): long tails, all short, one huge sample, or a mix."""
    world = draw(st.sampled_from([w for w in (1, 2, 4, 8, 16, 32, 64) if w <= max_world]))
    cap = draw(st.sampled_from([64, 257, 1024, 4096]))
    largest = world * cap
    kind = draw(st.sampled_from(["long_tail", "all_short", "one_huge", "mixed"]))
    n = draw(st.integers(1, 120))
    if kind == "all_short":
        lengths = draw(st.lists(st.integers(1, max(1, cap // 8)), min_size=n, max_size=n))
    elif kind == "one_huge":
        lengths = draw(st.lists(st.integers(1, max(1, cap // 4)), min_size=n - 1, max_size=n - 1))
        lengths.insert(draw(st.integers(0, n - 1)), draw(st.integers(max(1, largest // 2), largest)))
    elif kind == "long_tail":
        # geometric-ish tail: most short, a few up to the largest group's capacity
        exps = draw(st.lists(st.floats(0, 1), min_size=n, max_size=n))
        lengths = [max(1, int(largest ** (e**3))) for e in exps]
    else:
        lengths = draw(st.lists(st.integers(1, largest), min_size=n, max_size=n))
    return world, cap, lengths


def member_tokens_of(group, lens, rank, cost=None):
    """Tokens `rank` holds in the group's micro-batch; a blocks-mode member also holds what it
    receives (block_cost.received_token_equivalent, as StepPlan.validate counts it)."""
    t = sum(lens[s] for s in group.local.get(rank, []))
    if group.distributed:
        m = group.ranks.index(rank)
        if mode_spec(group.mode).carries_layout:
            t += group.blocks.member_tokens(m)
            if cost is not None:
                t += received_token_equivalent(group.blocks, m, cost)
        else:
            t += segment_tokens(rank_segments(group.mode, [lens[s] for s in group.distributed], group.size, m))
    return t


def check_balancer_properties(name, world, cap, lengths, cost, **options):
    """Plan, then check every invariant independently of StepPlan.validate as well."""
    cluster = ClusterSpec(world_size=world, max_tokens_per_rank=cap)
    ids = [1000 + 7 * i for i in range(len(lengths))]  # ids unlike positions, to catch mix-ups
    req = PlanRequest(ids, lengths, cluster, cost)
    plan = get_balancer(name, **options).plan(req)
    plan.validate(cluster, cost)
    lens = dict(zip(ids, lengths))
    scheduled = Counter(s for w in plan.waves for g in w.groups for s in g.sample_ids())
    assert sorted(scheduled) == sorted(ids), "a sample is lost"
    assert max(scheduled.values()) == 1, "a sample is duplicated"
    for w in plan.waves:
        for g in w.groups:
            dist = [lens[s] for s in g.distributed]
            if dist and not g.local and not mode_spec(g.mode).carries_layout:
                assert max_member_tokens(g.mode, dist, g.size) <= cap
            for r in g.ranks:
                assert member_tokens_of(g, lens, r, cost) <= cap
    # pure function: a fresh balancer and a fresh cost model (empty caches) give the same bytes
    fresh_cost = CostModel(cost.dims, cost.profile)
    again = get_balancer(name, **options).plan(PlanRequest(ids, lengths, cluster, fresh_cost))
    assert again.to_json() == plan.to_json()
    return plan


def check_auto_skips_behind_magi(member, bound_holds, traces_dir, kind, world, cost):
    """On the shipped shared-prompt step `kind` at `world` ranks, `member`'s lower bound holds
    (bound_holds(request, cost) asserts it against the member's plan and returns it) and is no
    better than magi's plan, and auto skips the member for it."""
    grouped_step = load_file_module("bench_auto_promise", "scripts/bench_auto_promise.py").grouped_step
    req = grouped_step(traces_dir, kind, world, cost)
    bound = bound_holds(req, cost)
    auto = get_balancer("auto")
    auto.plan(req)
    assert member in auto.last_skipped and bound >= auto.last_makespans["magi"], auto.last_skipped
