"""DPO pairs with images for the tests (tests/test_dpo_vision.py): the tiny Qwen2.5-VL of
helpers.tiny_vlm, a processor whose tokenizer puts the vision tokens at the tiny model's ids,
TRL's vision pair rows with random images, CPDPOTrainer's first step (in this process, or as a
rank of a torchrun job: `python -m helpers.dpo_vision_runs SPEC.json`), and the reference built
apart from hf_cp: the model's own forward (its own M-RoPE, its own vision scatter) of
prompt+chosen and prompt+rejected of each pair, policy and reference model, and DPO's sigmoid
loss by hand; and TRL's own DPOTrainer with a transformers Qwen2.5-VL processor (its video
processor left out: it needs torchvision, which has no CPU build here)."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
from PIL import Image
from transformers import AutoImageProcessor
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor

from hf_cp.data_prep.vision_processor import TINY_PROCESSOR, VISION_TOKENS, VisionProcessor

from helpers.dpo_runs import SETTINGS, GradTape
from helpers.harness.capture import capture_steps
from helpers.tiny_tokenizer import VOCAB_SIZE, tiny_chat_tokenizer
from helpers.tiny_vlm import IMAGE_TOKEN, build_vlm

BETA = SETTINGS["beta"]
# image sizes (pixels) -> grids of (1, h/4, w/4) patches, h*w/64 placeholder tokens
SIZES = [(16, 16), (16, 32), (24, 24), (32, 16)]


def vision_tokenizer():
    """The tiny byte tokenizer with <|image_pad|>, <|video_pad|>, <|vision_start|>, <|vision_end|>
    at the tiny VLM's ids 290-293 (reserved tokens before them) and the tiny processor's chat
    template (an image part renders <|vision_start|><|image_pad|><|vision_end|>)."""
    tok = tiny_chat_tokenizer()
    reserved = [f"<|reserved_{k}|>" for k in range(IMAGE_TOKEN - VOCAB_SIZE)]
    image, video, start, end = VISION_TOKENS[2], VISION_TOKENS[3], VISION_TOKENS[0], VISION_TOKENS[1]
    tok.add_special_tokens({"additional_special_tokens": SPECIALS_KEPT + reserved + [image, video, start, end]})
    assert tok.convert_tokens_to_ids(image) == IMAGE_TOKEN, tok.convert_tokens_to_ids(image)
    tok.chat_template = (TINY_PROCESSOR / "chat_template.jinja").read_text().rstrip("\n")
    return tok


SPECIALS_KEPT = ["<|im_start|>", "<|im_end|>"]


def vision_processor() -> VisionProcessor:
    """hf_cp's processor parts: vision_tokenizer and the tiny processor's Qwen2-VL image processor
    (patch 4, merge 2, temporal patch 2: the tiny tower's)."""
    return VisionProcessor(vision_tokenizer(), AutoImageProcessor.from_pretrained(str(TINY_PROCESSOR)), {}, "tests")


class ImageOnlyProcessor(Qwen2_5_VLProcessor):
    """transformers' Qwen2.5-VL processor without its video processor (whose class needs
    torchvision): images and text only, which is all TRL's DPO gives it."""

    def check_argument_for_proper_class(self, name, arg):
        if name == "video_processor":
            return None
        return super().check_argument_for_proper_class(name, arg)


def transformers_processor() -> ImageOnlyProcessor:
    vp = vision_processor()
    return ImageOnlyProcessor(
        image_processor=vp.image_processor,
        tokenizer=vp.tokenizer,
        video_processor=None,
        chat_template=vp.tokenizer.chat_template,
    )


def image(i: int, size=(16, 16)) -> Image.Image:
    h, w = size
    return Image.fromarray((np.random.default_rng(100 + i).random((h, w, 3)) * 255).astype("uint8"))


def image_pairs(n: int = 4, long_prompt: int = 0, text: bool = False) -> List[dict]:
    """TRL's vision pairs: an image (of SIZES, one pair with two) in a conversational prompt,
    or (`text`) a text prompt holding the vision tokens; pair 1's prompt text is `long_prompt`
    bytes when given (over a rank's cap)."""
    rows = []
    for i in range(n):
        images = [image(i, SIZES[i % len(SIZES)])]
        if i == 2:
            images.append(image(50 + i, SIZES[(i + 1) % len(SIZES)]))
        question = f"Q{i}: what is it? " * (1 + i % 2)
        if long_prompt and i == 1:
            question = ("look closely " * (long_prompt // 13 + 1))[:long_prompt]
        chosen = " a square" * (1 + i % 3)
        rejected = " a disc, maybe" * (1 + (i + 1) % 2)
        if text:
            pads = "<|vision_start|><|image_pad|><|vision_end|>" * len(images)
            rows.append(dict(prompt=pads + question, chosen=chosen, rejected=rejected, images=images))
            continue
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
        rows.append(
            dict(
                prompt=[{"role": "user", "content": content}],
                chosen=[{"role": "assistant", "content": chosen}],
                rejected=[{"role": "assistant", "content": rejected}],
                images=images,
            )
        )
    return rows


def reference_copy(policy):
    """The reference model: the policy moved by a fixed small noise (tower included), so that the
    loss is not log 2 and each pair's weight depends on the reference's own pass over its images."""
    ref = copy.deepcopy(policy)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for q in ref.parameters():
            q.add_(0.05 * q.abs().mean() * torch.randn(q.shape, generator=gen))
    return ref


def trainer(
    rows,
    out: str,
    tape: Optional[GradTape] = None,
    eval_rows=None,
    family: str = "qwen2_5_vl",
    steps: int = 1,
    ref: str = "noisy",
    processor=None,
    **kw,
):
    """CPDPOTrainer on `rows` with the processor parts; `ref`: "noisy" (reference_copy), "copy"
    (the initial policy) or "none" (no ref_model: precompute_ref_log_probs)."""
    from datasets import Dataset

    from hf_cp.train.objectives.dpo import CPDPOConfig, CPDPOTrainer

    settings = dict(
        SETTINGS,
        cp_max_tokens_per_rank=512,
        cp_tokens_per_step=4096,  # one step holds every pair
        cp_compare_balancer=None,
        cp_profile="cpu",
        cp_shuffle=False,
        cp_plan_lookahead=0,
    )
    settings.update(kw)
    args = CPDPOConfig(output_dir=out, max_steps=steps, **settings)
    model = build_vlm("hf_cp", family=family)
    return CPDPOTrainer(
        model=model,
        ref_model={"noisy": reference_copy, "copy": copy.deepcopy, "none": lambda m: None}[ref](model),
        args=args,
        train_dataset=Dataset.from_list(rows),
        eval_dataset=None if eval_rows is None else Dataset.from_list(eval_rows),
        processing_class=processor or vision_processor(),
        callbacks=[tape] if tape else None,
    )


def trl_step(rows, out: str, family: str = "qwen2_5_vl") -> Dict[str, object]:
    """(loss, every gradient) of TRL's DPOTrainer's first step on every pair in one batch, its own
    vision collator and processor (transformers_processor), sdpa, the same reference model."""
    from datasets import Dataset
    from torch.utils.data import DataLoader
    from trl import DPOConfig, DPOTrainer

    class OneBatch(DPOTrainer):
        def get_train_dataloader(self):
            order = [list(range(len(self.train_dataset)))]
            return DataLoader(self.train_dataset, batch_sampler=order, collate_fn=self.data_collator)

    args = DPOConfig(output_dir=out, max_steps=1, per_device_train_batch_size=len(rows), max_length=None, **SETTINGS)
    model = build_vlm("sdpa", family=family)
    tape = GradTape()
    t = OneBatch(
        model=model,
        ref_model=reference_copy(model),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=transformers_processor(),
        callbacks=[tape],
    )
    t.train()
    return {"loss": next(x["loss"] for x in tape.logs if "loss" in x), "grads": tape.grads[0]}


def hf_cp_step(rows, out: str, family: str = "qwen2_5_vl", **kw):
    """(loss, every gradient, the pairs' token ids and pixels, the step's CP sizes) of CPDPOTrainer's
    first step. Under DeepSpeed (a `deepspeed` setting) the gradients are ZeRO's, assembled whole."""
    tape = GradTape()
    t = trainer(rows, out, tape, family=family, **kw)
    records, stop = capture_steps(t) if kw.get("deepspeed") else ({}, None)
    t.train()
    if stop is not None:
        stop()
        tape.grads = [records[0]["grads"]]
    pairs = [
        {k: t.train_dataset[i][k] for k in ("prompt_ids", "chosen_ids", "rejected_ids", "pixel_values", "image_grid_thw")}
        for i in range(len(t.train_dataset))
    ]
    rec = t.cp_history[0]
    cp_sizes = list(rec.cp_size_samples)
    return {"loss": rec.loss, "grads": tape.grads[0], "pairs": pairs, "cp_sizes": cp_sizes, "family": family}


def _answer_logp(model, prompt: List[int], answer: List[int], pair: dict) -> torch.Tensor:
    """Summed log-prob of `answer` after `prompt` by the model's own forward (position_ids left to it)."""
    ids = torch.tensor(prompt + answer)[None]
    types = (ids == IMAGE_TOKEN).to(torch.int32)
    kw = dict(input_ids=ids, mm_token_type_ids=types, use_cache=False)
    if pair["image_grid_thw"]:
        kw.update(
            pixel_values=torch.tensor(pair["pixel_values"], dtype=torch.float32),
            image_grid_thw=torch.tensor(pair["image_grid_thw"]),
        )
    logits = model(**kw).logits[0].float()
    p = len(prompt)
    logps = torch.log_softmax(logits[p - 1 : -1], dim=-1)
    return logps.gather(1, torch.tensor(answer)[:, None]).sum()


def reference_step(pairs: List[dict], family: str = "qwen2_5_vl") -> Dict[str, object]:
    """The DPO sigmoid loss (mean over pairs) and the policy's gradients, from separate forwards
    of prompt+chosen and prompt+rejected (sdpa, the models' own vision path)."""
    policy = build_vlm("sdpa", family=family)
    ref = reference_copy(policy).eval()
    losses = []
    for pair in pairs:
        p, c, r = pair["prompt_ids"], pair["chosen_ids"], pair["rejected_ids"]
        with torch.no_grad():
            rc, rr = _answer_logp(ref, p, c, pair), _answer_logp(ref, p, r, pair)
        pc, pr = _answer_logp(policy, p, c, pair), _answer_logp(policy, p, r, pair)
        losses.append(-torch.nn.functional.logsigmoid(BETA * ((pc - rc) - (pr - rr))))
    loss = torch.stack(losses).mean()
    loss.backward()
    grads = {n: q.grad.detach().clone() for n, q in policy.named_parameters() if q.grad is not None}
    return {"loss": loss.item(), "grads": grads}


def grad_gap(ours: Dict[str, torch.Tensor], theirs: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Per parameter: max |difference| / max |reference entry| (a missing gradient counts as zero)."""
    out = {}
    for name, b in theirs.items():
        a = ours.get(name, torch.zeros_like(b))
        out[name] = float((a - b).abs().max()) / (float(b.abs().max()) or 1.0)
    return out


def _job(spec_file: str) -> None:
    """A torchrun rank: CPDPOTrainer's first step on the spec's rows; rank 0 saves it."""
    spec = json.loads(Path(spec_file).read_text())
    for run in spec["runs"]:
        got = hf_cp_step(image_pairs(**spec["rows"]), run["out"], **run.get("settings", {}))
        if int(os.environ.get("RANK", "0")) == 0:
            torch.save(got, Path(run["out"]) / "dpo_vision.pt")


if __name__ == "__main__":
    _job(sys.argv[1])
