"""hf-cp report on a synthetic run directory written with the keys CPTrainer logs: its per-step
history files, the Trainer's trainer_state.json (metrics.aggregate) and TensorBoard events."""

import json
import statistics

import pytest

from hf_cp.cli import main
from hf_cp.cost.simulate import max_over_mean
from hf_cp.report.runs import read_run
from hf_cp.train.measure.metrics import aggregate
from hf_cp.train.measure.step_record import StepRecord

WORLD = 4
STEPS = 8
LOG_EVERY = 4


def step_records():
    """Step records as CPTrainer._cp_record makes them: rank 3 is a straggler on odd steps."""
    recs = []
    for k in range(STEPS):
        pred = [100.0 + 10 * r + 5 * k for r in range(WORLD)]
        meas = [p * 1.1 + (60.0 if (r == 3 and k % 2) else 0.0) for r, p in enumerate(pred)]
        recs.append(
            StepRecord.from_dict(
                {
                    "index": k,
                    "epoch": 0,
                    "step_in_epoch": k,
                    "global_step": k + 1,
                    "num_samples": 5 + k,
                    "global_tokens": 4096,
                    "global_valid_tokens": 3000,
                    "loss": 3.0 - 0.1 * k,
                    "measured_ms": meas,
                    "rank_tokens": [1024] * WORLD,
                    "step_wall_ms": max(meas) + 5,
                    "predicted_ms": pred,
                    "predicted_step_ms": max(pred),
                    "compare_step_ms": max(pred) * 1.3,
                    "planner_ms": 2.0,
                    "cp_size_samples": {"1": 4 + k, "2": 1} if k % 2 else {"1": 5 + k},
                    "waves": 1 + k % 2,
                    "plan_digest": f"d{k}",
                }
            )
        )
    return recs


def write_run(run_dir, history=True, state=True, tensorboard=True):
    recs = step_records()
    if history:
        d = run_dir / "cp_history"
        d.mkdir(parents=True)
        for r in range(WORLD):
            with open(d / f"rank{r}.jsonl", "w") as f:
                for rec in recs:
                    f.write(json.dumps(rec.for_rank(r, [r]).to_dict()) + "\n")
    # what CPTrainer.log adds to the Trainer's logs every LOG_EVERY steps
    logs = []
    for end in range(LOG_EVERY, STEPS + 1, LOG_EVERY):
        entry = {"loss": recs[end - 1].loss, "grad_norm": 1.0, "learning_rate": 1e-3, "epoch": 0.5}
        entry.update(aggregate(recs[end - LOG_EVERY : end]))
        entry["step"] = end
        logs.append(entry)
    if state:  # with the Trainer's evaluation entries between the training logs
        run_dir.mkdir(parents=True, exist_ok=True)
        evals = [
            {"eval_loss": 3.5 - 0.2 * k, "eval_tokens": 900, "step": k * LOG_EVERY, "epoch": 0.5}
            for k in range(1, STEPS // LOG_EVERY + 1)
        ]
        evals.append({"eval_chat_loss": 2.25, "step": STEPS})
        (run_dir / "trainer_state.json").write_text(json.dumps({"global_step": STEPS, "log_history": logs + evals}))
    if tensorboard:
        from torch.utils.tensorboard import SummaryWriter
        from transformers.integrations.integration_utils import rewrite_logs

        w = SummaryWriter(log_dir=str(run_dir / "runs" / "Nov01_00-00-00_host"))
        for entry in logs:
            for k, v in rewrite_logs({k: v for k, v in entry.items() if k != "step"}).items():
                w.add_scalar(k, v, entry["step"])
        w.close()
    return recs, logs


def test_history_is_read_per_step(tmp_path):
    recs, _ = write_run(tmp_path / "run")
    s = read_run(tmp_path / "run")
    assert s.source == "cp_history/rank0.jsonl" and s.per_step and s.world == WORLD
    assert s.steps == list(range(1, STEPS + 1))
    assert s.measured_ms == [r.measured_ms for r in recs]
    assert s.predicted_ms == [r.predicted_ms for r in recs]
    assert s.measured_imbalance == pytest.approx([max_over_mean(r.measured_ms) for r in recs])
    assert s.cp_size_samples[1] == {1: 5.0, 2: 1.0} and s.cp_size_samples[0] == {1: 5.0}
    # a straggler on odd steps: measured imbalance exceeds predicted there only
    assert all(
        (m > p + 0.05) == bool(k % 2) for k, (m, p) in enumerate(zip(s.measured_imbalance, s.predicted_imbalance))
    )


def test_resumed_history_keeps_the_last_record_of_a_step(tmp_path):
    recs, _ = write_run(tmp_path / "run", state=False, tensorboard=False)
    again = dict(recs[STEPS - 1].to_dict(), measured_ms=[1.0, 2.0, 3.0, 4.0])
    with open(tmp_path / "run" / "cp_history" / "rank0.jsonl", "a") as f:
        f.write(json.dumps(again) + "\n")
    s = read_run(tmp_path / "run")
    assert len(s) == STEPS and s.measured_ms[-1] == [1.0, 2.0, 3.0, 4.0]


def test_interrupted_runs_are_shown_as_segments(tmp_path, capsys):
    # steps 1-3 by the first launch, 4-5 by a torchrun restart from checkpoint-3, 6-8 by a
    # relaunch after a preemption stop at checkpoint-5
    recs = step_records()
    runs = [(0, None)] * 3 + [(1, 3)] * 2 + [(0, 5)] * 3
    d = tmp_path / "run" / "cp_history"
    d.mkdir(parents=True)
    with open(d / "rank0.jsonl", "w") as f:
        for rec, (attempt, resumed) in zip(recs, runs):
            f.write(json.dumps(dict(rec.to_dict(), attempt=attempt, resumed_from=resumed)) + "\n")
    s = read_run(tmp_path / "run")
    assert s.segments == [(1, 3, 0, None), (4, 5, 1, 3), (6, 8, 0, 5)]
    assert main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert (
        "trained in 3 runs: steps 1-3 (fresh start); steps 4-5 (resumed from checkpoint-3, torchrun restart 1); "
        "steps 6-8 (resumed from checkpoint-5)"
    ) in out
    # a history without these fields (an older hf_cp) is one run
    write_run(tmp_path / "old", state=False, tensorboard=False)
    assert read_run(tmp_path / "old").segments == [(1, STEPS, 0, None)]


def test_sample_audit_counts_each_sample_once_per_epoch(tmp_path, capsys):
    from hf_cp.report.samples import audit_samples

    base = step_records()[0].to_dict()

    def rec(index, epoch, ids):
        fields = {"index": index, "epoch": epoch, "rank": 0, "trained_sample_ids": ids, "dataset_samples": 4}
        return json.dumps({**base, **fields}) + "\n"

    d = tmp_path / "run" / "cp_history"
    d.mkdir(parents=True)
    # sample 3 is spread over both ranks in step 2 (listed twice, trained once); step 2 was
    # trained again after a resume (its record appended twice: the last counts); epoch 1 is cut short
    (d / "rank0.jsonl").write_text(rec(0, 0, [0]) + rec(1, 0, [1, 3]) + rec(1, 0, [1, 3]) + rec(2, 1, [2]))
    (d / "rank1.jsonl").write_text(rec(0, 0, [2]) + rec(1, 0, [3]) + rec(1, 0, [3]) + rec(2, 1, [0]))
    audit = audit_samples(tmp_path / "run")
    assert audit.exactly_once and audit.pairs == 6 and audit.per_epoch == {0: 4, 1: 2}
    # a sample trained in two steps of one epoch: what a wrong resume would do
    with open(d / "rank1.jsonl", "a") as f:
        f.write(rec(3, 1, [2]))
    audit = audit_samples(tmp_path / "run")
    assert audit.duplicates == [(1, 2, [3, 4])]
    write_run(tmp_path / "run", history=False, state=True, tensorboard=False)
    assert main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "distinct samples per epoch 0: 4 (complete), 1: 2 of 4" in out
    assert "WARNING: 1 sample(s) trained more than once in an epoch: epoch 1 sample 2 at steps [3, 4]" in out


@pytest.mark.parametrize("source", ["trainer-state", "tensorboard"])
def test_logged_intervals_match_aggregate(tmp_path, source):
    _, logs = write_run(tmp_path / "run", history=False)
    s = read_run(tmp_path / "run", source=source)
    assert not s.per_step and s.steps == [LOG_EVERY, 2 * LOG_EVERY] and s.world == WORLD
    assert not s.per_rank  # the logs keep the spread over ranks, not every rank
    for entry, meas, pred, imb, sizes, loss in zip(
        logs, s.measured_spread, s.predicted_spread, s.measured_imbalance, s.cp_size_samples, s.loss
    ):
        assert meas == pytest.approx([entry[f"cp/measured_{k}_ms"] for k in ("min", "mean", "max")], rel=1e-6)
        assert pred == pytest.approx([entry[f"cp/predicted_{k}_ms"] for k in ("min", "mean", "max")], rel=1e-6)
        assert imb == pytest.approx(entry["cp/measured_max_over_mean"], rel=1e-6)
        assert sizes == pytest.approx({1: entry["cp/cp_size1_samples"], 2: entry["cp/cp_size2_samples"]})
        assert loss == pytest.approx(entry["loss"], rel=1e-6)


def test_auto_falls_back_in_order(tmp_path):
    write_run(tmp_path / "a", history=False, state=False)
    assert read_run(tmp_path / "a").source.startswith("runs/")
    write_run(tmp_path / "b", history=False)
    assert read_run(tmp_path / "b").source == "trainer_state.json"


def test_cli_writes_pngs_and_summary(capsys, tmp_path):
    recs, _ = write_run(tmp_path / "run")
    rc = main(["report", str(tmp_path / "run")])
    out = capsys.readouterr()
    assert rc == 0, out.err
    for name in ("rank_times.png", "imbalance.png", "cp_sizes.png", "loss.png"):
        p = tmp_path / "run" / "report" / name
        assert p.read_bytes()[:4] == b"\x89PNG" and p.stat().st_size > 10_000, name
        assert f"wrote {p}" in out.out
    meas = statistics.mean(max_over_mean(r.measured_ms) for r in recs)
    pred = statistics.mean(max_over_mean(r.predicted_ms) for r in recs)
    assert f"{STEPS} steps from cp_history/rank0.jsonl, {WORLD} ranks" in out.out
    assert f"predicted {pred:.3f}, measured {meas:.3f}" in out.out
    n1 = sum(r.cp_size_samples.get("1", 0) for r in recs)
    n2 = sum(r.cp_size_samples.get("2", 0) for r in recs)
    assert f"samples per CP size: 1:{n1} 2:{n2}" in out.out
    assert f"training loss: 3.0000 at step 1 -> {3.0 - 0.1 * (STEPS - 1):.4f} at step {STEPS}" in out.out
    assert f"eval loss: 3.3000 at step {LOG_EVERY} -> 3.1000 at step {STEPS} (2 evaluations)" in out.out
    assert f"eval_chat loss: 2.2500 at step {STEPS} -> 2.2500 at step {STEPS} (1 evaluations)" in out.out
    rc = main(["report", str(tmp_path / "run"), "--source", "tensorboard", "--out", str(tmp_path / "tb")])
    assert rc == 0 and (tmp_path / "tb" / "rank_times.png").exists()
    assert "2 logging intervals from runs/" in capsys.readouterr().out


def test_cli_errors_name_what_is_missing(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "no cp_history/rank*.jsonl" in err and "no trainer_state.json" in err and "no TensorBoard event" in err
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    write_run(tmp_path / "s", history=False, tensorboard=False)
    assert main(["report", str(tmp_path / "s"), "--source", "history"]) == 2
    assert "no cp_history" in capsys.readouterr().err
