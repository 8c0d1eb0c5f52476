"""The step record: what one optimizer step of a CP run did, predicted and measured.

One typed schema for the per-rank history files (`output_dir/cp_history/rank<R>.jsonl`), the
logged metrics (train/measure/metrics.py) and the reports (hf_cp/report/). CPTrainer builds one record
per step, identical on every rank; each rank's line adds its rank and the sample ids it trained.
Readers go through `StepRecord.from_dict`, which accepts histories written before a field
existed (missing fields take their defaults) and names the file and line of a malformed one.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Tuple, Union, get_args, get_origin, get_type_hints

from hf_cp.readers import load_json


class HistoryError(ValueError):
    """A history line is not a step record; the message names the file and line."""


@dataclass
class StepRecord:
    index: int  # global step index, from 0
    epoch: int
    global_step: int  # the Trainer's step counter after this step (from 1)
    num_samples: int
    global_tokens: int
    global_valid_tokens: int
    loss: float  # sum of token losses / valid targets of the whole global batch
    measured_ms: List[float]  # per rank: compute time of its waves (forward + backward)
    rank_tokens: List[int]  # per rank: tokens it processed
    step_wall_ms: float  # slowest rank's wall time of the whole step
    predicted_ms: List[float]  # per rank: simulated time inside its micro-batches (SimResult.occupied_ms)
    predicted_step_ms: float  # simulated makespan, plus the trainer's forward-only passes (forward_only_passes)
    waves: int
    plan_digest: str
    step_in_epoch: Optional[int] = None
    data_epoch: Optional[float] = None  # epochs of data seen at the end of this step (fractional)
    compare_step_ms: Optional[float] = None  # the other balancer's simulated makespan (not run)
    compare_balancer: Optional[str] = None  # which balancer compare_step_ms is of
    # cp_compare_measured: the step ran the comparison balancer's plan (compare_step_ms is then
    # the run's own balancer's)
    ran_compare: bool = False
    planner_ms: float = 0.0
    cp_size_samples: Dict[str, int] = field(default_factory=dict)  # group size -> samples run on it
    balancer: str = ""  # the plan's balancer (auto records its winner: auto:dynamic_cp)
    plan_notes: List[str] = field(default_factory=list)  # what the planner said (e.g. a solver fallback)
    # ChunkFlow: samples run as dependent chunks, their chunks, chunks recomputed in backward, largest chunk, K
    chunked: Dict[str, int] = field(default_factory=dict)
    attempt: int = 0  # torchrun restarts before the run that trained this step
    resumed_from: Optional[int] = None  # the checkpoint step this process started from
    dataset_samples: Optional[int] = None  # for the exactly-once audit of hf-cp report
    wave_max_ms: List[float] = field(default_factory=list)  # per wave: the slowest rank's time (dummies included)
    # the slowest rank's wall time in the step's forward-only passes (DPO's log-prob and reference
    # passes, the MoE router census), and how many the trainer runs over the plan
    forward_only_ms: float = 0.0
    forward_only_passes: int = 0
    calibration: int = 0  # the cost model that planned it: 0 the profile as given, k the k-th online calibration
    # per rank, GB: the device's peak allocated memory in the step (CUDA only; empty elsewhere)
    # and the memory model's peak for the rank's plan (static bytes + activation bytes x tokens)
    peak_memory_gb: List[float] = field(default_factory=list)
    predicted_peak_memory_gb: List[float] = field(default_factory=list)
    # per-rank lines only
    rank: Optional[int] = None
    trained_sample_ids: Optional[List[int]] = None
    # this rank's clock, seconds since the epoch: [start, end] of its training_step, and per wave
    # [start, end of its compute, end of its backward call (after the gradient reduction)]
    step_span: Optional[List[float]] = None
    wave_timeline: Optional[List[List[float]]] = None

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["rank"] is None:
            for k in ("rank", "trained_sample_ids", "step_span", "wave_timeline"):
                d.pop(k)
        return d

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "step record") -> StepRecord:
        if not isinstance(d, Mapping):
            raise HistoryError(f"{where}: expected a JSON object, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        missing = [
            f.name for f in fields(cls) if f.name not in d and f.default is MISSING and f.default_factory is MISSING
        ]
        if missing:
            raise HistoryError(f"{where}: not a step record (no {', '.join(repr(k) for k in missing)})")
        hints = _field_types()
        for k, v in d.items():
            if k in names and not _fits(v, hints[k]):
                raise HistoryError(f"{where}: field {k!r} must be {_describe(hints[k])}, got {v!r:.80}")
        sizes = d.get("cp_size_samples") or {}
        if not all(isinstance(k, str) and k.isdigit() for k in sizes):
            raise HistoryError(f"{where}: field 'cp_size_samples' maps CP group sizes to samples, got {sizes!r:.80}")
        negative = [k for k in COUNT_FIELDS if isinstance(d.get(k), int) and d[k] < 0]
        if negative:
            raise HistoryError(f"{where}: field {negative[0]!r} must not be negative, got {d[negative[0]]}")
        if not d["measured_ms"] or len(d["measured_ms"]) != len(d["predicted_ms"]):
            raise HistoryError(
                f"{where}: measured_ms and predicted_ms must hold one time per rank each, got "
                f"{len(d['measured_ms'])} and {len(d['predicted_ms'])}"
            )
        return cls(**{k: v for k, v in d.items() if k in names})

    def for_rank(
        self,
        rank: int,
        trained_sample_ids: Optional[List[int]],
        step_span: Optional[List[float]] = None,
        wave_timeline: Optional[List[List[float]]] = None,
    ) -> StepRecord:
        extra = {"step_span": step_span, "wave_timeline": [list(w) for w in wave_timeline or []] or None}
        return StepRecord(
            **{
                **asdict(self),
                "rank": rank,
                "trained_sample_ids": None if trained_sample_ids is None else list(trained_sample_ids),
                **extra,
            }
        )


# fields that count something: never negative
COUNT_FIELDS = ("index", "epoch", "global_step", "num_samples", "global_tokens", "global_valid_tokens", "waves")
COUNT_FIELDS += ("attempt", "rank", "step_in_epoch", "resumed_from", "dataset_samples", "calibration")
_TYPES: Dict[str, object] = {}


def _field_types() -> Dict[str, object]:
    if not _TYPES:
        _TYPES.update(get_type_hints(StepRecord))
    return _TYPES


def _fits(v, hint) -> bool:
    """Whether a JSON value `v` is of the field type `hint` (int, float, str, Optional, List, Dict)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Union:
        return any(_fits(v, a) for a in args)
    if hint is type(None):
        return v is None
    if hint is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if hint is float:  # JSON writes a whole float as an int; NaN and infinity are numbers too
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if hint is str:
        return isinstance(v, str)
    if origin is list:
        return isinstance(v, list) and all(_fits(x, args[0]) for x in v)
    if origin is dict:
        return isinstance(v, dict) and all(_fits(x, args[1]) for x in v.values())
    return True  # pragma: no cover


def _describe(hint, plural: bool = False) -> str:
    origin, args = get_origin(hint), get_args(hint)
    if origin is Union:
        return " or ".join(_describe(a, plural) for a in args)
    if origin is list:
        return ("lists" if plural else "a list") + f" of {_describe(args[0], True)}"
    if origin is dict:
        return ("objects" if plural else "an object") + f" of {_describe(args[1], True)}"
    names = {int: ("a whole number", "whole numbers"), float: ("a number", "numbers"), str: ("a text", "texts")}
    return names.get(hint, ("null", "nulls"))[plural]


def history_path(output_dir: Union[str, Path], rank: int) -> Path:
    return Path(output_dir) / "cp_history" / f"rank{rank}.jsonl"


def append_record(output_dir: Union[str, Path], record: StepRecord) -> None:
    """Append one rank's line (record.rank must be set)."""
    if record.rank is None:
        raise ValueError("append_record: a history line needs the rank (StepRecord.for_rank)")
    path = history_path(output_dir, record.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record.to_dict()) + "\n")


def history_lines(path: Union[str, Path]) -> Iterator[Tuple[int, dict]]:
    """(line number, decoded JSON) of every non-empty line of one rank's history file.

    A kill while a line is appended leaves it torn: the file then ends without a newline. Such
    a last line, when it does not decode, is skipped with a warning naming the file and line;
    a line that does not decode anywhere else is an error naming them."""
    p = Path(path)
    text = p.read_text()
    lines = text.splitlines()
    torn_tail = bool(text) and not text.endswith("\n")
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = load_json(line)
        except json.JSONDecodeError as e:
            if torn_tail and lineno == len(lines):
                warnings.warn(
                    f"{p}, line {lineno}: skipped a torn last line (a process was killed while writing it)",
                    stacklevel=3,
                )
                return
            raise HistoryError(f"{p}, line {lineno}: not a JSON step record ({e})") from None
        yield lineno, d


def read_history(path: Union[str, Path]) -> Iterator[Tuple[int, StepRecord]]:
    """(line number, record) of every non-empty line of one rank's history file (a torn last
    line skipped: history_lines)."""
    p = Path(path)
    for lineno, d in history_lines(p):
        yield lineno, StepRecord.from_dict(d, f"{p}, line {lineno}")


def latest_records(path: Union[str, Path]) -> List[StepRecord]:
    """One rank's records by step index; a resumed run appends, so the last record of a step wins."""
    by_index: Dict[int, StepRecord] = {}
    for _, rec in read_history(path):
        by_index[rec.index] = rec
    return [by_index[k] for k in sorted(by_index)]


def truncate_history(path: Path, steps_done: int) -> int:
    """Keep the history lines of steps below `steps_done` (those the checkpoint holds); steps
    after it are trained again by the resumed run. A last line torn by the kill is dropped too
    (history_lines warns), so the resumed run appends to whole lines. Returns the number of
    lines dropped."""
    if not path.is_file():
        return 0
    text = path.read_text()
    raw = text.splitlines()
    lines = [ln for ln in raw if ln.strip()]
    kept = [raw[n - 1] for n, d in history_lines(path) if _line_index(path, n, d) < steps_done]
    if len(kept) != len(lines) or (text and not text.endswith("\n")):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(ln + "\n" for ln in kept))
        tmp.replace(path)
    return len(lines) - len(kept)


def _line_index(path: Path, lineno: int, d) -> int:
    index = d.get("index") if isinstance(d, dict) else None
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise HistoryError(f"{path}, line {lineno}: not a step record (its 'index' is {index!r}, not a step number)")
    return index
