"""The ranks' agreement on plans, data and payloads, and the CP groups' names, on real gloo
processes: the session's pools of 2 and 4 (helpers/attention_pool.py), every rank's error
reported back (GlooPool.outcomes)."""

import time

from helpers.attention_pool import pools  # noqa: F401  (pools: fixture)


def _agree(rank, world, divergent_rank):
    from hf_cp.balance import PlanRequest, get_balancer
    from hf_cp.cost.model import CostModel
    from hf_cp.plan.cluster import ClusterSpec
    from hf_cp.train.step.agreement import assert_plans_agree

    cost = CostModel.load("qwen2.5-7b", "h200-qwen2.5-7b")
    lengths = [100, 2000, 40000, 7, 300]
    if rank == divergent_rank:
        lengths[2] += 1  # e.g. a rank that read a different dataset
    cl = ClusterSpec(world_size=world, max_tokens_per_rank=32768)
    plan = get_balancer("static").plan(PlanRequest(range(5), lengths, cl, cost))
    t0 = time.monotonic()
    assert_plans_agree(plan.digest(), step=7)
    return time.monotonic() - t0


def test_identical_plans_pass(pools):
    res = pools(2).outcomes(_agree, -1, timeout_s=90)
    assert all(status == "ok" for status, _ in res.values()), res


def test_divergent_plan_on_one_rank_fails_fast_with_agreement_error(pools):
    res = pools(4).outcomes(_agree, 2, timeout_s=90)
    for rank, (status, text) in res.items():
        assert status == "error", f"rank {rank} did not notice the disagreement"
        assert "PlanDisagreementError: step 7: ranks disagree" in text
        assert "ranks [2] hold plan" in text and "ranks [0, 1, 3] hold plan" in text


def _data(rank, world, odd_rank):
    from hf_cp.train.step.agreement import assert_data_agrees

    assert_data_agrees("ab" * 32 if rank != odd_rank else "cd" * 32, "training data")


def test_ranks_with_other_data_fail_at_start_naming_them(pools):
    assert all(status == "ok" for status, _ in pools(2).outcomes(_data, -1, timeout_s=90).values())
    res = pools(4).outcomes(_data, 3, timeout_s=90)
    for rank, (status, text) in res.items():
        assert status == "error", f"rank {rank} did not notice"
        assert "DataDisagreementError: ranks loaded different training data" in text
        assert "ranks [0, 1, 2] hold" in text and "ranks [3] hold" in text


def _groups(rank, world):
    from hf_cp.plan.cluster import ClusterSpec
    from hf_cp.train.step.groups import CPGroups

    groups = CPGroups(ClusterSpec(world_size=world, max_tokens_per_rank=1024))
    pair = (0, 1) if rank < 2 else (2, 3)  # a rank holds handles of its own groups only
    return {
        "control": groups.control.group_desc,
        "pair": groups.get(pair).group_desc,
        "all": groups.get((0, 1, 2, 3)).group_desc,
        "count": len(groups),
    }


def test_cp_groups_carry_names_that_nccl_timeouts_print(pools):
    res = pools(4).outcomes(_groups, timeout_s=90)
    for rank, (status, got) in res.items():
        assert status == "ok", got
        pair = "[0, 1]" if rank < 2 else "[2, 3]"
        assert got == {
            "control": "hf_cp control: plan agreement and metrics",
            "pair": f"hf_cp CP group {pair}",
            "all": "hf_cp CP group [0, 1, 2, 3]",
            "count": 3,
        }, (rank, got)


def _payload(rank, world):
    from hf_cp.train.step.agreement import agree_on_step

    # every rank offers its own numbers (a fit whose last bits differ); all adopt rank 0's
    flagged, adopted = agree_on_step("ab" * 8, 3, flag=rank == 1, payload=[1.0 + rank * 1e-12, 2.5e-7, -3.0])
    return flagged, adopted


def test_the_agreement_carries_rank_zeros_payload_to_every_rank(pools):
    res = pools(2).outcomes(_payload, timeout_s=90)
    for rank, (status, got) in res.items():
        assert status == "ok", got
        assert got == ([1], [1.0, 2.5e-7, -3.0]), (rank, got)


def _adopt(rank, world, adopt):
    from hf_cp.balance import PlanRequest, get_balancer
    from hf_cp.cost.model import CostModel
    from hf_cp.plan.cluster import ClusterSpec
    from hf_cp.train.step.agreement import agree_on_plan

    cost = CostModel.load("qwen2.5-7b", "h200-qwen2.5-7b")
    cl = ClusterSpec(world_size=world, max_tokens_per_rank=32768)
    lengths = [100, 2000, 40000, 7, 300]
    # rank 1 plans the same step with another balancer: what a solver's time limit can do
    name = "wlb" if rank == 1 else "static"
    plan = get_balancer(name).plan(PlanRequest(range(5), lengths, cl, cost, step=3))
    theirs, _ = agree_on_plan(plan.to_json(), plan.digest(), step=4, adopt_first=adopt)
    return theirs


def test_timing_dependent_plans_adopt_the_first_ranks_plan_and_others_still_fail(pools):
    from hf_cp.plan.step_plan import StepPlan

    res = pools(2).outcomes(_adopt, True, timeout_s=90)
    assert all(status == "ok" for status, _ in res.values()), res
    assert res[0][1] is None  # rank 0 keeps its own plan
    assert StepPlan.from_json(res[1][1]).balancer == "static"  # rank 1 runs rank 0's
    res = pools(2).outcomes(_adopt, False, timeout_s=90)
    for status, text in res.values():
        assert status == "error" and "PlanDisagreementError: step 4: ranks disagree" in text
