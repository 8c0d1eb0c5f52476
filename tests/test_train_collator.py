"""PlanCollator (hf_cp/train/data/collator.py): each rank's micro-batches of a step plan, in context.py's
layout, and the next-token targets."""

from __future__ import annotations

import numpy as np
import pytest

from hf_cp.attention.context import CPContext
from hf_cp.cost.model import CostModel
from hf_cp.modes.segments import WHOLE_DOCUMENT_MODES, ShardMode
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import Group, StepPlan, Wave
from hf_cp.planning import GlobalBatchSampler, Planner
from hf_cp.train.data.collator import IGNORE_INDEX, PlanCollator, shifted_targets, valid_targets

from helpers.harness.balancers import FixedModeBalancer
from helpers.harness.models import synthetic_rows
from helpers.world2_job import LENGTHS


def test_shifted_targets_mask_prompt_and_document_end():
    ids = [10, 11, 12, 13, 14]
    labels = [IGNORE_INDEX, IGNORE_INDEX, 12, 13, 14]
    assert shifted_targets(ids, None).tolist() == [11, 12, 13, 14, IGNORE_INDEX]
    assert shifted_targets(ids, labels).tolist() == [IGNORE_INDEX, 12, 13, 14, IGNORE_INDEX]
    assert valid_targets(ids, None) == 4 and valid_targets(ids, labels) == 3


@pytest.mark.parametrize("mode", WHOLE_DOCUMENT_MODES)
@pytest.mark.parametrize("size", [2, 4])
def test_collator_shards_cover_documents_exactly_once(mode, size):
    rows = synthetic_rows([37, 5, 64, 11], seed=1)
    fetch = lambda s: (rows[s]["input_ids"], rows[s]["labels"])
    plan = StepPlan(
        world_size=size,
        max_tokens_per_rank=1000,
        sample_ids=[0, 1, 2, 3],
        lengths=[37, 5, 64, 11],
        waves=[Wave([Group(ranks=tuple(range(size)), distributed=[0, 2], mode=mode, local={size - 1: [3], 0: [1]})])],
    )
    plan.validate(ClusterSpec(size, 1000))
    col = PlanCollator(fetch)
    seen = {s: np.zeros(len(rows[s]["input_ids"]), dtype=int) for s in (0, 2)}
    for r in range(size):
        step = col.rank_step(plan, r, global_valid_tokens=1)
        (mb,) = step.waves
        ctx = mb.context
        assert isinstance(ctx, CPContext) and ctx.member == r and ctx.group_ranks == tuple(range(size))
        assert ctx.distributed_lengths == (37, 64) and ctx.mode == mode
        ids, tgt, pos = mb.input_ids[0].numpy(), mb.shift_labels[0].numpy(), mb.position_ids[0].numpy()
        assert mb.cu_seq_lens[-1] == len(ids) == len(tgt) == len(pos)
        off = 0
        for s in plan.waves[0].groups[0].local.get(r, []):  # local documents first, whole
            n = len(rows[s]["input_ids"])
            assert ids[off : off + n].tolist() == rows[s]["input_ids"]
            assert tgt[off : off + n].tolist() == shifted_targets(rows[s]["input_ids"], rows[s]["labels"]).tolist()
            assert pos[off : off + n].tolist() == list(range(n))
            off += n
        assert ctx.local_lengths == tuple(len(rows[s]["input_ids"]) for s in plan.waves[0].groups[0].local.get(r, []))
        for seg in ctx.segments():  # then this member's segments, in rank_segments order
            sid = [0, 2][seg.doc]
            full_t = shifted_targets(rows[sid]["input_ids"], rows[sid]["labels"])
            sl = slice(seg.start, seg.start + seg.length)
            assert ids[off : off + seg.length].tolist() == rows[sid]["input_ids"][sl]
            assert tgt[off : off + seg.length].tolist() == full_t[sl].tolist()
            assert pos[off : off + seg.length].tolist() == list(range(seg.start, seg.start + seg.length))
            seen[sid][sl] += 1
            off += seg.length
        assert off == len(ids)
    for sid, count in seen.items():
        assert count.tolist() == [1] * len(count), f"sample {sid} not covered exactly once"


def test_rank_without_work_gets_none_and_trained_ids_partition_the_batch():
    rows = synthetic_rows(LENGTHS)
    fetch = lambda s: (rows[s]["input_ids"], rows[s]["labels"])
    cost = CostModel.load("tiny-llama", "h200-qwen2.5-7b")
    sampler = GlobalBatchSampler(LENGTHS, 500, shuffle=False)
    for bal in ("static", FixedModeBalancer("ring_zigzag")):
        planner = Planner(sampler, bal, ClusterSpec(2, 256), cost, lookahead=0)
        col = PlanCollator(fetch)
        idle_waves = 0
        for k in range(len(sampler)):
            plan = planner.get(k).plan
            steps = [col.rank_step(plan, r, 1) for r in range(2)]
            assert all(len(s.waves) == len(plan.waves) for s in steps)
            idle_waves += sum(mb is None for s in steps for mb in s.waves)
            ids = sorted(i for s in steps for i in s.trained_sample_ids)
            assert ids == sorted(plan.sample_ids)
        assert idle_waves > 0


def test_member_with_an_empty_shard_runs_one_ignored_padding_token():
    plan = StepPlan(
        world_size=4,
        max_tokens_per_rank=64,
        sample_ids=[0, 1],
        lengths=[3, 2],
        waves=[Wave([Group(ranks=(0, 1, 2, 3), distributed=[0, 1], mode=ShardMode.RING_PER_DOC)])],
    )
    plan.validate(ClusterSpec(4, 64))
    rows = {0: ([5, 6, 7], None), 1: ([8, 9], None)}
    collate = PlanCollator(lambda sid: rows[sid])
    mb = collate.micro_batch(plan, 0, plan.waves[0].groups[0], 3)  # 8 parts per document: rank 3 holds none
    assert mb.context.segments() == []
    assert mb.input_ids.shape == (1, 1) and mb.shift_labels.tolist() == [[IGNORE_INDEX]]
    assert mb.context.local_lengths == (1,) and mb.local_ids == []
    full = collate.micro_batch(plan, 0, plan.waves[0].groups[0], 0)
    assert full.context.local_lengths == () and full.num_tokens == 2  # members with tokens get no padding
