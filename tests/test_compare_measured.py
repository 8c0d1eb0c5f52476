"""cp_compare_measured: the comparison balancer's plan runs on every other step, so both balancers
are measured in one run (planning/worker.py Planner.compare_runs, train/measure/metrics.py
measured_comparison_line); the steps stay exact whichever plan runs them."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from hf_cp.cost.model import CostModel
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.planning import GlobalBatchSampler, Planner
from hf_cp.train.measure.metrics import balance_lines, measured_comparison_line

from helpers.step_records import records
from helpers.world2_job import (
    BALANCE_LENGTHS,
    WORLD2_JOB_TIMEOUT,
    assert_matches_reference,
    replanned,
)

SHARED_TIMEOUT = WORLD2_JOB_TIMEOUT + 60


def _planners(in_subprocess: bool):
    """The step sampler, a planner with compare_measured (planned ahead by a forked worker when
    `in_subprocess`), and plain auto and static planners of the same steps."""
    cost = CostModel.load("tiny-llama", "h200-qwen2.5-7b")
    sampler = GlobalBatchSampler(BALANCE_LENGTHS * 3, 600, seed=3)
    cluster = ClusterSpec(2, 256)
    measured = Planner(
        sampler,
        "auto",
        cluster,
        cost,
        lookahead=2 if in_subprocess else 0,
        in_subprocess=in_subprocess,
        compare_balancer="static",
        compare_measured=True,
    )
    return (
        sampler,
        measured,
        Planner(sampler, "auto", cluster, cost, lookahead=0),
        Planner(sampler, "static", cluster, cost, lookahead=0),
    )


@pytest.mark.parametrize("in_subprocess", [False, True])
def test_odd_steps_run_the_comparison_plan_and_even_steps_the_runs_own(in_subprocess):
    sampler, measured, auto, static = _planners(in_subprocess)
    assert measured.in_subprocess == in_subprocess
    try:
        differ = 0
        for k in range(len(sampler)):
            got, a, s = measured.get(k), auto.get(k), static.get(k)
            ran, other = (s, a) if k % 2 else (a, s)
            assert got.ran_compare == bool(k % 2)
            assert got.plan.to_json() == ran.plan.to_json(), f"step {k} did not plan what it runs"
            assert got.predicted.makespan_ms == pytest.approx(ran.predicted.makespan_ms)
            assert got.compare.makespan_ms == pytest.approx(other.predicted.makespan_ms)
            differ += a.plan.digest() != s.plan.digest()
        assert differ >= 2, "the data must give auto and static different plans"
    finally:
        for p in (measured, auto, static):
            p.close()


def test_compare_measured_without_a_comparison_balancer_is_refused_by_name():
    from hf_cp.train import CPTrainingArguments

    cost = CostModel.load("tiny-llama", "h200-qwen2.5-7b")
    sampler = GlobalBatchSampler(BALANCE_LENGTHS, 600)
    with pytest.raises(ValueError, match="compare_measured .* needs a comparison balancer other than 'auto'"):
        Planner(sampler, "auto", ClusterSpec(2, 256), cost, lookahead=0, compare_balancer="auto", compare_measured=True)
    for compare in (None, "auto"):
        with pytest.raises(ValueError, match="cp_compare_measured .* set cp_compare_balancer to a balancer other"):
            CPTrainingArguments(
                output_dir="unused", use_cpu=True, cp_compare_balancer=compare, cp_compare_measured=True
            )


def _alternating(own_ms, compare_ms, own_pred=100.0, compare_pred=110.0):
    """Records of a run whose steps alternate: the even ones measured `own_ms` in turn, the odd
    ones `compare_ms`; every step predicted at own_pred for the run's balancer and
    compare_pred for the other."""
    own, theirs = iter(own_ms), iter(compare_ms)
    out = []
    for k, r in enumerate(records(2, steps=len(own_ms) + len(compare_ms))):
        ran = k % 2 == 1
        out.append(
            dataclasses.replace(
                r,
                step_wall_ms=next(theirs) if ran else next(own),
                predicted_step_ms=compare_pred if ran else own_pred,
                compare_step_ms=own_pred if ran else compare_pred,
                compare_balancer="auto" if ran else "static",
                balancer="static" if ran else "auto:dynamic_cp",
                ran_compare=ran,
            )
        )
    return out


def test_the_summary_compares_the_measured_steps_after_the_first_on_equal_work():
    # step 0 (own, 900 ms: start-up) is left out. Own steps 2, 4: 200 + 220 ms, predicted 100 each
    # (2.1x). Compare steps 1, 3, 5: 260 + 250 + 300 ms where auto was predicted 100 each (2.7x)
    recs = _alternating([900.0, 200.0, 220.0], [260.0, 250.0, 300.0])
    line = measured_comparison_line(recs, "auto", "static")
    assert "auto 420 ms over 2 step(s) it was predicted to take 200 ms (2.100x)" in line, line
    assert "static 810 ms over 3 step(s) auto was predicted to take 300 ms (2.700x)" in line, line
    assert f"static / auto {2.7 / 2.1:.3f}x measured on equal work, 1.100x predicted on the same steps" in line
    lines = balance_lines(recs, "auto", "static")
    assert line in lines and not any("predicted only" in x for x in lines)
    # the balance line is of the run's own balancer's steps only
    own_only = balance_lines([r for r in recs if not r.ran_compare], "auto")
    assert lines[:2] == own_only[:2]
    # no comparison balancer named: the one the odd steps ran
    assert "static 810 ms" in measured_comparison_line(recs, "auto", "")


def test_steps_of_different_sizes_are_compared_per_predicted_ms():
    """An epoch's last step holds a few samples: where it falls to the comparison balancer, its
    raw time would make that balancer look faster. Here both run at exactly their predictions'
    pace (1.0x), whatever the step's size: the measured ratio is 1.000x."""
    recs = _alternating([900.0, 100.0, 100.0], [10.0, 100.0, 10.0], own_pred=100.0, compare_pred=100.0)
    for r in recs:  # the compare steps 1 and 5 are small: auto was predicted 10 ms on them
        if r.ran_compare and r.step_wall_ms == 10.0:
            r.compare_step_ms = r.predicted_step_ms = 10.0
    line = measured_comparison_line(recs, "auto", "static")
    assert "static / auto 1.000x measured on equal work, 1.000x predicted" in line, line


def test_too_few_steps_to_compare_say_so():
    line = measured_comparison_line(_alternating([900.0], [260.0]), "auto", "static")
    assert re.search(r"too few steps to compare auto and static after the first \(0 and 1\)", line), line
    # one step of each after the first, each planned with its own cost model: nothing to pair
    recs = [dataclasses.replace(r, calibration=k // 2) for k, r in enumerate(_alternating([900.0, 200.0], [260.0]))]
    line = measured_comparison_line(recs, "auto", "static")
    assert "after the first (1 and 1, planned with different cost models)" in line, line


@pytest.mark.timeout(SHARED_TIMEOUT)
def test_two_processes_alternating_balancers_equal_single_process(world2_job):
    """World 2 under ZeRO-2: step 0 runs auto's plan, step 1 static's (the short samples over
    both ranks, where auto keeps each on one rank); every step equals single-process training."""
    spec = world2_job["compare-measured"]
    assert_matches_reference(spec)
    history = json.loads((Path(spec["out"]) / "history.json").read_text())
    auto, static = replanned(spec), replanned(dict(spec, balancer="static"))
    assert [r["plan_digest"] for r in history] == [auto[0].digest(), static[1].digest()]
    assert auto[1].digest() != static[1].digest()
    assert [r["ran_compare"] for r in history] == [False, True]
    assert [r["compare_balancer"] for r in history] == ["static", "auto"]
    assert history[1]["balancer"] == "static" and history[0]["balancer"].startswith("auto")
    assert history[1]["cp_size_samples"] == {"2": 6} and "1" in history[0]["cp_size_samples"]


def test_a_step_planned_with_a_cost_model_only_one_side_ran_under_is_left_out():
    """cp_calibrate_scale_after: 1 recalibrates after step 1, so step 2 (index 1, static's) is the
    only one planned with the profile as given, whose predictions are 2x too long: its measured
    time over auto's 2x-long prediction would make static look faster than it runs."""
    recs = _alternating([900.0, 200.0, 220.0], [260.0, 250.0, 300.0])
    # step index 1 (static's first) planned with cost version 0 and predicted 2x; the rest with version 1
    recs = [
        dataclasses.replace(r, calibration=0 if k < 2 else 1, compare_step_ms=200.0 if k == 1 else r.compare_step_ms)
        for k, r in enumerate(recs)
    ]
    line = measured_comparison_line(recs, "auto", "static")
    assert "(1 step(s) planned with a cost model only one side's steps had left out)" in line, line
    # static's steps 3, 5: 250 + 300 ms where auto was predicted 100 each; auto's 2, 4 as before
    assert "static 550 ms over 2 step(s) auto was predicted to take 200 ms (2.750x)" in line, line
    assert f"static / auto {2.75 / 2.1:.3f}x measured on equal work" in line, line
    # every step planned by one model: nothing is left out
    same = [dataclasses.replace(r, calibration=1) for r in recs]
    assert "left out" not in measured_comparison_line(same, "auto", "static")
