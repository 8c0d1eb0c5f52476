"""Which member of a CP group encodes each image or clip of its distributed samples.

Every item is encoded once, on one member; its embedding rows then go to the members that hold
its placeholder tokens. A local sample's items are encoded by the rank that holds the sample.
An item of a distributed sample goes, largest first, to the member with the least encoder work
so far (its local items included), ties broken towards the member that holds most of the
item's tokens (fewest rows sent), then the lowest member. A pure function of plain numbers:
every member computes the same answer from the same plan and data, so no rank disagrees.
"""

from __future__ import annotations

from typing import List, Sequence


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
