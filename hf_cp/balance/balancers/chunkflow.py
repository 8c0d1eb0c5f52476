"""`chunkflow`: ChunkFlow's chunks (hf_cp/plan/chunks.py), balanced over the ranks by their real cost.

Samples of at most `chunk_size` tokens are packed into standalone chunks (first-fit
decreasing); a longer sample runs as dependent chunks on one rank, with the largest chunk size
(at most `chunk_size`) at which its K chunks' activations and its K/V state store fit the
rank's memory. A sample that does not fit one rank even in chunks of `min_chunk_size` tokens
(or half `chunk_size`, when that is shorter: sample_limit.shortest_allowed_chunk) runs whole on one rank when it fits the cap, else distributed over the smallest CP group that
holds it (per-document ring), as the other balancers would place it.

On one rank a long sample needs no communication, but it may take longer than a rank's share
of the step: with `spread_stragglers` (default), a chunked sample that alone takes longer than
the mean rank load runs on the smallest CP group that brings it under that load (or the one
where it is fastest), when that is faster than chunked; then `chunkflow` mixes with CP.

Every unit (a standalone chunk, a chunked sample, a CP sample) is priced by the cost model:
a dependent chunk by the keys it really attends to (chunk i over chunks 0..i), not by its
length as ChunkFlow's own scheduler does, plus the recompute of the first N-K chunks. CP
samples take their group first (the block whose busiest member is least loaded); then the
one-rank units go heaviest first to the least loaded rank (LPT).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, List, Optional, Tuple

from hf_cp.balance.base import PlanRequest, SampleTooLongError, max_member_tokens
from hf_cp.balance.options import BalancerOptionError, BalancerOptions, option
from hf_cp.balance.registry import register_balancer
from hf_cp.balance.toolkit.assign import lpt_assign
from hf_cp.balance.toolkit.costs import cost_memo
from hf_cp.balance.toolkit.sample_limit import (
    chunk_fits,
    format_bytes,
    longest_chunkable_sample,
    shortest_allowed_chunk,
)
from hf_cp.balance.toolkit.vision_memory import fit_vision_memory
from hf_cp.balance.toolkit.waves import WaveBuilder, block_ranks
from hf_cp.modes.segments import ShardMode
from hf_cp.plan.chunks import (
    build_chunk_plan,
    chunked_sample_cost,
    chunked_vision_bytes,
    chunked_vision_ms,
    dependent_chunk_sizes,
    standalone_chunk_ms,
    state_bytes,
)
from hf_cp.plan.step_plan import ChunkedSample, Group, StepPlan
from hf_cp.plan.vision_encoders import grid_patches

DEFAULT_MIN_CHUNK_SIZE = 256


@dataclass(frozen=True)
class ChunkFlowOptions(BalancerOptions):
    BALANCER: ClassVar[str] = "chunkflow"

    chunk_size: Optional[int] = option(None, "most tokens of any chunk (default: the per-rank cap divided by keep)")
    keep: int = option(1, "K: dependent chunks whose activations are kept (the first N-K are recomputed in backward)")
    min_chunk_size: int = option(
        DEFAULT_MIN_CHUNK_SIZE,
        "a long sample that would need shorter chunks to fit one rank runs on a CP group instead (short chunks run "
        "attention at low kernel efficiency and pay the per-micro-batch overhead each)",
    )
    spread_stragglers: bool = option(
        True,
        "run a chunked sample slower than the mean rank load on a CP group when the cost model says it is faster "
        "there (false: CP only for samples no rank can hold)",
    )

    def check(self) -> None:
        for name in ("chunk_size", "keep", "min_chunk_size"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise BalancerOptionError(f"chunkflow: {name} must be a positive integer, got {value!r}")


@register_balancer("chunkflow", auto_member=True)
class ChunkFlowBalancer:
    """ChunkFlow (ChunkFlowOptions): long samples as dependent chunks on one rank, short ones
    packed into standalone chunks, all placed by their real cost."""

    name = "chunkflow"
    options_class = ChunkFlowOptions

    def __init__(self, **options):
        o = self.options = ChunkFlowOptions.from_dict(options)
        self.chunk_size, self.keep, self.min_chunk_size = o.chunk_size, o.keep, o.min_chunk_size
        self.spread_stragglers = o.spread_stragglers

    def step_chunk_size(self, cap: int) -> int:
        """The chunk size of a step on ranks of `cap` tokens: K chunks must fit the cap."""
        if self.chunk_size is None:
            size = cap // self.keep
            if size <= 0:
                raise ValueError(f"chunkflow: keep {self.keep} chunks cannot fit a cap of {cap} tokens")
            return size
        if self.keep * self.chunk_size > cap:
            raise ValueError(
                f"chunkflow: keep {self.keep} x chunk_size {self.chunk_size} = {self.keep * self.chunk_size} "
                f"tokens of activations exceed the cap of {cap} tokens per rank"
            )
        return self.chunk_size

    def max_sample_tokens(self, cluster, cost, masked: bool = False) -> int:
        """The longest sample chunkflow trains (balance/sample_limit.py): as dependent chunks on
        one rank (K chunks of >= min_chunk_size tokens and the K/V state store of the whole
        sample within one rank's memory), or on the largest CP group. Masked samples: what
        the largest group holds (chunkflow plans causal samples only: check_mask_support)."""
        if masked:
            return cluster.largest_capacity
        cap = cluster.max_tokens_per_rank
        chunked = longest_chunkable_sample(cost, self.keep, cap, self.step_chunk_size(cap), self.min_chunk_size)
        return max(cluster.largest_capacity, chunked)

    def trains_length(self, n: int, cluster, cost) -> bool:
        """Whether a sample of `n` tokens (<= max_sample_tokens) is planned: on a CP group, or
        as dependent chunks that fit one rank (a few lengths just under the limit do not)."""
        cap = cluster.max_tokens_per_rank
        if n <= cap or self._cp_sizes(cluster, n):
            return True
        return bool(chunk_fits(cost, n, self.keep, cap, self.step_chunk_size(cap), self.min_chunk_size))

    def plan(self, req: PlanRequest) -> StepPlan:
        cl, cost = req.cluster, req.cost
        cap = cl.max_tokens_per_rank
        size = self.step_chunk_size(cap)
        chunks = build_chunk_plan(req.sample_ids, req.lengths, size, self.keep).validate()
        lens = chunks.length_of()
        # (ms, kind, payload): kind "pack" -> sample ids, "chunked" -> ChunkedSample, "cp" -> (id, group size)
        vision = req.vision or {}

        def encoder_ms(ids) -> float:  # the tower's time over the samples' items, on their rank
            grids = [g for s in ids for g in vision.get(s, ())]
            return cost.vision_ms(grids) if grids else 0.0

        units: List[Tuple[float, str, object]] = [
            (standalone_chunk_ms(cost, [lens[s] for s in ids]) + encoder_ms(ids), "pack", ids)
            for ids in chunks.standalone
        ]
        for dep in chunks.dependent:
            n = lens[dep.sample]
            # a sample's images and clips are encoded on its rank and held beside its chunks
            patches = sum(map(grid_patches, vision.get(dep.sample, ())))
            c = chunk_fits(cost, n, self.keep, cap, size, self.min_chunk_size, patches)
            if c:
                ms = chunked_sample_cost(cost, dependent_chunk_sizes(n, c), self.keep).compute_ms
                ms += chunked_vision_ms(cost, vision.get(dep.sample, ()))
                units.append((ms, "chunked", ChunkedSample(dep.sample, c, self.keep)))
                continue
            if n <= cap:  # too long for its chunks' K/V state, short enough to run whole
                units.append((standalone_chunk_ms(cost, [n]) + encoder_ms([dep.sample]), "pack", [dep.sample]))
                continue
            g = next((g for g in self._cp_sizes(cl, n)), None)
            if g is None:
                items = (
                    f" and its images' and clips' {format_bytes(chunked_vision_bytes(cost, patches))} ({patches} "
                    f"patches: the tower's activations and the held rows)"
                    if patches
                    else ""
                )
                raise SampleTooLongError(
                    f"chunkflow: sample {dep.sample} ({n} tokens) fits neither one rank as dependent chunks of "
                    f">= {shortest_allowed_chunk(n, size, self.min_chunk_size)} tokens (its K/V state store of "
                    f"{format_bytes(state_bytes(cost, n))}{items} is too large beside K={self.keep} chunks' activations; "
                    f"chunkflow trains samples up to {self.max_sample_tokens(cl, cost)} tokens here) nor any CP "
                    f"group of {cl.group_sizes} ranks with {cap} tokens each. Lower keep (cp_chunk_keep) or "
                    f"min_chunk_size, raise cp_max_tokens_per_rank, or drop or shorten it in the data"
                )
            units.append(
                (cost_memo(cost).doc_on_group_ms(n, g) + cost.micro_batch_overhead_ms(), "cp", (dep.sample, g))
            )
        if self.spread_stragglers and cl.world_size > 1:
            self._spread_stragglers(units, lens, req)

        load = [0.0] * cl.world_size
        waves = WaveBuilder(cl.world_size)
        cp_units = sorted((u for u in units if u[1] == "cp"), key=lambda u: -u[0])  # stable: ties in step order
        for ms, _, (sid, g) in cp_units:
            blocks = [block_ranks(b, g) for b in range(cl.world_size // g)]
            ranks = min(blocks, key=lambda rs: max(load[r] for r in rs))  # first block on ties
            start = max(load[r] for r in ranks)
            for r in ranks:
                load[r] = start + ms
            waves.add(Group(ranks=ranks, distributed=[sid], mode=ShardMode.RING_PER_DOC))
        one_rank = [u for u in units if u[1] != "cp"]
        bins, _ = lpt_assign([u[0] for u in one_rank], cl.world_size, loads=load, exact_items=len(one_rank))
        order = sorted(range(len(one_rank)), key=lambda i: (-one_rank[i][0], i))  # heaviest first on each rank
        for i in order:
            r = int(bins[i])
            _, kind, payload = one_rank[i]
            if kind == "pack":
                waves.add(Group(ranks=(r,), local={r: list(payload)}))
            else:
                waves.add(Group(ranks=(r,), chunked={r: [payload]}))
        plan = req.empty_plan(self.name)
        plan.waves = waves.build()
        return fit_vision_memory(plan, req)  # within the cap with its encoders' activations

    @staticmethod
    def _cp_sizes(cl, n: int) -> List[int]:
        """CP group sizes (> 1) whose members hold a per-document split of `n` tokens."""
        cap = cl.max_tokens_per_rank
        return [g for g in cl.group_sizes if g > 1 and max_member_tokens(ShardMode.RING_PER_DOC, [n], g) <= cap]

    def _spread_stragglers(self, units: List[Tuple[float, str, object]], lens, req: PlanRequest) -> None:
        """Chunked samples slower than the mean rank load go to a CP group where they are faster:
        the smallest that brings them under the mean, else the fastest."""
        cost, cl = req.cost, req.cluster
        mean = sum(ms * (p[1] if kind == "cp" else 1) for ms, kind, p in units) / cl.world_size  # rank-ms
        overhead = cost.micro_batch_overhead_ms()
        for i, (ms, kind, payload) in enumerate(units):
            if kind != "chunked" or ms <= mean:
                continue
            best: Optional[Tuple[float, int]] = None
            for g in self._cp_sizes(cl, lens[payload.sample]):
                t = cost_memo(cost).doc_on_group_ms(lens[payload.sample], g) + overhead
                if best is None or t < best[0]:
                    best = (t, g)
                if t <= mean:
                    break
            if best is not None and best[0] < ms:
                units[i] = (best[0], "cp", (payload.sample, best[1]))
