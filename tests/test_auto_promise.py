"""`auto`'s promise (issue 39): its plan is within 0.3% of the best plan any of its members
makes, on plain, grouped (shared-prompt) and GRPO-like steps (long completions), at worlds
4, 8 and 64 (512 in the slow set), and on grouped steps at 64 ranks it costs at most twice
the CPU of the member it returns.

Each member is planned here on its own and simulated: the reference does not go through
auto's pricing, bounds or early stop. Before issue 39 auto stopped on masked steps at the
first member within 1.5% of the charged bound (static, up to 1.2% behind magi and dcp), and on
steps of ~50 samples at dynamic_cp 0.4% behind flexsp."""

import pytest

from hf_cp.balance import PlanRequest, get_balancer
from hf_cp.cost.simulate import simulate

from helpers import load_file_module

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron", "ignore::DeprecationWarning")

# the steps are the promise bench's (scripts/bench_auto_promise.py), which prints this file's
# cases with auto's and its best member's CPU
_bench = load_file_module("bench_auto_promise", "scripts/bench_auto_promise.py")
grouped_step, plain_step = _bench.grouped_step, _bench.plain_step
PROMISE = 1.003


def check_promise(req: PlanRequest, cost) -> None:
    auto = get_balancer("auto")
    mine = simulate(auto.plan(req).validate(req.cluster, cost), cost).makespan_ms
    members = [(n, b) for n, b in auto.members if not req.masks or getattr(b, "handles_masks", False)]
    theirs = {n: simulate(b.plan(req), cost).makespan_ms for n, b in members}
    best = min(theirs, key=theirs.get)
    assert mine <= PROMISE * theirs[best], (
        f"auto {mine:.1f} ms is {mine / theirs[best]:.4f}x {best}'s {theirs[best]:.1f} ms "
        f"(planned {sorted(auto.last_makespans)}, skipped {auto.last_skipped})"
    )


@pytest.mark.parametrize("world", [4, 8, 64])
@pytest.mark.parametrize("kind", ["dpo", "g3", "g8", "g16"])
def test_grouped_steps(h200_cost, traces_dir, kind, world):
    check_promise(grouped_step(traces_dir, kind, world, h200_cost), h200_cost)


@pytest.mark.parametrize("world", [4, 8, 64])
def test_grpo_like_steps_with_long_completions(h200_cost, traces_dir, world):
    check_promise(grouped_step(traces_dir, "g8long", world, h200_cost), h200_cost)


@pytest.mark.parametrize("world", [4, 8, 64])
@pytest.mark.parametrize("trace", ["chat_lmsys_chat1m_191conv", "longdoc_leval_multiturn", "code_numpy_files"])
def test_plain_steps(h200_cost, traces_dir, trace, world):
    check_promise(plain_step(traces_dir, trace, world, h200_cost), h200_cost)


# At 512 ranks auto used to stop on the long-document step at dynamic_cp, within 1.5% of the
# charged bound but 0.60% behind flexsp: the core members (AutoOptions.core_members) now stop
# only within 0.3% of it.
@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        "plain:chat_lmsys_chat1m_191conv",
        "plain:code_numpy_files",
        "plain:longdoc_leval_multiturn",
        "grouped:g3",
        "grouped:dpo",
        "grouped:g8long",
    ],
)
def test_at_512_ranks(h200_cost, traces_dir, case):
    kind, name = case.split(":")
    req = (
        plain_step(traces_dir, name, 512, h200_cost)
        if kind == "plain"
        else grouped_step(traces_dir, name, 512, h200_cost)
    )
    check_promise(req, h200_cost)


@pytest.mark.parametrize("world", [4, 8, 64])
@pytest.mark.parametrize("kind", ["dpo", "g3", "g8", "g16"])
def test_grouped_steps_plan_only_the_member_returned(h200_cost, traces_dir, kind, world):
    """auto's CPU on these steps is its winner's plus the bound's: it stops after its first member,
    whose plan is within stop_within_masked of the charged bound (at 64 ranks it planned all five
    masked members, ~60x magi's CPU, while magi's plans ended 0.32% above the bound; at 4 and 8
    ranks, steps under exhaustive_below samples, it planned all five at 8-23x magi's CPU)."""
    req = grouped_step(traces_dir, kind, world, h200_cost)
    auto = get_balancer("auto")
    plan = auto.plan(req)
    assert list(auto.last_makespans) == [plan.balancer.split(":")[1]], auto.last_skipped


def test_core_members_must_be_balancers_auto_plans_with():
    with pytest.raises(ValueError, match=r"core_members \['nope'\]"):
        get_balancer("auto", core_members=["nope"])
