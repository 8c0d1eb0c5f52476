"""CPTrainer building blocks without processes: sampler, collator layout, planner, arguments."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers.harness.balancers import FixedModeBalancer
from helpers.harness.models import synthetic_rows

from hf_cp.attention.context import CPContext
from hf_cp.cost.model import CostModel
from hf_cp.modes.segments import WHOLE_DOCUMENT_MODES, ShardMode
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import Group, StepPlan, Wave
from hf_cp.planning import GlobalBatchSampler, Planner
from hf_cp.train.collator import IGNORE_INDEX, PlanCollator, shifted_targets, valid_targets

# Unshuffled at 500 tokens per step: [0 1 2] (three packs at a 256 cap: an idle rank in wave 2
# of static on 2 ranks), [3] alone (a step that leaves ranks without samples), [4..9], [10..16].
LENGTHS = [200, 150, 130, 250, 255, 90, 7, 33, 60, 40, 120, 100, 18, 5, 64, 21, 77]


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


@pytest.mark.parametrize("in_process", [False, True])
def test_background_planner_matches_inline_planning_and_validates(in_process):
    from concurrent.futures import ProcessPoolExecutor

    cost = CostModel.load("tiny-llama", "h200-qwen2.5-7b")
    sampler = GlobalBatchSampler(LENGTHS * 3, 900, seed=5, num_epochs=2)
    cl = ClusterSpec(4, 256)
    bg = Planner(sampler, "auto", cl, cost, lookahead=3, compare_balancer="static", in_process=in_process)
    inline = Planner(sampler, "auto", cl, cost, lookahead=0, compare_balancer="static")
    assert bg.in_process == in_process and isinstance(bg._pool, ProcessPoolExecutor) == in_process
    try:
        order = [0, 1, 2, 5, 6, len(sampler) - 1]  # includes a jump, as after a resume
        for k in order:
            a, b = bg.get(k), inline.get(k)
            assert a.plan.to_json() == b.plan.to_json() and a.plan.step == k
            assert a.predicted.makespan_ms == pytest.approx(b.predicted.makespan_ms)
            assert a.compare.makespan_ms == pytest.approx(b.compare.makespan_ms)
            assert a.batch.sample_ids == b.batch.sample_ids
    finally:
        bg.close()

    class Broken:
        name = "broken"

        def plan(self, req):
            return req.empty_plan("broken")  # schedules nothing

    with pytest.raises(ValueError, match="never scheduled"):
        Planner(sampler, Broken(), cl, cost, lookahead=0).get(0)

    class WhereAmI:
        name = "where"

        def plan(self, req):
            import dataclasses
            import os

            from hf_cp.balance import get_balancer

            return dataclasses.replace(get_balancer("static").plan(req), balancer=f"pid {os.getpid()}")

    where = Planner(sampler, WhereAmI(), cl, cost, lookahead=1, in_process=in_process)
    try:  # in_process: planned by another process, off this one's GIL
        import os

        assert (where.get(0).plan.balancer != f"pid {os.getpid()}") == in_process
    finally:
        where.close()
    broken_bg = Planner(sampler, Broken(), cl, cost, lookahead=1, in_process=in_process)
    try:  # an invalid plan made in the worker reaches the trainer as the same error
        with pytest.raises(ValueError, match="never scheduled"):
            broken_bg.get(0)
    finally:
        broken_bg.close()


def test_several_planner_workers_plan_the_same_steps():
    cost = CostModel.load("tiny-llama", "h200-qwen2.5-7b")
    sampler = GlobalBatchSampler(LENGTHS * 3, 900, seed=5, num_epochs=3)
    cl = ClusterSpec(4, 256)
    inline = Planner(sampler, "auto", cl, cost, lookahead=0)
    bg = Planner(sampler, "auto", cl, cost, lookahead=4, in_process=True, workers=3)
    try:
        for k in [0, 1, 2, 3, 7, 8, 9, len(sampler) - 1]:
            assert bg.get(k).plan.to_json() == inline.get(k).plan.to_json(), k
        assert len(bg._pool._processes) == 3
        # planning is background work: the workers run nicer than the training process
        from hf_cp.planning.worker import PLANNER_NICENESS

        mine = os.getpriority(os.PRIO_PROCESS, 0)
        for pid in bg._pool._processes:
            assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, mine + PLANNER_NICENESS)
    finally:
        bg.close()
    with pytest.raises(ValueError, match="planner workers must be >= 1"):
        Planner(sampler, "auto", cl, cost, workers=0)


class _WarmUpRecorder:
    """static's plans; warm_up() appends "<pid> <thread name>" to a file (it may run in a worker process)."""

    name = "warm-up-recorder"

    def __init__(self, path, fail=False):
        from hf_cp.balance import get_balancer

        self.static, self.path, self.fail = get_balancer("static"), path, fail

    def plan(self, req):
        return self.static.plan(req)

    def warm_up(self):
        import threading

        with open(self.path, "a") as f:
            f.write(f"{os.getpid()} {threading.current_thread().name}\n")
        if self.fail:
            raise RuntimeError("warm-up failed")


def _wait_for_lines(path, n, timeout_s=20.0):
    import time

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return path.read_text().splitlines()
        time.sleep(0.02)
    raise AssertionError(f"{path}: fewer than {n} warm-up lines after {timeout_s} s")


@pytest.mark.parametrize("in_process", [True, False])
def test_planner_start_warms_the_balancer_up_in_the_background_before_any_plan(tmp_path, in_process):
    """Planner.start: the worker starts and pays the balancer's one-time start-up (warm_up) at
    once, in the worker that will plan (each process of the pool, or the planner thread), not
    in the step that first needs it; the plans stay those planned inline."""
    cost = CostModel.load("tiny-llama", "h200-qwen2.5-7b")
    sampler = GlobalBatchSampler(LENGTHS * 3, 900, seed=5, num_epochs=3)
    cl = ClusterSpec(4, 256)
    inline = Planner(sampler, "static", cl, cost, lookahead=0)
    record = tmp_path / "warm.txt"
    bg = Planner(sampler, _WarmUpRecorder(record), cl, cost, lookahead=3, in_process=in_process, workers=2)
    try:
        assert not record.exists()  # nothing runs before start()
        bg.start()
        bg.start()  # once only
        lines = _wait_for_lines(record, 2 if in_process else 1)  # before any get()
        pids = {int(line.split()[0]) for line in lines}
        if in_process:
            assert pids == set(bg._pool._processes) and os.getpid() not in pids  # each worker process, once
        else:
            assert pids == {os.getpid()} and lines[0].split()[1].startswith("hf_cp-planner")
        for k in [0, 1, 5]:
            assert bg.get(k).plan.to_json() == inline.get(k).plan.to_json()
        assert len(record.read_text().splitlines()) == len(lines)  # planning warmed nothing up again
    finally:
        bg.close()
    # without a background worker there is nothing to start: plans are made on the caller's thread
    Planner(sampler, _WarmUpRecorder(record), cl, cost, lookahead=0).start()
    assert len(record.read_text().splitlines()) == len(lines)


def test_a_failed_warm_up_is_left_to_the_plan_that_needs_it(tmp_path):
    cost = CostModel.load("tiny-llama", "h200-qwen2.5-7b")
    sampler = GlobalBatchSampler(LENGTHS * 3, 900, seed=5, num_epochs=3)
    bg = Planner(sampler, _WarmUpRecorder(tmp_path / "w.txt", fail=True), ClusterSpec(4, 256), cost, lookahead=1)
    try:
        bg.warm_up_balancers()  # does not raise: the first plan that needs what failed raises it, with its step
        bg.start()
        assert bg.get(0).plan.waves
    finally:
        bg.close()


def test_dcp_and_flexsp_warm_up_pay_their_solvers_start_up_through_auto(monkeypatch):
    pytest.importorskip("mtkahypar")
    pytest.importorskip("highspy")
    from hf_cp.balance import get_balancer
    from hf_cp.balance.balancers.dcp import hypergraph
    from hf_cp.balance.toolkit import deadline as deadline_mod

    auto = get_balancer(
        "auto",
        members=["dynamic_cp", "dcp", "flexsp"],
        member_options={"dcp": {"partitioner": "mtkahypar"}, "flexsp": {"solver": "milp", "deadline_s": 5}},
    )
    monkeypatch.setattr(hypergraph, "_MT", None)
    worker = deadline_mod.SolverWorker()
    monkeypatch.setattr(deadline_mod, "_SHARED", worker)
    try:
        auto.warm_up()
        assert hypergraph._MT is not None  # Mt-KaHyPar imported and initialised
        assert worker.pid is not None and worker.started == 1  # the MILP's solver worker is running
        auto.warm_up()
        assert worker.started == 1  # a running worker is kept
    finally:
        worker.close()


def test_planner_replaces_a_worker_process_that_dies():
    """An OOM-killed planner worker costs a warning and a re-plan, never a hang or a wrong plan."""
    import os
    import signal

    cost = CostModel.load("tiny-llama", "h200-qwen2.5-7b")
    sampler = GlobalBatchSampler(LENGTHS * 3, 900, seed=5, num_epochs=3)
    cl = ClusterSpec(4, 256)
    inline = Planner(sampler, "auto", cl, cost, lookahead=0)
    bg = Planner(sampler, "auto", cl, cost, lookahead=2, in_process=True)
    try:
        assert bg.get(0).plan.to_json() == inline.get(0).plan.to_json()
        for death in range(1, Planner.MAX_WORKER_RESTARTS + 2):
            (pid,) = list(bg._pool._processes)
            os.kill(pid, signal.SIGKILL)
            step = 3 * death  # not planned ahead yet: the dead worker would have had to plan it
            if death <= Planner.MAX_WORKER_RESTARTS:
                with pytest.warns(RuntimeWarning, match=f"step {step}: the planner worker process died"):
                    got = bg.get(step)
                assert got.plan.to_json() == inline.get(step).plan.to_json()
                assert bg.worker_restarts == death
            else:  # something kills every worker: an error naming the step, not an endless loop
                with pytest.raises(RuntimeError, match=f"step {step}: the planner worker process died 4 times"):
                    bg.get(step)
    finally:
        bg.close()


def test_data_digest_sees_tokens_targets_and_order():
    from datasets import Dataset

    from hf_cp.train.columns import read_token_columns

    rows = synthetic_rows([40, 40, 33, 40, 7], seed=1)
    base = read_token_columns(Dataset.from_list(rows)).digest()
    assert base == read_token_columns(Dataset.from_list([dict(r) for r in rows])).digest()
    remasked = [dict(r, labels=list(r["input_ids"])) for r in rows]  # prompts now carry loss
    assert read_token_columns(Dataset.from_list(remasked)).digest() != base
    swapped = [rows[1], rows[0]] + rows[2:]  # same lengths, another order
    assert read_token_columns(Dataset.from_list(swapped)).digest() != base
    retokenised = [dict(rows[0], input_ids=[(t + 1) % 256 for t in rows[0]["input_ids"]])] + rows[1:]
    assert read_token_columns(Dataset.from_list(retokenised)).digest() != base


def test_planner_names_a_sample_too_long_for_any_group():
    cost = CostModel.load("tiny-llama", "h200-qwen2.5-7b")
    sampler = GlobalBatchSampler([10, 3000, 20], 5000)
    with pytest.raises(ValueError, match="sample 1 has 3000 tokens"):
        Planner(sampler, "static", ClusterSpec(2, 1000), cost)


def test_arguments_reject_trainer_batching_knobs():
    from hf_cp.train import CPTrainingArguments

    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        CPTrainingArguments(output_dir="/tmp/x", gradient_accumulation_steps=2, use_cpu=True)
    with pytest.raises(ValueError, match="per_device_train_batch_size"):
        CPTrainingArguments(output_dir="/tmp/x", per_device_train_batch_size=4, use_cpu=True)
    a = CPTrainingArguments(output_dir="/tmp/x", use_cpu=True, cp_tokens_per_rank_per_step=1000)
    assert a.per_device_train_batch_size == 1 and a.tokens_per_step(4) == 4000


def test_single_process_trainer_matches_reference(tmp_path):
    """World of one, no DeepSpeed: the CPTrainer path against the sample-by-sample reference,
    every step (loss, gradients before clipping, parameters after the optimizer)."""
    from datasets import Dataset
    from helpers.harness.capture import capture_steps
    from helpers.harness.check import compare_with_reference
    from helpers.harness.models import tiny_model

    from hf_cp.train import CPTrainer, CPTrainingArguments

    spec = dict(lengths=LENGTHS, tokens_per_step=500, max_tokens_per_rank=256, steps=3, balancer="static")
    rows = synthetic_rows(LENGTHS)
    args = CPTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        seed=42,
        cp_balancer="static",
        cp_max_tokens_per_rank=256,
        cp_tokens_per_step=500,
        cp_shuffle=False,
        max_steps=3,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        cp_compare_balancer=None,
    )
    trainer = CPTrainer(model=tiny_model(0), args=args, train_dataset=Dataset.from_list(rows))
    records, stop = capture_steps(trainer)
    try:
        trainer.train()
    finally:
        stop()
    final = {k: v.detach() for k, v in trainer.model.state_dict().items()}
    history = [r.to_dict() for r in trainer.cp_history]
    report = compare_with_reference(spec, history, trainer.state.log_history, records, final)
    assert report.steps == [0, 1, 2]
    assert [r.index for r in trainer.cp_history] == [0, 1, 2]
    logged = [h for h in trainer.state.log_history if "cp/measured_max_over_mean" in h]
    assert len(logged) == 3 and all(h["cp/tokens_per_s"] > 0 and "cp/predicted_max_ms" in h for h in logged)
    # epochs of data: the share of the dataset's samples trained after each step
    batches = GlobalBatchSampler(LENGTHS, 500, seed=42, shuffle=False)
    seen = np.cumsum([len(batches[k].sample_ids) for k in range(3)]) / len(LENGTHS)
    assert [h["cp/data_epoch"] for h in logged] == pytest.approx(list(seen))


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


@pytest.mark.parametrize(
    "rows, message",
    [
        ([], "train_dataset is empty"),
        (
            [{"input_ids": [1, 2, 3], "length": 3}, {"input_ids": [4, 5], "length": 7}],
            "train_dataset sample 1 has length column 7 but 2 input_ids",
        ),
        ([{"text": "not tokenised"}], "no 'input_ids' column"),
    ],
)
def test_trainer_rejects_bad_datasets_by_name(tmp_path, rows, message):
    from datasets import Dataset
    from helpers.harness.models import tiny_model

    from hf_cp.train import CPTrainer, CPTrainingArguments

    args = CPTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        cp_max_tokens_per_rank=256,
        cp_tokens_per_step=500,
        cp_compare_balancer=None,
    )
    ds = Dataset.from_list(rows) if rows else Dataset.from_dict({"input_ids": []})
    with pytest.raises(ValueError, match=message):
        CPTrainer(model=tiny_model(0), args=args, train_dataset=ds)


def test_evaluate_on_one_process_matches_reference_and_refuses_what_it_cannot_do(tmp_path):
    from datasets import Dataset
    from helpers.harness.models import eval_rows, synthetic_rows, tiny_model
    from helpers.harness.reference import reference_eval_loss

    from hf_cp.train import CPTrainer, CPTrainingArguments

    spec = dict(lengths=[40, 30], eval_lengths=[60, 9, 200], steps=0, tokens_per_step=300)
    args = CPTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        cp_max_tokens_per_rank=256,
        cp_tokens_per_step=300,
        cp_compare_balancer=None,
        cp_loss_chunk_tokens=16,
    )
    trainer = CPTrainer(
        model=tiny_model(0, attn="hf_cp"), args=args, train_dataset=Dataset.from_list(synthetic_rows(spec["lengths"]))
    )
    with pytest.raises(ValueError, match="no eval_dataset"):
        trainer.evaluate()
    chat = Dataset.from_list(eval_rows(spec))
    metrics = trainer.evaluate({"chat": chat})
    assert metrics["eval_chat_loss"] == pytest.approx(reference_eval_loss(spec, 0), rel=1e-5)
    assert metrics["eval_chat_samples"] == 3 and metrics["eval_chat_tokens"] == 269
    unlabeled = Dataset.from_list([{"input_ids": [1, 2, 3], "labels": [-100, -100, -100]}])
    with pytest.raises(ValueError, match="'eval' has no target tokens"):
        trainer.evaluate(unlabeled)
    with pytest.raises(ValueError, match="eval dataset 'eval' sample 0 has 3 input_ids but 1 labels"):
        trainer.evaluate(Dataset.from_list([{"input_ids": [1, 2, 3], "labels": [5]}]))
    # auto trains samples over the cap of 256 as dependent chunks (chunkflow) up to a limit set by
    # the K/V state store; one token more is refused by name
    limit = trainer.cp_planner.max_sample_tokens
    assert limit > 256
    with pytest.raises(ValueError, match=f"eval dataset 'eval': sample 1 has {limit + 1} tokens; balancer 'auto'"):
        trainer.evaluate(Dataset.from_list(synthetic_rows([5, limit + 1])))
    cached = trainer._cp_eval_data[id(chat)][2]
    again = trainer.evaluate({"chat": chat})
    assert trainer._cp_eval_data[id(chat)][2] is cached, "a dataset is planned once per run"
    assert again["eval_chat_loss"] == pytest.approx(metrics["eval_chat_loss"], rel=1e-12)
    with pytest.raises(NotImplementedError, match="evaluate\\(\\) gives the planned eval loss"):
        trainer.predict(unlabeled)
    # evaluation starts no background planner; asking for the training data does (Planner.start)
    assert trainer.cp_planner._started is None
    trainer.get_train_dataloader()
    assert trainer.cp_planner._started is not None
    trainer.cp_planner.close()


def test_scheduled_garbage_collection_collects_only_at_the_interval():
    import gc
    from types import SimpleNamespace

    from hf_cp.train.gc_schedule import ScheduledGarbageCollection

    seen = []

    def on_gc(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    cb = ScheduledGarbageCollection(3)
    state = SimpleNamespace(global_step=0)
    assert gc.isenabled()
    gc.callbacks.append(on_gc)
    try:
        cb.on_train_begin(None, state, None)
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        seen.clear()
        for step in range(1, 8):
            state.global_step = step
            for _ in range(2000):  # cyclic garbage that would trip automatic collections
                a = []
                a.append(a)
            cb.on_step_end(None, state, None)
        assert seen == [1, 1], "one young-generation collection at steps 3 and 6, none in between"
        cb.on_train_end(None, state, None)
        assert gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.callbacks.remove(on_gc)
        gc.unfreeze()
        gc.enable()
    with pytest.raises(ValueError, match="cp_gc_interval_steps must be positive"):
        ScheduledGarbageCollection(0)


def test_planner_worker_exits_when_its_training_process_is_killed():
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = (
        "import os\n"
        "from hf_cp.plan.cluster import ClusterSpec\n"
        "from hf_cp.cost.model import CostModel\n"
        "from hf_cp.planning import Planner\n"
        "from hf_cp.planning import GlobalBatchSampler\n"
        "p = Planner(GlobalBatchSampler([10] * 40, 100), 'static', ClusterSpec(2, 256),\n"
        "            CostModel.load('tiny-llama', 'h200-qwen2.5-7b'), lookahead=1, in_process=True)\n"
        "p.get(0)\n"
        "print(*p._pool._processes, flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    # the forked worker holds this pipe too: run() returns only once the worker is gone as well
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr[-2000:]
    worker = int(proc.stdout.split()[0])
    assert time.perf_counter() - t0 < 30
    status = Path(f"/proc/{worker}/status")

    def gone():
        try:  # exited: reaped, or a zombie until reaped
            return "\nState:\tZ" in status.read_text()
        except FileNotFoundError:
            return True

    # a dying process closes its files before it turns zombie, so the pipe may close while
    # /proc still shows it running: give the exit a moment to finish
    deadline = time.perf_counter() + 10
    while not gone() and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert gone(), f"planner worker {worker} outlived its training process"


def test_a_model_built_from_a_config_keeps_fp32_master_weights_whatever_dtype_the_config_names(monkeypatch):
    """Qwen2.5-0.5B's config says bfloat16: built as it says, a run without DeepSpeed would update
    bf16 parameters with AdamW (seen on an H200 run, where the memory model read the states'
    dtype off the built model). The training model is built in fp32."""
    import transformers

    from hf_cp.train.config import build_model, model_config

    mcfg = {"config": "qwen2.5-0.5b"}
    assert model_config(mcfg, "test").dtype == torch.bfloat16  # what the config names
    original = transformers.AutoModelForCausalLM.from_config

    def small(config, **kwargs):  # one layer and a small vocabulary: only the dtype matters here
        config.num_hidden_layers, config.vocab_size = 1, 64
        return original(config, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", small)
    assert {p.dtype for p in build_model(mcfg, "test").parameters()} == {torch.float32}
