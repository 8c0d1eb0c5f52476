"""Fitting a plan's vision memory: every rank within the cap with the activations of the images
and clips it encodes counted (StepPlan.held_tokens, the count StepPlan.validate checks).

A balancer that plans the encoders' memory itself (dynamic_cp, flexsp: cp_candidates) leaves
nothing to do here. For the others, which pack by tokens alone, `fit_vision_memory` moves what
overflows, group by group, and leaves every other group as it was:

1. a member over the cap gives up its local samples, largest first, until it fits (or has none
   left);
2. a group still over the cap gives up its distributed samples, each then planned alone;
3. the given-up local samples of a rank are packed first fit decreasing by what each holds of
   its rank (PlanRequest.memory_length_array) into micro-batches on that rank; a sample that
   does not fit its rank alone, and every distributed sample given up, runs alone, spread per
   document over the smallest registered aligned block around its rank that holds it
   (cost/vision.smallest_vision_group);
4. the moved work runs in waves after the plan's own (toolkit/waves.WaveBuilder).

The plan gets a note naming what moved. Pure function of the plan and the request.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Tuple

from hf_cp.balance.base import PlanRequest, check_vision_memory
from hf_cp.balance.toolkit.packing import first_fit_sorted
from hf_cp.balance.toolkit.waves import WaveBuilder
from hf_cp.cost.vision import smallest_vision_group
from hf_cp.modes.segments import ShardMode
from hf_cp.plan.step_plan import Group, StepPlan, Wave


def fit_vision_memory(plan: StepPlan, req: PlanRequest) -> StepPlan:
    """`plan` with no rank over the cap (module docstring): the plan itself when none was, else
    a new plan with the overflowing groups' work moved into added waves. Raises
    VisionMemoryError (by PlanRequest's check) for a sample no group holds."""
    if not plan.vision:
        return plan
    cost, cap = req.cost, plan.max_tokens_per_rank
    lens = plan.length_of()
    waves: List[Wave] = []
    loose: Dict[int, List[int]] = {}  # rank -> local samples given up
    spread: List[Tuple[int, int]] = []  # (sample, the first rank of the group it left)
    for wave in plan.waves:
        groups = []
        for g in wave.groups:
            held = plan.held_tokens(g, lens, cost)
            if max(held) <= cap or any(g.chunked.values()):  # chunked groups: ChunkFlow's own check
                groups.append(g)
                continue
            g = _shed(plan, g, lens, req, loose, spread)
            if g is not None:
                groups.append(g)
        waves.append(Wave(groups))
    if not loose and not spread:
        return plan
    moved = WaveBuilder(plan.world_size)
    lengths = dict(zip(req.sample_ids, req.memory_length_array.tolist()))
    alone = []
    for r in sorted(loose):
        fits = sorted((s for s in loose[r] if lengths[s] <= cap), key=lambda s: (-lengths[s], s))
        alone += [(s, r) for s in loose[r] if lengths[s] > cap]
        for ids in first_fit_sorted(fits, [lengths[s] for s in fits], cap) if fits else ():
            moved.add(Group(ranks=(r,), local={r: ids}))
    for s, r in spread + alone:
        size = smallest_vision_group(lens[s], plan.vision.get(s, ()), req.cluster.group_sizes, cap, cost)
        if size is None:
            check_vision_memory(req)  # names the sample and its numbers
            raise ValueError(f"sample {s} fits no registered group")  # a request not checked on creation
        first = min(r - r % size, (plan.world_size - size) // size * size)  # the aligned block around r
        moved.add(Group(ranks=tuple(range(first, first + size)), distributed=[s], mode=ShardMode.RING_PER_DOC))
    added = moved.build()
    names = sorted(s for ids in loose.values() for s in ids) + sorted(s for s, _ in spread)
    out = replace(plan, waves=waves + added, notes=list(plan.notes))
    out.notes.append(
        f"vision memory: samples {names[:8]}{'...' if len(names) > 8 else ''} ({len(names)} in all) moved to "
        f"{len(added)} added wave(s): their ranks were over the cap of {cap} tokens with their images' and "
        f"clips' activations counted"
    )
    return out


def _shed(plan: StepPlan, g: Group, lens, req: PlanRequest, loose, spread):
    """Group `g` without what puts a member over the cap (module docstring, steps 1 and 2), the
    given-up samples recorded in `loose` and `spread`; None when nothing is left of it."""
    cost, cap = req.cost, plan.max_tokens_per_rank
    local = {r: sorted(v, key=lambda s: (-lens[s], s)) for r, v in g.local.items() if v}
    if g.distributed and max(plan.held_tokens(replace(g, local={}), lens, cost)) > cap:
        spread.extend((s, g.ranks[0]) for s in g.distributed)  # over the cap even without locals
        g = Group(ranks=g.ranks)
    while True:
        trial = replace(g, local={r: v for r, v in local.items() if v})
        held = plan.held_tokens(trial, lens, cost)
        over = [r for r, t in zip(g.ranks, held) if t > cap and local.get(r)]
        if not over:
            break
        for r in over:  # its largest local sample goes (a distributed one's encoders may move)
            loose.setdefault(r, []).append(local[r].pop(0))
    if max(held) > cap:
        # over with no locals left: the distributed samples go too, and the locals kept then fit
        # (a member's bound counts its own items, vision_encoders.member_held_patches)
        spread.extend((s, g.ranks[0]) for s in trial.distributed)
        trial = Group(ranks=g.ranks, local=trial.local)
    if not trial.distributed and not any(trial.local.values()):
        return None
    return trial
