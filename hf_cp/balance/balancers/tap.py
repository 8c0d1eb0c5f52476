"""Libra's TAP (tiled attention pooling, survey section 3.2) inside VRSP's bounded pools.

VRSP (libra.py) decides which replica runs each packed sequence and in which wave; it never
splits a sequence, so what a pool's replicas hold in one wave can still differ in attention
work. TAP moves that work, not the data: in each wave every pool's ranks form one "blocks"
group, the data stays with its VRSP owner, and attention is cut into SH-tiles (a head range x
a query chunk of one sample, against all the keys it attends), each priced by its exact
masked pairs (masks.rect_pairs) at the kernel efficiency of its query length, with the head
split overhead when it covers part of the heads (CostModel.head_split_factor).

Placement (Libra's communication-aware greedy): tiles heaviest first; a tile goes to a worker
whose load, with the tile and the transfers moving it costs, stays under the soft cap ((1 + slack) x the pool's mean load, linear work
included) and who owns rows in this wave (a member without any sits it out), preferring, in order: the owner of its queries (nothing moves), a worker that
already receives the tile's keys and values for another tile (only Q moves), then the least
loaded worker. A tile that fits nowhere is split along heads first (Libra: equal head
ranges run at equal cost and keep the kernel's sequence length, where sequence splits make
short, slow chunks), down to one KV-head group; past that it goes to the least loaded
worker. Sequence chunks are `tile_tokens` long (the last of a sample shorter).

Samples none of whose tiles leave their owner stay local documents of the owner.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from hf_cp.balance.balancers.libra import LibraBalancer, PoolLayout
from hf_cp.balance.base import PlanRequest, SampleTooLongError
from hf_cp.balance.registry import register_balancer
from hf_cp.balance.toolkit.bounds import BoundCache
from hf_cp.balance.toolkit.placement import BlockPlacement, Chunk, ComputeBlock, blocks_group, request_masks
from hf_cp.balance.toolkit.ring_layout import pick_ring_mode
from hf_cp.balance.toolkit.vision_memory import fit_vision_memory
from hf_cp.cost.hardware import transfer_ms
from hf_cp.cost.model import CostModel
from hf_cp.cost.simulate import group_costs
from hf_cp.modes import ring
from hf_cp.modes.segments import cut, split_sizes
from hf_cp.plan.block_layout import received_row_bytes, received_token_equivalent
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import Group, StepPlan, Wave
from hf_cp.samples.masks import AttnSlice, SampleMask, SliceKind, rect_pairs


@dataclass(frozen=True)
class TapOptions:
    tile_tokens: int = 4096  # query tokens per sequence tile
    slack: float = 0.02  # soft cap: (1 + slack) x the pool's mean load

    def __post_init__(self):
        if self.tile_tokens < 1:
            raise ValueError(f"tap: tile_tokens {self.tile_tokens} must be positive")
        if self.slack < 0:
            raise ValueError(f"tap: slack {self.slack} must be >= 0")


@dataclass
class Tile:
    doc: int  # position in the pool's documents
    chunk: int  # query chunk (index into the placement's chunks)
    head_start: int
    head_end: int
    keys: Tuple[int, ...]  # key chunks it reads
    pairs: Tuple[int, ...]  # masked pairs per key chunk (all heads)
    ms: float


def _causal(n: int) -> List[AttnSlice]:
    return [AttnSlice(0, n, 0, n, SliceKind.CAUSAL)]


def tile_ms(cost: CostModel, pairs: int, q_len: int, heads: int) -> float:
    """Predicted time (all layers) of a tile: its share of the heads, the head-split overhead."""
    H = cost.dims.num_heads
    t = cost.dims.num_layers * cost.c2 * pairs / cost.chunk_efficiency(q_len) * heads / H
    return t * (cost.head_split_factor(H // heads) if heads < H else 1.0)


def pool_chunks(
    doc_lengths: Sequence[int], packs: Sequence[Tuple[Sequence[int], Sequence[int]]], tile_tokens: int
) -> List[Chunk]:
    """Chunks of a pool's documents. `packs`: (document positions, owning members) of each
    packed sequence. One member: its documents whole; n members: the packed sequence in ring
    zigzag's 2n pieces (ring.zigzag_pieces: member j holding pieces j and 2n-1-j, cut at document
    ends). Every piece is cut to at most `tile_tokens` (the query length of a sequence tile)."""
    out: List[Chunk] = []
    for docs, members in packs:
        g = len(members)
        lens = [doc_lengths[d] for d in docs]
        # in packed order, so document by document
        pieces = ring.zigzag_pieces(lens, g) if g > 1 else [(0, s) for s in cut(lens, 0, sum(lens))]
        for m, s in pieces:
            start = s.start
            for piece in split_sizes(s.length, -(-s.length // tile_tokens)):
                out.append(Chunk(docs[s.doc], start, piece, members[m]))
                start += piece
    return out


def place_tiles(
    cost: CostModel,
    doc_lengths: Sequence[int],
    doc_slices: Sequence[Sequence[AttnSlice]],
    chunks: Sequence[Chunk],
    base_load: Sequence[float],
    opt: TapOptions,
    cap: Optional[int] = None,
) -> Tuple[BlockPlacement, List[float]]:
    """TAP's greedy over one pool's members (see the module docstring). `base_load`: each
    member's work that stays put (its linear work, and anything else it runs). With `cap`, a
    tile only goes where the member's owned rows plus the K/V and Q rows it receives
    (block_layout.received_token_equivalent's measure) stay within it. Returns the placement
    (every block of a tile on the tile's worker) and the members' loads."""
    H = cost.dims.num_heads
    group = max(1, H // cost.dims.num_kv_heads)  # query heads per KV head: the finest head split
    g = len(base_load)
    by_doc: Dict[int, List[int]] = {}
    for i, c in enumerate(chunks):
        by_doc.setdefault(c.doc, []).append(i)
    tiles: List[Tile] = []
    for d, idx in by_doc.items():
        sl = doc_slices[d]
        for qi in idx:
            q = chunks[qi]
            keys, pairs = [], []
            for ki in idx:
                k = chunks[ki]
                p = rect_pairs(sl, q.start, q.end, k.start, k.end)
                if p:
                    keys.append(ki)
                    pairs.append(p)
            tiles.append(Tile(d, qi, 0, H, tuple(keys), tuple(pairs), tile_ms(cost, sum(pairs), q.length, H)))
    load = list(base_load)
    soft = (1.0 + opt.slack) * (sum(load) + sum(t.ms for t in tiles)) / g
    receives: Dict[int, set] = {m: set() for m in range(g)}  # member -> key chunks it already gets
    q_got: Dict[int, set] = {m: set() for m in range(g)}  # member -> query chunks it already gets
    kv_row, q_row = received_row_bytes(cost)
    per_token = int(cost.profile.activation_bytes_per_token)
    owned = [0] * g
    for c in chunks:
        owned[c.owner] += c.length
    recv_bytes = [0] * g
    # tiles run only where rows are owned: a member without rows sits out the micro-batch
    workers = [m for m in range(g) if owned[m] > 0]

    def extra_bytes(t: Tile, m: int) -> int:
        new_kv = sum(chunks[k].length for k in t.keys if chunks[k].owner != m and k not in receives[m])
        new_q = chunks[t.chunk].length if chunks[t.chunk].owner != m and t.chunk not in q_got[m] else 0
        return new_kv * kv_row + new_q * q_row

    # a moved tile also costs its transfers (Q out, the output back, K/V the worker lacks, all
    # layers), at the pool's intra-node bandwidth: a move must pay for them. Bytes alone: a move
    # adds bytes to the all-to-all-v phases, whose messages are per phase, not per tile
    # (cost.blocks.block_exchange_messages). per_ms: ms per byte a layer sends, all layers.
    per_ms = transfer_ms(cost.dims.softmax_layers, cost.profile.links["intra_node"], messages=0)

    def cost_on(t: Tile, m: int) -> float:
        return t.ms + (extra_bytes(t, m) * per_ms if m != chunks[t.chunk].owner else 0.0)

    def memory_ok(t: Tile, m: int) -> bool:
        if cap is None:
            return True
        b = recv_bytes[m] + extra_bytes(t, m)
        return owned[m] + (-(-b // per_token) if b else 0) <= cap

    placed: List[Tuple[Tile, int]] = []
    heap = [(-t.ms, n, t) for n, t in enumerate(tiles)]
    heapq.heapify(heap)
    serial = len(tiles)
    while heap:
        _, _, t = heapq.heappop(heap)
        owner = chunks[t.chunk].owner
        fits = [m for m in workers if load[m] + cost_on(t, m) <= soft + 1e-12 and memory_ok(t, m)]
        if owner in fits:
            m = owner
        else:
            holders = [m for m in fits if set(t.keys) <= receives[m] | {k for k in t.keys if chunks[k].owner == m}]
            if holders:
                m = min(holders, key=lambda x: (load[x], x))
            elif fits:
                m = min(fits, key=lambda x: (len(set(t.keys) - receives[x]), load[x], x))
            else:
                h = t.head_end - t.head_start
                if h >= 2 * group:  # split along heads first, at KV-head-group boundaries
                    mid = t.head_start + (h // group // 2) * group
                    q_len = chunks[t.chunk].length
                    for a, b in ((t.head_start, mid), (mid, t.head_end)):
                        part = Tile(t.doc, t.chunk, a, b, t.keys, t.pairs, tile_ms(cost, sum(t.pairs), q_len, b - a))
                        heapq.heappush(heap, (-part.ms, serial, part))
                        serial += 1
                    continue
                roomy = [x for x in workers if memory_ok(t, x)] or [owner]  # the owner receives nothing
                # where it ends soonest (its transfers included); the owner on ties
                m = min(roomy, key=lambda x: (load[x] + cost_on(t, x), x != owner, x))
        load[m] += cost_on(t, m)
        recv_bytes[m] += extra_bytes(t, m)
        for k in t.keys:
            if chunks[k].owner != m:
                receives[m].add(k)
        if chunks[t.chunk].owner != m:
            q_got[m].add(t.chunk)
        placed.append((t, m))
    pl = BlockPlacement(g, H, list(chunks))
    for t, m in sorted(placed, key=lambda x: (x[0].chunk, x[0].head_start)):
        for k, p in zip(t.keys, t.pairs):
            pl.compute.append(ComputeBlock(t.chunk, k, t.head_start, t.head_end, m, p))
    pl.compute.sort(key=lambda b: (b.q_chunk, b.k_chunk, b.head_start))
    return pl, load


def linear_ms(cost: CostModel, tokens: int) -> float:
    return (cost.dims.num_layers * cost.c1 + cost.head_ms_per_token) * tokens


@dataclass
class TapGroup:
    """One pool in one wave: its ranks, the samples TAP distributes (with their placement),
    and the samples that stay local to one rank."""

    ranks: Tuple[int, ...]
    distributed: List[int]  # request indices
    placement: Optional[BlockPlacement]
    local: Dict[int, List[int]]  # rank -> request indices
    loads: List[float]


def tap_pool(
    cost: CostModel,
    ranks: Sequence[int],
    packs: Sequence[Tuple[Sequence[int], Sequence[int]]],
    lengths: Sequence[int],
    masks: Optional[Mapping[int, SampleMask]] = None,
    options: Optional[TapOptions] = None,
    cap: Optional[int] = None,
) -> TapGroup:
    """TAP over one pool in one wave: `packs` are (request indices, owning members) of the
    packed sequences its replicas run (one member: its documents before TAP; several: the
    sequence zigzag-split over them, pool_chunks). With `cap`, received rows count against
    memory (place_tiles)."""
    opt = options or TapOptions()
    masks = masks or {}
    g = len(ranks)
    doc_ids = [i for docs, _ in packs for i in docs]
    doc_len = [lengths[i] for i in doc_ids]
    slices = [masks[i].slices() if i in masks else _causal(lengths[i]) for i in doc_ids]
    pos, layout = 0, []
    for docs, members in packs:
        layout.append((list(range(pos, pos + len(docs))), list(members)))
        pos += len(docs)
    chunks = pool_chunks(doc_len, layout, opt.tile_tokens)
    base = [0.0] * g
    for c in chunks:
        base[c.owner] += linear_ms(cost, c.length)
    pl, loads = place_tiles(cost, doc_len, slices, chunks, base, opt, cap)
    # a document none of whose blocks left a single owner is a local document of that owner
    spread = set()
    for b in pl.compute:
        q = pl.chunks[b.q_chunk]
        if b.executor != q.owner or pl.chunks[b.k_chunk].owner != q.owner:
            spread.add(q.doc)
    owners: Dict[int, set] = {}
    for c in pl.chunks:
        owners.setdefault(c.doc, set()).add(c.owner)
    spread |= {d for d, o in owners.items() if len(o) > 1}
    local: Dict[int, List[int]] = {}
    for d in range(len(doc_ids)):
        if d not in spread:
            local.setdefault(ranks[next(iter(owners[d]))], []).append(doc_ids[d])
    keep = sorted(spread)
    if not keep:
        return TapGroup(tuple(ranks), [], None, local, loads)
    renum = {d: n for n, d in enumerate(keep)}
    sub = BlockPlacement(g, pl.num_heads)
    index = {}
    for i, c in enumerate(pl.chunks):
        if c.doc in renum:
            index[i] = len(sub.chunks)
            sub.chunks.append(Chunk(renum[c.doc], c.start, c.length, c.owner))
    for b in pl.compute:
        if b.q_chunk in index:
            sub.compute.append(
                ComputeBlock(index[b.q_chunk], index[b.k_chunk], b.head_start, b.head_end, b.executor, b.pairs)
            )
    return TapGroup(tuple(ranks), [doc_ids[d] for d in keep], sub, local, loads)


# --------------------------------------------------------------------------- the balancer
@register_balancer("libra_tap", auto_member=True)
class LibraTapBalancer:
    """Libra: VRSP (libra.py) across bounded pools, then TAP inside each pool and wave.

    Options: libra's (`pool_size`, default 8 as in the seed; `cp_size`; `cp_scope`), TAP's
    (`tile_tokens`, `slack`), and `room`: VRSP packs to (1 - room) of the cap so that members
    may receive the K/V and Q rows of moved tiles (default 0: packs as `libra` does, whose
    packs leave some room; more room means more packs, which can cost a round of waves).
    Tiles only move where memory allows; a pool and wave whose layout would not fit (full
    packs spread over several ranks need their K/V received), or a pool of more than
    `max_pool_ranks` ranks (planner time: tiles grow with the pool's tokens), keeps libra's
    own groups. A TAP group synchronises its pool at every wave: a pool keeps TAP's groups
    only where the simulator's timing rule predicts them faster than libra's for the pool."""

    name = "libra_tap"
    handles_masks = True  # tiles are priced by their masked pairs

    def __init__(
        self,
        pool_size: int = 8,
        cp_size: Optional[int] = None,
        cp_scope: str = "step",
        tile_tokens: int = 4096,
        slack: float = 0.02,
        room: float = 0.0,
        max_pool_ranks: int = 16,
    ):

        if not 0 <= room < 1:
            raise ValueError(f"libra_tap: room {room} must be in [0, 1)")
        self.libra = LibraBalancer(pool_size=pool_size, cp_size=cp_size, cp_scope=cp_scope)
        self.options = TapOptions(tile_tokens=tile_tokens, slack=slack)
        self.room = room
        self.max_pool_ranks = max_pool_ranks

    def _layout(self, req: PlanRequest) -> PoolLayout:
        """VRSP's packs, pools and waves (libra.layout), packed with `room` to receive."""
        cl = req.cluster
        packed = req
        if self.room:
            cap = cl.max_tokens_per_rank
            tight = ClusterSpec(cl.world_size, max(1, int(cap * (1 - self.room))), cl.gpus_per_node, cl.max_group_size)
            try:  # pack with room to receive; a sample too long for that packs to the cap
                packed = PlanRequest(
                    req.sample_ids, req.lengths, tight, req.cost, req.seed, req.step, req.dataset_max_length
                )
            except SampleTooLongError:
                packed = req
        return self.libra.layout(packed)

    def lower_bound_ms(self, req: PlanRequest, bounds: BoundCache) -> Optional[float]:
        """No libra_tap plan of the request is faster (pools_lower_bound_ms over its own VRSP
        layout, which costs a few ms against TAP's tiles: auto skips libra_tap behind magi on
        GRPO-like steps, where it cost auto 6-17 ms of its 21-57 at worlds 4 and 8). None with
        vision work, whose memory fit may move samples (fit_vision_memory)."""
        if req.vision:
            return None
        return pools_lower_bound_ms(self._layout(req), req.length_array, bounds.local_ms, req.cost)

    def plan(self, req: PlanRequest) -> StepPlan:
        cap = req.cluster.max_tokens_per_rank
        lay = self._layout(req)
        N, P = lay.cp_size, lay.pool_size
        masks = request_masks(req)
        ids = req.sample_ids
        plan = req.empty_plan(self.name)
        plan.masks = {s: m for s, m in masks.items() if s in set(ids)}
        by_slot: Dict[int, Dict[int, List[Tuple[int, List[int]]]]] = {}  # slot -> pool -> [(pack, members)]
        for k in range(len(lay.packs)):
            rep = lay.replica_of_pack[k]
            pool = rep // P
            members = [(rep - pool * P) * N + j for j in range(N)]
            by_slot.setdefault(lay.slot_of_pack[k], {}).setdefault(pool, []).append((k, members))
        lens = dict(zip(ids, req.lengths))

        def libra_groups(pool: int, packs) -> List[Group]:
            ranks = tuple(range(pool * P * N, (pool + 1) * P * N))
            out = []
            for k, members in packs:
                rk = tuple(ranks[m] for m in members)
                pids = [ids[i] for i in lay.packs[k]]
                if N == 1:
                    out.append(Group(ranks=rk, local={rk[0]: pids}))
                else:
                    mode = pick_ring_mode(req.cost, [req.lengths[i] for i in lay.packs[k]], rk, cap)
                    out.append(Group(ranks=rk, distributed=pids, mode=mode))
            return out

        def tap_groups(pool: int, packs) -> Optional[List[Group]]:
            ranks = tuple(range(pool * P * N, (pool + 1) * P * N))
            if len(ranks) > self.max_pool_ranks:
                return None  # planner time: tiles grow with the pool's tokens
            seqs = [(lay.packs[k], members) for k, members in packs]
            pm = {i: masks[ids[i]] for docs, _ in seqs for i in docs if ids[i] in masks}
            tg = tap_pool(req.cost, ranks, seqs, req.lengths, pm, self.options, cap)
            local = {r: [ids[i] for i in v] for r, v in tg.local.items()}
            if tg.placement is None:  # nothing moves: every rank runs its documents alone
                return [Group(ranks=(r,), local={r: v}) for r, v in sorted(local.items())]
            group = blocks_group(ranks, [ids[i] for i in tg.distributed], tg.placement, local)
            return [group] if fits_memory(group, req, cap) else None

        # per pool, TAP's groups where they apply, then the pool's predicted time with them
        # against libra's own groups: a TAP group synchronises the pool every wave, which can
        # cost more than the balance it buys; the faster keeps the pool
        pools: Dict[int, Dict[int, Tuple[List[Group], List[Group]]]] = {}  # pool -> slot -> (libra, tap)
        for slot in sorted(by_slot):
            for pool, packs in sorted(by_slot[slot].items()):
                lib = libra_groups(pool, packs)
                pools.setdefault(pool, {})[slot] = (lib, tap_groups(pool, packs) or lib)
        chosen: Dict[Tuple[int, int], List[Group]] = {}
        for pool, slots in pools.items():
            t_lib = _pool_ms([slots[s][0] for s in sorted(slots)], lens, req.cost, plan.masks)
            t_tap = _pool_ms([slots[s][1] for s in sorted(slots)], lens, req.cost, plan.masks)
            pick = 1 if t_tap < t_lib - 1e-9 else 0
            for s, pair in slots.items():
                chosen[(s, pool)] = pair[pick]
        for slot in sorted(by_slot):
            groups = [g for pool in sorted(by_slot[slot]) for g in chosen[(slot, pool)]]
            plan.waves.append(Wave(sorted(groups, key=lambda g: g.ranks[0])))
        return fit_vision_memory(plan, req)  # within the cap with its encoders' activations


def _pool_ms(waves: Sequence[Sequence[Group]], lens, cost: CostModel, masks) -> float:
    """A pool's predicted time (hf_cp.cost.simulate's timing rule: a group starts when its last member is
    free and lasts as long as its slowest member) over its waves of groups."""

    clock: Dict[int, float] = {}
    overhead = cost.micro_batch_overhead_ms()
    for groups in waves:
        for g in groups:
            costs = group_costs(lens, g, cost, masks)
            start = max(clock.get(r, 0.0) for r in g.ranks)
            end = start + max(c.total_ms for c in costs) + overhead
            for r in g.ranks:
                clock[r] = end
    return max(clock.values()) if clock else 0.0


def pools_lower_bound_ms(lay: PoolLayout, lengths: Sequence[int], local_ms: Sequence[float], cost: CostModel) -> float:
    """No libra_tap plan built on VRSP's layout `lay` is faster under the simulator's timing rule
    (`local_ms`: every request sample's single-rank compute, masked by its area: BoundCache).

    Every wave of a pool runs one of three ways: TAP's one blocks group over all the pool's
    ranks (it starts when the pool's last rank is free), libra's own ring groups (each replica's
    pack on its N ranks), or, when no document of the wave spans two members, every rank alone.
    Take C, the latest clock of one replica's ranks. A TAP wave moves C on by at least its
    duration: the pool's work over its ranks, and the largest linear share a member owns
    (TAP moves attention, never rows), plus one micro-batch overhead. A ring group moves it on by
    at least the pack's work over N plus the overhead (the members' times sum to at least the
    pack's single-rank work: module bounds.py). So C grows by at least the smaller of the two
    every wave; a wave whose ranks may run alone adds nothing (N > 1) or the rank's own pack
    (N = 1: the replica is its one rank). Attention in a group counts at most
    cp_attention_scale of itself where calibration put that below 1."""
    N, R = lay.cp_size, lay.cp_size * lay.pool_size
    lin = linear_ms(cost, 1)
    overhead = cost.micro_batch_overhead_ms()
    scale = min(1.0, cost.profile.cp_attention_scale)
    best = 0.0
    for pool in lay.pools:
        waves: Dict[int, List[int]] = {}
        for k in pool:
            waves.setdefault(lay.slot_of_pack[k], []).append(k)
        clock: Dict[int, float] = {}  # replica -> the least its latest clock can be
        for packs in waves.values():
            # N > 1: the wave's ranks may run alone unless one of its documents spans two members
            work, widest, may_run_alone = {}, 0.0, N > 1
            for k in packs:
                lens = [int(lengths[i]) for i in lay.packs[k]]
                tokens = sum(lens)
                single = float(sum(local_ms[i] for i in lay.packs[k]))
                work[k] = lin * tokens + (single - lin * tokens) * scale
                if N == 1:
                    widest = max(widest, lin * tokens)
                    continue
                owners: Dict[int, set] = {}
                owned = [0] * N
                for m, seg in ring.zigzag_pieces(lens, N):
                    owners.setdefault(seg.doc, set()).add(m)
                    owned[m] += seg.length
                widest = max(widest, lin * max(owned))
                may_run_alone = may_run_alone and all(len(o) == 1 for o in owners.values())
            tap_ms = max(sum(work.values()) / R, widest) + overhead
            for k in packs:
                own = 0.0 if may_run_alone else work[k] / N + overhead
                rep = lay.replica_of_pack[k]
                clock[rep] = clock.get(rep, 0.0) + min(tap_ms, own)
        best = max([best] + list(clock.values()))
    return best


def fits_memory(group: Group, req: PlanRequest, cap: int) -> bool:
    """Whether every member's owned rows, local samples and received rows fit `cap`."""
    lens = dict(zip(req.sample_ids, req.lengths))
    for m, r in enumerate(group.ranks):
        t = group.blocks.member_tokens(m) + sum(lens[s] for s in group.local.get(r, []))
        if t + received_token_equivalent(group.blocks, m, req.cost) > cap:
            return False
    return True
