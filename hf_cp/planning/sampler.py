"""The global batch sampler: which samples form the global batch of every optimizer step.

A step's batch is a pure function of (lengths, tokens per step, seed, epoch), so every rank
knows every sample and length of every step without communication, and a resumed run sees the
same batches. Steps are numbered globally across epochs (index 0 .. len-1); epochs may have
different numbers of steps because batches are cut by tokens, not by sample count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from hf_cp.samples.lengths import step_batches


@dataclass(frozen=True)
class GlobalBatch:
    index: int  # global step index over the whole run
    epoch: int
    step_in_epoch: int
    sample_ids: Tuple[int, ...]
    lengths: Tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


class GlobalBatchSampler:
    def __init__(
        self,
        lengths: Sequence[int],
        tokens_per_step: int,
        seed: int = 0,
        num_epochs: float = 1.0,
        max_steps: Optional[int] = None,
        shuffle: bool = True,
    ):
        if len(lengths) == 0:
            raise ValueError("GlobalBatchSampler: the dataset is empty")
        if tokens_per_step <= 0:
            raise ValueError(f"GlobalBatchSampler: tokens_per_step must be positive, got {tokens_per_step}")
        self.lengths = [int(n) for n in lengths]
        self.tokens_per_step = int(tokens_per_step)
        self.seed = int(seed)
        self.shuffle = shuffle
        self._epochs: Dict[int, List[List[int]]] = {}
        if max_steps is not None and max_steps > 0:
            self.total_steps = int(max_steps)
        else:
            if num_epochs <= 0:
                raise ValueError(f"GlobalBatchSampler: num_epochs must be positive, got {num_epochs}")
            full = int(math.floor(num_epochs))
            total = sum(len(self.epoch_batches(e)) for e in range(full))
            frac = num_epochs - full
            if frac > 0:
                total += max(1, int(round(frac * len(self.epoch_batches(full)))))
            self.total_steps = total
        self._starts: List[int] = [0]  # global index of each epoch's first step, filled on demand

    def epoch_batches(self, epoch: int) -> List[List[int]]:
        if epoch not in self._epochs:
            self._epochs[epoch] = step_batches(
                self.lengths, self.tokens_per_step, seed=self.seed, epoch=epoch, shuffle=self.shuffle
            )
        return self._epochs[epoch]

    def __len__(self) -> int:
        return self.total_steps

    def locate(self, index: int) -> Tuple[int, int]:
        """(epoch, step in epoch) of global step `index`."""
        if not 0 <= index < self.total_steps:
            raise IndexError(f"step {index} outside the run's {self.total_steps} steps")
        while self._starts[-1] + len(self.epoch_batches(len(self._starts) - 1)) <= index:
            self._starts.append(self._starts[-1] + len(self.epoch_batches(len(self._starts) - 1)))
        epoch = max(e for e, s in enumerate(self._starts) if s <= index)
        return epoch, index - self._starts[epoch]

    def __getitem__(self, index: int) -> GlobalBatch:
        epoch, k = self.locate(index)
        ids = self.epoch_batches(epoch)[k]
        return GlobalBatch(
            index=index,
            epoch=epoch,
            step_in_epoch=k,
            sample_ids=tuple(ids),
            lengths=tuple(self.lengths[i] for i in ids),
        )
