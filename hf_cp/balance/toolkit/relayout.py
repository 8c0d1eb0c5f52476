"""A CP group's layout, chosen by cost: fixed geometries or solved block placements.

Any balancer that distributes documents over a group can ask `choose_layout` for the layout
the cost model predicts fastest among (families):

  ring     ring zigzag of the packed sequence and per-document sharding (modes/ring.py);
  ulysses  Ulysses' contiguous split with an all-to-all over heads (when the heads allow);
  magi     MagiAttention's dispatch (magi_dispatch.py): equal windows placed by masked area, K/V
           moving only where needed; windows of T / (k g) tokens for k in `magi_windows`;
  usp      Ulysses x ring (usp_layout.py) for every u x r = g with u dividing the heads, ring part
           zigzag or per-document; u = 1 is the ring geometry with K/V sent only where
           needed, u = g Ulysses as blocks.

Every candidate is priced by the same cost model the simulator uses (CostModel for the
whole-document modes, cost.blocks.block_group_costs for placements: masked areas, kernel
efficiency of the query chunk length, head-split overhead, exchange bytes over the group's
link), with the samples' masks, and must fit the memory cap (received K/V and Q rows counted
as StepPlan.validate counts them). The slowest member decides; on ties the earlier family
wins, so a plan only changes where a placement is predicted faster. Block families are
tried on groups of at most `max_block_group` ranks (their pricing grows with the square of
the chunks, and so would planner time).

`relayout(plan, request)` applies the choice to every distributed group of a plan: the
predicted step time can only go down (a group's members start no later and end no later).
The `magi` and `usp` balancers are a base balancer's plan relaid out with those families.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from hf_cp.balance.base import PlanRequest
from hf_cp.balance.registry import get_balancer
from hf_cp.balance.toolkit.magi_dispatch import magi_chunks, magi_placement
from hf_cp.balance.toolkit.placement import (
    executed_attention_ms,
    owned_tokens,
    request_masks,
    sample_slices,
)
from hf_cp.balance.toolkit.usp_layout import (
    RING_LAYOUTS,
    usp_chunk_pairs,
    usp_chunks,
    usp_factorisations,
    usp_placement,
)
from hf_cp.balance.toolkit.vision_memory import fit_vision_memory
from hf_cp.cost.blocks import block_group_costs
from hf_cp.cost.model import CostModel, segments_builder
from hf_cp.modes.segments import ShardMode, masked_doc_pairs, segment_tokens
from hf_cp.plan.block_layout import BlockLayout, received_token_equivalent
from hf_cp.plan.step_plan import Group, StepPlan, Wave
from hf_cp.samples.masks import SampleMask

FAMILIES = ("ring", "ulysses", "magi", "usp")


@dataclass(frozen=True)
class LayoutChoice:
    name: str  # e.g. "ring_zigzag", "ulysses", "magi:8", "usp:2x4:zigzag"
    mode: ShardMode
    layout: Optional[BlockLayout]  # mode BLOCKS only
    ms: float  # the slowest member's predicted time (compute + unhidden communication)


@dataclass(frozen=True)
class LayoutOptions:
    families: Tuple[str, ...] = FAMILIES
    magi_windows: Tuple[int, ...] = (2, 4)  # windows per member tried
    max_block_group: int = 8
    usp_ring_layouts: Tuple[str, ...] = RING_LAYOUTS

    def __post_init__(self):
        bad = [f for f in self.families if f not in FAMILIES]
        if bad:
            raise ValueError(f"layout families {bad} unknown; choose from {FAMILIES}")
        bad = [r for r in self.usp_ring_layouts if r not in RING_LAYOUTS]
        if bad:
            raise ValueError(f"usp ring layouts {bad} unknown; choose from {RING_LAYOUTS}")


def _candidates(cost: CostModel, doc_lengths, masks, g: int, opt: LayoutOptions, local, local_masks):
    """(name, mode, None) of the whole-document geometries, then (name, BLOCKS, (bound, build))
    of the placements: `bound` the slowest member's computation under it (slowest_member_bound_ms,
    a lower bound of its time), `build()` the placement."""
    H = cost.dims.num_heads
    if "ring" in opt.families:
        yield "ring_per_doc", ShardMode.RING_PER_DOC, None
        yield "ring_zigzag", ShardMode.RING_ZIGZAG, None
    if "ulysses" in opt.families:
        try:
            cost.check_ulysses(g)
            yield "ulysses", ShardMode.ULYSSES, None
        except ValueError:
            pass
    if g > opt.max_block_group:
        return
    slices = sample_slices(doc_lengths, masks)
    total = sum(doc_lengths)
    if "magi" in opt.families:
        seen = set()
        for k in opt.magi_windows:
            chunk = max(1, -(-total // (k * g)))
            if chunk in seen:
                continue
            seen.add(chunk)
            # bounded from its dispatched windows alone, built only when the bound can win
            chunks, pairs = magi_chunks(doc_lengths, g, chunk, slices)
            bound = slowest_member_bound_ms(
                cost, owned_tokens(chunks, g), executed_attention_ms(cost, chunks, pairs, g), local, local_masks
            )

            def build_magi(chunk=chunk, chunks=chunks):
                return magi_placement(doc_lengths, g, chunk, H, doc_slices=slices, chunks=chunks)

            yield f"magi:{k}", ShardMode.BLOCKS, (bound, build_magi)
    if "usp" in opt.families:
        for u, r in usp_factorisations(g, H):
            for ring in opt.usp_ring_layouts if r > 1 else ("zigzag",):
                # bounded from its chunks alone: most factorisations are ruled out unbuilt
                chunks = usp_chunks(doc_lengths, u, r, ring)
                attn = executed_attention_ms(cost, chunks, usp_chunk_pairs(chunks, doc_lengths, slices), g, u)
                bound = slowest_member_bound_ms(cost, owned_tokens(chunks, g), attn, local, local_masks)

                def build(u=u, r=r, ring=ring, chunks=chunks):
                    return usp_placement(doc_lengths, u, r, H, ring_layout=ring, doc_slices=slices, chunks=chunks)

                yield f"usp:{u}x{r}:{ring}", ShardMode.BLOCKS, (bound, build)


def slowest_member_bound_ms(
    cost: CostModel,
    tokens: Sequence[int],
    attn: Sequence[float],
    local: Mapping[int, Sequence[int]],
    local_masks: Mapping[int, Sequence[Optional[SampleMask]]],
) -> float:
    """The slowest member's computation, all layers, from the rows it owns (`tokens`), the
    attention it executes per layer (`attn`) and its local samples."""
    L = cost.dims.num_layers
    out = 0.0
    for m in range(len(tokens)):
        lens = list(local.get(m, ()))
        lm = list(local_masks.get(m, ())) + [None] * len(lens)
        t = tokens[m] + sum(lens)
        local_attn = sum(cost.c2 * masked_doc_pairs(n, lm[i]) / cost.chunk_efficiency(n) for i, n in enumerate(lens))
        out = max(out, L * (cost.c1 * t + local_attn + attn[m]) + cost.head_ms_per_token * t)
    return out


def choose_layout(
    cost: CostModel,
    doc_lengths: Sequence[int],
    ranks: Sequence[int],
    cap: int,
    masks: Optional[Sequence[Optional[SampleMask]]] = None,
    local: Optional[Mapping[int, Sequence[int]]] = None,
    local_masks: Optional[Mapping[int, Sequence[Optional[SampleMask]]]] = None,
    options: Optional[LayoutOptions] = None,
) -> Optional[LayoutChoice]:
    """The fastest layout that fits (None if none does) of documents distributed over `ranks`,
    with `local` (member -> lengths) alongside on their members. See the module docstring."""
    opt = options or LayoutOptions()
    g = len(ranks)
    local = {m: list(v) for m, v in (local or {}).items()}
    local_masks = {m: list(v) for m, v in (local_masks or {}).items()}
    local_tokens = [sum(local.get(m, ())) for m in range(g)]
    masks = list(masks) if masks is not None else [None] * len(doc_lengths)
    best: Optional[LayoutChoice] = None
    placements = []
    for name, mode, placement in _candidates(cost, doc_lengths, masks, g, opt, local, local_masks):
        if placement is not None:  # priced below, cheapest bound first
            placements.append((placement[0], name, placement[1]))
            continue
        segments_of = segments_builder(mode, doc_lengths, g)  # every member's share built once
        tokens = [segment_tokens(segments_of(m)) + local_tokens[m] for m in range(g)]
        if max(tokens) > cap:
            continue
        costs = [
            cost.distributed_rank_cost(
                doc_lengths, mode, ranks, m, local.get(m, ()), masks, local_masks.get(m), segments_of
            )
            for m in range(g)
        ]
        ms = max(c.total_ms for c in costs)
        if best is None or ms < best.ms - 1e-9:
            best = LayoutChoice(name, mode, None, ms)
    for bound, name, build in sorted(placements, key=lambda x: x[0]):
        if best is not None and bound >= best.ms - 1e-9:
            break  # its computation alone is no faster: neither is any later candidate
        pl = build()
        layout = pl.to_layout()
        if any(
            layout.member_tokens(m) + local_tokens[m] + received_token_equivalent(layout, m, cost) > cap
            for m in range(g)
        ):
            continue
        areas = [b.pairs for b in pl.compute]  # counted when the placement was built
        costs = block_group_costs(layout, doc_lengths, ranks, cost, masks, local, local_masks, areas)
        ms = max(c.total_ms for c in costs)
        if best is None or ms < best.ms - 1e-9:
            best = LayoutChoice(name, ShardMode.BLOCKS, layout, ms)
    return best


def relayout(plan: StepPlan, req: PlanRequest, options: Optional[LayoutOptions] = None) -> StepPlan:
    """`plan` with every group that distributes documents over several ranks given the layout
    choose_layout predicts fastest (the group's own layout when nothing beats it). The plan
    carries the request's masks; its balancer name is unchanged."""
    masks = request_masks(req)
    lens = plan.length_of()
    cap = plan.max_tokens_per_rank
    out = StepPlan(
        world_size=plan.world_size,
        max_tokens_per_rank=cap,
        sample_ids=list(plan.sample_ids),
        lengths=list(plan.lengths),
        step=plan.step,
        balancer=plan.balancer,
        masks={s: m for s, m in masks.items() if s in lens},
        vision=dict(plan.vision),
    )
    for wave in plan.waves:
        groups: List[Group] = []
        for g in wave.groups:
            if not g.distributed or g.size == 1:
                groups.append(_copy_group(g))
                continue
            dist = [lens[s] for s in g.distributed]
            local = {m: [lens[s] for s in g.local.get(r, [])] for m, r in enumerate(g.ranks)}
            local_masks = {m: [masks.get(s) for s in g.local.get(r, [])] for m, r in enumerate(g.ranks)}
            choice = choose_layout(
                req.cost, dist, g.ranks, cap, [masks.get(s) for s in g.distributed], local, local_masks, options
            )
            if choice is None or (choice.mode == g.mode and choice.layout is None):
                groups.append(_copy_group(g))
                continue
            groups.append(
                Group(
                    ranks=g.ranks,
                    distributed=list(g.distributed),
                    mode=choice.mode,
                    local=g.local,
                    blocks=choice.layout,
                )
            )
        out.waves.append(Wave(groups))
    return out


def _copy_group(g: Group) -> Group:
    """A group as the base plan has it, with lists of its own: a base plan is shared by the
    balancers relaid out from it (RelayoutBalancer._base_plan), and their plans must not share
    what a caller may change."""
    out = Group.__new__(Group)  # the fields as they are: no conversion to redo (copy.copy is 5x slower)
    out.__dict__.update(g.__dict__)
    out.distributed = list(g.distributed)
    out.local = {r: list(v) for r, v in g.local.items()}
    out.chunked = {r: list(v) for r, v in g.chunked.items()} if g.chunked else {}
    return out


# the last base plan made (a weak reference to its request, the base balancer's class and
# options, the plan): `magi` and `usp` (and any RelayoutBalancer) in one `auto` plan the same
# request from the same base, and the base plan is a third of magi's CPU on a GRPO-like step;
# relayout never changes it. Dropped with its request: a step's plan and cost model kept alive
# past their step made every garbage collection after it longer.
_last_base: Optional[Tuple[weakref.ref, tuple, StepPlan]] = None


def _forget_base(ref: weakref.ref) -> None:
    global _last_base
    last = _last_base
    if last is not None and last[0] is ref:
        _last_base = None


class RelayoutBalancer:
    """A base balancer's plan, every distributed group relaid out (relayout) with `families`."""

    name = ""
    # masked samples are priced by their masked area when a group is laid out (the base
    # balancer groups them by its own, causal, cost)
    handles_masks = True
    families: Tuple[str, ...] = FAMILIES

    def __init__(self, base: str = "dynamic_cp", base_options: Optional[Dict] = None, **layout_options):
        if base in ("magi", "usp", "auto"):
            raise ValueError(f"{self.name}: base balancer {base!r} would plan recursively; pick a whole-document one")
        self.base = get_balancer(base, **dict(base_options or {}))
        layout_options.setdefault("families", self.families)
        self.options = LayoutOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in layout_options.items()})

    def plan(self, req: PlanRequest) -> StepPlan:
        plan = relayout(self._base_plan(req), req, self.options)
        plan.balancer = self.name
        return fit_vision_memory(plan, req)  # a layout's cap check does not count the encoders

    def _base_plan(self, req: PlanRequest) -> StepPlan:
        """The base balancer's plan of `req`, the last one made when the same request was
        planned by a base of the same class and options (a base whose plans depend on timing is
        always asked again)."""
        global _last_base
        base = self.base
        key = (type(base), getattr(base, "options", None))
        last = _last_base  # one read: another thread may replace it
        if last is not None and last[0]() is req and last[1] == key:
            return last[2]
        plan = base.plan(req)
        if key[1] is not None and not getattr(base, "timing_dependent", False):
            _last_base = (weakref.ref(req, _forget_base), key, plan)
        return plan


__all__ = ["LayoutChoice", "LayoutOptions", "RelayoutBalancer", "choose_layout", "relayout"]
