"""Preference and rollout training of a Gated DeltaNet hybrid (a tiny Qwen3-Next) at world 2 (issue
36): CPDPOTrainer and CPGRPOTrainer on two gloo processes, with the long pair or prompt group
spread over a CP group of 2, equal the same training at world 1 (which tests/test_dpo.py and
tests/test_grpo.py check against TRL's own trainers on the same hybrid): loss and every gradient
of every step. A shared-prompt sample's answers each continue from the prompt's state through the
recurrent layers, gathered over the group (attention/recurrent.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_grpo import STEPS as GRPO_STEPS
from test_grpo import assert_same_steps, trl_results

from helpers.dpo_runs import grad_gap, hf_cp_run, preference_rows
from helpers.grpo_runs import model_dir, prompt_rows
from helpers.harness.job import run_distributed

STEPS = 2


def _spread_in_some_step(history_file: Path) -> bool:
    history = [json.loads(x) for x in history_file.read_text().splitlines()]
    return any(int(g) > 1 for r in history for g in r["cp_size_samples"])


def test_dpo_on_a_hybrid_at_world_2_equals_world_1(tmp_path):
    rows = preference_rows(8, long_prompt=300)  # pair 1 is over one rank's cap
    settings = dict(family="qwen3_next", cp_max_tokens_per_rank=256)  # world 2: the long pair needs both ranks
    runs = [dict(out=str(tmp_path / f"w2-{b}"), settings=dict(settings, cp_balancer=b)) for b in ("static", "auto")]
    run_distributed(dict(rows=rows, steps=STEPS, runs=runs), 2, timeout=900, module="helpers.dpo_runs")
    batches, losses, grads, _ = hf_cp_run(rows, str(tmp_path / "w1"), STEPS, family="qwen3_next")
    for run in runs:
        got = torch.load(Path(run["out"]) / "dpo.pt")
        assert got["batches"] == batches
        assert got["losses"] == pytest.approx(losses, rel=1e-5)
        gap = grad_gap(got["grads"], grads)
        print(f"DPO hybrid world 2 {run['settings']['cp_balancer']}: losses {got['losses']} gradient gap {gap:.2e}")
        assert gap < 2e-5, run["out"]
        assert _spread_in_some_step(Path(run["out"]) / "cp_history" / "rank0.jsonl"), "the long pair stayed local"


def test_grpo_on_a_hybrid_at_world_2_equals_trls_world_1(tmp_path_factory, tmp_path):
    path = model_dir(tmp_path_factory.mktemp("grpo_hybrid_w2"), family="qwen3_next")
    out = tmp_path / "cp-dapo"
    spec = dict(
        rows=prompt_rows(long_prompt=200),
        steps=GRPO_STEPS,
        model=path,
        runs=[dict(out=str(out), settings=dict(cp_max_tokens_per_rank=160))],  # the long prompt's group needs 2 ranks
    )
    run_distributed(spec, 2, timeout=900, module="helpers.grpo_runs")
    got = torch.load(out / "grpo.pt", weights_only=False)
    ref = trl_results("dapo", path, tmp_path, rows_key="long")
    print(
        f"GRPO hybrid world 2: {assert_same_steps(got['losses'], got['grads'], got['logs'], ref, 'hybrid at world 2')}"
    )
    assert any(2 in sizes for sizes in got["plans"]), got["plans"]
