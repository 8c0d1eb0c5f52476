"""DCP's placement of one step (plan_layout): long samples onto aligned blocks of ranks and into
waves, each block's hypergraph partitioned, atoms onto the least loaded ranks, and every
group's divisions (see the package docstring)."""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from hf_cp.balance.balancers.dcp.divisions import schedule_divisions
from hf_cp.balance.balancers.dcp.graph import WaveGraph
from hf_cp.balance.balancers.dcp.options import DcpError, DcpOptions
from hf_cp.balance.balancers.dcp.partition import place_block
from hf_cp.balance.balancers.dcp.placement import WavePlacement, group_placement, pack_to_rooms, wave_groups
from hf_cp.balance.balancers.dcp.weights import LongSample, Weights, block_count, causal_slices, cut_sample
from hf_cp.balance.toolkit.placement import BlockPlacement
from hf_cp.cost.model import CostModel
from hf_cp.modes.ring import per_doc_max_member_tokens
from hf_cp.samples.masks import AttnSlice, SampleMask


@dataclass
class DcpLayout:
    """A step as DCP places it: per wave, its groups (ranks, long samples as a placement with
    per-block divisions, local samples per rank)."""

    waves: List[List[Tuple[Tuple[int, ...], List[int], Optional[BlockPlacement], List[int], Dict[int, List[int]]]]]
    backend: str
    planner_s: float


def plan_layout(
    lengths: Sequence[int],
    world: int,
    gpus_per_node: int,
    cap: int,
    cost: CostModel,
    masks: Optional[Sequence[Optional[SampleMask]]] = None,
    options: Optional[DcpOptions] = None,
    max_group: Optional[int] = None,
) -> DcpLayout:
    """DCP's placement of one step (indices into `lengths`); see the module docstring.
    `max_group`: the largest group a plan may use (ClusterSpec.max_group_size)."""
    t0 = time.perf_counter()
    opt = options or DcpOptions()
    backend = opt.backend()
    w = Weights(cost)
    masks = masks or [None] * len(lengths)
    slices: Dict[int, List[AttnSlice]] = {}  # built for the samples cut in blocks or masked only

    def slices_of(i: int) -> List[AttnSlice]:
        if i not in slices:
            slices[i] = masks[i].slices() if masks[i] is not None else causal_slices(lengths[i])
        return slices[i]

    causal_ms: Dict[int, float] = {}  # per length: most samples of a step share a few lengths
    times = []
    for i, n in enumerate(lengths):
        if masks[i] is not None:
            times.append(w.sample_ms(n, slices_of(i)))
        else:
            t = causal_ms.get(n)
            if t is None:
                t = causal_ms[n] = w.linear_ms(n) + w.attention_ms(n * (n + 1) // 2, n)
            times.append(t)
    top = min(world, max_group or world)
    rank_share = sum(times) / world  # a rank's share of the step
    base = opt.block_size or max(1, 1 << int(math.log2(max(1, cap // 4))))
    room_per_rank = cap * opt.fill
    long_idx = sorted((i for i, n in enumerate(lengths) if n > base), key=lambda i: (-times[i], i))
    atoms = [i for i, n in enumerate(lengths) if n <= base]
    loads = [0.0] * world
    # long samples, heaviest first: each on the aligned block of ranks (as many as its time and
    # memory need, rounded up to a power of two) with the least work so far, in the first wave
    # where that block's ranks have the memory
    waves: List[Dict[Tuple[int, ...], List[int]]] = []  # wave -> block -> samples
    wave_tokens: List[List[float]] = []  # wave -> rank -> owned tokens of long samples
    for i in long_idx:
        need = max(math.ceil(times[i] / rank_share), math.ceil(lengths[i] / room_per_rank), 1)
        p = 1
        while p < need and p < top:
            p *= 2
        if lengths[i] > p * cap:
            raise DcpError(f"dcp: sample {i} ({lengths[i]} tokens) does not fit {p} ranks x {cap} tokens")
        blocks = sorted(
            (tuple(range(f, f + p)) for f in range(0, world, p)), key=lambda b: (sum(loads[r] for r in b), b[0])
        )
        per_rank = lengths[i] / p
        placed = False
        for wv in range(len(waves) + 1):
            if wv == len(waves):
                waves.append({})
                wave_tokens.append([0.0] * world)
            for blk in blocks:
                if all(wave_tokens[wv][r] + per_rank <= room_per_rank for r in blk) or (
                    wv == len(waves) - 1 and not waves[wv]
                ):
                    waves[wv].setdefault(blk, []).append(i)
                    for r in blk:
                        wave_tokens[wv][r] += per_rank
                        loads[r] += times[i] / p
                    placed = True
                    break
            if placed:
                break
    placed_waves: List[WavePlacement] = []
    ring_waves: List[Tuple[Tuple[int, ...], List[int]]] = []  # blocks that run ring per-document
    queue = [(blk, ids) for wave in waves for blk, ids in sorted(wave.items())]
    pending: List[Tuple[List[LongSample], List[int]]] = [([], []) for _ in waves]
    wave_index = [w for w, wave in enumerate(waves) for _ in sorted(wave.items())]
    while queue:
        blk, ids = queue.pop(0)
        wv = wave_index.pop(0)
        samples = []
        for i in ids:
            nb = block_count(lengths[i], base, len(blk), opt.max_blocks)
            samples.append(cut_sample(i, lengths[i], slices_of(i), nb))
        graph = WaveGraph.build(samples, w)
        gpn = gpus_per_node if len(blk) % gpus_per_node == 0 else len(blk)
        rank_of = place_block(graph, blk[0], len(blk), gpn, cap, world, w, opt, backend)
        if rank_of is None:
            if len(ids) > 1:  # place the samples of this block apart
                half = len(ids) // 2
                queue[:0] = [(blk, ids[:half]), (blk, ids[half:])]
                wave_index[:0] = [wv, len(waves) + len(ring_waves)]
                waves.append({})
                pending.append(([], []))
                continue
            # the K/V its blocks receive do not fit: ring attention streams them instead
            if per_doc_max_member_tokens(lengths[ids[0]], len(blk)) > cap:
                raise DcpError(
                    f"dcp: sample {ids[0]} ({lengths[ids[0]]} tokens) does not fit ranks {blk[0]}..{blk[-1]} x {cap} "
                    f"tokens, neither as blocks with the K/V and Q rows they receive nor per-document on a ring"
                )
            ring_waves.append((blk, ids))
            continue
        pending[wv][0].extend(samples)
        pending[wv][1].extend(rank_of)
    for samples, rank_of in pending:
        if samples:
            placed_waves.append(WavePlacement(WaveGraph.build(samples, w), rank_of))
    # atoms: heaviest first onto the rank with the least time in the step (LPT), then each
    # rank's atoms in micro-batches of its own (first fit decreasing), after the long waves
    heap = [(loads[r], r) for r in range(world)]
    heapq.heapify(heap)
    rank_atoms: Dict[int, List[int]] = {r: [] for r in range(world)}
    for i in sorted(atoms, key=lambda i: (-times[i], i)):
        l, r = heapq.heappop(heap)
        rank_atoms[r].append(i)
        heapq.heappush(heap, (l + times[i], r))
    extra: List[Dict[int, List[int]]] = []
    for r in range(world):
        for b, ids in enumerate(pack_to_rooms(rank_atoms[r], lengths, [], cap)):
            while len(extra) <= b:
                extra.append({})
            extra[b][r] = sorted(ids)
    out = []
    for wp in placed_waves:
        groups = []
        for ranks, sps, local in wave_groups(wp, world):
            pl = group_placement(wp, ranks, sps, cost.dims.num_heads) if sps else None
            docs = [wp.graph.samples[sp].index for sp in sps]
            div = []
            if pl is not None:
                ms = [w.attention_ms(b.pairs, pl.chunks[b.q_chunk].length) for b in pl.compute]
                div = schedule_divisions(pl, ms, opt.divisions)
            groups.append((ranks, docs, pl, div, local))
        out.append(groups)
    for blk, ids in ring_waves:  # mode ring per-document: no placement
        out.append([(blk, list(ids), None, [], {})])
    for wave_atoms in extra:
        out.append([((r,), [], None, [], {r: ids}) for r, ids in sorted(wave_atoms.items())])
    return DcpLayout(out, backend, time.perf_counter() - t0)
