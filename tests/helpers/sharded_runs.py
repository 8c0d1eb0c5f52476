"""World-2 runs of the parameter-sharding engines (FSDP2, DeepSpeed ZeRO-3) under planned steps,
shared by tests/test_fsdp2.py and tests/test_zero3.py: the runs, one torchrun job that trains
them all, and what the tests read back.

Under both engines every forward all-gathers each layer's parameters and every backward gathers
them again and reduce-scatters the gradients, so the ranks of a wave run one sequence of passes
(StepPlan.wave_passes): ChunkFlow's chunk forwards and recomputes on one rank are matched by
dummy passes on the others.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Sequence

import pytest
import torch

from helpers.harness.check import check_run
from helpers.harness.job import run_distributed
from helpers.harness.reference import reference_eval_loss
from helpers.world2_job import (
    CHUNKFLOW_ADAM_EPSILON,
    CHUNKFLOW_RUNS,
    COLLECTIVE_TIMEOUT,
    LENGTHS,
    balance_spec,
    chunkflow_mixed_spec,
    empty_shard_spec,
    executed_plans,
    lengths_spec,
)

JOB_TIMEOUT = 900


def chunkflow_spec(name: str) -> dict:
    return balance_spec("chunkflow", balancer_options=dict(CHUNKFLOW_RUNS[name]), adam_epsilon=CHUNKFLOW_ADAM_EPSILON)


SHARDED_RUNS = {
    "static": lengths_spec("static"),
    "auto": lengths_spec("auto"),
    "dcp": lengths_spec("dcp"),
    # 4 dependent chunks keeping 1 (3 recomputed): forwards without a graph, recompute passes
    "chunkflow": chunkflow_spec("balancer-chunkflow"),
    # every chunk kept (K >= N): several forwards before their backwards, dummies matching them
    "chunkflow-keep-all": chunkflow_spec("chunkflow-keep-all"),
    # chunks beside a CP group in one step, on the tiny Qwen2, evaluated by the same plans
    "chunkflow-mixed-qwen2": chunkflow_mixed_spec("qwen2"),
    # every sample spread over both ranks on its own: 1-token samples leave rank 1 without tokens
    "empty-shards": empty_shard_spec("ring_per_doc"),
    # a checkpoint after step 2 of 4, resumed by the tests
    "checkpointed": lengths_spec("auto", steps=4, save_steps=2),
    # mixed precision: bf16 compute (not compared with the fp32 reference: the auto run's losses are)
    "auto-bf16": lengths_spec("auto", bf16=True),
    # a deliberate bug: every wave's loss x 1.001
    "mutation-loss_scale": lengths_spec("auto", mutation="loss_scale"),
}
# ZeRO-3's CPU recipe is fp32 (bf16 there would need DeepSpeed's bf16 optimizer on CPU)
FSDP2_ONLY = {"auto-bf16"}
EXACT_RUNS = ["static", "auto", "dcp", "chunkflow", "chunkflow-keep-all", "chunkflow-mixed-qwen2", "empty-shards"]


def train_sharded_runs(folder: Path, engine: str, refused: Sequence[str] = ()) -> Dict[str, dict]:
    """Every run of SHARDED_RUNS under `engine`, trained by one world-2 torchrun job; the runs
    named in `refused` must stop with an error on every rank (error_rank<r>.txt, error_of)."""
    runs = {
        name: dict(
            spec, engine=engine, ddp_timeout=COLLECTIVE_TIMEOUT, out=str(folder / name), expect_error=name in refused
        )
        for name, spec in SHARDED_RUNS.items()
        if engine == "fsdp2" or name not in FSDP2_ONLY
    }
    run_distributed({"runs": list(runs.values())}, 2, timeout=JOB_TIMEOUT)
    return runs


def engine_of(spec: dict) -> dict:
    return json.loads((Path(spec["out"]) / "engine.json").read_text())


def history(spec: dict) -> list:
    return json.loads((Path(spec["out"]) / "history.json").read_text())


def trained_ids(out: Path, below: int = None) -> list:
    ids = []
    for f in sorted((out / "cp_history").glob("rank*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if below is None or rec["index"] < below:
                ids += rec["trained_sample_ids"]
    return ids


def errors_of(spec: dict) -> List[str]:
    """The error each rank of a refused run stopped with (one per rank, or fewer if some trained)."""
    return [f.read_text() for f in sorted(Path(spec["out"]).glob("error_rank*.txt"))]


def assert_ranks_ran_different_passes(runs: Dict[str, dict], names: Sequence[str]) -> None:
    """The ChunkFlow runs test the pass alignment only if some wave gives the ranks different
    passes (chunks on one rank against a micro-batch or nothing on the other); and the mixed
    run's forward-only evaluation, aligned too, equals the reference on both ranks."""
    for name in names:
        plans = executed_plans(runs[name])
        differing = [
            (p.step, w)
            for p in plans
            for w in range(len(p.waves))
            if len(set(p.rank_passes(w))) > 1 and any("f" in x or x.count("F") > 1 for x in p.rank_passes(w))
        ]
        assert differing, f"{name}: no wave where the ranks' passes differ"
    mixed = runs["chunkflow-mixed-qwen2"]
    evals = [json.loads((Path(mixed["out"]) / f"eval_rank{r}.json").read_text()) for r in range(2)]
    assert evals[0]["eval_loss"] == evals[1]["eval_loss"]
    assert evals[0]["eval_loss"] == pytest.approx(reference_eval_loss(mixed, mixed["steps"]), rel=1e-5)


def assert_resumes_exactly(full: dict, checkpoint: Path, out: Path) -> None:
    """The checkpointed run resumed from `checkpoint` (after step 2 of 4) into `out`: steps 3-4
    equal the reference step by step and the uninterrupted run, every sample trained once."""
    resumed = dict(full, out=str(out), resume_from=str(checkpoint), save_steps=None)
    run_distributed(resumed, 2, timeout=JOB_TIMEOUT)
    assert [r["index"] for r in history(resumed)] == [2, 3]
    check_run(full)
    check_run(resumed)  # steps 3-4 step by step: parameters and AdamW state came back whole
    a, b = (torch.load(Path(s["out"]) / "params.pt") for s in (full, resumed))
    for k in a:
        assert float((a[k] - b[k]).norm() / a[k].norm()) < 1e-6, k
    trained = trained_ids(Path(full["out"]), below=2) + trained_ids(Path(resumed["out"]))
    assert sorted(trained) == list(range(len(LENGTHS))), "every sample of the epoch exactly once"
