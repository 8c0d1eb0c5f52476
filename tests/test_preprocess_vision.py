"""hf-cp preprocess with images and video (issue 38): chat samples through the tiny Qwen2.5-VL
processor (SmolLM2's tokenizer with the vision tokens), rows the trainer reads (placeholders
matching the grids), lengths with vision tokens, the report and lengths file that show them, the
frames-to-video layout, the recipe's model and config, and what is refused by name."""

import json
import re
import shutil

import numpy as np
import pytest
from datasets import Dataset, Features, Image, List, Value, Video
from PIL import Image as PILImage

from hf_cp.cli import main
from hf_cp.cost.dims import ModelDims, VisionDims
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.cost.model import CostModel
from hf_cp.cost.vision import alone_held_tokens
from hf_cp.data.vlm_sample import VLM_CHAT_FILE, VLM_SAMPLE_DIR
from hf_cp.data_prep import length_report, preprocess
from hf_cp.data_prep.encode import IGNORE_INDEX, EncodeError
from hf_cp.data_prep.inputs import InputError
from hf_cp.data_prep.smollm2 import load_tokenizer
from hf_cp.data_prep.vision_encode import VisionChatEncoder
from hf_cp.data_prep.vision_processor import (
    TINY_PROCESSOR,
    ProcessorError,
    build_tiny_vlm_processor,
    load_vision_processor,
    vision_token_ids,
)
from hf_cp.samples.vision import sample_vision
from hf_cp.train.setup.config import TrainConfigError, load_config
from hf_cp.train.setup.model_section import build_model

from helpers.harness.job import run_recipe

MERGE = 2
FRAMES = [f"clip/frame_{k:02d}.png" for k in range(12)]


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory):
    return build_tiny_vlm_processor(tmp_path_factory.mktemp("tiny-vlm-processor"))


@pytest.fixture(scope="module")
def processor(processor_dir):
    return load_vision_processor(processor_dir)


@pytest.fixture(scope="module")
def bundled(processor):
    return preprocess(str(VLM_CHAT_FILE), None, processor=processor)


def _vision(row, sid, token_ids):
    pixels = {"image": row.get("pixel_values"), "video": row.get("pixel_values_videos")}
    grids = {"image": row.get("image_grid_thw"), "video": row.get("video_grid_thw")}
    return sample_vision(sid, row["input_ids"], pixels, grids, token_ids, MERGE)


def _chat_file(tmp_path, rows, name="chat.jsonl"):
    """Rows written beside copies of the bundled media (relative paths resolve from the file's folder)."""
    folder = tmp_path / "data"
    if not folder.exists():
        shutil.copytree(VLM_SAMPLE_DIR, folder)
    path = folder / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _user(*parts, answer="A shape."):
    return {"messages": [{"role": "user", "content": list(parts)}, {"role": "assistant", "content": answer}]}


# ------------------------------------------------------------------ rows the trainer reads
def test_bundled_rows_have_placeholders_matching_their_grids(bundled, processor):
    ds, token_ids = bundled.dataset, vision_token_ids(processor)
    assert {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"} <= set(
        ds.column_names
    )
    grids = []
    for sid in range(len(ds)):
        row = ds[sid]
        got = _vision(row, sid, token_ids)
        ids, labels = np.asarray(row["input_ids"]), np.asarray(row["labels"])
        for item in got.items:  # each item's placeholders: grid.prod() / merge^2, between start and end
            assert item.tokens == int(np.prod(item.grid_thw)) // MERGE**2
            first, last = item.token_positions[0], item.token_positions[-1]
            assert last - first + 1 == item.tokens
            assert ids[first - 1] == processor.token_id("<|vision_start|>")
            assert ids[last + 1] == processor.token_id("<|vision_end|>")
        placeholders = np.isin(ids, list(token_ids.values()))
        assert placeholders.sum() == got.vision_tokens and (labels[placeholders] == IGNORE_INDEX).all()
        assert row["length"] == len(ids) == len(labels)
        grids.append([list(it.grid_thw) for it in got.items])
    # 32x32 images: 8x8 patches of 4; the 48x48 clip's 12 frames: 6 temporal patches of 12x12
    assert grids[0] == [[1, 8, 8]] and grids[3] == [[1, 8, 12]] and grids[6] == [[1, 8, 8], [1, 8, 8]]
    assert grids[7] == [[6, 12, 12]] and ds[7]["second_per_grid_ts"] == [1.0]  # temporal patch 2 / fps 2
    assert bundled.vision_grids == grids


def test_only_assistant_text_is_trained(bundled, processor):
    row = bundled.dataset[7]
    trained = [t for t, y in zip(row["input_ids"], row["labels"]) if y != IGNORE_INDEX]
    text = processor.tokenizer.decode(trained)
    assert text.startswith("A white dot moves from the left edge") and "clip" not in text


def test_lengths_count_vision_tokens_and_the_summary_says_so(bundled):
    lengths = np.asarray(bundled.dataset["length"])
    vision = np.asarray([sum(np.prod(g) // MERGE**2 for g in gs) for gs in bundled.vision_grids])
    assert (lengths > vision).all() and vision.sum() == 136 + 216
    assert bundled.vision_tokens == {"image": 136, "video": 216}
    assert any("136 image and 216 video placeholder tokens" in line for line in bundled.summary_lines(None, "error"))


def test_the_report_shows_text_and_vision_tokens_apart_and_the_lengths_file_has_grids(
    processor_dir, tmp_path, capsys, bundled
):
    lengths, report = tmp_path / "lengths.jsonl", tmp_path / "report.json"
    rc = main(
        [
            "preprocess",
            str(VLM_CHAT_FILE),
            "--processor",
            str(processor_dir),
            "--out",
            str(tmp_path / "out"),
            "--model",
            "tiny-qwen2.5-vl",
            "--profile",
            "cpu",
            "--lengths-jsonl",
            str(lengths),
            "--report-json",
            str(report),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    total = int(np.sum(bundled.dataset["length"]))
    assert f"tokens: {total - 352} text + 352 vision (136 image, 216 video)" in out
    rep = json.loads(report.read_text())
    assert rep["tokens"] == total and rep["text_tokens"] == total - 352
    assert rep["vision_tokens"] == {"image": 136, "video": 216}
    rows = [json.loads(line) for line in lengths.read_text().splitlines()]
    assert [r["length"] for r in rows] == list(bundled.dataset["length"])
    assert [r["vision"] for r in rows] == bundled.vision_grids
    assert set(rows[0]) == {"length", "vision"}


def test_a_text_only_report_has_no_vision_line(capsys):
    cost = CostModel(ModelDims.load("tiny-qwen2.5-vl"), HardwareProfile.load("cpu"))
    assert "vision" not in length_report([10, 20], cost).text()
    assert (
        "tokens: 20 text + 10 vision (4 image, 6 video)"
        in length_report([10, 20], cost, vision_tokens={"image": 4, "video": 6}).text()
    )


# ------------------------------------------------------------------ media forms
def test_a_two_frame_clip_of_one_image_equals_the_image_processors_patches(processor):
    # the image processor repeats an image over the temporal patch; a clip of that image twice is
    # the same patches, in Qwen2VLVideoProcessor.patchify's layout
    im = PILImage.open(VLM_SAMPLE_DIR / "horizontal_gradient.png").convert("RGB")
    patches, grid = processor.video([im, im])
    ref = processor.images([im])
    assert grid == tuple(ref["image_grid_thw"][0]) == (1, 8, 12)
    np.testing.assert_array_equal(patches, ref["pixel_values"])


def test_an_odd_clip_repeats_its_last_frame_and_frames_pair_in_time(processor):
    frames = [PILImage.open(VLM_SAMPLE_DIR / f).convert("RGB") for f in FRAMES[:3]]
    patches, grid = processor.video(frames)
    assert grid == (2, 12, 12)
    # columns: (channel, temporal, patch row, patch column); rows: temporal patch first
    x = patches.reshape(2, 144, 3, 2, 16)
    np.testing.assert_array_equal(x[1, :, :, 0], x[1, :, :, 1])  # frame 2 and its repeat
    assert not np.array_equal(x[0, :, :, 0], x[0, :, :, 1])  # frames 0 and 1 differ (the dot moved)
    first = processor.images([frames[0]])["pixel_values"].reshape(144, 3, 2, 16)  # frame 0 twice
    np.testing.assert_array_equal(x[0, :, :, 0], first[:, :, 0])


def test_frames_as_an_array_and_images_from_a_datasets_column_encode_like_paths(processor, tmp_path, bundled):
    frames = np.stack([np.asarray(PILImage.open(VLM_SAMPLE_DIR / f).convert("RGB")) for f in FRAMES])
    rows = {
        "messages": [
            json.dumps(_user({"type": "image"}, {"type": "text", "text": "What shape is in this image?"})["messages"]),
        ],
        "images": [[PILImage.open(VLM_SAMPLE_DIR / "red_disc.png")]],
    }
    folder = tmp_path / "with_images"
    Dataset.from_dict(rows).cast_column("images", List(Image())).save_to_disk(str(folder))
    got = preprocess(str(folder), None, processor=processor, mask="none").dataset[0]
    ref = preprocess(str(VLM_CHAT_FILE), None, processor=processor, mask="none", limit=1).dataset[0]
    assert got["image_grid_thw"] == ref["image_grid_thw"] == [[1, 8, 8]]
    np.testing.assert_array_equal(got["pixel_values"], ref["pixel_values"])
    clip = processor.video([PILImage.fromarray(f) for f in frames])
    encoder_row = preprocess(
        str(_chat_file(tmp_path, [_user({"type": "video", "video": FRAMES})])), None, processor=processor
    ).dataset[0]
    np.testing.assert_array_equal(np.asarray(encoder_row["pixel_values_videos"], np.float32), clip[0])
    enc = VisionChatEncoder(processor, "messages")
    as_array = enc.encode(_user({"type": "video", "video": frames})["messages"], 0, {})
    assert as_array["input_ids"] == encoder_row["input_ids"]
    np.testing.assert_array_equal(np.asarray(as_array["pixel_values_videos"], np.float32), clip[0])


def test_images_alone_write_no_video_columns(processor, tmp_path):
    path = _chat_file(tmp_path, [_user({"type": "image", "image": "red_disc.png"})])
    ds = preprocess(str(path), None, processor=processor).dataset
    assert "pixel_values" in ds.column_names and "pixel_values_videos" not in ds.column_names


# ------------------------------------------------------------------ refusals by name
@pytest.mark.parametrize(
    "part, words",
    [
        ({"type": "video", "video": "clip.mp4"}, "torchcodec, PyAV or decord"),
        ({"type": "image", "image": "clip/clip.mp4"}, "is a video file, not an image"),
        ({"type": "audio", "audio": "a.wav"}, "part type 'audio'"),
        ({"type": "image", "image_url": "red_disc.png"}, r"unknown media field\(s\) \['image_url'\]"),
        ({"type": "image"}, "without its 'image' field"),
        ({"type": "image", "image": "missing.png"}, "cannot read the image"),
        ({"type": "video", "video": FRAMES[:2], "fps": 0}, "fps must be positive"),
    ],
)
def test_media_hf_cp_cannot_read_are_refused_naming_the_sample_and_part(processor, tmp_path, part, words):
    path = _chat_file(tmp_path, [_user({"type": "image", "image": "red_disc.png"}), _user(part)])
    with pytest.raises(EncodeError, match=words) as caught:
        preprocess(str(path), None, processor=processor)
    assert "sample 1: messages[0].content[0]" in str(caught.value)


def test_a_text_holding_a_placeholder_token_is_refused(processor, tmp_path):
    path = _chat_file(tmp_path, [_user({"type": "text", "text": "look: <|image_pad|>"})])
    with pytest.raises(EncodeError, match=r"sample 0: the rendered text has 1 <\|image_pad\|> token\(s\) for 0"):
        preprocess(str(path), None, processor=processor)


def test_more_images_in_the_column_than_parts_is_refused(processor, tmp_path):
    rows = {"messages": [json.dumps(_user({"type": "text", "text": "hi"})["messages"])], "images": [["x.png"]]}
    folder = tmp_path / "extra"
    Dataset.from_dict(rows).save_to_disk(str(folder))
    with pytest.raises(EncodeError, match="sample 0: its 'images' column holds 1 image"):
        preprocess(str(folder), None, processor=processor)


@pytest.mark.parametrize(
    "column, feature, words",
    [
        ("audio", Value("string"), r"column\(s\) \['audio'\] hold audio"),
        ("videos", Video(decode=False), r"\['videos'\] are datasets' Video feature.*torchcodec"),
    ],
)
def test_audio_and_undecodable_video_columns_are_refused_by_name(processor, tmp_path, column, feature, words):
    clip = tmp_path / "a.mp4"
    clip.write_bytes(b"\0" * 16)  # never decoded: the column is refused first
    rows = {"messages": [json.dumps(_user({"type": "text", "text": "hi"})["messages"])], column: [str(clip)]}
    folder = tmp_path / column
    Dataset.from_dict(rows, features=Features({"messages": Value("string"), column: feature})).save_to_disk(str(folder))
    with pytest.raises(InputError, match=words):
        preprocess(str(folder), None, processor=processor)


def test_media_without_a_processor_and_truncation_with_one_are_refused(processor, tmp_path):
    path = tmp_path / "media.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "images": ["a.png"]}) + "\n")
    with pytest.raises(InputError, match=r"\['images'\] hold images or video.*--processor"):
        preprocess(str(path), processor.tokenizer)
    with pytest.raises(ValueError, match="--overlong truncate with --processor"):
        preprocess(str(VLM_CHAT_FILE), None, processor=processor, max_length=100, overlong="truncate")
    dropped = preprocess(str(VLM_CHAT_FILE), None, processor=processor, max_length=100, overlong="drop")
    assert dropped.dropped_overlong == 1 and max(dropped.dataset["length"]) <= 100


def _edit_json(path, **changes):
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **changes)))


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda d: (d / "feature_extractor_config.json").write_text("{}"), "audio feature extractor"),
        (
            lambda d: (d / "video_preprocessor_config.json").write_text(json.dumps({"use_audio_in_video": True})),
            "sets use_audio_in_video",
        ),
        (
            lambda d: (d / "preprocessor_config.json").write_text(
                json.dumps({"image_processor_type": "LlavaNextImageProcessor"})
            ),
            "image_processor_type 'LlavaNextImageProcessor'",
        ),
        (lambda d: (d / "preprocessor_config.json").unlink(), "no preprocessor_config.json"),
        (lambda d: _edit_json(d / "video_preprocessor_config.json", do_sample_frames=True), "do_sample_frames is set"),
        (lambda d: _edit_json(d / "video_preprocessor_config.json", patch_size=14), "video processor's patch_size 14"),
    ],
)
def test_processors_hf_cp_cannot_honour_are_refused_by_name(processor_dir, tmp_path, edit, words):
    folder = tmp_path / "processor"
    shutil.copytree(processor_dir, folder)
    edit(folder)
    with pytest.raises(ProcessorError, match=words):
        load_vision_processor(folder)


def test_a_tokenizer_without_the_vision_tokens_is_refused(tmp_path):
    folder = tmp_path / "plain"
    load_tokenizer().save_pretrained(str(folder))
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        shutil.copyfile(TINY_PROCESSOR / name, folder / name)
    with pytest.raises(ProcessorError, match=r"no <\|vision_start\|>"):
        load_vision_processor(folder)


# ------------------------------------------------------------------ the recipe's model and config
def test_the_recipe_config_builds_the_vlm_whose_vocabulary_is_the_processors(processor):
    cfg = load_config("configs/tiny-vlm-cpu.yaml")
    model = build_model(cfg["model"], cfg["_source"])
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert model.config.text_config.vocab_size == len(processor.tokenizer)
    ids = vision_token_ids(processor)
    assert (model.config.image_token_id, model.config.video_token_id) == (ids["image"], ids["video"])
    assert model.config.vision_config.patch_size == processor.image_processor.patch_size
    assert cfg["data"]["bundled"] == "vlm_sample"


def test_older_min_max_pixels_video_settings_bound_the_frames(processor_dir, tmp_path):
    folder = tmp_path / "processor"
    shutil.copytree(processor_dir, folder)
    _edit_json(folder / "video_preprocessor_config.json", max_pixels=24 * 24)  # 48x48 frames -> 24x24
    frames = [PILImage.open(VLM_SAMPLE_DIR / f).convert("RGB") for f in FRAMES[:2]]
    assert load_vision_processor(folder).video(frames)[1] == (1, 6, 6)
    assert load_vision_processor(processor_dir).video(frames)[1] == (1, 12, 12)


def test_the_recipe_dry_runs_with_its_model_class(capsys):
    assert main(["train", "configs/tiny-vlm-cpu.yaml", "--dry-run", "--world", "2"]) == 0
    out = capsys.readouterr().out
    assert "8 training samples" in out and "longest sample 265 tokens" in out and "dry run passed" in out


def test_the_recipes_clip_sample_needs_a_group_of_two(bundled):
    """With its items' activations counted (cost/vision.alone_held_tokens, what the plan's validation
    counts), the clip's sample fits no rank alone and a group of 2; every image sample fits one rank."""
    cap = load_config("configs/tiny-vlm-cpu.yaml")["training"]["cp_max_tokens_per_rank"]
    cost = CostModel(
        ModelDims.load("tiny-qwen2.5-vl"), HardwareProfile.load("cpu"), None, VisionDims.load("tiny-qwen2.5-vl")
    )
    ds = bundled.dataset
    held = {}
    for n, images, clips in zip(ds["length"], ds["image_grid_thw"], ds["video_grid_thw"]):
        grids = tuple(tuple(g) for g in (images or []) + (clips or []))
        held[n] = [alone_held_tokens(n, grids, g, cost) for g in (1, 2)]
    longest = max(held)
    assert held[longest][0] > cap >= held[longest][1]
    assert all(one <= cap for n, (one, _) in held.items() if n != longest)


@pytest.mark.parametrize(
    "model, words",
    [
        ({"config": "tiny-qwen2.5-vl", "model_class": "Qwen2_5_VLForConditionalGenration"}, "no model class"),
        ({"config": "tiny-llama", "model_class": "Qwen2_5_VLForConditionalGeneration"}, "takes a Qwen2_5_VLConfig"),
        ({"config": "tiny-qwen2.5-vl", "model_klass": "x"}, "did you mean model.model_class"),
    ],
)
def test_a_wrong_model_class_is_refused_naming_the_key(tmp_path, model, words):
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"model": model, "data": {"bundled": "vlm_sample"}, "training": {"output_dir": "o"}}))
    with pytest.raises(TrainConfigError, match=words):
        cfg = load_config(str(path))
        build_model(cfg["model"], cfg["_source"])


# ------------------------------------------------------------------ the recipe run (2 CPU processes)
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_tiny_vlm_recipe_trains_on_two_processes_with_its_loss_going_down(tmp_path):
    proc = run_recipe("configs/tiny-vlm-cpu.yaml", tmp_path / "out", timeout=380)
    assert proc.returncode == 0, proc.stderr[-6000:]
    text = proc.stdout
    assert "hf_cp training summary" in text and "2 process(es)" in text
    m = re.search(r"loss: first \d+ step\(s\) ([\d.]+) -> last \d+ step\(s\) ([\d.]+) \(down\)", text)
    assert m and float(m.group(2)) < float(m.group(1)) - 2.0, text
    sizes = re.search(r"cp-size:samples ([\d: ]+)", text)
    assert sizes and re.search(r"\b2:\d+", sizes.group(1)), text  # the clip's sample ran on a group of 2
