"""Vision-language set-up and data (issue 38): what is read from a processor's columns, where each
item is encoded, and what is refused by name (another family's vision inputs, raw media, a model
without a tower hf_cp runs, streams, packed rows, sharded parameters, shared-prompt trainers, masks
and ChunkFlow with images)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import LlamaConfig

import hf_cp.attention.interface  # noqa: F401  (registers attn_implementation "hf_cp")
from hf_cp.attention.recurrent import _documents_from_positions
from hf_cp.plan.step_plan import ChunkedSample, Group, StepPlan, Wave
from hf_cp.plan.vision_encoders import assign_encoders
from hf_cp.samples.masks import SampleMask
from hf_cp.samples.vision import VisionInputError, sample_vision
from hf_cp.train.checks.setup import SetupError
from hf_cp.train.data.collator import PlanCollator
from hf_cp.train.data.columns import read_token_columns
from hf_cp.train.data.streaming import stream_sample
from hf_cp.train.setup.vision_setup import attach_vision

from helpers.tiny_vlm import IMAGE_TOKEN, MERGE, VIDEO_TOKEN, build_vlm, make_sample

TOKEN_IDS = {"image": IMAGE_TOKEN, "video": VIDEO_TOKEN}
LAYOUT = [("text", 4), ("image", (1, 4, 4)), ("text", 3), ("video", (2, 4, 8)), ("text", 2)]


def _inputs(row):
    pixels = {"image": row.get("pixel_values"), "video": row.get("pixel_values_videos")}
    grids = {"image": row.get("image_grid_thw"), "video": row.get("video_grid_thw")}
    return row["input_ids"], pixels, grids


class _ConfigOnly(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config


# ------------------------------------------------------------------ samples/vision.py
def test_a_samples_items_are_found_at_their_placeholders():
    row = make_sample(0, LAYOUT)
    got = sample_vision(7, *_inputs(row), TOKEN_IDS, MERGE)
    assert [it.kind for it in got.items] == ["image", "video"]
    assert [it.grid_thw for it in got.items] == [(1, 4, 4), (2, 4, 8)]
    assert [it.patches for it in got.items] == [16, 64] and [it.tokens for it in got.items] == [4, 16]
    ids = np.asarray(row["input_ids"])
    assert (ids[got.items[0].token_positions] == IMAGE_TOKEN).all()
    assert got.items[1].token_positions[0] == 4 + 1 + 4 + 1 + 3 + 1  # text, start, image, end, text, start
    item, rows = got.item_of_token(len(ids))
    assert (item >= 0).sum() == 20 and rows[got.items[1].token_positions].tolist() == list(range(16))
    assert sample_vision(1, [1, 2, 3], {}, {}, TOKEN_IDS, MERGE) is None  # text only


@pytest.mark.parametrize(
    "break_it, words",
    [
        (lambda r: r.update(input_ids=r["input_ids"][:-3] + [IMAGE_TOKEN] * 3), "placeholder tokens"),
        (lambda r: r.update(pixel_values=r["pixel_values"][:-1]), "pixel_values has shape"),
        (lambda r: r.pop("pixel_values"), "pixel_values is missing"),
        (lambda r: r.update(image_grid_thw=np.array([[1, 3, 3]])), "not a multiple of the encoder's spatial merge"),
        (lambda r: r.update(video_grid_thw=np.array([[2, 4]])), "video_grid_thw must hold one"),
    ],
)
def test_vision_inputs_that_contradict_the_tokens_are_refused_naming_the_sample(break_it, words):
    row = make_sample(0, LAYOUT)
    break_it(row)
    with pytest.raises(VisionInputError, match=words) as caught:
        sample_vision(12, *_inputs(row), TOKEN_IDS, MERGE)
    assert "sample 12" in str(caught.value)


# ------------------------------------------------------------------ plan/vision_encoders.py
def test_items_go_largest_first_to_the_least_loaded_member_ties_to_the_most_held():
    # member 1 already encodes 10 (a local sample's image); items of 8, 8 and 2
    # (largest first: both 8s to member 0, at 8 then 16 against 10; the 2 to member 1)
    assert assign_encoders([8, 2, 8], [[1, 0], [0, 3], [0, 5]], [0, 10]) == [0, 1, 0]
    # equal loads: the tie goes to the member holding more of the item's tokens
    assert assign_encoders([4], [[1, 3]], [0, 0]) == [1]
    assert assign_encoders([4, 4], [[2, 2], [2, 2]], [0, 0]) == [0, 1]
    with pytest.raises(ValueError, match="tokens_held"):
        assign_encoders([1], [[1]], [0, 0])


# ------------------------------------------------------------------ refusals at set-up
def _vision_dataset(**extra):
    rows = [make_sample(0, LAYOUT), make_sample(1, [("text", 9)])]
    for r in rows:
        r.update(extra)
    return Dataset.from_list(rows)


def test_a_model_without_a_tower_hf_cp_runs_is_refused_by_name():
    ds = _vision_dataset()
    data = read_token_columns(ds)
    llama = _ConfigOnly(LlamaConfig(vocab_size=300, hidden_size=16, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(SetupError, match="llama model has no vision tower"):
        attach_vision(ds, data, llama, "CPTrainer")
    assert data.vision is None  # nothing attached by a refused set-up


@pytest.mark.parametrize("family, deepstack", [("qwen2_5_vl", 0), ("qwen3_vl", 2), ("qwen3_5", 0)])
def test_each_honoured_family_sets_up_its_tower(family, deepstack):
    ds = _vision_dataset()
    data = read_token_columns(ds)
    tower = attach_vision(ds, data, build_vlm("hf_cp", family=family), "CPTrainer")
    assert tower.family == family and tower.deepstack_layers == deepstack
    assert tower.visual.config._attn_implementation == "sdpa"  # the tower encodes whole items on one rank


@pytest.mark.parametrize("column", ["image_sizes", "pixel_attention_mask", "input_features", "images"])
def test_another_processors_multimodal_columns_are_refused_by_name(column):
    ds = _vision_dataset(**{column: [1, 2]})
    with pytest.raises(ValueError, match=f"'{column}'"):
        attach_vision(ds, read_token_columns(ds), build_vlm("hf_cp"), "CPTrainer")


def test_vision_data_is_refused_where_it_cannot_be_carried():
    model = build_vlm("hf_cp")
    ds = _vision_dataset()
    with pytest.raises(ValueError, match="sharded by fsdp2"):
        attach_vision(ds, read_token_columns(ds), model, "CPTrainer", sharding="fsdp2")
    with pytest.raises(ValueError, match="share a prompt"):
        attach_vision(ds, read_token_columns(ds), model, "CPKTOTrainer", shared_prompts=True)
    stream = ds.to_iterable_dataset()
    with pytest.raises(ValueError, match="stream"):
        attach_vision(stream, read_token_columns(ds), model, "CPTrainer")
    packed = Dataset.from_list([dict(r, seq_lengths=[len(r["input_ids"])]) for r in ds])
    with pytest.raises(ValueError, match="pre-packed"):
        attach_vision(packed, read_token_columns(packed), model, "CPTrainer")


def test_a_text_dataset_sets_up_no_tower_and_a_vision_one_reads_its_samples():
    model = build_vlm("hf_cp")
    text = Dataset.from_list([{"input_ids": [1, 2, 3, 4]}])
    data = read_token_columns(text)
    assert attach_vision(text, data, model, "CPTrainer") is None and data.vision is None
    ds = _vision_dataset()
    data = read_token_columns(ds)
    tower = attach_vision(ds, data, model, "CPTrainer")
    assert tower is not None and tower.family == "qwen2_5_vl"
    got = data.vision(0)
    assert [it.kind for it in got.items] == ["image", "video"] and got.rope_positions.shape == (3, data.lengths[0])
    assert data.vision(1) is None
    # M-RoPE: the image's tokens share a temporal position; text after the clip continues past it
    pos = got.rope_positions
    first = got.items[0].token_positions
    assert len(set(pos[0, first].tolist())) == 1 and len(set(pos[2, first].tolist())) == 2


# ------------------------------------------------------------------ refusals in the collator
def _one_rank_plan(group: Group) -> StepPlan:
    return StepPlan(
        world_size=1, max_tokens_per_rank=256, sample_ids=[0], lengths=[29], balancer="t", waves=[Wave([group])]
    )


def test_masks_with_images_are_refused_by_name_and_chunked_images_carry_their_rows():
    model = build_vlm("hf_cp")
    ds = _vision_dataset()
    data = read_token_columns(ds)
    attach_vision(ds, data, model, "CPTrainer")
    n = data.lengths[0]
    plan = _one_rank_plan(Group(ranks=(0,), local={0: [0]}))
    masked = PlanCollator(data.fetch, {0: SampleMask.prefix_lm(n, 5)}, data.vision)
    with pytest.raises(ValueError, match="sample 0 has images or clips and a 'prefix_lm' mask"):
        masked.rank_step(plan, 0, n - 1)
    # ChunkFlow (tests/test_chunkflow_vision.py): the sample's items, all encoded on its rank, its
    # placeholders' positions and its whole M-RoPE positions travel with its chunks
    chunked = _one_rank_plan(Group(ranks=(0,), chunked={0: [ChunkedSample(0, 8, 1)]}))
    rows = PlanCollator(data.fetch, None, data.vision).rank_step(chunked, 0, n - 1).waves[0].chunked[0]
    got = data.vision(0)
    assert rows.vision is not None and rows.vision.encodes and len(rows.chunk_sizes) == -(-n // 8)
    assert rows.vision.grid_thw.shape[0] == len(got.items)
    assert rows.vision.token_positions.tolist() == [p for it in got.items for p in it.token_positions]
    assert rows.vision.rope_positions.tolist() == got.rope_positions.tolist()


# ------------------------------------------------------------------ hf_cp attention without a context
def test_an_mrope_model_without_text_positions_is_refused_and_with_them_packs_exactly():
    """Qwen2.5-VL hands the attention no positions when given 2-D ones (issue 38: it trained two
    packed documents as one, silently). hf_cp refuses that; with [4, 1, T] positions (the 1-D ones
    first) the packed row equals each document alone."""
    model = build_vlm("hf_cp").eval()
    ref = build_vlm("sdpa").eval()
    a, b = torch.randint(0, 280, (9,)), torch.randint(0, 280, (7,))
    ids = torch.cat([a, b])[None]
    flat = torch.cat([torch.arange(9), torch.arange(7)])[None]
    with torch.no_grad(), pytest.raises(ValueError, match=r"position_ids of shape \[4, batch, seq\]"):
        model(input_ids=ids, position_ids=flat)
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=flat[None].expand(4, 1, -1)).logits[0]
        want = torch.cat([ref(input_ids=a[None]).logits[0], ref(input_ids=b[None]).logits[0]])
    assert (got - want).abs().max().item() < 1e-5


def test_a_stream_with_images_is_refused_at_its_row_by_name():
    row = dict(make_sample(0, LAYOUT), labels=None)
    with pytest.raises(ValueError, match=r"stream sample 4 has the multimodal column\(s\) \['pixel_values'"):
        stream_sample(row, 4)


def test_a_hybrids_recurrent_layers_read_the_text_row_of_mrope_positions():
    # outside a CP context (a dummy pass), a Qwen3.5's layers see position_ids [4, 1, T]
    text = torch.cat([torch.arange(5), torch.arange(3)])
    rope = torch.stack([text, text * 0, text + 7])
    assert _documents_from_positions(torch.cat([text[None], rope])[:, None], 8) == [5, 3]
