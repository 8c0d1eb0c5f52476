"""A shard mode registered at run time, with no ShardMode member (hf_cp/modes/segments.py: plans
store a mode by its registered name), runs through the collator, the plan pricer and replay like
the mode it copies: they ask its spec (ring_split, splits_heads, carries_layout), never its name."""

from __future__ import annotations

import pytest

from hf_cp.balance.toolkit.pricing import PlanPricer
from hf_cp.cost.model import CostModel
from hf_cp.cost.simulate import simulate
from hf_cp.modes import mode_names, mode_spec, register_mode, unregister_mode
from hf_cp.modes.segments import ShardMode
from hf_cp.plan.block_layout import per_doc_layout
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import Group, PlanError, StepPlan, Wave
from hf_cp.profiling.replay import rank_micro_batches
from hf_cp.train.data.collator import PlanCollator

from helpers.harness.models import synthetic_rows

LENGTHS = [37, 5, 64, 11]
SIZE = 4
HEADS = 4


@pytest.fixture(params=[ShardMode.ULYSSES, ShardMode.RING_PER_DOC, ShardMode.RING_ZIGZAG, ShardMode.BLOCKS])
def copied_mode(request):
    """(original mode name, name of a copy of its spec registered for this test only)."""
    original = mode_spec(request.param)
    name = f"test_copy_of_{original.name}"
    assert name not in {m.value for m in ShardMode}
    copy_cls = type(f"CopyOf{type(original).__name__}", (type(original),), {"name": name})
    register_mode(copy_cls())
    try:
        yield original.name, name
    finally:
        unregister_mode(name)
    assert name not in mode_names()


def _plan(mode: str) -> StepPlan:
    layout = per_doc_layout([LENGTHS[0], LENGTHS[2]], SIZE, HEADS) if mode_spec(mode).carries_layout else None
    group = Group(ranks=tuple(range(SIZE)), distributed=[0, 2], mode=mode, local={SIZE - 1: [3], 0: [1]}, blocks=layout)
    plan = StepPlan(
        world_size=SIZE, max_tokens_per_rank=1000, sample_ids=[0, 1, 2, 3], lengths=LENGTHS, waves=[Wave([group])]
    )
    plan.validate(ClusterSpec(SIZE, 1000))
    return plan


def _collator() -> PlanCollator:
    rows = synthetic_rows(LENGTHS, seed=3)
    return PlanCollator(lambda s: (rows[s]["input_ids"], rows[s]["labels"]))


def test_registered_mode_collates_like_the_mode_it_copies(copied_mode):
    original, copy = copied_mode
    ref_plan, new_plan = _plan(original), _plan(copy)
    assert new_plan.waves[0].groups[0].mode == copy
    col = _collator()
    for r in range(SIZE):
        (ref,) = col.rank_step(ref_plan, r, global_valid_tokens=1).waves
        (new,) = col.rank_step(new_plan, r, global_valid_tokens=1).waves
        assert new.context.mode == copy and new.context.member == r
        assert new.input_ids.tolist() == ref.input_ids.tolist(), f"rank {r}: input ids"
        assert new.position_ids.tolist() == ref.position_ids.tolist(), f"rank {r}: positions"
        assert new.shift_labels.tolist() == ref.shift_labels.tolist(), f"rank {r}: labels"
        assert new.cu_seq_lens.tolist() == ref.cu_seq_lens.tolist(), f"rank {r}: pieces"
        assert new.context.segments() == ref.context.segments(), f"rank {r}: segments"
        assert (new.context.blocks is None) == (ref.context.blocks is None)
        assert new.local_ids == ref.local_ids and new.distributed_ids == ref.distributed_ids


def test_registered_mode_is_priced_like_the_mode_it_copies(copied_mode, h200_cost, monkeypatch):
    # the pricer's vectorised tables serve a copy of a ring mode (its spec's ring_split), not
    # only the names of the built-in ones; every other copy goes through the cost model
    original, copy = copied_mode
    ref_plan, new_plan = _plan(original), _plan(copy)
    ref = PlanPricer(CostModel(h200_cost.dims, h200_cost.profile))
    ref_clock = ref.rank_finish_ms(ref_plan)
    cost = CostModel(h200_cost.dims, h200_cost.profile)
    expected = simulate(new_plan, cost).makespan_ms
    if mode_spec(original).ring_split:

        def through_the_cost_model(*args, **kwargs):
            raise AssertionError(f"mode {copy!r} was priced through the cost model, not the pricer's ring tables")

        monkeypatch.setattr(cost, "distributed_rank_cost", through_the_cost_model)
        monkeypatch.setattr(cost, "distributed_rank_costs", through_the_cost_model)
    new = PlanPricer(cost)
    assert new.rank_finish_ms(new_plan).tolist() == ref_clock.tolist()
    assert new.makespan_ms(new_plan) == pytest.approx(expected, rel=1e-12)
    if mode_spec(original).ring_split:
        dist = [LENGTHS[0], LENGTHS[2]]
        for a, b in zip(
            new.distributed_member_times(dist, copy, range(SIZE)),
            ref.distributed_member_times(dist, original, range(SIZE)),
        ):
            assert a.tolist() == b.tolist()


def test_registered_mode_replays_like_the_mode_it_copies_or_is_refused_by_name(copied_mode):
    original, copy = copied_mode
    ref_plan, new_plan = _plan(original), _plan(copy)
    if mode_spec(copy).carries_layout:  # compute blocks run at their executors: not replayed
        for mode, plan in ((original, ref_plan), (copy, new_plan)):
            with pytest.raises(
                PlanError, match=rf"shard mode '{mode}', whose compute blocks are the plan's block layout"
            ):
                rank_micro_batches(plan, 0)
        return
    for r in range(SIZE):
        assert rank_micro_batches(new_plan, r) == rank_micro_batches(ref_plan, r), f"rank {r}"
    if mode_spec(copy).splits_heads:  # the copy of Ulysses runs its documents on a share of the heads
        assert all(
            w.head_split_ways == SIZE for r in range(SIZE) for w in rank_micro_batches(new_plan, r) if w.head_split_docs
        )
        assert any(w.head_split_docs for w in rank_micro_batches(new_plan, 1))


def test_unknown_mode_names_itself_and_the_registered_modes():
    with pytest.raises(PlanError, match=r"unknown shard mode 'no_such_mode'; registered modes: .*ring_per_doc"):
        Group(ranks=(0, 1), distributed=[0], mode="no_such_mode")
    with pytest.raises(PlanError, match="no_such_mode"):
        Group.from_dict({"ranks": [0, 1], "distributed": [0], "mode": "no_such_mode"})


def test_mode_unregistered_after_planning_fails_clearly_in_the_collator():
    register_mode(type("Transient", (type(mode_spec(ShardMode.RING_PER_DOC)),), {"name": "test_transient"})())
    try:
        plan = _plan("test_transient")
    finally:
        unregister_mode("test_transient")
    with pytest.raises(ValueError, match=r"unknown shard mode 'test_transient'; registered modes: .*ring_per_doc"):
        _collator().rank_step(plan, 0, global_valid_tokens=1)
    with pytest.raises(ValueError, match="test_transient"):
        unregister_mode("test_transient")
