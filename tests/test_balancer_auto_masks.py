"""`auto`'s early stop on masked steps (issue 28).

auto stops planning once its best plan is within `stop_within` of the step's lower bound, so
that bound must price masked samples by their masked area, as the simulator does: priced as
causal documents it sat 3-21% above the bound with masks on shared-prompt steps, and auto
kept `static` at up to 1.04x the bound where `magi` or `dcp` gave 1.001-1.003x. The property,
on full steps with and without masks at worlds 4 and 8: auto's plan is never slower than a
member it could plan by more than `stop_within` x the bound, and the bound is below every
member's plan (a true bound)."""

import json

import pytest

from hf_cp.balance import PlanRequest, get_balancer
from hf_cp.balance.toolkit.bounds import BoundCache
from hf_cp.cost.simulate import simulate
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.samples.lengths import read_lengths, step_batches
from hf_cp.samples.masks import SampleMask

CAP = 32768
TOKENS_PER_RANK = 65536  # a full step, as the balancer benchmarks fill them


def shared_prompt_groups(traces_dir, n: int, answers=None):
    """The shared-prompt trace of `n` answers per prompt as masked samples (the first
    `answers` answers of each prompt when given: 3-answer groups come from the n8 trace)."""
    lines = (traces_dir / f"shared_prompt_alpaca_eval_n{n}.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [SampleMask.shared_prompt(r["prompt"], r["answers"][:answers]) for r in records]


def full_step(lengths, world: int, seed: int):
    """The first global batch of one shuffled epoch, filled to the step's token budget."""
    return step_batches(lengths, TOKENS_PER_RANK * world, seed=seed)[0]


def masked_step(cost, world: int, groups, seed: int) -> PlanRequest:
    batch = full_step([m.length for m in groups], world, seed)
    cluster = ClusterSpec(world, CAP, cost.profile.gpus_per_node)
    return PlanRequest(batch, [groups[i].length for i in batch], cluster, cost, masks={i: groups[i] for i in batch})


def causal_step(cost, world: int, lengths, seed: int) -> PlanRequest:
    batch = full_step(lengths, world, seed)
    cluster = ClusterSpec(world, CAP, cost.profile.gpus_per_node)
    lens = [lengths[i] for i in batch]
    return PlanRequest(batch, lens, cluster, cost, dataset_max_length=max(lengths))


def check_never_slower_than_a_member_by_more_than_stop_within(req: PlanRequest, cost):
    auto = get_balancer("auto")
    plan = auto.plan(req).validate(req.cluster, cost)
    sim = simulate(plan, cost, req.cluster)
    bound = sim.charged_bound_ms  # the simulator's, masked samples by their masked area
    members = [(n, b) for n, b in auto.members if not req.masks or getattr(b, "handles_masks", False)]
    assert len(members) >= (4 if req.masks else 10)
    makespans = {name: simulate(balancer.plan(req), cost).makespan_ms for name, balancer in members}
    for name, member in makespans.items():
        assert bound <= member * (1 + 1e-9), f"{name}: {member:.1f} ms is under the bound {bound:.1f} ms"
        within = auto.options.stop_within_masked if req.masks else auto.options.stop_within
        assert sim.makespan_ms <= member + within * bound, (
            f"auto kept {plan.balancer} at {sim.makespan_ms / bound:.4f}x the bound, {name} gives "
            f"{member / bound:.4f}x (skipped: {auto.last_skipped})"
        )
    # auto stops against that bound, from the shared per-length caches
    assert auto.last_lower_bound_ms == pytest.approx(bound, rel=1e-9)
    # and skips a member by its own bound only where that bound is under its plan
    bounds = BoundCache(req)
    for name, balancer in members:
        own_bound = getattr(balancer, "lower_bound_ms", None)
        if own_bound is not None:
            assert own_bound(req, bounds) <= makespans[name] * (1 + 1e-9), name


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("seed", [0, 2, 5])
def test_three_answer_groups(h200_cost, traces_dir, world, seed):
    # the reported shape: 3-answer chat groups (auto kept static at 1.022-1.029x the bound on
    # seeds 0, 2 and 5, the best member at 1.002-1.003x)
    groups = shared_prompt_groups(traces_dir, 8, answers=3)
    check_never_slower_than_a_member_by_more_than_stop_within(masked_step(h200_cost, world, groups, seed), h200_cost)


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("answers_per_prompt", [8, 16])
def test_whole_shared_prompt_groups(h200_cost, traces_dir, world, answers_per_prompt):
    groups = shared_prompt_groups(traces_dir, answers_per_prompt)
    check_never_slower_than_a_member_by_more_than_stop_within(masked_step(h200_cost, world, groups, 0), h200_cost)


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("trace", ["chat_alpaca_eval_outputs", "longdoc_leval_multiturn"])
def test_causal_steps(h200_cost, traces_dir, world, trace):
    lengths = [n for n in read_lengths(traces_dir / f"{trace}.txt") if n <= world * CAP]
    check_never_slower_than_a_member_by_more_than_stop_within(causal_step(h200_cost, world, lengths, 0), h200_cost)


def test_bounds_price_masked_samples_by_their_masked_area(h200_cost):
    # one shared-prompt group: its answers do not attend to each other, so its attention is
    # under a causal document's of the same length, and every bound the cache gives is too
    mask = SampleMask.shared_prompt(2000, [3000, 3000, 3000])
    cluster = ClusterSpec(4, CAP, h200_cost.profile.gpus_per_node)
    masked = BoundCache(PlanRequest([0, 1], [mask.length, 500], cluster, h200_cost, masks={0: mask}))
    causal = BoundCache(PlanRequest([0, 1], [mask.length, 500], cluster, h200_cost))
    assert masked.local_ms[0] == pytest.approx(h200_cost.local_ms([mask.length], [mask]), rel=1e-12)
    assert masked.local_ms[0] < causal.local_ms[0] and masked.local_ms[1] == causal.local_ms[1]
    assert masked.charged() < causal.charged() and masked.step() < causal.step()
    for size in cluster.group_sizes:
        assert masked.fixed_size(size) < causal.fixed_size(size)
