"""GRPO runs for the tests: hf_cp's CPGRPOTrainer (in this process, or as a rank of a torchrun job:
`python -m helpers.grpo_runs SPEC.json`) and TRL's own GRPOTrainer on the same rollouts, each
recording per step the loss and every parameter's gradient before the optimizer step.

Both trainers are TRL's code up to the policy step (its sampler, prompt tokenisation, rewards
through `reward_a`, advantages, old and reference log-probs); the only change, the same in
both, is generation: `FixedCompletions` returns predetermined completion ids, a function of
the prompt's tokens and the row's place in its group (its global row index modulo
num_generations), so both trainers at any world size see the same rollouts. Some completions
end with EOS, others stop at max_completion_length without it (truncated); a prompt with
"LONG" in it gets only truncated completions. The model is the tiny chat Llama saved once to a
folder (TRL builds the reference model from its path when beta > 0), loaded with sdpa attention
for TRL and hf_cp's for hf_cp.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

from helpers.dpo_runs import GradTape
from helpers.tiny_tokenizer import tiny_chat_model, tiny_chat_tokenizer

G = 4  # completions per prompt
MAX_LEN = 12  # max_completion_length
SETTINGS = dict(
    seed=0,
    learning_rate=0.3,
    optim="sgd",  # plain SGD: Adam turns fp32 noise of near-zero gradient entries into whole updates
    lr_scheduler_type="constant",
    weight_decay=0.0,
    max_grad_norm=0.0,  # no clipping: the comparison is of raw gradients
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    use_cpu=True,
    bf16=False,
    gradient_checkpointing=False,
    disable_tqdm=True,
    num_generations=G,
    max_completion_length=MAX_LEN,
    dataloader_num_workers=0,
)
ROWS_PER_STEP = 12  # 3 groups of 4 completions
WORDS = ["banana", "cab", "abba", "data", "bccb", "aaa", "cobalt", "bb", "maple"]


def prompt_rows(n: int = 9, long_prompt: int = 0, truncated: Optional[int] = None) -> List[dict]:
    """Plain-text prompts; with `long_prompt`, prompt 1 is that many bytes (over a rank's cap at
    world 2); with `truncated`, that prompt's completions are all truncated."""
    rows = []
    for i in range(n):
        prompt = f"Q{i}: spell {WORDS[i % len(WORDS)]} " + "please " * (i % 3)
        if long_prompt and i == 1:
            prompt = ("a long context " * (long_prompt // 15 + 1))[:long_prompt]
        if truncated is not None and i == truncated:
            prompt = f"Q{i}: LONG " + prompt
        rows.append({"prompt": prompt})
    return rows


def fixed_completion(tokenizer, prompt_ids: List[int], k: int, max_len: int) -> List[int]:
    """Completion k of a prompt: letters a/b/c in a pattern set by the prompt and k, ending with
    EOS unless it runs to max_len (truncated); all truncated for a prompt with "LONG"."""
    text = tokenizer.decode(prompt_ids)
    h = sum(prompt_ids) % 11
    letters = "abc"
    n = 2 + (h * 3 + k * 5) % (max_len + 2)  # 2 .. max_len + 1: some run past max_len
    body = "".join(letters[(h + k * (j + 1) + j * j) % 3] for j in range(n))
    ids = tokenizer(body)["input_ids"]
    if "LONG" in text or len(ids) >= max_len:
        return ids[:max_len] if len(ids) >= max_len else (ids * max_len)[:max_len]
    return ids + [tokenizer.eos_token_id]


def reward_a(completions, **kwargs) -> List[float]:
    """The toy reward: the share of 'a' in the completion."""
    return [c.count("a") / max(len(c), 1) for c in completions]


def constant_reward(completions, **kwargs) -> List[float]:
    """Every completion alike: every advantage is 0, so no group can move the policy."""
    return [1.0] * len(completions)


class FixedCompletions:
    """Generation replaced by fixed_completion (mixed in before the trainer class)."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        first = self.accelerator.process_index * len(prompt_ids)  # global row of this process's first row
        out = [
            fixed_completion(
                self.processing_class, list(ids), (first + i) % num_generations, self.max_completion_length
            )
            for i, ids in enumerate(prompt_ids)
        ]
        return out, None


def model_dir(root: Path, family: str = "llama") -> str:
    """The tiny chat Llama (seed 0; or tiny_chat_model's other `family`) and its tokenizer saved
    under root/model (once)."""
    path = Path(root) / "model"
    if not (path / "config.json").exists():
        path.mkdir(parents=True, exist_ok=True)
        tiny_chat_model(0, attn="sdpa", family=family).save_pretrained(str(path))
        tiny_chat_tokenizer().save_pretrained(str(path))
    return str(path)


def load_model(path: str, attn: str):
    from transformers import AutoModelForCausalLM

    import hf_cp.attention.interface  # noqa: F401  registers attn_implementation="hf_cp"

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32)
    model.config.use_cache = False
    return model


def _reset_accelerate() -> None:
    """A run's Accelerator state must not leak into the next run of the same process."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def hf_cp_trainer(
    rows,
    out: str,
    steps: int,
    model_path: str,
    tape: Optional[GradTape] = None,
    reward=reward_a,
    peft_config=None,
    **kw,
):
    from datasets import Dataset

    from hf_cp.train.objectives.grpo import CPGRPOConfig, CPGRPOTrainer

    class FixedCPGRPOTrainer(FixedCompletions, CPGRPOTrainer):
        pass

    world = int(os.environ.get("WORLD_SIZE", "1"))
    settings = dict(
        SETTINGS,
        per_device_train_batch_size=ROWS_PER_STEP // world,
        cp_max_tokens_per_rank=512,
        cp_compare_balancer=None,
        cp_profile="cpu",
        cp_plan_lookahead=0,
        cp_balancer="auto",
    )
    settings.update(kw)
    _reset_accelerate()
    args = CPGRPOConfig(output_dir=out, max_steps=steps, **settings)
    return FixedCPGRPOTrainer(
        model=load_model(model_path, "hf_cp"),
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tiny_chat_tokenizer(),
        callbacks=[tape] if tape else None,
        peft_config=peft_config,
    )


def hf_cp_run(rows, out: str, steps: int, model_path: str, **kw):
    """(per-step losses, per-step gradients, logs, per-step planned group sizes) of CPGRPOTrainer."""
    tape = GradTape()
    trainer = hf_cp_trainer(rows, out, steps, model_path, tape, **kw)
    plans: List[List[int]] = []
    build = trainer._cp_build_step

    def recording(rollout):
        t = build(rollout)
        plan = t.step.plan if t.step is not None else None
        plans.append(sorted({len(g.ranks) for w in plan.waves for g in w.groups if g.distributed}) if plan else [])
        return t

    trainer._cp_build_step = recording
    trainer.train()
    losses = [x["loss"] for x in tape.logs if "loss" in x]
    return losses, tape.grads, tape.logs, plans


def trl_trainer(
    rows,
    out: str,
    steps: int,
    model_path: str,
    tape: Optional[GradTape] = None,
    reward=reward_a,
    peft_config=None,
    **kw,
):
    """TRL's GRPOTrainer with the same fixed completions (cp_* settings are left out)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    class FixedGRPOTrainer(FixedCompletions, GRPOTrainer):
        pass

    world = int(os.environ.get("WORLD_SIZE", "1"))
    settings = dict(SETTINGS, per_device_train_batch_size=ROWS_PER_STEP // world)
    settings.update({k: v for k, v in kw.items() if not k.startswith("cp_")})
    _reset_accelerate()
    args = GRPOConfig(output_dir=out, max_steps=steps, **settings)
    return FixedGRPOTrainer(
        model=load_model(model_path, "sdpa"),
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tiny_chat_tokenizer(),
        callbacks=[tape] if tape else None,
        peft_config=peft_config,
    )


def trl_run(rows, out: str, steps: int, model_path: str, **kw):
    """(per-step losses, per-step gradients, logs) of TRL's GRPOTrainer on the same rollouts."""
    tape = GradTape()
    trl_trainer(rows, out, steps, model_path, tape, **kw).train()
    losses = [x["loss"] for x in tape.logs if "loss" in x]
    return losses, tape.grads, tape.logs


def max_relative_grad_diff(a: List[Dict[str, torch.Tensor]], b: List[Dict[str, torch.Tensor]]) -> float:
    """Over steps: the largest |a - b| of any gradient entry relative to b's largest entry in
    that parameter (parameters whose gradient is 0 in both count 0)."""
    assert len(a) == len(b), (len(a), len(b))
    worst = 0.0
    for ga, gb in zip(a, b):
        assert ga.keys() == gb.keys(), set(ga) ^ set(gb)
        for name in gb:
            scale = float(gb[name].abs().max())
            diff = float((ga[name] - gb[name]).abs().max())
            if scale == 0.0:
                worst = max(worst, 0.0 if diff == 0.0 else float("inf"))
            else:
                worst = max(worst, diff / scale)
    return worst


def assert_balance_summary_holds_the_records(summary: List[str], records, balancer: str, compare: str) -> None:
    """A rollout trainer's end-of-run summary gives its planned steps' balance from their step
    records: max/mean per-rank compute (predicted, measured), each rank's mean, and the predicted
    step time of the comparison balancer, each recomputed here from the records."""
    text = "\n".join(summary)
    assert records, "no step was recorded"

    def max_over_mean(values) -> float:
        return max(values) / statistics.mean(values)

    predicted = statistics.mean(max_over_mean(r.predicted_ms) for r in records)
    measured = statistics.mean(max_over_mean(r.measured_ms) for r in records)
    assert f"balance ({balancer}): per-rank compute max/mean predicted {predicted:.3f}, measured {measured:.3f}" in text
    world = len(records[0].measured_ms)
    means = [
        " ".join(f"{statistics.mean(getattr(r, what)[k] for r in records):.0f}" for k in range(world))
        for what in ("predicted_ms", "measured_ms")
    ]
    assert f"per-rank compute, mean per step (ms): predicted {means[0]} | measured {means[1]}" in text, text
    ours = statistics.mean(r.predicted_step_ms for r in records)
    theirs = statistics.mean(r.compare_step_ms for r in records)
    assert f"{balancer} {ours:.1f} ms, {compare} would take {theirs:.1f} ms ({theirs / ours:.2f}x" in text, text


def _job(spec_file: str) -> None:
    """A torchrun rank: the spec's runs one after the other (CPGRPOTrainer, or TRL's GRPOTrainer
    with "trl": true); rank 0 saves each run's results to its out/grpo.pt."""
    from datetime import timedelta

    from accelerate import PartialState

    from hf_cp.train.launch.entry import shutdown_distributed

    spec = json.loads(Path(spec_file).read_text())
    PartialState(backend="gloo", timeout=timedelta(seconds=600))
    for run in spec["runs"]:
        settings = dict(run.get("settings", {}))
        if run.get("trl"):
            losses, grads, logs = trl_run(spec["rows"], run["out"], spec["steps"], spec["model"], **settings)
            plans = []
        else:
            losses, grads, logs, plans = hf_cp_run(spec["rows"], run["out"], spec["steps"], spec["model"], **settings)
        if int(os.environ.get("RANK", "0")) == 0:
            result = {"losses": losses, "grads": grads, "logs": logs, "plans": plans}
            torch.save(result, Path(run["out"]) / "grpo.pt")
    shutdown_distributed()


if __name__ == "__main__":
    _job(sys.argv[1])
