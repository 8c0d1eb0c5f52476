"""Properties every registered balancer must have, over random length distributions."""

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_cp.balance import PlanRequest, SampleTooLongError, available_balancers, get_balancer
from hf_cp.plan.cluster import ClusterSpec

# megatron-core warns on import that Transformer Engine / Apex are missing (CPU): expected here
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron", "ignore::DeprecationWarning")

BALANCERS = [n for n in available_balancers() if not n.startswith("test_")]


@st.composite
def scenarios(draw):
    world = draw(st.sampled_from([1, 2, 4, 8, 16]))
    cap = draw(st.sampled_from([2048, 8192, 32768]))
    n = draw(st.integers(1, 120))
    shape = draw(st.sampled_from(["short", "long_tail", "uniform", "equal"]))
    top = world * cap
    if shape == "short":
        lengths = draw(st.lists(st.integers(1, min(600, top)), min_size=n, max_size=n))
    elif shape == "uniform":
        lengths = draw(st.lists(st.integers(1, top), min_size=n, max_size=n))
    elif shape == "equal":
        lengths = [draw(st.integers(1, top))] * n
    else:
        short = draw(st.lists(st.integers(1, min(3000, top)), min_size=n, max_size=n))
        longs = draw(st.lists(st.integers(cap // 2 + 1, top), min_size=0, max_size=4))
        lengths = short + longs
    first = draw(st.integers(0, 10_000))
    ids = [first + 3 * i for i in range(len(lengths))]  # ids are not positions
    return ClusterSpec(world, cap), ids, lengths


def scheduled(plan):
    out = Counter()
    for w in plan.waves:
        for g in w.groups:
            out.update(g.distributed)
            for ids in g.local.values():
                out.update(ids)
            for cs in g.chunked.values():  # ChunkFlow's dependent chunks
                out.update(c.sample for c in cs)
    return out


@pytest.mark.parametrize("name", BALANCERS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=scenarios())
def test_every_sample_once_caps_honoured_identical_plans(name, case, h200_cost):
    cluster, ids, lengths = case
    req = PlanRequest(ids, lengths, cluster, h200_cost, dataset_max_length=max(lengths))
    plan = get_balancer(name).plan(req)
    plan.validate(cluster)
    assert scheduled(plan) == Counter(ids), "a sample was lost or duplicated"
    lens = dict(zip(ids, lengths))
    for w in plan.waves:
        for g in w.groups:
            for r in g.ranks:
                assert plan.rank_tokens(g, r, lens) <= cluster.max_tokens_per_rank
    again = get_balancer(name).plan(
        PlanRequest(list(ids), list(lengths), cluster, h200_cost, dataset_max_length=max(lengths))
    )
    assert again.to_json() == plan.to_json()


@pytest.mark.parametrize("name", BALANCERS)
def test_a_sample_too_long_for_the_largest_group_is_named(name, h200_cost):
    cluster = ClusterSpec(4, 1000)
    with pytest.raises(SampleTooLongError, match="sample 17 has 4001 tokens"):
        get_balancer(name).plan(PlanRequest([5, 17], [10, 4001], cluster, h200_cost))
