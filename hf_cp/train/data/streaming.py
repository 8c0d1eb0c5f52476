"""A streaming `train_dataset` (a `datasets.IterableDataset`, or any iterable of rows without a
length): what CPTrainer reads of it, where a checkpoint says it stopped, and how a run ends.

Every rank reads the whole stream in its own order (no shuffling: cp_shuffle=True is refused;
shuffle the stream itself, e.g. `stream.shuffle(seed=..., buffer_size=...)`, which every rank
then reads alike). Steps are cut as the stream is read (planning/stream_sampler.py: the rule of
`step_batches`), into a look-ahead buffer of at most cp_plan_lookahead + 1 steps of samples plus
the one sample that closed the last of them; the planner releases a step's samples once the
trainer has collated it. Sample ids are stream indices (0: the stream's first row).

The planner (planning/worker.py) reads each step's batch on the training process and hands it,
with its samples' masks, to its worker with the request: a forked worker cannot see what the
stream yields after the fork.

Length: a stream has none. `max_steps` (> 0) must be set; training stops after the stream's last
step when it ends first (a warning says so; the last step holds what remains, like the last step
of an epoch). One pass: `num_train_epochs` does not apply.

Checkpoints: the schedule record (resume.SCHEDULE_FILE) holds, under STREAM_FIELD, where the
checkpoint's next step starts in the stream (StreamPosition: the step, the stream index of its
first sample, and a digest of the lengths of every sample before it). A resumed run re-opens the
stream, skips those samples (reading them: a stream cannot seek), checks their lengths against
the digest (another stream raises ScheduleChangedError, unless cp_allow_schedule_change), and
cuts the same steps an uninterrupted run would.

Rows are checked as they are read; errors name the stream index ("train_dataset stream sample
17"): missing or empty input_ids, values that are not integers, labels of another length, a
`length` column that disagrees, a malformed attn_mask, a pre-packed row of several documents.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from transformers import TrainerCallback
from transformers.trainer_utils import SaveStrategy

from hf_cp.balance.toolkit.sample_limit import sample_token_limit
from hf_cp.planning.stream_sampler import (
    EMPTY_DIGEST,
    BufferBound,
    StreamBatchSampler,
    StreamPosition,
    StreamSample,
    buffer_bound,
    chain_digest,
)
from hf_cp.readers import load_json  # nesting bounded (readers.py)
from hf_cp.samples.mask_column import MASK_COLUMN, decode_mask
from hf_cp.samples.masks import MaskError, SampleMask
from hf_cp.samples.packed_input import PackedInputError, boundary_columns, row_documents
from hf_cp.samples.targets import sample_valid_targets
from hf_cp.train.checkpoint.marks import SCHEDULE_FILE
from hf_cp.train.checkpoint.resolve import checkpoint_step
from hf_cp.train.checkpoint.schedule import ScheduleChangedError
from hf_cp.train.data.collator import valid_targets
from hf_cp.train.data.columns import (
    INTEGER_FIX,
    _first_non_integer,
    read_token_columns,
    token_range_message,
    token_range_problem,
)
from hf_cp.train.data.vision_columns import FOREIGN_COLUMNS, VISION_COLUMNS

logger = logging.getLogger(__name__)

STREAM_FIELD = "stream"  # in the schedule record: the StreamPosition of the checkpoint's next step
STREAM = "stream"  # the schedule record's data fields of a stream (its samples are not known ahead)


def is_streaming(dataset) -> bool:
    """A dataset without a length: read as a stream."""
    return dataset is not None and not hasattr(dataset, "__len__")


def check_streaming(dataset, args) -> None:
    """A streaming dataset's settings, refused by name before the Trainer's own checks: it needs
    max_steps (it has no length) and cp_shuffle off (every rank reads it in its own order)."""
    if not is_streaming(dataset):
        return
    what = f"CPTrainer: train_dataset is a streaming {type(dataset).__name__}"
    if args.max_steps is None or args.max_steps <= 0:
        raise ValueError(
            f"{what}, which has no length: set max_steps (> 0), the optimizer steps to train (training stops "
            f"earlier, with a warning, when the stream ends first; num_train_epochs does not apply to a stream)"
        )
    if args.cp_shuffle:
        raise ValueError(
            f"{what}: cp_shuffle=True cannot apply (every rank reads the stream in its own order, and a step is cut "
            f"as it is read); set cp_shuffle=False, and shuffle the stream itself if it needs it, e.g. "
            f"stream.shuffle(seed=..., buffer_size=...)"
        )


class _HeldCounts:
    """The valid-target counts of held samples, indexed like TokenColumns.valid_counts (a list of ids)."""

    def __init__(self, data: StreamColumns):
        self.data = data

    def __getitem__(self, ids: Sequence[int]) -> np.ndarray:
        return np.asarray([self.data.sampler.sample(int(s)).payload[2] for s in ids], dtype=np.int64)


class StreamColumns:
    """A stream's training data with TokenColumns' interface (fetch, masks, valid_counts, digest,
    warnings), over the samples the sampler holds. `make_sampler` builds the run's sampler
    (planning_setup calls it); `start` positions the stream for train()."""

    def __init__(self, dataset, name: str = "train_dataset", vocab_size: Optional[int] = None):
        self.dataset, self.name, self.vocab_size = dataset, name, vocab_size
        self.warnings: List[str] = []
        self.sampler: Optional[StreamBatchSampler] = None
        self.valid_counts = _HeldCounts(self)
        self.vision = None  # a stream is text only (stream_sample refuses images and video by name)

    # ------------------------------------------------------------------ TokenColumns' interface
    @property
    def masks(self) -> Dict[int, SampleMask]:
        """The held samples' masks: the sampler's live dict (filled as the stream is read)."""
        return self.sampler.masks if self.sampler is not None else {}

    def fetch(self, sid: int):
        ids, labels, _ = self.sampler.sample(sid).payload
        return ids, labels

    def digest(self) -> str:
        """What every rank can tell of the stream before reading it: its type and columns."""
        cols = getattr(self.dataset, "column_names", None)
        return hashlib.sha256(f"{STREAM}:{type(self.dataset).__name__}:{cols}".encode()).hexdigest()

    def __len__(self) -> int:
        """Samples read so far."""
        return self.sampler.samples_read if self.sampler is not None else 0

    # ------------------------------------------------------------------ the sampler
    def make_sampler(self, tokens_per_step: int, seed: int, max_steps: int) -> StreamBatchSampler:
        self.sampler = StreamBatchSampler(tokens_per_step, max_steps, seed, self._samples(self._rows(), 0))
        return self.sampler

    def _rows(self) -> Iterator:
        """The stream from its start, opened when first read."""
        yield from self.dataset

    def _samples(self, rows: Iterator, first: int) -> Iterator[StreamSample]:
        for sid, row in enumerate(rows, first):
            yield stream_sample(row, sid, self.name, self.vocab_size)

    def start(self, checkpoint: Optional[str], allow_change: bool = False) -> Tuple[List[str], bool]:
        """Position the stream for train(): at its start, or (`checkpoint`) where the
        checkpoint's next step starts. Returns (warnings, whether the stream holds a sample after
        that point). Raises ScheduleChangedError when the re-opened stream's first samples are
        not the ones the checkpoint trained (a warning with `allow_change`)."""
        rows = self._rows()
        notes: List[str] = []
        position = StreamPosition()
        if checkpoint is not None:
            position = read_position(checkpoint)
            lengths = []
            for i in range(position.sample):
                row = next(rows, None)
                if row is None:
                    break
                lengths.append(_row_length(row, i, self.name))
            problem = None
            if len(lengths) < position.sample:
                problem = f"the stream ends after {len(lengths)} samples, and the checkpoint trained {position.sample}"
            elif chain_digest(EMPTY_DIGEST, lengths) != position.digest:
                problem = f"the lengths of its first {position.sample} samples differ from those the checkpoint trained"
            if problem is not None:
                message = (
                    f"resuming {checkpoint} on another stream ({problem}): steps after the checkpoint would not "
                    f"continue the stream it trained on"
                )
                if not allow_change:
                    raise ScheduleChangedError(
                        f"{message}. To continue on this stream anyway, set cp_allow_schedule_change: true"
                    )
                notes.append(f"{message}; continuing from stream sample {len(lengths)} (cp_allow_schedule_change)")
                position = StreamPosition(position.step, len(lengths), chain_digest(EMPTY_DIGEST, lengths))
        first = next(rows, None)
        more = first is not None
        rest = itertools.chain([first], rows) if more else iter(())
        self.sampler.restart(self._samples(rest, position.sample), position)
        return notes, more

    def schedule(self, world_size: int, step: int) -> dict:
        """The schedule record of a streaming run (resume.schedule_record's fields) with the
        position of step `step` (where the stream continues after `step` steps), when known."""
        sm = self.sampler
        record = {
            "num_samples": STREAM,
            "lengths_sha256": STREAM,
            "data_sha256": STREAM,
            "tokens_per_step": int(sm.tokens_per_step),
            "seed": int(sm.seed),
            "shuffle": False,
            "world_size": int(world_size),
        }
        try:
            record[STREAM_FIELD] = sm.position(step).to_dict()
        except ValueError:
            pass  # only compared, never saved, before the step's start is known (a train() call's start)
        return record

    def bound(self, lookahead: int, max_sample_tokens: int) -> BufferBound:
        return buffer_bound(lookahead, self.sampler.tokens_per_step, max_sample_tokens)


# ------------------------------------------------------------------------------ rows
def _integers(value, what: str, column: str) -> np.ndarray:
    """One row's `column` as int64, or a ValueError naming the stream sample, the value and its position."""
    if value is None or isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise ValueError(f"CPTrainer: {what}, column {column!r}: expected a list of integers, got {value!r:.60}")
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError):  # ragged nesting
        arr = np.array(list(value), dtype=object)
    if arr.ndim == 1 and arr.dtype.kind in "iu":
        return arr.astype(np.int64, copy=False)
    if len(value) == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(
            f"CPTrainer: {what}, column {column!r}: expected a flat list of integers, got {value!r:.60}; "
            f"{INTEGER_FIX.format(column=column)}"
        )
    bad, integral = _first_non_integer(arr if arr.dtype.kind in "f" else np.array(list(value), dtype=object))
    index = bad if bad is not None else integral
    if index is None:  # integers of mixed Python and numpy types
        return np.asarray([int(v) for v in value], dtype=np.int64)
    shown = value[index]
    shown = shown.item() if isinstance(shown, np.generic) else shown
    kind = "token ids, -100 for no loss" if column == "labels" else "token ids"
    note = " (floats are refused even when integral, as here)" if bad is None else ""
    raise ValueError(
        f"CPTrainer: {what}, column {column!r}: expected integers ({kind}), got {shown!r:.60} at position {index}"
        f"{note}; {INTEGER_FIX.format(column=column)}"
    )


def _row_input_ids(row, sid: int, name: str):
    what = f"{name} stream sample {sid}"
    if not isinstance(row, Mapping) or "input_ids" not in row:
        keys = sorted(row) if isinstance(row, Mapping) else type(row).__name__
        raise ValueError(
            f"CPTrainer: {what} has no 'input_ids' ({keys}); tokenise the stream first, e.g. stream.map(tokenize)"
        )
    return row["input_ids"], what


def _row_length(row, sid: int, name: str) -> int:
    """A row's length, read while skipping trained samples on resume."""
    ids, what = _row_input_ids(row, sid, name)
    try:
        return len(ids)
    except TypeError:
        raise ValueError(
            f"CPTrainer: {what}, column 'input_ids': expected a list of integers, got {ids!r:.60}"
        ) from None


def _in_vocabulary(values: np.ndarray, what: str, column: str, vocab_size: Optional[int]) -> None:
    index = token_range_problem(values, vocab_size, column == "labels") if vocab_size else None
    if index is not None:
        raise ValueError(token_range_message(what, column, index, int(values[index]), vocab_size))


def stream_sample(
    row: Mapping[str, Any], sid: int, name: str = "train_dataset", vocab_size: Optional[int] = None
) -> StreamSample:
    """One row of a stream as a sample: (length, mask, payload (input_ids, labels or None, valid
    targets)), every check of read_token_columns made on it and named by its stream index."""
    value, what = _row_input_ids(row, sid, name)
    media = [c for c in row if c in VISION_COLUMNS or c in FOREIGN_COLUMNS]
    if media:  # a stream's column names may be unknown until it is read: refused here, by name
        raise ValueError(
            f"CPTrainer: {what} has the multimodal column(s) {media}; images and video train from a map-style "
            "dataset (datasets.Dataset), not a stream"
        )
    ids = _integers(value, what, "input_ids")
    _in_vocabulary(ids, what, "input_ids", vocab_size)
    if len(ids) == 0:
        raise ValueError(f"CPTrainer: {what} has no tokens (empty input_ids)")
    labels = row.get("labels")
    if labels is not None:
        labels = _integers(labels, what, "labels")
        _in_vocabulary(labels, what, "labels", vocab_size)
        if len(labels) != len(ids):
            raise ValueError(f"CPTrainer: {what} has {len(ids)} input_ids but {len(labels)} labels")
    given = row.get("length")
    if given is not None and int(given) != len(ids):
        raise ValueError(f"CPTrainer: {what} has length column {given} but {len(ids)} input_ids")
    packed = boundary_columns(list(row))
    if packed:
        try:
            docs = row_documents(len(ids), {c: row[c] for c in packed}, row=f"{sid} of the {name} stream")
        except PackedInputError as e:
            raise ValueError(f"CPTrainer: {e}") from None
        if len(docs) > 1:
            raise ValueError(
                f"CPTrainer: {what} is a pre-packed row of {len(docs)} documents (column {packed[0]!r}); a streaming "
                f"dataset takes one sample per row: give its documents as rows of their own"
            )
    try:
        mask = decode_mask(row.get(MASK_COLUMN), f"{sid} of the {name} stream", len(ids))
    except MaskError as e:
        raise ValueError(f"CPTrainer: {e}") from None
    valid = sample_valid_targets(ids, labels, mask) if mask is not None else valid_targets(ids, labels)
    return StreamSample(len(ids), mask, (ids, labels, int(valid)))


# ------------------------------------------------------------------------------ checkpoints
def read_position(checkpoint: str) -> StreamPosition:
    """The stream position a checkpoint saved (its next step's), checked against its step."""
    path = Path(checkpoint) / SCHEDULE_FILE
    try:
        saved = load_json(path.read_text())
    except (OSError, ValueError) as err:
        raise ScheduleChangedError(
            f"{checkpoint}: a streaming run resumes where its {SCHEDULE_FILE} says the stream stopped, and it "
            f"cannot be read ({err})"
        ) from None
    entry = saved.get(STREAM_FIELD) if isinstance(saved, dict) else None
    if not isinstance(entry, dict):
        raise ScheduleChangedError(
            f"{checkpoint} holds no stream position ({SCHEDULE_FILE} has no {STREAM_FIELD!r} entry: it was saved by "
            f"a run on a map-style dataset, or by another tool); a streaming run cannot tell where to continue"
        )
    try:
        position = StreamPosition.from_dict(entry)
    except ValueError as err:
        raise ScheduleChangedError(f"{path}: {err}") from None
    step = checkpoint_step(checkpoint)
    if position.step != step:
        raise ScheduleChangedError(
            f"{path}: its stream position is that of step {position.step}, but the checkpoint has trained {step} steps"
        )
    return position


# ------------------------------------------------------------------------------ the trainer's hooks
class StreamEndCallback(TrainerCallback):
    """Stops training after the stream's last step when it comes before max_steps, saving as at
    max_steps (save_strategy "steps"), with one warning."""

    def __init__(self, sampler: StreamBatchSampler, rank: int):
        self.sampler, self.rank, self.warned = sampler, rank, False

    def on_step_end(self, args, state, control, **kwargs):
        last = self.sampler.last_step
        if last is None or state.global_step < last + 1 or state.global_step >= state.max_steps:
            return control
        control.should_training_stop = True
        if args.save_strategy == SaveStrategy.STEPS:
            control.should_save = True
        if self.rank == 0 and not self.warned:
            logger.warning(
                "hf_cp: train_dataset: the stream ended after %d samples, in step %d of max_steps %d: training "
                "stops after it (every sample of the stream trained once)",
                self.sampler.samples_read,
                state.global_step,
                state.max_steps,
            )
        self.warned = True
        return control


def read_training_data(dataset, name: str, eos_token_ids=(), vocab_size: Optional[int] = None):
    """The trainer's training data: TokenColumns (columns.read_token_columns), or StreamColumns
    for a streaming dataset (read as training goes); ids are checked against `vocab_size`."""
    if is_streaming(dataset):
        return StreamColumns(dataset, name, vocab_size)
    return read_token_columns(dataset, name, eos_token_ids, vocab_size)


def attach_stream(trainer, balancer=None) -> Optional[StreamColumns]:
    """For a streaming train_dataset: the trainer's StreamColumns, with its stop at the stream's
    end (StreamEndCallback) and its set-up line (the look-ahead buffer's bound) logged; None
    otherwise."""
    data = trainer.cp_data
    if not isinstance(data, StreamColumns):
        return None
    trainer.add_callback(StreamEndCallback(data.sampler, trainer.cp_rank))
    setup = trainer.cp_setup
    limit = sample_token_limit(balancer or setup.balancer(), setup.cluster, setup.cost)
    lookahead = trainer.args.cp_plan_lookahead
    b = data.bound(lookahead, limit)
    trainer._cp_warn(
        f"train_dataset is a stream ({type(data.dataset).__name__}): every rank reads it in its own order and cuts "
        f"steps of {data.sampler.tokens_per_step} tokens as it goes, at most max_steps {data.sampler.total_steps} "
        f"(one pass; it stops earlier if the stream ends). Its look-ahead buffer holds at most {b.steps} step(s) of "
        f"samples (cp_plan_lookahead {lookahead} + 1) and the sample that closed the last: at most {b.samples} "
        f"samples, {b.tokens} tokens"
    )
    return data


def start_stream(trainer, checkpoint: Optional[str]) -> None:
    """Before train(): position the stream at its start or at `checkpoint`'s next step. When
    nothing remains (the stream ended in the checkpoint's last step), the run has no steps left:
    max_steps becomes the checkpoint's step, as a run that reached max_steps."""
    data: StreamColumns = trainer.cp_stream
    notes, more = data.start(checkpoint, trainer.args.cp_allow_schedule_change)
    for note in notes:
        trainer._cp_warn(note)
    if more:
        return
    if checkpoint is None:
        raise ValueError("CPTrainer: train_dataset is an empty stream (it yields no row)")
    step = checkpoint_step(checkpoint)
    trainer._cp_warn(
        f"train_dataset: the stream ended with the last step of {checkpoint} (step {step}): nothing left to train"
    )
    data.sampler.total_steps = step
    trainer.args.max_steps = step
