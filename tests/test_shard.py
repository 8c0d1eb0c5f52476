from hypothesis import given, settings
from hypothesis import strategies as st

from hf_cp.modes.registry import rank_segments
from hf_cp.modes.segments import (
    WHOLE_DOCUMENT_MODES,
    ShardMode,
    causal_pairs,
    doc_pairs,
    segment_pairs,
    segment_tokens,
    split_sizes,
)

doc_lists = st.lists(st.integers(1, 200), min_size=1, max_size=12)
groups = st.sampled_from([1, 2, 3, 4, 8])


def brute_force(doc_lengths, segments):
    """Count (query, key) pairs with key <= query inside the same document, token by token."""
    owned = set()
    for s in segments:
        for p in range(s.start, s.start + s.length):
            owned.add((s.doc, p))
    return sum(p + 1 for (_, p) in owned), owned


@settings(max_examples=150, deadline=None)
@given(doc_lists, groups, st.sampled_from(WHOLE_DOCUMENT_MODES))
def test_segments_cover_every_token_once_and_pairs_match_brute_force(docs, g, mode):
    seen = {}
    total_pairs = 0
    for r in range(g):
        segs = rank_segments(mode, docs, g, r)
        pairs, owned = brute_force(docs, segs)
        assert segment_pairs(segs) == pairs
        assert segment_tokens(segs) == len(owned)
        for tok in owned:
            assert tok not in seen, f"token {tok} held by ranks {seen[tok]} and {r}"
            seen[tok] = r
        total_pairs += pairs
    assert len(seen) == sum(docs)
    assert total_pairs == sum(doc_pairs(n) for n in docs)


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_split_sizes(n, parts):
    s = split_sizes(n, parts)
    assert sum(s) == n and len(s) == parts and max(s) - min(s) <= 1


def test_zigzag_pairs_balanced_for_one_long_document():
    # zigzag's point: every rank gets the same causal work on a long document
    pairs = [segment_pairs(rank_segments(ShardMode.RING_ZIGZAG, [8000], 4, r)) for r in range(4)]
    assert max(pairs) - min(pairs) <= 0.001 * max(pairs)
    # a contiguous split is badly skewed on the same document
    contig = [segment_pairs(rank_segments(ShardMode.ULYSSES, [8000], 4, r)) for r in range(4)]
    assert contig[-1] > 5 * contig[0]


def test_per_doc_needs_no_padding_for_short_documents():
    segs = [rank_segments(ShardMode.RING_PER_DOC, [1, 3, 7], 4, r) for r in range(4)]
    assert sum(segment_tokens(s) for s in segs) == 11
    assert causal_pairs(2, 3) == 3 + 4 + 5


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 500), min_size=0, max_size=12), groups)
def test_ring_member_tokens_closed_forms_match_the_segments(docs, g):
    # every planner-side shortcut of which tokens a ring member holds is modes/ring.py's
    from hf_cp.modes import ring
    from hf_cp.modes.registry import mode_spec

    for mode in (ShardMode.RING_ZIGZAG, ShardMode.RING_PER_DOC):
        expect = [segment_tokens(rank_segments(mode, docs, g, m)) for m in range(g)]
        assert ring.member_tokens(mode, docs, g).tolist() == expect
        assert mode_spec(mode).member_tokens(docs, g) == expect
    for n in docs:
        parts = split_sizes(n, 2 * g)
        assert ring.part_sizes(n, g) == parts
        start, size = ring.part_arrays(n, g)
        assert size.tolist() == parts and start.tolist() == [sum(parts[:p]) for p in range(2 * g)]
        held = ring.split_member_tokens(n, g)
        assert held == [parts[a] + parts[b] for a, b in (ring.member_parts(m, g) for m in range(g))]
        assert ring.member_sums(size).tolist() == held
        assert ring.per_doc_max_member_tokens(n, g) == max(held)
        assert [ring.part_member(p, g) for p in range(2 * g)] == [min(p, 2 * g - 1 - p) for p in range(2 * g)]
