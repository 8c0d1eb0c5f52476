"""Global batches of a streaming dataset, cut as the stream is read.

A stream has no length and no lengths ahead of time, so its steps cannot come from a pure
function of every length (sampler.py). They come from the stream's own order instead, cut by
the rule of `samples.lengths.step_batches` without shuffling: a batch closes when the next
sample would overflow the tokens per step, and a sample longer than a step forms its own. Every
rank reads the same stream, so every rank cuts the same batches, and a step's plan stays a pure
function of its batch. Sample ids are stream indices (0 is the stream's first sample); there is
one pass (epoch 0), of at most `max_steps` steps.

Memory is bounded: the sampler keeps the samples of the steps it has cut and not yet released,
plus the one sample read past the last cut step (the one that closed it). The planner releases
the steps before step k when it is asked for step k (the trainer has collated them) and reads
at most its look-ahead past it, so at most lookahead + 1 steps and one sample are held
(`buffer_bound`).

Resume: `StreamPosition(step, sample, digest)` says where step `step` starts in the stream,
with a digest of the lengths of every sample before it (`chain_digest`). A checkpoint saves the
position of its next step; the resumed run skips `sample` samples of the re-opened stream,
checks their lengths against the digest, and restarts the sampler there: its steps are the
uninterrupted run's.

Pure Python on plain data: torch-free.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, Mapping, Optional, Tuple

from hf_cp.planning.sampler import GlobalBatch
from hf_cp.samples.masks import SampleMask

# the digest of the lengths of no sample: where every stream's chain starts
EMPTY_DIGEST = hashlib.sha256(b"hf_cp stream lengths").hexdigest()


def chain_digest(digest: str, lengths: Iterable[int]) -> str:
    """`digest` extended by `lengths`, one sample at a time: the digest of samples 0..n-1 is the
    same however the stream was read (at once, or resumed at any sample)."""
    for n in lengths:
        digest = hashlib.sha256(f"{digest}:{int(n)}".encode()).hexdigest()
    return digest


@dataclass(frozen=True)
class StreamSample:
    """One sample as the sampler reads it: its length, its mask (None: causal) and what the
    caller keeps of it until its step is released (its tokens)."""

    length: int
    mask: Optional[SampleMask] = None
    payload: Any = None


@dataclass(frozen=True)
class StreamPosition:
    """Where step `step` starts: stream index `sample`, after samples whose lengths chain to `digest`."""

    step: int = 0
    sample: int = 0
    digest: str = EMPTY_DIGEST

    def to_dict(self) -> Dict[str, Any]:
        return {"step": self.step, "sample": self.sample, "lengths_sha256": self.digest}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StreamPosition:
        step, sample, digest = d.get("step"), d.get("sample"), d.get("lengths_sha256")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (step, sample)) or not (
            isinstance(digest, str)
        ):
            raise ValueError(f"a stream position needs whole numbers step, sample >= 0 and lengths_sha256, got {d!r}")
        return cls(step, sample, digest)


class StreamEnded(IndexError):
    """A step past the end of the stream."""


@dataclass(frozen=True)
class BufferBound:
    """What a streaming run holds at most: `steps` steps of samples plus one sample read past them."""

    steps: int
    samples: int
    tokens: int


def buffer_bound(lookahead: int, tokens_per_step: int, max_sample_tokens: int) -> BufferBound:
    """The most a planner with `lookahead` holds: lookahead + 1 steps (a step of several samples
    holds at most `tokens_per_step` tokens, hence samples; a step of one sample at most
    `max_sample_tokens`, the longest sample the balancer trains) and the sample that closed the
    last of them."""
    steps = max(lookahead, 0) + 1
    return BufferBound(
        steps=steps,
        samples=steps * tokens_per_step + 1,
        tokens=steps * max(tokens_per_step, max_sample_tokens) + max_sample_tokens,
    )


class StreamBatchSampler:
    """The global batches of a stream of samples (`StreamSample`s, read on demand): item k is
    step k, cut when first asked for. `release(k)` drops the steps before k. `last_step` is the
    stream's last step once its end has been read (None before). `masks` is the live dict of
    the held samples' masks."""

    streaming = True
    shuffle = False

    def __init__(
        self,
        tokens_per_step: int,
        max_steps: int,
        seed: int = 0,
        samples: Iterable[StreamSample] = (),
        start: StreamPosition = StreamPosition(),
    ):
        if tokens_per_step <= 0:
            raise ValueError(f"StreamBatchSampler: tokens_per_step must be positive, got {tokens_per_step}")
        if max_steps is None or max_steps <= 0:
            raise ValueError(f"StreamBatchSampler: a stream has no length; max_steps must be positive, got {max_steps}")
        self.tokens_per_step = int(tokens_per_step)
        self.total_steps = int(max_steps)
        self.seed = int(seed)
        self.masks: Dict[int, SampleMask] = {}  # the same dict for the sampler's life: collators hold it
        self.restart(samples, start)

    def restart(self, samples: Iterable[StreamSample], start: StreamPosition = StreamPosition()) -> None:
        """Read `samples` from now on: the stream from `start.sample` on, whose first sample
        opens step `start.step`. Everything held is dropped."""
        self._source: Iterator[StreamSample] = iter(samples)
        self.start = start
        self._read = start.sample  # stream index of the next sample to read
        self._digest = start.digest  # chain digest of every sample before it
        self._exhausted = False
        # the sample read past the last cut step: (stream index, sample, digest of the samples before it)
        self._pending: Optional[Tuple[int, StreamSample, str]] = None
        self._next_step = start.step  # the next step to cut
        self._first_kept = start.step  # the oldest step held
        self._batches: Dict[int, GlobalBatch] = {}
        self._samples: Dict[int, StreamSample] = {}
        # step -> (its first sample, digest before it): held steps and the next one
        self._starts: Dict[int, Tuple[int, str]] = {start.step: (start.sample, start.digest)}
        self.masks.clear()
        self.last_step: Optional[int] = None
        self.peak_samples = 0  # the most samples, and tokens, held at once since the restart
        self.peak_tokens = 0

    def __len__(self) -> int:
        return self.total_steps

    @property
    def samples_read(self) -> int:
        """Stream index of the next sample to read: samples read so far, counting those skipped at a restart."""
        return self._read

    def _read_one(self) -> Optional[Tuple[int, StreamSample, str]]:
        if self._exhausted:
            return None
        try:
            sample = next(self._source)
        except StopIteration:
            self._exhausted = True
            return None
        sid, before = self._read, self._digest
        self._read += 1
        self._digest = chain_digest(before, [sample.length])
        self._samples[sid] = sample
        if sample.mask is not None:
            self.masks[sid] = sample.mask
        return sid, sample, before

    def has_more(self) -> bool:
        """Whether a sample remains past the last cut step (reads one sample ahead if needed)."""
        if self._pending is None:
            self._pending = self._read_one()
        return self._pending is not None

    def _cut(self) -> None:
        k = self._next_step
        self.has_more()
        ids, lengths, tokens = [], [], 0
        while self._pending is not None:
            sid, sample, _ = self._pending
            if ids and tokens + sample.length > self.tokens_per_step:
                break
            ids.append(sid)
            lengths.append(sample.length)
            tokens += sample.length
            self._pending = self._read_one()
        if not ids:
            self.last_step = k - 1
            raise StreamEnded(f"step {k}: the stream ended with step {k - 1} ({self._read} samples)")
        self._batches[k] = GlobalBatch(index=k, epoch=0, step_in_epoch=k, sample_ids=tuple(ids), lengths=tuple(lengths))
        self._next_step = k + 1
        if self._pending is None:  # the stream ended inside this step
            self.last_step = k
            self._starts[k + 1] = (self._read, self._digest)
        else:
            self._starts[k + 1] = (self._pending[0], self._pending[2])
        self.peak_samples = max(self.peak_samples, self.held_samples)
        self.peak_tokens = max(self.peak_tokens, self.held_tokens)

    def __getitem__(self, index: int) -> GlobalBatch:
        if not 0 <= index < self.total_steps:
            raise IndexError(f"step {index} outside the run's {self.total_steps} steps")
        if index < self._first_kept:
            raise IndexError(f"step {index} of the stream was released (steps from {self._first_kept} are held)")
        while self._next_step <= index:
            if self.last_step is not None:
                raise StreamEnded(f"step {index}: the stream ended with step {self.last_step} ({self._read} samples)")
            self._cut()
        return self._batches[index]

    def release(self, before: int) -> None:
        """Drop the steps before `before` (trained): their samples and masks."""
        upto = min(before, self._next_step)
        for k in range(self._first_kept, upto):
            for sid in self._batches.pop(k).sample_ids:
                del self._samples[sid]
                self.masks.pop(sid, None)
            del self._starts[k]
        self._first_kept = max(self._first_kept, upto)

    def position(self, step: int) -> StreamPosition:
        """Where step `step` starts (a held step, or the next one to cut)."""
        if step not in self._starts:
            raise ValueError(f"the start of step {step} is not known (steps {self._first_kept}..{self._next_step} are)")
        sample, digest = self._starts[step]
        return StreamPosition(step, sample, digest)

    def sample(self, sid: int) -> StreamSample:
        """A held sample."""
        try:
            return self._samples[sid]
        except KeyError:
            raise KeyError(
                f"stream sample {sid} is not held (its step was released, or it was not read yet): "
                f"samples {min(self._samples, default=self._read)}..{self._read - 1} are"
            ) from None

    def batch_masks(self, batch: GlobalBatch) -> Optional[Dict[int, SampleMask]]:
        """The masks of the batch's samples (None: every one is causal)."""
        got = {s: self.masks[s] for s in batch.sample_ids if s in self.masks}
        return got or None

    @property
    def held_samples(self) -> int:
        return len(self._samples)

    @property
    def held_tokens(self) -> int:
        return sum(s.length for s in self._samples.values())
