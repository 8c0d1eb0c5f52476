"""The Balancer protocol, the request it plans, and the checks every balancer shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping, Optional, Protocol, Sequence, Tuple, runtime_checkable

import numpy as np

from hf_cp.balance.registry import balancers_handling_masks
from hf_cp.cost.model import CostModel
from hf_cp.cost.vision import alone_held_tokens, grid_patches, smallest_vision_group
from hf_cp.modes.registry import rank_segments
from hf_cp.modes.segments import ShardMode, segment_tokens
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import StepPlan
from hf_cp.samples.masks import SampleMask
from hf_cp.samples.vision_grids import SampleGrids, parse_grids


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _int_column(values) -> Tuple[Tuple[int, ...], np.ndarray]:
    """(Python ints, read-only int64 array) of a request's ids or lengths: a sequence (each read
    as int() reads it) or an integer array (a sampler's, taken without a pass in Python).
    np.fromiter then tolist: a third of tuple(int(v) ...)'s time on the 7M samples of a
    16384-rank step."""
    if isinstance(values, np.ndarray):
        if values.dtype.kind not in "iu":
            raise TypeError(f"sample ids and lengths must be integers, got an array of {values.dtype}")
        arr = values.astype(np.int64).reshape(-1)  # a copy: the caller's array may change
    else:
        values = values if isinstance(values, (list, tuple)) else list(values)
        arr = np.fromiter(values, dtype=np.int64, count=len(values))
    return tuple(arr.tolist()), _read_only(arr)


class SampleTooLongError(ValueError):
    """A sample cannot fit even the largest registered group."""


class VisionMemoryError(SampleTooLongError):
    """A sample's tokens and its images' and clips' activations fit no rank of any group."""


class UnsupportedMaskError(ValueError):
    """A balancer was asked to plan samples with masks it cannot price or place."""


@dataclass(frozen=True)
class PlanRequest:
    """Everything a balancer may look at: a pure function of this gives the plan."""

    sample_ids: Tuple[int, ...]
    lengths: Tuple[int, ...]
    cluster: ClusterSpec
    cost: CostModel
    seed: int = 0
    step: int = 0
    dataset_max_length: Optional[int] = None  # longest sample of the whole dataset, if known
    # sample id -> its non-causal mask (hf_cp/masks.py); samples not in it are causal. Balancers
    # that cannot price masked samples are refused them (check_mask_support).
    masks: Optional[Mapping[int, SampleMask]] = field(default=None, hash=False)
    # longest sample the request admits (None: what the largest CP group holds). Whoever builds
    # the request for a balancer that trains longer samples (chunkflow, auto with it) sets it to
    # that balancer's limit (balance/sample_limit.py: sample_token_limit)
    max_sample_tokens: Optional[int] = None
    # sample id -> the patch grids (t, h, w) of its images and clips (samples/vision_grids.py);
    # samples not in it are text only. Their encoder work is priced with the request's cost
    # model (CostModel.vision_item_ms), on the rank or group that holds them (cost/vision.py).
    vision: Optional[Mapping[int, SampleGrids]] = field(default=None, hash=False)

    def __post_init__(self):
        ids, id_array = _int_column(self.sample_ids)
        lengths, length_array = _int_column(self.lengths)
        object.__setattr__(self, "sample_ids", ids)
        object.__setattr__(self, "lengths", lengths)
        # the arrays made once, here (cached_property reads the instance __dict__ first)
        self.__dict__["id_array"], self.__dict__["length_array"] = id_array, length_array
        if len(self.sample_ids) != len(self.lengths):
            raise ValueError(f"{len(self.sample_ids)} sample ids but {len(self.lengths)} lengths")
        if self.masks:
            lens = dict(zip(self.sample_ids, self.lengths))
            for s, m in self.masks.items():
                if s not in lens:
                    raise ValueError(f"step {self.step}: a mask is given for sample {s}, which is not in the step")
                if not isinstance(m, SampleMask) or m.length != lens[s]:
                    raise ValueError(
                        f"step {self.step}: sample {s} has {lens[s]} tokens but its mask is {m!r:.120}; "
                        f"masks must be SampleMasks of the sample's length"
                    )
            object.__setattr__(self, "masks", {int(s): m for s, m in self.masks.items() if not m.is_causal} or None)
        else:
            object.__setattr__(self, "masks", None)
        if self.vision:
            stepped = set(self.sample_ids)
            stray = sorted(int(s) for s in self.vision if int(s) not in stepped)
            if stray:
                raise ValueError(
                    f"step {self.step}: vision grids are given for sample {stray[0]}, which is not in the step"
                )
            grids = {int(s): parse_grids(g, f"step {self.step}: sample {s}") for s, g in self.vision.items()}
            object.__setattr__(self, "vision", {s: g for s, g in grids.items() if g} or None)
            if self.vision:
                self.cost.vision_dims()  # refused by name when the cost model has no vision tower
        else:
            object.__setattr__(self, "vision", None)
        if not self.sample_ids:
            raise ValueError(f"step {self.step}: empty global batch, nothing to plan")
        cap = self.cluster.largest_capacity
        limit = cap if self.max_sample_tokens is None else max(cap, int(self.max_sample_tokens))
        # the first sample (in step order) with a length <= 0 or over the limit, found in numpy
        bad = np.flatnonzero((length_array <= 0) | (length_array > limit))
        if bad.size:
            s, n = ids[int(bad[0])], lengths[int(bad[0])]
            if n <= 0:
                raise ValueError(f"sample {s}: length {n} must be positive")
            if n > limit:
                raise SampleTooLongError(
                    f"sample {s} has {n} tokens; the largest group ({self.cluster.group_sizes[-1]} ranks x "
                    f"{self.cluster.max_tokens_per_rank} tokens per rank) holds {cap}"
                    + (f" and the request admits samples up to {limit} tokens" if limit > cap else "")
                    + ". Raise max_tokens_per_rank or the world size, or drop or shorten it in the data "
                    "(hf-cp preprocess --max-length --overlong drop/truncate for token data)"
                    + ("" if limit > cap else "; balancer chunkflow trains longer samples as dependent chunks")
                )
        if self.vision:
            check_vision_memory(self)

    # The ids and lengths as int64 arrays, made once per request (read-only; __post_init__
    # makes them with the tuples): a step holds up to ~10^7 samples, and its members, bounds
    # and pricer each used to convert the tuples (cached_property writes the instance
    # __dict__, which a frozen dataclass allows; these are its fallback).
    @cached_property
    def id_array(self) -> np.ndarray:
        return _read_only(np.fromiter(self.sample_ids, dtype=np.int64, count=len(self.sample_ids)))

    @cached_property
    def length_array(self) -> np.ndarray:
        return _read_only(np.fromiter(self.lengths, dtype=np.int64, count=len(self.lengths)))

    @cached_property
    def memory_length_array(self) -> np.ndarray:
        """Per sample, what it holds of its rank's memory when local, in tokens: its length plus,
        for a sample with images or clips, their activations (cost.vision_tokens of its
        patches); the length array itself in a text-only step. For several samples on one rank
        the sum is at least what StepPlan.held_tokens counts (vision_tokens rounds each up)."""
        if not self.vision:
            return self.length_array
        extra = [self.cost.vision_tokens(sum(map(grid_patches, self.vision.get(s, ())))) for s in self.sample_ids]
        return _read_only(self.length_array + np.asarray(extra, dtype=np.int64))

    def empty_plan(self, balancer: str) -> StepPlan:
        return StepPlan(
            world_size=self.cluster.world_size,
            max_tokens_per_rank=self.cluster.max_tokens_per_rank,
            sample_ids=list(self.sample_ids),
            lengths=list(self.lengths),
            step=self.step,
            balancer=balancer,
            masks=dict(self.masks or {}),  # the plan carries its samples' masks (self-contained JSON)
            vision=dict(self.vision or {}),  # ... and their vision grids (the simulator prices them)
        )


def check_vision_memory(req: PlanRequest) -> None:
    """Raise VisionMemoryError naming the first sample of `req` that fits no rank's memory with
    its items' activations, alone on one rank or on any registered group (cost/vision.py:
    alone_held_tokens, the count StepPlan.validate checks). A sample longer than the largest group
    holds, in a request that admits it (`max_sample_tokens`: only ChunkFlow's dependent chunks
    train it), is left to the balancer, which counts its items beside its chunks and refuses it
    by name when they do not fit (balancers/chunkflow.py)."""
    cl, cost = req.cluster, req.cost
    cap = cl.max_tokens_per_rank
    for s, n in zip(req.sample_ids, req.lengths):
        grids = req.vision.get(s)
        if not grids or alone_held_tokens(n, grids, 1, cost) <= cap:
            continue
        if n > cl.largest_capacity and req.max_sample_tokens is not None and n <= req.max_sample_tokens:
            continue  # chunked or refused by the balancer
        if smallest_vision_group(n, grids, cl.group_sizes, cap, cost) is not None:
            continue
        patches = [grid_patches(g) for g in grids]
        largest = max(range(len(grids)), key=lambda k: (patches[k], -k))
        top = cl.group_sizes[-1]
        raise VisionMemoryError(
            f"step {req.step}: sample {s} ({n} tokens, {len(grids)} image(s) or clip(s) of {sum(patches)} patches) "
            f"fits no rank's memory: alone on one rank it holds {alone_held_tokens(n, grids, 1, cost)} tokens "
            f"(its own and its items' activations, {cost.vision_tokens(sum(patches))} tokens), and spread over "
            f"the largest group ({top} ranks) the fullest member holds {alone_held_tokens(n, grids, top, cost)}, "
            f"over the cap of {cap} tokens per rank. An item is encoded whole on one rank: its largest, "
            f"{tuple(grids[largest])} ({patches[largest]} patches), alone holds {cost.vision_tokens(patches[largest])} "
            f"tokens of activations. Raise cp_max_tokens_per_rank, or give it fewer pixels or frames (the "
            f"processor's max_pixels, a lower video fps), or drop it from the data"
        )


@runtime_checkable
class Balancer(Protocol):
    """Plans one optimizer step. Must be deterministic in its request.

    A balancer that plans samples with masks (PlanRequest.masks) correctly, pricing them by
    their masked area or placing them independently of their attention cost, says so with a
    class attribute `handles_masks = True`; the others are refused masked samples.

    A balancer whose first plan pays a one-time start-up (a solver library's initialisation)
    may define `warm_up()`, which pays it at once: the planner worker calls it when it starts,
    so that the cost overlaps the trainer's set-up (warm_up_balancer)."""

    name: str

    def plan(self, request: PlanRequest) -> StepPlan: ...


def warm_up_balancer(balancer) -> None:
    """Call `balancer.warm_up()` when it has one (the Balancer protocol's optional start-up)."""
    warm = getattr(balancer, "warm_up", None)
    if callable(warm):
        warm()


def check_mask_support(balancer, request: PlanRequest, name: Optional[str] = None) -> None:
    """Raise UnsupportedMaskError, naming the balancer and a masked sample, when `request` has
    masked samples and `balancer` does not declare `handles_masks`."""
    if not request.masks or getattr(balancer, "handles_masks", False):
        return

    name = name or getattr(balancer, "name", type(balancer).__name__)
    sid = min(request.masks)
    kinds = sorted({m.kind for m in request.masks.values()})
    raise UnsupportedMaskError(
        f"step {request.step}: balancer {name!r} prices every sample as a causal document, so it cannot plan "
        f"masked samples: sample {sid} has a {request.masks[sid].kind!r} mask ({len(request.masks)} masked samples "
        f"in the step, kinds {kinds}). Balancers that plan masked samples: "
        f"{', '.join(balancers_handling_masks()) or 'none'}"
    )


def max_member_tokens(mode: ShardMode, doc_lengths: Sequence[int], group_size: int) -> int:
    """Tokens the fullest member holds when `doc_lengths` are distributed with `mode`."""
    if group_size == 1:
        return sum(doc_lengths)
    return max(segment_tokens(rank_segments(mode, doc_lengths, group_size, m)) for m in range(group_size))
