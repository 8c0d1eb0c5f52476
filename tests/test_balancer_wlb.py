import numpy as np
from hypothesis import HealthCheck, given, settings

from hf_cp.balance import PlanRequest, get_balancer
from hf_cp.balance.balancers.wlb import workload_greedy
from hf_cp.cost.simulate import simulate
from hf_cp.plan.cluster import ClusterSpec

from helpers.balancer_checks import check_balancer_properties, step_cases


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=step_cases())
def test_wlb_plans_are_valid_complete_capped_and_deterministic(case, h200_cost):
    world, cap, lengths = case
    check_balancer_properties("wlb", world, cap, lengths, h200_cost)


def test_wlb_balances_a_skewed_batch_better_than_static(h200_cost):
    # data order puts the long documents together: static's fixed-length packs are very
    # unequal in attention work, WLB's workload-aware packing is not
    lengths = [16000] * 8 + [500] * 256
    cl = ClusterSpec(world_size=8, max_tokens_per_rank=32768)
    req = PlanRequest(list(range(len(lengths))), lengths, cl, h200_cost)
    wlb = simulate(get_balancer("wlb").plan(req), h200_cost)
    static = simulate(get_balancer("static").plan(req), h200_cost)
    assert wlb.imbalance < 1.05
    assert wlb.imbalance < static.imbalance - 0.1
    assert wlb.makespan_ms < static.makespan_ms


def test_outliers_never_share_a_micro_batch(h200_cost):
    # window = 2 ranks x 1000 tokens; documents >= 1000 are outliers; 5 of them on one replica
    lengths = [1200, 10, 1500, 20, 1100, 30, 1000, 40, 1900, 50]
    cl = ClusterSpec(world_size=2, max_tokens_per_rank=1000)
    plan = get_balancer("wlb", cp_size=2).plan(PlanRequest(list(range(len(lengths))), lengths, cl, h200_cost))
    plan.validate(cl)
    outliers = {i for i, n in enumerate(lengths) if n >= 1000}
    per_group = [len(outliers & set(g.sample_ids())) for w in plan.waves for g in w.groups]
    assert max(per_group) == 1 and sum(per_group) == len(outliers)


def test_workload_greedy_prefers_least_work_then_fewest_tokens():
    # 3 replicas x 1 round of 100 tokens. Longest first: 90 -> replica 0, 60 -> 1, 50 -> 2
    # (all empty, lowest index first); 45: least work is replica 0 (1.0) but it has no room;
    # next by work is replica 2 (3.0): it has room
    lengths = np.array([90, 60, 50, 45])
    work = np.array([1.0, 5.0, 3.0, 0.1])
    assert workload_greedy(lengths, work, 3, 1, 100).tolist() == [0, 1, 2, 2]
    # with only 2 micro-batches the 50 fits nowhere (90 + 50, 60 + 50 > 100)
    assert workload_greedy(lengths, work, 2, 1, 100) is None
    # 1 replica x 2 rounds: the replica's micro-batch with the fewest tokens takes each
    assert workload_greedy(np.array([60, 50, 40]), np.ones(3), 1, 2, 100).tolist() == [0, 1, 1]


def test_wlb_gives_a_heavy_micro_batch_fewer_companions(h200_cost):
    # one long document dominates: the replica running it gets less of the rest
    lengths = [15000] + [1000] * 120
    cl = ClusterSpec(world_size=4, max_tokens_per_rank=32768)
    req = PlanRequest(list(range(len(lengths))), lengths, cl, h200_cost)
    plan = get_balancer("wlb", cp_size=1).plan(req)
    per_rank = {r: [s for w in plan.waves for g in w.groups for s in g.local.get(r, [])] for r in range(4)}
    heavy = next(r for r, ss in per_rank.items() if 0 in ss)
    assert all(len(per_rank[heavy]) < len(ss) - 10 for r, ss in per_rank.items() if r != heavy)
    assert simulate(plan, h200_cost).imbalance < 1.05


def test_wlb_rejects_bad_options():
    import pytest

    with pytest.raises(ValueError, match="cp_size 3"):
        get_balancer("wlb", cp_size=3)
    with pytest.raises(ValueError, match="outlier_fraction"):
        get_balancer("wlb", outlier_fraction=0)


def test_a_small_step_at_a_large_world_is_not_shredded_over_one_huge_group(h200_cost, traces_dir):
    """WLB-LLM's 'balanced' CP size used to double while the longest sample outlasted the
    mean rank's share, which on a small step at 512 ranks is tiny: every short document went
    over one 512-rank group, balanced (max/mean 1.000) and 19-65x the bound. The size now
    stops where doubling no longer lowers the bound on plans of that size."""
    from hf_cp.cost.bounds import charged_lower_bound_ms
    from hf_cp.samples.lengths import read_lengths

    lengths = read_lengths(traces_dir / "chat_lmsys_chat1m_191conv.txt")  # 191 samples, one partial step
    cl = ClusterSpec(512, 32768, gpus_per_node=8)
    req = PlanRequest(range(len(lengths)), lengths, cl, h200_cost, dataset_max_length=max(lengths))
    plan = get_balancer("wlb").plan(req)
    sim = simulate(plan, h200_cost, cl)
    sizes = {g.size for w in plan.waves for g in w.groups}
    assert max(sizes) <= 32
    assert sim.makespan_ms <= 1.2 * charged_lower_bound_ms(lengths, cl, h200_cost)
    assert not sim.flags
    # the rule it replaced, for the record: the whole world in one group, flagged though balanced
    whole = simulate(get_balancer("wlb", cp_size=512).plan(req), h200_cost, cl)
    assert whole.imbalance < 1.01 and whole.far_above_bound and "far above the bound" in whole.flags[0]
    assert whole.makespan_ms > 5 * sim.makespan_ms
