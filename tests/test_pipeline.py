"""The 1F1B pipeline bubble of variable micro-batches (hf_cp/pipeline.py)."""

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_cp.cost.pipeline import bubble_share, one_f_one_b_order, simulate_1f1b


def F(*xs):
    return [Fraction(x) for x in xs]


def test_the_issue_numbers_exactly():
    # ChunkFlow's example: 4 micro-batches of relative lengths 3, 1, 1, 1 on 4 stages: 57.14%
    run = simulate_1f1b(F(3, 1, 1, 1), 4)
    assert run.makespan == 42 and run.work == 72
    assert run.bubble == Fraction(4, 7)
    assert bubble_share(F(1, 1, 1, 1), 4) == Fraction(3, 7)


@pytest.mark.parametrize("stages, micro_batches", [(1, 1), (1, 5), (2, 1), (2, 8), (4, 4), (4, 9), (8, 3), (8, 16)])
def test_equal_micro_batches_give_the_textbook_bubble(stages, micro_batches):
    # 1F1B with equal micro-batches idles (P-1)/(M+P-1) of the time: P-1 fill and drain steps
    assert bubble_share(F(*[2] * micro_batches), stages) == Fraction(stages - 1, micro_batches + stages - 1)


def test_1f1b_order_per_stage():
    assert one_f_one_b_order(4, 4, 0) == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("F", 3),
        ("B", 0),
        ("B", 1),
        ("B", 2),
        ("B", 3),
    ]
    assert one_f_one_b_order(4, 4, 3) == [
        ("F", 0),
        ("B", 0),
        ("F", 1),
        ("B", 1),
        ("F", 2),
        ("B", 2),
        ("F", 3),
        ("B", 3),
    ]
    assert one_f_one_b_order(4, 6, 2)[:4] == [("F", 0), ("F", 1), ("B", 0), ("F", 2)]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=12), st.integers(1, 8))
def test_schedule_respects_every_dependency_and_never_overlaps(costs, stages):
    run = simulate_1f1b(F(*costs), stages)
    ends = {}
    for s, ops in enumerate(run.ops):
        assert [(k, m) for k, m, _, _ in ops] == one_f_one_b_order(stages, len(costs), s)
        for (_, _, _, e0), (_, _, s1, _) in zip(ops, ops[1:]):
            assert s1 >= e0, "a stage runs one operation at a time"
        for k, m, start, end in ops:
            assert end - start == costs[m] * (1 if k == "F" else 2)
            ends[(k, m, s)] = (start, end)
    for (k, m, s), (start, _) in ends.items():
        if k == "F" and s > 0:
            assert start >= ends[("F", m, s - 1)][1]
        if k == "B":
            assert start >= ends[("F", m, s)][1]
            if s < stages - 1:
                assert start >= ends[("B", m, s + 1)][1]
    assert run.makespan >= 3 * sum(costs)  # a stage's own work
    assert 0 <= run.bubble < 1


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="micro-batch 1 has cost 0"):
        simulate_1f1b([1, 0], 2)
    with pytest.raises(ValueError, match="stages must be positive"):
        simulate_1f1b([1], 0)
    with pytest.raises(ValueError, match="no micro-batches"):
        simulate_1f1b([], 2)
