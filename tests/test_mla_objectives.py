"""Preference and rollout training of an MLA model (a tiny DeepSeek-V3: value head dim 16, query
and key 16 + 8) equal TRL's own trainers (issue 36): hf_cp's attention pads the narrower head dim
for its kernels and slices the output back (attention/interface.py), under CPDPOTrainer's
shared-prompt pairs and CPGRPOTrainer's prompt groups as under plain SFT."""

from __future__ import annotations

import pytest
from test_dpo import GRAD_TOL, compare
from test_grpo import CONFIGS, STEPS, assert_same_steps, trl_results

from helpers.dpo_runs import grad_gap
from helpers.grpo_runs import hf_cp_run, model_dir, prompt_rows


def test_dpo_on_an_mla_model_equals_trls_dpo_trainer(tmp_path):
    losses, grads, _, trl_losses, trl_grads, _ = compare(tmp_path, family="deepseek_v3")
    print("MLA DPO losses", losses, trl_losses, "gradient gap", grad_gap(grads, trl_grads))
    assert losses == pytest.approx(trl_losses, rel=1e-5, abs=1e-6)
    assert grad_gap(grads, trl_grads) < GRAD_TOL
    assert losses[0] != pytest.approx(losses[1]), "the steps differ: the policy moved"


def test_grpo_on_an_mla_model_equals_trls_grpo_trainer(tmp_path_factory, tmp_path):
    path = model_dir(tmp_path_factory.mktemp("grpo_mla"), family="deepseek_v3")
    for name in ("dapo", "beta"):  # the plain loss, and the KL to the reference
        ref = trl_results(name, path, tmp_path / name)
        losses, grads, logs, _ = hf_cp_run(prompt_rows(), str(tmp_path / name / "cp"), STEPS, path, **CONFIGS[name])
        print(f"MLA GRPO {name}: {assert_same_steps(losses, grads, logs, ref, name)}")
