"""DCP's placement of one step (plan_layout): long samples onto aligned blocks of ranks and into
waves, each block's hypergraph partitioned, atoms onto the least loaded ranks, and every
group's divisions (see the package docstring); and the plan a passed deadline leads to
(fallback_layout: the long samples ring per-document, no blocks).

Memory. A wave's blocks may overlap (a sample on ranks 0-63 and another on rank 0 alone), and
their groups then merge, so each block is placed against what the wave already holds on its
ranks (placement.WaveMemory: owned rows plus received K/V and Q rows, counted by
block_layout.held_tokens as StepPlan.validate counts them); blocks are placed largest first,
and one that no longer fits moves to the next wave. Every layout plan_layout returns passes
StepPlan.validate.

Deadline. `check` (a callable) is called between bounded steps (a block's placement level, a
group's layout); it raises toolkit.deadline.DeadlinePassed once the planner's deadline has
gone, and the balancer then plans with fallback_layout (cheap: no hypergraph) and says so."""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from hf_cp.balance.balancers.dcp.divisions import schedule_divisions
from hf_cp.balance.balancers.dcp.graph import WaveGraph
from hf_cp.balance.balancers.dcp.options import DcpError, DcpOptions
from hf_cp.balance.balancers.dcp.partition import place_block_rows
from hf_cp.balance.balancers.dcp.placement import (
    ArrayPlacement,
    WaveMemory,
    WavePlacement,
    group_placement,
    pack_to_rooms,
    wave_groups,
)
from hf_cp.balance.balancers.dcp.weights import Weights, block_count, causal_slices, cut_sample, sample_times
from hf_cp.balance.toolkit.deadline import DeadlinePassed
from hf_cp.cost.model import CostModel
from hf_cp.modes.ring import per_doc_max_member_tokens
from hf_cp.samples.masks import AttnSlice, SampleMask

# (ranks, long samples, their block placement (None: ring per-document), divisions, local samples per rank)
LayoutGroup = Tuple[Tuple[int, ...], List[int], Optional[ArrayPlacement], List[int], Dict[int, List[int]]]


@dataclass
class DcpLayout:
    """A step as DCP places it: per wave, its groups (ranks, long samples as a placement with
    per-block divisions, local samples per rank)."""

    waves: List[List[LayoutGroup]]
    backend: str
    planner_s: float


def deadline_check(deadline: Optional[float], seconds: Optional[float] = None) -> Callable[[], None]:
    """A callable that raises DeadlinePassed once time.monotonic() passes `deadline` (None: never)."""

    def check() -> None:
        if deadline is not None and time.monotonic() > deadline:
            raise DeadlinePassed(f"dcp passed its {seconds or 0:g} s deadline")

    return check


@dataclass
class _Step:
    """What the placement and its fallback both start from."""

    lengths: List[int]
    times: np.ndarray  # predicted ms of each sample, whole on one rank
    base: int  # tokens per data block; longer samples are cut in blocks
    long_idx: List[int]  # the long samples, heaviest first
    sizes: List[int]  # ranks each long sample spreads over (a power of two)
    atoms: List[int]


def _prepare(lengths, world, cap, w, masks, opt, max_group) -> _Step:
    lengths = [int(n) for n in lengths]
    times = sample_times(lengths, masks, w)
    # the largest aligned power-of-two block: a world that is not a power of two (3, 6 ranks of
    # one node) has none of its own size, and a sample spreads over at most the largest that fits
    top = 1 << (min(world, max_group or world).bit_length() - 1)
    rank_share = float(times.sum()) / world  # a rank's share of the step
    base = opt.block_size or max(1, 1 << int(math.log2(max(1, cap // 4))))
    room = cap * opt.fill
    idx = np.arange(len(lengths))
    order = np.lexsort((idx, -times)).tolist()  # heaviest first
    long_idx = [i for i in order if lengths[i] > base]
    sizes = []
    for i in long_idx:
        need = max(math.ceil(times[i] / rank_share), math.ceil(lengths[i] / room), 1)
        p = 1
        while p < need and p < top:
            p *= 2
        if lengths[i] > p * cap:
            raise DcpError(f"dcp: sample {i} ({lengths[i]} tokens) does not fit {p} ranks x {cap} tokens")
        sizes.append(p)
    atoms = [i for i in order if lengths[i] <= base]
    return _Step(lengths, times, base, long_idx, sizes, atoms)


def spreads_long_samples(
    lengths: Sequence[int],
    world: int,
    cap: int,
    cost: CostModel,
    masks: Optional[Sequence[Optional[SampleMask]]] = None,
    options: Optional[DcpOptions] = None,
    max_group: Optional[int] = None,
) -> bool:
    """Whether plan_layout (and fallback_layout) spread some long sample over several ranks:
    only then do the two differ in more than the order of their work (one pass over the step)."""
    masks = list(masks) if masks is not None else [None] * len(lengths)
    step = _prepare(lengths, world, cap, Weights(cost), masks, options or DcpOptions(), max_group)
    return any(p > 1 for p in step.sizes)


def _blocks_by_load(loads: np.ndarray, p: int) -> np.ndarray:
    """First ranks' block numbers of the aligned blocks of p ranks, least loaded first (a world
    of one node that is not a power of two ends before its last block would: blocks that fit)."""
    n = len(loads) // p
    return np.lexsort((np.arange(n), loads[: n * p].reshape(n, p).sum(axis=1)))


def _by_block(per_rank: np.ndarray, p: int) -> np.ndarray:
    """A per-rank array as rows of the aligned blocks of p ranks (the ranks past the last whole
    block, in a world that is not a power of two, belong to none)."""
    n = len(per_rank) // p
    return per_rank[: n * p].reshape(n, p)


def _atom_ranks(step: _Step, loads: np.ndarray, world: int) -> Dict[int, List[int]]:
    """Atoms heaviest first onto the rank with the least time in the step (LPT): rank -> atoms."""
    heap = [(float(loads[r]), r) for r in range(world)]
    heapq.heapify(heap)
    rank_atoms: Dict[int, List[int]] = {r: [] for r in range(world)}
    times = step.times.tolist()
    for i in step.atoms:
        t, r = heapq.heappop(heap)
        rank_atoms[r].append(i)
        heapq.heappush(heap, (t + times[i], r))
    return rank_atoms


def _atom_waves(step: _Step, loads: np.ndarray, world: int, cap: int, check) -> List[List[LayoutGroup]]:
    """Atoms placed by _atom_ranks, then each rank's atoms in micro-batches of its own (first
    fit decreasing), one wave per micro-batch."""
    rank_atoms = _atom_ranks(step, loads, world)
    check()
    extra: List[Dict[int, List[int]]] = []
    for r in range(world):
        for b, ids in enumerate(pack_to_rooms(rank_atoms[r], step.lengths, [], cap)):
            while len(extra) <= b:
                extra.append({})
            extra[b][r] = sorted(ids)
    return [[((r,), [], None, [], {r: ids}) for r, ids in sorted(wave.items())] for wave in extra]


def _long_sample_blocks(
    step: _Step, world: int, room: float
) -> Tuple[List[List[Tuple[int, int, List[int]]]], np.ndarray]:
    """plan_layout's first step: long samples, heaviest first, each on the aligned block of
    ranks (as many as its time and memory need) with the least work so far, in the first wave
    where that block's ranks have the room for its owned tokens (an estimate: step 2 places
    against the exact count). (wave -> [(first rank, size, samples)], every rank's work)."""
    lengths = step.lengths
    loads = np.zeros(world)
    waves: List[List[Tuple[int, int, List[int]]]] = []  # wave -> (first rank, size, samples)
    wave_tokens: List[np.ndarray] = []  # wave -> rank -> owned tokens of long samples
    for i, p in zip(step.long_idx, step.sizes):
        order = _blocks_by_load(loads, p)
        per_rank = lengths[i] / p
        for wv in range(len(waves) + 1):
            if wv == len(waves):
                waves.append([])
                wave_tokens.append(np.zeros(world))
            if waves[wv]:
                fits = (_by_block(wave_tokens[wv], p) + per_rank <= room).all(axis=1)
                ok = order[fits[order]]
                if not len(ok):
                    continue
                b = int(ok[0])
            else:
                b = int(order[0])
            entry = next((e for e in waves[wv] if e[0] == b * p and e[1] == p), None)
            if entry is None:
                waves[wv].append((b * p, p, [i]))
            else:
                entry[2].append(i)
            wave_tokens[wv][b * p : (b + 1) * p] += per_rank
            loads[b * p : (b + 1) * p] += step.times[i] / p
            break
    return waves, loads


def plan_layout(
    lengths: Sequence[int],
    world: int,
    gpus_per_node: int,
    cap: int,
    cost: CostModel,
    masks: Optional[Sequence[Optional[SampleMask]]] = None,
    options: Optional[DcpOptions] = None,
    max_group: Optional[int] = None,
    check: Optional[Callable[[], None]] = None,
) -> DcpLayout:
    """DCP's placement of one step (indices into `lengths`); see the module docstring.
    `max_group`: the largest group a plan may use (ClusterSpec.max_group_size); `check`:
    called between steps, raises DeadlinePassed past the planner's deadline."""
    t0 = time.perf_counter()
    check = check or deadline_check(None)
    opt = options or DcpOptions()
    backend = opt.backend()
    w = Weights(cost)
    masks = list(masks) if masks is not None else [None] * len(lengths)
    step = _prepare(lengths, world, cap, w, masks, opt, max_group)
    lengths = step.lengths
    room = cap * opt.fill

    def slices_of(i: int) -> List[AttnSlice]:
        return masks[i].slices() if masks[i] is not None else causal_slices(lengths[i])

    # 1. long samples onto blocks of ranks and into waves (_long_sample_blocks)
    waves, loads = _long_sample_blocks(step, world, room)
    check()
    # 2. each wave's blocks, largest first, placed against what the wave already holds; a
    # block that does not fit moves to the next wave (or, alone there, splits its samples; a
    # sample alone whose received rows do not fit runs ring per-document)
    graphs: Dict[Tuple[int, Tuple[int, ...]], WaveGraph] = {}

    def graph_of(size: int, ids: List[int]) -> WaveGraph:
        key = (size, tuple(ids))
        if key not in graphs:
            samples = [
                cut_sample(i, lengths[i], slices_of(i), block_count(lengths[i], step.base, size, opt.max_blocks))
                for i in ids
            ]
            graphs[key] = WaveGraph.build(samples, w)
        return graphs[key]

    placed: List[List[Tuple[WaveGraph, np.ndarray]]] = []
    ring: List[Tuple[Tuple[int, ...], List[int]]] = []  # blocks that run ring per-document
    wv = 0
    while wv < len(waves):
        todo = sorted(waves[wv], key=lambda e: (-e[1], e[0], e[2]))
        memory = WaveMemory(world)
        parts: List[Tuple[WaveGraph, np.ndarray]] = []
        while todo:
            first, size, ids = todo.pop(0)
            check()
            graph = graph_of(size, ids)
            gpn = gpus_per_node if size % gpus_per_node == 0 else size
            done = place_block_rows(graph, first, size, gpn, cap, world, w, opt, backend, memory, check)
            if done is not None:
                memory.add(done[1])
                parts.append((graph, done[0]))
                continue
            if memory.busy(first, size):  # others hold these ranks in this wave: the next wave
                if wv + 1 == len(waves):
                    waves.append([])
                waves[wv + 1].append((first, size, ids))
            elif len(ids) > 1:  # place the samples of this block apart
                half = len(ids) // 2
                todo.insert(0, (first, size, ids[:half]))
                if wv + 1 == len(waves):
                    waves.append([])
                waves[wv + 1].append((first, size, ids[half:]))
            elif per_doc_max_member_tokens(lengths[ids[0]], size) > cap:
                raise DcpError(
                    f"dcp: sample {ids[0]} ({lengths[ids[0]]} tokens) does not fit ranks {first}..{first + size - 1} "
                    f"x {cap} tokens, neither as blocks with the K/V and Q rows they receive nor per-document on a ring"
                )
            else:  # the K/V its blocks receive do not fit: ring attention streams them instead
                ring.append((tuple(range(first, first + size)), ids))
        placed.append(parts)
        wv += 1
    # 3. every wave's groups and their block placements
    out: List[List[LayoutGroup]] = []
    for parts in placed:
        if not parts:
            continue
        wp = WavePlacement(WaveGraph.concat([g for g, _ in parts]), np.concatenate([r for _, r in parts]))
        groups: List[LayoutGroup] = []
        for ranks, sps, local in wave_groups(wp, world):
            check()
            pl = group_placement(wp, ranks, sps, cost.dims.num_heads) if sps else None
            docs = [wp.graph.samples[sp].index for sp in sps]
            div: List[int] = []
            if pl is not None:
                if opt.divisions > 1:
                    ms = w.attention_ms(pl.pairs, pl.length[pl.q_chunk]).tolist()
                    div = schedule_divisions(pl, ms, opt.divisions)
                else:
                    div = [0] * len(pl)
            groups.append((ranks, docs, pl, div, local))
        out.append(groups)
    for blk, ids in ring:  # mode ring per-document: no placement
        out.append([(blk, list(ids), None, [], {})])
    out.extend(_atom_waves(step, loads, world, cap, check))
    return DcpLayout(out, backend, time.perf_counter() - t0)


def _inside_blocks_ms(work: np.ndarray, first: np.ndarray, size: np.ndarray, world: int) -> float:
    """The most work per rank of any aligned block of p ranks (p a power of two) in the samples
    placed inside it (sample i on ranks first[i] .. first[i] + size[i] - 1, an aligned block
    of a power of two ranks): those ranks run at least that work, whatever the rest does."""
    out, p = 0.0, 1
    while p <= world:
        inside = size <= p
        if inside.any():
            sums = np.bincount(first[inside] // p, weights=work[inside], minlength=world // p)
            out = max(out, float(sums.max()) / p)
        p *= 2
    return out


def placement_lower_bound_ms(
    lengths: Sequence[int],
    world: int,
    cap: int,
    cost: CostModel,
    work: np.ndarray,
    masks: Optional[Sequence[Optional[SampleMask]]] = None,
    options: Optional[DcpOptions] = None,
    max_group: Optional[int] = None,
) -> float:
    """No plan of plan_layout's or fallback_layout's is faster than this, for `work` (each
    sample's single-rank compute, what sharding it only adds to: cost.bounds' argument).

    Both place every long sample on an aligned block of ranks in their first step
    (_long_sample_blocks, _fallback_blocks: no partitioning, one numpy pass per sample) and
    the atoms onto single ranks (_atom_ranks); the later steps keep each sample's compute on
    its block's ranks (its blocks are partitioned over them, or it runs ring per-document or
    whole there, in this wave or a later one). So every aligned block of ranks runs at least
    the work of the samples placed inside it, spread over its ranks at best
    (_inside_blocks_ms); the bound is the smaller of the two layouts'."""
    opt = options or DcpOptions()
    masks = list(masks) if masks is not None else [None] * len(lengths)
    step = _prepare(lengths, world, cap, Weights(cost), masks, opt, max_group)
    n = len(step.lengths)
    out = []
    for layout in ("blocks", "fallback"):
        first, size = np.zeros(n, dtype=np.int64), np.ones(n, dtype=np.int64)
        if layout == "blocks":
            waves, loads = _long_sample_blocks(step, world, cap * opt.fill)
            placed = [(f, p, ids) for wave in waves for f, p, ids in wave]
        else:
            blocks, locals_, loads = _fallback_blocks(step, world, cap, cap * opt.fill)
            placed = [(f, p, ids) for wave in blocks for (f, p), ids in wave.items()]
            placed += [(r, 1, ids) for wave in locals_ for r, ids in wave.items()]
        placed += [(r, 1, ids) for r, ids in _atom_ranks(step, loads, world).items()]
        for f, p, ids in placed:
            first[ids], size[ids] = f, p
        out.append(_inside_blocks_ms(np.asarray(work, dtype=np.float64), first, size, world))
    return min(out)


def fallback_layout(
    lengths: Sequence[int],
    world: int,
    cap: int,
    cost: CostModel,
    masks: Optional[Sequence[Optional[SampleMask]]] = None,
    options: Optional[DcpOptions] = None,
    max_group: Optional[int] = None,
) -> DcpLayout:
    """The plan a passed deadline leads to, cheap and a pure function of the request: every
    long sample on an aligned block of as many ranks as plan_layout gives it, ring
    per-document (nothing received to count: a member holds its two pieces), blocks of one
    wave disjoint or the same (then one group), the least loaded block of the first wave with
    room; a sample on one rank runs local there; atoms as in plan_layout."""
    t0 = time.perf_counter()
    opt = options or DcpOptions()
    w = Weights(cost)
    masks = list(masks) if masks is not None else [None] * len(lengths)
    step = _prepare(lengths, world, cap, w, masks, opt, max_group)
    waves, locals_, loads = _fallback_blocks(step, world, cap, cap * opt.fill)
    out: List[List[LayoutGroup]] = []
    for blocks, local in zip(waves, locals_):
        groups: List[LayoutGroup] = []
        covered = set()
        for (first, p), ids in sorted(blocks.items()):
            ranks = tuple(range(first, first + p))
            covered.update(ranks)
            groups.append((ranks, list(ids), None, [], {r: sorted(local[r]) for r in ranks if r in local}))
        groups += [((r,), [], None, [], {r: sorted(ids)}) for r, ids in sorted(local.items()) if r not in covered]
        out.append(sorted(groups, key=lambda g: g[0][0]))
    out.extend(_atom_waves(step, loads, world, cap, deadline_check(None)))
    return DcpLayout(out, "none", time.perf_counter() - t0)


def _fallback_blocks(
    step: _Step, world: int, cap: int, room: float
) -> Tuple[List[Dict[Tuple[int, int], List[int]]], List[Dict[int, List[int]]], np.ndarray]:
    """fallback_layout's long samples: per wave, (first rank, size) -> the samples ring
    per-document there and rank -> the samples run whole there; and every rank's work."""
    lengths = step.lengths
    loads = np.zeros(world)
    waves: List[Dict[Tuple[int, int], List[int]]] = []  # wave -> (first rank, size) -> samples
    locals_: List[Dict[int, List[int]]] = []  # wave -> rank -> samples run whole
    tokens: List[np.ndarray] = []  # wave -> rank -> tokens held
    owner: List[np.ndarray] = []  # wave -> rank -> first rank * (world + 1) + size of its ring group (-1: none)
    for i, p in zip(step.long_idx, step.sizes):
        order = _blocks_by_load(loads, p)
        per = per_doc_max_member_tokens(lengths[i], p) if p > 1 else lengths[i]
        for wv in range(len(waves) + 1):
            if wv == len(waves):
                waves.append({})
                locals_.append({})
                tokens.append(np.zeros(world, dtype=np.int64))
                owner.append(np.full(world, -1, dtype=np.int64))
            fresh = not waves[wv] and not locals_[wv]
            t = _by_block(tokens[wv], p)
            fits = (t + per <= room).all(axis=1) | ((t + per <= cap).all(axis=1) & fresh)
            if p > 1:
                own = _by_block(owner[wv], p)
                code = np.arange(len(own)) * p * (world + 1) + p
                fits &= ((own == -1) | (own == code[:, None])).all(axis=1)
            ok = order[fits[order]]
            if not len(ok):
                continue
            b = int(ok[0])
            s = slice(b * p, (b + 1) * p)
            if p > 1:
                waves[wv].setdefault((b * p, p), []).append(i)
                owner[wv][s] = b * p * (world + 1) + p
            else:
                locals_[wv].setdefault(b, []).append(i)
            tokens[wv][s] += per
            loads[s] += step.times[i] / p
            break
    return waves, locals_, loads
