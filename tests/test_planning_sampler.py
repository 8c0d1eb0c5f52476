"""GlobalBatchSampler (hf_cp/planning/sampler.py): the global batches of each step, epoch by epoch."""

from __future__ import annotations

import pytest

from hf_cp.planning import GlobalBatchSampler

from helpers.world2_job import LENGTHS


def test_sampler_is_deterministic_and_covers_each_epoch_once():
    a = GlobalBatchSampler(LENGTHS, 600, seed=3, num_epochs=2)
    b = GlobalBatchSampler(LENGTHS, 600, seed=3, num_epochs=2)
    assert len(a) == len(b) and len(a) >= 2 * (sum(LENGTHS) // 600)
    assert [a[k] for k in range(len(a))] == [b[k] for k in range(len(b))]
    for epoch in (0, 1):
        ids = [s for k in range(len(a)) if a[k].epoch == epoch for s in a[k].sample_ids]
        assert sorted(ids) == list(range(len(LENGTHS)))
    assert a.epoch_batches(0) != a.epoch_batches(1)  # reshuffled per epoch
    for k in range(len(a)):
        batch = a[k]
        assert batch.tokens <= 600 or len(batch.sample_ids) == 1
        assert batch.lengths == tuple(LENGTHS[s] for s in batch.sample_ids)


def test_sampler_unshuffled_steps_and_max_steps_across_epochs():
    s = GlobalBatchSampler(LENGTHS, 500, shuffle=False)
    assert [list(s[k].sample_ids) for k in range(len(s))] == [
        [0, 1, 2],
        [3],
        [4, 5, 6, 7, 8, 9],
        [10, 11, 12, 13, 14, 15, 16],
    ]
    m = GlobalBatchSampler(LENGTHS, 500, shuffle=False, max_steps=6)
    assert len(m) == 6 and (m[5].epoch, m[5].step_in_epoch, m[5].sample_ids) == (1, 1, (3,))
    with pytest.raises(IndexError):
        m[6]
    with pytest.raises(ValueError, match="tokens_per_step"):
        GlobalBatchSampler(LENGTHS, 0)
