"""Load errors name the file (issue 27, finding 5): a checkpoint part that is cut short or damaged
(trainer_state.json, model weights, optimizer, scheduler and RNG state, DeepSpeed's model states
and ZeRO shards) stops a resume before anything trains, on every rank alike, with the path and
what is wrong; so does the dry run. Plan JSON files (hf-cp plan --plan-json, hf-cp replay) and
history files (hf-cp report, a resume's history truncation) name the file and the plan, step or
line. tests/test_fuzz_inputs.py throws random mutations at the same loaders."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from hf_cp.cli import main
from hf_cp.train.checkpoint.integrity import CorruptCheckpointError, check_checkpoint_files
from hf_cp.train.checkpoint.marks import COMPLETE_FILE, DIGESTS_FIELD, MARKED_FIELD, SCHEDULE_FILE, mark_complete
from hf_cp.train.checkpoint.resolve import check_resume, checkpoint_step
from hf_cp.train.checkpoint.trust import UntrustedCheckpointError
from hf_cp.train.measure.step_record import HistoryError, read_history, truncate_history

from helpers.checkpoint_runs import train_with_checkpoints
from helpers.harness.models import ROOT

TINY = str(ROOT / "configs" / "tiny-cpu.yaml")


def _train(out: Path, steps: int, resume=None):
    """A world-1 CPTrainer without DeepSpeed on LENGTHS, a checkpoint every 2 steps (~5 s)."""
    return train_with_checkpoints(out, steps, resume)


def _add_zero_folder(ckpt: Path, ranks: int = 2) -> None:
    """DeepSpeed ZeRO-2's files as a `ranks`-rank save lays them out (torch.save archives of
    small states), and the checkpoint marked again so its record lists them."""
    import torch

    folder = ckpt / "global_step2"
    folder.mkdir()
    torch.save({"module": {"w": torch.arange(16.0)}, "ds_version": "0.19"}, folder / "mp_rank_00_model_states.pt")
    for r in range(ranks):
        state = {"optimizer_state_dict": {"state": {0: {"exp_avg": torch.full((8,), float(r))}}}}
        torch.save(state, folder / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    (ckpt / "latest").write_text("global_step2")
    mark_complete(ckpt, 2, ranks)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A run folder whose checkpoint-2 holds every part a resume loads (the Trainer's files of a
    world-1 run, and a ZeRO-2 folder of 2 ranks), complete and marked."""
    out = tmp_path_factory.mktemp("saved") / "run"
    _train(out, 2)
    _add_zero_folder(out / "checkpoint-2")
    assert check_checkpoint_files(out / "checkpoint-2") == []
    return out


@pytest.fixture
def run_copy(saved, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(saved, out)
    return out


def _schedule(ckpt: Path) -> dict:
    record = json.loads((ckpt / SCHEDULE_FILE).read_text())
    record.pop(MARKED_FIELD, None)
    return record


def _drop_digests(ckpt: Path) -> None:
    """The completion record as an hf_cp from before checksums wrote it."""
    record = json.loads((ckpt / COMPLETE_FILE).read_text())
    record.pop(DIGESTS_FIELD)
    (ckpt / COMPLETE_FILE).write_text(json.dumps(record))


def _cut(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


# each part a resume loads, what is done to it, and what the error says
DAMAGES = [
    ("trainer_state.json", lambda p: _cut(p), "is not valid JSON"),
    ("trainer_state.json", lambda p: p.write_text('{"global_step": "2"}'), "'global_step' must be a whole number"),
    ("trainer_state.json", lambda p: p.write_text('{"global_step": 2, "epochs": 1}'), "'epochs' is not one of"),
    ("trainer_state.json", lambda p: p.unlink(), "is missing"),
    (
        "trainer_state.json",
        lambda p: p.write_text(json.dumps(dict(json.loads(p.read_text()), global_step=4))),
        "says global_step 4, but its folder is checkpoint-2",
    ),
    ("config.json", lambda p: p.write_text("{"), "is not valid JSON"),
    # 100,000-deep: json.loads would end in a RecursionError traceback on every rank
    ("config.json", lambda p: p.write_text("[" * 100_000 + "]" * 100_000), "nested deeper than 100 levels"),
    ("model.safetensors", lambda p: _cut(p), "is cut short: its tensors need"),
    ("model.safetensors", lambda p: p.write_bytes(b"\xff" * 64), "is damaged: its first 8 bytes"),
    ("optimizer.pt", lambda p: _cut(p), "is cut short or damaged: its zip directory cannot be read"),
    ("scheduler.pt", lambda p: p.write_bytes(b"garbage" * 9), "is not a torch.save archive"),
    ("rng_state.pth", lambda p: p.write_bytes(b""), "is empty"),
    ("training_args.bin", lambda p: _cut(p, 0.9), "is cut short or damaged"),
    ("global_step2/mp_rank_00_model_states.pt", lambda p: _cut(p), "is cut short or damaged"),
    ("global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt", lambda p: _cut(p, 0.99), "is cut short or damaged"),
    ("global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt", lambda p: p.unlink(), "optimizer state of rank 0"),
    ("latest", lambda p: p.write_text("global_step9"), "names the DeepSpeed folder 'global_step9'"),
]


@pytest.mark.parametrize("part, damage, message", DAMAGES, ids=[f"{d[0]}:{d[2][:24]}" for d in DAMAGES])
def test_a_damaged_checkpoint_part_is_named_before_anything_loads(run_copy, part, damage, message):
    ckpt = run_copy / "checkpoint-2"
    damage(ckpt / part)
    with pytest.raises(CorruptCheckpointError) as err:
        check_resume(str(ckpt), _schedule(ckpt), 1, None)
    text = str(err.value)
    assert f"checkpoint file {ckpt / part} " in text and message in text, text
    assert f"{ckpt} cannot be resumed" in text


def test_the_size_recorded_at_the_save_is_quoted_and_an_older_checkpoint_offered(run_copy):
    ckpt = run_copy / "checkpoint-2"
    older = shutil.copytree(ckpt, run_copy / "checkpoint-1")  # a complete one before it
    (older / COMPLETE_FILE).unlink()
    mark_complete(older, 1, 2)
    size = (ckpt / "optimizer.pt").stat().st_size
    _cut(ckpt / "optimizer.pt")
    with pytest.raises(CorruptCheckpointError) as err:
        check_checkpoint_files(ckpt)
    text = str(err.value)
    assert f"({size // 2} bytes; {size} when it was saved)" in text, text
    assert f"resume {older}, the complete checkpoint before it, or delete checkpoint-2" in text
    # a file that reads fine but was rewritten since the save: refused by its checksum
    (ckpt / "optimizer.pt").unlink()
    import torch

    torch.save({"state": {}, "param_groups": []}, ckpt / "optimizer.pt")
    now = (ckpt / "optimizer.pt").stat().st_size
    with pytest.raises(UntrustedCheckpointError) as err:
        check_checkpoint_files(ckpt)
    text = str(err.value)
    assert f"checkpoint file {ckpt / 'optimizer.pt'} is not the file its save wrote" in text, text
    assert f"({now} bytes, {size} when it was saved)" in text, text
    # a record of an hf_cp from before checksums: the size difference is a note
    _drop_digests(ckpt)
    notes = check_checkpoint_files(ckpt)
    assert any(f"checkpoint file {ckpt / 'optimizer.pt'} has" in n and "reads fine" in n for n in notes), notes
    assert any("records no sha256 checksums" in n for n in notes), notes


def test_a_flipped_byte_in_a_small_torch_archive_fails_its_checksum(run_copy):
    # torch.load does not check CRC-32s: a flipped digit in the pickle would load a wrong value
    ckpt = run_copy / "checkpoint-2"
    path = ckpt / "scheduler.pt"
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01  # inside scheduler/data.pkl, the first entry
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"scheduler/data.pkl does not match its checksum"):
        check_checkpoint_files(ckpt)


def test_large_archives_have_only_their_pickle_checksummed(run_copy, monkeypatch):
    """Every rank reads every file: past TORCH_CHECKSUM_TOTAL bytes (a universal checkpoint's
    thousands of files) the tensors' bytes are left to the load, the pickle is still checked."""
    import zipfile

    import hf_cp.train.checkpoint.integrity as integrity

    ckpt = run_copy / "checkpoint-2"
    path = ckpt / "rng_state.pth"
    with zipfile.ZipFile(path) as z:
        tensor = next(i for i in z.infolist() if "/data/" in i.filename)
    data = bytearray(path.read_bytes())
    data[tensor.header_offset + 30 + len(tensor.filename) + 100] ^= 0x01  # inside the tensor's bytes
    path.write_bytes(bytes(data))
    # the SHA-256 its save recorded sees the flipped byte whatever the budget
    monkeypatch.setattr(integrity, "TORCH_CHECKSUM_TOTAL", 0)
    with pytest.raises(UntrustedCheckpointError, match="rng_state.pth is not the file its save wrote"):
        check_checkpoint_files(ckpt)
    # a record without checksums (an older hf_cp): the CRC-32s, within the budget
    _drop_digests(ckpt)
    monkeypatch.setattr(integrity, "TORCH_CHECKSUM_TOTAL", 256 << 20)
    with pytest.raises(CorruptCheckpointError, match=r"rng_state/data/\d+ does not match its checksum"):
        check_checkpoint_files(ckpt)
    monkeypatch.setattr(integrity, "TORCH_CHECKSUM_TOTAL", 0)
    assert [n for n in check_checkpoint_files(ckpt) if "records no sha256" not in n] == []


def test_trainer_state_fields_the_trainer_would_trip_over_are_named(run_copy):
    ckpt = run_copy / "checkpoint-2"
    path = ckpt / "trainer_state.json"
    state = json.loads(path.read_text())
    for key, value, message in [
        ("log_history", "x", "'log_history' must be a list of objects"),
        ("epoch", float("nan"), "'epoch' must be a finite number or null"),
        ("stateful_callbacks", [1], "'stateful_callbacks' must be an object of callback states"),
        ("global_step", -1, "'global_step' must be a whole number >= 0"),
        ("train_batch_size", 1.5, "'train_batch_size' must be a whole number >= 0 or null"),
    ]:
        path.write_text(json.dumps(dict(state, **{key: value})))
        with pytest.raises(CorruptCheckpointError, match=message):
            check_checkpoint_files(ckpt)
    path.write_text(json.dumps([state]))
    with pytest.raises(CorruptCheckpointError, match="must hold a JSON object"):
        check_checkpoint_files(ckpt)
    path.write_text(json.dumps({"global_step": 2}))  # what older tools and the tests write: fine
    _drop_digests(ckpt)  # (a checkpoint saved by hf_cp would fail its checksum)
    assert [n for n in check_checkpoint_files(ckpt) if "records no sha256" not in n] == []
    assert checkpoint_step(str(ckpt)) == 2


def test_a_resume_from_a_damaged_checkpoint_stops_before_training(run_copy):
    """CPTrainer.train: the error names the file; no step runs, the history is untouched."""
    ckpt = run_copy / "checkpoint-2"
    shutil.rmtree(ckpt / "global_step2")  # the Trainer's own files only (no DeepSpeed here)
    (ckpt / "latest").unlink()
    mark_complete(ckpt, 2, 1)
    history = run_copy / "cp_history" / "rank0.jsonl"
    before = history.read_text()
    _cut(ckpt / "model.safetensors")
    with pytest.raises(CorruptCheckpointError, match=rf"checkpoint file {ckpt / 'model.safetensors'} is cut short"):
        _train(run_copy, 4, resume="latest")
    assert history.read_text() == before and not (run_copy / "checkpoint-4").exists()


def test_the_dry_run_names_the_damaged_file(run_copy, capsys):
    ckpt = run_copy / "checkpoint-2"
    _cut(ckpt / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    args = ["train", TINY, "--dry-run", "--world", "2", "--dry-run-steps", "1"]
    args += ["--set", f"training.output_dir={run_copy}", "--set", "training.resume_from_checkpoint=latest"]
    assert main(args) == 2
    err = capsys.readouterr().err
    shard = ckpt / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert f"hf-cp train: error: checkpoint file {shard} is cut short or damaged" in err, err


# ------------------------------------------------------------------ plan JSON
def _plans(tmp_path, capsys) -> Path:
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [300, 40, 900, 120, 60, 700, 80, 200]))
    out = tmp_path / "plans.json"
    common = ["--model", "tiny-llama", "--profile", "cpu", "--max-tokens-per-rank", "512"]
    args = ["plan", "--lengths", str(lengths), "--world", "4", *common, "--tokens-per-rank-per-step", "400"]
    assert main([*args, "--steps", "2", "--json", str(out)]) == 0
    capsys.readouterr()
    return out


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: "{not json", r"not valid JSON"),
        (lambda d: {"plans": []}, r"holds no plans"),
        (lambda d: {"plans": [5]}, r"\[0\]: expected a JSON object"),
        (lambda d: d["plans"][1].pop("waves") and d, r"\[1\]: missing field 'waves'"),
        (lambda d: d["plans"][0].update(world_size=2.5) or d, r"\[0\]: malformed plan: world_size: 2.5 is not a whole"),
        (lambda d: d["plans"][0]["samples"][0].__setitem__(1, 0) or d, r"\[0\]: step 0 .*has length 0"),
        (
            lambda d: d["plans"][1]["waves"][0]["groups"][0].update(local=[1]) or d,
            r"\[1\]: malformed plan: group 'local'",
        ),
        (lambda d: d["plans"][1]["waves"].pop() and d, r"\[1\]: step 1 .*never scheduled"),
    ],
)
def test_plan_json_errors_name_the_file_and_the_plan(tmp_path, capsys, edit, message):
    good = _plans(tmp_path, capsys)
    bad = tmp_path / "bad.json"
    changed = edit(json.loads(good.read_text()))
    bad.write_text(changed if isinstance(changed, str) else json.dumps(changed))
    assert main(["plan", "--plan-json", str(bad), "--model", "tiny-llama", "--profile", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hf-cp plan: error: {bad}") and re.search(message, err), err
    assert main(["replay", str(bad), "--model", "tiny-llama", "--device", "cpu", "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hf-cp replay: error: {bad}") and re.search(message, err), err


def test_a_plan_for_a_world_the_cluster_cannot_have_names_the_file(tmp_path, capsys):
    good = _plans(tmp_path, capsys)
    d = json.loads(good.read_text())
    for p in d["plans"]:
        p["world_size"] = 12  # every rank of the plan still inside: valid as data, not as a cluster
    bad = tmp_path / "twelve.json"
    bad.write_text(json.dumps(d))
    assert main(["plan", "--plan-json", str(bad), "--model", "tiny-llama", "--profile", "cpu"]) == 2
    assert f"error: {bad}: world_size 12 is not a power of two" in capsys.readouterr().err


# ------------------------------------------------------------------ history files
def test_report_and_resume_name_the_history_file_and_line(run_copy, capsys):
    history = run_copy / "cp_history" / "rank0.jsonl"
    lines = history.read_text().splitlines()
    rec = json.loads(lines[0])
    history.write_text(json.dumps(dict(rec, measured_ms="slow")) + "\n" + lines[1] + "\n")
    with pytest.raises(HistoryError, match=rf"{history}, line 1: field 'measured_ms' must be a list of numbers"):
        list(read_history(history))
    assert main(["report", str(run_copy), "--out", str(run_copy / "rep")]) == 2
    assert f"hf-cp report: error: {history}, line 1: field 'measured_ms'" in capsys.readouterr().err
    # a line that is not a step record where a resume truncates the history
    history.write_text(json.dumps({"attempt": 0}) + "\n" + lines[1] + "\n")
    with pytest.raises(HistoryError, match=rf"{history}, line 1: not a step record \(its 'index' is None"):
        truncate_history(history, 1)


# ------------------------------------------------------------------ DeepSpeed, end to end
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_cut_zero_shard_stops_a_deepspeed_resume_naming_it(tmp_path):
    """A real ZeRO-2 checkpoint (torchrun, 1 rank, ~1 min), its optimizer shard cut short: the
    resume fails with the shard's path (before: DeepSpeed's "failed finding central directory")."""
    from helpers.harness.job import run_distributed
    from helpers.world2_job import spec_for

    spec = spec_for(tmp_path, "static", steps=2, save_steps=2, tag="zero")
    run_distributed(spec, 1, timeout=600)
    ckpt = Path(spec["out"]) / "checkpoint-2"
    shard = ckpt / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert shard.is_file() and check_checkpoint_files(ckpt) == []
    _cut(shard)
    with pytest.raises(RuntimeError) as err:
        run_distributed(dict(spec, steps=4, resume_from=str(ckpt)), 1, timeout=600)
    assert f"CorruptCheckpointError: checkpoint file {shard} is cut short or damaged" in str(err.value)
