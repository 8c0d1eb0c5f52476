"""The block-plan format: constructors, JSON inside a StepPlan, validation that names what is
wrong, and the K/V transfers a placement implies (zigzag: 18 of the ring's 24 at CP 4)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_cp.modes.ring import per_doc_segments, zigzag_segments
from hf_cp.modes.segments import ShardMode
from hf_cp.modes.ulysses import contiguous_segments
from hf_cp.plan.block_layout import (
    BlockLayout,
    BlockLayoutError,
    Chunk,
    ComputeBlock,
    all_remote_layout,
    attended_chunk_pairs,
    block_area,
    contiguous_layout,
    doc_slices,
    per_doc_layout,
    random_layout,
    ring_kv_transfers,
    ulysses_layout,
    zigzag_layout,
)
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import Group, PlanError, StepPlan, Wave
from hf_cp.samples.masks import SampleMask, rect_pairs

MASKS = st.one_of(
    st.none(),
    st.integers(1, 40).map(lambda n: ("sliding_window", n)),
    st.integers(0, 40).map(lambda n: ("prefix_lm", n)),
    st.integers(1, 9).map(lambda n: ("block_causal", n)),
)


def make_mask(spec, n):
    if spec is None:
        return None
    kind, x = spec
    if kind == "sliding_window":
        return SampleMask.sliding_window(n, x)
    if kind == "prefix_lm":
        return SampleMask.prefix_lm(n, min(x, n))
    return SampleMask.block_causal(n, x)


@st.composite
def group_case(draw):
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    masks = [make_mask(draw(MASKS), n) for n in lengths]
    if draw(st.booleans()):  # a shared-prompt sample
        p, answers = draw(st.integers(0, 8)), draw(st.lists(st.integers(1, 8), min_size=1, max_size=4))
        masks.append(SampleMask.shared_prompt(p, answers))
        lengths.append(masks[-1].length)
    g = draw(st.sampled_from([1, 2, 4]))
    return lengths, masks, g, draw(st.integers(0, 10_000))


def layouts(lengths, slices, g, heads, seed):
    out = {
        "contiguous": contiguous_layout(lengths, g, heads, slices),
        "zigzag": zigzag_layout(lengths, g, heads, slices),
        "per_doc": per_doc_layout(lengths, g, heads, slices),
        "random": random_layout(lengths, g, heads, slices, seed),
        "random_heads": random_layout(lengths, g, heads, slices, seed, split_heads=True),
    }
    if heads % g == 0:
        out["ulysses"] = ulysses_layout(lengths, g, heads, slices)
    if g > 1:
        out["remote"] = all_remote_layout(out["random"], g, seed)
    return out


@settings(max_examples=80, deadline=None)
@given(case=group_case())
def test_every_constructor_is_valid_and_computes_each_attended_pair_once(case):
    lengths, masks, g, seed = case
    slices = doc_slices(lengths, masks)
    total = sum(rect_pairs(s, 0, n, 0, n) for s, n in zip(slices, lengths))
    for name, lay in layouts(lengths, slices, g, 4, seed).items():
        lay.validate(lengths, g, slices, 4)
        # head-weighted areas add up to the masks' pairs on every head
        got = sum(
            block_area(lay.chunks, slices, b.q_chunk, b.k_chunk) * (b.head_end - b.head_start) for b in lay.compute
        )
        assert got == 4 * total, name
        assert sum(lay.member_tokens(m) for m in range(g)) == sum(lengths), name


@settings(max_examples=60, deadline=None)
@given(case=group_case())
def test_attended_chunk_pairs_are_the_pairs_with_nonzero_area(case):
    lengths, masks, g, seed = case
    slices = doc_slices(lengths, masks)
    lay = random_layout(lengths, g, 2, slices, seed, max_chunks_per_doc=8)
    brute = {
        (i, j)
        for i, a in enumerate(lay.chunks)
        for j, b in enumerate(lay.chunks)
        if a.doc == b.doc and block_area(lay.chunks, slices, i, j) > 0
    }
    assert set(attended_chunk_pairs(lay.chunks, slices)) == brute


@pytest.mark.parametrize("g", [1, 2, 4, 8])
def test_ring_geometries_as_blocks_hold_the_same_rows(g):
    lengths = [37, 5, 64, 11, 1]
    for layout, segments in (
        (zigzag_layout, zigzag_segments),
        (per_doc_layout, per_doc_segments),
        (contiguous_layout, contiguous_segments),
    ):
        lay = layout(lengths, g, 4)
        for m in range(g):
            assert lay.member_segments(m) == segments(lengths, g, m), (layout.__name__, m)


@pytest.mark.parametrize("g, engine, ring", [(4, 18, 24), (8, 84, 112)])
def test_causal_zigzag_moves_only_the_needed_kv_chunks(g, engine, ring):
    """The issue's count: zigzag over one causal document, each K/V chunk sent only to members
    holding a later query chunk, against every chunk travelling g-1 hops round the ring."""
    lay = zigzag_layout([64 * g], g, 8)
    assert len(lay.chunks) == 2 * g
    assert lay.kv_transfers() == engine
    assert ring_kv_transfers(lay, g) == ring
    assert lay.q_transfers() == 0


def _plan(layout, lengths=(40, 9), masks=None, cap=1000):
    return StepPlan(
        world_size=4,
        max_tokens_per_rank=cap,
        sample_ids=[10, 11],
        lengths=list(lengths),
        waves=[Wave([Group(ranks=(0, 1, 2, 3), distributed=[10, 11], mode=ShardMode.BLOCKS, blocks=layout)])],
        masks=dict(masks or {}),
    )


def test_block_plan_with_masks_round_trips_byte_identically():
    masks = {11: SampleMask.shared_prompt(3, [4, 2])}
    lens = [40, 9]
    lay = all_remote_layout(random_layout(lens, 4, 4, doc_slices(lens, [None, masks[11]]), 7, split_heads=True), 4, 1)
    p = _plan(lay, lens, masks).validate(ClusterSpec(4, 1000))
    text = p.to_json()
    q = StepPlan.from_json(text)
    assert q.to_json() == text and q.masks == p.masks and q.waves[0].groups[0].blocks == lay
    assert '"mode":"blocks"' in text and '"masks":{"11":' in text
    # a plan without masks or blocks serialises exactly as before the format existed
    plain = _plan(None)
    plain.waves[0].groups[0].mode = ShardMode.RING_PER_DOC
    assert "masks" not in plain.to_json() and "blocks" not in plain.to_json()


def _mutated(mutate):
    lay = zigzag_layout([40, 9], 4, 4)
    chunks, compute = [list(c) for c in lay.chunks], [list(b) for b in lay.compute]
    mutate(chunks, compute)
    return BlockLayout(tuple(Chunk(*c) for c in chunks), tuple(ComputeBlock(*b) for b in compute))


def _drop_pair(chunks, compute):
    del compute[3]


def _split_heads_with_overlap(chunks, compute):
    q, k, _, _, e = compute[0]
    compute[0] = [q, k, 0, 3, e]
    compute.insert(1, [q, k, 2, 4, e])


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c, b: c[0].__setitem__(2, c[0][2] + 1), "sample 10: chunk 1 starts at token"),
        (lambda c, b: c[0].__setitem__(2, c[0][2] - 1), r"sample 10: tokens \[6, 7\) are in no chunk"),
        (lambda c, b: c[0].__setitem__(3, 4), "sample 10, chunk 0: owner 4 is not a member"),
        (lambda c, b: c[0].__setitem__(0, 2), "chunk 0 .*: doc 2 is not one of the group's 2 distributed samples"),
        (lambda c, b: b.__setitem__(0, [0, 6, 0, 4, 0]), "attend no key of chunk 6 .*zero area"),
        (_drop_pair, "sample 10: queries of chunk .* attend keys of chunk .* but no block computes them"),
        (_split_heads_with_overlap, "sample 10, block 1 .*head ranges of chunks 0 x 0 overlap at head 2"),
        (lambda c, b: b.__setitem__(0, b[0][:3] + [3, b[0][4]]), r"sample 10: chunks 0 x 0 have heads \[3, 4\) in no"),
        (lambda c, b: b.__setitem__(0, b[0][:4] + [5]), "sample 10, block 0 .*: executor 5 is not a member"),
        (
            lambda c, b: b.append([0, len(c) - 1, 0, 4, 0]),
            "query chunk 0 is of sample 10 but key chunk .* of sample 11",
        ),
    ],
)
def test_validate_names_step_wave_group_sample_chunk_and_block(mutate, message):
    p = _plan(_mutated(mutate))
    p.step = 5
    with pytest.raises(PlanError, match=message) as e:
        p.validate(ClusterSpec(4, 1000))
    assert re.match(r"step 5, wave 0, group 0 \[0, 1, 2, 3\]: ", str(e.value)), str(e.value)


def test_validate_checks_heads_against_the_model_and_needs_a_layout(h200_cost):
    p = _plan(zigzag_layout([40, 9], 4, 4))
    p.validate(ClusterSpec(4, 1000))  # heads are the layout's own without a cost model
    with pytest.raises(PlanError, match=r"heads \[4, 28\) in no block"):
        p.validate(ClusterSpec(4, 1000), h200_cost)
    with pytest.raises(PlanError, match="mode 'blocks' needs a block layout"):
        _plan(None).validate()
    with pytest.raises(PlanError, match=r"sample 11: tokens \[0, 9\) are in no chunk"):
        _plan(zigzag_layout([40], 4, 4)).validate()


def test_memory_cap_counts_received_kv_and_q_rows(h200_cost):
    """A member running every block receives the other members' K/V and Q: its rows plus those
    (weighted by their bytes against a token's activations) must fit the cap."""
    from hf_cp.plan.block_layout import received_token_equivalent

    n = 64 * 1024
    lay = contiguous_layout([n], 4, 28)
    lay = BlockLayout(lay.chunks, tuple(b._replace(executor=0) for b in lay.compute))
    extra = received_token_equivalent(lay, 0, h200_cost)
    assert extra > 0 and received_token_equivalent(lay, 1, h200_cost) == 0
    plan = StepPlan(4, n // 4 + extra, [0], [n], [Wave([Group((0, 1, 2, 3), [0], ShardMode.BLOCKS, blocks=lay)])])
    plan.validate(ClusterSpec(4, n // 4 + extra), h200_cost)
    plan.max_tokens_per_rank -= 1
    with pytest.raises(PlanError, match=f"rank 0 holds {n // 4 + extra} tokens.*received K/V and Q rows counted as"):
        plan.validate(ClusterSpec(4, n // 4 + extra - 1), h200_cost)


def test_masks_in_a_plan_are_checked_against_the_samples():
    with pytest.raises(PlanError, match="mask covers 5 tokens but the sample has 9"):
        _plan(zigzag_layout([40, 9], 4, 4), masks={11: SampleMask.causal(5)}).validate()
    d = _plan(zigzag_layout([40, 9], 4, 4)).to_dict()
    d["masks"] = {"12": {"kind": "causal", "length": 3}}
    with pytest.raises(PlanError, match="sample 12, which is not in the step"):
        StepPlan.from_dict(d)


def test_malformed_layout_json_and_a_layout_for_another_mask_are_refused():
    from hf_cp.plan.block_layout import layer_exchange

    with pytest.raises(BlockLayoutError, match=r"chunks are \[doc, start, length, owner\]"):
        BlockLayout.from_dict({"chunks": [[0, 0, 1]], "compute": []})
    with pytest.raises(BlockLayoutError, match="expected an object with 'chunks' and 'compute'"):
        BlockLayout.from_dict({"chunks": []})
    windowed = doc_slices([32], [SampleMask.sliding_window(32, 4)])
    lay = contiguous_layout([32], 4, 4, windowed)  # far key chunks left out: the window never reaches them
    layer_exchange(lay, windowed, 4, 2)
    with pytest.raises(BlockLayoutError, match="layout was made for another mask"):
        layer_exchange(lay, doc_slices([32]), 4, 2)


def test_a_layout_on_a_group_of_another_mode_is_refused():
    p = _plan(zigzag_layout([40, 9], 4, 4))
    p.waves[0].groups[0].mode = ShardMode.RING_ZIGZAG
    with pytest.raises(PlanError, match="a block layout is given but the mode is 'ring_zigzag'"):
        p.validate()
    with pytest.raises(ValueError, match="places chunks explicitly"):
        from hf_cp.modes.registry import rank_segments

        rank_segments(ShardMode.BLOCKS, [40], 4, 0)
