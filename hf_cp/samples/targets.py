"""What each token of a sample is trained to predict, and at which rotary position it sits,
under the sample's mask.

A causal sample (no mask) is one sequence: token p predicts token p+1, positions 0..n-1.

A shared-prompt sample [prompt][answer 1]...[answer n] stands for n sequences
(prompt, answer i) that share the prompt's tokens (hf_cp/masks.py). Its reference semantics:
each (prompt, answer i) trained as its own sequence, the prompt's own targets counted once.
So:
- positions: every answer continues from the end of the prompt (SampleMask.position_ids);
- targets never cross a segment (SampleMask.segments: the prompt, then each answer): an
  answer's last token predicts nothing, and no answer token predicts the next answer's first;
- the prompt's last token predicts the first token of *every* answer: n targets from one
  hidden state (the prompt cannot see the answers, so its hidden states are the same in all n
  sequences). The first valid one is the position's ordinary target; the others are *extra
  targets*, (position, token) pairs whose loss the loss function adds from that position's
  hidden state (hf_cp/train/step/loss.py).
With one answer, a shared-prompt sample is exactly a causal sample.

Other mask kinds change only what a token attends to, not what it predicts.
Pure numpy; labels follow the HF convention (aligned with input_ids, -100 = no loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from hf_cp.samples.masks import SampleMask

IGNORE_INDEX = -100


@dataclass(frozen=True)
class SampleTargets:
    shifted: np.ndarray  # [n] int64: the target of each position, IGNORE_INDEX where none
    positions: np.ndarray  # [n] int64: rotary position of each token
    extra_rows: np.ndarray  # [k] int64: positions with one more target each (sample-local)
    extra_tokens: np.ndarray  # [k] int64: those targets (never IGNORE_INDEX)
    # which answer each target belongs to (a shared-prompt sample's answer index; 0 for the one
    # sequence of any other sample), -1 where no valid target or a prompt token predicts a prompt
    # token: sequence-level losses (DPO, GRPO) sum log-probs per answer
    answers: Optional[np.ndarray] = None  # [n] int64
    extra_answers: Optional[np.ndarray] = None  # [k] int64

    @property
    def valid(self) -> int:
        """Targets that carry loss: the ordinary ones plus the extra ones."""
        return int((self.shifted != IGNORE_INDEX).sum()) + len(self.extra_rows)


_NO_EXTRAS = np.zeros(0, dtype=np.int64)


def _shift(src: np.ndarray) -> np.ndarray:
    out = np.full(len(src), IGNORE_INDEX, dtype=np.int64)
    out[:-1] = src[1:]
    return out


def sample_targets(
    input_ids: Sequence[int], labels: Optional[Sequence[int]] = None, mask: Optional[SampleMask] = None
) -> SampleTargets:
    """Targets, positions and extra targets of one sample (module docstring)."""
    src = np.asarray(input_ids if labels is None else labels, dtype=np.int64)
    n = len(src)
    if mask is None or mask.kind != "shared_prompt" or len(mask.answers) <= 1:
        pos = np.arange(n, dtype=np.int64) if mask is None else np.asarray(mask.position_ids(), dtype=np.int64)
        shifted = _shift(src)
        # one answer: the sequence itself (a one-answer shared-prompt sample: its prompt's targets
        # other than the answer's first token are the prompt's, answer -1)
        answers = np.where(shifted != IGNORE_INDEX, 0, -1).astype(np.int64)
        if mask is not None and mask.kind == "shared_prompt" and mask.prompt > 1:
            answers[: mask.prompt - 1] = -1
        return SampleTargets(shifted, pos, _NO_EXTRAS, _NO_EXTRAS, answers, _NO_EXTRAS)
    if mask.length != n:
        raise ValueError(f"the mask covers {mask.length} tokens but the sample has {n}")
    shifted = np.full(n, IGNORE_INDEX, dtype=np.int64)
    answers = np.full(n, -1, dtype=np.int64)
    for k, (start, end) in enumerate(mask.segments()):  # targets stay inside their segment
        shifted[start : end - 1] = src[start + 1 : end]
        if mask.prompt == 0 or k > 0:  # segment k is answer k-1 after a prompt
            answers[start : end - 1] = k - (1 if mask.prompt > 0 else 0)
    answers[shifted == IGNORE_INDEX] = -1
    firsts, first_answers = [], []
    if mask.prompt > 0:
        start = mask.prompt
        for i, a in enumerate(mask.answers):
            if src[start] != IGNORE_INDEX:
                firsts.append(int(src[start]))
                first_answers.append(i)
            start += a
    last_prompt = mask.prompt - 1
    extra_rows, extra_tokens, extra_answers = _NO_EXTRAS, _NO_EXTRAS, _NO_EXTRAS
    if firsts:
        shifted[last_prompt] = firsts[0]
        answers[last_prompt] = first_answers[0]
        extra_tokens = np.asarray(firsts[1:], dtype=np.int64)
        extra_rows = np.full(len(extra_tokens), last_prompt, dtype=np.int64)
        extra_answers = np.asarray(first_answers[1:], dtype=np.int64)
    positions = np.asarray(mask.position_ids(), dtype=np.int64)
    return SampleTargets(shifted, positions, extra_rows, extra_tokens, answers, extra_answers)


def sample_valid_targets(
    input_ids: Sequence[int], labels: Optional[Sequence[int]] = None, mask: Optional[SampleMask] = None
) -> int:
    """Number of loss-carrying targets of a sample, extra targets included."""
    if mask is None or mask.kind != "shared_prompt" or len(mask.answers) <= 1:
        if labels is None:
            return max(len(input_ids) - 1, 0)
        return int((np.asarray(labels[1:], dtype=np.int64) != IGNORE_INDEX).sum())
    return sample_targets(input_ids, labels, mask).valid
