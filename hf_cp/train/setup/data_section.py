"""A training config's data section: where the samples come from, and the preprocessing a run
does itself when they are raw.

    data:
      path: chat.jsonl          # or name: a Hub dataset (split, subset), or bundled: chat_sample
      format: auto              # tokens | chat | prompt-completion | text
      template: chat.jinja      # a chat template for the run's tokenizer (default: its own)
      max_length: 1024          # overlong: error | drop | truncate
      mask: auto                # assistant | last-assistant | completion | none

trainer: cp trains token ids. Rows that already hold `input_ids` (hf-cp preprocess's output,
the bundled longtail_sample) are used as they are; raw chat, prompt-completion or text rows go
through the same pipeline as `hf-cp preprocess` (data_prep/pipeline.py) with the run's tokenizer,
datasets' map and filter showing their progress. The result is saved under
output_dir/preprocessed/, keyed by a fingerprint of the raw rows, the settings and the
tokenizer (datasets' Hasher), so a second run, a resumed one and every other rank reuse it:
the main process of each node preprocesses first (TrainingArguments.main_process_first), the
others then read its copy, and a copy is written to a temporary folder and renamed, so a reader
never sees half of one. The TRL trainers (sft, dpo, kto, grpo, rloo) tokenise their rows
themselves: for them the section only reads the rows (and `template` sets the tokenizer's chat
template); the keys of hf_cp's preprocessing are refused for them by name.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable, ContextManager, List, Optional, Tuple

from hf_cp.data import CHAT_SAMPLE_FILE, load_sample_dataset
from hf_cp.data.toy_preferences import toy_preference_rows
from hf_cp.data.toy_prompts import toy_prompts
from hf_cp.data.vlm_sample import load_vlm_sample_dataset
from hf_cp.data_prep.encode import EncodeError
from hf_cp.data_prep.inputs import InputError, load_input
from hf_cp.data_prep.pipeline import AUDIO_COLUMNS, MEDIA_COLUMNS, preprocess
from hf_cp.readers import brief, load_json
from hf_cp.train.setup.config_names import LOOKED, resolve_input
from hf_cp.train.setup.schema import DATA_KEYS, PREPROCESS_KEYS, TrainConfigError, check_section

# longtail_sample: token ids (trainer cp); chat_sample: 33 raw chat samples (trainer cp preprocesses them
# with the run's tokenizer, trainer sft gives them to TRL); toy_preferences: prompt/chosen/rejected text (dpo,
# kto); toy_prompts: prompts (grpo, rloo; the reward hf_cp.data.toy_prompts:share_of_a); vlm_sample: images and
# a clip through the tiny Qwen2.5-VL processor (trainer cp, model.model_class Qwen2_5_VLForConditionalGeneration)
BUNDLED = ("longtail_sample", "chat_sample", "toy_preferences", "toy_prompts", "vlm_sample")
FORMATS = ("auto", "tokens", "chat", "prompt-completion", "text")
CACHE_FOLDER = "preprocessed"  # under output_dir
TOKEN_SUFFIXES = (".jsonl", ".gz")  # what trainer cp read as token ids before the section preprocessed


# hf-cp preprocess's flags, as the pipeline's messages and summary name them, and the data keys that set the same
CLI_TO_KEY = (
    ("--max-length", "data.max_length"),
    ("--overlong ", "data.overlong: "),
    ("--text-field", "data.text_field"),
    ("--messages-field", "data.messages_field"),
    ("--prompt-field", "data.prompt_field"),
    ("--completion-field", "data.completion_field"),
    ("--mask", "data.mask"),
)


def in_config_words(message: str) -> str:
    """A preprocessing message with the CLI's flags named by the data keys that set them."""
    for flag, key in CLI_TO_KEY:
        message = message.replace(flag, key)
    return message


def check_data_section(dcfg: dict, trainer: str, source: str) -> None:
    """What the section asks that the trainer cannot honour, refused by name when the config is
    read: hf_cp's preprocessing keys with a TRL trainer (which tokenises the rows itself), and
    `overlong` without `max_length`."""
    if trainer != "cp":
        given = sorted(k for k in dcfg if k in PREPROCESS_KEYS and not (k == "format" and dcfg[k] == "auto"))
        if given:
            raise TrainConfigError(
                f"{source}: data.{given[0]} is hf_cp's preprocessing, for trainer: cp; trainer: {trainer} gives the "
                f"rows to TRL, which tokenises them itself (hf_cp never truncates them: a row longer than the largest "
                f"CP group holds is refused by name); remove data.{', data.'.join(given)}"
            )
    if "overlong" in dcfg and "max_length" not in dcfg:
        raise TrainConfigError(
            f"{source}: data.overlong {dcfg['overlong']!r} says what to do with samples over data.max_length, "
            "which is not set"
        )


def apply_template(dcfg: dict, tokenizer, source: str) -> None:
    """data.template: the file's text becomes the tokenizer's chat template (saved with the final
    model, so the template the run trained with travels with it)."""
    name = dcfg.get("template")
    if name is None:
        return
    if tokenizer is None:
        raise TrainConfigError(
            f"{source}: data.template {name} is a chat template for the run's tokenizer, and this run has none: "
            "give model.tokenizer or a pretrained folder with one"
        )
    path = Path(resolve_input(name))
    if not path.is_file():
        raise TrainConfigError(f"{source}: data.template {name} is no file ({LOOKED}); give a Jinja chat template file")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise TrainConfigError(f"{source}: data.template {name}: cannot read it as text ({e})") from None
    if "{{" not in text and "{%" not in text:
        raise TrainConfigError(
            f"{source}: data.template {name} holds no Jinja ({{{{ ... }}}} or {{% ... %}}): not a chat template"
        )
    tokenizer.chat_template = text


def _read_token_jsonl(p: Path, field: str, source: str):
    """A .jsonl[.gz] of records, each line's error naming its line."""
    from datasets import Dataset  # datasets, loaded only when data is read

    opener = gzip.open if p.suffix == ".gz" else open
    rows = []
    with opener(p, "rt") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(load_json(line))
            except ValueError as e:  # JSONDecodeError (nested too deep too), UnicodeDecodeError
                raise TrainConfigError(f"{source}: data.{field} {p}, line {lineno}: not a JSON record ({e})") from None
    if not rows:
        raise TrainConfigError(f"{source}: data.{field} {p} holds no records")
    return Dataset.from_list(rows)


def read_rows(name: str, field: str, source: str, split: str = "train", subset: Optional[str] = None):
    """The rows at data.`field`: a saved `datasets` folder, a .json/.jsonl/.parquet/.csv file
    (optionally compressed), a folder of such files, or (data.name) a Hub dataset."""
    from datasets import load_from_disk  # datasets, loaded only when data is read

    if field == "name":
        try:
            return load_input(name, split=split, subset=subset)
        except InputError as e:
            raise TrainConfigError(f"{source}: data.name: {e}") from None
    p = Path(resolve_input(name))
    if not p.exists():
        raise TrainConfigError(f"{source}: data.{field} {name} does not exist ({LOOKED})")
    if p.is_dir() and ((p / "state.json").exists() or (p / "dataset_dict.json").exists()):
        try:
            ds = load_from_disk(str(p))
        except Exception as e:  # noqa: BLE001 (datasets raises IndexError on a folder of no rows, others when cut short)
            raise TrainConfigError(
                f"{source}: data.{field} {name}: datasets could not load this saved folder ({type(e).__name__}: {e}); "
                "write it again (Dataset.save_to_disk, hf-cp preprocess), and check that it holds rows"
            ) from None
        if hasattr(ds, "keys"):
            if split not in ds:
                raise TrainConfigError(f"{source}: data.{field} {name} has no split {split!r} (splits: {sorted(ds)})")
            ds = ds[split]
        return ds
    if p.is_file() and p.suffix in TOKEN_SUFFIXES and ".json" in p.name:
        return _read_token_jsonl(p, field, source)
    try:
        return load_input(str(p), split=split, subset=subset)
    except InputError as e:
        raise TrainConfigError(
            f"{source}: data.{field}: {e}; expected a folder written by Dataset.save_to_disk (hf-cp preprocess), "
            "a .json/.jsonl/.parquet/.csv file, or a folder of them"
        ) from None


def _bundled_rows(name: str, limit: int, source: str):
    from datasets import Dataset  # datasets, loaded only when data is read

    if name not in BUNDLED:
        raise TrainConfigError(f"{source}: data.bundled {name!r}: the bundled datasets are {', '.join(BUNDLED)}")
    if name in ("toy_preferences", "toy_prompts"):
        rows = toy_preference_rows() if name == "toy_preferences" else toy_prompts()
        return Dataset.from_list(rows[:limit] if limit else rows)
    if name == "vlm_sample":
        return load_vlm_sample_dataset(limit=limit)
    if name == "chat_sample":
        ds = read_rows(str(CHAT_SAMPLE_FILE), "bundled", source)
        return ds.select(range(min(limit, len(ds)))) if limit else ds
    return load_sample_dataset(limit=limit)


@contextlib.contextmanager
def _no_wait(desc: str):
    yield


class DataPreparation:
    """How raw rows become a run's token ids (trainer cp), and where the result is kept.

    `tokenizer`: the run's (None: a run whose model has no tokenizer); `cache_root`: the folder
    preprocessed copies are kept in (output_dir/preprocessed; None: nothing written, as in the
    dry run); `main_first`: a context manager factory (desc) under which the main process works
    first and the others wait (TrainingArguments.main_process_first); `is_main`: whether this
    process prints what it did; `say`: where it prints."""

    def __init__(
        self,
        trainer: str = "cp",
        tokenizer=None,
        cache_root: Optional[Path] = None,
        main_first: Callable[[str], ContextManager] = _no_wait,
        is_main: bool = True,
        say: Callable[[str], None] = print,
    ):
        self.trainer, self.tokenizer, self.cache_root = trainer, tokenizer, cache_root
        self.main_first, self.is_main, self.say = main_first, is_main, say

    def prepare(self, ds, dcfg: dict, role: str, origin: str, source: str):
        """`ds` as the trainer takes it: raw rows preprocessed for trainer cp (cached), else as read."""
        fmt = dcfg.get("format", "auto")
        if self.trainer != "cp":
            return ds
        if fmt == "tokens" or (fmt == "auto" and "input_ids" in ds.column_names):
            if "input_ids" not in ds.column_names:
                raise TrainConfigError(
                    f"{source}: data.format tokens, but {origin} has no input_ids column (columns: "
                    f"{ds.column_names}); give format: auto to preprocess raw rows"
                )
            given = sorted(k for k in dcfg if k in PREPROCESS_KEYS and k != "format")
            if given:
                raise TrainConfigError(
                    f"{source}: data.{given[0]}: {origin} is already token ids (an input_ids column), so nothing "
                    f"is preprocessed; preprocess the raw rows instead, or remove data.{', data.'.join(given)}"
                )
            return ds
        if "input_ids" in ds.column_names:
            raise TrainConfigError(
                f"{source}: data.format {fmt}, but {origin} already holds token ids (an input_ids column); "
                "give format: tokens (or auto)"
            )
        media = [c for c in ds.column_names if c in MEDIA_COLUMNS or c in AUDIO_COLUMNS]
        if media:
            raise TrainConfigError(
                f"{source}: {origin} has column(s) {media} of images, video or audio, which the data section does "
                "not encode: preprocess images and video with the model's processor first (hf-cp preprocess DATA "
                "--processor FOLDER --out D) and give data.path: D"
            )
        if self.tokenizer is None:
            raise TrainConfigError(
                f"{source}: {origin} holds raw rows (columns {ds.column_names}), which need a tokenizer: give "
                "model.tokenizer or a pretrained folder with one, or token ids (hf-cp preprocess)"
            )
        settings = self.settings(dcfg)
        key = self.fingerprint(ds, settings)
        cached = self.cache_root / f"{role}-{key}" if self.cache_root is not None else None
        with self.main_first(f"preprocessing the {role} data"):
            if cached is not None and (cached / "state.json").exists():
                from datasets import load_from_disk  # datasets

                out = load_from_disk(str(cached))
                if self.is_main:
                    self.say(
                        f"data ({role}): {len(out)} samples preprocessed earlier from {origin}, read from {cached}"
                    )
                return out
            result = self.run(ds, settings, origin, source)
            if cached is not None:
                self.save(result.dataset, cached)
        if self.is_main:
            policy = settings["overlong"]
            lines = [in_config_words(line) for line in result.summary_lines(settings["max_length"], policy)]
            where = f", saved to {cached}" if cached is not None else ""
            self.say(f"data ({role}): {origin} preprocessed with the run's tokenizer{where}")
            for line in lines:
                self.say("  " + line)
        return result.dataset

    @staticmethod
    def settings(dcfg: dict) -> dict:
        """What pipeline.preprocess is given (the fingerprint covers all of it)."""
        fmt = dcfg.get("format", "auto")
        return {
            "text_field": dcfg.get("text_field") or ("text" if fmt == "text" else None),
            "messages_field": dcfg.get("messages_field", "messages"),
            "prompt_field": dcfg.get("prompt_field", "prompt"),
            "completion_field": dcfg.get("completion_field", "completion"),
            "mask": dcfg.get("mask", "auto"),
            "max_length": dcfg.get("max_length"),
            "overlong": dcfg.get("overlong", "error"),
            "add_eos": dcfg.get("add_eos", True),
            "num_proc": dcfg.get("num_proc"),
            "format": fmt,
        }

    def fingerprint(self, ds, settings: dict) -> str:
        """The raw rows' fingerprint (datasets': it changes with the data files), the settings that
        change the result, and the tokenizer (its vocabulary, special tokens and chat template)."""
        from datasets.fingerprint import Hasher  # datasets

        kept = {k: v for k, v in settings.items() if k != "num_proc"}  # processes change nothing
        return Hasher.hash((ds._fingerprint, sorted(kept.items()), self.tokenizer))

    def run(self, ds, settings: dict, origin: str, source: str):
        fmt = settings.pop("format")
        try:
            result = preprocess(origin, self.tokenizer, raw=ds, **settings)
        except (InputError, EncodeError, ValueError) as e:
            raise TrainConfigError(f"{source}: data: {in_config_words(str(e))}") from None
        if fmt not in ("auto",) and not result.kind.startswith(fmt):
            raise TrainConfigError(
                f"{source}: data.format {fmt}, but {origin} reads as {result.kind} samples (columns {ds.column_names}); "
                f"name the field with data.{'text_field' if fmt == 'text' else 'messages_field' if fmt == 'chat' else 'prompt_field'}"
            )
        return result

    @staticmethod
    def save(ds, cached: Path) -> None:
        """Written beside its final place and renamed: a reader never sees a half-written copy, and
        two nodes writing the same copy on a shared disk keep the first."""
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.parent / f".{cached.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        ds.save_to_disk(str(tmp))
        try:
            os.rename(tmp, cached)
        except OSError:  # another process renamed its copy first: the same rows
            shutil.rmtree(tmp, ignore_errors=True)


def load_datasets(dcfg: dict, source: str, preparation: Optional[DataPreparation] = None) -> Tuple[object, object]:
    """(train, eval or None), as the trainer takes them (`preparation`: how raw rows are
    preprocessed; default: trainer cp, no tokenizer, nothing cached). Evaluation data:
    data.eval_path (same formats as path), or data.eval_split: a fraction of the samples held
    out (seeded by data.eval_seed, default 0), drawn after preprocessing."""
    prep = preparation or DataPreparation()
    dcfg = check_section("data", dcfg, DATA_KEYS, source)  # typed, null keys left out
    limit = int(dcfg.get("limit", 0) or 0)
    split, subset = dcfg.get("split", "train"), dcfg.get("subset")
    sources = [k for k in ("bundled", "path", "name") if k in dcfg]
    if len(sources) > 1:
        raise TrainConfigError(f"{source}: data.{sources[0]} and data.{sources[1]} both set: choose one source")
    if not sources:
        raise TrainConfigError(
            f"{source}: data needs one of bundled: ({', '.join(BUNDLED)}), path: (a file or folder) or name: "
            "(a Hub dataset)"
        )
    field = sources[0]
    if field == "bundled":
        ds, origin = _bundled_rows(dcfg["bundled"], limit, source), f"the bundled {dcfg['bundled']}"
    else:
        origin = f"data.{field} {dcfg[field]}"
        # the main process reads first: a Hub download, or datasets' arrow copy of a file, made once
        with prep.main_first(f"reading {origin}"):
            ds = read_rows(dcfg[field], field, source, split, subset)
        ds = ds.select(range(min(limit, len(ds)))) if limit else ds
    if len(ds) == 0:
        raise TrainConfigError(f"{source}: {origin} holds no samples")
    ds = prep.prepare(ds, dcfg, "train", origin, source)
    if dcfg.get("eval_path") and dcfg.get("eval_split"):
        raise TrainConfigError(f"{source}: data.eval_path and data.eval_split both set; choose one")
    if dcfg.get("eval_path"):
        with prep.main_first("reading data.eval_path"):
            evaluation = read_rows(dcfg["eval_path"], "eval_path", source, split, subset)
        if len(evaluation) == 0:
            raise TrainConfigError(f"{source}: data.eval_path {dcfg['eval_path']} holds no samples")
        return ds, prep.prepare(evaluation, dcfg, "eval", f"data.eval_path {dcfg['eval_path']}", source)
    if dcfg.get("eval_split"):
        parts = ds.train_test_split(test_size=float(dcfg["eval_split"]), seed=int(dcfg.get("eval_seed", 0)))
        return parts["train"], parts["test"]
    return ds, None


def data_lines(dcfg: dict) -> List[str]:
    """The section in words, for the dry run (what will be read and how)."""
    what = next((f"{k} {brief(dcfg[k])}" for k in ("bundled", "path", "name") if k in dcfg), "no source")
    extra = [f"{k} {brief(dcfg[k])}" for k in ("format", "template", "max_length", "overlong", "mask") if k in dcfg]
    return [f"data: {what}" + (f" ({', '.join(extra)})" if extra else "")]
