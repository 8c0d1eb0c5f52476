"""CPTrainer on 2 gloo processes under plain DDP (torchrun, no DeepSpeed), against a reference
built from torch and transformers alone (one sample at a time, SDPA, summed token losses over
the batch's valid targets)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.harness.reference import sample_loss_sum, sample_valid_targets
from helpers.masked_training import max_relative_error, run_processes, tiny_llama


def reference(rows):
    model = tiny_llama(0, attn="sdpa")
    model.train()
    valid = sum(sample_valid_targets(r) for r in rows)
    total = sum(sample_loss_sum(model, r) for r in rows) / valid
    total.backward()
    return float(total.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


# slow (a DDP job of its own, ~20 s): the fast suite trains under DDP in the world-2 job's lora-ddp run
@pytest.mark.slow
def test_chunked_sample_in_the_last_wave_trains_exactly_under_ddp(tmp_path):
    """Rank 0 runs a 60-token sample as 4 dependent chunks keeping 2 in the step's only wave,
    rank 1 one pack of the rest. The chunked sample's backwards run under one wave context:
    when they held the accumulation boundary, DDP reduced in each of rank 0's 4 backwards
    against one on rank 1, and the step hung. The boundary now falls on a padding micro-batch."""
    rng = np.random.default_rng(3)
    rows = []
    for n in (60, 10, 12, 9, 14, 8):
        ids = rng.integers(0, 256, n).tolist()
        rows.append({"input_ids": ids, "labels": [-100 if rng.random() < 0.2 else x for x in ids]})
    ref_loss, ref_grads = reference(rows)
    got = run_processes(dict(rows=rows, out=str(tmp_path / "ddp"), cap=64, balancer="chunks_4_keep_2"), 2, 180)
    rec = got["history"][0]
    assert rec["waves"] == 1 and rec["chunked"]["samples"] == 1 and rec["chunked"]["chunks"] == 4
    assert rec["rank_tokens"] == [60, 53]
    assert got["loss"] == pytest.approx(ref_loss, rel=1e-6)
    assert max_relative_error(got["grads"], ref_grads) < 1e-5
    assert all(torch.isfinite(g).all() for g in got["grads"].values())
