"""Streaming training data (issue 27): the stream sampler (planning/stream_sampler.py), the
planner fed a stream's batches as they are read (forked worker included), and CPTrainer on a
streaming datasets.IterableDataset (train/data/streaming.py): the same steps and losses as the rows
materialised, a bounded look-ahead buffer, a clean stop at the stream's end, exact resume from a
checkpoint's stream position, and errors that name the stream sample."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from hf_cp.cost.model import CostModel
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.planning import Planner
from hf_cp.planning.stream_sampler import (
    EMPTY_DIGEST,
    StreamBatchSampler,
    StreamEnded,
    StreamSample,
    buffer_bound,
    chain_digest,
)
from hf_cp.samples.lengths import step_batches

from helpers.harness.models import synthetic_rows
from helpers.world2_job import LENGTHS

# long-tailed, with samples longer than a step (each its own step) and exact fits
STREAM_LENGTHS = [int(n) for n in np.random.default_rng(7).integers(1, 700, size=120)] + [500, 500, 1, 999]


def _sampler(lengths, tokens=500, steps=10_000, start_index=0, start=None):
    samples = (StreamSample(n, payload=i) for i, n in enumerate(lengths[start_index:], start_index))
    kw = {"start": start} if start is not None else {}
    return StreamBatchSampler(tokens, steps, samples=samples, **kw)


def _all_batches(sampler):
    out, k = [], 0
    while True:
        try:
            out.append(list(sampler[k].sample_ids))
        except StreamEnded:
            return out
        k += 1


# ------------------------------------------------------------------------------ the sampler
def test_stream_steps_are_cut_by_the_rule_of_step_batches():
    sampler = _sampler(STREAM_LENGTHS)
    got = _all_batches(sampler)
    assert got == step_batches(STREAM_LENGTHS, 500, shuffle=False)
    assert sampler.last_step == len(got) - 1
    assert sampler[3].lengths == tuple(STREAM_LENGTHS[s] for s in got[3])
    with pytest.raises(StreamEnded, match=f"ended with step {len(got) - 1}"):
        sampler[len(got) + 2]
    # max_steps cuts the run short, reading no further than needed
    short = _sampler(STREAM_LENGTHS, steps=3)
    assert len(short) == 3 and [list(short[k].sample_ids) for k in range(3)] == got[:3]
    assert short.samples_read == len(got[0]) + len(got[1]) + len(got[2]) + 1  # + the sample that closed step 3
    with pytest.raises(IndexError):
        short[3]


def test_released_steps_drop_their_samples_and_positions_resume_the_same_steps():
    full = _sampler(STREAM_LENGTHS)
    batches = _all_batches(full)
    positions = {}
    walk = _sampler(STREAM_LENGTHS)
    for k in range(len(batches)):
        walk.release(k)
        walk[k]
        positions[k] = walk.position(k)
        held = set(walk._samples)
        assert held == set(batches[k]) | ({batches[k + 1][0]} if k + 1 < len(batches) else set())
        with pytest.raises(KeyError, match="not held"):
            walk.sample(batches[k][0] - 1) if batches[k][0] else walk.sample(10**9)
    for k in (1, 5, len(batches) - 1):
        pos = positions[k]
        assert pos.sample == batches[k][0]
        assert pos.digest == chain_digest(EMPTY_DIGEST, STREAM_LENGTHS[: pos.sample])
        resumed = _sampler(STREAM_LENGTHS, start_index=pos.sample, start=pos)
        with pytest.raises(IndexError, match="released"):
            resumed[k - 1]
        assert [list(resumed[j].sample_ids) for j in range(k, len(batches))] == batches[k:]
        assert resumed.position(len(batches)) == walk.position(len(batches))  # the same chain at the end


@pytest.mark.parametrize("in_subprocess", [False, True], ids=["thread", "forked-worker"])
def test_planner_plans_stream_steps_read_after_its_worker_started(in_subprocess):
    """The forked worker never sees the stream: each step's batch (and its samples' masks) comes
    with the request. Plans equal inline planning; the buffer holds lookahead + 1 steps and one
    sample at most; a sample too long for any group is named by its stream index."""
    cluster, cost = ClusterSpec(4, 256), CostModel.load("tiny-llama", "h200-qwen2.5-7b")
    lengths = [n for n in STREAM_LENGTHS if n <= 1024][:60]
    inline = Planner(_sampler(lengths, steps=12), "usp", cluster, cost, seed=3, lookahead=0)
    expected = [inline.get(k).plan.digest() for k in range(12)]
    sampler = _sampler(lengths, steps=12)
    ahead = Planner(sampler, "usp", cluster, cost, seed=3, lookahead=2, in_subprocess=in_subprocess)
    try:
        ahead.start()  # the worker forks now, before any sample is read
        assert sampler.samples_read == 0
        got = []
        for k in range(12):
            ps = ahead.get(k)
            got.append(ps.plan.digest())
            bound = buffer_bound(2, 500, ahead.max_sample_tokens)
            assert sampler.held_samples <= sum(len(sampler[j].sample_ids) for j in range(k, min(k + 3, 12))) + 1
            assert sampler.held_samples <= bound.samples and sampler.held_tokens <= bound.tokens
        assert ahead.in_subprocess == in_subprocess
    finally:
        ahead.close()
    assert got == expected
    too_long = Planner(_sampler([10, 20, 2000, 5]), "usp", cluster, cost, lookahead=0)
    with pytest.raises(ValueError, match="stream sample 2 has 2000 tokens"):
        too_long.get(1)


# ------------------------------------------------------------------------------ rows
@pytest.mark.parametrize(
    "row, message",
    [
        ({"input_ids": []}, r"train_dataset stream sample 5 has no tokens \(empty input_ids\)"),
        ({"text": "hi"}, r"train_dataset stream sample 5 has no 'input_ids'"),
        ({"input_ids": [1, 2], "labels": [1.5, 2]}, r"stream sample 5, column 'labels': expected integers .* 1\.5"),
        ({"input_ids": [1, "7"]}, r"stream sample 5, column 'input_ids': expected integers .* '7' at position 1"),
        ({"input_ids": [1.0, 2.0]}, r"stream sample 5, column 'input_ids'.*even when integral"),
        ({"input_ids": [1, 2, 3], "labels": [1, 2]}, r"stream sample 5 has 3 input_ids but 2 labels"),
        ({"input_ids": [1, 2, 3], "length": 4}, r"stream sample 5 has length column 4 but 3 input_ids"),
        ({"input_ids": [1, 2, 3], "seq_lengths": [1, 2]}, r"stream sample 5 is a pre-packed row of 2 documents"),
        ({"input_ids": [1, 2, 3], "attn_mask": "{"}, r"sample 5 of the train_dataset stream: column 'attn_mask'"),
    ],
)
def test_bad_rows_are_named_by_their_stream_index(row, message):
    from hf_cp.train.data.streaming import stream_sample

    with pytest.raises(ValueError, match=message):
        stream_sample(row, 5)
    ok = stream_sample({"input_ids": np.arange(4), "labels": [-100, 1, 2, 3], "seq_lengths": [4]}, 0)
    assert ok.length == 4 and ok.payload[2] == 3 and ok.mask is None


# ------------------------------------------------------------------------------ the trainer
def _args(out, steps, **kw):
    from hf_cp.train import CPTrainingArguments

    settings = dict(
        output_dir=str(out),
        use_cpu=True,
        seed=42,
        cp_balancer="static",
        cp_max_tokens_per_rank=256,
        cp_tokens_per_step=500,
        cp_shuffle=False,
        max_steps=steps,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        report_to="none",
        save_strategy="steps",
        save_steps=2,
        disable_tqdm=True,
        logging_steps=1,
        cp_compare_balancer=None,
    )
    settings.update(kw)
    return CPTrainingArguments(**settings)


def _train(rows, out, steps, stream=True, resume=None, **kw):
    from datasets import Dataset

    from hf_cp.train import CPTrainer

    from helpers.harness.models import tiny_model

    ds = Dataset.from_list(rows)
    train = ds.to_iterable_dataset() if stream else ds
    trainer = CPTrainer(model=tiny_model(0), args=_args(out, steps, **kw), train_dataset=train)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _steps(trainer):
    """(step, its sample ids) of every step the trainer's output_dir history holds."""
    lines = (Path(trainer.args.output_dir) / "cp_history" / "rank0.jsonl").read_text().splitlines()
    return [(rec["index"], sorted(rec["trained_sample_ids"])) for rec in map(json.loads, lines)]


def _masked_rows():
    from hf_cp.samples.mask_column import encode_mask
    from hf_cp.samples.masks import SampleMask

    rows = synthetic_rows(LENGTHS)
    for r in rows:
        r["attn_mask"] = None
    rows[1]["attn_mask"] = encode_mask(SampleMask.shared_prompt(50, [50, 50]))  # sample 1: 150 tokens
    return rows


def test_a_stream_trains_the_steps_and_losses_of_its_rows_materialised_and_stops_at_its_end(tmp_path, caplog):
    """17 samples, 4 steps of 500 tokens, max_steps 10: the stream stops after step 4 (a warning
    says so, the checkpoint is saved), every sample once; steps and losses are those of the same
    rows as a map-style dataset (masks included); resuming its last checkpoint trains nothing."""
    rows = _masked_rows()
    with caplog.at_level(logging.WARNING):
        streamed = _train(rows, tmp_path / "stream", 10)
    text = caplog.text
    assert "train_dataset is a stream (IterableDataset)" in text and "at most 3 step(s) of samples" in text
    assert "the stream ended after 17 samples, in step 4 of max_steps 10" in text
    assert streamed.state.global_step == 4
    materialised = _train(rows, tmp_path / "map", 4, stream=False)
    assert [r.index for r in streamed.cp_history] == [0, 1, 2, 3]
    assert _steps(streamed) == _steps(materialised)
    assert [r.loss for r in streamed.cp_history] == pytest.approx([r.loss for r in materialised.cp_history], rel=1e-6)
    trained = sorted(s for _, ids in _steps(streamed) for s in ids)
    assert trained == list(range(len(LENGTHS))), "every sample of the stream exactly once"
    assert all(r.data_epoch is None and r.dataset_samples is None for r in streamed.cp_history)
    sm = streamed.cp_sampler
    bound = buffer_bound(2, 500, 256)
    assert 0 < sm.peak_samples <= bound.samples and 0 < sm.peak_tokens <= bound.tokens
    schedule = json.loads((tmp_path / "stream" / "checkpoint-4" / "hf_cp_schedule.json").read_text())
    assert schedule["stream"] == {"step": 4, "sample": 17, "lengths_sha256": chain_digest(EMPTY_DIGEST, LENGTHS)}
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = _train(rows, tmp_path / "stream", 10, resume=str(tmp_path / "stream" / "checkpoint-4"))
    assert "nothing left to train" in caplog.text and again.state.global_step == 4 and not again.cp_history


def test_resume_from_a_checkpoint_continues_the_stream_exactly(tmp_path):
    """An uninterrupted run of 6 steps against one resumed from its checkpoint at step 3: the same
    samples per step and the same losses; a stream whose trained part changed is refused."""
    from hf_cp.train.checkpoint.schedule import ScheduleChangedError

    rows = synthetic_rows(LENGTHS + LENGTHS[::-1], seed=3)
    full = _train(rows, tmp_path / "full", 6, save_steps=3)
    ckpt = tmp_path / "full" / "checkpoint-3"
    resumed = _train(rows, tmp_path / "resumed", 6, resume=str(ckpt), save_steps=3)
    assert [r.index for r in resumed.cp_history] == [3, 4, 5]
    assert _steps(resumed) == _steps(full)[3:]
    assert [r.loss for r in resumed.cp_history] == pytest.approx([r.loss for r in full.cp_history[3:]], rel=1e-6)
    position = json.loads((ckpt / "hf_cp_schedule.json").read_text())["stream"]
    assert position["step"] == 3 and position["sample"] == min(_steps(full)[3][1])
    trained = sorted(s for _, ids in _steps(full)[:3] + _steps(resumed) for s in ids)
    assert trained == list(range(len(trained))), "every sample read once, none skipped or repeated"
    changed = list(rows)
    first = rows[0]
    changed[0] = dict(first, input_ids=first["input_ids"][:-1], labels=first["labels"][:-1], length=first["length"] - 1)
    with pytest.raises(ScheduleChangedError, match="another stream .*lengths of its first"):
        _train(changed, tmp_path / "changed", 6, resume=str(ckpt))
    with pytest.raises(ScheduleChangedError, match="samples in the training set: 'stream' in the checkpoint"):
        _train(rows, tmp_path / "map", 6, stream=False, resume=str(ckpt))


def test_a_stream_is_refused_without_max_steps_or_with_cp_shuffle_and_a_bad_row_is_named(tmp_path):
    from datasets import Dataset, IterableDataset

    from hf_cp.train import CPTrainer

    from helpers.harness.models import tiny_model

    stream = Dataset.from_list([{"input_ids": [1, 2, 3]}] * 4).to_iterable_dataset()
    with pytest.raises(ValueError, match=r"streaming IterableDataset, which has no length: set max_steps"):
        CPTrainer(model=tiny_model(0), args=_args(tmp_path, -1), train_dataset=stream)
    with pytest.raises(ValueError, match=r"streaming IterableDataset: cp_shuffle=True .* set cp_shuffle=False"):
        CPTrainer(model=tiny_model(0), args=_args(tmp_path, 3, cp_shuffle=True), train_dataset=stream)
    rows = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}] * 9
    rows[3] = {"input_ids": [1, 2, 3], "labels": [1, 2.5, 3]}  # a generator's rows keep their own types
    bad = IterableDataset.from_generator(lambda: iter(rows))
    trainer = CPTrainer(model=tiny_model(0), args=_args(tmp_path, 5, cp_tokens_per_step=6), train_dataset=bad)
    with pytest.raises(ValueError, match=r"train_dataset stream sample 3, column 'labels'.*got 2\.5 at position 1"):
        trainer.train()


# ------------------------------------------------------------------------------ world 2
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_processes_resume_a_stream_like_an_uninterrupted_run(tmp_path):
    """Two gloo ranks under ZeRO-2 read the same stream: an uninterrupted run and one resumed
    from its step-2 checkpoint train the same samples, equal to the single-process reference."""
    import torch

    from helpers.harness.job import run_distributed
    from helpers.world2_job import JOB_TIMEOUT, assert_matches_reference, spec_for

    full = spec_for(tmp_path, "auto", steps=4, save_steps=2, tag="full", streaming=True)
    ckpt = Path(full["out"]) / "checkpoint-2"
    resumed = spec_for(tmp_path, "auto", steps=4, resume_from=str(ckpt), tag="resumed", streaming=True)
    run_distributed({"runs": [full, resumed]}, 2, timeout=2 * JOB_TIMEOUT)
    a = torch.load(Path(full["out"]) / "params.pt")
    b = torch.load(Path(resumed["out"]) / "params.pt")
    for k in a:
        assert float((a[k] - b[k]).norm() / a[k].norm()) < 1e-6, k
    assert_matches_reference(full)
    assert_matches_reference(resumed)
    ids = []
    for out, keep in ((Path(full["out"]), lambda i: i < 2), (Path(resumed["out"]), lambda i: True)):
        for f in sorted((out / "cp_history").glob("rank*.jsonl")):
            for line in f.read_text().splitlines():
                rec = json.loads(line)
                if keep(rec["index"]):
                    ids += rec["trained_sample_ids"]
    assert sorted(ids) == list(range(len(LENGTHS))), "every sample of the stream exactly once"
