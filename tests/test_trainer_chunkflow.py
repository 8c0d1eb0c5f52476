"""ChunkFlow under CPTrainer on 2 processes (DeepSpeed ZeRO-2) equals single-process training,
step by step (harness.check: loss, gradient norm and every parameter gradient before the
optimizer, parameters after it), on the tiny Llama and the tiny Qwen2 (GQA).

- In the fast suite, from the shared world-2 job: Qwen2 trained by the `chunkflow` balancer in
  a step that runs a CP group of both ranks and, in another wave, dependent chunks on one rank
  beside a packed or chunked sample on the other (world2_job.chunkflow_mixed_spec); its
  planned evaluations (dependent chunks forward over the K/V store, CP groups) equal the
  reference model's loss.
- Slow: the issue's matrix, one torchrun job training every run one after the other: each
  model x N = 1, 2, 5 dependent chunks x K = 1 and K = N (harness ChunkedSampleBalancer: the
  step's longest sample as exactly N chunks on rank 0, the other rank a packed micro-batch
  padded to rank 0's N backward passes), and the mixed chunkflow run on the Llama.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hf_cp.balance import get_balancer
from hf_cp.cost.dims import ModelDims
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.cost.model import CostModel
from hf_cp.plan.chunks import dependent_chunk_sizes
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.planning.evaluation import plan_evaluation

from helpers.harness.check import check_run
from helpers.harness.job import run_distributed
from helpers.harness.models import MODELS, tiny_config
from helpers.harness.reference import reference_eval_loss
from helpers.world2_job import (
    CAP,
    CHUNKFLOW_ADAM_EPSILON,
    COLLECTIVE_TIMEOUT,
    FIXTURE_TIMEOUT,
    chunkflow_mixed_spec,
    executed_plans,
)

# Unshuffled at 500 tokens per step: [0..4] (250 tokens the longest; the other four, 220
# tokens, fit rank 1's cap of 256 in one pack) and [5..9] (200 the longest; rank 1 packs 120,
# 70 and 50, and the 33-token sample runs alone on rank 0 in a second wave while rank 1
# idles). Samples 0, 3, 6 and 9 have a masked prompt (their first third): with 5 chunks,
# sample 0's first chunk has no target at all.
MATRIX_LENGTHS = [250, 60, 30, 90, 40, 200, 70, 120, 50, 33]
MATRIX_TOKENS_PER_STEP = 500
MATRIX_STEPS = 2
# (N chunks, K kept): K = 1 recomputes the first N - 1 chunks; K = N recomputes none
MATRIX_CASES = [(1, 1), (2, 1), (2, 2), (5, 1), (5, 5)]
MATRIX_JOB_TIMEOUT = 900


def matrix_runs() -> dict:
    """name -> run spec (without its output folder) of the slow job."""
    runs = {
        f"{model}-n{n}-k{k}": dict(
            lengths=MATRIX_LENGTHS,
            tokens_per_step=MATRIX_TOKENS_PER_STEP,
            max_tokens_per_rank=CAP,
            steps=MATRIX_STEPS,
            balancer=f"chunks_{n}_keep_{k}",
            model=model,
            adam_epsilon=CHUNKFLOW_ADAM_EPSILON,
        )
        for model in MODELS
        for n, k in MATRIX_CASES
    }
    runs["llama-mixed"] = chunkflow_mixed_spec("llama")
    return {name: dict(spec, ddp_timeout=COLLECTIVE_TIMEOUT) for name, spec in runs.items()}


@pytest.fixture(scope="module")
def chunkflow_matrix_job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chunkflow_matrix")
    runs = {name: dict(spec, out=str(folder / name)) for name, spec in matrix_runs().items()}
    t0 = time.perf_counter()
    proc = run_distributed({"runs": list(runs.values())}, 2, timeout=MATRIX_JOB_TIMEOUT)
    print(f"chunkflow matrix job: {len(runs)} runs in {time.perf_counter() - t0:.1f} s")
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("harness.job:")))
    return runs


def chunked_runs(spec: dict, plans) -> list:
    """(step, rank, wave, sample, chunk sizes, keep) of every chunked sample the run executed."""
    out = []
    for p in plans:
        lens = p.length_of()
        for w, wave in enumerate(p.waves):
            for g in wave.groups:
                for r, cs in g.chunked.items():
                    out += [
                        (p.step, r, w, c.sample, dependent_chunk_sizes(lens[c.sample], c.chunk_size), c.keep)
                        for c in cs
                    ]
    return out


def assert_mixes_cp_and_chunks(spec: dict) -> None:
    """Some step of the run has a CP group of both ranks and dependent chunks on one rank beside
    work on the other in one wave: ChunkFlow mixed with CP, and the zero-weight padding."""
    plans = executed_plans(spec)
    mixed = []
    for p in plans:
        cp = [g for w in p.waves for g in w.groups if g.distributed and g.size == 2]
        chunk_waves = [w for w in p.waves if any(g.chunked for g in w.groups) and len(w.groups) == 2]
        if cp and chunk_waves:
            mixed.append(p.step)
    assert mixed, f"no step mixes a CP group with dependent chunks: {[p.to_dict()['waves'] for p in plans]}"
    runs = chunked_runs(spec, plans)
    assert any(len(sizes) == 5 and keep == 1 for *_, sizes, keep in runs), runs  # 4 chunks recomputed
    backward_counts = {len(sizes) for *_, sizes, _ in runs}
    assert len(backward_counts) > 1, "ranks ran the same number of chunks: the padding went untested"


def assert_evaluation_equals_single_process(spec: dict) -> None:
    """The run's planned evaluations (after each step, and evaluate() at the end) ran dependent
    chunks forward over the K/V store and CP groups, and equal the reference model's loss."""
    cost = CostModel(
        ModelDims.from_hf_config(tiny_config(spec["model"]).to_dict()), HardwareProfile.load("h200-qwen2.5-7b")
    )
    lengths = spec["eval_lengths"]
    balancer = get_balancer(spec["balancer"], **spec["balancer_options"])
    plans = [
        p
        for p, _ in plan_evaluation(
            lengths,
            [0] * len(lengths),
            spec["tokens_per_step"],
            balancer,
            ClusterSpec(2, spec["max_tokens_per_rank"]),
            cost,
        )
    ]
    assert any(p.chunked_samples for p in plans) and any(p.spreads_samples for p in plans)
    out = Path(spec["out"])
    final = [json.loads((out / f"eval_rank{r}.json").read_text()) for r in range(2)]
    for m in final:
        m.pop("eval_runtime")
        m.pop("eval_samples_per_second", None)
        m.pop("eval_steps_per_second", None)
    assert final[0] == final[1], "every rank reports the same evaluation"
    steps = spec["steps"]
    assert final[0]["eval_loss"] == pytest.approx(reference_eval_loss(spec, steps), rel=1e-5)
    logged = [rec for rec in json.loads((out / "log_history.json").read_text()) if "eval_loss" in rec]
    assert [rec["step"] for rec in logged] == list(range(1, steps + 1)) + [steps]
    assert logged[0]["eval_loss"] == pytest.approx(reference_eval_loss(spec, 1), rel=1e-5)


@pytest.mark.timeout(FIXTURE_TIMEOUT)
def test_chunkflow_mixed_with_cp_on_qwen2_equals_single_process(world2_job):
    spec = world2_job["chunkflow-mixed-qwen2"]
    assert spec["model"] == "qwen2"
    assert_mixes_cp_and_chunks(spec)
    report = check_run(spec)
    assert report.steps == [0, 1]
    assert_evaluation_equals_single_process(spec)


@pytest.mark.timeout(FIXTURE_TIMEOUT)
def test_samples_longer_than_the_whole_world_train_as_dependent_chunks(world2_job):
    # 600 and 520 tokens, over what both ranks hold together (2 x 256): no balancer but
    # chunkflow trains them; each runs as 6 dependent chunks on one rank (5 recomputed)
    spec = world2_job["chunkflow-beyond-world"]
    assert max(spec["lengths"]) > 2 * spec["max_tokens_per_rank"]
    runs = chunked_runs(spec, executed_plans(spec))
    long = {sample: sizes for _, _, _, sample, sizes, _ in runs if spec["lengths"][sample] > 2 * CAP}
    assert long == {0: [100] * 6, 4: [87, 87, 87, 87, 86, 86]}, runs
    report = check_run(spec)
    assert report.steps == [0, 1]


@pytest.mark.slow
@pytest.mark.timeout(MATRIX_JOB_TIMEOUT + 120)
@pytest.mark.parametrize("name", sorted(matrix_runs()))
def test_chunked_sample_under_the_trainer_equals_single_process(chunkflow_matrix_job, name):
    spec = chunkflow_matrix_job[name]
    if name.endswith("-mixed"):
        assert_mixes_cp_and_chunks(spec)
        assert_evaluation_equals_single_process(spec)
    else:
        n, k = (int(x) for x in spec["balancer"][len("chunks_") :].split("_keep_"))
        runs = chunked_runs(spec, executed_plans(spec))
        # every step: its longest sample as exactly N chunks on rank 0 in wave 0, K kept
        assert [(step, r, w, len(sizes), keep) for step, r, w, _, sizes, keep in runs] == [
            (step, 0, 0, n, k) for step in range(spec["steps"])
        ], runs
        assert all(max(sizes) - min(sizes) <= 1 for *_, sizes, _ in runs)
    report = check_run(spec)
    assert report.steps == list(range(spec["steps"]))
