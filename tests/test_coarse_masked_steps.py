"""Coarse masked steps (issue 39): GRPO-like steps of shared prompts with long completions hold
about two samples a rank, each near the cap. Whole-document candidates priced such samples as
causal documents on their groups (several times their masked work) and then filled the ranks
with samples too coarse to level the blocks: magi's plan was 1.095x the charged bound at 64
ranks. The balancers now price a distributed masked sample by its masked area, and dynamic_cp
adds a candidate that spreads the step's samples over groups of two balanced as one LPT."""

import pytest
from test_auto_promise import grouped_step  # the promise bench's step builder

from hf_cp.balance import PlanRequest, get_balancer
from hf_cp.balance.toolkit.bounds import BoundCache
from hf_cp.balance.toolkit.costs import cost_memo
from hf_cp.balance.toolkit.cp_candidates import per_rank_ms
from hf_cp.cost.simulate import simulate
from hf_cp.modes.segments import ShardMode
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import Group, StepPlan, Wave
from hf_cp.samples.masks import SampleMask

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron", "ignore::DeprecationWarning")


def one_sample_plan(mask: SampleMask, group_size: int) -> StepPlan:
    """The sample alone, per-document sharded over ranks 0..g-1 (local on rank 0 at g = 1)."""
    ranks = tuple(range(group_size))
    group = (
        Group(ranks=ranks, local={0: [0]})
        if group_size == 1
        else Group(ranks=ranks, distributed=[0], mode=ShardMode.RING_PER_DOC.value)
    )
    return StepPlan(
        world_size=group_size,
        max_tokens_per_rank=1 << 20,
        sample_ids=[0],
        lengths=[mask.length],
        waves=[Wave([group])],
        masks={0: mask},
    )


@pytest.mark.parametrize("group_size", [1, 2, 4, 8])
def test_a_masked_sample_is_priced_on_its_group_as_the_simulator_runs_it(h200_cost, group_size):
    mask = SampleMask.shared_prompt(900, [6000, 4000, 7000, 3000, 5000, 2000, 6500, 4500])
    memo = cost_memo(h200_cost)
    overhead = h200_cost.micro_batch_overhead_ms()
    simulated = simulate(one_sample_plan(mask, group_size), h200_cost).makespan_ms
    # per_rank_ms charges one micro-batch overhead to a distributed sample, none to a local one
    charged = per_rank_ms(memo, mask.length, group_size, mask) + (overhead if group_size == 1 else 0.0)
    assert charged == pytest.approx(simulated, rel=1e-9)
    # ... and the causal price of the same length is far above it: the mis-pricing this fixes
    assert per_rank_ms(memo, mask.length, group_size) > 1.3 * per_rank_ms(memo, mask.length, group_size, mask)


@pytest.mark.parametrize("balancer", ["auto", "magi", "usp"])
def test_grpo_like_step_at_64_ranks_is_within_5_percent_of_the_charged_bound(h200_cost, traces_dir, balancer):
    req = grouped_step(traces_dir, "g8long", 64, h200_cost)
    plan = get_balancer(balancer).plan(req).validate(req.cluster, h200_cost)
    ratio = simulate(plan, h200_cost).makespan_ms / BoundCache(req).charged()
    assert ratio <= 1.05, f"{balancer}: {ratio:.4f}x the charged bound"


def test_the_spread_candidate_is_what_levels_the_coarse_step(h200_cost, traces_dir):
    """Without spread candidates dynamic_cp's groups leave magi 1.07x the bound on this step."""
    req = grouped_step(traces_dir, "g8long", 64, h200_cost)
    bound = BoundCache(req).charged()

    def ratio(**options):
        plan = get_balancer("magi", base_options=options).plan(req)
        return simulate(plan, h200_cost).makespan_ms / bound

    assert ratio() <= 1.05 < ratio(spread_sizes=[])


def test_spread_candidates_are_tried_on_coarse_steps_only(h200_cost):
    """A step of many samples a rank is planned exactly as without the spread candidates."""
    cluster = ClusterSpec(8, 4096, 8)
    lengths = [200 + (37 * i) % 900 for i in range(400)]  # 50 samples a rank
    req = PlanRequest(list(range(len(lengths))), lengths, cluster, h200_cost)
    with_spread = get_balancer("dynamic_cp").plan(req).to_json()
    assert with_spread == get_balancer("dynamic_cp", spread_sizes=[]).plan(req).to_json()


@pytest.mark.parametrize("bad", [[3], [1], [2, 6]])
def test_spread_sizes_must_be_powers_of_two_above_one(bad):
    with pytest.raises(ValueError, match="spread_sizes"):
        get_balancer("dynamic_cp", spread_sizes=bad)


def test_spread_samples_per_rank_must_not_be_negative():
    with pytest.raises(ValueError, match="spread_samples_per_rank -1"):
        get_balancer("dynamic_cp", spread_samples_per_rank=-1)
