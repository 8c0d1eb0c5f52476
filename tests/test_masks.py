"""Masks as data: every kind compiles to slices whose dense form is the intended pattern, and
rect_pairs counts exactly what a dense mask counts, for any rectangle."""

import pickle
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_cp.samples.masks import (
    AttnSlice,
    MaskError,
    SampleMask,
    SliceKind,
    clip_slices,
    intersect_slices,
    masks_from_json,
    rect_pairs,
    rect_pairs_of_slice,
    window_slices,
)


def dense_slice(s: AttnSlice, n: int) -> np.ndarray:
    """The slice's mask built from its definition row by row (independent of rect_pairs)."""
    m = np.zeros((n, n), dtype=bool)
    qn, kn = s.q_end - s.q_start, s.k_end - s.k_start
    for r in range(qn):
        for c in range(kn):
            ok = True
            if s.kind in (SliceKind.CAUSAL, SliceKind.BI_CAUSAL):
                ok &= c <= r + (kn - qn)  # bottom-right aligned diagonal
            if s.kind in (SliceKind.INV_CAUSAL, SliceKind.BI_CAUSAL):
                ok &= c >= r  # top-left aligned diagonal
            m[s.q_start + r, s.k_start + c] = ok
    return m


def dense(mask: SampleMask) -> np.ndarray:
    out = np.zeros((mask.length, mask.length), dtype=int)
    for s in mask.slices():
        out += dense_slice(s, mask.length)
    return out


def intended(mask: SampleMask) -> np.ndarray:
    """Each kind's pattern written from its plain-language definition."""
    n = mask.length
    q, k = np.arange(n)[:, None], np.arange(n)[None, :]
    if mask.kind == "causal":
        return k <= q
    if mask.kind == "sliding_window":
        return (k <= q) & (k > q - mask.window)
    if mask.kind == "prefix_lm":
        return (k <= q) | ((q < mask.prefix) & (k < mask.prefix))
    if mask.kind == "block_causal":
        return k // mask.block <= q // mask.block
    if mask.kind == "shared_prompt":
        seg = np.zeros(n, dtype=int)
        start = mask.prompt
        for j, a in enumerate(mask.answers):
            seg[start : start + a] = j + 1
            start += a
        qs, ks = seg[:, None], seg[None, :]
        return (k <= q) & ((ks == qs) | (ks == 0))
    raise AssertionError(mask.kind)


KINDS = st.one_of(
    st.builds(SampleMask.causal, st.integers(1, 40)),
    st.builds(SampleMask.sliding_window, st.integers(1, 40), st.integers(1, 45)),
    st.integers(1, 40).flatmap(lambda n: st.builds(SampleMask.prefix_lm, st.just(n), st.integers(0, n))),
    st.builds(SampleMask.shared_prompt, st.integers(0, 12), st.lists(st.integers(1, 9), min_size=1, max_size=5)),
    st.builds(SampleMask.block_causal, st.integers(1, 40), st.integers(1, 12)),
)


@settings(max_examples=150, deadline=None)
@given(mask=KINDS)
def test_every_kind_compiles_to_its_pattern_without_overlap(mask):
    d = dense(mask)
    assert d.max() <= 1, "slices overlap"
    assert (d.astype(bool) == intended(mask)).all()
    mask.validate()
    assert mask.pairs() == int(d.sum())


@st.composite
def slice_and_rect(draw):
    n = draw(st.integers(1, 30))
    qs = draw(st.integers(0, n - 1))
    qe = draw(st.integers(qs + 1, n))
    ks = draw(st.integers(0, n - 1))
    ke = draw(st.integers(ks + 1, n))
    kind = draw(st.sampled_from(list(SliceKind)))
    a, b = sorted(draw(st.lists(st.integers(0, n), min_size=2, max_size=2)))
    c, e = sorted(draw(st.lists(st.integers(0, n), min_size=2, max_size=2)))
    return n, AttnSlice(qs, qe, ks, ke, kind), (a, b, c, e)


@settings(max_examples=400, deadline=None)
@given(case=slice_and_rect())
def test_rect_pairs_equals_dense_count_for_any_rectangle(case):
    n, s, (a, b, c, e) = case
    assert rect_pairs([s], a, b, c, e) == int(dense_slice(s, n)[a:b, c:e].sum())


@settings(max_examples=300, deadline=None)
@given(mask=KINDS, data=st.data())
def test_rect_pairs_of_a_mask_is_its_slices_counted_one_by_one_and_the_dense_count(mask, data):
    """rect_pairs counts full and causal slices inline (issue 39): the same integers as
    rect_pairs_of_slice per slice and as the dense mask, rectangles past the sample included."""
    n = mask.length
    a, b = sorted(data.draw(st.lists(st.integers(-2, n + 2), min_size=2, max_size=2)))
    c, e = sorted(data.draw(st.lists(st.integers(-2, n + 2), min_size=2, max_size=2)))
    slices = mask.slices()
    got = rect_pairs(slices, a, b, c, e)
    assert got == sum(rect_pairs_of_slice(s, a, b, c, e) for s in slices)
    assert got == int(dense(mask)[max(a, 0) : max(b, 0), max(c, 0) : max(e, 0)].sum())


def test_a_masks_slices_are_compiled_once_and_handed_out_as_fresh_lists():
    mask = SampleMask.shared_prompt(5, [3, 4])
    first, second = mask.slices(), mask.slices()
    assert first == second and first is not second and all(x is y for x, y in zip(first, second))
    first.append(AttnSlice(0, 1, 0, 1))  # the caller's list: the mask keeps its own
    assert mask.slices() == second
    assert mask == SampleMask.shared_prompt(5, [3, 4]) and hash(mask) == hash(SampleMask.shared_prompt(5, [3, 4]))
    # its hash is kept, but not sent: another process hashes strings differently
    assert "_hash" not in pickle.loads(pickle.dumps(mask)).__dict__ and pickle.loads(pickle.dumps(mask)) == mask


def test_rect_pairs_on_a_million_token_document_is_closed_form():
    n = 1_000_000
    causal = SampleMask.causal(n).slices()
    assert rect_pairs(causal, 0, n, 0, n) == n * (n + 1) // 2
    # queries in the second half against keys of the first half: a full rectangle
    assert rect_pairs(causal, n // 2, n, 0, n // 2) == (n // 2) ** 2
    window = SampleMask.sliding_window(n, 4096)
    assert window.pairs() == 4096 * 4097 // 2 + (n - 4096) * 4096


def test_json_round_trip_and_position_ids():
    m = SampleMask.shared_prompt(3, [2, 4])
    assert SampleMask.from_dict(m.to_dict()) == m
    assert m.position_ids() == [0, 1, 2, 3, 4, 3, 4, 5, 6]
    assert m.segments() == [(0, 3), (3, 5), (5, 9)]
    got = masks_from_json({"7": {"kind": "sliding_window", "length": 10, "window": 3}}, {7: 10})
    assert got[7].slices()[1].kind == SliceKind.BI_CAUSAL


@pytest.mark.parametrize(
    "mask, message",
    [
        (SampleMask.from_slices(4, [AttnSlice(0, 4, 0, 4, "causal"), AttnSlice(2, 4, 0, 2, "full")]), "both attend"),
        (SampleMask.from_slices(4, [AttnSlice(0, 4, 0, 5, "full")]), "inside [0, 4)"),
        (SampleMask.from_slices(4, [AttnSlice(0, 2, 0, 2, "causal")]), "attend no key"),
        (SampleMask.from_slices(4, [AttnSlice(0, 4, 0, 1, "causal")]), "query row 0 attends no key"),
        (SampleMask.sliding_window(4, 0), "at least 1"),
        (SampleMask.prefix_lm(4, 5), "prefix 5"),
    ],
)
def test_malformed_masks_name_the_sample_and_the_slice(mask, message):
    with pytest.raises(MaskError, match=re.escape(message)) as e:
        mask.validate(sample=12)
    assert "sample 12" in str(e.value)


def test_bad_json_is_refused_by_name():
    with pytest.raises(MaskError, match="unknown mask kind 'diagonal'"):
        SampleMask.from_dict({"kind": "diagonal"}, 3)
    with pytest.raises(MaskError, match="takes \\['window'\\], not \\['windw'\\]"):
        SampleMask.from_dict({"kind": "sliding_window", "length": 5, "windw": 2}, 3)
    with pytest.raises(MaskError, match="not in the step"):
        masks_from_json({"9": {"kind": "causal", "length": 3}}, {1: 3})
    with pytest.raises(MaskError, match="covers 3 tokens but the sample has 4"):
        masks_from_json({"1": {"kind": "causal", "length": 3}}, {1: 4})


# ----------------------------------------------------------------------------- clipping, intersection, windows
def assert_tight(slices):
    """Every row of every slice sees a key, and no clamp of the slice's definition is active:
    kernels take a slice's kind from its bounds alone."""
    for s in slices:
        for i in range(s.q_start, s.q_end):
            lo, hi = s._raw_bounds(i)
            assert s.k_start <= lo < hi <= s.k_end, (s, i, lo, hi)


def dense_of(slices, n):
    out = np.zeros((n, n), dtype=int)
    for s in slices:
        out += dense_slice(s, n)
    return out


@settings(max_examples=200, deadline=None)
@given(mask=KINDS, data=st.data())
def test_clip_slices_is_the_dense_rectangle_as_tight_slices(mask, data):
    n = mask.length
    a, b = sorted(data.draw(st.lists(st.integers(0, n), min_size=2, max_size=2)))
    c, e = sorted(data.draw(st.lists(st.integers(0, n), min_size=2, max_size=2)))
    clipped = clip_slices(mask.slices(), a, b, c, e)
    assert_tight(clipped)
    want = np.zeros((n, n), dtype=int)
    want[a:b, c:e] = dense(mask)[a:b, c:e]
    assert (dense_of(clipped, n) == want).all()
    assert sum(s.pairs() for s in clipped) == rect_pairs(mask.slices(), a, b, c, e)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 30), data=st.data())
def test_intersect_slices_is_the_dense_and(n, data):
    def of_length(m):
        return st.one_of(
            st.just(SampleMask.causal(m)),
            st.builds(SampleMask.sliding_window, st.just(m), st.integers(1, m + 2)),
            st.builds(SampleMask.prefix_lm, st.just(m), st.integers(0, m)),
            st.builds(SampleMask.block_causal, st.just(m), st.integers(1, 8)),
        )

    a, b = data.draw(of_length(n)), data.draw(of_length(n))
    got = intersect_slices(a.slices(), b.slices())
    assert_tight(got)
    assert (dense_of(got, n) == (dense(a) & dense(b))).all()


@settings(max_examples=200, deadline=None)
@given(mask=KINDS, window=st.integers(1, 12))
def test_window_slices_keep_keys_within_the_window_in_rotary_positions(mask, window):
    got = window_slices(mask, window)
    assert_tight(got)
    pos = np.asarray(mask.position_ids())
    in_window = (pos[:, None] - pos[None, :]) < window
    assert (dense_of(got, mask.length) == (intended(mask) & in_window)).all()
    assert window_slices(mask, None) == mask.slices()


def test_window_of_a_shared_prompt_answer_counts_from_its_own_position():
    # prompt 4, answers 3 and 3: the second answer's first token (index 7, position 4) sees
    # prompt keys at positions > 4 - 3 = 1 (indices 2, 3) and itself
    m = SampleMask.shared_prompt(4, [3, 3])
    d = dense_of(window_slices(m, 3), m.length)
    assert d[7].nonzero()[0].tolist() == [2, 3, 7]
    assert d[4].nonzero()[0].tolist() == [2, 3, 4]


def test_attended_key_range_is_the_span_of_the_keys_rows_attend():
    """Against every row's keys counted one by one, and against clip_slices' tight pieces, on
    random slices of every kind and random row ranges (some empty, some with rows seeing nothing)."""
    import random

    from hf_cp.samples.masks import AttnSlice, SliceKind, attended_key_range, clip_slices

    rng = random.Random(0)
    for _ in range(5000):
        qs, ql, ks, kl = rng.randint(0, 20), rng.randint(1, 20), rng.randint(0, 30), rng.randint(1, 25)
        s = AttnSlice(qs, qs + ql, ks, ks + kl, rng.choice(list(SliceKind)))
        lo = rng.randint(0, 45)
        hi = lo + rng.randint(0, 20)
        keys = [k for i in range(max(lo, qs), min(hi, qs + ql)) for k in range(*s.key_interval(i))]
        expected = (min(keys), max(keys) + 1) if keys else None
        assert attended_key_range(s, lo, hi) == expected, (s, lo, hi)
        pieces = clip_slices([s], lo, hi, 0, 1 << 62)
        assert expected == ((min(c.k_start for c in pieces), max(c.k_end for c in pieces)) if pieces else None)
