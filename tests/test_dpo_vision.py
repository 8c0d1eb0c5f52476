"""CPDPOTrainer on TRL's vision pairs (issue 38): tiny random Qwen2.5-VL, Qwen3-VL, Qwen3.5 and
Qwen2-VL, random images of several sizes (one pair with two), tokenised by hf_cp's processor path,
against TRL's own DPOTrainer with a transformers processor, and against a reference built apart
from hf_cp and TRL: the model's own forward (its own M-RoPE, its own vision scatter, sdpa) of
prompt+chosen and of prompt+rejected of each pair, policy and reference model, and DPO's sigmoid
loss by hand, mean over pairs. Loss and every gradient (the tower's included) at world 1, and at
world 2 (gloo processes) with one pair spread over the CP group of 2; the splice of each answer's
M-RoPE positions; and what stays refused, by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("trl")  # the optional `trl` extra

from datasets import Dataset  # noqa: E402

from hf_cp.train.data.columns import read_token_columns  # noqa: E402
from hf_cp.train.data.vision_columns import shared_prompt_rope, vision_reader  # noqa: E402
from hf_cp.samples.masks import SampleMask  # noqa: E402
from hf_cp.samples.vision import VisionInputError, sample_vision  # noqa: E402
from hf_cp.train.setup.vision_setup import attach_vision  # noqa: E402
from hf_cp.train.step.vision_tower import vision_tower_of  # noqa: E402

from helpers.dpo_vision_runs import (  # noqa: E402
    grad_gap,
    hf_cp_step,
    image,
    image_pairs,
    reference_step,
    trainer,
    transformers_processor,
    trl_step,
    vision_processor,
)
from helpers.dpo_runs import GradTape  # noqa: E402
from helpers.harness.job import run_distributed, zero2_config  # noqa: E402
from helpers.tiny_vlm import IMAGE_TOKEN, build_vlm  # noqa: E402

LOSS_TOL = 1e-5  # relative
GRAD_TOL = 2e-5  # max |difference| / max |reference gradient| of a parameter (fp32 noise: ~1e-6)


def _check(got: dict, label: str) -> None:
    ref = reference_step(got["pairs"], got["family"])
    gaps = grad_gap(got["grads"], ref["grads"])
    worst = max(gaps, key=gaps.get)
    tower = max(v for k, v in gaps.items() if ".visual." in k)
    print(f"{label}: loss {got['loss']!r} reference {ref['loss']!r}; worst gradient {gaps[worst]:.2e} ({worst}), "
          f"tower {tower:.2e}")  # fmt: skip
    assert got["loss"] == pytest.approx(ref["loss"], rel=LOSS_TOL)
    assert set(got["grads"]) == set(ref["grads"])
    assert any(".visual." in k for k in ref["grads"]), "the tower trains"
    assert gaps[worst] < GRAD_TOL, (worst, gaps[worst])


# ---------------------------------------------------------------- exactness
@pytest.mark.parametrize(
    "family, text",
    [
        ("qwen2_5_vl", False),
        ("qwen2_5_vl", True),
        ("qwen3_vl", False),
        pytest.param("qwen3_5", False, marks=pytest.mark.slow),
        pytest.param("qwen2_vl", False, marks=pytest.mark.slow),
    ],
    ids=["qwen2_5_vl", "qwen2_5_vl-text", "qwen3_vl", "qwen3_5", "qwen2_vl"],
)
def test_pairs_with_images_equal_separate_forwards_of_each_answer(tmp_path, family, text):
    """World 1: one step of 4 pairs (images of 16x16 to 32x16 pixels, pair 2 with two), each
    pair one shared-prompt sample; conversational pairs, and text pairs whose prompt holds the
    vision tokens; Qwen3-VL's DeepStack rows, Qwen3.5's Gated DeltaNet layer. Measured: loss
    within 1.3e-6 relative, gradients within 3.1e-6 (Qwen2.5-VL 3.7e-7 / 1.6e-6, its text pairs
    1.2e-6 / 3.1e-6, Qwen3-VL 8.5e-7 / 2.0e-6, Qwen3.5 1.5e-7 / 2.5e-6, Qwen2-VL 7.6e-8 / 3.0e-6)."""
    got = hf_cp_step(image_pairs(4, text=text), str(tmp_path), family=family)
    grids = [g for p in got["pairs"] for g in p["image_grid_thw"]]
    assert len(grids) == 5 and len({tuple(g) for g in grids}) >= 3, grids
    _check(got, f"world 1 {family}{' text' if text else ''}")


@pytest.mark.parametrize("family", ["qwen2_5_vl", pytest.param("qwen3_vl", marks=pytest.mark.slow)])
def test_pairs_with_images_equal_trls_dpo_trainer_with_the_models_processor(tmp_path, family):
    """TRL's own DPOTrainer, its vision collator and a transformers Qwen2.5-VL processor (without
    its video processor, which needs torchvision), every pair in one padded batch, against
    CPDPOTrainer given that same processor as processing_class."""
    rows = image_pairs(4)
    got = hf_cp_step(rows, str(tmp_path / "hf_cp"), family=family, processor=transformers_processor())
    theirs = trl_step(rows, str(tmp_path / "trl"), family=family)
    gaps = grad_gap(got["grads"], theirs["grads"])
    worst = max(gaps, key=gaps.get)
    print(f"{family}: loss {got['loss']!r} TRL {theirs['loss']!r}; worst gradient {gaps[worst]:.2e} ({worst})")
    assert got["loss"] == pytest.approx(theirs["loss"], rel=LOSS_TOL)
    assert set(got["grads"]) == set(theirs["grads"])
    assert gaps[worst] < GRAD_TOL, (worst, gaps[worst])


@pytest.mark.slow
def test_world_2_with_a_pair_spread_over_the_group_equals_separate_forwards(tmp_path):
    """World 2 (gloo): pair 1's prompt (its image and 300 bytes) is over a rank's cap of 256
    tokens, so it runs over the CP group of 2 (auto's choice, ring zigzag under static, blocks
    under magi; Qwen3-VL under auto; under DeepSpeed ZeRO-2), its image encoded on one member and
    its rows sent to the other."""
    named = {
        "auto": {},
        "static": dict(cp_balancer="static"),
        "magi": dict(cp_balancer="magi"),
        "qwen3_vl_auto": dict(family="qwen3_vl"),
        "auto_zero2": dict(deepspeed=zero2_config()),  # the reference model a DeepSpeed engine too
    }
    runs = [
        dict(out=str(tmp_path / name), settings=dict(cp_max_tokens_per_rank=256, **settings))
        for name, settings in named.items()
    ]
    run_distributed(dict(rows=dict(n=4, long_prompt=300), runs=runs), 2, timeout=900, module="helpers.dpo_vision_runs")
    for run in runs:
        got = torch.load(Path(run["out"]) / "dpo_vision.pt")
        assert any(int(g) > 1 for g in got["cp_sizes"]), (run["out"], got["cp_sizes"])
        _check(got, f"world 2 {Path(run['out']).name}")


def test_precomputed_reference_log_probs_with_images_equal_a_reference_model(tmp_path):
    """precompute_ref_log_probs=True (TRL refuses it with images): hf_cp's planned pass over the
    training pairs with the initial policy, its tower encoding the images, before the first
    update. Two steps equal a run with ref_model a copy of the initial policy."""
    rows = image_pairs(6)
    runs = {}
    for name, kw in (("pre", dict(ref="none", precompute_ref_log_probs=True)), ("copy", dict(ref="copy"))):
        tape = GradTape()
        t = trainer(rows, str(tmp_path / name), tape, steps=2, cp_tokens_per_step=300, **kw)
        t.train()
        runs[name] = ([r.loss for r in t.cp_history], tape.grads)
    (pre_losses, pre_grads), (losses, grads) = runs["pre"], runs["copy"]
    print("precomputed", pre_losses, "reference model", losses)
    assert len(losses) == 2 and pre_losses == pytest.approx(losses, rel=LOSS_TOL)
    assert losses[1] != pytest.approx(0.6931471805599453, rel=1e-6), "step 2's policy moved from the reference"
    for step, (a, b) in enumerate(zip(pre_grads, grads)):
        gaps = grad_gap(a, b)
        print(f"step {step + 1}: gradients within {max(gaps.values()):.2e}")
        assert max(gaps.values()) < GRAD_TOL, max(gaps, key=gaps.get)


def test_evaluation_of_pairs_with_images_gives_the_reference_loss(tmp_path):
    rows = image_pairs(3)
    t = trainer(rows, str(tmp_path), eval_rows=rows)
    metrics = t.evaluate()
    pairs = [
        {
            k: t.train_dataset[i][k]
            for k in ("prompt_ids", "chosen_ids", "rejected_ids", "pixel_values", "image_grid_thw")
        }
        for i in range(len(t.train_dataset))
    ]
    ref = reference_step(pairs)
    print("eval loss", metrics["eval_loss"], "reference", ref["loss"])
    assert metrics["eval_loss"] == pytest.approx(ref["loss"], rel=LOSS_TOL)


# ---------------------------------------------------------------- tokenisation and positions
def test_a_pair_is_tokenised_as_trls_vision_collator_with_each_image_expanded(tmp_path):
    rows = image_pairs(3)
    t = trainer(rows, str(tmp_path))
    tok = vision_processor().tokenizer
    for i, row in enumerate(rows):
        got = t.train_dataset[i]
        prompt = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)
        whole = tok.apply_chat_template(row["prompt"] + row["chosen"], tokenize=True, return_dict=True)
        tokens = [int(np.prod(g)) // 4 for g in got["image_grid_thw"]]
        assert len(tokens) == len(row["images"])
        expanded = []
        for x in prompt["input_ids"]:
            expanded += [x] * tokens.pop(0) if x == IMAGE_TOKEN else [x]
        assert got["prompt_ids"] == expanded
        assert got["chosen_ids"] == whole["input_ids"][len(prompt["input_ids"]) :]
        assert got["input_ids"] == got["prompt_ids"] + got["chosen_ids"] + got["rejected_ids"]
        assert len(got["pixel_values"]) == sum(int(np.prod(g)) for g in got["image_grid_thw"])
    # TRL's one-image column `image` tokenises as a one-image `images` list
    single = [{k: v for k, v in dict(r, image=r["images"][0]).items() if k != "images"} for r in rows[:2]]
    one = trainer(single, str(tmp_path / "image"))
    for i in range(2):
        assert one.train_dataset[i]["input_ids"] == t.train_dataset[i]["input_ids"]
        assert one.train_dataset[i]["image_grid_thw"] == t.train_dataset[i]["image_grid_thw"]


def test_each_answers_m_rope_positions_are_those_of_prompt_and_answer_alone():
    """The spliced positions equal the model's own rope-index function over prompt+chosen and
    over prompt+rejected; the whole sample's would put the rejected answer after the chosen one."""
    model = build_vlm("hf_cp")
    tower = vision_tower_of(model, "test")
    rng = np.random.default_rng(0)
    prompt = [5, 6, 292] + [IMAGE_TOKEN] * 4 + [293, 7, 8]
    chosen, rejected = rng.integers(0, 200, 6).tolist(), rng.integers(0, 200, 9).tolist()
    ids = prompt + chosen + rejected
    grids = {"image": np.asarray([[1, 4, 4]]), "video": np.zeros((0, 3), np.int64)}
    mask = SampleMask.shared_prompt(len(prompt), [len(chosen), len(rejected)])
    row = {"input_ids": ids, "pixel_values": rng.standard_normal((16, 96)).astype(np.float32)}
    row["image_grid_thw"] = grids["image"]
    got = vision_reader(lambda sid: row, tower.token_ids, tower.merge, tower.rope_positions, masks={0: mask})(0)
    alone_c = tower.rope_positions(prompt + chosen, grids, None)
    alone_r = tower.rope_positions(prompt + rejected, grids, None)
    p = len(prompt)
    assert (got.rope_positions[:, : p + len(chosen)] == alone_c).all()
    assert (got.rope_positions[:, p + len(chosen) :] == alone_r[:, p:]).all()
    whole = tower.rope_positions(ids, grids, None)
    assert not (whole[:, p + len(chosen) :] == alone_r[:, p:]).all(), "the splice matters"
    late = prompt[:3] + [9] * 4 + prompt[7:]  # the image moved into the rejected answer
    moved = {"input_ids": late + chosen[:2] + [292] + [IMAGE_TOKEN] * 4 + [293]}
    bad = SampleMask.shared_prompt(len(late), [2, 6])
    with pytest.raises(VisionInputError, match="after the shared prompt's"):
        shared_prompt_rope(1, moved["input_ids"], bad, _items(moved, tower), tower.rope_positions, grids, None)


def _items(row, tower):
    pix = {"image": np.zeros((16, 96), np.float32), "video": None}
    return sample_vision(1, row["input_ids"], pix, {"image": [[1, 4, 4]]}, tower.token_ids, tower.merge)


# ---------------------------------------------------------------- refusals, by name
def test_an_image_in_an_answer_is_refused_naming_the_pair(tmp_path):
    rows = image_pairs(3)
    for i, row in enumerate(rows):  # content as parts in every row (a dataset's column has one type)
        parts = [{"type": "image", "text": None}] if i == 1 else []
        row["chosen"] = [{"role": "assistant", "content": parts + [{"type": "text", "text": " it"}]}]
    with pytest.raises(ValueError, match="train pair 1: its chosen answer has an image or video part"):
        trainer(rows, str(tmp_path))
    rows = image_pairs(3, text=True)
    rows[2]["rejected"] = rows[2]["rejected"] + "<|vision_start|><|image_pad|><|vision_end|>"
    with pytest.raises(ValueError, match="train pair 2: its rejected answer holds an image or video pad token"):
        trainer(rows, str(tmp_path / "text"))


def test_images_without_the_models_processor_are_refused_by_name(tmp_path):
    from helpers.dpo_runs import SETTINGS
    from helpers.tiny_tokenizer import tiny_chat_tokenizer

    from hf_cp.train.objectives.dpo import CPDPOConfig, CPDPOTrainer

    args = CPDPOConfig(output_dir=str(tmp_path), max_steps=1, cp_profile="cpu", **SETTINGS)
    model = build_vlm("hf_cp")
    with pytest.raises(ValueError, match="need the model.s processor as processing_class, got TokenizersBackend"):
        CPDPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(image_pairs(2)),
                     processing_class=tiny_chat_tokenizer())  # fmt: skip
    # `hf-cp train --dry-run` has no processing class: the same refusal
    with pytest.raises(ValueError, match="got none .*`hf-cp train` passes the model's tokenizer"):
        CPDPOTrainer.cp_check_datasets(Dataset.from_list(image_pairs(2)), None)


def test_video_and_image_evaluation_after_text_training_are_refused(tmp_path):
    rows = [dict(r, videos=[[0]]) for r in image_pairs(2)]
    with pytest.raises(ValueError, match="train_dataset has the column 'videos'; DPO pairs with video are not built"):
        trainer(rows, str(tmp_path / "video"))
    text = [{"prompt": "Q: which?", "chosen": " this one", "rejected": " that"}] * 2
    with pytest.raises(ValueError, match="the eval pairs have images but the training pairs do not"):
        trainer(text, str(tmp_path / "eval"), eval_rows=image_pairs(2))


def test_image_pairs_under_sharded_parameters_are_refused_by_name():
    """FSDP2 / ZeRO-3: the tower runs inside the embedding pass; DPO's pairs take the same refusal."""
    rows = [
        {"input_ids": [5, 292] + [IMAGE_TOKEN] * 4 + [293, 6, 7], "pixel_values": np.zeros((16, 96), np.float32),
         "image_grid_thw": [[1, 4, 4]]}
    ]  # fmt: skip
    ds = Dataset.from_list(rows)
    for sharding in ("fsdp2", "zero3"):
        with pytest.raises(ValueError, match=f"sharded by {sharding}"):
            attach_vision(ds, read_token_columns(ds), build_vlm("hf_cp"), "CPDPOTrainer", sharding=sharding,
                          shared_prompts=True, vision_pairs=True)  # fmt: skip


def test_kto_grpo_and_rloo_with_images_are_refused_by_name_before_any_work(tmp_path):
    """KTO's shared-prompt samples carry no images. Before (measured): KTO failed in TRL with "The
    dataset appears to be vision-related ..., but the provided model does not seem to be a
    vision-language model", with a vision-language model. GRPO and RLOO train TRL's vision rows
    (tests/test_grpo_vision.py) with the model's processor, and refuse a bare tokenizer by name."""
    from helpers import grpo_runs, kto_runs
    from helpers.tiny_tokenizer import tiny_chat_tokenizer

    from hf_cp.train.objectives.grpo import CPGRPOConfig, CPGRPOTrainer
    from hf_cp.train.objectives.rloo import CPRLOOConfig, CPRLOOTrainer

    images = [image(0)]
    kto = [dict(r, images=images) for r in kto_runs.kto_rows(4)]
    with pytest.raises(ValueError, match="CPKTOTrainer: train_dataset has the column 'images'.*carry no images"):
        kto_runs.hf_cp_trainer(kto, str(tmp_path / "kto"), 1, family="qwen2_5_vl")
    prompts = Dataset.from_list([dict(r, image=images[0]) for r in grpo_runs.prompt_rows(4)])
    for trainer_class, config_class in ((CPGRPOTrainer, CPGRPOConfig), (CPRLOOTrainer, CPRLOOConfig)):
        name = trainer_class.__name__
        args = config_class(output_dir=str(tmp_path / name), max_steps=1, **grpo_runs.SETTINGS)
        with pytest.raises(ValueError, match=f"{name}: prompts with images are generated by TRL with the model's "
                                             "transformers processor"):  # fmt: skip
            trainer_class(model=build_vlm("hf_cp"), reward_funcs=grpo_runs.reward_a, args=args,
                          train_dataset=prompts, processing_class=tiny_chat_tokenizer())  # fmt: skip
