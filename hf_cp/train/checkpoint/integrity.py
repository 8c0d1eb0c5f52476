"""A checkpoint's files checked before anything loads: each readable and as saved (sizes,
checksums, headers), with no code in its pickles (trust.py).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

from hf_cp.readers import load_json  # nesting bounded (readers.py)
from hf_cp.train.checkpoint.marks import (
    CHECKPOINT_NAME,
    COMPLETE_FILE,
    DIGESTS_FIELD,
    SCHEDULE_FILE,
    TMP_SUFFIX,
    last_complete,
)
from hf_cp.train.checkpoint.trust import (
    DIGEST,
    UntrustedCheckpointError,
    digest_mismatches,
    refuse_code_in_pickles,
)

# ------------------------------------------------------------------ readable checkpoint files
# Before a resume loads anything, every file of the checkpoint that the Trainer or DeepSpeed
# reads is checked cheaply: JSON files parse (trainer_state.json with the fields and types the
# Trainer uses), a safetensors header covers the file exactly, a torch.save archive has its zip
# directory and each entry's header where the directory says. Every rank checks every file, so
# all raise the same error, naming the file, before any collective (a corrupt shard would else
# fail one rank inside DeepSpeed's load with "failed finding central directory" and no path).
# Flipped bits inside tensor data are not found: torch.load does not see them either.
TORCH_SUFFIXES = (".pt", ".pth", ".bin")  # torch.save archives: optimizer, scheduler, RNG, ZeRO shards
SAFETENSORS_SUFFIX = ".safetensors"
# a torch.save archive up to this size has every entry's CRC-32 checked, smallest first until
# TORCH_CHECKSUM_TOTAL bytes of a checkpoint are read (RNG, scheduler, small models); a larger
# one only its pickle and metadata (the tensors' bytes, most of it, are read by the load itself;
# every rank checks every file, so a universal checkpoint's thousands of files are not read whole)
TORCH_CHECKSUM_BYTES = 64 << 20
TORCH_CHECKSUM_TOTAL = 256 << 20
# safetensors' own limit on the JSON header; a larger length is a damaged first 8 bytes
SAFETENSORS_MAX_HEADER = 100_000_000
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "C64": 8,
}
SAFETENSORS_PACKED_DTYPES = ("F4", "F6_E2M3", "F6_E3M2")  # sub-byte: their sizes are not checked
_ZIP_LOCAL_HEADER = b"PK\x03\x04"
# trainer_state.json: TrainerState's fields and what the Trainer needs of them on resume
# (None allowed where the field is optional)
_COUNT, _NUMBER, _TEXT, _FLAG = "a whole number >= 0", "a finite number", "text", "true or false"
TRAINER_STATE_FIELDS = {
    "global_step": (_COUNT, False),
    "epoch": (_NUMBER, True),
    "max_steps": (_COUNT, False),
    "logging_steps": (_NUMBER, True),
    "eval_steps": (_NUMBER, True),
    "save_steps": (_NUMBER, True),
    "train_batch_size": (_COUNT, True),
    "num_train_epochs": (_NUMBER, False),
    "num_input_tokens_seen": (_COUNT, False),
    "total_flos": (_NUMBER, False),
    "log_history": ("a list of objects", False),
    "best_metric": (_NUMBER, True),
    "best_global_step": (_COUNT, True),
    "best_model_checkpoint": (_TEXT, True),
    "is_local_process_zero": (_FLAG, False),
    "is_world_process_zero": (_FLAG, False),
    "is_hyper_param_search": (_FLAG, False),
    "trial_name": (_TEXT, True),
    "trial_params": ("an object", True),
    "stateful_callbacks": ("an object of callback states", True),
}


class CorruptCheckpointError(ValueError):
    """A checkpoint file that a resume cannot load (cut short, damaged, not its format); the
    message names the file, what is wrong and what to resume instead."""


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _fits(kind: str, v) -> bool:
    if kind == _COUNT:
        return _is_count(v)
    if kind == _NUMBER:
        return _is_number(v)
    if kind == _TEXT:
        return isinstance(v, str)
    if kind == _FLAG:
        return isinstance(v, bool)
    if kind == "a list of objects":
        return isinstance(v, list) and all(isinstance(e, dict) for e in v)
    if kind == "an object":
        return isinstance(v, dict)
    # stateful_callbacks: name -> {"args": {...}, "attributes": {...}}, or a list of them
    return isinstance(v, dict) and all(
        all(isinstance(c, dict) and all(isinstance(c.get(k, {}), dict) for k in ("args", "attributes")) for c in cs)
        for cs in (x if isinstance(x, list) else [x] for x in v.values())
    )


def _trainer_state_fields() -> set:
    try:  # the installed transformers' fields: TrainerState(**state) refuses any other key
        from dataclasses import fields

        from transformers import TrainerState  # transformers
    except ImportError:  # pragma: no cover
        return set(TRAINER_STATE_FIELDS)
    return {f.name for f in fields(TrainerState)}


def _json_problem(path: Path) -> Optional[str]:
    try:
        data = load_json(path.read_bytes())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        return f"is not valid JSON ({e})"
    if path.name != "trainer_state.json":
        return None
    if not isinstance(data, dict):
        return f"must hold a JSON object (the Trainer's state), got {type(data).__name__}"
    known = _trainer_state_fields()
    for k, v in data.items():
        if k not in known:
            return f"field {k!r} is not one of transformers' TrainerState (saved by another transformers version?)"
        if k in TRAINER_STATE_FIELDS:
            kind, optional = TRAINER_STATE_FIELDS[k]
            if not (v is None and optional) and not _fits(kind, v):
                return f"field {k!r} must be {kind}{' or null' if optional else ''}, got {v!r:.80}"
    if "global_step" not in data:
        return "has no global_step: the Trainer cannot tell where to resume"
    return None


def _safetensors_problem(path: Path, size: int) -> Optional[str]:
    if size < 8:
        return f"is cut short: {size} bytes, less than the 8-byte header length a safetensors file starts with"
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if n > SAFETENSORS_MAX_HEADER:
            return f"is damaged: its first 8 bytes give a header of {n} bytes, not a safetensors header length"
        if 8 + n > size:
            return f"is cut short: its header needs {n} bytes after the first 8, the file has {size} bytes in all"
        raw = fh.read(n)
    try:
        header = load_json(raw)
    except ValueError as e:
        return f"is damaged: its header is not valid JSON ({e})"
    if not isinstance(header, dict):
        return "is damaged: its header is not a JSON object"
    spans = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = t["dtype"], list(t["shape"]), t["data_offsets"]
            ok = all(_is_count(x) for x in [start, end, *shape]) and start <= end
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            return f"is damaged: tensor {name!r} has no valid dtype, shape and data_offsets in the header"
        elems = 1
        for x in shape:
            elems *= x
        width = SAFETENSORS_DTYPE_BYTES.get(dtype)
        if width is None and dtype not in SAFETENSORS_PACKED_DTYPES:
            return f"is damaged: tensor {name!r} has dtype {dtype!r}, which is no safetensors dtype"
        if width is not None and elems * width != end - start:
            return f"is damaged: tensor {name!r} ({dtype}, shape {shape}) does not span {end - start} bytes"
        spans.append((start, end, name))
    data = size - 8 - n
    at = 0
    for start, end, name in sorted(spans):
        if start != at:
            return f"is damaged: tensor {name!r} starts at byte {start} of the data, where {at} was expected"
        at = end
    if at > data:
        return f"is cut short: its tensors need {at} bytes of data, the file holds {data} ({size} bytes in all)"
    if at < data:
        return f"is damaged: {data - at} bytes follow its last tensor"
    return None


def _torch_problem(path: Path, size: int, whole: bool) -> Optional[str]:
    """`whole`: check the CRC-32 of every entry, not only of the pickle and metadata."""
    import zipfile

    if size == 0:
        return "is empty"
    with open(path, "rb") as fh:
        magic = fh.read(4)
        if magic != _ZIP_LOCAL_HEADER:
            if magic[:1] == b"\x80":  # torch.save's legacy pickle format: nothing cheap to check
                return None
            return "is not a torch.save archive (no zip signature at its start): damaged or another kind of file"
        try:
            z = zipfile.ZipFile(fh)
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            return f"is cut short or damaged: its zip directory cannot be read ({e})"
        with z:
            entries = z.infolist()
            if not any(e.filename == "data.pkl" or e.filename.endswith("/data.pkl") for e in entries):
                return "is not a torch.save archive: it holds no data.pkl"
            for e in entries:
                if e.header_offset + 30 + e.compress_size > size:
                    return f"is cut short: its entry {e.filename} reaches past the end of the file ({size} bytes)"
                fh.seek(e.header_offset)
                if fh.read(4) != _ZIP_LOCAL_HEADER:
                    return f"is damaged: its entry {e.filename} has no zip header where the directory places it"
                if whole or "/data/" not in "/" + e.filename:  # the pickle and its metadata; tensors of small files
                    try:
                        with z.open(e) as r:
                            while r.read(1 << 20):
                                pass
                    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
                        return f"is damaged: its entry {e.filename} does not match its checksum ({err})"
    return None


def _deepspeed_problem(checkpoint: Path) -> Optional[Tuple[Path, str]]:
    """The DeepSpeed folder named by `latest`: present, with its model states and a ZeRO
    optimizer shard for every rank 0..N-1."""
    latest = checkpoint / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_bytes().decode("utf-8", "replace").strip()
    folder = checkpoint / tag
    if not tag or "/" in tag or not folder.is_dir():
        return latest, f"names the DeepSpeed folder {tag!r}, which {checkpoint} does not hold"
    if not any(folder.glob("*model_states.pt")):
        return folder, "holds no mp_rank_00_model_states.pt (DeepSpeed's model states)"
    ranks = sorted(
        int(m.group(1))
        for f in folder.glob("zero_pp_rank_*_mp_rank_00_optim_states.pt")
        if (m := re.match(r"zero_pp_rank_(\d+)_", f.name))
    )
    missing = sorted(set(range(ranks[-1] + 1)) - set(ranks)) if ranks else []
    if missing:
        return folder / f"zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt", (
            f"is missing: the ZeRO optimizer state of rank {missing[0]} (ranks {ranks} are there)"
        )
    return None


def _bytes(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # gone since it was listed: read below, which names it
        return 0


def _completion_record(ckpt: Path) -> Tuple[dict, dict]:
    """The sizes and digests COMPLETE_FILE recorded at the save ({} for what it lacks)."""
    try:
        record = load_json((ckpt / COMPLETE_FILE).read_text())
        sizes = dict(record["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}, {}
    digests = record.get(DIGESTS_FIELD)
    if not (isinstance(digests, dict) and all(isinstance(v, str) for v in digests.values())):
        digests = {}
    return sizes, digests


def check_checkpoint_files(checkpoint: Union[str, Path], allowed_globals: Sequence[str] = ()) -> List[str]:
    """Raise CorruptCheckpointError naming the first file of `checkpoint` that a resume could not
    load: trainer_state.json (missing, not JSON, a field the Trainer cannot use), any other JSON
    file, a safetensors file (header, coverage), a torch.save archive (.pt, .pth, .bin: optimizer,
    scheduler, RNG state, DeepSpeed model states and ZeRO shards) or DeepSpeed's `latest` folder.
    Then UntrustedCheckpointError (checkpoint/trust.py) for a file whose SHA-256 differs from
    the one COMPLETE_FILE recorded, or a pickle that would import anything beyond what the
    Trainer's, DeepSpeed's and torch distributed checkpoint's states need (and
    `allowed_globals`). Returns notes: a record without digests (an older hf_cp), and there
    files whose size differs from the recorded one."""
    ckpt = Path(checkpoint)
    recorded, digests = _completion_record(ckpt)
    notes: List[str] = []

    def refuse(path: Path, problem: str, size: Optional[int] = None):
        saved = recorded.get(path.relative_to(ckpt).as_posix()) if path.is_relative_to(ckpt) else None
        if size is not None and isinstance(saved, int) and saved != size:
            problem += f" ({size} bytes; {saved} when it was saved)"
        step = CHECKPOINT_NAME.match(ckpt.name)
        older = last_complete(ckpt.parent, before=int(step.group(1))) if step else None
        instead = (
            f"resume {older}, the complete checkpoint before it, or delete {ckpt.name} ('latest' then resumes it)"
            if older is not None
            else f"no complete checkpoint precedes it in {ckpt.parent} (delete {ckpt.name} to start afresh)"
        )
        raise CorruptCheckpointError(f"checkpoint file {path} {problem}. {ckpt} cannot be resumed: {instead}")

    state = ckpt / "trainer_state.json"
    if not state.is_file():
        refuse(state, "is missing: a Trainer checkpoint holds its training state there")
    files = sorted(f for f in ckpt.rglob("*") if f.is_file())
    # the small files first: trainer_state.json names the step before the weights are looked at
    budget = TORCH_CHECKSUM_TOTAL
    sizes = {f: _bytes(f) for f in files}
    for f in sorted(files, key=lambda f: (f != state, f.suffix != ".json", sizes[f], str(f))):
        if f.name in (COMPLETE_FILE, SCHEDULE_FILE) or f.name.endswith(TMP_SUFFIX):
            continue  # checked by checkpoint_status and check_resumed_schedule
        suffix = f.suffix.lower()
        if suffix not in (".json", SAFETENSORS_SUFFIX) + TORCH_SUFFIXES:
            continue
        try:
            size = f.stat().st_size
            if suffix == ".json":
                problem = _json_problem(f)
            elif suffix == SAFETENSORS_SUFFIX:
                problem = _safetensors_problem(f, size)
            else:
                # the recorded SHA-256 reads every byte below: CRC-32s of the pickles suffice
                whole = not digests and size <= min(TORCH_CHECKSUM_BYTES, budget)
                budget -= size if whole else 0
                problem = _torch_problem(f, size, whole)
        except OSError as e:
            problem, size = f"cannot be read ({e.strerror or e})", None
        if problem is not None:
            refuse(f, problem, size)
        saved = recorded.get(f.relative_to(ckpt).as_posix())
        if not digests and isinstance(saved, int) and saved != size and suffix != ".json":
            notes.append(f"checkpoint file {f} has {size} bytes, {saved} when it was saved; it reads fine")
    found = _deepspeed_problem(ckpt)
    if found is not None:
        refuse(*found)
    named = CHECKPOINT_NAME.match(ckpt.name)
    if named:  # the Trainer resumes at trainer_state's step; the folder's name is what resume chose it by
        saved_step = load_json(state.read_text()).get("global_step")
        if saved_step != int(named.group(1)):
            refuse(
                state,
                f"says global_step {saved_step}, but its folder is {ckpt.name}: it belongs to another checkpoint "
                f"(copied or renamed by hand)",
            )
    if digests:
        changed = digest_mismatches(ckpt, digests, files)
        if changed is not None:
            f, now = changed
            name = f.relative_to(ckpt).as_posix()
            size, saved = _bytes(f), recorded.get(name)
            sizes = f"{size} bytes" + (f", {saved} when it was saved" if isinstance(saved, int) else "")
            raise UntrustedCheckpointError(
                f"checkpoint file {f} is not the file its save wrote: its {DIGEST} is {now[:16]}..., "
                f"{COMPLETE_FILE} recorded {digests[name][:16]}... ({sizes}). Nothing of {ckpt} was "
                f"loaded: copy the checkpoint again, or resume an earlier one"
            )
    elif recorded:
        notes.append(
            f"{ckpt} records no {DIGEST} checksums (saved by an hf_cp before they were recorded): "
            f"its files were checked for their format and for code in their pickles only"
        )
    refuse_code_in_pickles(ckpt, files, allowed_globals)
    return notes
