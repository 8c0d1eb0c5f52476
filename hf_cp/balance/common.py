"""Small pure helpers shared by balancers: cached per-length costs, LPT, packing, wave assembly.

Everything here is deterministic in its arguments (ties break on the lowest index) and
takes its numbers from the CostModel; nothing here has a cost formula of its own.
"""

from __future__ import annotations

import bisect
import heapq
import weakref
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..cost import CostModel
from ..plan import Group, Wave
from ..shard import ShardMode, rank_segments, segment_tokens, split_sizes

if TYPE_CHECKING:
    from .base import PlanRequest


# --------------------------------------------------------------------------- cached costs
class CostMemo:
    """Per-length results of one CostModel, computed once.

    `sample_local_ms` is a few microseconds per call and a step holds up to ~10^5 samples,
    while a trace holds far fewer distinct lengths: caching by length keeps planners at
    numpy speed. Values are exactly the model's, so plans do not depend on the cache state.
    """

    def __init__(self, cost: CostModel):
        self.cost = cost
        self._local: Dict[int, float] = {}
        self._on_group: Dict[Tuple[int, int], float] = {}
        self._member_tokens: Dict[Tuple[int, int], Tuple[int, ...]] = {}
        self.overhead_ms = cost.micro_batch_overhead_ms()

    def local_ms(self, length: int) -> float:
        """Whole-document compute of one sample on one rank (CostModel.sample_local_ms)."""
        v = self._local.get(length)
        if v is None:
            v = self._local[length] = self.cost.sample_local_ms(length)
        return v

    def local_ms_array(self, lengths: np.ndarray) -> np.ndarray:
        """local_ms of every entry of an integer array."""
        uniq, inv = np.unique(lengths, return_inverse=True)
        get = self.local_ms
        return np.fromiter((get(int(n)) for n in uniq.tolist()), dtype=np.float64, count=len(uniq))[inv]

    def doc_on_group_ms(self, length: int, group_size: int) -> float:
        """Slowest member's time of one document alone, per-document sharded over an aligned
        block of `group_size` ranks (micro-batch overhead excluded)."""
        key = (length, group_size)
        v = self._on_group.get(key)
        if v is None:
            if group_size == 1:
                v = self.local_ms(length)
            else:
                ranks = list(range(group_size))
                v = max(
                    c.total_ms
                    for c in self.cost.distributed_rank_costs(
                        [length], ShardMode.RING_PER_DOC, ranks, (0, group_size - 1)
                    )
                )
            self._on_group[key] = v
        return v

    def per_doc_member_tokens(self, length: int, group_size: int) -> Tuple[int, ...]:
        """Tokens each member holds when one document is per-document sharded over the group:
        parts m and 2g-1-m of shard.split_sizes(length, 2g) (shard.per_doc_segments' layout,
        in O(g) instead of calling it for every member)."""
        key = (length, group_size)
        v = self._member_tokens.get(key)
        if v is None:
            parts = split_sizes(length, 2 * group_size)
            v = self._member_tokens[key] = tuple(parts[m] + parts[2 * group_size - 1 - m] for m in range(group_size))
        return v


_MEMOS: weakref.WeakKeyDictionary[CostModel, CostMemo] = weakref.WeakKeyDictionary()


def cost_memo(cost: CostModel) -> CostMemo:
    """The shared CostMemo of a CostModel (kept as long as the model lives)."""
    memo = _MEMOS.get(cost)
    if memo is None:
        memo = _MEMOS[cost] = CostMemo(cost)
    return memo


# --------------------------------------------------------------------------- parallel config
CP_SCOPES = ("balanced", "step", "dataset")


def fixed_cp_size(req: PlanRequest, cp_size: Optional[int], balancer: str, scope: str = "balanced") -> int:
    """The one CP size of a step's plan.

    `cp_size` if given (checked against the cluster and the step's samples). Otherwise the
    smallest registered group whose combined cap holds the longest sample: of the step
    (scope "step": every group is pre-built, so the size may change between steps at no
    cost) or of the whole dataset (scope "dataset": one size for the run, as `static`).
    Scope "balanced" goes on doubling the step's size while the longest sample alone on
    such a group would still outlast the mean rank's share of the step's work (its
    predicted time, CostModel.distributed_rank_cost, against the sum of
    CostModel.sample_local_ms over the world): a sample that long is the straggler
    whatever else is balanced.
    """
    cl = req.cluster
    if cp_size is None:
        if scope not in CP_SCOPES:
            raise ValueError(f"{balancer}: cp_scope {scope!r} must be one of {CP_SCOPES}")
        longest = max(req.lengths) if scope != "dataset" else max(req.dataset_max_length or 0, max(req.lengths))
        g = cl.smallest_group_for(longest)
        if scope == "balanced":
            memo = cost_memo(req.cost)
            mean_rank_ms = float(memo.local_ms_array(np.asarray(req.lengths, dtype=np.int64)).sum()) / cl.world_size
            while g < cl.group_sizes[-1] and memo.doc_on_group_ms(longest, g) > mean_rank_ms:
                g *= 2
        return g
    if cp_size not in cl.group_sizes:
        raise ValueError(f"{balancer}: cp_size {cp_size} is not a registered group size {cl.group_sizes}")
    i = int(np.argmax(req.lengths))
    if cp_size * cl.max_tokens_per_rank < req.lengths[i]:
        raise ValueError(
            f"{balancer}: sample {req.sample_ids[i]} ({req.lengths[i]} tokens) does not fit "
            f"cp_size {cp_size} x {cl.max_tokens_per_rank} tokens per rank"
        )
    return cp_size


def check_cp_options(cp_size: Optional[int], scope: str, balancer: str, scopes: Tuple[str, ...] = CP_SCOPES) -> None:
    if cp_size is not None and (not isinstance(cp_size, int) or cp_size <= 0 or cp_size & (cp_size - 1)):
        raise ValueError(f"{balancer}: cp_size {cp_size!r} must be a power of two")
    if scope not in scopes:
        raise ValueError(f"{balancer}: cp_scope {scope!r} must be one of {scopes}")


# --------------------------------------------------------------------------- LPT
def descending_order(weights: np.ndarray) -> np.ndarray:
    """Indices by decreasing weight; equal weights keep their input order (stable)."""
    return np.argsort(-np.asarray(weights, dtype=np.float64), kind="stable")


# LPT goes one item at a time through a heap until items weigh less than this share of the
# mean bin load; the lighter rest is water-filled in one vectorised pass (each bin then ends
# within one such item, < 1/64 of the mean, of where the heap would leave it).
EXACT_LPT_SHARE = 1.0 / 64


def split_exact_tail(weights_desc: np.ndarray, n_bins: int, total_with_loads: float, min_exact: int) -> int:
    """How many of the heaviest items (sorted heaviest first) LPT places one by one."""
    light = weights_desc < EXACT_LPT_SHARE * total_with_loads / n_bins
    first_light = int(np.argmax(light)) if light.any() else len(weights_desc)
    return min(len(weights_desc), max(min_exact, first_light))


def lpt_assign(
    weights: Sequence[float], n_bins: int, loads: Optional[Sequence[float]] = None, exact_items: Optional[int] = None
) -> Tuple[np.ndarray, np.ndarray]:
    """Longest-processing-time-first: heaviest item onto the least loaded bin.

    Returns (bin of every item, final bin loads). `loads` are the bins' starting loads.
    The heaviest items (all but those lighter than EXACT_LPT_SHARE of the mean bin load, and
    at least 2 per bin; or exactly `exact_items`) go one by one through a heap; the light
    tail is water-filled (water_fill).
    """
    w = np.asarray(weights, dtype=np.float64)
    n = len(w)
    bins = np.zeros(n, dtype=np.int64)
    load = np.zeros(n_bins, dtype=np.float64) if loads is None else np.array(loads, dtype=np.float64)
    if n == 0:
        return bins, load
    order = descending_order(w)
    k = (
        split_exact_tail(w[order], n_bins, float(w.sum() + load.sum()), 2 * n_bins)
        if exact_items is None
        else min(n, exact_items)
    )
    heap = [(float(l), b) for b, l in enumerate(load.tolist())]
    heapq.heapify(heap)
    wl = w.tolist()
    for i in order[:k].tolist():
        l, b = heap[0]
        bins[i] = b
        heapq.heapreplace(heap, (l + wl[i], b))
    for l, b in heap:
        load[b] = l
    if k < n:
        tail = order[k:]
        bins[tail] = water_fill(w[tail], load)
        np.add.at(load, bins[tail], w[tail])
    return bins, load


def water_fill(weights: np.ndarray, loads: np.ndarray) -> np.ndarray:
    """Bins for light items so that the bins' loads rise to one common level.

    The level T solves sum(max(0, T - load)) = sum(weights); the items, in the given order,
    are laid end to end over the bins' deficits (lightest bin first) and each goes to the
    bin whose deficit holds its midpoint.
    """
    n_bins = len(loads)
    by_load = np.argsort(loads, kind="stable")
    sl = loads[by_load]
    levels = (float(np.sum(weights)) + np.cumsum(sl)) / np.arange(1, n_bins + 1)
    k = int(np.nonzero(levels >= sl)[0][-1]) + 1  # fill the k lightest bins up to the level
    bounds = np.cumsum(np.maximum(0.0, levels[k - 1] - sl))
    mid = np.cumsum(weights) - weights / 2.0
    pos = np.minimum(np.searchsorted(bounds, mid, side="right"), n_bins - 1)
    return by_load[pos]


def group_indices(labels: np.ndarray, n_groups: int) -> List[np.ndarray]:
    """Indices of each label 0..n_groups-1, in increasing index order."""
    order = np.argsort(labels, kind="stable")
    counts = np.bincount(labels, minlength=n_groups)
    return np.split(order, np.cumsum(counts)[:-1])


def serpentine(n_items: int, n_bins: int) -> np.ndarray:
    """Bin of each position when items are dealt 0,1,..,m-1,m-1,..,1,0,0,1,.. (snake order):
    dealt heaviest first, every bin gets a fair share of heavy and light items."""
    p = np.arange(n_items)
    r = p % (2 * n_bins)
    return np.where(r < n_bins, r, 2 * n_bins - 1 - r)


# --------------------------------------------------------------------------- packing
def even_cap(cap: int, group_size: int) -> int:
    """Per-rank token budget that a zigzag split of a group's pack can always honour.

    A zigzag member holds two of 2g nearly equal chunks, i.e. at most 2*ceil(T/2g) tokens:
    with T <= g * (cap rounded down to even) that is <= cap.
    """
    return cap if group_size == 1 else cap - (cap & 1)


def split_to_cap(ids: Sequence[int], lengths: Sequence[int], cap: int) -> List[List[int]]:
    """Pack one rank's local documents into micro-batches of at most `cap` tokens.

    First-fit decreasing (each micro-batch costs a fixed overhead, so few and full is best);
    equal lengths keep their input order.
    """
    if not len(ids):
        return []
    lens = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lens, kind="stable").tolist()
    idl, lnl = list(ids), lens.tolist()
    if lnl[order[0]] > cap:
        raise ValueError(f"sample {idl[order[0]]} has {lnl[order[0]]} tokens, more than a rank's cap {cap}")
    total = int(lens.sum())
    if total <= cap:
        return [[idl[i] for i in order]]
    bins: List[List[int]] = []
    free: List[int] = []
    for i in order:
        n = lnl[i]
        for b, f in enumerate(free):
            if f >= n:
                bins[b].append(idl[i])
                free[b] = f - n
                break
        else:
            bins.append([idl[i]])
            free.append(cap - n)
    return bins


def lookahead_pack(lengths: Sequence[int], capacity: int, max_skips: int = 16) -> np.ndarray:
    """Fixed-length packing in data order, as a streaming data loader packs: the pack index of
    every item.

    A pack takes the next items while they fit; an item that does not fit is set aside and
    the pack goes on with the items after it (up to `max_skips` times, or until no item of
    the step could fit, then it closes). The items set aside then go, in data order, into
    the first pack with room (first fit), opening new packs at the end if none has, so the
    waste gathers in the last packs as with first fit. An item over `capacity` is a pack of
    its own. Runs of items are found by bisection on prefix sums and the first fit scans in
    numpy, so the Python work is per pack and per item set aside, not per item.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    n = len(lens)
    prefix = np.concatenate([[0], np.cumsum(lens)]).tolist()
    pack_of = np.empty(n, dtype=np.int64)
    smallest = int(lens.min()) if n else 0  # a pack with less room than this is full
    set_aside: List[int] = []
    free: List[int] = []
    i = 0
    while i < n:
        k, room, skips, start = len(free), capacity, 0, i
        while i < n:
            e = bisect.bisect_right(prefix, prefix[i] + room, lo=i) - 1  # items i..e-1 fit
            if e > i:
                pack_of[i:e] = k
                room -= prefix[e] - prefix[i]
                i = e
            elif i == start:  # over capacity: a pack of its own
                pack_of[i] = k
                room = 0
                i += 1
                break
            if i >= n or skips == max_skips or room < smallest:
                break
            set_aside.append(i)
            i += 1
            skips += 1
        free.append(room)
    if set_aside:
        room_left = np.zeros(len(free) + len(set_aside), dtype=np.int64)
        room_left[: len(free)] = free
        n_packs = len(free)
        for i in set_aside:
            k = int(np.argmax(room_left[:n_packs] >= lens[i]))
            if room_left[k] < lens[i]:
                k = n_packs
                n_packs += 1
                room_left[k] = max(capacity, lens[i])
            pack_of[i] = k
            room_left[k] -= lens[i]
    return pack_of


# --------------------------------------------------------------------------- modes and memory
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


def sampled_members(group_size: int) -> List[int]:
    """Members whose cost stands for the group's slowest when comparing modes: all of a small
    group; the two ends and the middle pair of a large one (where zigzag's and per-document
    sharding's remainders and heavy chunks land)."""
    g = group_size
    if g <= 8:
        return list(range(g))
    return sorted({0, 1, g // 2 - 1, g // 2, g - 2, g - 1})


def member_tokens(mode: ShardMode, doc_lengths: Sequence[int], group_size: int, memo: CostMemo) -> np.ndarray:
    """Tokens every member holds of the distributed documents under `mode`."""
    g = group_size
    if not doc_lengths:
        return np.zeros(g, dtype=np.int64)
    if mode == ShardMode.RING_ZIGZAG:
        # member m holds chunks m and 2g-1-m of the packed total cut in 2g (shard.zigzag_segments)
        parts = np.asarray(split_sizes(sum(doc_lengths), 2 * g), dtype=np.int64)
        return parts[:g] + parts[g:][::-1]
    if mode == ShardMode.RING_PER_DOC:  # every document is split on its own
        return np.sum([memo.per_doc_member_tokens(n, g) for n in doc_lengths], axis=0).astype(np.int64)
    return np.asarray([segment_tokens(rank_segments(mode, doc_lengths, g, m)) for m in range(g)], dtype=np.int64)


def group_fits(
    mode: ShardMode,
    doc_lengths: Sequence[int],
    group_size: int,
    cap: int,
    memo: CostMemo,
    local_tokens: Optional[Sequence[int]] = None,
) -> bool:
    """Whether every member holds at most `cap` tokens (its distributed share plus its locals)."""
    t = member_tokens(mode, doc_lengths, group_size, memo)
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

    Of the modes that fit, the one the cost model predicts faster (CostModel.best_ring_mode's
    comparison, on sampled members of large groups; locals add the same work under either
    mode and are left out). Large packs are compared more cheaply or not at all, see
    PER_DOC_MAX_DOCS. Raises ValueError if neither mode fits.
    """
    return ring_mode_and_ms(cost, doc_lengths, ranks, cap, local_tokens, memo, estimate=False)[0]


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
    zz_fits = group_fits(ShardMode.RING_ZIGZAG, docs, g, cap, memo, local_tokens)
    if len(docs) == 1 and zz_fits:  # one document: both modes are the same split
        return ShardMode.RING_PER_DOC, memo.doc_on_group_ms(docs[0], g) if estimate else float("nan")
    exact = len(docs) <= PER_DOC_MAX_DOCS and len(docs) * g <= PER_DOC_EVAL_BUDGET
    summed = not exact and len(docs) <= PER_DOC_SUM_DOCS
    pd_fits = (exact or summed or not zz_fits) and group_fits(ShardMode.RING_PER_DOC, docs, g, cap, memo, local_tokens)
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
    # both fit and per-document is cheap enough to weigh: the faster (per-document on ties,
    # as CostModel.best_ring_mode). Zigzag's slowest member can be any, so it is only chosen
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


# --------------------------------------------------------------------------- wave assembly
class WaveBuilder:
    """Assembles groups into waves: each group goes to the first wave after every earlier
    group of any of its ranks, so groups of a wave are disjoint and every rank runs its
    groups in the order they were added."""

    def __init__(self, world_size: int):
        self.next_wave = [0] * world_size
        self.waves: List[List[Group]] = []

    def add(self, group: Group, at_least: int = 0) -> int:
        """Add `group` to the first wave (not before `at_least`) after its ranks' earlier groups."""
        w = max(at_least, max(self.next_wave[r] for r in group.ranks))
        while len(self.waves) <= w:
            self.waves.append([])
        self.waves[w].append(group)
        for r in group.ranks:
            self.next_wave[r] = w + 1
        return w

    def build(self) -> List[Wave]:
        return [Wave(sorted(gs, key=lambda g: g.ranks[0])) for gs in self.waves]


def block_ranks(index: int, size: int) -> Tuple[int, ...]:
    """Ranks of the `index`-th aligned block of `size` ranks."""
    return tuple(range(index * size, (index + 1) * size))
