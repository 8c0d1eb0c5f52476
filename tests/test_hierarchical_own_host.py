"""Each host plans only its own parts of a hierarchical step (issue 39): the first pass, the
blocks of hosts it owns and its own samples; the ranks exchange the parts and every rank
merges them into the plan plan_hierarchically makes, byte for byte."""

import random
import threading
from pathlib import Path

import numpy as np
import pytest
from test_hierarchical import full_step

from hf_cp.balance import BalancerOptionError, PlanRequest, get_balancer
from hf_cp.balance.hierarchical import (
    HostPartsError,
    block_owners,
    merge_host_parts,
    plan_hierarchically,
    plan_host_parts,
)
from hf_cp.balance.toolkit.host_split import split_over_hosts
from hf_cp.cost.model import CostModel
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.planning.sampler import GlobalBatch
from hf_cp.planning.setup import PlanningSettings, planning_setup
from hf_cp.planning.worker import HostPlanned, Planner
from hf_cp.samples.lengths import read_lengths

from helpers.dist_utils import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron", "ignore::DeprecationWarning")

TRACES = Path(__file__).resolve().parent.parent / "benchmarks" / "traces"


@pytest.fixture(scope="module")
def cost():
    return CostModel.load("qwen2.5-7b", "h200-qwen2.5-7b")


def spread_step(cost, world: int, host_ranks: int, longs, n: int = 300, seed: int = 2) -> PlanRequest:
    """Short samples and `longs` over what a host of `host_ranks` x 1024 tokens holds."""
    rng = np.random.default_rng(seed)
    lengths = list(longs) + rng.integers(50, 1000, n).tolist()
    return PlanRequest(range(len(lengths)), lengths, ClusterSpec(world, 1024, host_ranks), cost, seed=seed)


def every_host(req: PlanRequest, member, host_ranks: int):
    return [plan_host_parts(req, member, host_ranks, h) for h in range(req.cluster.world_size // host_ranks)]


REQUESTS = {
    "world 16, 4 hosts, 2 spread samples": lambda cost: (spread_step(cost, 16, 4, [9000, 7000]), 4),
    "world 16, 4 hosts, chat: none spread": lambda cost: (full_step(TRACES, "chat_lmsys_chat1m_191conv", 16, cost), 4),
    "world 64, 8 hosts, 1 spread over 4": lambda cost: (spread_step(cost, 64, 8, [20000], 400, 3), 8),
    "world 128, 8 hosts of 16, code": lambda cost: (full_step(TRACES, "code_numpy_files", 128, cost, seed=4), 16),
    "world 512, 64 hosts, long documents": lambda cost: (full_step(TRACES, "longdoc_leval_multiturn", 512, cost), 8),
}


@pytest.mark.parametrize("case", list(REQUESTS))
def test_merging_every_hosts_parts_gives_the_flat_plan_byte_for_byte(case, cost):
    req, host_ranks = REQUESTS[case](cost)
    auto = get_balancer("auto", exhaustive_below=0)
    flat, report, winners = plan_hierarchically(req, auto.plan, host_ranks)
    parts = every_host(req, auto.plan, host_ranks)
    random.Random(0).shuffle(parts)  # the exchange's order is not the merge's
    merged, merged_report, merged_winners = merge_host_parts(req, parts)
    assert merged.to_json() == flat.to_json()
    assert merged_winners == winners
    assert merged_report.layout() == report.layout() and merged_report.block_owner == report.block_owner
    # the balancer's own plan is the merge of its own parts too
    balancer = get_balancer("hierarchical", host_ranks=host_ranks, min_samples_per_rank=0)
    whole = balancer.plan(req)
    hosts = [balancer.plan_host_parts(req, h) for h in range(req.cluster.world_size // host_ranks)]
    assert balancer.merge_host_parts(req, hosts).to_json() == whole.to_json()
    merged.validate(req.cluster, cost)


def counting(member):
    calls = []

    def plan(req):
        calls.append((req.cluster.world_size, tuple(req.sample_ids)))
        return member(req)

    return plan, calls


def test_a_host_plans_only_its_own_samples_and_the_blocks_it_owns(cost):
    req = spread_step(cost, 16, 2, [9000, 7000, 2500])
    auto = get_balancer("auto", exhaustive_below=0)
    split = split_over_hosts(req, 2)
    owners = block_owners(split)
    assert len(split.spread) >= 2
    for h in range(split.hosts):
        plan, calls = counting(auto.plan)
        plan_host_parts(req, plan, 2, h)
        want = [(b.hosts * 2, tuple(b.positions)) for b, o in zip(split.spread, owners) if o == h]
        if len(split.host_positions[h]):
            want.append((2, tuple(int(i) for i in split.host_positions[h])))
        assert calls == want, h
    # each block is planned by exactly one of its hosts
    assert all(b.first_host <= o < b.first_host + b.hosts for b, o in zip(split.spread, owners))


def test_blocks_starting_at_one_host_are_owned_by_the_least_loaded_of_their_hosts(traces_dir):
    settings = PlanningSettings(
        balancer="hierarchical", balancer_options={"host_ranks": 2, "min_samples_per_rank": 0}, compare_balancer=None,
        profile="h200-qwen2.5-7b", model_dims="qwen2.5-7b", max_tokens_per_rank=8192, tokens_per_rank_per_step=16384,
    )  # fmt: skip
    setup = planning_setup(settings, read_lengths(traces_dir / "longdoc_leval_multiturn.txt"), 8)
    req = Planner.from_setup(setup, lookahead=0).request(setup.sampler[1])
    split = split_over_hosts(req, 2)
    assert [(b.first_host, b.hosts) for b in split.spread] == [(0, 2), (0, 4)]
    assert block_owners(split) == [0, 1]  # not host 0 twice


def test_the_merge_refuses_a_missing_a_failed_or_a_disagreeing_host(cost):
    req = spread_step(cost, 16, 4, [9000, 7000])
    auto = get_balancer("auto", exhaustive_below=0)
    parts = every_host(req, auto.plan, 4)
    with pytest.raises(HostPartsError, match=r"step 0: the parts of hosts \[2\] of 4 are missing"):
        merge_host_parts(req, parts[:2] + parts[3:])
    parts[1].error = "MemoryError: boom"
    with pytest.raises(HostPartsError, match="step 0: host 1 could not plan its parts: MemoryError: boom"):
        merge_host_parts(req, parts)
    parts[1].error = None
    owner = next(hp for hp in parts if any(p.block for p in hp.parts))
    owner.parts = [p for p in owner.parts if not p.block]
    with pytest.raises(HostPartsError, match="came from no host"):
        merge_host_parts(req, parts)
    other = every_host(spread_step(cost, 16, 4, [9000, 7000], seed=5), auto.plan, 4)
    with pytest.raises(HostPartsError, match="split the step otherwise than host 0"):
        merge_host_parts(req, every_host(req, auto.plan, 4)[:3] + other[3:])


@pytest.mark.parametrize("value", ["sometimes", 2])
def test_a_bad_plan_own_host_is_refused_by_name(value):
    with pytest.raises(BalancerOptionError, match="hierarchical: option plan_own_host"):
        get_balancer("hierarchical", plan_own_host=value)


# ------------------------------------------------------------------ the planner
def longdoc_setup(world: int, host_ranks: int, cap: int = 16384, trace: str = "longdoc_leval_multiturn", **options):
    """Steps of long documents (up to 57K tokens: some spread over a block of hosts)."""
    settings = PlanningSettings(
        balancer="hierarchical", balancer_options={"host_ranks": host_ranks, "min_samples_per_rank": 0, **options},
        profile="h200-qwen2.5-7b", model_dims="qwen2.5-7b", max_tokens_per_rank=cap, tokens_per_rank_per_step=2 * cap,
        compare_balancer=None,
    )  # fmt: skip
    return planning_setup(settings, read_lengths(TRACES / f"{trace}.txt"), world)


def test_planners_of_every_rank_merge_the_flat_plan_from_the_parts_of_the_hosts_first_ranks():
    world, h = 8, 2
    setup = longdoc_setup(world, h, cap=8192)
    flat = Planner.from_setup(setup, lookahead=0)
    planners = [Planner.from_setup(setup, lookahead=0) for _ in range(world)]
    inbox = {}
    for r, p in enumerate(planners):
        assert p.plan_own_host(r, lambda index, parts: inbox[index])
    for k in range(3):
        mine = [p.plan_part(k) for p in planners]
        assert all(isinstance(m, HostPlanned) for m in mine)
        assert [m.parts is not None for m in mine] == [r % h == 0 for r in range(world)]
        inbox[k] = [m.parts for m in mine]
        want = flat.get(k)
        for p, m in zip(planners, mine):
            got = p.finish(k, m)
            assert got.plan.to_json() == want.plan.to_json()
            assert got.predicted.makespan_ms == want.predicted.makespan_ms
    # one host, or plan_own_host off: every rank plans every step whole, as before
    assert not Planner.from_setup(longdoc_setup(2, 2, trace="chat_lmsys_chat1m_191conv"), lookahead=0).plan_own_host(
        0, None
    )
    assert not Planner.from_setup(longdoc_setup(world, h, plan_own_host=False), lookahead=0).plan_own_host(0, None)


def test_the_next_steps_parts_are_exchanged_when_a_step_is_taken_and_again_after_a_new_cost_model():
    world, h = 8, 2
    setup = longdoc_setup(world, h, cap=8192)
    balancer = setup.balancer()
    exchanged = []

    def exchange(index, parts):  # rank 0 of host 0; the other hosts' first ranks as they would plan
        exchanged.append(index)
        req = planner.request(setup.sampler[index], planner.cost_for(index)[1])
        others = [balancer.plan_host_parts(req, host) for host in range(1, world // h)]
        return [parts, None] + [x for o in others for x in (o, None)]

    planner = Planner.from_setup(setup, lookahead=2, in_subprocess=False)
    assert planner.plan_own_host(0, exchange)
    member, threads = planner.balancer.member, []
    member.plan = lambda req, plan=member.plan: threads.append(threading.current_thread().name) or plan(req)
    flat = Planner.from_setup(setup, lookahead=0)
    assert planner.get(0).plan.to_json() == flat.get(0).plan.to_json()
    assert exchanged == [0, 1]  # step 1's parts too, merged while step 0 trains
    planner.set_cost(1, 1, setup.cost)  # (online calibration, alike on every rank): step 1 exchanged again
    assert planner.get(1).plan.to_json() == flat.get(1).plan.to_json()
    assert exchanged == [0, 1, 1, 2]
    assert planner.get(3).plan.to_json() == flat.get(3).plan.to_json()  # (step 2 skipped: resumed)
    assert exchanged == [0, 1, 1, 2, 3, 4] and planner.merged_ahead == 0
    assert planner.get(4).plan.to_json() == flat.get(4).plan.to_json()
    assert exchanged == [0, 1, 1, 2, 3, 4, 5] and planner.merged_ahead == 1
    for k in (5, 6):
        assert planner.get(k).plan.to_json() == flat.get(k).plan.to_json()
    assert exchanged[-2:] == [6, 7] and planner.merged_ahead == 3
    # every step planned ahead on the planner's thread, never on the one that takes the steps
    assert threads and set(threads) != {threading.current_thread().name}
    assert threading.current_thread().name not in threads
    planner.close()


# ------------------------------------------------------------------ real gloo worlds
def _plan_in_a_gloo_world(rank, world, host_ranks, cap, steps, in_subprocess, batches):
    import torch.distributed as dist

    from hf_cp.train.runtime.host_parts import host_parts_exchange

    setup = longdoc_setup(world, host_ranks, cap)
    group = dist.new_group(list(range(world)), backend="gloo")
    out = {"digests": [], "calls": []}
    # planned ahead (lookahead 2) in a worker process, or on a thread (its member calls counted here)
    planner = Planner.from_setup(setup, lookahead=2, in_subprocess=in_subprocess)
    assert planner.plan_own_host(rank, host_parts_exchange(group))
    member = planner.balancer.member
    plan, calls = member.plan, []
    member.plan = lambda req: calls.append((req.step, req.cluster.world_size)) or plan(req)
    planner.start()
    for k in range(steps):
        out["digests"].append(planner.get(k).plan.digest())
    out["merged_ahead"] = planner.merged_ahead
    planner.close()
    # batches given now (GRPO's path, lookahead 0): a host with no samples still exchanges
    given = Planner(None, setup.balancer(), setup.cluster, setup.cost, lookahead=0, compare_balancer=None)
    assert given.plan_own_host(rank, host_parts_exchange(group))
    given.balancer.member.plan = lambda req, p=given.balancer.member.plan: calls.append(("given",)) or p(req)
    for k, lengths in enumerate(batches):
        batch = GlobalBatch(k, 0, k, tuple(range(len(lengths))), tuple(lengths))
        out["digests"].append(given.plan_now(k, batch=batch).plan.digest())
    out["calls"] = calls
    return out


@pytest.mark.parametrize(
    "world, host_ranks, cap", [(4, 2, 16384), pytest.param(8, 4, 8192, marks=pytest.mark.slow)]
)  # (at 8192 tokens a rank, 57K-token documents spread over 8 ranks)
def test_every_rank_of_a_gloo_world_merges_the_single_process_plan_planning_only_its_host(world, host_ranks, cap):
    steps = 3
    # given batches: one sample over both hosts' memory (a block; no host has samples of its own),
    # one short sample (one host has it, the others nothing)
    batches = [[cap * host_ranks + 5000], [300]]
    results = run_distributed(
        _plan_in_a_gloo_world, world, host_ranks, cap, steps, False, batches, timeout_s=240, daemon=False
    )
    assert all(status == "ok" for status, _ in results.values()), results
    setup = longdoc_setup(world, host_ranks, cap)
    flat = Planner.from_setup(setup, lookahead=0)
    want = [flat.get(k).plan.digest() for k in range(steps)]
    given = Planner(None, setup.balancer(), setup.cluster, setup.cost, lookahead=0, compare_balancer=None)
    want += [
        given.plan_now(k, batch=GlobalBatch(k, 0, k, tuple(range(len(b))), tuple(b))).plan.digest()
        for k, b in enumerate(batches)
    ]
    # per host, the member's calls it should make: (step, ranks planned on) for each block it
    # owns, then for its own samples
    expected = {h: [] for h in range(world // host_ranks)}
    for k in range(steps):
        split = split_over_hosts(flat.request(setup.sampler[k]), host_ranks)
        for b, owner in zip(split.spread, block_owners(split)):
            expected[owner].append((k, b.hosts * host_ranks))
        for h, pos in enumerate(split.host_positions):
            if len(pos):
                expected[h].append((k, host_ranks))
    assert any(size > host_ranks for calls in expected.values() for _, size in calls)  # blocks were planned
    for rank, (_, got) in sorted(results.items()):
        assert got["digests"] == want, rank
        assert got["merged_ahead"] == steps - 1, rank  # merged on the planner's thread while the step before ran
        if rank % host_ranks:  # receives its host's parts: plans nothing
            assert got["calls"] == [], rank
            continue
        # (the planner plans `lookahead` steps past the last one asked for: not counted)
        planned = [tuple(c) for c in got["calls"] if c[0] != "given" and c[0] < steps]
        assert planned == expected[rank // host_ranks], rank


def test_a_gloo_world_planning_ahead_in_worker_processes_merges_the_same_plans():
    world, host_ranks, steps = 4, 2, 3
    results = run_distributed(
        _plan_in_a_gloo_world, world, host_ranks, 16384, steps, True, [], timeout_s=240, daemon=False
    )
    assert all(status == "ok" for status, _ in results.values()), results
    flat = Planner.from_setup(longdoc_setup(world, host_ranks), lookahead=0)
    want = [flat.get(k).plan.digest() for k in range(steps)]
    assert all(got["digests"] == want for _, got in results.values())
    # every step after the first: exchanged when the one before was taken, merged by the worker
    assert all(got["merged_ahead"] == steps - 1 for _, got in results.values())


def _plan_with_a_failing_host(rank, world):
    import torch.distributed as dist

    from hf_cp.train.runtime.host_parts import host_parts_exchange

    setup = longdoc_setup(world, 2)
    group = dist.new_group(list(range(world)), backend="gloo")
    planner = Planner(None, setup.balancer(), setup.cluster, setup.cost, lookahead=0, compare_balancer=None)
    assert planner.plan_own_host(rank, host_parts_exchange(group))
    if rank == 2:  # host 1's first rank: its member fails

        def fail(req):
            raise MemoryError("no memory left for the member")

        planner.balancer.member.plan = fail
    batch = GlobalBatch(0, 0, 0, tuple(range(8)), (300, 200, 900, 50, 700, 120, 60, 2000))
    try:
        planner.plan_now(0, batch=batch)
    except HostPartsError as e:
        return str(e)
    return "no error"


def test_a_host_whose_planning_fails_fails_every_rank_naming_it_instead_of_a_hang():
    results = run_distributed(_plan_with_a_failing_host, 4, timeout_s=120, daemon=False)
    texts = {status + ": " + str(text) for status, text in results.values()}
    assert texts == {"ok: step 0: host 1 could not plan its parts: MemoryError: no memory left for the member"}, texts


def _exchange_with_a_missing_rank(rank, world):
    import datetime

    import torch.distributed as dist

    from hf_cp.train.runtime.host_parts import HostPartsExchangeError, host_parts_exchange

    group = dist.new_group(list(range(world)), backend="gloo", timeout=datetime.timedelta(seconds=3))
    if rank == 1:
        return "skipped"  # never joins step 5's exchange
    try:
        host_parts_exchange(group)(4, None)
    except HostPartsExchangeError as e:
        return str(e)
    return "no error"


def test_a_failed_exchange_names_the_step():
    results = run_distributed(_exchange_with_a_missing_rank, 2, timeout_s=120)
    status, text = results[0]
    assert status == "ok" and text.startswith("step 5: exchanging the hosts' plan parts"), results


# ------------------------------------------------------------------ CPTrainer at world 4
# 2 hosts of 2 ranks x 256 tokens: the 700-token sample spreads over a block of both hosts (a
# CP group of 4), each host plans its own short samples; at 900 tokens a step, unshuffled,
# step 1 is [0..3] and step 2 [4..13] (a step whose hosts only plan their own samples)
TRAINER_LENGTHS = [700, 60, 30, 90, 120, 100, 150, 90, 60, 70, 40, 110, 33, 20]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_world_4_cptrainer_run_planning_each_host_trains_as_every_rank_planning_everything(tmp_path):
    import json

    from helpers.harness.check import check_run
    from helpers.harness.job import run_distributed as run_job

    def spec(own: bool) -> dict:
        return dict(
            lengths=TRAINER_LENGTHS, tokens_per_step=900, max_tokens_per_rank=256, steps=2, balancer="hierarchical",
            balancer_options=dict(host_ranks=2, min_samples_per_rank=0, plan_own_host=own), ddp_timeout=120,
            out=str(tmp_path / ("own-host" if own else "every-host")),
        )  # fmt: skip

    own, every = spec(True), spec(False)
    run_job({"runs": [own, every]}, 4, timeout=840)
    history = {s["out"]: json.loads((Path(s["out"]) / "history.json").read_text()) for s in (own, every)}
    mine, theirs = history[own["out"]], history[every["out"]]
    assert [r["plan_digest"] for r in mine] == [r["plan_digest"] for r in theirs]
    assert [r["loss"] for r in mine] == [r["loss"] for r in theirs]
    check_run(own)  # and both equal single-process training, step by step
