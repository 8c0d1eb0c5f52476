"""StepPlan: what every rank runs in one optimizer step.

A plan is an ordered list of waves. A wave is a set of disjoint groups of ranks taken from
the registry (cluster.py). A group runs one micro-batch: documents *distributed* over all of
its members with one sharding mode, plus documents *local* to single members (computed with
no communication, Skrull-style). A rank in no group of a wave has nothing to do in it. In
mode "blocks" the group also carries its block layout (block_layout.py: owned chunks and placed
compute blocks). Samples with a mask other than causal carry it in `masks` (masks.py).
A one-rank group may instead run *chunked* samples (ChunkFlow, hf_cp/plan/chunks.py): each a long
sample cut into dependent chunks run in order on that rank, one sample after another.

Plans are plain data: JSON in and out (byte-identical for identical plans), validated against
the invariants of docs/design.md ("StepPlan invariants") before any collective is issued.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from hf_cp.modes.registry import mode_name, mode_spec, rank_segments
from hf_cp.modes.segments import Segment, ShardMode
from hf_cp.plan.block_layout import BlockLayout, BlockLayoutError, doc_slices, held_tokens, received_rows
from hf_cp.plan.chunks import activation_tokens, chunked_memory_bytes, dependent_chunk_sizes
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.passes import MICRO_BATCH_PASSES, chunked_passes, merge_passes
from hf_cp.plan.sorting import stable_order
from hf_cp.plan.vision_encoders import grid_patches, member_held_patches
from hf_cp.readers import load_json
from hf_cp.samples.masks import MaskError, SampleMask, masks_from_json
from hf_cp.samples.vision_grids import SampleGrids, VisionGridError, parse_grids

FORMAT = "hf_cp.step_plan/1"


class PlanError(ValueError):
    """A plan breaks an invariant; the message names the sample, rank and wave."""


class ChunkedSample(NamedTuple):
    """A long sample run as dependent chunks on one rank (ChunkFlow; hf_cp/plan/chunks.py)."""

    sample: int
    chunk_size: int  # its chunks are chunks.dependent_chunk_sizes(length, chunk_size)
    keep: int  # K: chunks whose activations are kept; the first N-K are recomputed in backward


@dataclass
class Group:
    ranks: Tuple[int, ...]
    distributed: List[int] = field(default_factory=list)  # sample ids, packed in this order
    mode: str = ShardMode.RING_PER_DOC.value  # how `distributed` is sharded: a registered mode name
    local: Dict[int, List[int]] = field(default_factory=dict)  # rank -> sample ids on it alone
    blocks: Optional[BlockLayout] = None  # mode BLOCKS: the chunks and compute blocks (block_layout.py)
    # rank -> samples run as dependent chunks, one after another; only in a one-rank group
    # that runs nothing else (the chunks' forwards and backwards are its micro-batches)
    chunked: Dict[int, List[ChunkedSample]] = field(default_factory=dict)

    def __post_init__(self):
        self.ranks = tuple(int(r) for r in self.ranks)
        try:
            self.mode = mode_name(self.mode)
        except ValueError as e:
            raise PlanError(f"group {list(self.ranks)}: {e}") from None
        self.local = {int(r): list(v) for r, v in self.local.items()}
        # planners build ~10^4 groups a step with no layout: skip the (slow) ABC check for them
        if self.blocks is not None and isinstance(self.blocks, Mapping):
            self.blocks = BlockLayout.from_dict(self.blocks)
        if self.chunked:
            self.chunked = {int(r): [ChunkedSample(*(int(x) for x in c)) for c in v] for r, v in self.chunked.items()}
        else:
            self.chunked = {}  # a fresh dict, as the comprehension made

    @classmethod
    def one_rank_groups(cls, micro_batches: Sequence[Tuple[int, List[int]]]) -> List[Group]:
        """Group(ranks=(r,), local={r: ids}) for each (r, ids), made without __post_init__'s
        conversions: planners make ~10^4 of them a step, each rank a Python int and each ids
        a fresh list of them (the group keeps that list). The same groups as the constructor
        makes (tests/test_planner_scale.py compares them)."""
        default_mode = mode_name(ShardMode.RING_PER_DOC.value)
        out = []
        new = object.__new__
        for r, ids in micro_batches:
            g = new(cls)
            g.ranks, g.distributed, g.mode, g.local, g.blocks, g.chunked = (r,), [], default_mode, {r: ids}, None, {}
            out.append(g)
        return out

    def shifted(self, offset: int) -> Group:
        """This group on ranks `offset` higher (its samples, mode and block layout shared: a
        layout indexes members, not ranks); made without __post_init__'s conversions, as
        one_rank_groups makes groups."""
        g = object.__new__(type(self))
        g.ranks = tuple(r + offset for r in self.ranks)
        g.distributed, g.mode, g.blocks = self.distributed, self.mode, self.blocks
        g.local = {r + offset: v for r, v in self.local.items()}
        g.chunked = {r + offset: v for r, v in self.chunked.items()}
        return g

    @property
    def size(self) -> int:
        return len(self.ranks)

    def sample_ids(self) -> List[int]:
        ids = list(self.distributed)
        for r in sorted(self.local):
            ids.extend(self.local[r])
        for r in sorted(self.chunked):
            ids.extend(c.sample for c in self.chunked[r])
        return ids

    def member_segments(self, member: int, lens: Mapping[int, int]) -> List[Segment]:
        """The segments of the distributed samples `member` holds, in its row order."""
        if not self.distributed:
            return []
        if mode_spec(self.mode).carries_layout:
            if self.blocks is None:
                raise PlanError(f"group {list(self.ranks)} has mode 'blocks' but no block layout")
            return self.blocks.member_segments(member)
        return rank_segments(self.mode, [lens[s] for s in self.distributed], self.size, member)

    def to_dict(self) -> dict:
        d = {"ranks": list(self.ranks)}
        if self.distributed:
            d["distributed"] = list(self.distributed)
            d["mode"] = self.mode
            if mode_spec(self.mode).carries_layout and self.blocks is not None:
                d["blocks"] = self.blocks.to_dict()
        if any(self.local.values()):
            d["local"] = {str(r): list(v) for r, v in sorted(self.local.items()) if v}
        if any(self.chunked.values()):
            d["chunked"] = {str(r): [list(c) for c in v] for r, v in sorted(self.chunked.items()) if v}
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> Group:
        if not isinstance(d, Mapping):
            raise ValueError(f"a group must be an object with 'ranks', got {d!r:.60}")

        def per_rank(key: str) -> Mapping:
            v = d.get(key, {})
            if not isinstance(v, Mapping):
                raise ValueError(f"group {key!r} must map ranks to sample lists, got {v!r:.60}")
            return v

        def chunk(c) -> ChunkedSample:
            if not isinstance(c, (list, tuple)) or len(c) != 3:
                raise ValueError(f"a chunked sample is [sample, chunk_size, keep], got {c!r:.60}")
            return ChunkedSample(*(whole(x, "chunked sample") for x in c))

        return cls(
            ranks=tuple(whole(r, "ranks") for r in _items(d["ranks"], "ranks")),
            distributed=[whole(s, "distributed") for s in _items(d.get("distributed", []), "distributed")],
            mode=d.get("mode", ShardMode.RING_PER_DOC.value),
            local={
                whole(k, "local", key=True): [whole(s, "local") for s in _items(v, "local")]
                for k, v in per_rank("local").items()
            },
            blocks=BlockLayout.from_dict(d["blocks"], "group blocks") if "blocks" in d else None,
            chunked={
                whole(k, "chunked", key=True): [chunk(c) for c in _items(v, "chunked")]
                for k, v in per_rank("chunked").items()
            },
        )


def whole(v, what: str, key: bool = False) -> int:
    """An integer of a plan file: an int or an integral float (`key`: a string of one, as JSON
    writes the keys of `local` and `chunked`); a fraction, a bool or text is refused, never rounded."""
    if key and isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            raise ValueError(f"{what}: {v!r} is not a whole number") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"{what}: {v!r:.60} is not a whole number")
    return int(v)


def _items(v, what: str) -> list:
    if not isinstance(v, list):
        raise ValueError(f"{what} must be a list, got {v!r:.60}")
    return v


@dataclass
class Wave:
    groups: List[Group] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"groups": [g.to_dict() for g in self.groups]}


@dataclass
class StepPlan:
    world_size: int
    max_tokens_per_rank: int
    sample_ids: List[int]  # the global batch of this step
    lengths: List[int]  # aligned with sample_ids
    waves: List[Wave] = field(default_factory=list)
    step: int = 0
    balancer: str = ""
    masks: Dict[int, SampleMask] = field(default_factory=dict)  # sample id -> mask; absent: causal
    # sample id -> the patch grids (t, h, w) of its images and clips; absent: text only
    vision: Dict[int, SampleGrids] = field(default_factory=dict)
    # What the step record should carry about how the plan was made, e.g. a solver that passed
    # its deadline and the greedy plan taken instead. Serialised only when not empty.
    notes: List[str] = field(default_factory=list)

    # ---- lookups
    def length_of(self) -> Dict[int, int]:
        return dict(zip(self.sample_ids, self.lengths))

    def rank_waves(self, rank: int) -> List[Tuple[int, Group]]:
        """(wave index, group) pairs this rank takes part in, in execution order."""
        return [(w, g) for w, wave in enumerate(self.waves) for g in wave.groups if rank in g.ranks]

    def member_tokens(self, group: Group, lens: Optional[Mapping[int, int]] = None) -> List[int]:
        """Tokens each member holds while running `group`'s micro-batch, in the group's rank order.
        The distributed documents' share comes from the mode's member_tokens, all members at once
        (its closed form where it has one; by contract the members' segments summed)."""
        lens = self.length_of() if lens is None else lens
        g = group
        out = [sum(map(lens.__getitem__, g.local.get(r, ()))) for r in g.ranks]
        if g.distributed:
            spec = mode_spec(g.mode)
            if spec.carries_layout:
                if g.blocks is not None:
                    out = [t + g.blocks.member_tokens(m) for m, t in enumerate(out)]
            else:
                shares = spec.member_tokens([lens[s] for s in g.distributed], g.size)
                out = [t + int(d) for t, d in zip(out, shares)]
        for m, r in enumerate(g.ranks):
            for c in g.chunked.get(r, []):  # run one after another: the largest counts
                out[m] = max(out[m], activation_tokens(dependent_chunk_sizes(lens[c.sample], c.chunk_size), c.keep))
        return out

    def rank_tokens(self, group: Group, rank: int, lens: Optional[Mapping[int, int]] = None) -> int:
        """Tokens `rank` holds while running `group`'s micro-batch (member_tokens of that rank)."""
        return self.member_tokens(group, lens)[group.ranks.index(rank)]

    def group_masks(self, group: Group) -> List[Optional[SampleMask]]:
        """The masks of a group's distributed samples, in order (None: causal)."""
        return [self.masks.get(s) for s in group.distributed]

    def cp_size_of_samples(self) -> Dict[int, int]:
        """Sample id -> ranks it runs on (the group size if distributed, 1 if local)."""
        out: Dict[int, int] = {}
        for wave in self.waves:
            for g in wave.groups:
                out.update({s: g.size for s in g.distributed})
                for ids in g.local.values():
                    out.update({s: 1 for s in ids})
                for cs in g.chunked.values():
                    out.update({c.sample: 1 for c in cs})
        return out

    @property
    def chunked_samples(self) -> List[int]:
        """Samples the plan runs as dependent chunks (they need the ChunkFlow executor)."""
        return [c.sample for w in self.waves for g in w.groups for cs in g.chunked.values() for c in cs]

    def chunking_summary(self) -> Dict[str, int]:
        """ChunkFlow in this plan: samples run as dependent chunks, their chunks, the chunks
        recomputed in backward (the first N-K of each), the largest chunk and the largest K
        ({} when nothing is chunked)."""
        lens = None
        out = {"samples": 0, "chunks": 0, "recomputed": 0, "max_chunk_tokens": 0, "keep": 0}
        for w in self.waves:
            for g in w.groups:
                for cs in g.chunked.values():
                    for c in cs:
                        lens = lens or self.length_of()
                        sizes = dependent_chunk_sizes(lens[c.sample], c.chunk_size)
                        out["samples"] += 1
                        out["chunks"] += len(sizes)
                        out["recomputed"] += max(0, len(sizes) - c.keep)
                        out["max_chunk_tokens"] = max(out["max_chunk_tokens"], max(sizes))
                        out["keep"] = max(out["keep"], c.keep)
        return out if out["samples"] else {}

    def backward_calls(self, wave: int, rank: int) -> int:
        """Backward passes `rank` runs in wave `wave`: one per dependent chunk of its chunked
        samples, else one for a micro-batch with work (0 without). Under ZeRO-2 every backward
        reduces gradients over the world, so the trainer pads every rank to the wave's largest
        count with zero-weight micro-batches (at least one each wave)."""
        lens = None
        for g in self.waves[wave].groups:
            if rank not in g.ranks:
                continue
            if g.chunked.get(rank):
                lens = lens or self.length_of()
                return sum(len(dependent_chunk_sizes(lens[c.sample], c.chunk_size)) for c in g.chunked[rank])
            return 1 if (g.distributed or g.local.get(rank)) else 0
        return 0

    def wave_backward_calls(self) -> List[int]:
        """Backward passes every rank runs in each wave: the wave's largest count (ZeRO-2 reduces in
        every backward, so all ranks pad to it with zero-weight micro-batches), at least one.

        A last wave with chunked samples gets one more: the executor runs a chunked sample's
        backwards under one wave context, so the accumulation boundary must fall on a padding
        micro-batch. Under DDP a chunked sample holding it would run every chunk's forward and
        backward with the reduction on (one all-reduce per chunk against one on the other ranks:
        a hang)."""
        calls = [max(1, max(self.backward_calls(w, r) for r in range(self.world_size))) for w in range(len(self.waves))]
        if self.waves and any(any(g.chunked.values()) for g in self.waves[-1].groups):
            calls[-1] += 1
        return calls

    def rank_passes(self, wave: int, lens: Optional[Mapping[int, int]] = None) -> List[str]:
        """Per rank, the forward (F) and backward (B) passes it itself runs in wave `wave`
        (plan/passes.py): "FB" for a micro-batch with work, ChunkFlow's schedule for each chunked
        sample, "" without."""
        own = [""] * self.world_size
        for g in self.waves[wave].groups:
            for r in g.ranks:
                if g.chunked.get(r):
                    lens = lens or self.length_of()
                    own[r] = "".join(
                        chunked_passes(len(dependent_chunk_sizes(lens[c.sample], c.chunk_size)), c.keep)
                        for c in g.chunked[r]
                    )
                elif g.distributed or g.local.get(r):
                    own[r] = MICRO_BATCH_PASSES
        return own

    def wave_passes(self) -> List[str]:
        """Per wave, the pass sequence every rank runs when the parameters are sharded (FSDP2,
        ZeRO-3: each pass is a chain of world-wide collectives), each rank's own passes in their
        places and zero-weight dummies elsewhere (plan/passes.merge_passes)."""
        lens = self.length_of() if any(g.chunked for w in self.waves for g in w.groups) else None
        return [merge_passes(self.rank_passes(w, lens)) for w in range(len(self.waves))]

    @property
    def spreads_samples(self) -> bool:
        """Whether some sample runs over a CP group of several ranks (needs CP attention)."""
        return any(g.distributed and g.size > 1 for w in self.waves for g in w.groups)

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)

    # ---- serialisation
    def to_dict(self) -> dict:
        d = {
            "format": FORMAT,
            "step": self.step,
            "balancer": self.balancer,
            "world_size": self.world_size,
            "max_tokens_per_rank": self.max_tokens_per_rank,
            "samples": [[i, n] for i, n in zip(self.sample_ids, self.lengths)],
            "waves": [w.to_dict() for w in self.waves],
            **({"notes": list(self.notes)} if self.notes else {}),
        }
        if self.masks:  # absent when every sample is causal: such plans serialise as before
            d["masks"] = {str(s): m.to_dict() for s, m in sorted(self.masks.items())}
        if self.vision:  # absent for text-only steps: such plans serialise as before
            d["vision"] = {str(s): [list(g) for g in gs] for s, gs in sorted(self.vision.items())}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        """Cheap fingerprint to check that all ranks hold the same plan."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, d: Mapping, source: str = "plan") -> StepPlan:
        if not isinstance(d, Mapping):
            raise PlanError(f"{source}: expected a JSON object")
        if d.get("format") != FORMAT:
            raise PlanError(f"{source}: format is {d.get('format')!r}, expected {FORMAT!r}")
        try:
            samples = _items(d["samples"], "samples")
            if not all(isinstance(s, list) and len(s) == 2 for s in samples):
                raise ValueError("samples are [sample id, length] pairs")
            waves = _items(d["waves"], "waves")
            if not all(isinstance(w, Mapping) for w in waves):
                raise ValueError("waves are objects with 'groups'")
            balancer, notes = d.get("balancer", ""), _items(d.get("notes", []), "notes")
            if not isinstance(balancer, str) or not all(isinstance(n, str) for n in notes):
                raise ValueError("balancer is text and notes a list of texts")
            masks = d.get("masks")
            if masks is not None and not isinstance(masks, Mapping):
                raise ValueError(f"masks must map sample ids to masks, got {masks!r:.60}")
            plan = cls(
                world_size=whole(d["world_size"], "world_size"),
                max_tokens_per_rank=whole(d["max_tokens_per_rank"], "max_tokens_per_rank"),
                sample_ids=[whole(s[0], "samples") for s in samples],
                lengths=[whole(s[1], "samples") for s in samples],
                waves=[Wave([Group.from_dict(g) for g in _items(w["groups"], "groups")]) for w in waves],
                step=whole(d.get("step", 0), "step"),
                balancer=balancer,
                notes=list(notes),
            )
            plan.masks = masks_from_json(masks, plan.length_of())
            vision = d.get("vision", {})
            if not isinstance(vision, Mapping):
                raise ValueError(f"vision must map sample ids to patch grids, got {vision!r:.60}")
            plan.vision = {int(s): parse_grids(g, f"sample {s}") for s, g in vision.items() if g}
        except KeyError as e:
            raise PlanError(f"{source}: missing field {e.args[0]!r}") from None
        except (MaskError, BlockLayoutError, VisionGridError) as e:
            raise PlanError(f"{source}: {e}") from None
        except (TypeError, ValueError, IndexError, AttributeError) as e:
            raise PlanError(f"{source}: malformed plan: {e}") from None
        return plan

    @classmethod
    def load_file(cls, path, validate: bool = True) -> List[StepPlan]:
        """The plans of a JSON file: `hf-cp plan --json`'s {"plans": [...], ...}, a list of plans
        or one plan; each read (and, with `validate`, checked) with errors naming the file and
        the plan's index: "plans.json[2]: step 5, wave 1: ..."."""
        path = Path(path)
        if path.is_dir():
            raise PlanError(f"{path}: is a directory; expected a plan JSON file (hf-cp plan --json writes one)")
        try:
            data = load_json(path.read_bytes())
        except OSError as e:
            raise PlanError(f"{path}: {e.strerror or e}") from None
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise PlanError(f"{path}: not valid JSON: {e}") from None
        if isinstance(data, Mapping) and "plans" in data:
            items = data["plans"]
        elif isinstance(data, list):
            items = data
        else:
            items = [data]
        if not isinstance(items, list) or not items:
            raise PlanError(f'{path}: holds no plans (expected a plan object, a list of plans or {{"plans": [...]}})')
        plans = []
        for i, d in enumerate(items):
            plan = cls.from_dict(d, source=f"{path}[{i}]")
            if validate:
                try:
                    plan.validate()
                except PlanError as e:
                    raise PlanError(f"{path}[{i}]: {e}") from None
            plans.append(plan)
        return plans

    @classmethod
    def from_json(cls, text: str, source: str = "plan") -> StepPlan:
        try:
            d = load_json(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"{source}: not valid JSON: {e}") from None
        return cls.from_dict(d, source)

    # ---- invariants
    def validate(self, cluster: Optional[ClusterSpec] = None, cost=None) -> StepPlan:
        """Raise PlanError naming the first broken invariant; return self when valid.

        With a CostModel, also check that Ulysses groups split the model's heads evenly, that
        a blocks group's head ranges cover the model's heads, and count each blocks-group
        member's received K/V and Q rows (in tokens of activation memory: `held_tokens`, the count
        the simulator and the block planners use) against the cap. Masks must match their samples; a blocks layout must follow its
        format (block_layout.BlockLayout.validate), its errors naming the sample, chunk and block.
        """
        where = f"step {self.step}" + (f" ({self.balancer})" if self.balancer else "")
        if len(self.sample_ids) != len(self.lengths):
            raise PlanError(f"{where}: {len(self.sample_ids)} sample ids but {len(self.lengths)} lengths")
        if not self.sample_ids:
            raise PlanError(f"{where}: the step has no samples")
        extra = None  # per sample, its items' activations in tokens (an upper bound for a rank holding several)
        if self.vision and cost is not None:
            try:
                vt = {s: cost.vision_tokens(sum(map(grid_patches, gs))) for s, gs in self.vision.items()}
            except ValueError as e:  # a cost model without a vision tower
                raise PlanError(f"{where}: {e}") from None
            extra = [vt.get(s, 0) for s in self.sample_ids]
        bulk = _BulkSamples.of(self, extra)
        if bulk is None or bulk.duplicated:
            if len(set(self.sample_ids)) != len(self.sample_ids):
                dup = next(s for s in self.sample_ids if self.sample_ids.count(s) > 1)
                raise PlanError(f"{where}: sample {dup} appears twice in the global batch")
        if min(self.lengths) <= 0:
            s, n = next((s, n) for s, n in zip(self.sample_ids, self.lengths) if n <= 0)
            raise PlanError(f"{where}: sample {s} has length {n}; lengths must be positive")
        if cluster is not None:
            if cluster.world_size != self.world_size:
                raise PlanError(f"{where}: plan is for world {self.world_size}, cluster has {cluster.world_size}")
        # With every sample scheduled exactly once (checked in bulk), the per-sample checks below
        # cannot fail and are skipped, and each group looks its samples' lengths up in its own
        # slice: one by one, through a dict of the whole step, they cost more than planning on
        # steps of ~10^5 samples. Otherwise they run as they always did, so the first broken
        # invariant is named exactly as before.
        each_once = bulk is not None and bulk.each_once
        lens = self.length_of() if not each_once or self.masks else None
        if self.vision:
            stepped = set(self.sample_ids)
            stray = sorted(s for s in self.vision if s not in stepped)
            if stray:
                raise PlanError(f"{where}: vision grids are given for sample {stray[0]}, which is not in the step")
        for s, m in sorted(self.masks.items()):
            if s not in lens:
                raise PlanError(f"{where}: a mask is given for sample {s}, which is not in the step")
            try:
                m.validate(s, lens[s])
            except MaskError as e:
                raise PlanError(f"{where}: {e}") from None
        registered: Dict[Tuple[int, ...], bool] = {}  # ranks -> cluster.is_registered, per distinct group
        seen: Dict[int, int] = {}  # sample -> wave
        k = -1  # the group's index over the whole plan (bulk's numbering)
        for w, wave in enumerate(self.waves):
            busy: Dict[int, int] = {}
            # the wave's ranks in range and in one group each, checked at once (a wave of a
            # 4096-rank step holds thousands); rank by rank only to name what broke
            ranks = list(chain.from_iterable(g.ranks for g in wave.groups))
            checked = bool(ranks) and 0 <= min(ranks) and max(ranks) < self.world_size and len(set(ranks)) == len(ranks)
            for gi, g in enumerate(wave.groups):
                k += 1
                if not g.ranks:
                    raise PlanError(f"{where}, wave {w}: group {gi} has no ranks")
                for r in () if checked else g.ranks:
                    if not 0 <= r < self.world_size:
                        raise PlanError(f"{where}, wave {w}: rank {r} outside world of {self.world_size}")
                    if r in busy:
                        raise PlanError(
                            f"{where}, wave {w}: rank {r} is in groups {busy[r]} and {gi}; "
                            f"groups of a wave must be disjoint"
                        )
                    busy[r] = gi
                ok = registered.get(g.ranks) if cluster is not None and len(g.ranks) > 1 else True
                if ok is None:
                    ok = registered[g.ranks] = cluster.is_registered(g.ranks)
                if not ok:
                    raise PlanError(
                        f"{where}, wave {w}: group {list(g.ranks)} is not a registered group "
                        f"({cluster.describe_registry()})"
                    )
                if cost is not None and g.distributed and g.size > 1:
                    try:
                        mode_spec(g.mode).check_group(cost.dims, g.size)
                    except ValueError as e:
                        raise PlanError(f"{where}, wave {w}: group {list(g.ranks)}: {e}") from None
                for r in g.local:
                    if r not in g.ranks:
                        raise PlanError(
                            f"{where}, wave {w}: local samples {g.local[r]} on rank {r}, "
                            f"which is not in group {list(g.ranks)}"
                        )
                chunked = any(g.chunked.values())
                if each_once:
                    if not g.distributed and not chunked and g.blocks is None and not bulk.local_over_cap[k]:
                        continue  # local samples alone, their tokens within the cap: nothing below can fail
                    lens = bulk.group_lengths(k)
                if chunked:
                    self._validate_chunked(g, f"{where}, wave {w}", lens, cost)
                for s in () if each_once else g.sample_ids():
                    if s not in lens:
                        raise PlanError(f"{where}, wave {w}: sample {s} is not in the step's global batch")
                    if s in seen:
                        raise PlanError(f"{where}: sample {s} is scheduled twice (waves {seen[s]} and {w})")
                    seen[s] = w
                self._validate_blocks(g, lens, cost, f"{where}, wave {w}, group {gi} {list(g.ranks)}")
                for r, t in zip(g.ranks, self.held_tokens(g, lens, cost)):
                    if t > self.max_tokens_per_rank and any(g.chunked.values()):
                        raise PlanError(
                            f"{where}, wave {w}: rank {r} holds the activations of {t} tokens of the chunked "
                            f"samples {[list(c) for c in g.chunked[r]]}, over the cap of {self.max_tokens_per_rank}: "
                            f"lower their chunk_size or keep (K)"
                        )
                    if t > self.max_tokens_per_rank:
                        m = g.ranks.index(r)
                        vision = self.vision_held_tokens(g, cost)[m] if self.vision and cost is not None else 0
                        extra = t - self.rank_tokens(g, r, lens) - vision
                        patches = member_held_patches(g, self.vision)[m] if vision else 0
                        raise PlanError(
                            f"{where}, wave {w}: rank {r} holds {t} tokens, over the cap of "
                            f"{self.max_tokens_per_rank} (samples {g.local.get(r, [])} local, "
                            f"{g.distributed} distributed over {list(g.ranks)}"
                            + (f", received K/V and Q rows counted as {extra} tokens" if extra else "")
                            + (
                                f", the vision activations of the {patches} patches it may encode counted as "
                                f"{vision} tokens"
                                if vision
                                else ""
                            )
                            + ")"
                        )
        missing = [] if each_once else [s for s in self.sample_ids if s not in seen]
        if missing:
            raise PlanError(
                f"{where}: samples {missing[:10]}{'...' if len(missing) > 10 else ''} "
                f"({len(missing)} in all) are never scheduled"
            )
        return self

    def held_tokens(self, g: Group, lens: Optional[Mapping[int, int]] = None, cost=None) -> List[int]:
        """Tokens each member of group `g` holds, what the cap bounds: rank_tokens, plus, given
        a CostModel, in a blocks group the K/V and Q rows it receives (block_layout.held_tokens)
        and in a step with images or clips the activations of the items it may encode
        (vision_held_tokens). The one count that validate checks, the simulator reports and the
        planners plan against. The layout is not checked here (validate does)."""
        lens = self.length_of() if lens is None else lens
        own = self.member_tokens(g, lens)
        if cost is None:
            return own
        if g.blocks is not None and g.distributed and mode_spec(g.mode).carries_layout:
            kv, q = received_rows(g.blocks, g.size)
            own = [held_tokens(o, kv[m], q[m], cost) for m, o in enumerate(own)]
        if self.vision:
            own = [t + v for t, v in zip(own, self.vision_held_tokens(g, cost))]
        return own

    def vision_held_tokens(self, g: Group, cost) -> List[int]:
        """Per member of `g`, the activations of the images and clips it may encode, in tokens of
        the memory model (cost.vision_tokens of vision_encoders.member_held_patches: its own
        samples' items and the most of the distributed samples' the executor may give it)."""
        return [cost.vision_tokens(p) for p in member_held_patches(g, self.vision)]

    def _validate_blocks(self, g: Group, lens: Mapping[int, int], cost, where: str) -> None:
        """Check a blocks-mode group's layout (its format, and with a CostModel the model's heads)."""
        if not mode_spec(g.mode).carries_layout or not g.distributed:
            if g.blocks is not None and g.distributed:
                raise PlanError(f"{where}: a block layout is given but the mode is {mode_name(g.mode)!r}, not 'blocks'")
            return
        if g.blocks is None:
            raise PlanError(f"{where}: mode 'blocks' needs a block layout ('blocks': chunks and compute)")
        dist = [lens[s] for s in g.distributed]
        heads = cost.dims.num_heads if cost is not None else None
        try:
            g.blocks.validate(dist, g.size, doc_slices(dist, self.group_masks(g)), heads, g.distributed)
        except BlockLayoutError as e:
            raise PlanError(f"{where}: {e}") from None

    def _validate_chunked(self, g: Group, where: str, lens: Mapping[int, int], cost) -> None:
        """A chunked group: one rank running only chunked samples with sane chunk settings; with a
        CostModel, each sample's activations plus its K/V state store fit the rank's memory."""
        for r, cs in g.chunked.items():
            ids = [c.sample for c in cs]
            if g.size != 1 or r not in g.ranks:
                raise PlanError(
                    f"{where}: chunked samples {ids} on rank {r} in group {list(g.ranks)}: chunked samples "
                    f"run in a one-rank group of their own rank"
                )
            if g.distributed or any(g.local.values()):
                raise PlanError(
                    f"{where}: rank {r} runs chunked samples {ids} and other samples in one group; a chunked "
                    f"sample's group runs nothing else (put the others in another wave)"
                )
            for c in cs:
                if c.sample not in lens:
                    continue  # named by the global-batch check
                if c.chunk_size <= 0 or c.keep <= 0:
                    raise PlanError(
                        f"{where}: chunked sample {c.sample} has chunk_size {c.chunk_size} and keep {c.keep}; "
                        f"both must be positive"
                    )
                if cost is not None:
                    sizes = dependent_chunk_sizes(lens[c.sample], c.chunk_size)
                    patches = sum(map(grid_patches, (self.vision or {}).get(c.sample, ())))
                    need = chunked_memory_bytes(cost, sizes, c.keep, patches)
                    have = cost.memory_bytes(self.max_tokens_per_rank)
                    if need > have:
                        items = (
                            f", and its images' and clips' tower activations and held rows ({patches} patches)"
                            if patches
                            else ""
                        )
                        raise PlanError(
                            f"{where}: chunked sample {c.sample} ({lens[c.sample]} tokens in {len(sizes)} chunks, "
                            f"K={c.keep}) needs {need / 2**30:.2f} GiB (activations and its K/V state store{items}), "
                            f"more than the {have / 2**30:.2f} GiB of a rank's cap of {self.max_tokens_per_rank} tokens"
                        )


@dataclass
class _BulkSamples:
    """A plan's samples looked at all at once, for StepPlan.validate: whether the batch holds
    an id twice, whether the groups schedule every sample of the batch exactly once, and then
    each group's samples with their lengths (a slice of one array gathered with numpy) and
    whether some rank's local samples of a group may exceed the cap (their tokens, and
    `extra` per sample where given: its items' activations)."""

    duplicated: bool
    each_once: bool = False
    ids: List[int] = field(default_factory=list)  # the scheduled ids, group after group
    lengths: Optional[np.ndarray] = None  # their lengths (each_once only)
    group_start: List[int] = field(default_factory=list)  # per group, its first entry in `ids` (and the end)
    local_over_cap: Optional[np.ndarray] = None  # per group: some rank's local samples exceed the cap

    @classmethod
    def of(cls, plan: StepPlan, extra: Optional[Sequence[int]] = None) -> Optional[_BulkSamples]:
        """None when the ids are not plain integers (validate then checks one by one). `extra`
        (aligned with the plan's samples): tokens each sample adds to its rank beyond its
        length (the sum over a rank's samples at least what they add together)."""
        ids = np.asarray(plan.sample_ids)
        if ids.dtype.kind not in "iu":
            return None
        by_id = stable_order(ids)
        sorted_ids = ids[by_id]
        if bool((sorted_ids[1:] == sorted_ids[:-1]).any()):
            return cls(duplicated=True)
        sched: List[int] = []
        group_start = [0]
        spans: List[Tuple[int, int, int]] = []  # (group, first, end) of each rank's local samples
        for wave in plan.waves:
            for g in wave.groups:
                sched.extend(g.distributed)
                for r in sorted(g.local):
                    a = len(sched)
                    sched.extend(g.local[r])
                    spans.append((len(group_start) - 1, a, len(sched)))
                for r in sorted(g.chunked):
                    sched.extend(c.sample for c in g.chunked[r])
                group_start.append(len(sched))
        n = len(ids)
        arr = np.asarray(sched)
        if len(sched) != n or arr.dtype.kind not in "iu":
            return cls(duplicated=False)
        # sorted, the scheduled ids are the batch's (which has none twice): each sample exactly once
        by_sched = stable_order(arr)
        if not np.array_equal(arr[by_sched], sorted_ids):
            return cls(duplicated=False)
        batch_lengths = np.asarray(plan.lengths)
        if batch_lengths.dtype.kind not in "iu":
            return cls(duplicated=False)
        lengths = np.empty(n, dtype=np.int64)
        lengths[by_sched] = batch_lengths[by_id]
        over = np.zeros(len(group_start) - 1, dtype=bool)
        if spans:
            span = np.asarray(spans, dtype=np.int64)
            held = lengths
            if extra is not None:
                held = np.empty(n, dtype=np.int64)
                held[by_sched] = np.asarray(extra, dtype=np.int64)[by_id]
                held += lengths
            csum = np.concatenate(([0], np.cumsum(held)))
            sums = csum[span[:, 2]] - csum[span[:, 1]]
            over[span[sums > plan.max_tokens_per_rank, 0]] = True
        return cls(False, True, sched, lengths, group_start, over)

    def group_lengths(self, k: int) -> Dict[int, int]:
        """Sample id -> length of the samples of group `k`."""
        a, b = self.group_start[k], self.group_start[k + 1]
        return dict(zip(self.ids[a:b], self.lengths[a:b].tolist()))
