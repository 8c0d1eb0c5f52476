import numpy as np
import pytest

from hf_cp.balance import PlanRequest, get_balancer
from hf_cp.balance.toolkit.costs import cost_memo
from hf_cp.balance.toolkit.cp_candidates import balance_sizes, memory_min_sizes
from hf_cp.cost.bounds import lower_bound_ms
from hf_cp.cost.simulate import simulate
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.samples.lengths import read_lengths, step_batches


def request(lengths, world, cost, cap=32768):
    return PlanRequest(list(range(len(lengths))), lengths, ClusterSpec(world, cap), cost)


def test_memory_pass_gives_the_smallest_group_that_holds_each_sample(h200_cost):
    req = request([1000, 32768, 32769, 70000, 200000], 16, h200_cost)
    sizes = memory_min_sizes(cost_memo(h200_cost), np.asarray(req.lengths), req)
    assert sizes.tolist() == [1, 1, 2, 4, 8]


def test_workload_pass_cuts_a_sample_over_the_quota_finer(h200_cost):
    # one 60K document and 200 short ones on 16 ranks: the 60K sample fits 2 ranks, but its
    # time there is several times a rank's fair share, so the workload pass enlarges its group
    lengths = [60000] + [2000] * 200
    req = request(lengths, 16, h200_cost)
    memo = cost_memo(h200_cost)
    L = np.asarray(lengths)
    local = memo.local_ms_array(L)
    quota = local.sum() / 16
    mins = memory_min_sizes(memo, L, req)
    assert mins[0] == 2
    sizes = balance_sizes(memo, L, mins, local, 16, quota, 1.0)
    assert sizes[0] >= 4
    assert memo.doc_on_group_ms(60000, int(sizes[0])) <= quota
    assert (sizes[1:] == 1).all()
    plan = get_balancer("dynamic_cp").plan(req)
    plan.validate(req.cluster)
    assert plan.cp_size_of_samples()[0] >= 4


def test_no_group_ever_waits_for_a_member(h200_cost):
    # distributed work of several sizes plus locals: every rank's runs follow each other
    # back to back (largest groups first, aligned blocks nest)
    rng = np.random.default_rng(3)
    lengths = [120000, 90000, 70000, 40000, 40000] + rng.integers(100, 9000, 300).tolist()
    req = request(lengths, 16, h200_cost)
    plan = get_balancer("dynamic_cp").plan(req)
    plan.validate(req.cluster)
    sim = simulate(plan, h200_cost)
    clock = [0.0] * 16
    for run in sorted(sim.runs, key=lambda r: r.start_ms):
        for r in run.ranks:
            assert run.start_ms == pytest.approx(clock[r], abs=1e-6)
            clock[r] = run.start_ms + run.duration_ms
    assert len({plan.cp_size_of_samples()[s] for s in range(5)}) >= 2


def test_beats_static_and_stays_near_the_bound_on_a_real_long_tail(h200_cost, traces_dir):
    lengths = read_lengths(traces_dir / "longdoc_leval_multiturn.txt")
    cl = ClusterSpec(16, 32768)
    ids = step_batches(lengths, 65536 * 16)[0]
    req = PlanRequest(ids, [lengths[i] for i in ids], cl, h200_cost, dataset_max_length=max(lengths))
    dyn = get_balancer("dynamic_cp").plan(req).validate(cl)
    static = get_balancer("static").plan(req).validate(cl)
    t_dyn = simulate(dyn, h200_cost).makespan_ms
    lb = lower_bound_ms(req.lengths, cl, h200_cost)
    assert t_dyn < simulate(static, h200_cost).makespan_ms / 1.2
    assert t_dyn <= 1.10 * lb


def test_keeps_the_best_simulated_candidate(h200_cost):
    lengths = [60000] + [2000] * 200
    req = request(lengths, 16, h200_cost)
    best = simulate(get_balancer("dynamic_cp").plan(req), h200_cost).makespan_ms
    for theta in (None, 1.0, 0.25):
        only = get_balancer("dynamic_cp", thetas=(theta,), simulate_within=1.0).plan(req)
        assert best <= simulate(only, h200_cost).makespan_ms * (1 + 0.003) + 1e-9


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="theta -1"):
        get_balancer("dynamic_cp", thetas=(None, -1))
    with pytest.raises(ValueError, match="at least one candidate"):
        get_balancer("dynamic_cp", thetas=())


def test_improve_max_load_lowers_the_heaviest_bin_and_keeps_every_item():
    import numpy as np

    from hf_cp.balance.toolkit.assign import improve_max_load, lpt_assign

    rng = np.random.default_rng(5)
    w = np.concatenate([rng.uniform(400, 900, 40), rng.uniform(1, 50, 200)])
    fixed = rng.uniform(0, 300, 16)  # work that cannot move (distributed samples)
    bins, loads = lpt_assign(w, 16, fixed, exact_items=len(w))
    new_bins, new_loads = improve_max_load(w, bins, loads, tolerance=0.0)
    assert new_loads.max() < loads.max()
    assert np.allclose(new_loads, fixed + np.bincount(new_bins, weights=w, minlength=16))  # nothing lost
    assert np.allclose(new_loads.sum(), loads.sum())
    again = improve_max_load(w, bins, loads, tolerance=0.0)
    assert np.array_equal(again[0], new_bins)  # deterministic
    # nothing to gain: equal items, equal bins
    eq_bins, eq_loads = improve_max_load(np.ones(8), np.repeat(np.arange(4), 2), np.full(4, 2.0))
    assert np.array_equal(eq_bins, np.repeat(np.arange(4), 2)) and np.all(eq_loads == 2.0)


def test_refinement_closes_lpt_gaps_of_coarse_steps(h200_cost, traces_dir):
    from hf_cp.samples.lengths import read_lengths

    lengths = read_lengths(traces_dir / "longdoc_leval_multiturn.txt")[:400]  # ~6 long documents per rank
    req = PlanRequest(range(len(lengths)), lengths, ClusterSpec(64, 32768), h200_cost, dataset_max_length=max(lengths))
    from hf_cp.cost.bounds import lower_bound_ms
    from hf_cp.cost.simulate import simulate

    lb = lower_bound_ms(lengths, req.cluster, h200_cost)
    coarse = simulate(get_balancer("dynamic_cp", refine_candidates=0).plan(req), h200_cost).makespan_ms
    refined = simulate(get_balancer("dynamic_cp").plan(req), h200_cost).makespan_ms
    both = simulate(get_balancer("dynamic_cp", refine_candidates=2).plan(req), h200_cost).makespan_ms
    assert both <= refined < coarse
    assert both / lb < 1.01 < coarse / lb
