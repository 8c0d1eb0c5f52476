"""Attention masks as data: slices, the mask kinds that compile to them, and exact pair counts.

A sample's mask says which of its tokens (keys) each of its tokens (queries) attends to, in
sample-local positions 0..n-1. A sample without a mask is causal, as before.

A *slice* is (query range, key range, kind), in MagiAttention's sense. For query row i of
[q_start, q_end) the attended keys are one interval [lo(i), hi(i)) inside [k_start, k_end):

    full           lo = k_start                     hi = k_end
    causal         lo = k_start                     hi = k_end - (q_end - 1 - i)   (bottom-right aligned)
    inv_causal     lo = k_start + (i - q_start)     hi = k_end                     (top-left aligned)
    bi_causal      lo = k_start + (i - q_start)     hi = k_end - (q_end - 1 - i)   (both: a band)

clamped to the key range (a row may see no key of one slice). A mask is a list of slices whose
attended pairs never overlap; every query row must see at least one key.

`rect_pairs` is the one function that counts attended pairs of any (query range, key range)
rectangle. The cost model, the placement solvers and the executor all use it, so predicted
work and executed work agree. It runs in O(1) per slice (closed form on at most a few linear
pieces), which is what lets planners price millions of tokens.

Everything here is pure Python on integers: no torch, no numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple


class MaskError(ValueError):
    """A malformed mask; the message names the sample and the slice."""


class SliceKind(str, Enum):
    FULL = "full"
    CAUSAL = "causal"
    INV_CAUSAL = "inv_causal"
    BI_CAUSAL = "bi_causal"


@dataclass(frozen=True)
class AttnSlice:
    """Queries [q_start, q_end) attend keys [k_start, k_end) with `kind` (module docstring)."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    kind: SliceKind = SliceKind.FULL

    def __post_init__(self):
        kind = self.kind if type(self.kind) is SliceKind else SliceKind(self.kind)
        object.__setattr__(self, "kind", kind)
        for f in ("q_start", "q_end", "k_start", "k_end"):
            object.__setattr__(self, f, int(getattr(self, f)))
        # rect_pairs' coefficients, computed once: (q_start, q_end, k_start, k_end, p, r, a1, b1)
        # with a row's keys [b1 + r i, a1 + p i) before clamping (rect_pairs_of_slice)
        p = 1 if kind in (SliceKind.CAUSAL, SliceKind.BI_CAUSAL) else 0
        r = 1 if kind in (SliceKind.INV_CAUSAL, SliceKind.BI_CAUSAL) else 0
        a1 = self.k_end - self.q_end + 1 if p else self.k_end
        b1 = self.k_start - self.q_start if r else self.k_start
        object.__setattr__(self, "_rp", (self.q_start, self.q_end, self.k_start, self.k_end, p, r, a1, b1))

    @property
    def q_len(self) -> int:
        return self.q_end - self.q_start

    @property
    def k_len(self) -> int:
        return self.k_end - self.k_start

    def key_interval(self, i: int) -> Tuple[int, int]:
        """[lo, hi) of the keys query row i attends (empty when hi <= lo)."""
        lo, hi = self._raw_bounds(i)
        return max(lo, self.k_start), min(hi, self.k_end)

    def _raw_bounds(self, i: int) -> Tuple[int, int]:
        k = self.kind
        lo = self.k_start + (i - self.q_start) if k in (SliceKind.INV_CAUSAL, SliceKind.BI_CAUSAL) else self.k_start
        hi = self.k_end - (self.q_end - 1 - i) if k in (SliceKind.CAUSAL, SliceKind.BI_CAUSAL) else self.k_end
        return lo, hi

    def pairs(self) -> int:
        """Attended query-key pairs of the whole slice."""
        return rect_pairs_of_slice(self, self.q_start, self.q_end, self.k_start, self.k_end)

    def to_list(self) -> list:
        return [self.q_start, self.q_end, self.k_start, self.k_end, self.kind.value]

    @classmethod
    def from_list(cls, x: Sequence) -> AttnSlice:
        if len(x) != 5:
            raise MaskError(f"a slice is [q_start, q_end, k_start, k_end, kind], got {list(x)!r}")
        try:
            return cls(int(x[0]), int(x[1]), int(x[2]), int(x[3]), SliceKind(x[4]))
        except ValueError as e:
            raise MaskError(f"slice {list(x)!r}: {e}") from None


# --------------------------------------------------------------------------- exact pair counts
def _sum_positive_linear(alpha: int, beta: int, u: int, v: int) -> int:
    """sum over integer i in [u, v) of max(0, alpha + beta * i), beta in {-1, 0, 1}."""
    if v <= u:
        return 0
    if beta == 0:
        return (v - u) * alpha if alpha > 0 else 0
    if beta == 1:  # alpha + i > 0  <=>  i >= 1 - alpha
        a = max(u, 1 - alpha)
        if a >= v:
            return 0
        n = v - a
        first = alpha + a
        return n * first + n * (n - 1) // 2
    # beta == -1: alpha - i > 0  <=>  i <= alpha - 1
    b = min(v, alpha)
    if b <= u:
        return 0
    n = b - u
    first = alpha - u
    return n * first - n * (n - 1) // 2


def rect_pairs_of_slice(s: AttnSlice, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> int:
    """Attended pairs of slice `s` with query in [q_lo, q_hi) and key in [k_lo, k_hi)."""
    u, v = max(q_lo, s.q_start), min(q_hi, s.q_end)
    klo, khi = max(k_lo, s.k_start), min(k_hi, s.k_end)
    if u >= v or klo >= khi:
        return 0
    # count(i) = max(0, min(A(i), khi) - max(B(i), klo)) with A(i) = a1 + p*i, B(i) = b1 + r*i
    p = 1 if s.kind in (SliceKind.CAUSAL, SliceKind.BI_CAUSAL) else 0
    r = 1 if s.kind in (SliceKind.INV_CAUSAL, SliceKind.BI_CAUSAL) else 0
    a1 = s.k_end - s.q_end + 1 if p else s.k_end
    b1 = s.k_start - s.q_start if r else s.k_start
    # breakpoints where a clamp switches: A(i) = khi, B(i) = klo
    cuts = {u, v}
    if p:
        cuts.add(min(max(khi - a1, u), v))
    if r:
        cuts.add(min(max(klo - b1, u), v))
    bounds = sorted(cuts)
    total = 0
    for x, y in zip(bounds, bounds[1:]):
        if x >= y:
            continue
        # on [x, y) each clamp is decided by its value at x (A and B are non-decreasing)
        a_clamped = (a1 + p * x) >= khi
        b_clamped = (b1 + r * x) < klo or not r
        alpha = (khi if a_clamped else a1) - (klo if b_clamped else b1)
        beta = (0 if a_clamped else p) - (0 if b_clamped else r)
        total += _sum_positive_linear(alpha, beta, x, y)
    return total


def _clamped_run(x: int, w: int) -> int:
    """sum over t in [0, x) of min(t, w), for x >= 0 and w >= 1."""
    if x <= w + 1:
        return x * (x - 1) // 2
    return w * (w + 1) // 2 + (x - w - 1) * w


def rect_pairs(slices: Iterable[AttnSlice], q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> int:
    """Exact attended query-key pairs of a mask (its slices) inside one rectangle:
    queries [q_lo, q_hi) x keys [k_lo, k_hi). The one pair count of hf_cp."""
    # a planner counts many small rectangles of masks with many slices (a shared prompt's
    # answers), each touching a few: slices outside the rectangle are skipped, and full and
    # causal slices (what shared prompts, prefixes and block-causal masks compile to) are
    # counted inline, in the closed form rect_pairs_of_slice gives them
    total = 0
    for s in slices:
        qs, qe, ks, ke, p, r, a1, b1 = s._rp
        if qs >= q_hi or qe <= q_lo or ks >= k_hi or ke <= k_lo:
            continue
        if r:
            total += rect_pairs_of_slice(s, q_lo, q_hi, k_lo, k_hi)
            continue
        u = qs if qs > q_lo else q_lo
        v = qe if qe < q_hi else q_hi
        klo = ks if ks > k_lo else k_lo
        khi = ke if ke < k_hi else k_hi
        w = khi - klo
        if not p:  # full: every row sees all of [klo, khi)
            total += (v - u) * w
            continue
        # causal: row i sees min(a1 + i, khi) - klo keys when positive, i.e. min(t, w) for
        # t = a1 + i - klo once t >= 0
        x0, x1 = a1 + u - klo, a1 + v - klo
        if x1 > 0:
            total += _clamped_run(x1, w) - (_clamped_run(x0, w) if x0 > 0 else 0)
    return total


def attended_key_range(s: AttnSlice, q_lo: int, q_hi: int) -> Optional[Tuple[int, int]]:
    """[first, last + 1) of the keys that rows [q_lo, q_hi) of slice `s` attend, or None when
    none does. A row's keys [lo(i), hi(i)) have both ends non-decreasing and step by at most
    one, so the attended rows' keys are one contiguous range: from the first attending row's lo
    to the last one's hi. The same range as the union of clip_slices(s, q_lo, q_hi, ...)'s keys."""
    u, v = max(q_lo, s.q_start), min(q_hi, s.q_end)
    if u >= v:
        return None
    p = 1 if s.kind in (SliceKind.CAUSAL, SliceKind.BI_CAUSAL) else 0
    r = 1 if s.kind in (SliceKind.INV_CAUSAL, SliceKind.BI_CAUSAL) else 0
    # width hi(i) - lo(i) = w0 + (p - r) * i; the rows where it is >= 1 are one run [a, b)
    w0 = s.k_end - s.k_start - p * (s.q_end - 1) + r * s.q_start
    d = p - r
    if d == 0:
        a, b = (u, v) if w0 >= 1 else (u, u)
    elif d == 1:
        a, b = max(u, 1 - w0), v
    else:
        a, b = u, min(v, w0)
    if a >= b:
        return None
    return s.k_start + r * (a - s.q_start), s.k_end - p * (s.q_end - b)


# --------------------------------------------------------------------------- mask kinds
# A mask's slices as one hashable value (a block layout's per-sample slices, a cache key).
Slices = Tuple[AttnSlice, ...]

MASK_KINDS = ("causal", "sliding_window", "prefix_lm", "shared_prompt", "block_causal", "slices")


@dataclass(frozen=True)
class SampleMask:
    """A sample's attention pattern, as the user states it; `slices()` compiles it.

    kind           parameters
    causal         -
    sliding_window window: each query sees itself and the window-1 keys before it
    prefix_lm      prefix: the first `prefix` tokens see each other (bidirectional); later
                   tokens are causal over everything before them
    shared_prompt  prompt, answers (lengths): [prompt][answer 1]...[answer n]; the prompt is
                   causal, each answer sees the whole prompt and itself (causal), never another
                   answer. Positions of every answer continue from the end of the prompt.
    block_causal   block: tokens of block b see blocks 0..b in full (video / multimodal frames)
    slices         explicit: a list of AttnSlice
    """

    kind: str
    length: int
    window: int = 0
    prefix: int = 0
    prompt: int = 0
    answers: Tuple[int, ...] = ()
    block: int = 0
    explicit: Tuple[AttnSlice, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "answers", tuple(int(a) for a in self.answers))
        object.__setattr__(self, "explicit", tuple(self.explicit))

    def __hash__(self) -> int:
        # the fields' hash (what dataclass would make), computed once: masks key the planners'
        # caches (pair counts, costs on groups, priced groups), thousands of lookups a step
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(
                (self.kind, self.length, self.window, self.prefix, self.prompt, self.answers, self.block, self.explicit)
            )
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        # a string's hash differs between processes: a mask sent to a planner worker hashes anew
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    # ---- constructors
    @classmethod
    def causal(cls, length: int) -> SampleMask:
        return cls("causal", int(length))

    @classmethod
    def sliding_window(cls, length: int, window: int) -> SampleMask:
        return cls("sliding_window", int(length), window=int(window))

    @classmethod
    def prefix_lm(cls, length: int, prefix: int) -> SampleMask:
        return cls("prefix_lm", int(length), prefix=int(prefix))

    @classmethod
    def shared_prompt(cls, prompt: int, answers: Sequence[int]) -> SampleMask:
        answers = tuple(int(a) for a in answers)
        return cls("shared_prompt", int(prompt) + sum(answers), prompt=int(prompt), answers=answers)

    @classmethod
    def block_causal(cls, length: int, block: int) -> SampleMask:
        return cls("block_causal", int(length), block=int(block))

    @classmethod
    def from_slices(cls, length: int, slices: Sequence[AttnSlice]) -> SampleMask:
        return cls("slices", int(length), explicit=tuple(slices))

    # ---- compilation
    def slices(self) -> List[AttnSlice]:
        """The mask as non-overlapping slices over positions 0..length-1 (not validated).
        Compiled once per mask (a planner asks for the same masks' slices in every member)."""
        compiled = self.__dict__.get("_slices")
        if compiled is None:
            compiled = tuple(self._compile())
            object.__setattr__(self, "_slices", compiled)
        return list(compiled)

    def _compile(self) -> List[AttnSlice]:
        n, F, C, BI = self.length, SliceKind.FULL, SliceKind.CAUSAL, SliceKind.BI_CAUSAL
        if self.kind == "causal":
            return [AttnSlice(0, n, 0, n, C)]
        if self.kind == "sliding_window":
            w = self.window
            if w >= n:
                return [AttnSlice(0, n, 0, n, C)]
            # first w rows: causal; row i >= w sees [i - w + 1, i]: a band over keys [1, n)
            return [AttnSlice(0, w, 0, w, C), AttnSlice(w, n, 1, n, BI)]
        if self.kind == "prefix_lm":
            p = self.prefix
            out = [AttnSlice(0, p, 0, p, F)] if p > 0 else []
            if p < n:
                out.append(AttnSlice(p, n, 0, n, C))
            return out
        if self.kind == "shared_prompt":
            p = self.prompt
            out = [AttnSlice(0, p, 0, p, C)] if p > 0 else []
            start = p
            for a in self.answers:
                if p > 0:
                    out.append(AttnSlice(start, start + a, 0, p, F))
                out.append(AttnSlice(start, start + a, start, start + a, C))
                start += a
            return out
        if self.kind == "block_causal":
            b = self.block
            return [AttnSlice(s, min(s + b, n), 0, min(s + b, n), F) for s in range(0, n, b)]
        if self.kind == "slices":
            return list(self.explicit)
        raise MaskError(f"unknown mask kind {self.kind!r}; expected one of {MASK_KINDS}")

    def position_ids(self) -> List[int]:
        """Rotary positions of the sample's tokens: 0..n-1, except that every answer of a
        shared-prompt sample continues from the end of the prompt."""
        if self.kind != "shared_prompt":
            return list(range(self.length))
        pos = list(range(self.prompt))
        for a in self.answers:
            pos.extend(range(self.prompt, self.prompt + a))
        return pos

    def segments(self) -> List[Tuple[int, int]]:
        """(start, end) of the sample's independent sequences for target shifting: a token's
        target is the next token of its own segment. One segment unless shared-prompt, whose
        prompt and answers are separate segments (labels never cross answers)."""
        if self.kind != "shared_prompt":
            return [(0, self.length)]
        out, start = [(0, self.prompt)] if self.prompt else [], self.prompt
        for a in self.answers:
            out.append((start, start + a))
            start += a
        return out

    @property
    def is_causal(self) -> bool:
        """The plain causal pattern with positions 0..n-1 (a window as long as the sample, or a
        shared prompt with a single answer, is that)."""
        return (
            self.kind == "causal"
            or (self.kind == "sliding_window" and self.window >= self.length)
            or (self.kind == "shared_prompt" and len(self.answers) == 1)
        )

    def pairs(self) -> int:
        return rect_pairs(self.slices(), 0, self.length, 0, self.length)

    # ---- JSON
    def to_dict(self) -> dict:
        d: Dict[str, object] = {"kind": self.kind, "length": self.length}
        if self.kind == "sliding_window":
            d["window"] = self.window
        elif self.kind == "prefix_lm":
            d["prefix"] = self.prefix
        elif self.kind == "shared_prompt":
            d["prompt"], d["answers"] = self.prompt, list(self.answers)
        elif self.kind == "block_causal":
            d["block"] = self.block
        elif self.kind == "slices":
            d["slices"] = [s.to_list() for s in self.explicit]
        return d

    @classmethod
    def from_dict(cls, d: Mapping, sample: object = "?") -> SampleMask:
        if not isinstance(d, Mapping) or "kind" not in d:
            raise MaskError(f"sample {sample}: a mask is an object with a 'kind' (one of {MASK_KINDS}), got {d!r}")
        kind = d["kind"]
        known = {
            "causal": (),
            "sliding_window": ("window",),
            "prefix_lm": ("prefix",),
            "shared_prompt": ("prompt", "answers"),
            "block_causal": ("block",),
            "slices": ("slices",),
        }
        if kind not in known:
            raise MaskError(f"sample {sample}: unknown mask kind {kind!r}; expected one of {MASK_KINDS}")
        extra = set(d) - {"kind", "length", *known[kind]}
        if extra:
            raise MaskError(f"sample {sample}: mask kind {kind!r} takes {list(known[kind])}, not {sorted(extra)}")
        try:
            if kind == "shared_prompt":
                m = cls.shared_prompt(int(d["prompt"]), [int(a) for a in d["answers"]])
            elif kind == "slices":
                m = cls.from_slices(int(d["length"]), [AttnSlice.from_list(s) for s in d["slices"]])
            else:
                m = cls(
                    kind,
                    int(d["length"]),
                    window=int(d.get("window", 0)),
                    prefix=int(d.get("prefix", 0)),
                    block=int(d.get("block", 0)),
                )
        except KeyError as e:
            raise MaskError(f"sample {sample}: mask kind {kind!r} needs {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise MaskError(f"sample {sample}: malformed {kind!r} mask {dict(d)!r}: {e}") from None
        if "length" in d and int(d["length"]) != m.length:
            raise MaskError(f"sample {sample}: mask length {d['length']} but its parts add up to {m.length}")
        return m

    # ---- validation
    def validate(self, sample: object = "?", length: Optional[int] = None) -> SampleMask:
        """Raise MaskError naming the sample and the slice; return self when valid."""
        n = self.length
        if length is not None and int(length) != n:
            raise MaskError(f"sample {sample}: the mask covers {n} tokens but the sample has {length}")
        if n <= 0:
            raise MaskError(f"sample {sample}: mask length {n} must be positive")
        if self.kind == "prefix_lm" and not 0 <= self.prefix <= n:
            raise MaskError(f"sample {sample}: prefix_lm prefix {self.prefix} must be in [0, {n}]")
        for kind, param in (("sliding_window", "window"), ("block_causal", "block")):
            if self.kind == kind and getattr(self, param) < 1:
                raise MaskError(f"sample {sample}: {kind} {param} {getattr(self, param)} must be at least 1")
        if self.kind == "shared_prompt":
            if self.prompt < 0 or not self.answers or any(a <= 0 for a in self.answers):
                raise MaskError(
                    f"sample {sample}: shared_prompt needs a prompt length >= 0 and at least one answer, each of "
                    f"positive length; got prompt {self.prompt}, answers {list(self.answers)}"
                )
        validate_slices(self.slices(), n, sample)
        return self


def validate_slices(slices: Sequence[AttnSlice], length: int, sample: object = "?") -> None:
    """Ranges inside [0, length), no overlapping attended pairs, every query row sees a key."""
    for j, s in enumerate(slices):
        where = f"sample {sample}, slice {j} {s.to_list()}"
        if not (0 <= s.q_start < s.q_end <= length and 0 <= s.k_start < s.k_end <= length):
            raise MaskError(f"{where}: ranges must be non-empty and inside [0, {length})")
        if s.pairs() == 0:
            raise MaskError(f"{where}: attends no pair (a causal slice needs keys at or before its last query)")
    # per query row, the union of the slices' key intervals must be disjoint intervals;
    # rows change behaviour only at slice boundaries, so sweep events instead of rows
    events = sorted({0, length} | {x for s in slices for x in (s.q_start, s.q_end)})
    for lo, hi in zip(events, events[1:]):
        active = [(j, s) for j, s in enumerate(slices) if s.q_start <= lo and hi <= s.q_end]
        if not active:
            raise MaskError(f"sample {sample}: query rows [{lo}, {hi}) attend no key (no slice covers them)")
        for a in range(len(active)):
            for b in range(a + 1, len(active)):
                (ja, sa), (jb, sb) = active[a], active[b]
                clash = _overlap_row(sa, sb, lo, hi)
                if clash is not None:
                    raise MaskError(
                        f"sample {sample}: slices {ja} {sa.to_list()} and {jb} {sb.to_list()} both attend "
                        f"query {clash[0]} to key {clash[1]}; slices must not overlap"
                    )
        for i in (lo, hi - 1):  # the intervals are monotone in i: empty rows sit at the ends
            if all(s.key_interval(i)[0] >= s.key_interval(i)[1] for _, s in active):
                raise MaskError(f"sample {sample}: query row {i} attends no key")


def _overlap_row(a: AttnSlice, b: AttnSlice, lo: int, hi: int) -> Optional[Tuple[int, int]]:
    """A (query, key) both slices attend, for a query in [lo, hi), or None.

    Interval ends move by 0 or 1 per row, so the overlap length min(hi_a, hi_b) - max(lo_a, lo_b)
    is piecewise linear in the row with breakpoints where an end crosses another: checking the
    rows at those breakpoints (and the ends) finds any overlap."""
    cand = {lo, hi - 1}
    la0, ha0 = a._raw_bounds(0)
    lb0, hb0 = b._raw_bounds(0)
    slopes_a = (a._raw_bounds(1)[0] - la0, a._raw_bounds(1)[1] - ha0)
    slopes_b = (b._raw_bounds(1)[0] - lb0, b._raw_bounds(1)[1] - hb0)
    ends = [
        (la0, slopes_a[0]),
        (ha0, slopes_a[1]),
        (lb0, slopes_b[0]),
        (hb0, slopes_b[1]),
        (a.k_start, 0),
        (a.k_end, 0),
        (b.k_start, 0),
        (b.k_end, 0),
    ]
    for x in range(len(ends)):
        for y in range(x + 1, len(ends)):
            (c1, m1), (c2, m2) = ends[x], ends[y]
            if m1 != m2:  # c1 + m1 i = c2 + m2 i
                i = (c2 - c1) // (m1 - m2)
                for d in (-1, 0, 1):
                    if lo <= i + d < hi:
                        cand.add(i + d)
    for i in sorted(cand):
        la, ha = a.key_interval(i)
        lb, hb = b.key_interval(i)
        if max(la, lb) < min(ha, hb):
            return i, max(la, lb)
    return None


def masks_from_json(d: Optional[Mapping], lengths: Mapping[int, int]) -> Dict[int, SampleMask]:
    """{sample id (str or int): mask dict} -> validated masks, checked against the lengths."""
    out: Dict[int, SampleMask] = {}
    for k, v in (d or {}).items():
        sid = int(k)
        if sid not in lengths:
            raise MaskError(f"a mask is given for sample {sid}, which is not in the step")
        out[sid] = SampleMask.from_dict(v, sid).validate(sid, lengths[sid])
    return out


# --------------------------------------------------------------------------- clipping and intersection
# A region of rows [u, v) whose row i attends keys [max(lo funcs)(i), min(hi funcs)(i)), each
# func an affine a + s*i with slope s in {0, 1}. Slices, rectangles and sliding windows are all
# such bounds, so one routine clips a mask to a rectangle, intersects two masks or applies a
# layer's window, and returns *tight* slices: every row of a result slice sees at least one
# key and no clamp of the slice's definition is active, so its kind follows the slopes of
# its bounds alone (the kernels rely on that).
Affine = Tuple[int, int]  # (a, s): a + s * i


def _slice_bounds(s: AttnSlice) -> Tuple[List[Affine], List[Affine]]:
    lo: List[Affine] = [(s.k_start, 0)]
    hi: List[Affine] = [(s.k_end, 0)]
    if s.kind in (SliceKind.INV_CAUSAL, SliceKind.BI_CAUSAL):
        lo.append((s.k_start - s.q_start, 1))
    if s.kind in (SliceKind.CAUSAL, SliceKind.BI_CAUSAL):
        hi.append((s.k_end - s.q_end + 1, 1))
    return lo, hi


def _pick(funcs: Sequence[Affine], x: int, largest: bool) -> Affine:
    """The func that is the max (or min) on rows [x, next breakpoint): ties at x go to the one
    that wins just after x (no two funcs cross strictly inside a piece)."""
    if largest:
        return max(funcs, key=lambda f: (f[0] + f[1] * x, f[1]))
    return min(funcs, key=lambda f: (f[0] + f[1] * x, f[1]))


def _tight_slices(u: int, v: int, lo: Sequence[Affine], hi: Sequence[Affine]) -> List[AttnSlice]:
    if u >= v:
        return []
    funcs = list(lo) + list(hi)
    cuts = {u, v}
    for i in range(len(funcs)):
        for j in range(i + 1, len(funcs)):
            (a1, s1), (a2, s2) = funcs[i], funcs[j]
            if s1 != s2:  # slopes differ by one: they cross at an integer row
                for x in ((a2 - a1) // (s1 - s2), (a2 - a1 + 1) // (s1 - s2)):
                    if u < x < v:
                        cuts.add(x)
    bounds = sorted(cuts)
    pieces: List[Tuple[int, int, Affine, Affine]] = []
    for x, y in zip(bounds, bounds[1:]):
        (la, ls), (ha, hs) = _pick(lo, x, True), _pick(hi, x, False)
        # width hi - lo is affine on [x, y): keep the rows where it is at least 1
        w0, dw = (ha + hs * x) - (la + ls * x), hs - ls
        if dw == 0:
            a, b = (x, y) if w0 >= 1 else (x, x)
        elif dw > 0:
            a, b = max(x, x + 1 - w0), y
        else:
            a, b = x, min(y, x + w0)
        if a < b:
            if pieces and pieces[-1][1] == a and pieces[-1][2] == (la, ls) and pieces[-1][3] == (ha, hs):
                pieces[-1] = (pieces[-1][0], b, (la, ls), (ha, hs))
            else:
                pieces.append((a, b, (la, ls), (ha, hs)))
    out = []
    for a, b, (la, ls), (ha, hs) in pieces:
        kind = {
            (0, 0): SliceKind.FULL,
            (0, 1): SliceKind.CAUSAL,
            (1, 0): SliceKind.INV_CAUSAL,
            (1, 1): SliceKind.BI_CAUSAL,
        }[(ls, hs)]
        out.append(AttnSlice(a, b, la + ls * a, ha + hs * (b - 1), kind))
    return out


def clip_slices(slices: Iterable[AttnSlice], q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> List[AttnSlice]:
    """The mask restricted to queries [q_lo, q_hi) x keys [k_lo, k_hi), as tight slices (in the
    mask's own positions). Their pairs add up to rect_pairs of the same rectangle."""
    out: List[AttnSlice] = []
    for s in slices:
        lo, hi = _slice_bounds(s)
        out.extend(_tight_slices(max(q_lo, s.q_start), min(q_hi, s.q_end), lo + [(k_lo, 0)], hi + [(k_hi, 0)]))
    return out


def intersect_slices(a: Iterable[AttnSlice], b: Iterable[AttnSlice]) -> List[AttnSlice]:
    """Pairs attended under both masks, as tight slices."""
    b = list(b)
    out: List[AttnSlice] = []
    for sa in a:
        la, ha = _slice_bounds(sa)
        for sb in b:
            u, v = max(sa.q_start, sb.q_start), min(sa.q_end, sb.q_end)
            if u < v:
                lb, hb = _slice_bounds(sb)
                out.extend(_tight_slices(u, v, la + lb, ha + hb))
    return out


def position_offsets(mask: SampleMask) -> List[Tuple[int, int, int]]:
    """(start, end, position - index) of the runs where a token's rotary position is its index
    plus a constant: one run, except for a shared-prompt sample's answers."""
    if mask.kind != "shared_prompt":
        return [(0, mask.length, 0)]
    out = [(0, mask.prompt, 0)] if mask.prompt else []
    start = mask.prompt
    for a in mask.answers:
        out.append((start, start + a, mask.prompt - start))
        start += a
    return out


def window_slices(mask: SampleMask, window: Optional[int]) -> List[AttnSlice]:
    """The sample's mask under a layer's sliding window: a query at position p keeps only keys
    at positions in (p - window, p], positions being the rotary ones (a shared-prompt answer
    counts its distance to the prompt from its own position, as when trained on its own).
    None or a window at least the sample's length leaves the mask as it is."""
    slices = mask.slices()
    if window is None or window >= mask.length:
        return slices
    if window < 1:
        raise MaskError(f"a sliding window must be at least 1 token, got {window}")
    runs = position_offsets(mask)

    def offset(lo: int, hi: int, what: str, s: AttnSlice) -> int:
        for a, b, d in runs:
            if a <= lo and hi <= b:
                return d
        raise MaskError(
            f"slice {s.to_list()}: its {what} range [{lo}, {hi}) spans tokens of different position runs; "
            "a sliding window cannot be applied to it"
        )

    out: List[AttnSlice] = []
    for s in slices:
        dq = offset(s.q_start, s.q_end, "query", s)
        dk = offset(s.k_start, s.k_end, "key", s)
        # (i + dq) - (k + dk) < window  <=>  k >= i + dq - dk - window + 1
        lo, hi = _slice_bounds(s)
        out.extend(_tight_slices(s.q_start, s.q_end, lo + [(dq - dk - window + 1, 1)], hi))
    return out
