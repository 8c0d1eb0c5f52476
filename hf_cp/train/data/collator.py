"""The collator: one rank's micro-batches of a planned step.

Token layout of a micro-batch (hf_cp/attention/context.py): this rank's local documents,
whole and in order, then its segments of the group's distributed documents in
`Group.member_segments` order (`registry.rank_segments`; in mode "blocks", the chunks it owns).
For every token:
    input_ids      the token
    shift_labels   the next token of the same document (already shifted, so a segment cut
                   inside a document still has its true target); -100 at a document's last
                   token and where the target is masked (prompt tokens, labels == -100)
    position_ids   the token's position inside its document (rotary embeddings)
`cu_seq_lens` are the boundaries of the contiguous pieces (whole documents or segments).

A sample with a mask (hf_cp/masks.py, read from the dataset's mask column) takes its positions
and targets from it (samples/targets.py: a shared-prompt sample's answers continue from the
prompt's end, targets never cross answers, and the prompt's last token predicts every answer's
first token, the extra ones as `extra_rows`/`extra_targets`); the masks travel to the attention
in the CP context (`local_masks`, `masks` (distributed documents), aligned with the lengths, None = causal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from hf_cp.attention.context import CPContext
from hf_cp.modes.registry import mode_spec
from hf_cp.modes.segments import ShardMode
from hf_cp.plan.chunks import dependent_chunk_sizes
from hf_cp.plan.step_plan import Group, StepPlan
from hf_cp.samples.masks import SampleMask
from hf_cp.samples.targets import sample_targets
from hf_cp.train.data.vision_rows import VisionFn, WaveVision, wave_vision

IGNORE_INDEX = -100

# (input_ids, labels or None) of one sample id; labels follow the HF convention (aligned with
# input_ids, -100 where no loss is taken)
FetchFn = Callable[[int], Tuple[Sequence[int], Optional[Sequence[int]]]]


def shifted_targets(input_ids: Sequence[int], labels: Optional[Sequence[int]]) -> np.ndarray:
    """Per position p: the target of predicting token p+1 (labels[p+1]); -100 at the end."""
    src = np.asarray(input_ids if labels is None else labels, dtype=np.int64)
    out = np.full(len(src), IGNORE_INDEX, dtype=np.int64)
    out[:-1] = src[1:]
    return out


def valid_targets(input_ids: Sequence[int], labels: Optional[Sequence[int]]) -> int:
    """Number of tokens of a sample that contribute to the loss."""
    if labels is None:
        return max(len(input_ids) - 1, 0)
    return int((np.asarray(labels[1:], dtype=np.int64) != IGNORE_INDEX).sum())


@dataclass
class MicroBatch:
    wave: int
    input_ids: torch.Tensor  # [1, T]
    shift_labels: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    cu_seq_lens: torch.Tensor  # [pieces + 1], int32
    context: CPContext  # group filled in by the trainer from the registry
    local_ids: List[int] = field(default_factory=list)
    distributed_ids: List[int] = field(default_factory=list)
    # second and further targets of a row (a shared prompt's last token predicts the first
    # token of every answer): the loss adds CE(row's hidden state, target) for each pair
    extra_rows: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # [k]
    extra_targets: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # [k]
    # the step's answer slot (RankStep.answer_slots) of each row's target and of each extra target,
    # -1 where none: sequence-level losses sum per-token log-probs into them
    target_slots: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 0, dtype=torch.long))  # [1, T]
    extra_slots: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # [k]

    # ChunkFlow: samples this rank runs as dependent chunks in this wave (then the rows above are empty)
    chunked: List[ChunkedRows] = field(default_factory=list)
    # trailing tokens that are no sample's (a member with an empty shard runs one): not counted
    # where every token counts, as the MoE router's load-balancing term does
    padding_tokens: int = 0
    # vision-language runs: the images and clips this rank encodes, where their embedding rows
    # go, and the row's M-RoPE positions (data/vision_rows.py); None in a text-only run
    vision: Optional[WaveVision] = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1]) + sum(c.num_tokens for c in self.chunked)

    @property
    def num_valid(self) -> int:
        chunked = sum(int((c.shift_labels != IGNORE_INDEX).sum()) for c in self.chunked)
        return int((self.shift_labels != IGNORE_INDEX).sum()) + int(self.extra_targets.numel()) + chunked

    @property
    def backward_calls(self) -> int:
        """Backward passes this micro-batch runs: one per dependent chunk, else one."""
        return sum(len(c.chunk_sizes) for c in self.chunked) if self.chunked else 1

    @property
    def has_masks(self) -> bool:
        """Whether some sample of the micro-batch has a non-causal mask."""
        return any(m is not None for m in self.context.local_masks + self.context.masks)


@dataclass
class ChunkedRows:
    """One sample run as dependent chunks (ChunkFlow): its whole rows and how they are cut."""

    sample: int
    input_ids: torch.Tensor  # [T]
    shift_labels: torch.Tensor  # [T], shifted over the whole sample
    chunk_sizes: List[int]
    keep: int  # K: chunks whose activations are kept; the others are recomputed in backward
    # vision-language runs: the sample's items (all encoded on its rank), its placeholder tokens'
    # positions and its M-RoPE positions [3, T] (data/vision_rows.py); None in a text-only run
    vision: Optional[WaveVision] = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class RankStep:
    """What one rank runs in one optimizer step: one entry per wave (None: no work)."""

    rank: int
    index: int  # global step index
    epoch: int
    plan: StepPlan
    waves: List[Optional[MicroBatch]]
    global_valid_tokens: int  # loss normaliser: valid targets of the whole global batch
    planned: object = None  # the PlannedStep (predictions, planner time)
    masked_samples: Tuple[int, ...] = ()  # samples of the whole step with a non-causal mask
    wave_backward_calls: List[int] = field(default_factory=list)  # per wave: backward passes every rank runs
    # per wave: the F/B pass sequence every rank runs when parameters are sharded (plan/passes.py)
    wave_passes: List[str] = field(default_factory=list)
    # (sample id, answer index) of every answer of the step, the same on every rank: the slots that
    # MicroBatch.target_slots index (a causal sample is one answer, a shared-prompt sample has several)
    answer_slots: Tuple[Tuple[int, int], ...] = ()

    @property
    def has_masks(self) -> bool:
        """Whether some sample of the step (on any rank: the same answer everywhere) has a
        non-causal mask."""
        return bool(self.masked_samples)

    @property
    def trained_sample_ids(self) -> List[int]:
        """Samples this rank accounts for: its local ones, and distributed ones where it is the
        group's first member (so the union over ranks counts every sample once)."""
        out: List[int] = []
        for mb in self.waves:
            if mb is None:
                continue
            out += mb.local_ids
            if mb.context.member == 0:
                out += mb.distributed_ids
        return out


class PlanCollator:
    """`fetch(sid)` gives a sample's (input_ids, labels); `masks` the non-causal masks by
    sample id (samples without one are causal); `vision(sid)` a vision-language sample's images
    and clips (None: text only), in a run whose model encodes them (None: a text-only run)."""

    def __init__(
        self, fetch: FetchFn, masks: Optional[Mapping[int, SampleMask]] = None, vision: Optional[VisionFn] = None
    ):
        self.fetch = fetch
        # a dict is kept, not copied: a stream's masks arrive as it is read (data/streaming.py)
        self.masks = masks if isinstance(masks, dict) else dict(masks or {})
        self.vision = vision

    def answer_slots(self, plan: StepPlan) -> Tuple[Tuple[int, int], ...]:
        """(sample id, answer) of every answer of the step, in the plan's sample order."""
        out: List[Tuple[int, int]] = []
        for sid in plan.sample_ids:
            m = self.masks.get(sid)
            n = len(m.answers) if m is not None and m.kind == "shared_prompt" else 1
            out += [(sid, a) for a in range(n)]
        return tuple(out)

    def micro_batch(
        self, plan: StepPlan, wave: int, group: Group, rank: int, first_slot: Optional[Mapping[int, int]] = None
    ) -> Optional[MicroBatch]:
        """`first_slot`: sample id -> the slot of its first answer (default: from answer_slots)."""
        if first_slot is None:
            first_slot = _first_slots(self.answer_slots(plan))
        if group.chunked.get(rank):
            return self.chunked_micro_batch(plan, wave, group, rank)
        local = list(group.local.get(rank, []))
        if not local and not group.distributed:
            return None
        member = group.ranks.index(rank)
        ids, tgts, pos, pieces = [], [], [], []
        padding = 0  # tokens of no sample (below)
        extra_rows, extra_targets = [], []
        slots, extra_slots = [], []
        local_lengths = []
        text_positions = {}  # sample -> its 1-D positions (vision runs: the M-RoPE of a text-only sample)
        row = 0
        for sid in local:
            x, y = self.fetch(sid)
            t = sample_targets(x, y, self.masks.get(sid))
            text_positions[sid] = t.positions
            ids.append(np.asarray(x, dtype=np.int64))
            tgts.append(t.shifted)
            pos.append(t.positions)
            extra_rows.append(t.extra_rows + row)
            extra_targets.append(t.extra_tokens)
            slots.append(_slots(t.answers, first_slot[sid]))
            extra_slots.append(_slots(t.extra_answers, first_slot[sid]))
            pieces.append(len(x))
            local_lengths.append(len(x))
            row += len(x)
        dist_docs = [self.fetch(sid) for sid in group.distributed]
        dist_lengths = [len(x) for x, _ in dist_docs]
        if group.distributed:
            full = [sample_targets(x, y, self.masks.get(sid)) for sid, (x, y) in zip(group.distributed, dist_docs)]
            text_positions.update({sid: t.positions for sid, t in zip(group.distributed, full)})
            # whole-document modes cut by lengths; mode "blocks" takes the chunks the member owns
            for seg in group.member_segments(member, dict(zip(group.distributed, dist_lengths))):
                x = np.asarray(dist_docs[seg.doc][0], dtype=np.int64)
                t = full[seg.doc]
                sl = slice(seg.start, seg.start + seg.length)
                ids.append(x[sl])
                tgts.append(t.shifted[sl])
                pos.append(t.positions[sl])
                mine = (t.extra_rows >= seg.start) & (t.extra_rows < seg.start + seg.length)
                extra_rows.append(t.extra_rows[mine] - seg.start + row)
                extra_targets.append(t.extra_tokens[mine])
                sid = group.distributed[seg.doc]
                slots.append(_slots(t.answers[sl], first_slot[sid]))
                extra_slots.append(_slots(t.extra_answers[mine], first_slot[sid]))
                pieces.append(seg.length)
                row += seg.length
        if not pieces:
            # A member whose shard of the distributed documents is empty (documents shorter than
            # the group's split) still joins the group's collectives; a zero-token batch cannot
            # pass transformers' mask preprocessing, so it runs one local padding token whose
            # target is ignored: no loss, no gradient, the same collectives.
            ids.append(np.zeros(1, dtype=np.int64))
            tgts.append(np.full(1, IGNORE_INDEX, dtype=np.int64))
            pos.append(np.zeros(1, dtype=np.int64))
            slots.append(np.full(1, -1, dtype=np.int64))
            pieces.append(1)
            local_lengths.append(1)
            padding = 1
        cat = lambda parts: torch.from_numpy(np.concatenate(parts))[None]  # noqa: E731
        cu = torch.tensor(np.concatenate([[0], np.cumsum(pieces)]) if pieces else [0], dtype=torch.int32)
        ctx = CPContext(
            group=None,
            group_ranks=tuple(group.ranks),
            member=member,
            mode=group.mode,
            distributed_lengths=tuple(dist_lengths),
            local_lengths=tuple(local_lengths),
            # the mode's registered spec, not the ShardMode enum: a registered mode needs no member
            blocks=group.blocks if group.distributed and mode_spec(group.mode).carries_layout else None,
            local_masks=_aligned_masks(self.masks, local, len(local_lengths)),
            masks=_aligned_masks(self.masks, group.distributed, len(dist_lengths)),
        )
        flat = lambda parts: torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))  # noqa: E731
        vision = None
        if self.vision is not None:
            vision = self._wave_vision(plan, wave, group, member, text_positions, row + padding)
        return MicroBatch(
            wave=wave,
            input_ids=cat(ids),
            shift_labels=cat(tgts),
            position_ids=cat(pos),
            cu_seq_lens=cu,
            context=ctx,
            local_ids=local,
            distributed_ids=list(group.distributed),
            extra_rows=flat(extra_rows),
            extra_targets=flat(extra_targets),
            target_slots=cat(slots),
            extra_slots=flat(extra_slots),
            padding_tokens=padding,
            vision=vision,
        )

    def _wave_vision(
        self, plan: StepPlan, wave: int, group: Group, member: int, text_positions: Dict[int, np.ndarray], row: int
    ) -> WaveVision:
        """The member's vision rows; the group's other members' samples are read too (every member
        computes the same encoder placement and exchange)."""
        samples = [s for r in group.ranks for s in group.local.get(r, [])] + list(group.distributed)
        lengths = {}
        for sid in samples:
            if sid not in text_positions:  # another member's local sample: its length and positions
                x, y = self.fetch(sid)
                text_positions[sid] = sample_targets(x, y, self.masks.get(sid)).positions
            lengths[sid] = len(text_positions[sid])
            kind = self.masks[sid].kind if sid in self.masks else None
            if kind not in (None, "shared_prompt") and self.vision(sid) is not None:
                raise ValueError(
                    f"step {plan.step + 1}, wave {wave}: sample {sid} has images or clips and a {kind!r} mask; vision "
                    "samples train with causal attention, or as a shared prompt with its answers (DPO pairs), only"
                )
        return wave_vision(group, member, lengths, self.vision, text_positions, row)

    def chunked_micro_batch(self, plan: StepPlan, wave: int, group: Group, rank: int) -> MicroBatch:
        """A one-rank group of chunked samples: each sample's whole rows and its chunk sizes."""
        chunked = []
        for c in group.chunked[rank]:
            if c.sample in self.masks:
                raise ValueError(
                    f"step {plan.step + 1}, wave {wave}: sample {c.sample} has a {self.masks[c.sample].kind!r} mask; "
                    f"dependent chunks attend causally over the K/V state store, so masked samples cannot be chunked"
                )
            x, y = self.fetch(c.sample)
            ids = torch.as_tensor(np.asarray(x, dtype=np.int64))
            t = sample_targets(x, y, None)
            tgts = torch.as_tensor(t.shifted)
            sizes = dependent_chunk_sizes(len(x), c.chunk_size)
            vision = None
            if self.vision is not None:  # its items, encoded on this rank, and its M-RoPE positions
                alone = Group(ranks=(rank,), local={rank: [c.sample]})
                vision = wave_vision(alone, 0, {c.sample: len(x)}, self.vision, {c.sample: t.positions}, len(x))
            chunked.append(ChunkedRows(c.sample, ids, tgts, sizes, c.keep, vision))
        empty = torch.zeros(1, 0, dtype=torch.long)
        ctx = CPContext(group=None, group_ranks=(rank,), member=0, mode=ShardMode.RING_PER_DOC)
        return MicroBatch(
            wave=wave,
            input_ids=empty,
            shift_labels=empty.clone(),
            position_ids=empty.clone(),
            cu_seq_lens=torch.zeros(1, dtype=torch.int32),
            context=ctx,
            local_ids=[c.sample for c in group.chunked[rank]],
            chunked=chunked,
        )

    def rank_step(
        self, plan: StepPlan, rank: int, global_valid_tokens: int, epoch: int = 0, planned: object = None
    ) -> RankStep:
        waves: List[Optional[MicroBatch]] = []
        slots = self.answer_slots(plan)
        first = _first_slots(slots)
        for w, wave in enumerate(plan.waves):
            mine = [g for g in wave.groups if rank in g.ranks]
            waves.append(self.micro_batch(plan, w, mine[0], rank, first) if mine else None)
        return RankStep(
            rank=rank,
            index=plan.step,
            epoch=epoch,
            plan=plan,
            waves=waves,
            global_valid_tokens=global_valid_tokens,
            planned=planned,
            masked_samples=tuple(s for s in plan.sample_ids if s in self.masks),
            wave_backward_calls=plan.wave_backward_calls(),
            wave_passes=plan.wave_passes(),
            answer_slots=slots,
        )


def _first_slots(slots: Sequence[Tuple[int, int]]) -> Dict[int, int]:
    first: Dict[int, int] = {}
    for k, (sid, _) in enumerate(slots):
        first.setdefault(sid, k)
    return first


def _slots(answers: Optional[np.ndarray], first: int) -> np.ndarray:
    """Answer indices of a sample's targets -> the step's slots (-1 stays -1)."""
    a = np.asarray(answers if answers is not None else [], dtype=np.int64)
    return np.where(a >= 0, a + first, -1)


def _aligned_masks(masks: Mapping[int, SampleMask], ids: Sequence[int], n: int) -> Tuple[Optional[SampleMask], ...]:
    """One entry per document (None = causal); () when every one is causal, as before masks.
    `n` may exceed len(ids) by the padding token of a member with an empty shard."""
    got = tuple(masks.get(s) for s in ids) + (None,) * (n - len(ids))
    return got if any(m is not None for m in got) else ()
