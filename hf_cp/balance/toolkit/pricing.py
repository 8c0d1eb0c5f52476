"""Fast predicted step time of a plan: `hf_cp.cost.simulate.simulate`'s timing rule on per-length tables.

`simulate` prices every member of every group document by document through
CostModel.distributed_rank_cost: exact and readable, but at 512 ranks it takes longer than
planning (50-1200 ms a plan). Pricing a plan here gives the same makespan (to rounding:
sums are taken in another order) from vectorised pieces:

* a member's time is additive in its local documents (CostMemo.local_ms, cached per length)
  plus its share of the distributed ones, whose compute is additive over segments while the
  ring's unhidden communication, max(0, bytes / bandwidth + latency - attention), is taken
  once per member, as in CostModel._rank_cost;
* per-document sharding: every document's per-member tokens and attention are a table per
  (length, group size), built once with numpy; zigzag: the segments of the packed sequence
  are the cuts of the document bounds by the 2g chunk bounds, found with numpy in
  O(documents + g) (the modes whose spec's ring_split says so: ring_per_doc, ring_zigzag and
  registered copies of them); every other mode (Ulysses, blocks: no built-in balancer plans
  them) and every plan with masked samples go through the cost model (simulate.group_costs); vision
  work is added per slot (a local list's items on its rank) and per distributed group (cost/vision.py);
* the timing loop runs once per group, size-1 groups without arithmetic on arrays;
* with an execution the wall clock follows simulate's rule (_WallClock): dummies, barriers and
  reductions under ZeRO-2 and DDP; under FSDP2 and ZeRO-3 (parameters sharded) every wave
  runs its pass sequence, each pass at least its parameter communication, through the same
  sharded.ShardedPasses the simulator uses, so balancers see what an extra wave costs.

Nothing here has a cost formula of its own beyond re-arranging CostModel's; the test suite
checks pricing against `simulate` on random valid plans and every balancer's plans.
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Sequence, Tuple

import numpy as np

from hf_cp.balance.toolkit.costs import CostMemo, cost_memo
from hf_cp.cost.hardware import transfer_ms
from hf_cp.cost.model import CostModel, RankCost
from hf_cp.cost.sharded import ShardedPasses
from hf_cp.cost.simulate import IDLE_MEMBER, chunked_group_calls, chunked_group_cost, group_costs, wave_reductions
from hf_cp.cost.vision import group_vision, samples_vision_ms
from hf_cp.modes import ring
from hf_cp.modes.registry import mode_spec
from hf_cp.plan.step_plan import Group, StepPlan


class PlanPricer:
    """Predicted makespan of StepPlans under one CostModel (see the module docstring)."""

    def __init__(self, cost: CostModel, memo: CostMemo | None = None):
        self.cost = cost
        self.memo = memo or cost_memo(cost)
        d, p = cost.dims, cost.profile
        self.layers = d.num_layers
        self.c1, self.c2, self.head = cost.c1, cost.c2, cost.head_ms_per_token
        self.overhead_ms = cost.micro_batch_overhead_ms()
        self.cp_attention_scale = p.cp_attention_scale
        self.execution = getattr(cost, "execution", None)  # wall clock: simulate.simulate's execution rule
        self.kv_bytes_per_token = 2 * d.num_kv_heads * d.head_dim * p.bytes_per_element * d.softmax_share
        self.gpus_per_node = p.gpus_per_node
        qs = [q for q, _ in p.chunk_efficiency]
        self._eff_q = np.asarray(qs, dtype=np.float64)
        self._eff_v = np.asarray([e for _, e in p.chunk_efficiency], dtype=np.float64)
        self._eff_logq = np.log(self._eff_q) if qs else self._eff_q
        self._per_doc: Dict[Tuple[int, int], Tuple[np.ndarray, np.ndarray]] = {}
        # masked groups' member costs by what decides them (group_costs): auto prices every
        # member's plan, whose groups repeat the base plan's, a member's own checks and the
        # other members' (magi's and usp's untouched groups are dynamic_cp's)
        self._groups: Dict[tuple, list] = {}

    # ------------------------------------------------------------------ cost pieces
    def efficiency(self, q_len: np.ndarray) -> np.ndarray:
        """CostModel.chunk_efficiency of every entry (log-linear interpolation of the table)."""
        q = np.asarray(q_len, dtype=np.float64)
        qs, es = self._eff_q, self._eff_v
        if not len(qs):
            return np.ones_like(q)
        out = np.full(q.shape, es[-1])
        low = q <= qs[0]
        out[low] = es[0] * np.maximum(q[low], 1.0) / qs[0]
        mid = ~low & (q < qs[-1])
        if mid.any():
            qm = q[mid]
            i = np.searchsorted(qs, qm, side="right")
            lq0, lq1 = self._eff_logq[i - 1], self._eff_logq[i]
            t = (np.log(qm) - lq0) / (lq1 - lq0)
            out[mid] = es[i - 1] + t * (es[i] - es[i - 1])
        return out

    def segment_attention(self, start: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Per-layer attention ms of query segments (CostModel._segments_attention_ms, per segment)."""
        start = np.asarray(start, dtype=np.int64)
        length = np.asarray(length, dtype=np.int64)
        pairs = length * start + length * (length + 1) // 2
        return self.c2 * pairs.astype(np.float64) / self.efficiency(length)

    def per_doc_table(self, length: int, group_size: int) -> Tuple[np.ndarray, np.ndarray]:
        """(tokens, per-layer attention ms) of every member when one document is split in 2g
        parts, member m holding parts m and 2g-1-m (ring.per_doc_segments)."""
        key = (length, group_size)
        v = self._per_doc.get(key)
        if v is None:
            start, size = ring.part_arrays(length, group_size)
            attn = self.segment_attention(start, size)
            v = self._per_doc[key] = (ring.member_sums(size), ring.member_sums(attn))
        return v

    def zigzag_members(self, doc_lengths: Sequence[int], group_size: int) -> Tuple[np.ndarray, np.ndarray]:
        """(tokens, per-layer attention ms) of every member of a zigzag-split packed sequence."""
        g = group_size
        lens = np.asarray(doc_lengths, dtype=np.int64)
        sizes = ring.part_arrays(int(lens.sum()), g)[1]
        chunk_bounds = np.concatenate(([0], np.cumsum(sizes)))
        doc_bounds = np.concatenate(([0], np.cumsum(lens)))
        cuts = np.union1d(chunk_bounds, doc_bounds)
        begin, end = cuts[:-1], cuts[1:]
        doc = np.searchsorted(doc_bounds, begin, side="right") - 1
        chunk = np.searchsorted(chunk_bounds, begin, side="right") - 1
        attn = self.segment_attention(begin - doc_bounds[doc], end - begin)
        chunk_attn = np.bincount(chunk, weights=attn, minlength=2 * g)
        return ring.member_sums(sizes), ring.member_sums(chunk_attn)

    def distributed_member_ms(self, doc_lengths: Sequence[int], mode: str, ranks: Sequence[int]) -> np.ndarray:
        """Every member's time (compute + unhidden communication, overhead excluded) for the
        distributed documents of one micro-batch; CostModel.distributed_rank_cost's total_ms."""
        return self.distributed_member_times(doc_lengths, mode, ranks)[0]

    def distributed_member_times(
        self, doc_lengths: Sequence[int], mode: str, ranks: Sequence[int]
    ) -> Tuple[np.ndarray, np.ndarray]:
        """(total, compute alone) of every member: distributed_member_ms, and its compute part.
        `mode`: a registered mode name (or a ShardMode member)."""
        g = len(ranks)
        spec = mode_spec(mode)
        if spec.ring_split == "zigzag":
            tok, attn = self.zigzag_members(doc_lengths, g)
        elif spec.ring_split != "per_doc":  # Ulysses, blocks and any other mode: the cost model itself
            costs = self.cost.distributed_rank_costs(doc_lengths, mode, ranks, range(g))
            return (
                np.asarray([c.total_ms for c in costs], dtype=np.float64),
                np.asarray([c.compute_ms for c in costs], dtype=np.float64),
            )
        else:
            tables = [self.per_doc_table(n, g) for n in doc_lengths]
            if len(tables) == 1:
                tok, attn = tables[0]
            else:
                tok = np.sum([t for t, _ in tables], axis=0)
                attn = np.sum([a for _, a in tables], axis=0)
        L = self.layers
        if g > 1:  # attention spread over a group: the profile's factor (CostModel._rank_cost)
            attn = attn * self.cp_attention_scale
        ms = L * (self.c1 * tok + attn) + self.head * tok
        compute = ms
        if g > 1:
            total = int(sum(doc_lengths))
            nxt = np.roll(tok, -1)
            sent = (2 * (total - nxt) + total) * self.kv_bytes_per_token  # ring.ring_bytes_per_layer, every member
            link = self.cost.link_for(ranks)
            messages = spec.comm_messages(g)  # a ring's 3(g-1): K/V forward, again in backward, dK/dV home
            comm = transfer_ms(sent, link, messages)
            # the exchange's per-message cost, which compute does not hide (CostModel._rank_cost)
            ms = ms + L * (np.maximum(0.0, comm - attn) + self.cost.exchange_sync_ms(messages))
            # a hybrid's linear-time layers on a distributed document (CostModel.spread_linear_layers)
            mix_ms, mix_comm, _ = self.cost.spread_linear_layers(total, tok, g, link)
            compute = compute + mix_ms
            ms = ms + mix_ms + mix_comm
        return ms, compute

    def group_costs(self, lens: Dict[int, int], group: Group, masks: Dict) -> list:
        """simulate.group_costs(lens, group, cost, masks) of a group without vision work, kept
        per (ranks, samples with their lengths and masks, mode, local lists, block layout):
        the same values, computed once (do not modify the list). A group of local samples
        alone is priced as the causal path prices them: each member the sum of its samples'
        single-rank times, kept per length and per mask (CostMemo; the cost model's sum, to
        rounding: a DPO-pair step at 64 ranks has 34 masked samples a rank)."""
        if not group.distributed:
            out = []
            memo = self.memo
            for r in group.ranks:
                sids = group.local.get(r, ())
                if not sids:
                    out.append(IDLE_MEMBER)
                    continue
                ms, tokens = 0.0, 0
                for s in sids:
                    n, mask = lens[s], masks.get(s)
                    ms += memo.local_ms(n) if mask is None else memo.doc_on_group_ms(n, 1, mask)
                    tokens += n
                out.append(RankCost(compute_ms=ms, comm_ms=0.0, comm_bytes=0, tokens=tokens))
            return out
        sids = [*group.distributed, *(s for v in group.local.values() for s in v)]
        key = (
            group.ranks,
            group.mode,
            tuple(group.distributed),
            tuple((r, tuple(v)) for r, v in group.local.items()),
            group.blocks,
            tuple((lens[s], masks.get(s)) for s in sids),
        )
        v = self._groups.get(key)
        if v is None:
            if len(self._groups) >= _GROUP_CACHE_SIZE:
                self._groups.clear()
            v = self._groups[key] = group_costs(lens, group, self.cost, masks)
        return v

    # ------------------------------------------------------------------ plans
    def rank_finish_ms(self, plan: StepPlan) -> np.ndarray:
        """When every rank ends its last micro-batch, by simulate's timing rule: a group's
        members start together when the last of them is free, the micro-batch takes its
        slowest member's time plus one overhead, members with no tokens in a group without
        distributed documents are not held."""
        if plan.masks or plan.chunked_samples:  # masked samples (their area), chunked ones: the cost model's own path
            return self._finish_by_cost_model(plan)
        ids = np.asarray(plan.sample_ids, dtype=np.int64)
        by_id = np.argsort(ids, kind="stable")
        sorted_ids = ids[by_id]
        lens = np.asarray(plan.lengths, dtype=np.int64)
        local_ms = self.memo.step_local_ms(plan.lengths)

        # pass 1: every local list's samples, flattened, labelled with its slot
        flat: List[int] = []
        slot_of: List[int] = []
        slots: List[Tuple[int, int]] = []  # (group number, member)
        groups = [g for wave in plan.waves for g in wave.groups]
        for k, g in enumerate(groups):
            for r, sids in g.local.items():
                if sids:
                    slot_of.extend([len(slots)] * len(sids))
                    slots.append((k, g.ranks.index(r) if g.size > 1 else 0))
                    flat.extend(sids)
        slot_ms = np.zeros(len(slots))
        slot_tok = np.zeros(len(slots), dtype=np.int64)
        if flat:
            pos = by_id[np.searchsorted(sorted_ids, np.asarray(flat, dtype=np.int64))]
            labels = np.asarray(slot_of, dtype=np.int64)
            slot_ms = np.bincount(labels, weights=local_ms[pos], minlength=len(slots))
            slot_tok = np.bincount(labels, weights=lens[pos], minlength=len(slots)).astype(np.int64)
        # a local list's images and clips are encoded on its rank (cost/vision.py); in a group with
        # distributed samples group_vision splits the group's items over its members instead
        slot_vision = np.zeros(len(slots))
        if plan.vision and flat:
            vision_ms = samples_vision_ms(plan.sample_ids, plan.vision, self.cost)
            slot_vision = np.bincount(labels, weights=vision_ms[pos], minlength=len(slots))
        slot_ms_l, slot_tok_l = slot_ms.tolist(), slot_tok.tolist()
        slot_local_l = (slot_ms + slot_vision).tolist()  # a local-only group's member: text and vision
        group_slots: Dict[int, List[Tuple[int, int]]] = {}
        for s, (k, m) in enumerate(slots):
            group_slots.setdefault(k, []).append((m, s))

        # pass 2: the timing rule, group by group in wave order
        clock = [0.0] * plan.world_size
        overhead = self.overhead_ms
        length_of = None
        wall = _WallClock(self.cost, plan) if self.execution is not None else None
        wave_of = [w for w, wave in enumerate(plan.waves) for _ in wave.groups]
        for k, g in enumerate(groups):
            if wall is not None:
                wall.enter_wave(wave_of[k], clock)
            mine = group_slots.get(k, ())
            if not g.distributed:
                if not mine:
                    continue  # an empty group issues nothing
                if g.size == 1:
                    r = g.ranks[0]
                    clock[r] = clock[r] + slot_local_l[mine[0][1]] + overhead
                    if wall is not None:
                        wall.worked(r, slot_local_l[mine[0][1]], slot_local_l[mine[0][1]] + overhead)
                    continue
                start = max(clock[r] for r in g.ranks)
                dur = max(slot_local_l[s] for _, s in mine if slot_tok_l[s]) if mine else 0.0
                end = start + dur + overhead
                for m, s in mine:
                    if slot_tok_l[s]:
                        clock[g.ranks[m]] = end
                        if wall is not None:
                            wall.worked(g.ranks[m], slot_local_l[s], dur + overhead)
                continue
            if length_of is None:
                length_of = dict(zip(plan.sample_ids, plan.lengths))
            tabled = bool(mode_spec(g.mode).ring_split)  # a ring split the tables above reproduce
            if tabled and not (mine and self.cp_attention_scale != 1.0):
                member, member_compute = self.distributed_member_times(
                    [length_of[s] for s in g.distributed], g.mode, g.ranks
                )
                for m, s in mine:
                    member[m] += slot_ms_l[s]
                    member_compute[m] += slot_ms_l[s]
                if plan.vision:
                    encoders = np.asarray([v.ms for v in group_vision(g, plan.vision, self.cost)])
                    member, member_compute = member + encoders, member_compute + encoders
            else:  # every other mode (Ulysses, blocks), and local documents scaled in a group: the cost model
                costs = group_costs(length_of, g, self.cost, vision=plan.vision)
                member = np.asarray([c.total_ms for c in costs])
                member_compute = np.asarray([c.compute_ms for c in costs])
            start = max(clock[r] for r in g.ranks)
            dur = float(member.max()) + overhead
            end = start + dur
            for m, r in enumerate(g.ranks):
                clock[r] = end
                if wall is not None:
                    wall.worked(r, float(member_compute[m]), dur)
        if wall is not None:
            return wall.finish(clock, len(plan.waves))
        return np.asarray(clock)

    def _finish_by_cost_model(self, plan: StepPlan) -> np.ndarray:
        """rank_finish_ms by simulate.group_costs for every group (plans with masked, chunked or vision samples)."""
        lens = plan.length_of()
        clock = [0.0] * plan.world_size
        overhead = self.overhead_ms
        wall = _WallClock(self.cost, plan) if self.execution is not None else None
        for w, wave in enumerate(plan.waves):
            if wall is not None:
                wall.enter_wave(w, clock)
            for g in wave.groups:
                if any(g.chunked.values()):  # one rank running dependent chunks: as simulate.simulate
                    ms = chunked_group_cost(lens, g, self.cost, plan.vision)[0]
                    clock[g.ranks[0]] += ms
                    if wall is not None:
                        wall.worked_chunked(lens, g, ms)
                    continue
                if plan.vision:
                    costs = group_costs(lens, g, self.cost, plan.masks, plan.vision)
                else:
                    costs = self.group_costs(lens, g, plan.masks or {})
                if all(c.tokens == 0 for c in costs):
                    continue
                dur = max(c.total_ms for c in costs) + overhead
                end = max(clock[r] for r in g.ranks) + dur
                for c, r in zip(costs, g.ranks):
                    if c.tokens or g.distributed:
                        clock[r] = end
                        if wall is not None:
                            wall.worked(r, c.compute_ms, dur)
        if wall is not None:
            return wall.finish(clock, len(plan.waves))
        return np.asarray(clock)

    def makespan_ms(self, plan: StepPlan) -> float:
        """The plan's predicted step time (simulate(plan, cost).makespan_ms, to rounding)."""
        clock = self.rank_finish_ms(plan)
        fixed = self.cost.profile.step_overhead_ms if self.execution is not None else 0.0
        return (float(clock.max()) if len(clock) else 0.0) + fixed


class _WallClock:
    """simulate.simulate's execution rule (hf_cp/cost/execution.py) on a pricing loop's clocks.

    Replicated parameters (ZeRO-2, DDP): at every wave's end every rank pads to the wave's
    backward count with dummy micro-batches (none worked: one; a chunked sample: one per
    dependent chunk) and, when waves synchronise (or at the last wave), all wait for the slowest
    and the gradient reductions (one per backward pass when waves synchronise).

    Sharded parameters (FSDP2, ZeRO-3): every pass re-gathers the parameters, so a wave's time
    is not its slowest rank's compute but its pass sequence's (sharded.ShardedPasses, the
    simulator's own rule): each pass lasts at least its communication, dummy passes included,
    and every wave the plan adds pays that again. The loop's clocks only collect each rank's own
    passes; the wave then ends for all at its start plus ShardedPasses.wave's wall time."""

    def __init__(self, cost: CostModel, plan: StepPlan):
        self.cost, self.world = cost, plan.world_size
        self.ex = cost.execution
        # one ShardedPasses per plan: its pass sequences (StepPlan.wave_passes) are the plan's
        self.sharded = ShardedPasses(plan, cost) if self.ex.shards_parameters else None
        self.dummy = cost.dummy_micro_batch_ms()
        self.wave = -1
        self.wave_start = 0.0
        self.calls = [0] * self.world
        self.own_ms: List[List[float]] = [[] for _ in range(self.world)]
        self.chunked = False
        self.slowest = 0.0

    def worked(self, rank: int, compute_ms: float, duration_ms: float) -> None:
        """`rank` ran a micro-batch: `compute_ms` its own compute (what can hide a reduction),
        `duration_ms` its group's time with the overhead (what its passes take when sharded)."""
        self.calls[rank] = max(self.calls[rank], 1)
        self.slowest = max(self.slowest, compute_ms)
        if self.sharded is not None:
            self.own_ms[rank] = self.sharded.micro_batch_ms(duration_ms)

    def worked_chunked(self, lens: Dict[int, int], group: Group, compute_ms: float) -> None:
        """A one-rank group of chunked samples ran, taking `compute_ms`: one backward per
        dependent chunk, or, when sharded, ChunkFlow's own passes."""
        rank = group.ranks[0]
        self.calls[rank] += chunked_group_calls(lens, group)
        self.chunked = True
        self.slowest = max(self.slowest, compute_ms)
        if self.sharded is not None:
            self.own_ms[rank] = self.sharded.chunked_ms(group, rank)

    def _end_wave(self, clock: List[float], last: bool) -> None:
        if self.sharded is not None:
            # every rank runs the wave's passes from the barrier that started it to their end
            clock[:] = [self.wave_start + self.sharded.wave(self.wave, self.own_ms).wall_ms] * self.world
            self.own_ms = [[] for _ in range(self.world)]
            return
        n_calls = max(1, max(self.calls)) + (1 if last and self.chunked else 0)
        for r in range(self.world):
            clock[r] += (n_calls - self.calls[r]) * self.dummy
        k = wave_reductions(n_calls, self.ex.waves_synchronise, last)
        if k:
            red = k * self.cost.gradient_reduction_ms(self.world, hidden_behind_ms=self.slowest * 2 / 3 / k)
            top = max(clock) + red
            clock[:] = [top] * self.world
        self.calls = [0] * self.world
        self.chunked = False
        self.slowest = 0.0

    def enter_wave(self, wave: int, clock: List[float]) -> None:
        while self.wave < wave:  # waves before this one (empty ones included) end first
            if self.wave >= 0:
                self._end_wave(clock, last=False)
            self.wave += 1
            self.wave_start = max(clock)

    def finish(self, clock: List[float], n_waves: int) -> np.ndarray:
        if n_waves:
            self.enter_wave(n_waves - 1, clock)
            self._end_wave(clock, last=True)
        return np.asarray(clock)


# masked groups a pricer keeps (PlanPricer.group_costs): a 64-rank step's members price a few
# hundred; the cache is emptied when full
_GROUP_CACHE_SIZE = 8192
_PRICERS: weakref.WeakKeyDictionary[CostModel, PlanPricer] = weakref.WeakKeyDictionary()


def pricer_for(cost: CostModel) -> PlanPricer:
    """The shared PlanPricer of a CostModel (kept, with its tables, as long as the model lives)."""
    p = _PRICERS.get(cost)
    if p is None:
        p = _PRICERS[cost] = PlanPricer(cost)
    return p


def lower_bound_from_local_ms(local_ms: np.ndarray, world_size: int, largest_group: int) -> float:
    """cost.bounds.lower_bound_ms from the samples' single-rank times (CostMemo.local_ms_array)."""
    if not len(local_ms):
        return 0.0
    return max(float(local_ms.sum()) / world_size, float(local_ms.max()) / largest_group)
