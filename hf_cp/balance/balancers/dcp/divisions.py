"""DCP's computation/communication schedule: the division of every compute block of a group, so
that the transfers of division i+1 can overlap the computation of division i."""

from __future__ import annotations

import heapq
from typing import Dict, List, Sequence, Tuple

from hf_cp.balance.toolkit.placement import BlockPlacement


def schedule_divisions(pl: BlockPlacement, block_ms: Sequence[float], n_div: int) -> List[int]:
    """Division of every compute block (DCP's computation/communication schedule).

    Inputs of a block are its query and key chunks; one not owned by the executor is a
    transfer (owner -> executor), made once, in the first division that needs it. Division
    0: blocks with every input local. Divisions 1..T-2: repeatedly the device with the least
    computation in the division takes its next block, unless the block's new transfers
    would push a (sender, receiver) pair over total / T of that pair's traffic (a pair may
    always send one chunk per division: chunks are the unit of transfer); such a device is
    done for the division. Division T-1: the rest.
    """
    n = len(pl.compute)
    if n_div <= 1 or n == 0:
        return [0] * n
    chunks = pl.chunks
    div = [-1] * n
    pair_total: Dict[Tuple[int, int], int] = {}
    for b in pl.compute:
        for c in {b.q_chunk, b.k_chunk}:
            o = chunks[c].owner
            if o != b.executor:
                pair_total[(o, b.executor)] = pair_total.get((o, b.executor), 0)  # keyed; filled below
    needed = {}
    for b in pl.compute:
        for c in {b.q_chunk, b.k_chunk}:
            o = chunks[c].owner
            if o != b.executor:
                needed[(c, b.executor)] = (o, b.executor, chunks[c].length)
    for o, e, ln in needed.values():
        pair_total[(o, e)] += ln
    limit = {k: v / n_div for k, v in pair_total.items()}
    have = set()  # (chunk, executor) already received
    todo: Dict[int, List[int]] = {}
    for j, b in enumerate(pl.compute):
        local = all(chunks[c].owner == b.executor for c in (b.q_chunk, b.k_chunk))
        if local:
            div[j] = 0
        else:
            todo.setdefault(b.executor, []).append(j)
    for d in range(1, n_div - 1):
        sent: Dict[Tuple[int, int], int] = {}
        load = {e: 0.0 for e in todo}
        active = [e for e in todo if todo[e]]
        heap = [(0.0, e) for e in sorted(active)]
        heapq.heapify(heap)
        while heap:
            l, e = heapq.heappop(heap)
            j = todo[e][0]
            b = pl.compute[j]
            new = [
                (c, chunks[c].owner, chunks[c].length)
                for c in {b.q_chunk, b.k_chunk}
                if chunks[c].owner != e and (c, e) not in have
            ]
            if any(sent.get((o, e), 0) and sent[(o, e)] + ln > limit[(o, e)] + 1e-9 for _, o, ln in new):
                continue  # this device waits for the next division (a pair always takes one chunk)
            for c, o, ln in new:
                sent[(o, e)] = sent.get((o, e), 0) + ln
                have.add((c, e))
            div[j] = d
            todo[e].pop(0)
            load[e] = l + block_ms[j]
            if todo[e]:
                heapq.heappush(heap, (load[e], e))
    for e in todo:
        for j in todo[e]:
            div[j] = n_div - 1
    return div


def division_overlap_ms(compute_ms: Sequence[float], comm_ms: Sequence[float]) -> float:
    """Time of a pipeline where the transfers of division i+1 run during the computation of
    division i: comm[0] + sum_i max(compute[i], comm[i+1]) + compute[last]."""
    n = len(compute_ms)
    if n == 0:
        return 0.0
    t = comm_ms[0]
    for i in range(n - 1):
        t += max(compute_ms[i], comm_ms[i + 1])
    return t + compute_ms[-1]
