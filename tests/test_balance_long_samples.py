"""Samples longer than the whole world holds (world x cap): ChunkFlow trains them as dependent
chunks on one rank (issue 17); the other balancers refuse them by name (balance/sample_limit.py).

The toy cost model (helpers.toy_cost) at 1000 B of activations per token: a token's K/V
state store takes 96 B, so a 64-token rank holds the store of 666 tokens, and with one kept
chunk of at least 16 tokens the store of 500."""

import warnings

import pytest

from hf_cp.balance import PlanRequest, SampleTooLongError, get_balancer
from hf_cp.balance.toolkit.sample_limit import check_sample_lengths, chunk_fits, sample_token_limit
from hf_cp.plan.chunks import chunked_sample_cost, dependent_chunk_sizes
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.planning.predict import plan_and_predict
from hf_cp.planning.sampler import GlobalBatchSampler
from hf_cp.planning.worker import Planner

from helpers.toy_cost import toy_cost

CLUSTER = ClusterSpec(2, 64)  # the whole world holds 128 tokens
LENGTHS = [400, 20, 30, 10, 50, 7]  # sample 0: 3 x the world's tokens
CHUNKFLOW = dict(min_chunk_size=16)


@pytest.fixture(scope="module")
def cost():
    return toy_cost(activation_bytes_per_token=1000)


def chunkflow():
    return get_balancer("chunkflow", **CHUNKFLOW)


def request(cost, lengths=LENGTHS, limit=None, **kw):
    return PlanRequest(range(len(lengths)), lengths, CLUSTER, cost, max_sample_tokens=limit, **kw)


def test_the_limit_is_what_chunkflow_plans(cost):
    cf = chunkflow()
    limit = sample_token_limit(cf, CLUSTER, cost)
    # (64 - 16) tokens of activations hold the store of 500 tokens: 500 x 96 B = 48,000 B
    assert limit == 500
    assert chunk_fits(cost, 500, 1, 64, 64, 16) and not chunk_fits(cost, 501, 1, 64, 64, 16)
    for name in ("static", "dynamic_cp", "wlb", "flexsp"):
        assert sample_token_limit(get_balancer(name), CLUSTER, cost) == CLUSTER.largest_capacity == 128
    assert sample_token_limit(get_balancer("auto", member_options={"chunkflow": CHUNKFLOW}), CLUSTER, cost) == 500
    # chunkflow's default minimum chunk (256 tokens) is over the chunk size here: half of it, 32
    # tokens, leaves room for the store of at most (64 - 32) / 0.096 = 333 tokens; 322 is the
    # longest whose chunks (ceil(n / N) tokens for some count N) land in [32, the room left]
    assert sample_token_limit(get_balancer("chunkflow"), CLUSTER, cost) == 322
    # a few lengths just under a limit split into chunks that do not fit: refused by name too
    keep2 = get_balancer("chunkflow", keep=2, chunk_size=32, min_chunk_size=16)
    assert sample_token_limit(keep2, CLUSTER, cost) == 354
    check_sample_lengths(keep2, [0, 1], [354, 335], CLUSTER, cost)
    with pytest.raises(SampleTooLongError, match="sample 1 has 336 tokens; balancer 'chunkflow' trains samples of"):
        check_sample_lengths(keep2, [0, 1], [354, 336], CLUSTER, cost)
    with pytest.raises(SampleTooLongError, match=r"sample 1 \(336 tokens\) fits neither one rank"):
        keep2.plan(request(cost, [5, 336], 10**6))
    plan = cf.plan(request(cost, [500, 5], limit))
    assert plan.chunked_samples == [0]
    with pytest.raises(SampleTooLongError, match=r"sample 0 \(501 tokens\) fits neither one rank"):
        cf.plan(request(cost, [501, 5], 10**6))


def test_chunkflow_plans_a_sample_longer_than_the_world_on_one_rank(cost):
    with pytest.raises(SampleTooLongError, match="sample 0 has 400 tokens; the largest group"):
        request(cost)  # a request admits what the largest group holds unless told more
    limit = sample_token_limit(chunkflow(), CLUSTER, cost)
    planned = plan_and_predict(chunkflow(), request(cost, limit=limit))  # validated and simulated
    plan, sim = planned.plan, planned.predicted
    chunked = [(w, g) for w, wave in enumerate(plan.waves) for g in wave.groups if g.chunked]
    assert len(chunked) == 1
    _, group = chunked[0]
    ((rank, [c]),) = group.chunked.items()
    assert group.ranks == (rank,) and c.sample == 0 and c.keep == 1
    sizes = dependent_chunk_sizes(400, c.chunk_size)
    # the store of 400 tokens (38,400 B) leaves 25 tokens of activations: 16 chunks of 25
    assert c.chunk_size == 25 and sizes == [25] * 16
    alone = chunked_sample_cost(cost, sizes, 1).compute_ms
    assert sim.makespan_ms >= alone > 0
    assert sim.charged_bound_ms <= sim.makespan_ms
    others = {s for wave in plan.waves for g in wave.groups for ids in g.local.values() for s in ids}
    assert others == {1, 2, 3, 4, 5}
    assert all(rank not in g.local for wave in plan.waves for g in wave.groups if g.local), "its rank runs it alone"


@pytest.mark.parametrize("name", ["static", "dynamic_cp"])
def test_whole_document_balancers_refuse_it_by_name(cost, name):
    balancer = get_balancer(name)
    message = r"sample 0 has 400 tokens; the largest CP group \(2 ranks x 64 tokens per rank\) holds 128"
    with pytest.raises(SampleTooLongError, match=message):
        check_sample_lengths(balancer, range(len(LENGTHS)), LENGTHS, CLUSTER, cost, name)
    # handed a request built for chunkflow, planning refuses it before the balancer runs
    with pytest.raises(SampleTooLongError, match="step 0: " + message):
        plan_and_predict(balancer, request(cost, limit=500))
    # chunkflow's default settings train up to 333 tokens here (above): no hint; with a cheaper
    # store (10,000 B of activations per token), the hint
    cheap = toy_cost(activation_bytes_per_token=10_000)
    with pytest.raises(SampleTooLongError, match="or set cp_balancer: chunkflow .* samples up to 3333 tokens"):
        check_sample_lengths(balancer, range(len(LENGTHS)), LENGTHS, CLUSTER, cheap, name)


def test_auto_plans_the_long_step_with_chunkflow_and_the_others_with_any_member(cost):
    auto = get_balancer("auto", members=["static", "dynamic_cp", "chunkflow"], member_options={"chunkflow": CHUNKFLOW})
    limit = sample_token_limit(auto, CLUSTER, cost)
    assert limit == 500
    plan = plan_and_predict(auto, request(cost, limit=limit, dataset_max_length=400)).plan
    assert plan.balancer == "auto:chunkflow" and plan.chunked_samples == [0]
    assert auto.last_skipped["static"] == "it trains samples up to 128 tokens; sample 0 has 400"
    assert set(auto.last_skipped) == {"static", "dynamic_cp"}
    # a step of short samples: every member plans, static sized for the longest it trains
    # (the dataset's 400-token sample is chunkflow's); stop_within 0 plans them all
    auto = get_balancer("auto", members=["static", "chunkflow"], member_options={"chunkflow": CHUNKFLOW}, stop_within=0)
    short = LENGTHS[1:]
    plan_and_predict(auto, request(cost, short, limit, dataset_max_length=400))
    assert set(auto.last_makespans) == {"static", "chunkflow"}, auto.last_skipped
    # no member trains it: refused by name
    auto = get_balancer("auto", members=["static", "dynamic_cp"])
    with pytest.raises(
        SampleTooLongError, match=r"auto: none of its members \['static', 'dynamic_cp'\] trains sample 0"
    ):
        auto.plan(request(cost, limit=500))


def test_a_sample_whose_kv_store_alone_exceeds_the_rank_is_refused_by_name(cost):
    lengths = [5, 700, 20]  # 700 x 96 B = 67,200 B of K/V, over the rank's 64,000 B
    with pytest.raises(SampleTooLongError, match=r"chunkflow: sample 1 \(700 tokens\) fits neither one rank"):
        chunkflow().plan(request(cost, lengths, 10**6))
    message = (
        r"sample 1 has 700 tokens; balancer 'chunkflow' trains samples of at most 500 tokens, as dependent chunks "
        r"on one rank \(ChunkFlow\): its K/V state store alone \(65.62 KiB\) exceeds a rank's memory"
    )
    with pytest.raises(SampleTooLongError, match=message):
        check_sample_lengths(chunkflow(), range(3), lengths, CLUSTER, cost)


def test_the_planner_worker_trains_it_under_chunkflow_and_refuses_it_under_static(cost):
    lengths = [30, 400, 20, 50, 10, 45, 7]
    sampler = GlobalBatchSampler(lengths, 200, shuffle=False)  # steps [0], [1], [2..6]
    with pytest.warns(RuntimeWarning, match="comparison balancer 'static' trains samples up to 128 tokens"):
        planner = Planner(sampler, chunkflow(), CLUSTER, cost, lookahead=0, compare_balancer="static")
    assert planner.max_sample_tokens == 500
    steps = [planner.get(k) for k in range(len(sampler))]
    long_step = next(ps for ps in steps if 1 in ps.batch.sample_ids)
    assert long_step.plan.chunked_samples == [1] and long_step.compare is None  # static cannot plan it
    assert all(ps.compare is not None for ps in steps if ps is not long_step)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(SampleTooLongError, match="sample 1 has 400 tokens; the largest CP group"):
            Planner(sampler, "static", CLUSTER, cost, lookahead=0)
