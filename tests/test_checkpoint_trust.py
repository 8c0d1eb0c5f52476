"""The trust boundary of a checkpoint (hf_cp/train/checkpoint/trust.py, docs/faults.md): a file
that differs from the SHA-256 its save recorded, or a pickle that would import anything beyond
the data a Trainer, DeepSpeed or torch distributed checkpoint state holds, is refused by name
before anything of the checkpoint is loaded: a payload in a ZeRO-2 optimizer shard (DeepSpeed
loads it with weights_only=False) or in FSDP2's `.metadata` (a plain pickle.load) never runs."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from hf_cp.cli import main
from hf_cp.train.checkpoint.integrity import check_checkpoint_files
from hf_cp.train.checkpoint.marks import COMPLETE_FILE, DIGESTS_FIELD, mark_complete
from hf_cp.train.checkpoint.trust import (
    UntrustedCheckpointError,
    allowed_globals,
    pickle_globals,
    unsafe_globals,
)

from helpers.harness.job import run_distributed
from helpers.harness.models import ROOT
from helpers.world2_job import COLLECTIVE_TIMEOUT, lengths_spec

TINY = str(ROOT / "configs" / "tiny-cpu.yaml")


class Payload:
    """What an attacker pickles: unpickling calls os.system, which creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ------------------------------------------------------------------ the opcode walk
def test_the_walk_finds_the_globals_a_pickle_imports_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    found, _ = pickle_globals(pickle.dumps({"state": [Payload(marker)]}, protocol=4))
    assert found == {f"{os.system.__module__}.system"}
    assert not marker.exists()
    for protocol in (0, 1, 2, 3, 5):  # GLOBAL / INST / STACK_GLOBAL, memoised or not
        assert pickle_globals(pickle.dumps(Payload(marker), protocol=protocol))[0] == {f"{os.system.__module__}.system"}
    assert not marker.exists()


def test_a_global_whose_strings_come_from_the_memo_is_resolved():
    # module and name pushed, memoised, popped, then fetched back from the memo for STACK_GLOBAL
    data = (
        b"\x80\x04"
        + b"\x8c\x05posix\x94"  # SHORT_BINUNICODE 'posix', MEMOIZE -> 0
        + b"\x8c\x06getcwd\x94"  # 'getcwd' -> 1
        + b"00"  # POP, POP
        + b"h\x00h\x01\x93)R."  # BINGET 0, BINGET 1, STACK_GLOBAL, EMPTY_TUPLE, REDUCE, STOP
    )
    assert pickle.loads(data) == os.getcwd()  # a real pickle: loading it calls os.getcwd
    assert pickle_globals(data)[0] == {"posix.getcwd"}


def test_a_global_computed_while_loading_cannot_be_checked_and_is_refused(tmp_path):
    # STACK_GLOBAL on strings built by a call: unknowable without running the pickle
    data = b"\x80\x04\x8c\x08builtins\x8c\x03str\x93\x8c\x02os\x85R\x8c\x06system\x93."
    with pytest.raises(ValueError, match="computed while loading"):
        pickle_globals(data)
    path = tmp_path / "optimizer.pt"
    path.write_bytes(data)
    with pytest.raises(UntrustedCheckpointError, match="cannot be checked for code before loading"):
        unsafe_globals(path)


def test_tensors_numpy_and_ordered_dicts_are_data():
    import numpy as np

    out = io.BytesIO()
    torch.save({"w": torch.arange(4.0), "rng": np.random.get_state(), "steps": torch.tensor(3)}, out)
    with zipfile.ZipFile(io.BytesIO(out.getvalue())) as z:
        pkl = next(z.read(n) for n in z.namelist() if n.endswith("data.pkl"))
    found, _ = pickle_globals(pkl)
    assert found and found <= allowed_globals(), found - allowed_globals()


# ------------------------------------------------------------------ real checkpoints, attacked
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """Real checkpoints of one world-1 job each: DeepSpeed ZeRO-2 and FSDP2 (about 20 s)."""
    root = tmp_path_factory.mktemp("trust")
    runs = {
        "zero2": dict(lengths_spec("static", steps=2, save_steps=2), out=str(root / "zero2")),
        "fsdp2": dict(
            lengths_spec("static", steps=2, save_steps=2),
            engine="fsdp2",
            ddp_timeout=COLLECTIVE_TIMEOUT,
            out=str(root / "fsdp2"),
        ),
    }
    for spec in runs.values():
        run_distributed(spec, 1, timeout=600)
    return runs


@pytest.fixture
def copies(saved, tmp_path) -> dict:
    out = {}
    for name, spec in saved.items():
        run = tmp_path / name
        shutil.copytree(spec["out"], run)
        out[name] = (dict(spec, out=str(run)), run / "checkpoint-2")
    return out


def _targets(ckpt: Path) -> dict:
    return {
        "zero2": ckpt / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "fsdp2": ckpt / "optimizer_0" / ".metadata",
    }


def test_real_checkpoints_carry_checksums_and_pass(copies):
    for name, (_, ckpt) in copies.items():
        record = json.loads((ckpt / COMPLETE_FILE).read_text())
        assert sorted(record[DIGESTS_FIELD]) == sorted(record["files"]), name
        assert all(len(d) == 64 for d in record[DIGESTS_FIELD].values())
        assert check_checkpoint_files(ckpt) == [], name
        assert _targets(ckpt)[name].is_file()


@pytest.mark.parametrize("engine", ["zero2", "fsdp2"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["plain-pickle", "inside-a-torch-archive"])
def test_a_payload_is_refused_by_checksum_then_by_its_imports(copies, tmp_path, engine, wrapped):
    _, ckpt = copies[engine]
    target = _targets(ckpt)[engine]
    marker = tmp_path / "payload-ran"
    if wrapped and target.suffix == ".pt":
        torch.save({"optimizer_state_dict": {"state": Payload(marker)}}, target)
    else:
        target.write_bytes(pickle.dumps(Payload(marker)))
    # the file replaced, its record left: the checksum names it
    with pytest.raises(UntrustedCheckpointError, match="is not the file its save wrote") as err:
        check_checkpoint_files(ckpt)
    assert str(target) in str(err.value)
    # the record rewritten to match (an attacker who writes the whole folder): its imports name it
    mark_complete(ckpt, 2, 1)
    with pytest.raises(UntrustedCheckpointError, match=r"could run code when loaded: its pickle imports posix\.system"):
        check_checkpoint_files(ckpt)
    assert not marker.exists()
    # allowing the global by name (a checkpoint the user trusts) lets it through to the load
    assert check_checkpoint_files(ckpt, allowed_globals=["posix.system"]) == []
    assert not marker.exists()
    # and that load would have run it: DeepSpeed's torch.load(weights_only=False), DCP's pickle.load
    if target.suffix == ".pt":
        try:  # a plain pickle runs as torch reads it for the legacy format's magic number
            torch.load(target, weights_only=False)
        except RuntimeError as e:
            assert "magic number" in str(e) and not wrapped
    else:
        with open(target, "rb") as fh:
            pickle.load(fh)
    assert marker.exists()


@pytest.mark.parametrize("engine", ["zero2", "fsdp2"])
def test_a_resume_from_an_attacked_checkpoint_stops_before_loading_and_runs_nothing(copies, tmp_path, engine):
    spec, ckpt = copies[engine]
    marker = tmp_path / "payload-ran"
    _targets(ckpt)[engine].write_bytes(pickle.dumps(Payload(marker)))
    mark_complete(ckpt, 2, 1)
    with pytest.raises(RuntimeError) as err:
        run_distributed(dict(spec, steps=4, resume_from=str(ckpt)), 1, timeout=600)
    assert "UntrustedCheckpointError" in str(err.value) and "imports posix.system" in str(err.value)
    assert not marker.exists()


def test_the_dry_run_refuses_an_attacked_checkpoint(copies, tmp_path, capsys):
    spec, ckpt = copies["zero2"]
    marker = tmp_path / "payload-ran"
    target = _targets(ckpt)["zero2"]
    target.write_bytes(pickle.dumps(Payload(marker)))
    run = Path(spec["out"])
    args = ["train", TINY, "--dry-run", "--world", "1", "--dry-run-steps", "1"]
    args += ["--set", f"training.output_dir={run}", "--set", "training.resume_from_checkpoint=latest"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"checkpoint file {target} is not the file its save wrote" in err, err
    assert not marker.exists()
