"""Block plans: a CP group's distributed samples as owned chunks and placed compute blocks.

The "blocks" shard mode (issue 15; MagiAttention, DCP and Libra TAP place attention this way).
Plain data, JSON inside a StepPlan group:

    "blocks": {"chunks":  [[doc, start, length, owner], ...],
               "compute": [[q_chunk, k_chunk, head_start, head_end, executor], ...]}

- `doc` indexes the group's `distributed` list; `start`/`length` are sample-local positions;
  `owner` and `executor` are member indices. A chunk never spans samples; the chunks of a
  sample cover it exactly once, in any order and with any owners. The owner holds the chunk's
  Q, K, V, O and labels; a member's rows are its local documents, then the chunks it owns in
  the order they appear in `chunks`.
- A compute entry is the attention of q_chunk's queries over k_chunk's keys (the sample's mask
  restricted to that rectangle) for query heads [head_start, head_end), run by `executor`. The
  default executor is the query chunk's owner; elsewhere, the executor receives the Q rows and
  returns a partial output with its log-sum-exp.

Ulysses, ring zigzag and ring per-document are placements of this format (constructors below),
so the engine can be checked against them. Torch-free: pure functions on integers.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

from hf_cp.modes.ring import per_doc_pieces, zigzag_pieces
from hf_cp.modes.segments import Segment
from hf_cp.modes.ulysses import contiguous_segments
from hf_cp.samples.masks import AttnSlice, SampleMask, SliceKind, Slices, attended_key_range, rect_pairs

PARTIAL_BYTES = 4  # partial outputs, log-sum-exp and gradient partials travel in float32


class BlockLayoutError(ValueError):
    """A block layout breaks the format's rules; the message names the sample, chunk and block."""


class Chunk(NamedTuple):
    doc: int
    start: int
    length: int
    owner: int


class ComputeBlock(NamedTuple):
    q_chunk: int
    k_chunk: int
    head_start: int
    head_end: int
    executor: int


def causal_slices(length: int) -> Slices:
    return (AttnSlice(0, length, 0, length, SliceKind.CAUSAL),)


def doc_slices(lengths: Sequence[int], masks: Optional[Sequence[Optional[SampleMask]]] = None) -> List[Slices]:
    """Each document's mask as slices (a document without a mask is causal)."""
    masks = list(masks or [])
    out = []
    for d, n in enumerate(lengths):
        m = masks[d] if d < len(masks) else None
        out.append(tuple(m.slices()) if m is not None else causal_slices(n))
    return out


@dataclass(frozen=True)
class BlockLayout:
    chunks: Tuple[Chunk, ...]
    compute: Tuple[ComputeBlock, ...]
    # Optional schedule (DCP's divisions, balance/balancers/dcp/divisions.py): the division of every compute entry;
    # the transfers a division needs overlap the previous division's computation
    # (cost.blocks.division_comm_ms). None: one exchange before the computation.
    divisions: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        object.__setattr__(self, "chunks", tuple(Chunk(*(int(x) for x in c)) for c in self.chunks))
        object.__setattr__(self, "compute", tuple(ComputeBlock(*(int(x) for x in b)) for b in self.compute))
        if self.divisions is not None:
            object.__setattr__(self, "divisions", tuple(int(x) for x in self.divisions))

    # ---- JSON
    def to_dict(self) -> dict:
        d = {"chunks": [list(c) for c in self.chunks], "compute": [list(b) for b in self.compute]}
        if self.divisions is not None:
            d["divisions"] = list(self.divisions)
        return d

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "blocks") -> BlockLayout:
        if not isinstance(d, Mapping) or not {"chunks", "compute"} <= set(d) <= {"chunks", "compute", "divisions"}:
            got = sorted(d) if isinstance(d, Mapping) else type(d).__name__
            raise BlockLayoutError(
                f"{where}: expected an object with 'chunks' and 'compute' (and optionally 'divisions'), got {got}"
            )
        try:
            chunks = [Chunk(*(int(x) for x in c)) for c in d["chunks"]]
            compute = [ComputeBlock(*(int(x) for x in b)) for b in d["compute"]]
        except (TypeError, ValueError) as e:
            raise BlockLayoutError(
                f"{where}: chunks are [doc, start, length, owner] and compute entries "
                f"[q_chunk, k_chunk, head_start, head_end, executor] of integers ({e})"
            ) from None
        divisions = None
        if "divisions" in d:
            try:
                divisions = tuple(int(x) for x in d["divisions"])
            except (TypeError, ValueError) as e:
                raise BlockLayoutError(f"{where}: divisions are one integer per compute entry ({e})") from None
        return cls(tuple(chunks), tuple(compute), divisions)

    # ---- lookups
    @property
    def num_heads(self) -> int:
        """The query heads the compute entries cover (their largest head_end)."""
        return max((b.head_end for b in self.compute), default=0)

    def member_chunks(self, member: int) -> List[int]:
        """Indices of the chunks `member` owns, in its row order."""
        return [i for i, c in enumerate(self.chunks) if c.owner == member]

    def member_segments(self, member: int) -> List[Segment]:
        return [Segment(c.doc, c.start, c.length) for c in self.chunks if c.owner == member]

    def member_tokens(self, member: int) -> int:
        return sum(c.length for c in self.chunks if c.owner == member)

    def received_chunks(self, member: int) -> Tuple[List[int], List[int]]:
        """(K/V chunks, Q chunks) that `member` receives from their owners to run its blocks."""
        kv: Set[int] = set()
        q: Set[int] = set()
        for b in self.compute:
            if b.executor == member:
                if self.chunks[b.k_chunk].owner != member:
                    kv.add(b.k_chunk)
                if self.chunks[b.q_chunk].owner != member:
                    q.add(b.q_chunk)
        return sorted(kv), sorted(q)

    def kv_transfers(self) -> int:
        """K/V chunk sends of one forward pass: (chunk, executor) pairs with the executor not
        the chunk's owner (each chunk goes once to each member that needs it)."""
        return len({(b.k_chunk, b.executor) for b in self.compute if self.chunks[b.k_chunk].owner != b.executor})

    def q_transfers(self) -> int:
        return len({(b.q_chunk, b.executor) for b in self.compute if self.chunks[b.q_chunk].owner != b.executor})

    # ---- validation
    def validate(
        self,
        doc_lengths: Sequence[int],
        group_size: int,
        slices: Optional[Sequence[Slices]] = None,
        num_heads: Optional[int] = None,
        sample_ids: Optional[Sequence[int]] = None,
    ) -> BlockLayout:
        """Raise BlockLayoutError naming the sample, chunk and block; return self when valid.

        Checks: chunks inside their samples and covering each exactly once; owners and
        executors are members; every (query chunk, key chunk) pair with attended pairs under the
        sample's mask (rect_pairs) appears, its head ranges partitioning [0, num_heads) exactly
        once; no entry has a zero area. Without num_heads, the heads are the layout's own
        (its largest head_end), and every pair must cover them all.
        """
        g = group_size
        names = list(sample_ids) if sample_ids is not None else list(range(len(doc_lengths)))
        slices = list(slices) if slices is not None else [causal_slices(n) for n in doc_lengths]

        def sample(d: int) -> str:
            return f"sample {names[d]}"

        per_doc: Dict[int, List[Tuple[int, int]]] = {}
        for i, c in enumerate(self.chunks):
            if not 0 <= c.doc < len(doc_lengths):
                raise BlockLayoutError(
                    f"chunk {i} {list(c)}: doc {c.doc} is not one of the group's {len(doc_lengths)} distributed samples"
                )
            n = doc_lengths[c.doc]
            if c.length < 1 or c.start < 0 or c.start + c.length > n:
                raise BlockLayoutError(
                    f"{sample(c.doc)}, chunk {i} {list(c)}: tokens [{c.start}, {c.start + c.length}) are not a "
                    f"non-empty range inside the sample's {n} tokens"
                )
            if not 0 <= c.owner < g:
                raise BlockLayoutError(f"{sample(c.doc)}, chunk {i}: owner {c.owner} is not a member (0..{g - 1})")
            per_doc.setdefault(c.doc, []).append((c.start, i))
        for d, n in enumerate(doc_lengths):
            pos = 0
            for start, i in sorted(per_doc.get(d, [])):
                if start < pos:
                    raise BlockLayoutError(f"{sample(d)}: chunk {i} starts at token {start}, inside an earlier chunk")
                if start > pos:
                    raise BlockLayoutError(f"{sample(d)}: tokens [{pos}, {start}) are in no chunk")
                pos = start + self.chunks[i].length
            if pos != n:
                raise BlockLayoutError(f"{sample(d)}: tokens [{pos}, {n}) are in no chunk")
        heads = self.num_heads if num_heads is None else int(num_heads)
        if self.divisions is not None and (
            len(self.divisions) != len(self.compute) or any(x < 0 for x in self.divisions)
        ):
            raise BlockLayoutError(
                f"divisions: {len(self.divisions)} entries for {len(self.compute)} compute entries; one "
                f"non-negative division per compute entry"
            )
        ranges: Dict[Tuple[int, int], List[Tuple[int, int, int]]] = {}
        nc = len(self.chunks)
        for j, b in enumerate(self.compute):
            if not (0 <= b.q_chunk < nc and 0 <= b.k_chunk < nc):
                raise BlockLayoutError(f"block {j} {list(b)}: chunk index outside the {nc} chunks")
            cq, ck = self.chunks[b.q_chunk], self.chunks[b.k_chunk]
            where = f"{sample(cq.doc)}, block {j} {list(b)}"
            if cq.doc != ck.doc:
                raise BlockLayoutError(
                    f"block {j} {list(b)}: query chunk {b.q_chunk} is of {sample(cq.doc)} but key chunk "
                    f"{b.k_chunk} of {sample(ck.doc)}; a block pairs chunks of one sample"
                )
            if not 0 <= b.head_start < b.head_end <= heads:
                raise BlockLayoutError(f"{where}: heads [{b.head_start}, {b.head_end}) are not inside [0, {heads})")
            if not 0 <= b.executor < g:
                raise BlockLayoutError(f"{where}: executor {b.executor} is not a member (0..{g - 1})")
            ranges.setdefault((b.q_chunk, b.k_chunk), []).append((b.head_start, b.head_end, j))
        needed = set(attended_chunk_pairs(self.chunks, slices))
        for (qc, kc), hs in sorted(ranges.items()):
            d = self.chunks[qc].doc
            if (qc, kc) not in needed:
                j = hs[0][2]
                raise BlockLayoutError(
                    f"{sample(d)}, block {j} {list(self.compute[j])}: queries of chunk {qc} attend no key of chunk "
                    f"{kc} under the sample's mask (zero area); leave the pair out"
                )
            pos = 0
            for a, b, j in sorted(hs):
                if a != pos:
                    what = "overlap" if a < pos else "leave a gap"
                    raise BlockLayoutError(
                        f"{sample(d)}, block {j} {list(self.compute[j])}: the head ranges of chunks {qc} x {kc} "
                        f"{what} at head {min(a, pos)}; they must partition [0, {heads}) exactly once"
                    )
                pos = b
            if pos != heads:
                raise BlockLayoutError(
                    f"{sample(d)}: chunks {qc} x {kc} have heads [{pos}, {heads}) in no block; the head ranges of a "
                    f"pair must partition [0, {heads})"
                )
        missing = sorted(needed - set(ranges))
        if missing:
            qc, kc = missing[0]
            raise BlockLayoutError(
                f"{sample(self.chunks[qc].doc)}: queries of chunk {qc} attend keys of chunk {kc} but no block computes "
                f"them ({len(missing)} such pairs missing)"
            )
        return self


# --------------------------------------------------------------------------- which chunk pairs attend
def attended_chunk_pairs(chunks: Sequence[Chunk], slices: Sequence[Slices]) -> Iterable[Tuple[int, int]]:
    """(q chunk, k chunk) pairs of the same sample with at least one attended pair.

    A slice's rows in a query chunk see one contiguous key range (masks.attended_key_range), so
    per query chunk the key chunks it needs come from bisecting each slice's range: no
    pair-by-pair count and no clipping, which keeps long samples cut in many chunks cheap.
    """
    by_doc: Dict[int, List[Tuple[int, int]]] = {}
    for i, c in enumerate(chunks):
        by_doc.setdefault(c.doc, []).append((c.start, i))
    starts_of: Dict[int, List[int]] = {}
    for d, items in by_doc.items():
        items.sort()
        starts_of[d] = [s for s, _ in items]
    for i, c in enumerate(chunks):
        items, starts = by_doc[c.doc], starts_of[c.doc]
        seen: Set[int] = set()
        lo, hi = c.start, c.start + c.length
        for s in slices[c.doc]:
            if s.q_start >= hi or s.q_end <= lo:  # none of its rows in the chunk
                continue
            keys = attended_key_range(s, lo, hi)
            if keys is None:
                continue
            first = max(0, bisect.bisect_right(starts, keys[0]) - 1)
            last = bisect.bisect_left(starts, keys[1])
            if last - first == 1:
                seen.add(items[first][1])
            else:
                seen.update([items[x][1] for x in range(first, last)])
        for k in sorted(seen):
            yield i, k


def block_area(chunks: Sequence[Chunk], slices: Sequence[Slices], q_chunk: int, k_chunk: int) -> int:
    """Attended query-key pairs of one (q chunk, k chunk) rectangle (all heads count once)."""
    q, k = chunks[q_chunk], chunks[k_chunk]
    if q.doc != k.doc:
        return 0
    return rect_pairs(slices[q.doc], q.start, q.start + q.length, k.start, k.start + k.length)


# --------------------------------------------------------------------------- constructors
Executor = Callable[[int, int, Chunk, Chunk], int]  # (q chunk, k chunk, q, k) -> member


def layout_from_chunks(
    chunks: Sequence[Chunk],
    doc_lengths: Sequence[int],
    num_heads: int,
    slices: Optional[Sequence[Slices]] = None,
    executor: Optional[Executor] = None,
) -> BlockLayout:
    """Every attended (q chunk, k chunk) pair as one block over all heads, run by `executor`
    (default: the query chunk's owner)."""
    slices = list(slices) if slices is not None else [causal_slices(n) for n in doc_lengths]
    chunks = [Chunk(*c) for c in chunks]
    compute = []
    for qi, ki in sorted(attended_chunk_pairs(chunks, slices)):
        e = chunks[qi].owner if executor is None else executor(qi, ki, chunks[qi], chunks[ki])
        compute.append(ComputeBlock(qi, ki, 0, num_heads, e))
    return BlockLayout(tuple(chunks), tuple(compute))


def contiguous_chunks(doc_lengths: Sequence[int], group_size: int) -> List[Chunk]:
    """The packed sequence in g contiguous pieces, member m holding piece m (cut at sample ends:
    ulysses.contiguous_segments)."""
    return [
        Chunk(s.doc, s.start, s.length, m)
        for m in range(group_size)
        for s in contiguous_segments(doc_lengths, group_size, m)
    ]


def zigzag_chunks(doc_lengths: Sequence[int], group_size: int) -> List[Chunk]:
    """Ring zigzag's geometry (ring.zigzag_pieces): the packed sequence in 2g pieces, member r
    holding r and 2g-1-r."""
    return [Chunk(s.doc, s.start, s.length, m) for m, s in zigzag_pieces(doc_lengths, group_size)]


def per_doc_chunks(doc_lengths: Sequence[int], group_size: int) -> List[Chunk]:
    """Ring per-document geometry (ring.per_doc_pieces): each sample in 2g parts, member r
    holding parts r and 2g-1-r."""
    return [Chunk(s.doc, s.start, s.length, m) for m, s in per_doc_pieces(doc_lengths, group_size)]


def contiguous_layout(doc_lengths, group_size, num_heads, slices=None) -> BlockLayout:
    """The identity placement: contiguous token pieces, every block run by its query's owner."""
    return layout_from_chunks(contiguous_chunks(doc_lengths, group_size), doc_lengths, num_heads, slices)


def zigzag_layout(doc_lengths, group_size, num_heads, slices=None) -> BlockLayout:
    return layout_from_chunks(zigzag_chunks(doc_lengths, group_size), doc_lengths, num_heads, slices)


def per_doc_layout(doc_lengths, group_size, num_heads, slices=None) -> BlockLayout:
    return layout_from_chunks(per_doc_chunks(doc_lengths, group_size), doc_lengths, num_heads, slices)


def ulysses_layout(doc_lengths, group_size, num_heads, slices=None) -> BlockLayout:
    """Ulysses as blocks: contiguous pieces, each block split into g equal head ranges, range j
    run by member j (it receives the Q and K/V of those heads and returns their outputs)."""
    g = group_size
    if num_heads % g:
        raise BlockLayoutError(f"Ulysses as blocks splits {num_heads} query heads over {g} members: not divisible")
    base = contiguous_layout(doc_lengths, g, num_heads, slices)
    h = num_heads // g
    compute = [ComputeBlock(b.q_chunk, b.k_chunk, j * h, (j + 1) * h, j) for b in base.compute for j in range(g)]
    return BlockLayout(base.chunks, tuple(compute))


def random_layout(
    doc_lengths: Sequence[int],
    group_size: int,
    num_heads: int,
    slices: Optional[Sequence[Slices]] = None,
    seed: int = 0,
    max_chunks_per_doc: int = 6,
    split_heads: bool = False,
) -> BlockLayout:
    """Random cuts, owners in a random permutation order (chunks listed shuffled) and, with
    split_heads, blocks split into random head ranges run by random members; otherwise each
    block runs on its query's owner. For tests: any valid placement must compute the same."""
    rng = random.Random(seed)
    g = group_size
    chunks: List[Chunk] = []
    for d, n in enumerate(doc_lengths):
        k = rng.randint(1, max(1, min(max_chunks_per_doc, n)))
        cuts = sorted(rng.sample(range(1, n), k - 1)) if n > 1 else []
        for a, b in zip([0] + cuts, cuts + [n]):
            chunks.append(Chunk(d, a, b - a, rng.randrange(g)))
    rng.shuffle(chunks)
    base = layout_from_chunks(chunks, doc_lengths, num_heads, slices)
    if not split_heads:
        return base
    compute = []
    for b in base.compute:
        cuts = sorted(rng.sample(range(1, num_heads), rng.randint(0, min(2, num_heads - 1))))
        for a, e in zip([0] + cuts, cuts + [num_heads]):
            compute.append(ComputeBlock(b.q_chunk, b.k_chunk, a, e, rng.randrange(g)))
    return BlockLayout(base.chunks, tuple(compute))


def all_remote_layout(layout: BlockLayout, group_size: int, seed: int = 0) -> BlockLayout:
    """The same chunks with every block run by a member that does not own its query chunk
    (Q travels to the executor and the partial output comes back)."""
    if group_size < 2:
        raise BlockLayoutError("every block away from its query's owner needs at least 2 members")
    rng = random.Random(seed)
    compute = []
    for b in layout.compute:
        owner = layout.chunks[b.q_chunk].owner
        compute.append(b._replace(executor=(owner + rng.randint(1, group_size - 1)) % group_size))
    return BlockLayout(layout.chunks, tuple(compute))


def ring_kv_transfers(layout: BlockLayout, group_size: int) -> int:
    """K/V chunk sends of one forward pass if the same chunks went round a ring: every chunk
    travels g-1 hops, needed or not."""
    return len(layout.chunks) * (group_size - 1)


# --------------------------------------------------------------------------- one layer's exchange
@dataclass(frozen=True)
class LayerExchange:
    """What moves in one layer under a block layout and that layer's masks (torch-free: the
    engine executes it and the cost model prices it, so bytes predicted are bytes sent).

    blocks: indices of the compute entries with attended pairs under this layer's slices (a
            sliding-window layer may leave some of the plan's blocks empty: they are skipped);
    kv:     (chunk, executor, kv_head_start, kv_head_end) for K/V an executor receives from the
            chunk's owner: the hull of the kv heads its blocks on that chunk use;
    q:      (chunk, executor, head_start, head_end) for query rows run away from their owner.
    Both sorted, which is the order pieces travel in.
    """

    blocks: Tuple[int, ...]
    kv: Tuple[Tuple[int, int, int, int], ...]
    q: Tuple[Tuple[int, int, int, int], ...]


def layer_exchange(layout: BlockLayout, slices: Sequence[Slices], num_heads: int, num_kv_heads: int) -> LayerExchange:
    if num_heads % num_kv_heads:
        raise BlockLayoutError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    rep = num_heads // num_kv_heads
    needed = set(attended_chunk_pairs(layout.chunks, slices))
    active, covered = [], set()
    kv: Dict[Tuple[int, int], List[int]] = {}
    q: Dict[Tuple[int, int], List[int]] = {}

    def hull(d, key, a, b):
        h = d.setdefault(key, [a, b])
        h[0], h[1] = min(h[0], a), max(h[1], b)

    for j, b in enumerate(layout.compute):
        if (b.q_chunk, b.k_chunk) not in needed:
            continue
        active.append(j)
        covered.add((b.q_chunk, b.k_chunk))
        if layout.chunks[b.k_chunk].owner != b.executor:
            hull(kv, (b.k_chunk, b.executor), b.head_start // rep, (b.head_end - 1) // rep + 1)
        if layout.chunks[b.q_chunk].owner != b.executor:
            hull(q, (b.q_chunk, b.executor), b.head_start, b.head_end)
    missing = needed - covered
    if missing:
        qc, kc = min(missing)
        raise BlockLayoutError(
            f"this layer's mask needs queries of chunk {qc} against keys of chunk {kc}, which no block of the "
            f"layout computes ({len(missing)} pairs missing): the layout was made for another mask"
        )
    return LayerExchange(
        tuple(active),
        tuple((c, e, a, b) for (c, e), (a, b) in sorted(kv.items())),
        tuple((c, e, a, b) for (c, e), (a, b) in sorted(q.items())),
    )


# --------------------------------------------------------------------------- a member's memory
# A blocks-group member holds its owned rows plus, for one layer at a time, the K/V and Q rows
# it receives. `held_tokens` is the one count of that, in tokens of activation memory:
# StepPlan.validate checks it against the cap, the simulator reports it as the peak, and the
# planners that place blocks (dcp, tap, relayout) plan against it. Two counts drift.
def received_row_bytes(cost) -> Tuple[int, int]:
    """Bytes one received row holds for one layer: (a K/V row with its fp32 dK/dV partials,
    a Q row with dO, O, the log-sum-exp and the fp32 dQ)."""
    dims, e = cost.dims, cost.profile.bytes_per_element
    kv_row = 2 * dims.num_kv_heads * dims.head_dim * (e + PARTIAL_BYTES)
    q_row = dims.num_heads * (dims.head_dim * (3 * e + PARTIAL_BYTES) + PARTIAL_BYTES)
    return kv_row, q_row


def held_tokens(owned, kv_rows, q_rows, cost):
    """Tokens a member holds: `owned` (its chunks' rows and local samples' tokens) plus the
    `kv_rows` K/V rows and `q_rows` Q rows it receives, priced by their bytes of one layer
    (received_row_bytes) in tokens of whole-model activation memory, rounded up. Those buffers
    live for one layer at a time; the engine re-sends them in backward. Integers, or integer
    numpy arrays elementwise (one value per rank)."""
    kv_row, q_row = received_row_bytes(cost)
    per_token = int(cost.profile.activation_bytes_per_token)
    return owned + -(-(kv_rows * kv_row + q_rows * q_row) // per_token)


def received_rows(layout: BlockLayout, group_size: int) -> Tuple[List[int], List[int]]:
    """(K/V rows, Q rows) every member receives to run its blocks: the rows of the chunks it
    uses but does not own, each chunk once per member (one pass over the compute entries)."""
    chunks = layout.chunks
    kv: Set[Tuple[int, int]] = set()
    q: Set[Tuple[int, int]] = set()
    for b in layout.compute:
        e = b.executor
        if chunks[b.k_chunk].owner != e:
            kv.add((b.k_chunk, e))
        if chunks[b.q_chunk].owner != e:
            q.add((b.q_chunk, e))
    kv_rows, q_rows = [0] * group_size, [0] * group_size
    for c, e in kv:
        kv_rows[e] += chunks[c].length
    for c, e in q:
        q_rows[e] += chunks[c].length
    return kv_rows, q_rows


def received_token_equivalent(layout: BlockLayout, member: int, cost) -> int:
    """The member's received K/V and Q rows of one layer in tokens of activation memory
    (held_tokens of nothing owned). For every member at once, received_rows is one pass."""
    kv, q = layout.received_chunks(member)
    return held_tokens(0, sum(layout.chunks[c].length for c in kv), sum(layout.chunks[c].length for c in q), cost)
