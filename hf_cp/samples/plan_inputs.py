"""What `hf-cp plan` plans: the samples' lengths and masks, read from one of
    - a text file, one token count per line (a causal sample each);
    - a JSON-lines file, one sample a line: `{"length": N}` (a causal sample of N tokens) or a
      shared-prompt group `{"prompt": P, "answers": [a1, ..., an]}` in tokens
      (benchmarks/traces/shared_prompt_*.jsonl): one sample of P + sum(a) tokens with the
      shared-prompt mask (a single answer is a causal sample). Either may carry
      `"vision": [[t, h, w], ...]`, the patch grids of the sample's images and clips (its
      length counts their placeholder tokens);
    - a dataset saved by `hf-cp preprocess` (or any save_to_disk folder): its `length` column
      (else the input_ids' lengths), its `attn_mask` column, its `image_grid_thw` and
      `video_grid_thw` columns (a vision-language processor's), and pre-packed rows unpacked
      into their documents (packed_input.py), as the trainer reads them.
Errors name the file and the line or sample. Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Sequence, Union

from hf_cp.readers import brief, load_json
from hf_cp.samples.lengths import MAX_TOKENS, LengthsError, load_saved_dataset, read_lengths
from hf_cp.samples.mask_column import MASK_COLUMN, decode_mask_column
from hf_cp.samples.masks import MaskError, SampleMask
from hf_cp.samples.packed_input import PackedInputError, boundary_columns, row_documents
from hf_cp.samples.vision import KIND_COLUMNS, KINDS
from hf_cp.samples.vision_grids import SampleGrids, VisionGridError, parse_grids

GROUP_SUFFIXES = (".jsonl", ".json")
# a vision-language processor's patch-grid columns, images before clips
GRID_COLUMNS = tuple(KIND_COLUMNS[kind][1] for kind in KINDS)


@dataclass
class PlanInputs:
    lengths: List[int]
    masks: Dict[int, SampleMask] = field(default_factory=dict)  # sample id -> non-causal mask
    kind: str = "lengths"  # what the source was, for reports
    vision: Dict[int, SampleGrids] = field(default_factory=dict)  # sample id -> its items' patch grids

    def describe(self) -> str:
        parts = [self.kind]
        if self.masks:
            kinds = sorted({m.kind for m in self.masks.values()})
            parts.append(f"{len(self.masks)} with masks ({', '.join(kinds)})")
        if self.vision:
            items = sum(len(g) for g in self.vision.values())
            parts.append(f"{len(self.vision)} with images or clips ({items} items)")
        return ", ".join(parts)


def read_plan_inputs(path: Union[str, Path]) -> PlanInputs:
    """Lengths and masks from a lengths file, a shared-prompt JSON-lines file or a saved dataset."""
    p = Path(path)
    if not p.exists():
        raise LengthsError(f"lengths file {p} does not exist")
    if p.is_dir():
        return _dataset_inputs(p)
    if p.suffix.lower() in GROUP_SUFFIXES or _first_char(p) == "{":
        return _group_records(p)
    return PlanInputs(read_lengths(p), kind="lengths")


def _first_char(p: Path) -> str:
    with p.open() as f:
        for line in f:
            s = line.strip()
            if s and not s.startswith("#"):
                return s[0]
    return ""


RECORD_FORMS = '{"length": N} or {"prompt": P, "answers": [a1, ...]}, either with "vision": [[t, h, w], ...]'


def _group_records(p: Path) -> PlanInputs:
    lengths: List[int] = []
    masks: Dict[int, SampleMask] = {}
    vision: Dict[int, SampleGrids] = {}
    groups = 0  # records of the shared-prompt form
    with p.open() as f:
        for lineno, line in enumerate(f, 1):
            s = line.strip()
            if not s:
                continue
            where = f"{p}, line {lineno}"
            try:
                rec = load_json(s)
            except json.JSONDecodeError as e:
                raise LengthsError(f"{where}: not JSON ({e}); expected {RECORD_FORMS}") from None
            if isinstance(rec, dict) and "vision" in rec:
                try:
                    grids = parse_grids(rec["vision"], where, "field 'vision'")
                except VisionGridError as e:
                    raise LengthsError(str(e)) from None
                if grids:
                    vision[len(lengths)] = grids
            if isinstance(rec, dict) and "length" in rec and "prompt" not in rec:
                n = rec["length"]
                if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= MAX_TOKENS:
                    raise LengthsError(
                        f"{where}: field 'length' must be a positive token count (at most {MAX_TOKENS}), got {brief(n)}"
                    )
                lengths.append(n)
                continue
            if not isinstance(rec, dict) or "prompt" not in rec or "answers" not in rec:
                raise LengthsError(f"{where}: expected a record {RECORD_FORMS} of token counts, got {s[:80]!r}")
            prompt, answers = rec["prompt"], rec["answers"]
            groups += 1
            ok = isinstance(prompt, int) and 0 <= prompt <= MAX_TOKENS and isinstance(answers, list) and answers
            ok = ok and all(isinstance(a, int) and 0 < a <= MAX_TOKENS for a in answers)
            if not ok:
                raise LengthsError(
                    f"{where}: prompt must be a token count >= 0 and answers a non-empty list of positive token "
                    f"counts (each at most {MAX_TOKENS}), got prompt {brief(prompt)}, answers {brief(answers)}"
                )
            mask = SampleMask.shared_prompt(prompt, answers)
            if not mask.is_causal:
                masks[len(lengths)] = mask.validate(f"{len(lengths)} ({where})")
            lengths.append(mask.length)
    if not lengths:
        raise LengthsError(f"{p}: no records found (one {RECORD_FORMS} per line expected)")
    kind = "shared-prompt records" if groups else "length records"
    return PlanInputs(lengths, masks, kind=kind, vision=vision)


def _dataset_inputs(p: Path) -> PlanInputs:
    from datasets import DatasetDict  # datasets, only for a folder

    ds = load_saved_dataset(p)
    if isinstance(ds, DatasetDict):
        ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
    cols = ds.column_names
    if len(ds) == 0:
        raise LengthsError(f"dataset {p} is empty")
    if "length" in cols:
        rows = [int(n) for n in ds["length"]]
    elif "input_ids" in cols:
        rows = [len(x) for x in ds["input_ids"]]
    else:
        raise LengthsError(
            f"dataset {p} has no 'length' or 'input_ids' column (columns: {cols}); run `hf-cp preprocess` to add it"
        )
    bad = next((i for i, n in enumerate(rows) if n <= 0), None)
    if bad is not None:
        raise LengthsError(f"dataset {p}: sample {bad} has length {rows[bad]}; lengths must be positive")
    packed = boundary_columns(cols)
    if packed:
        values = {c: ds[c] for c in packed}
        lengths: List[int] = []
        try:
            for i, n in enumerate(rows):
                lengths += row_documents(n, {c: values[c][i] for c in packed}, row=f"{i} of dataset {p}")
        except PackedInputError as e:
            raise LengthsError(str(e)) from None
        return PlanInputs(lengths, kind=f"pre-packed dataset ({len(rows)} rows)")
    masks = {}
    if MASK_COLUMN in cols:
        try:
            masks = decode_mask_column(ds[MASK_COLUMN], rows, f"dataset {p}")
        except MaskError as e:
            raise LengthsError(str(e)) from None
    return PlanInputs(rows, masks, kind="dataset", vision=_dataset_grids(ds, p))


def _dataset_grids(ds, p: Path) -> Dict[int, SampleGrids]:
    try:
        return grid_columns_vision({c: ds[c] for c in GRID_COLUMNS if c in ds.column_names}, f"dataset {p}")
    except VisionGridError as e:
        raise LengthsError(str(e)) from None


def grid_columns_vision(columns: Mapping[str, Sequence], where: str) -> Dict[int, SampleGrids]:
    """sample (row) -> its image grids, then its clip grids, from a processor's grid columns
    (`columns`: name -> one value per row, of GRID_COLUMNS; a row's None or empty list: none of
    that kind). Rows without any are left out. VisionGridError names the row and the column."""
    present = [c for c in GRID_COLUMNS if c in columns]
    out: Dict[int, SampleGrids] = {}
    for i, row in enumerate(zip(*(columns[c] for c in present))):
        grids = sum((parse_grids(v, f"{where}: sample {i}", c) for c, v in zip(present, row)), ())
        if grids:
            out[i] = grids
    return out
