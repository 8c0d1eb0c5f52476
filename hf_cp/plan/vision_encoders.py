"""Which member of a CP group encodes each image or clip of its distributed samples.

Every item is encoded once, on one member; its embedding rows then go to the members that hold
its placeholder tokens. A local sample's items are encoded by the rank that holds the sample.
An item of a distributed sample goes, largest first, to the member with the least encoder work
so far (its local items included), ties broken towards the member that holds most of the
item's tokens (fewest rows sent), then the lowest member. A pure function of plain numbers:
every member computes the same answer from the same plan and data, so no rank disagrees.

A plan does not know which member holds most of an item's tokens (that depends on where its
placeholders sit in the sample), so it assigns with no tokens held (ties to the lowest member:
member_items) and bounds what each member may encode whatever the tie-breaks
(member_held_patches): the memory a rank is charged for (StepPlan.held_tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Mapping, Optional, Sequence, Tuple

from hf_cp.samples.vision_grids import GridTHW, SampleGrids

if TYPE_CHECKING:  # step_plan, which defines Group, imports this module
    from hf_cp.plan.step_plan import Group


def assign_encoders(
    item_work: Sequence[float],
    tokens_held: Sequence[Sequence[int]],
    member_work: Sequence[float],
) -> List[int]:
    """The encoding member of each item. `item_work[i]`: item i's encoder work (any unit, the
    same for all); `tokens_held[i][m]`: how many of its placeholder tokens member m holds;
    `member_work[m]`: encoder work member m already has (its local samples' items)."""
    load = [float(w) for w in member_work]
    n = len(load)
    if any(len(h) != n for h in tokens_held):
        raise ValueError(f"tokens_held must list {n} members for every item")
    out = [0] * len(item_work)
    for i in sorted(range(len(item_work)), key=lambda i: (-float(item_work[i]), i)):
        m = min(range(n), key=lambda m: (load[m], -int(tokens_held[i][m]), m))
        out[i] = m
        load[m] += float(item_work[i])
    return out


def grid_patches(grid: GridTHW) -> int:
    """Patches of an item of patch grid (t, h, w): the encoder work unit of assign_encoders."""
    t, h, w = grid
    return int(t) * int(h) * int(w)


def group_items(group: Group, grids: Mapping[int, SampleGrids]) -> Tuple[List[List[GridTHW]], List[GridTHW]]:
    """(per member, the items of its local and chunked samples, which it encodes; the items of
    the group's distributed samples, in the order assign_encoders takes them)."""
    own: List[List[GridTHW]] = []
    for r in group.ranks:
        mine = [tuple(g) for s in group.local.get(r, ()) for g in grids.get(s, ())]
        mine += [tuple(g) for c in group.chunked.get(r, ()) for g in grids.get(c.sample, ())]
        own.append(mine)
    spread = [tuple(g) for s in group.distributed for g in grids.get(s, ())]
    return own, spread


def member_items(group: Group, grids: Optional[Mapping[int, SampleGrids]]) -> List[List[GridTHW]]:
    """Per member of `group`, the items it encodes: its own samples' (group_items) and the
    distributed samples' items assign_encoders gives it with no tokens held (ties to the
    lowest member)."""
    if not grids:
        return [[] for _ in group.ranks]
    items, spread = group_items(group, grids)
    if spread:
        work = [sum(grid_patches(g) for g in mine) for mine in items]
        chosen = assign_encoders([grid_patches(g) for g in spread], [[0] * len(items) for _ in spread], work)
        for g, m in zip(spread, chosen):
            items[m].append(g)
    return items


def encoder_patch_bounds(item_patches: Sequence[int], member_patches: Sequence[int]) -> List[int]:
    """Per member, the most patches it may encode under assign_encoders whatever the tokens held
    (`item_patches`: the distributed items'; `member_patches`: what each member encodes of its
    own). The tie-break is all the tokens held change: members tied at the least load may
    trade the item, and every later step is the same up to that exchange (the loads' multiset
    is the same). So a member ends with the load of some member it was tied with, directly or
    through others: the bound is the largest final load among them (tied sets joined, as the
    tie-free run, assign_encoders with no tokens held, meets them)."""
    load = [int(p) for p in member_patches]
    n = len(load)
    parent = list(range(n))

    def root(m: int) -> int:
        while parent[m] != m:
            parent[m] = parent[parent[m]]
            m = parent[m]
        return m

    for i in sorted(range(len(item_patches)), key=lambda i: (-int(item_patches[i]), i)):
        least = min(load)
        tied = [m for m in range(n) if load[m] == least]
        for m in tied[1:]:
            parent[root(m)] = root(tied[0])
        load[tied[0]] += int(item_patches[i])
    top: dict = {}
    for m in range(n):
        r = root(m)
        top[r] = max(top.get(r, 0), load[m])
    return [top[root(m)] for m in range(n)]


def member_held_patches(group: Group, grids: Optional[Mapping[int, SampleGrids]]) -> List[int]:
    """Per member of `group`, the patches whose activations it is charged for: its own items'
    and, where the group spreads items, the most the executor may give it (encoder_patch_bounds)."""
    if not grids:
        return [0] * len(group.ranks)
    own, spread = group_items(group, grids)
    work = [sum(grid_patches(g) for g in mine) for mine in own]
    if not spread:
        return work
    return encoder_patch_bounds([grid_patches(g) for g in spread], work)
