import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_cp.modes.segments import ShardMode
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import Group, PlanError, StepPlan, Wave

from helpers.plan_gen import random_valid_plan

CL = ClusterSpec(world_size=8, max_tokens_per_rank=1000, gpus_per_node=4)


def base_plan():
    return StepPlan(
        world_size=8,
        max_tokens_per_rank=1000,
        sample_ids=[10, 11, 12, 13],
        lengths=[3000, 500, 200, 900],
        waves=[
            Wave(
                [
                    Group(ranks=(0, 1, 2, 3), distributed=[10], mode=ShardMode.RING_PER_DOC, local={1: [12]}),
                    Group(ranks=(4, 5), local={4: [11], 5: [13]}),
                ]
            )
        ],
    )


def test_valid_plan_passes_and_round_trips():
    p = base_plan().validate(CL)
    q = StepPlan.from_json(p.to_json())
    assert q.to_json() == p.to_json()
    assert q.digest() == p.digest()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda p: p.waves[0].groups[1].local[4].append(10), "sample 10 is scheduled twice"),
        (lambda p: p.waves[0].groups[1].local.pop(5), r"samples \[13\] .* never scheduled"),
        (lambda p: p.waves[0].groups.append(Group(ranks=(3,), local={3: []})), "rank 3 is in groups 0 and 2"),
        (lambda p: setattr(p.waves[0].groups[1], "ranks", (5, 6)), r"group \[5, 6\] is not a registered group"),
        (
            lambda p: p.waves[0].groups[1].local.__setitem__(4, [11, 13]) or p.waves[0].groups[1].local.pop(5),
            "rank 4 holds 1400 tokens, over the cap of 1000",
        ),
        (
            lambda p: p.waves[0].groups[1].local.__setitem__(7, [13]) or p.waves[0].groups[1].local.pop(5),
            "not in group",
        ),
        (lambda p: p.waves[0].groups[1].local[4].append(99), "sample 99 is not in the step's global batch"),
        (lambda p: p.lengths.__setitem__(1, 0), "sample 11 has length 0"),
        (lambda p: setattr(p, "sample_ids", [10, 10, 12, 13]), "sample 10 appears twice"),
        (lambda p: setattr(p.waves[0].groups[0], "ranks", (6, 7, 8, 9)), "rank 8 outside world of 8"),
        (lambda p: p.waves[0].groups.append(Group(ranks=(9,), local={9: []})), "rank 9 outside world of 8"),
        (lambda p: p.waves[0].groups.append(Group(ranks=(-1,), local={-1: []})), "rank -1 outside world of 8"),
    ],
)
def test_validate_rejects_each_broken_invariant(mutate, message):
    p = base_plan()
    mutate(p)
    with pytest.raises(PlanError, match=message):
        p.validate(CL)


def test_distributed_cap_counts_shards():
    # 3000 tokens over 2 ranks is 1500 per rank: over the cap of 1000
    p = base_plan()
    p.waves[0].groups[0] = Group(ranks=(0, 1), distributed=[10], local={1: [12]})
    p.waves[0].groups[1].local[4] = [11]
    with pytest.raises(PlanError, match="rank 0 holds 1500 tokens"):
        p.validate(CL)


def test_empty_step_rejected():
    with pytest.raises(PlanError, match="no samples"):
        StepPlan(world_size=8, max_tokens_per_rank=10, sample_ids=[], lengths=[]).validate(CL)


def test_malformed_json_names_the_problem():
    with pytest.raises(PlanError, match="not valid JSON"):
        StepPlan.from_json("{", "x.json")
    d = base_plan().to_dict()
    del d["waves"]
    with pytest.raises(PlanError, match="missing field 'waves'"):
        StepPlan.from_dict(d)
    d = base_plan().to_dict()
    d["format"] = "other"
    with pytest.raises(PlanError, match="format"):
        StepPlan.from_dict(d)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 8000), min_size=1, max_size=40), st.integers(0, 10**6))
def test_random_valid_plans_validate_and_serialise_identically(lengths, seed):
    p = random_valid_plan(lengths, CL, seed)
    p.validate(CL)
    assert StepPlan.from_json(p.to_json()).to_json() == p.to_json()
    assert random_valid_plan(lengths, CL, seed).to_json() == p.to_json()
