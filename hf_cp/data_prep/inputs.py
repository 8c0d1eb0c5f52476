"""Read the raw samples: a local json/jsonl/parquet/csv file, a saved dataset folder, or a
dataset on the Hugging Face Hub."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from hf_cp.readers import check_json_file

# file suffix -> datasets' packaged builder
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


class InputError(ValueError):
    """The input cannot be read; the message names the path or dataset and what was expected."""


def _pick_split(ds, split: str, source: str):
    from datasets import DatasetDict

    if isinstance(ds, DatasetDict):
        if split not in ds:
            raise InputError(f"{source} has no split {split!r} (splits: {sorted(ds)}); choose one with --split")
        return ds[split]
    return ds


def load_input(source: str, split: str = "train", subset: Optional[str] = None):
    """One `datasets.Dataset` of raw samples from `source`.

    - a file ending in .json / .jsonl / .parquet / .csv (compressed forms like .jsonl.gz too);
    - a folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`;
    - a folder of such data files (read with `load_dataset(folder)`);
    - anything else is taken as a Hub dataset name (needs a network).
    """
    import datasets

    p = Path(source)
    if p.is_file():
        suffixes = [s.lower() for s in p.suffixes]
        if suffixes and suffixes[-1] in (".gz", ".bz2", ".xz", ".zst"):
            suffixes = suffixes[:-1]
        builder = FILE_BUILDERS.get(suffixes[-1] if suffixes else "")
        if builder is None:
            raise InputError(
                f"{p}: unsupported file type {''.join(p.suffixes) or '(none)'}; expected one of "
                f"{', '.join(sorted(FILE_BUILDERS))} (optionally compressed)"
            )
        if builder == "json" and p.suffix.lower() != ".zst":
            try:  # pyarrow's JSON reader crashes the process on deep nesting: refused first
                check_json_file(p)
            except ValueError as e:
                raise InputError(f"{p}: {e}") from None
            except Exception:  # noqa: BLE001 (a corrupt archive: datasets reports it below)
                pass
        try:
            return datasets.load_dataset(builder, data_files=str(p), split="train")
        except Exception as e:  # datasets wraps parse errors in several exception types
            raise InputError(f"{p}: could not read it as {builder}: {e}") from None
    if p.is_dir():
        if (p / "state.json").exists() or (p / "dataset_dict.json").exists():
            return _pick_split(datasets.load_from_disk(str(p)), split, str(p))
        try:
            return _pick_split(datasets.load_dataset(str(p)), split, str(p))
        except Exception as e:
            raise InputError(
                f"{p}: neither a saved dataset (no state.json / dataset_dict.json) nor a folder "
                f"of data files datasets can read: {e}"
            ) from None
    if source.startswith((".", "/", "~")) or source.endswith(tuple(FILE_BUILDERS)):
        raise InputError(f"input {source} does not exist")
    try:
        # only the split asked for: hub datasets can be large
        return datasets.load_dataset(source, subset, split=split)
    except Exception as e:
        raise InputError(
            f"{source!r} is not a local file or folder, and loading it from the Hugging Face Hub "
            f"failed (is a network available?): {type(e).__name__}: {e}"
        ) from None
