"""Ring layout of a group's distributed documents: the memory fit and the zigzag vs
per-document choice (WLB-LLM's per-sequence vs per-document sharding). Which tokens each
member holds is the ring modes' geometry (hf_cp/modes/ring.py)."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from hf_cp.balance.toolkit.costs import CostMemo, cost_memo
from hf_cp.cost.model import CostModel
from hf_cp.modes import ring
from hf_cp.modes.segments import ShardMode

# Per-document sharding costs O(documents x 2g) to evaluate per member, and the comparison
# runs for every micro-batch of a step. Up to PER_DOC_MAX_DOCS documents (and
# PER_DOC_EVAL_BUDGET document-members) it is evaluated exactly; up to PER_DOC_SUM_DOCS
# documents by the sum of every document's time alone on the group (cached per length:
# exact for compute, an over-estimate of unhidden communication); past that zigzag is taken
# (per-document only if zigzag does not fit): so many documents in one pack are short ones,
# whose per-document query chunks would be tiny and slow anyway.
PER_DOC_MAX_DOCS = 8
PER_DOC_EVAL_BUDGET = 2048
PER_DOC_SUM_DOCS = 64
ZIGZAG_ALL_MEMBERS_BUDGET = 32768  # member x document evaluations for one zigzag prediction
# pick_ring_mode's cache (CostMemo.ring_modes) is emptied past this many choices, so that a
# long run's distinct packs do not pile up
RING_MODE_CACHE_MAX = 1 << 16


def sampled_members(group_size: int) -> List[int]:
    """Members whose cost stands for the group's slowest when comparing modes: all of a small
    group; the two ends and the middle pair of a large one (where zigzag's and per-document
    sharding's remainders and heavy chunks land)."""
    g = group_size
    if g <= 8:
        return list(range(g))
    return sorted({0, 1, g // 2 - 1, g // 2, g - 2, g - 1})


def group_fits(
    mode: ShardMode,
    doc_lengths: Sequence[int],
    group_size: int,
    cap: int,
    local_tokens: Optional[Sequence[int]] = None,
) -> bool:
    """Whether every member holds at most `cap` tokens (its distributed share under the ring
    mode, ring.member_tokens, plus its locals)."""
    t = ring.member_tokens(mode, doc_lengths, group_size)
    if local_tokens is not None:
        t = t + np.asarray(local_tokens, dtype=np.int64)
    return int(t.max()) <= cap


def predicted_group_ms(
    cost: CostModel, mode: ShardMode, doc_lengths: Sequence[int], ranks: Sequence[int], all_members: bool = False
) -> float:
    """Slowest member's time for the distributed documents (CostModel.distributed_rank_cost),
    over every member or the sampled ones (sampled_members). Per-document sharding is
    symmetric, its members nearly equal; zigzag's heavy member can be any."""
    members = range(len(ranks)) if all_members else sampled_members(len(ranks))
    return max(c.total_ms for c in cost.distributed_rank_costs(doc_lengths, mode, ranks, members))


def pick_ring_mode(
    cost: CostModel,
    doc_lengths: Sequence[int],
    ranks: Sequence[int],
    cap: int,
    local_tokens: Optional[Sequence[int]] = None,
    memo: Optional[CostMemo] = None,
) -> ShardMode:
    """WLB-LLM's per-sequence (zigzag) vs per-document choice, within the memory cap.

    Of the modes that fit, the one whose slowest member the cost model predicts faster
    (CostModel.distributed_rank_costs, on sampled members of large groups; per-document
    sharding on ties; locals add the same work under either mode and are left out). Large packs are compared more cheaply or not at all, see
    PER_DOC_MAX_DOCS. Raises ValueError if neither mode fits.

    Without `local_tokens` the choice is kept in the memo (CostMemo.ring_modes): it depends on
    the ranks only through their number and their link (CostModel.link_for), so one key serves
    every aligned block of a size. A pack that fits no mode is not kept and raises each time.
    """
    memo = memo or cost_memo(cost)
    if local_tokens is not None:
        return ring_mode_and_ms(cost, doc_lengths, ranks, cap, local_tokens, memo, estimate=False)[0]
    key = (tuple(doc_lengths), len(ranks), cost.link_for(ranks), cap)
    mode = memo.ring_modes.get(key)
    if mode is None:
        mode = ring_mode_and_ms(cost, doc_lengths, ranks, cap, None, memo, estimate=False)[0]
        if len(memo.ring_modes) >= RING_MODE_CACHE_MAX:
            memo.ring_modes.clear()
        memo.ring_modes[key] = mode
    return mode


def ring_mode_and_ms(
    cost: CostModel,
    doc_lengths: Sequence[int],
    ranks: Sequence[int],
    cap: int,
    local_tokens: Optional[Sequence[int]] = None,
    memo: Optional[CostMemo] = None,
    estimate: bool = True,
    all_members: bool = False,
) -> Tuple[ShardMode, float]:
    """pick_ring_mode's choice and, with `estimate`, the predicted time of the distributed
    documents' slowest member under it (nan without `estimate`). Zigzag is predicted over
    every member with `all_members`, else over the sampled ones; per-document sharding over
    the sampled members, or past PER_DOC_MAX_DOCS by summed per-document times."""
    memo = memo or cost_memo(cost)
    g = len(ranks)
    docs = list(doc_lengths)
    zz_fits = group_fits(ShardMode.RING_ZIGZAG, docs, g, cap, local_tokens)
    if len(docs) == 1 and zz_fits:  # one document: both modes are the same split
        return ShardMode.RING_PER_DOC, memo.doc_on_group_ms(docs[0], g) if estimate else float("nan")
    exact = len(docs) <= PER_DOC_MAX_DOCS and len(docs) * g <= PER_DOC_EVAL_BUDGET
    summed = not exact and len(docs) <= PER_DOC_SUM_DOCS
    pd_fits = (exact or summed or not zz_fits) and group_fits(ShardMode.RING_PER_DOC, docs, g, cap, local_tokens)
    if not pd_fits and not zz_fits:
        raise ValueError(
            f"documents {docs[:8]} ({len(docs)} documents, {sum(docs)} tokens) "
            f"do not fit a group of {g} ranks with cap {cap} in any ring mode"
        )

    def per_doc_ms() -> float:
        if exact:
            return predicted_group_ms(cost, ShardMode.RING_PER_DOC, docs, ranks)
        return sum(memo.doc_on_group_ms(n, g) for n in docs)

    if not (pd_fits and zz_fits):
        if pd_fits:
            return ShardMode.RING_PER_DOC, per_doc_ms() if estimate else float("nan")
        return ShardMode.RING_ZIGZAG, (
            predicted_group_ms(cost, ShardMode.RING_ZIGZAG, docs, ranks, all_members) if estimate else float("nan")
        )
    # both fit and per-document is cheap enough to weigh: the faster (per-document on ties).
    # Zigzag's slowest member can be any, so it is only chosen
    # when every member could be predicted; otherwise per-document sharding, balanced by
    # construction, is the safe choice.
    pd = per_doc_ms()
    if g * len(docs) > ZIGZAG_ALL_MEMBERS_BUDGET:
        return ShardMode.RING_PER_DOC, pd
    # Zigzag is taken only if its slowest member beats per-document sharding, and every
    # member's time bounds the slowest from below: once a sampled member (where zigzag's
    # heavy chunks land) does not beat it, the other members need no prediction.
    sampled = sampled_members(g)
    zz = predicted_group_ms(cost, ShardMode.RING_ZIGZAG, docs, ranks)
    if pd <= zz + 1e-12:
        return ShardMode.RING_PER_DOC, pd
    rest = sorted(set(range(g)) - set(sampled))
    if rest:
        zz = max(zz, max(c.total_ms for c in cost.distributed_rank_costs(docs, ShardMode.RING_ZIGZAG, ranks, rest)))
    return (ShardMode.RING_PER_DOC, pd) if pd <= zz + 1e-12 else (ShardMode.RING_ZIGZAG, zz)
