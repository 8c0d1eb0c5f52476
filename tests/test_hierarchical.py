"""Hierarchical planning (issue 39): the first pass splits a step over the hosts, each host
plans its own ranks, and the merged plan is a valid StepPlan within 0.3% of flat planning."""

import json

import numpy as np
import pytest

from hf_cp.balance import BalancerOptionError, PlanRequest, UnsupportedMaskError, check_mask_support, get_balancer
from hf_cp.balance.hierarchical import plan_hierarchically
from hf_cp.balance.toolkit.host_split import split_over_hosts
from hf_cp.cli import main
from hf_cp.cost.model import CostModel
from hf_cp.cost.simulate import simulate
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.planning.setup import PlanningSettings, planning_setup
from hf_cp.planning.worker import Planner
from hf_cp.samples.lengths import read_lengths, step_batches
from hf_cp.samples.masks import SampleMask

from helpers import load_file_module

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron", "ignore::DeprecationWarning")

CAP = 32768
TOKENS_PER_RANK = 65536  # a full step, as the balancer benchmarks fill them


@pytest.fixture(scope="module")
def cost():
    return CostModel.load("qwen2.5-7b", "h200-qwen2.5-7b")


def full_step(traces_dir, name: str, world: int, cost, seed: int = 0) -> PlanRequest:
    """Step 1 of the trace's shuffled epochs read as one stream, filled to the token budget (the
    balancer benchmark's full steps: a small trace fills a large world's step over epochs)."""
    bench = load_file_module("bench_balancers", "scripts/bench_balancers.py")
    lengths = read_lengths(traces_dir / f"{name}.txt")
    cluster = ClusterSpec(world, CAP, 8)
    ids = bench.full_step_ids(lengths, TOKENS_PER_RANK * world, seed, [1])[1]
    lens = [lengths[i % len(lengths)] for i in ids]
    return PlanRequest(ids, lens, cluster, cost, seed=seed, step=1, dataset_max_length=max(lengths))


def positions_of(split):
    spread = [p for b in split.spread for p in b.positions]
    hosts = [int(p) for h in split.host_positions for p in h]
    return spread, hosts


def test_the_split_places_every_sample_once_and_evens_the_hosts(traces_dir, cost):
    req = full_step(traces_dir, "chat_lmsys_chat1m_191conv", 512, cost)
    split = split_over_hosts(req, 8)
    spread, hosts = positions_of(split)
    assert sorted(spread + hosts) == list(range(len(req.sample_ids)))
    assert split.hosts == 64 and not spread  # chat samples all fit a host in time
    assert split.imbalance() < 1.002
    # the estimate is what each host's request holds, priced again from its own samples
    again = split_over_hosts(req, 8)
    assert all(np.array_equal(a, b) for a, b in zip(split.host_positions, again.host_positions))


def test_a_sample_no_host_holds_spreads_over_an_aligned_block_of_hosts_first(cost):
    # hosts of 8 ranks x 1024 tokens hold 8192 tokens per micro-batch; 20000 tokens need 32 ranks
    cluster = ClusterSpec(64, 1024, 8)
    rng = np.random.default_rng(3)
    lengths = [20000] + rng.integers(50, 1000, 400).tolist()
    req = PlanRequest(range(len(lengths)), lengths, cluster, cost, seed=1)
    split = split_over_hosts(req, 8)
    (block,) = split.spread
    assert block.positions == (0,) and block.hosts == 4 and block.first_host % 4 == 0
    spread, hosts = positions_of(split)
    assert sorted(spread + hosts) == list(range(len(lengths)))
    auto = get_balancer("auto")
    plan, report, _ = plan_hierarchically(req, auto.plan, 8)
    plan.validate(cluster, cost)
    ((spread_wave, group),) = [(w, g) for w, wv in enumerate(plan.waves) for g in wv.groups if 0 in g.sample_ids()]
    assert len({r // 8 for r in group.ranks}) > 1  # the group spans hosts
    block_ranks = range(block.first_host * 8, (block.first_host + block.hosts) * 8)
    own = [
        w for w, wv in enumerate(plan.waves) for g in wv.groups if g.ranks[0] in block_ranks and 0 not in g.sample_ids()
    ]
    assert own and min(own) > spread_wave  # the block's hosts run their own samples after it
    assert report.spread_samples == 1 and len(report.block_ms) == 1


def test_the_4096_rank_step_validates_and_is_within_0_3_percent_of_the_flat_plan(traces_dir, cost):
    req = full_step(traces_dir, "longdoc_leval_multiturn", 4096, cost)
    auto = get_balancer("auto")
    flat = simulate(auto.plan(req), cost).makespan_ms
    plan = get_balancer("hierarchical").plan(req).validate(req.cluster, cost)
    assert plan.balancer.startswith("hierarchical:auto:")
    assert sorted(plan.sample_ids) == sorted(req.sample_ids)
    mine = simulate(plan, cost).makespan_ms
    assert mine <= 1.003 * flat, (mine, flat)


def test_the_plan_is_a_pure_function_of_the_request(traces_dir, cost):
    req = full_step(traces_dir, "code_numpy_files", 128, cost, seed=4)
    a = get_balancer("hierarchical", host_ranks=16).plan(req)
    b = get_balancer("hierarchical", host_ranks=16).plan(req)
    assert json.dumps(a.to_dict(), sort_keys=True) == json.dumps(b.to_dict(), sort_keys=True)
    assert any("hierarchical: 8 hosts of 16 ranks" in n for n in a.notes)


def test_a_world_of_one_host_is_planned_flat_by_the_member(traces_dir, cost):
    req = full_step(traces_dir, "chat_alpaca_eval_outputs", 8, cost)
    mine = get_balancer("hierarchical").plan(req)
    theirs = get_balancer("auto").plan(req)
    assert mine.balancer == f"hierarchical:{theirs.balancer}"
    assert [w.to_dict() for w in mine.waves] == [w.to_dict() for w in theirs.waves]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"host_ranks": 12}, "host_ranks 12 must be a positive power of two"),
        ({"member": "hierarchical"}, "cannot be its own member"),
        ({"member": "nope"}, "member 'nope' is not a balancer"),
        ({"member_options": {"fill": 2}}, "hierarchical: member_options: auto: unknown option 'fill'"),
        ({"hosts": 8}, "unknown option 'hosts'"),
        ({"min_samples_per_rank": -1}, "min_samples_per_rank -1.0 must be >= 0"),
    ],
)
def test_bad_options_are_refused_by_name(options, message):
    with pytest.raises(BalancerOptionError, match=message):
        get_balancer("hierarchical", **options)


def test_masked_samples_are_planned_by_a_member_that_plans_them_and_refused_otherwise(traces_dir, cost):
    lines = (traces_dir / "shared_prompt_alpaca_eval_n8.jsonl").read_text().splitlines()
    groups = [SampleMask.shared_prompt(r["prompt"], r["answers"]) for r in map(json.loads, filter(None, lines))]
    batch = step_batches([m.length for m in groups], TOKENS_PER_RANK * 32, seed=0)[0]
    req = PlanRequest(batch, [groups[i].length for i in batch], ClusterSpec(32, CAP, 8), cost,
                      masks={i: groups[i] for i in batch})  # fmt: skip
    plan = get_balancer("hierarchical").plan(req).validate(req.cluster, cost)
    assert plan.masks == req.masks
    flat = simulate(get_balancer("auto").plan(req), cost).makespan_ms
    assert simulate(plan, cost).makespan_ms <= 1.003 * flat
    with pytest.raises(UnsupportedMaskError, match="balancer 'hierarchical' prices every sample as a causal"):
        check_mask_support(get_balancer("hierarchical", member="wlb"), req, "hierarchical")


def test_the_trainers_planner_plans_with_it_and_passes_the_chunk_settings_to_the_member(traces_dir):
    settings = PlanningSettings(
        balancer="hierarchical", balancer_options={"host_ranks": 4}, chunk_keep=3, profile="h200-qwen2.5-7b",
        model_dims="qwen2.5-7b", max_tokens_per_rank=CAP, tokens_per_rank_per_step=TOKENS_PER_RANK,
    )  # fmt: skip
    assert settings.balancer_kwargs()["member_options"]["member_options"]["chunkflow"]["keep"] == 3
    lengths = read_lengths(traces_dir / "longdoc_leval_multiturn.txt")
    setup = planning_setup(settings, lengths, 16)
    planner = Planner.from_setup(setup, lookahead=0)
    step = planner.get(0)
    assert step.plan.balancer.startswith("hierarchical:")
    assert planner.balancer.last_report.hosts == 4
    assert step.planner_cpu_ms > 0


def run_plan(capsys, *args):
    rc = main(["plan", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out


def test_a_step_of_few_samples_per_rank_is_planned_flat(traces_dir, cost):
    lengths = read_lengths(traces_dir / "chat_lmsys_chat1m_191conv.txt")  # 191 samples: 3 per rank at 64
    req = PlanRequest(range(len(lengths)), lengths, ClusterSpec(64, CAP, 8), cost)
    balancer = get_balancer("hierarchical")
    plan = balancer.plan(req)
    assert balancer.last_report is None
    assert [w.to_dict() for w in plan.waves] == [w.to_dict() for w in get_balancer("auto").plan(req).waves]
    # planned host by host anyway, it trails the flat plan by more than the 0.3% promised
    split = get_balancer("hierarchical", min_samples_per_rank=0).plan(req)
    assert simulate(split, cost).makespan_ms > 1.003 * simulate(plan, cost).makespan_ms


def test_the_cli_reports_the_first_pass_the_slowest_host_and_the_flat_plan(capsys, traces_dir):
    trace = traces_dir / "chat_lmsys_chat1m_191conv.txt"  # 16 ranks x 8192 tokens: a full first step
    rc, out = run_plan(capsys, "--lengths", trace, "--world", 16, "--tokens-per-rank-per-step", 8192,
                       "--host-ranks", 4, "--steps", 1, "--hierarchical", "--progress", "off")  # fmt: skip
    assert rc == 0
    assert "balancer hierarchical member=auto" in out
    assert "first pass CPU" in out and "slowest host CPU" in out
    line = next(x for x in out.splitlines() if x.startswith("hierarchical / flat over these steps:"))
    assert float(line.split(":")[1].split(";")[0]) <= 1.003
    assert "plan wall" in out and "plan CPU" in out
    assert main(["plan", "--lengths", str(trace), "--world", "64", "--host-ranks", "8"]) != 0
    assert "--host-ranks is an option of --hierarchical" in capsys.readouterr().err
