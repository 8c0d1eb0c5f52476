"""The first pass of hierarchical planning: a step's samples split over the hosts (issue 39).

A host is `host_ranks` consecutive ranks (a node, or a pod of nodes). Each sample goes either
to one host, which plans it among its own ranks, or, when no host can run it in time, to an
aligned block of whole hosts ("spread" samples), placed here first. Everything is priced by
the cost model the balancers use (CostMemo: the same per-length numbers), in rank-ms:

* a sample that fits one rank costs its single-rank compute (masked samples by their masked
  area, bounds.request_local_ms) plus its share of micro-batch overheads (tokens / cap);
* a longer one the least `g x (its time alone on g ranks + one overhead)` over the group sizes
  of a host that hold it (what it keeps a host's ranks busy for, at best);
* the step's time is estimated as the charged bound estimates it: the larger of the mean
  rank's work and the longest samples' best time alone on any group;
* a sample spreads when no group of a host holds it, or holds it within that time. It takes
  the smallest block of hosts that runs it in time (else the fastest); blocks are chosen
  costliest sample first, each on the aligned block whose busiest host is least loaded, and
  every host of the block is busy for the sample's time alone.

The other samples are dealt to hosts by load: those costlier than LPT_SHARE of a host's target
by longest processing time first (assign.least_loaded_first: each to the least loaded host so
far, costliest first), then the many small ones in the step's order (already shuffled), each
host taking the contiguous run whose cost fills its gap to the common target. A host's total
then misses the target by about one small sample, so each host's plan, near its own bound, is
near the flat plan's.

Pure numpy on the request: every rank computes the same split. Cost: a few passes over the
step's samples and a sort of the costly ones only (a step of 10^6 chat samples holds few).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import numpy as np

from hf_cp.balance.base import PlanRequest
from hf_cp.balance.toolkit.assign import least_loaded_first
from hf_cp.balance.toolkit.bounds import request_local_ms
from hf_cp.balance.toolkit.costs import cost_memo
from hf_cp.modes.ring import per_doc_max_member_tokens

# a sample costing more than this share of a host's target is dealt by LPT; cheaper ones fill
# the hosts' gaps in step order (a host then misses its target by at most one of them)
LPT_SHARE = 1e-3
LONGEST_CHECKED = 8  # distinct lengths, longest first, whose best time alone bounds the step


@dataclass(frozen=True)
class SpreadBlock:
    """Samples run on an aligned block of whole hosts, before the hosts' own plans."""

    first_host: int
    hosts: int
    positions: Tuple[int, ...]  # indices into the request's samples


@dataclass(frozen=True)
class HostSplit:
    """Where each sample of a request is planned: a block of hosts or one host (indices into
    the request's samples), and each host's estimated busy rank-ms."""

    host_ranks: int
    spread: Tuple[SpreadBlock, ...]
    host_positions: Tuple[np.ndarray, ...]  # per host, indices into the request (its plan's sample order)
    host_load_ms: np.ndarray  # per host: estimated rank-ms, spread blocks included

    @property
    def hosts(self) -> int:
        return len(self.host_positions)

    def imbalance(self) -> float:
        """The busiest host's estimated load over the mean (1.0: perfectly even)."""
        mean = float(self.host_load_ms.mean())
        return float(self.host_load_ms.max()) / mean if mean > 0 else 1.0


def host_group_sizes(req: PlanRequest, host_ranks: int) -> List[int]:
    """The aligned group sizes inside one host (those of the cluster up to the host)."""
    return [g for g in req.cluster.group_sizes if g <= host_ranks]


def split_over_hosts(req: PlanRequest, host_ranks: int) -> HostSplit:
    """The first pass (module docstring). `host_ranks` must be a power of two that divides the
    world; a world of one host puts every sample on it."""
    cl, cost = req.cluster, req.cost
    world = cl.world_size
    if host_ranks <= 0 or host_ranks & (host_ranks - 1) or world % host_ranks:
        raise ValueError(f"host_ranks {host_ranks} must be a power of two that divides the world ({world} ranks)")
    hosts = world // host_ranks
    memo = cost_memo(cost)
    cap, overhead = cl.max_tokens_per_rank, memo.overhead_ms
    lens = req.length_array
    work = request_local_ms(req, memo) + lens * (overhead / cap)

    def fits(n: int, g: int) -> bool:
        return per_doc_max_member_tokens(n, g) <= cap

    def alone(n: int, g: int) -> float:
        return memo.doc_on_group_ms(n, g) + overhead

    # samples over one rank (or costly on one): each is charged its least rank-ms over the
    # groups of a host that hold it, and the step's time is estimated as the larger of the mean
    # rank's work and the longest samples' best time alone (the charged bound's two terms; the
    # 8 longest, as the bound checks them: group sizes above a host cost O(ranks) each to price)
    costly = np.unique(lens[(lens > cap) | (work > 0.5 * float(work.sum()) / world)]).tolist()
    inner = {n: [g for g in cl.group_sizes if g <= host_ranks and fits(n, g)] for n in costly}
    over_cap = np.flatnonzero(lens > cap)
    if len(over_cap):  # each distinct length priced once (a step of Wikipedia holds ~10^3 of them)
        uniq, inv = np.unique(lens[over_cap], return_inverse=True)
        held = [min((g * alone(n, g) for g in inner[n]), default=None) for n in uniq.tolist()]
        keep = np.array([h is not None for h in held])
        vals = np.array([h if h is not None else 0.0 for h in held])
        work[over_cap[keep[inv]]] = vals[inv][keep[inv]]
    outer = {n: [g for g in cl.group_sizes if g > host_ranks and fits(n, g)] for n in costly[-LONGEST_CHECKED:]}
    best = [min(alone(n, g) for g in inner.get(n, []) + outer[n]) for n in outer if inner.get(n) or outer[n]]
    step_ms = max([float(work.sum()) / world] + best)
    # a sample spreads over hosts when no group of a host holds it in the step's time: on the
    # smallest block of hosts that does (else the fastest)
    spread_size = {}  # length -> hosts of its block
    for n in costly:
        if inner[n] and min(alone(n, g) for g in inner[n]) <= step_ms:
            continue  # a host's groups run it in time
        over = outer.get(n) or [g for g in cl.group_sizes if g > host_ranks and fits(n, g)]
        if over:
            timely = [g for g in over if alone(n, g) <= step_ms]
            g = timely[0] if timely else min(over, key=lambda g: alone(n, g))
            spread_size[n] = g // host_ranks
        # else: no group of the cluster holds it (ChunkFlow runs it on one rank of a host)
    load = np.zeros(hosts)
    spread: List[SpreadBlock] = []
    is_spread = np.zeros(len(lens), dtype=bool)
    if spread_size:
        is_spread = np.isin(lens, np.fromiter(spread_size, dtype=np.int64))
        pos = np.flatnonzero(is_spread)
        blocks: dict = {}  # (first host, hosts) -> positions
        time_ms = {n: alone(n, k * host_ranks) for n, k in spread_size.items()}  # on its block
        # costliest first (the hosts it holds x its time), each on the block least loaded at its busiest host
        for i in sorted(pos.tolist(), key=lambda i: (-time_ms[int(lens[i])] * spread_size[int(lens[i])], i)):
            n = int(lens[i])
            k = spread_size[n]
            b = int(np.argmin(load.reshape(-1, k).max(axis=1)))
            load[b * k : (b + 1) * k] += time_ms[n] * host_ranks
            blocks.setdefault((b * k, k), []).append(i)
        spread = [SpreadBlock(first, k, tuple(p)) for (first, k), p in sorted(blocks.items())]
    rest = np.flatnonzero(~is_spread) if spread_size else np.arange(len(lens))
    rest_work = work[rest] if spread_size else work
    target = (float(rest_work.sum()) + float(load.sum())) / hosts
    is_big = rest_work > LPT_SHARE * target
    if is_big.any():
        big, small, small_costs = rest[is_big], rest[~is_big], rest_work[~is_big]
    else:  # (no copies of a step of 10^6-10^7 short samples)
        big, small, small_costs = rest[:0], rest, rest_work
    big_owner = np.zeros(len(big), dtype=np.int64)
    if len(big):
        # longest processing time first: each costly sample to the least loaded host so far
        # (numpy's default sort: deterministic, and 4x a stable one's speed on 10^6 floats;
        # samples of equal cost are interchangeable here)
        big = big[np.argsort(-work[big])]
        big_owner = least_loaded_first(work[big], load)
    starts = cut = np.zeros(hosts, dtype=np.int64)
    if len(small):
        running = np.cumsum(small_costs)  # one pass over the step's many small samples
        total = float(running[-1])
        gap = np.maximum(0.0, (float(load.sum()) + total) / hosts - load)
        total_gap = float(gap.sum())
        # each host takes the run of small samples whose cost fills its share of the gaps: the
        # runs end where the running cost passes the gaps' running total
        ends = np.cumsum(gap) * (total / total_gap) if total_gap > 0 else np.zeros(hosts)
        cut = np.searchsorted(running, ends)
        cut[-1] = len(small)
        starts = np.concatenate([[0], cut[:-1]])

        def before(i: np.ndarray) -> np.ndarray:  # running cost of the samples before index i
            return np.where(i > 0, running[np.maximum(i - 1, 0)], 0.0)

        load += before(cut) - before(starts)
    # per host: its costly samples (costliest first), then its run of small ones in step order
    by_owner = np.argsort(big_owner.astype(np.uint16 if hosts <= 1 << 16 else np.uint32), kind="stable")  # radix
    edges = np.searchsorted(big_owner[by_owner], np.arange(hosts + 1))
    host_positions = tuple(
        np.concatenate([big[by_owner[edges[h] : edges[h + 1]]], small[starts[h] : cut[h]]])
        if edges[h + 1] > edges[h]
        else small[starts[h] : cut[h]]  # (a view: a host of short samples only copies nothing)
        for h in range(hosts)
    )
    return HostSplit(host_ranks, tuple(spread), host_positions, load)
