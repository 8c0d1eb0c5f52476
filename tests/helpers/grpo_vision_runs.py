"""GRPO with images for the tests (tests/test_grpo_vision.py): the tiny random Qwen2.5-VL of
helpers.tiny_vlm saved to a folder (TRL loads the reference model from it when beta > 0), TRL's
vision prompt rows (an `images` column of random images of several sizes, one prompt with two),
and CPGRPOTrainer or TRL's own GRPOTrainer with the transformers Qwen2.5-VL processor of
helpers.dpo_vision_runs (its video processor left out). Generation is replaced alike in both by
fixed completions (helpers.grpo_runs.fixed_completion, through the processor's tokenizer), so
both trainers see the same rollouts at any world size; each run records per step the loss and
every parameter's gradient (the vision tower's included) before the optimizer step.
`python -m helpers.grpo_vision_runs SPEC.json`: a rank of a torchrun job."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import torch

from helpers.dpo_runs import GradTape
from helpers.dpo_vision_runs import SIZES, image, transformers_processor
from helpers.grpo_runs import SETTINGS, _reset_accelerate, fixed_completion
from helpers.tiny_vlm import build_vlm

G = 3  # completions per prompt
PROMPTS = 4
ROWS_PER_STEP = G * PROMPTS


def prompt_rows(n: int = PROMPTS, long_prompt: int = 0) -> List[dict]:
    """TRL's vision prompt rows: an image (of SIZES; prompt 2 with two) before a question;
    prompt 1's question is `long_prompt` bytes when given (over a rank's cap at world 2)."""
    rows = []
    for i in range(n):
        images = [image(i, SIZES[i % len(SIZES)])]
        if i == 2:
            images.append(image(50 + i, SIZES[(i + 1) % len(SIZES)]))
        question = f"Q{i}: spell what you see " + "please " * (i % 3)
        if long_prompt and i == 1:
            question = ("look closely " * (long_prompt // 13 + 1))[:long_prompt]
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
        rows.append({"prompt": [{"role": "user", "content": content}], "images": images})
    return rows


def reward_a(completions, **kwargs) -> List[float]:
    """The toy reward: the share of 'a' in the completion's text (a conversational completion:
    its assistant message)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [t.count("a") / max(len(t), 1) for t in texts]


def left_padding_processor():
    """helpers.dpo_vision_runs' transformers processor with its tokenizer padding on the left.
    TRL's GRPO left-pads the prompt ids itself but takes mm_token_type_ids from the processor's
    own padding of the same prompts: with a tokenizer that pads on the right, those types miss
    the image tokens of every padded row, and the model's M-RoPE positions of those rows are
    wrong in TRL's loss forward (measured: per-token log-probs 2-6e-4 off each row's own forward,
    gradients up to 10% off). Padding on the left, TRL's forward is each row's own."""
    processor = transformers_processor()
    processor.tokenizer.padding_side = "left"
    return processor


class FixedCompletions:
    """Generation replaced by fixed_completion, tokenised by the processor's tokenizer (mixed in
    before the trainer class); `completion_prefix` token ids start every completion (a test's
    image placeholder in a completion)."""

    completion_prefix: List[int] = []

    def _fixed(self, prompt_ids):
        first = self.accelerator.process_index * len(prompt_ids)
        G = self.num_generations
        return [
            self.completion_prefix
            + fixed_completion(self._tokenizer, list(ids), (first + i) % G, self.max_completion_length)
            for i, ids in enumerate(prompt_ids)
        ]


class FixedGRPO(FixedCompletions):
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return self._fixed(prompt_ids), None


class FixedRLOO(FixedCompletions):
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
        return self._fixed(prompt_ids)  # RLOO's returns the completion ids alone


def model_dir(root: Path) -> str:
    """The tiny Qwen2.5-VL (build_vlm's seed) saved under root/vlm (once)."""
    path = Path(root) / "vlm"
    if not (path / "config.json").exists():
        build_vlm("sdpa").save_pretrained(str(path))
    return str(path)


def load_model(path: str, attn: str):
    from transformers import Qwen2_5_VLForConditionalGeneration

    import hf_cp.attention.interface  # noqa: F401  registers attn_implementation="hf_cp"

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, attn_implementation=attn, dtype=torch.float32)
    model.config.use_cache = False
    return model.train()


def _settings(kw: dict, cp: bool) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    settings = dict(SETTINGS, num_generations=G, per_device_train_batch_size=ROWS_PER_STEP // world)
    if cp:
        settings.update(cp_max_tokens_per_rank=1024, cp_compare_balancer=None, cp_profile="cpu", cp_plan_lookahead=0)
    settings.update({k: v for k, v in kw.items() if cp or not k.startswith("cp_")})
    return settings


def _classes(trl: bool, rloo: bool):
    """(config class, trainer class, its fixed generation) of the run."""
    if rloo:
        from trl import RLOOConfig, RLOOTrainer

        from hf_cp.train.objectives.rloo import CPRLOOConfig, CPRLOOTrainer

        return (RLOOConfig, RLOOTrainer, FixedRLOO) if trl else (CPRLOOConfig, CPRLOOTrainer, FixedRLOO)
    from trl import GRPOConfig, GRPOTrainer

    from hf_cp.train.objectives.grpo import CPGRPOConfig, CPGRPOTrainer

    return (GRPOConfig, GRPOTrainer, FixedGRPO) if trl else (CPGRPOConfig, CPGRPOTrainer, FixedGRPO)


def trainer(rows, out: str, steps: int, model_path: str, tape: Optional[GradTape] = None, trl: bool = False,
            processor=None, rloo: bool = False, completion_prefix=(), dataset=None, **kw):  # fmt: skip
    """CPGRPOTrainer (or, `trl`, TRL's GRPOTrainer; `rloo`: the RLOO trainers) with fixed
    completions on `rows` (or `dataset`)."""
    from datasets import Dataset

    Config, Base, Generation = _classes(trl, rloo)

    class Fixed(Generation, Base):
        pass

    Fixed.completion_prefix = list(completion_prefix)

    _reset_accelerate()
    args = Config(output_dir=out, max_steps=steps, **_settings(kw, not trl))
    return Fixed(
        model=load_model(model_path, "sdpa" if trl else "hf_cp"),
        reward_funcs=reward_a,
        args=args,
        train_dataset=dataset if dataset is not None else Dataset.from_list(rows),
        processing_class=processor or left_padding_processor(),
        callbacks=[tape] if tape else None,
    )


def run(rows, out: str, steps: int, model_path: str, trl: bool = False, **kw):
    """(per-step losses, per-step gradients, logs, the trainer) of one run."""
    tape = GradTape()
    t = trainer(rows, out, steps, model_path, tape, trl=trl, **kw)
    t.train()
    losses = [x["loss"] for x in tape.logs if "loss" in x]
    return losses, tape.grads, tape.logs, t


def _job(spec_file: str) -> None:
    """A torchrun rank: the spec's runs; rank 0 saves each run's losses, gradients and CP sizes."""
    from datetime import timedelta

    from accelerate import PartialState

    from hf_cp.train.launch.entry import shutdown_distributed

    spec = json.loads(Path(spec_file).read_text())
    PartialState(backend="gloo", timeout=timedelta(seconds=600))
    for r in spec["runs"]:
        losses, grads, logs, t = run(prompt_rows(**spec["rows"]), r["out"], spec["steps"], spec["model"],
                                     trl=r.get("trl", False), **r.get("settings", {}))  # fmt: skip
        sizes = [sorted(int(s) for s in rec.cp_size_samples) for rec in getattr(t, "cp_history", [])]
        if int(os.environ.get("RANK", "0")) == 0:
            torch.save({"losses": losses, "grads": grads, "cp_sizes": sizes}, Path(r["out"]) / "grpo_vision.pt")
    shutdown_distributed()


if __name__ == "__main__":
    _job(sys.argv[1])
