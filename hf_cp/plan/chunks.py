"""ChunkFlow's chunk plan: a step's samples as chunks of at most ChunkSize tokens (issue 17).

Samples of at most ChunkSize tokens are bin-packed into *standalone* chunks (ordinary packed
micro-batches). A longer sample is cut into N *dependent* chunks that run in order on one rank:
chunk i attends to its own tokens causally and to every key of chunks 0..i-1, which a K/V state
store keeps (hf_cp/attention/chunk_state.py). Under ChunkFlow's state-aware schedule only the
last K chunks keep their activations; the first N-K are run again (recomputed) in backward.

Pure functions on lengths and plain data: torch-free, like the rest of plan/ and cost/. The same
geometry (`dependent_chunk_sizes`) is used by the plan, the simulator and the executor
(hf_cp/train/step/chunkflow.py), so predicted and executed chunks agree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Mapping, Sequence, Tuple

from hf_cp.modes.segments import causal_pairs, split_sizes
from hf_cp.plan.bins import first_fit
from hf_cp.readers import load_json

if TYPE_CHECKING:  # pricing takes a CostModel; the plan itself needs no cost model
    from hf_cp.cost.model import CostModel

FORMAT = "hf_cp.chunk_plan/1"

# The state store accumulates the K/V gradients of earlier chunks in float32, whatever the
# model's dtype: many later chunks add into them, and fp32 keeps that sum exact enough.
GRAD_ACCUMULATOR_BYTES = 4


class ChunkPlanError(ValueError):
    """A chunk plan breaks an invariant; the message names the sample and the chunk."""


# --------------------------------------------------------------------------- geometry
def dependent_chunk_sizes(length: int, chunk_size: int) -> List[int]:
    """The chunks a sample of `length` tokens is cut into: N = ceil(length / chunk_size) nearly
    equal pieces in order (segments.split_sizes: the first length % N get one more token), so
    every chunk has at most `chunk_size` tokens and none is a tiny remainder."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if length <= 0:
        raise ValueError(f"length must be positive, got {length}")
    return split_sizes(length, -(-length // chunk_size))


def chunk_starts(sizes: Sequence[int]) -> List[int]:
    """Position of each chunk's first token in its sample."""
    out, s = [], 0
    for n in sizes:
        out.append(s)
        s += n
    return out


def activation_tokens(sizes: Sequence[int], keep: int) -> int:
    """Most tokens whose activations exist at once under the state-aware schedule: the last
    `keep` chunks after the forward pass, or one recomputed chunk later (the largest)."""
    if keep <= 0:
        raise ValueError(f"keep (K) must be positive, got {keep}")
    return max(sum(sizes[-keep:]), max(sizes))


def recomputed_chunks(n_chunks: int, keep: int) -> int:
    """Chunks whose forward runs twice: the first N-K (none when K >= N)."""
    return max(0, n_chunks - keep)


# --------------------------------------------------------------------------- the chunk plan
@dataclass
class DependentSample:
    """A long sample as dependent chunks: (start, length) ranges covering it in order."""

    sample: int
    chunks: List[Tuple[int, int]]

    @property
    def sizes(self) -> List[int]:
        return [n for _, n in self.chunks]

    def to_dict(self) -> dict:
        return {"sample": self.sample, "chunks": [list(c) for c in self.chunks]}

    @classmethod
    def from_dict(cls, d: Mapping) -> DependentSample:
        return cls(sample=int(d["sample"]), chunks=[(int(s), int(n)) for s, n in d["chunks"]])


@dataclass
class ChunkPlan:
    """One step's samples as standalone chunks (packs of whole samples) and dependent chunks."""

    chunk_size: int
    keep: int  # K: dependent chunks whose activations are kept; the first N-K are recomputed
    sample_ids: List[int]
    lengths: List[int]  # aligned with sample_ids
    standalone: List[List[int]] = field(default_factory=list)  # sample ids of each packed chunk
    dependent: List[DependentSample] = field(default_factory=list)

    def length_of(self) -> Dict[int, int]:
        return dict(zip(self.sample_ids, self.lengths))

    @property
    def num_chunks(self) -> int:
        return len(self.standalone) + sum(len(d.chunks) for d in self.dependent)

    def chunk_lengths(self) -> List[int]:
        """Tokens of every chunk: standalone chunks first, then each sample's dependent chunks."""
        lens = self.length_of()
        return [sum(lens[s] for s in c) for c in self.standalone] + [n for d in self.dependent for n in d.sizes]

    # ---- serialisation
    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "chunk_size": self.chunk_size,
            "keep": self.keep,
            "samples": [[i, n] for i, n in zip(self.sample_ids, self.lengths)],
            "standalone": [list(c) for c in self.standalone],
            "dependent": [d.to_dict() for d in self.dependent],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: Mapping, source: str = "chunk plan") -> ChunkPlan:
        if not isinstance(d, Mapping):
            raise ChunkPlanError(f"{source}: expected a JSON object")
        if d.get("format") != FORMAT:
            raise ChunkPlanError(f"{source}: format is {d.get('format')!r}, expected {FORMAT!r}")
        try:
            return cls(
                chunk_size=int(d["chunk_size"]),
                keep=int(d["keep"]),
                sample_ids=[int(s[0]) for s in d["samples"]],
                lengths=[int(s[1]) for s in d["samples"]],
                standalone=[[int(s) for s in c] for c in d.get("standalone", [])],
                dependent=[DependentSample.from_dict(x) for x in d.get("dependent", [])],
            )
        except KeyError as e:
            raise ChunkPlanError(f"{source}: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError, IndexError) as e:
            raise ChunkPlanError(f"{source}: malformed chunk plan: {e}") from None

    @classmethod
    def from_json(cls, text: str, source: str = "chunk plan") -> ChunkPlan:
        try:
            d = load_json(text)
        except json.JSONDecodeError as e:
            raise ChunkPlanError(f"{source}: not valid JSON: {e}") from None
        return cls.from_dict(d, source)

    # ---- invariants
    def validate(self) -> ChunkPlan:
        """Raise ChunkPlanError naming the first broken invariant; return self when valid.

        Every sample of the step exactly once; a standalone chunk holds whole samples of at most
        chunk_size tokens in all; a dependent sample's chunks are non-empty, at most chunk_size
        long, and cover positions 0..length-1 contiguously and in order.
        """
        if self.chunk_size <= 0:
            raise ChunkPlanError(f"chunk_size must be positive, got {self.chunk_size}")
        if self.keep <= 0:
            raise ChunkPlanError(f"keep (K) must be positive, got {self.keep}")
        if len(self.sample_ids) != len(self.lengths):
            raise ChunkPlanError(f"{len(self.sample_ids)} sample ids but {len(self.lengths)} lengths")
        lens: Dict[int, int] = {}
        for s, n in zip(self.sample_ids, self.lengths):
            if s in lens:
                raise ChunkPlanError(f"sample {s} appears twice in the step")
            if n <= 0:
                raise ChunkPlanError(f"sample {s} has length {n}; lengths must be positive")
            lens[s] = n
        seen: Dict[int, str] = {}

        def claim(s: int, where: str) -> None:
            if s not in lens:
                raise ChunkPlanError(f"{where}: sample {s} is not in the step")
            if s in seen:
                raise ChunkPlanError(f"sample {s} is chunked twice ({seen[s]} and {where})")
            seen[s] = where

        for c, ids in enumerate(self.standalone):
            where = f"standalone chunk {c}"
            if not ids:
                raise ChunkPlanError(f"{where} is empty")
            for s in ids:
                claim(s, where)
            tokens = sum(lens[s] for s in ids)
            if tokens > self.chunk_size:
                raise ChunkPlanError(
                    f"{where} holds {tokens} tokens (samples {ids}), over the chunk size {self.chunk_size}"
                )
        for dep in self.dependent:
            s = dep.sample
            claim(s, f"the dependent chunks of sample {s}")
            if not dep.chunks:
                raise ChunkPlanError(f"sample {s} has no dependent chunks")
            pos = 0
            for i, (start, n) in enumerate(dep.chunks):
                if start != pos:
                    raise ChunkPlanError(
                        f"sample {s}, chunk {i} starts at position {start}, expected {pos}: dependent "
                        f"chunks must be contiguous and in order"
                    )
                if n <= 0 or n > self.chunk_size:
                    raise ChunkPlanError(
                        f"sample {s}, chunk {i} has {n} tokens; chunks hold 1..{self.chunk_size} tokens"
                    )
                pos += n
            if pos != lens[s]:
                raise ChunkPlanError(f"the chunks of sample {s} cover {pos} of its {lens[s]} tokens")
        missing = [s for s in self.sample_ids if s not in seen]
        if missing:
            raise ChunkPlanError(
                f"samples {missing[:10]}{'...' if len(missing) > 10 else ''} ({len(missing)} in all) are in no chunk"
            )
        return self


def build_chunk_plan(sample_ids: Sequence[int], lengths: Sequence[int], chunk_size: int, keep: int = 1) -> ChunkPlan:
    """ChunkFlow's chunk construction: samples longer than `chunk_size` become dependent chunks
    (dependent_chunk_sizes); the others are packed into standalone chunks of at most
    `chunk_size` tokens by first-fit decreasing (ties in step order), which needs few chunks."""

    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if keep <= 0:
        raise ValueError(f"keep (K) must be positive, got {keep}")
    short = [(n, i) for i, n in enumerate(lengths) if n <= chunk_size]
    short.sort(key=lambda x: (-x[0], x[1]))
    standalone = first_fit([sample_ids[i] for _, i in short], [n for n, _ in short], chunk_size)
    dependent = []
    for s, n in zip(sample_ids, lengths):
        if n > chunk_size:
            sizes = dependent_chunk_sizes(n, chunk_size)
            dependent.append(DependentSample(int(s), list(zip(chunk_starts(sizes), sizes))))
    return ChunkPlan(
        chunk_size=int(chunk_size),
        keep=int(keep),
        sample_ids=[int(s) for s in sample_ids],
        lengths=[int(n) for n in lengths],
        standalone=[list(c) for c in standalone],
        dependent=dependent,
    )


# --------------------------------------------------------------------------- pricing
@dataclass(frozen=True)
class ChunkedCost:
    """Predicted time and memory of one sample run as dependent chunks on one rank."""

    chunk_ms: Tuple[float, ...]  # fwd+bwd of each chunk (whole model, no per-micro-batch overhead)
    recompute_ms: float  # the decoder forward of the first N-K chunks, run a second time
    overhead_ms: float  # per-micro-batch overhead of every chunk's run (and of each recompute)
    activation_tokens: int  # most tokens whose activations exist at once (activation_tokens())
    state_bytes: float  # the K/V state store: values of all tokens and their fp32 gradients

    @property
    def compute_ms(self) -> float:
        return sum(self.chunk_ms) + self.recompute_ms + self.overhead_ms


def dependent_chunk_layers_ms(cost: CostModel, start: int, length: int) -> float:
    """fwd+bwd of one dependent chunk's decoder layers: linear work on its tokens and attention
    of its queries over the keys of every earlier chunk and its own (causal_pairs(start,
    length)), at the kernel efficiency of a `length`-token query chunk."""
    attn = cost.c2 * causal_pairs(start, length) / cost.chunk_efficiency(length)
    return cost.dims.num_layers * (cost.c1 * length + attn)


def dependent_chunk_ms(cost: CostModel, start: int, length: int) -> float:
    """fwd+bwd of one dependent chunk: its decoder layers and the LM head on its tokens."""
    return dependent_chunk_layers_ms(cost, start, length) + cost.head_ms_per_token * length


def state_bytes(cost: CostModel, length: int) -> float:
    """Bytes of the K/V state store for a sample of `length` tokens: every layer's keys and
    values in the model's dtype plus their gradient accumulators (GRAD_ACCUMULATOR_BYTES)."""
    d = cost.dims
    return float(length) * (
        d.kv_bytes_per_token(cost.profile.bytes_per_element) + d.kv_bytes_per_token(GRAD_ACCUMULATOR_BYTES)
    )


def recurrent_state_bytes(cost: CostModel, sizes: Sequence[int]) -> float:
    """Bytes ChunkFlow's state store keeps for a hybrid's Gated DeltaNet layers over a sample cut
    into `sizes`: per layer and per chunk but the last, its final recurrent state (float32) and
    its last conv-window input rows (at most the chunk's, in the model's dtype), each with a
    gradient accumulator (GRAD_ACCUMULATOR_BYTES); 0 for a model without such layers."""
    d = cost.dims
    if not d.recurrent_state_elements:
        return 0.0
    rows = sum(min(d.conv_window, n) for n in list(sizes)[:-1])
    state = d.recurrent_state_elements * (4 + GRAD_ACCUMULATOR_BYTES) * (len(sizes) - 1)
    halo = rows * d.hidden * (cost.profile.bytes_per_element + GRAD_ACCUMULATOR_BYTES)
    return float((d.num_layers - d.softmax_layers) * (state + halo))


def chunked_sample_cost(cost: CostModel, sizes: Sequence[int], keep: int) -> ChunkedCost:
    """Time and memory of a sample cut into chunks of `sizes` under the state-aware schedule
    with `keep` (K) chunks kept.

    Time: every chunk's fwd+bwd (dependent_chunk_ms: later chunks attend to more keys), plus
    a second decoder forward of the first N-K chunks: the executor's first forward of those
    only fills the K/V store (no LM head, no graph), the second is the recompute whose backward
    follows. A forward is taken as profile.forward_share of fwd+bwd (1/3, backward twice the
    forward, unless the profile measured it). Each chunk run is one micro-batch (its per-micro-
    batch overhead c0 per layer); a recompute pays the forward share of it again.
    Memory: activations of activation_tokens(sizes, keep) tokens (cost.memory_bytes) plus the
    state store (state_bytes), which holds the K/V of the whole sample, and a hybrid's recurrent
    states between chunks (recurrent_state_bytes).
    """
    sizes = list(sizes)
    if not sizes or any(n <= 0 for n in sizes):
        raise ValueError(f"chunk sizes must be positive, got {sizes}")
    starts = chunk_starts(sizes)
    layers_ms = [dependent_chunk_layers_ms(cost, s, n) for s, n in zip(starts, sizes)]
    chunk_ms = tuple(ms + cost.head_ms_per_token * n for ms, n in zip(layers_ms, sizes))
    n_re = recomputed_chunks(len(sizes), keep)
    share = cost.profile.forward_share
    overhead = cost.micro_batch_overhead_ms()
    return ChunkedCost(
        chunk_ms=chunk_ms,
        recompute_ms=share * sum(layers_ms[:n_re]),
        overhead_ms=overhead * (len(sizes) + share * n_re),
        activation_tokens=activation_tokens(sizes, keep),
        state_bytes=state_bytes(cost, sum(sizes)) + recurrent_state_bytes(cost, sizes),
    )


def vision_rows_bytes(cost: CostModel, patches: int) -> float:
    """Bytes a chunked sample with images or clips of `patches` patches holds beside its chunks'
    activations (train/step/chunk_vision.py): the tower's rows of its placeholder tokens (one per
    merged cell, out_hidden wide, once more per DeepStack merger), kept in the model's dtype from
    the encoding to the sample's last backward, and their float32 gradient accumulator
    (GRAD_ACCUMULATOR_BYTES). 0 without patches. The tower's own activations are apart
    (cost.vision_tokens)."""
    if not patches:
        return 0.0
    v = cost.vision_dims()
    rows = -(-int(patches) // v.merge_unit)
    width = v.out_hidden * (1 + len(v.deepstack_visual_indexes))
    return float(rows * width * (cost.profile.bytes_per_element + GRAD_ACCUMULATOR_BYTES))


def chunked_vision_ms(cost: CostModel, grids: Sequence[Sequence[int]]) -> float:
    """The tower's time over a chunked sample's images and clips of patch grids `grids`: their
    forward and backward (cost.vision_ms) and one more forward (profile.forward_share of it): the
    executor encodes them once without a graph for the rows every chunk reads, and again with one
    in chunk 0's pass, whose backward runs the tower's (train/step/chunk_vision.py)."""
    if not grids:
        return 0.0
    return (1.0 + cost.profile.forward_share) * cost.vision_ms(grids)


def chunked_vision_bytes(cost: CostModel, patches: int) -> float:
    """What a chunked sample's images and clips hold on its rank for the whole sample, beyond the
    rank's static bytes: the tower's activations (cost.vision_tokens, in tokens of the memory
    model) and the held rows with their gradients (vision_rows_bytes). 0 without patches."""
    if not patches:
        return 0.0
    return cost.profile.activation_bytes_per_token * cost.vision_tokens(int(patches)) + vision_rows_bytes(cost, patches)


def chunked_memory_bytes(cost: CostModel, sizes: Sequence[int], keep: int, patches: int = 0) -> float:
    """Peak bytes of a chunked sample on its rank: activations plus the state store, and with
    `patches` patches of images and clips what they hold (chunked_vision_bytes)."""
    store = state_bytes(cost, sum(sizes)) + recurrent_state_bytes(cost, sizes)
    return cost.memory_bytes(activation_tokens(sizes, keep)) + store + chunked_vision_bytes(cost, patches)


def chunk_costs_ms(plan: ChunkPlan, cost: CostModel) -> List[float]:
    """fwd+bwd of every chunk of a chunk plan, in ChunkPlan.chunk_lengths order: the
    micro-batch costs of a pipeline fed with these chunks (pipeline.simulate_1f1b), next to
    the same step's unchunked micro-batches. Per-micro-batch overhead included, recompute not."""
    lens = plan.length_of()
    out = [standalone_chunk_ms(cost, [lens[s] for s in ids]) for ids in plan.standalone]
    overhead = cost.micro_batch_overhead_ms()
    for dep in plan.dependent:
        out += [dependent_chunk_ms(cost, s, n) + overhead for s, n in dep.chunks]
    return out


def standalone_chunk_ms(cost: CostModel, lengths: Sequence[int]) -> float:
    """fwd+bwd of one standalone chunk (packed whole samples), its micro-batch overhead included."""
    return cost.local_ms(lengths) + cost.micro_batch_overhead_ms()


def largest_fitting_chunk(
    cost: CostModel, length: int, keep: int, max_tokens_per_rank: int, upper: int, patches: int = 0
) -> int:
    """The largest chunk size <= `upper` with which a sample of `length` tokens fits a rank whose
    memory is cost.memory_bytes(max_tokens_per_rank) (its activations and its state store: the
    K/V, and a hybrid's recurrent states between chunks, recurrent_state_bytes; with `patches`
    patches of images and clips, what they hold for the whole sample, chunked_vision_bytes);
    0 when even one-token chunks do not fit.

    For a given budget of activation tokens, searched over the chunk count m: chunks of
    c = ceil(length / m) tokens, which make n = ceil(length / c) <= m chunks
    (dependent_chunk_sizes), split as split_sizes does (the first r of q + 1 tokens). The K kept
    chunks are the last, smallest K of them, and the largest chunk is ceil(length / n); both
    never grow with n, and n never shrinks with m, so whether m fits is monotone in m: a
    bisection over [lower bound, length] finds the smallest m that fits (the largest chunk) in
    at most 64 steps, whatever the numbers (a cap of 1e15 tokens, an activation size of 1e300
    bytes made a walk over m spin for hours). The lower bound: ceil(length / upper), and when the
    whole sample does not fit the free activation tokens only n > K can, the kept chunks then
    holding at least K * floor(length / n) tokens, so no m below length / (free / K + 1) fits.

    A hybrid's recurrent states grow with the chunk count, so the budget depends on the answer:
    the search runs again with the budget less the states of the chunks it chose, until the
    chunks stay the same. Every chunking that fits needs at least the chunks of the run before
    (its budget was larger), so the fixed point is the largest chunk that fits; the chunk count
    only grows, so this ends (at most 64 rounds, each checked)."""
    if keep <= 0 or upper <= 0:
        raise ValueError(f"keep and upper must be positive, got {keep} and {upper}")
    alpha = cost.profile.activation_bytes_per_token
    room = cost.memory_bytes(max_tokens_per_rank) - cost.memory_bytes(0)
    free = (room - state_bytes(cost, length) - chunked_vision_bytes(cost, patches)) / alpha
    length = int(length)
    chunk = _largest_chunk_within(length, keep, free, upper)
    for _ in range(64):
        if not chunk or not cost.dims.recurrent_state_elements:
            return chunk
        budget = free - recurrent_state_bytes(cost, dependent_chunk_sizes(length, chunk)) / alpha
        again = _largest_chunk_within(length, keep, budget, upper)
        if again == chunk:
            return chunk
        chunk = again
    return 0  # not settled in 64 rounds: refused as not fitting rather than guessed


def _largest_chunk_within(length: int, keep: int, free: float, upper: int) -> int:
    """largest_fitting_chunk's search for a budget of `free` activation tokens (0: none fits)."""
    if not free >= 1:  # nan (inf - inf) fits nothing either
        return 0

    def fits(m: int) -> bool:
        c = -(-length // m)
        n = -(-length // c)  # the chunks dependent_chunk_sizes(length, c) really makes (n <= m)
        q, r = divmod(length, n)
        kept = length if keep >= n else keep * q + max(0, r - (n - keep))  # split_sizes: the first r are q + 1
        return max(kept, q + (r > 0)) <= free

    lo = max(-(-length // upper), 1)
    if length > free:
        lo = max(lo, int(length // (free / keep + 1)))
    lo = min(lo, length)
    if lo < 1 or not fits(length):
        return 0
    hi = length  # fits(hi); the smallest m in [lo, hi] that fits is wanted
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return -(-length // lo)
