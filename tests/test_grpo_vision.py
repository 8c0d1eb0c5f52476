"""CPGRPOTrainer and CPRLOOTrainer on TRL's vision prompt rows (issue 38): the tiny random
Qwen2.5-VL, prompts with random images of several sizes (one with two), TRL's own generation
and scoring with the transformers Qwen2.5-VL processor (its video processor left out), and the
fixed completions of helpers.grpo_vision_runs so that both trainers see the same rollouts.
Compared: the step's loss and every gradient (the vision tower's included) with TRL's own
GRPOTrainer / RLOOTrainer on the same rollouts at world 1, and with a reference built apart
from both (each row's prompt+completion through the model's own forward, alone); at world 2
(gloo, slow) with a prompt group spread over a CP group of 2. Break tests: each completion's
M-RoPE positions left unspliced, and one image's embedding gradient dropped. And what stays
refused, by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")  # the optional `trl` extra

from datasets import Dataset  # noqa: E402

import hf_cp.train.data.vision_columns as vision_columns  # noqa: E402
import hf_cp.train.step.vision_tower as vision_tower  # noqa: E402

from helpers.dpo_vision_runs import grad_gap, transformers_processor, vision_tokenizer  # noqa: E402
from helpers.grpo_vision_runs import left_padding_processor, load_model, model_dir, prompt_rows, run, trainer  # noqa: E402
from helpers.tiny_vlm import IMAGE_TOKEN  # noqa: E402

LOSS_TOL = 1e-5  # relative (with an absolute floor: GRPO's step-1 loss is near 0)
GRAD_TOL = 2e-5  # max |difference| / max |reference gradient| of a parameter (fp32 noise: ~1e-6)
CONFIGS = {"dapo": {}, "grpo_beta": dict(loss_type="grpo", beta=0.1)}
_TRL = {}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("grpo_vision_model"))


def trl_result(name: str, model_path: str, tmp: Path, rloo: bool = False):
    key = (name, rloo)
    if key not in _TRL:
        kw = {} if rloo else CONFIGS[name]
        losses, grads, _, _ = run(prompt_rows(), str(tmp / f"trl-{name}"), 1, model_path, trl=True, rloo=rloo, **kw)
        _TRL[key] = (losses, grads)
    return _TRL[key]


def gaps_of(grads, ref_grads) -> dict:
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    assert any(".visual." in k for k in ref_grads), "the tower trains"
    return grad_gap(grads, ref_grads)


def assert_same(losses, grads, ref, label: str) -> str:
    ref_losses, ref_grads = ref
    assert len(losses) == len(ref_losses) == 1, (losses, ref_losses)
    assert losses[0] == pytest.approx(ref_losses[0], rel=LOSS_TOL, abs=1e-7), (label, losses, ref_losses)
    gaps = gaps_of(grads[0], ref_grads[0])
    worst = max(gaps, key=gaps.get)
    tower = max(v for k, v in gaps.items() if ".visual." in k)
    line = (f"{label}: loss {losses[0]!r} vs {ref_losses[0]!r}; worst gradient {gaps[worst]:.2e} ({worst}), "
            f"tower {tower:.2e}")  # fmt: skip
    print(line)
    assert gaps[worst] < GRAD_TOL, line
    return line


def rows_alone_reference(trained, model_path: str) -> dict:
    """dapo's loss gradient from each row's prompt+completion through the model's own forward
    (its own M-RoPE and vision scatter, sdpa), alone: -sum(adv * ratio over loss tokens) / tokens."""
    ro = trained._cp_rollout
    model = load_model(model_path, "sdpa")
    total = float(ro.counts().sum())
    loss = 0.0
    for r in range(ro.rows):
        prompt, completion = ro.prompts[r], ro.completions[r]
        ids = torch.tensor(prompt + completion)[None]
        kw = dict(input_ids=ids, mm_token_type_ids=(ids == IMAGE_TOKEN).to(torch.int32), use_cache=False)
        if ro.images is not None and ro.images[r] is not None:
            kw.update(pixel_values=torch.tensor(ro.images[r][0]), image_grid_thw=torch.tensor(ro.images[r][1]))
        logits = model(**kw).logits[0].float()
        lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1).gather(1, torch.tensor(completion)[:, None])[:, 0]
        adv = float(ro.advantages[r][0])
        loss = loss - (adv * torch.exp(lp - lp.detach()) * torch.tensor(ro.loss_masks[r])).sum() / total
    loss.backward()
    return {n: q.grad.detach().clone() for n, q in model.named_parameters() if q.grad is not None}


# --------------------------------------------------------------------------- world 1
@pytest.mark.parametrize("name", list(CONFIGS))
def test_grpo_with_images_equals_trls_grpo_at_world_1(name, model_path, tmp_path):
    ref = trl_result(name, model_path, tmp_path)
    losses, grads, logs, t = run(prompt_rows(), str(tmp_path / "cp"), 1, model_path, **CONFIGS[name])
    assert_same(losses, grads, ref, f"GRPO {name} with images, world 1 vs TRL")
    assert [x["cp/prompt_groups"] for x in logs if "cp/prompt_groups" in x] == [4.0]
    assert t.cp_vision is not None
    # TRL's rows, G per prompt in its sampler's order: prompt 2 with two images, the others one
    assert sorted(len(im[1]) for im in t._cp_rollout.images) == [1] * 9 + [2] * 3


def test_grpo_with_images_equals_each_row_alone(model_path, tmp_path):
    """Against a reference apart from TRL and hf_cp: each row's prompt+completion alone. With a
    processor whose tokenizer pads on the right (transformers' default here), TRL's own loss
    forward misplaces the image token types of padded rows (helpers.grpo_vision_runs
    .left_padding_processor); hf_cp takes the prompt tokens and pixels, not those types, and is
    exact with either."""
    processor = transformers_processor()
    assert processor.tokenizer.padding_side == "right"
    losses, grads, _, t = run(prompt_rows(), str(tmp_path / "cp"), 1, model_path, processor=processor)
    ref = rows_alone_reference(t, model_path)
    gaps = gaps_of(grads[0], ref)
    worst = max(gaps, key=gaps.get)
    print(f"GRPO with images (a right-padding processor) vs each row alone: worst gradient {gaps[worst]:.2e} ({worst})")
    assert gaps[worst] < GRAD_TOL, (worst, gaps[worst])


def test_rloo_with_images_equals_trls_rloo_at_world_1(model_path, tmp_path):
    ref = trl_result("rloo", model_path, tmp_path, rloo=True)
    losses, grads, _, t = run(prompt_rows(), str(tmp_path / "cp"), 1, model_path, rloo=True)
    assert_same(losses, grads, ref, "RLOO with images, world 1 vs TRL")
    assert t.cp_vision is not None


# --------------------------------------------------------------------------- break tests
def test_unspliced_completion_positions_are_caught(model_path, tmp_path, monkeypatch):
    """Each completion's M-RoPE positions taken from the whole [prompt][c1]...[cG] sequence
    (not prompt+completion alone): the gradients leave the tolerance."""

    def whole(sid, ids, mask, items, rope_positions, grids, seconds):
        return rope_positions(list(ids), grids, seconds)

    monkeypatch.setattr(vision_columns, "shared_prompt_rope", whole)
    ref = trl_result("dapo", model_path, tmp_path)
    losses, grads, _, _ = run(prompt_rows(), str(tmp_path / "cp"), 1, model_path)
    gaps = gaps_of(grads[0], ref[1][0])
    worst = max(gaps, key=gaps.get)
    print(f"unspliced completion positions: worst gradient {gaps[worst]:.2e} ({worst})")
    assert gaps[worst] > 10 * GRAD_TOL


def test_one_images_embedding_gradient_dropped_is_caught(model_path, tmp_path, monkeypatch):
    """The first image each encoding encodes loses its rows' gradient (the graph kept whole, as
    tests/test_vision_exact.py's break): the tower's gradients leave the tolerance."""
    real = vision_tower.VisionTower.encode
    dropped = []

    def encode_dropping_first(self, pixels, grid):
        rows = real(self, pixels, grid)
        k = int(grid[0].prod()) // self.merge**2
        dropped.append(k)
        return torch.cat([rows[:k].detach() + rows[:k] * 0.0, rows[k:]])

    monkeypatch.setattr(vision_tower.VisionTower, "encode", encode_dropping_first)
    ref = trl_result("dapo", model_path, tmp_path)
    losses, grads, _, _ = run(prompt_rows(), str(tmp_path / "cp"), 1, model_path)
    assert dropped, "no image was encoded"
    gaps = gaps_of(grads[0], ref[1][0])
    tower = max(v for k, v in gaps.items() if ".visual." in k)
    print(f"one image's embedding gradient dropped: tower gradient {tower:.2e}")
    assert tower > 10 * GRAD_TOL


# --------------------------------------------------------------------------- world 2
@pytest.mark.slow
def test_world_2_with_a_prompt_group_over_two_ranks_equals_trls_world_1(model_path, tmp_path):
    """Two gloo processes, prompt 1's question 300 bytes so that its group (~420 tokens) runs over
    a CP group of 2 under a 256-token cap; against TRL's GRPOTrainer at world 1 on the same
    rollouts (the fixed completions are a function of the global row). GRPO and RLOO."""
    from helpers.harness.job import run_distributed

    rows = dict(long_prompt=300)
    runs = [
        dict(out=str(tmp_path / "grpo"), settings=dict(cp_max_tokens_per_rank=256)),
        dict(out=str(tmp_path / "rloo"), settings=dict(cp_max_tokens_per_rank=256, rloo=True)),
    ]
    spec = dict(rows=rows, steps=1, model=model_path, runs=runs)
    run_distributed(spec, 2, timeout=900, module="helpers.grpo_vision_runs")
    for r, rloo in zip(runs, (False, True)):
        got = torch.load(Path(r["out"]) / "grpo_vision.pt", weights_only=False)
        assert any(s > 1 for s in got["cp_sizes"][0]), got["cp_sizes"]
        losses, grads, _, _ = run(
            prompt_rows(**rows), str(tmp_path / f"trl-{rloo}"), 1, model_path, trl=True, rloo=rloo
        )
        assert_same(got["losses"], got["grads"], (losses, grads), f"{'RLOO' if rloo else 'GRPO'} with images, world 2")


# --------------------------------------------------------------------------- refused by name
def _rows_with(column: str, value) -> Dataset:
    rows = prompt_rows(2)
    return Dataset.from_list([dict(r, **{column: value}) for r in rows])


def test_a_video_column_is_refused_by_name(model_path, tmp_path):
    with pytest.raises(ValueError, match=r"CPGRPOTrainer: train_dataset has the column 'videos'; TRL's GRPO generates "
                                         r"from images only"):  # fmt: skip
        trainer(None, str(tmp_path), 1, model_path, dataset=_rows_with("videos", ["clip.mp4"]))


def test_a_processors_pixel_columns_are_refused_by_name(model_path, tmp_path):
    """TRL's GRPO drops columns other than prompt/image/images: pre-computed pixels would vanish."""
    rows = [{"prompt": "Q: what?", "pixel_values": [[0.0] * 96] * 16, "image_grid_thw": [[1, 4, 4]]}] * 2
    with pytest.raises(ValueError, match=r"CPRLOOTrainer: train_dataset has a processor's vision column\(s\) "
                                         r"\['pixel_values', 'image_grid_thw'\]"):  # fmt: skip
        trainer(None, str(tmp_path), 1, model_path, rloo=True, dataset=Dataset.from_list(rows))


def test_images_with_a_bare_tokenizer_are_refused_by_name(model_path, tmp_path):
    with pytest.raises(ValueError, match=r"CPGRPOTrainer: prompts with images are generated by TRL with the model's "
                                         r"transformers processor .* got \w+: pass processing_class=AutoProcessor"):  # fmt: skip
        trainer(prompt_rows(2), str(tmp_path), 1, model_path, processor=vision_tokenizer())


def test_images_under_sharded_parameters_are_refused_by_name():
    """FSDP2 / ZeRO-3: the tower runs inside the language model's embedding pass (as for DPO's pairs)."""
    from types import SimpleNamespace

    from hf_cp.train.objectives.rollout_vision import check_image_prompts

    datasets = {"train_dataset": Dataset.from_list(prompt_rows(2)), "eval_dataset": None}
    fsdp2 = SimpleNamespace(fsdp="full_shard", fsdp_plugin_args={"fsdp_version": 2})
    zero3 = SimpleNamespace(deepspeed={"zero_optimization": {"stage": 3}})
    for args, sharding in ((fsdp2, "fsdp2"), (zero3, "zero3")):
        with pytest.raises(
            ValueError, match=f"CPRLOOTrainer: prompts with images and parameters sharded by {sharding}"
        ):
            check_image_prompts(datasets, left_padding_processor(), args, "CPRLOOTrainer")
    assert check_image_prompts(datasets, left_padding_processor(), SimpleNamespace(), "CPGRPOTrainer")


def test_an_image_placeholder_in_a_completion_is_refused_by_name(model_path, tmp_path):
    t = trainer(prompt_rows(), str(tmp_path), 1, model_path, completion_prefix=[IMAGE_TOKEN])
    with pytest.raises(ValueError, match=r"row \d+ of GRPO group \d+ .*: its completion holds the image placeholder"):
        t.train()


def test_a_processor_with_text_prompts_is_refused_by_name(model_path, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "Q: spell abba"}]}] * 2
    with pytest.raises(ValueError, match=r"CPGRPOTrainer: processing_class is a processor .* but the prompts have no "
                                         r"images"):  # fmt: skip
        trainer(None, str(tmp_path), 1, model_path, dataset=Dataset.from_list(rows))


def test_kto_still_refuses_trls_vision_rows(tmp_path):
    from hf_cp.train.objectives.kto import CPKTOConfig, CPKTOTrainer

    rows = [dict(prompt="<|image_pad|> what?", completion=" a square", label=True, images=[None])]
    args = CPKTOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", cp_profile="cpu")
    with pytest.raises(ValueError, match=r"CPKTOTrainer: train_dataset has the column 'images'"):
        CPKTOTrainer(
            model=None, args=args, train_dataset=Dataset.from_list(rows), processing_class=transformers_processor()
        )
