"""ChunkFlow's chunk plan (hf_cp/chunking.py): geometry, construction, validate(), JSON, pricing."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_cp.cost.dims import ModelDims
from hf_cp.plan.chunks import (
    ChunkPlan,
    ChunkPlanError,
    DependentSample,
    activation_tokens,
    build_chunk_plan,
    chunk_costs_ms,
    chunked_memory_bytes,
    chunked_sample_cost,
    dependent_chunk_sizes,
    largest_fitting_chunk,
    standalone_chunk_ms,
    state_bytes,
)

from helpers.toy_cost import DIMS, toy_cost


# --------------------------------------------------------------------------- geometry
@pytest.mark.parametrize(
    "length, size, expected",
    [(37, 40, [37]), (37, 37, [37]), (37, 19, [19, 18]), (37, 8, [8, 8, 7, 7, 7]), (8, 4, [4, 4]), (9, 4, [3, 3, 3])],
)
def test_dependent_chunk_sizes(length, size, expected):
    assert dependent_chunk_sizes(length, size) == expected


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10**6), st.integers(1, 10**5))
def test_dependent_chunks_cover_the_sample_within_the_chunk_size(length, size):
    sizes = dependent_chunk_sizes(length, size)
    assert sum(sizes) == length
    assert max(sizes) <= size and min(sizes) >= 1
    assert len(sizes) == -(-length // size)  # as few chunks as the size allows
    assert max(sizes) - min(sizes) <= 1


def test_activation_tokens_is_the_kept_chunks_or_the_largest_recomputed_one():
    assert activation_tokens([8, 8, 7, 7, 7], 1) == 8  # chunk 0 (8 tokens) is recomputed alone
    assert activation_tokens([8, 8, 7, 7, 7], 2) == 14
    assert activation_tokens([8, 8, 7, 7, 7], 9) == 37
    with pytest.raises(ValueError, match="keep"):
        activation_tokens([3], 0)


def test_model_dims_kv_bytes_per_token():
    # 2 (K, V) x 1 kv head x head dim 4 x 2 bytes x 2 layers
    assert DIMS.kv_bytes_per_token(2) == 32
    qwen7b = ModelDims.load("qwen2.5-7b")
    assert qwen7b.kv_bytes_per_token(2) == 2 * 4 * 128 * 2 * 28


# --------------------------------------------------------------------------- construction
def test_build_chunk_plan_packs_short_samples_and_cuts_long_ones():
    plan = build_chunk_plan([10, 11, 12, 13, 14], [3, 9, 5, 2, 4], chunk_size=6, keep=1).validate()
    # 9 > 6: two dependent chunks; the rest first-fit decreasing: 5 | 4+2 | 3
    assert plan.dependent == [DependentSample(11, [(0, 5), (5, 4)])]
    assert plan.standalone == [[12], [14, 13], [10]]
    assert plan.num_chunks == 5
    assert plan.chunk_lengths() == [5, 6, 3, 5, 4]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=60), st.integers(1, 1000), st.integers(1, 4))
def test_built_plans_are_valid_and_pack_tightly(lengths, size, keep):
    ids = [7 * i + 3 for i in range(len(lengths))]
    plan = build_chunk_plan(ids, lengths, size, keep).validate()
    lens = dict(zip(ids, lengths))
    assert {d.sample for d in plan.dependent} == {s for s in ids if lens[s] > size}
    loads = [sum(lens[s] for s in c) for c in plan.standalone]
    assert sum(1 for x in loads if 2 * x <= size) <= 1, "first fit leaves at most one chunk half empty"
    assert ChunkPlan.from_json(plan.to_json()).to_json() == plan.to_json()


# --------------------------------------------------------------------------- validate
def base_chunk_plan() -> ChunkPlan:
    return ChunkPlan(
        chunk_size=4,
        keep=1,
        sample_ids=[5, 6, 7],
        lengths=[1, 3, 8],
        standalone=[[6, 5]],
        dependent=[DependentSample(7, [(0, 4), (4, 4)])],
    )


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda p: p.standalone.append([5]),
            r"sample 5 is chunked twice \(standalone chunk 0 and standalone chunk 1\)",
        ),
        (lambda p: p.standalone[0].remove(5), r"samples \[5\] \(1 in all\) are in no chunk"),
        (lambda p: p.standalone[0].append(99), "standalone chunk 0: sample 99 is not in the step"),
        (lambda p: p.standalone.append([]), "standalone chunk 1 is empty"),
        (
            lambda p: p.lengths.__setitem__(1, 4),
            r"standalone chunk 0 holds 5 tokens \(samples \[6, 5\]\), over the chunk size 4",
        ),
        (
            lambda p: setattr(p.dependent[0], "chunks", [(0, 4), (5, 3)]),
            "sample 7, chunk 1 starts at position 5, expected 4: dependent chunks must be contiguous and in order",
        ),
        (
            lambda p: setattr(p.dependent[0], "chunks", [(4, 4), (0, 4)]),
            "sample 7, chunk 0 starts at position 4, expected 0",
        ),
        (
            lambda p: setattr(p.dependent[0], "chunks", [(0, 5), (5, 3)]),
            r"sample 7, chunk 0 has 5 tokens; chunks hold 1..4",
        ),
        (
            lambda p: setattr(p.dependent[0], "chunks", [(0, 4), (4, 2)]),
            "the chunks of sample 7 cover 6 of its 8 tokens",
        ),
        (lambda p: setattr(p.dependent[0], "chunks", []), "sample 7 has no dependent chunks"),
        (lambda p: p.dependent.append(DependentSample(6, [(0, 3)])), "sample 6 is chunked twice"),
        (lambda p: setattr(p, "keep", 0), r"keep \(K\) must be positive"),
        (lambda p: setattr(p, "sample_ids", [5, 5, 7]), "sample 5 appears twice in the step"),
    ],
)
def test_validate_names_sample_and_chunk(mutate, message):
    p = base_chunk_plan().validate()
    mutate(p)
    with pytest.raises(ChunkPlanError, match=message):
        p.validate()


def test_json_round_trip_and_malformed_input():
    p = base_chunk_plan()
    q = ChunkPlan.from_json(p.to_json())
    assert q == p and q.to_json() == p.to_json()
    with pytest.raises(ChunkPlanError, match="format is 'x'"):
        ChunkPlan.from_dict({**p.to_dict(), "format": "x"})
    d = p.to_dict()
    del d["keep"]
    with pytest.raises(ChunkPlanError, match="missing field 'keep'"):
        ChunkPlan.from_dict(d)
    with pytest.raises(ChunkPlanError, match="not valid JSON"):
        ChunkPlan.from_json("{")


# --------------------------------------------------------------------------- pricing
def test_pricing_by_hand():
    cost = toy_cost()
    # 4 tokens in chunks of 2: chunk 0 has causal_pairs(0, 2) = 3 pairs, chunk 1 causal_pairs(2, 2) = 7
    # (its 2 queries see the 2 earlier keys and its own, causally). Per chunk, 2 layers x (c1 x 2 + c2 x pairs).
    cc = chunked_sample_cost(cost, [2, 2], keep=1)
    assert cc.chunk_ms == pytest.approx((2 * (2 + 0.3), 2 * (2 + 0.7)))
    assert cc.recompute_ms == pytest.approx(4.6 / 3)  # chunk 0's forward again, a third of fwd+bwd
    assert cc.overhead_ms == pytest.approx(2 * 0.5 * (2 + 1 / 3))  # 2 chunk runs + a recompute's forward share
    assert cc.compute_ms == pytest.approx(4.6 + 5.4 + 4.6 / 3 + 1.0 * (2 + 1 / 3))
    kept_all = chunked_sample_cost(cost, [2, 2], keep=2)
    assert kept_all.recompute_ms == 0 and kept_all.compute_ms == pytest.approx(4.6 + 5.4 + 2 * 1.0)
    # the same 10 causal pairs unchunked: one micro-batch overhead less, no recompute
    assert standalone_chunk_ms(cost, [4]) == pytest.approx(2 * (4 + 1.0) + 1.0)
    # one chunk is exactly the unchunked sample
    assert chunked_sample_cost(cost, [4], keep=1).compute_ms == pytest.approx(standalone_chunk_ms(cost, [4]))
    # memory: K/V 32 B/token in the model's dtype + 64 B/token of fp32 gradient accumulators
    assert state_bytes(cost, 4) == 4 * 96
    assert cc.activation_tokens == 2 and kept_all.activation_tokens == 4
    assert chunked_memory_bytes(cost, [2, 2], 1) == 1000 + 100 * 2 + 384
    assert chunked_memory_bytes(cost, [2, 2], 2) == 1000 + 100 * 4 + 384


def test_forward_share_comes_from_the_profile_when_measured():
    cost = toy_cost(forward_share=0.4)
    assert chunked_sample_cost(cost, [2, 2], keep=1).recompute_ms == pytest.approx(0.4 * 4.6)
    with pytest.raises(Exception, match=r"forward_share must be in \(0, 1\)"):
        toy_cost(forward_share=1.5)


def test_later_chunks_cost_more_and_recompute_excludes_the_lm_head(h200_cost):
    sizes = dependent_chunk_sizes(65536, 8192)
    cc = chunked_sample_cost(h200_cost, sizes, keep=2)
    assert all(a < b for a, b in zip(cc.chunk_ms, cc.chunk_ms[1:])), "chunk i attends to more keys than chunk i-1"
    head = h200_cost.head_ms_per_token * 8192
    assert head > 0
    share = h200_cost.profile.forward_share
    assert cc.recompute_ms == pytest.approx(share * sum(ms - head for ms in cc.chunk_ms[:6]))
    # a pipeline's micro-batch costs of these chunks
    plan = build_chunk_plan([1], [65536], 8192, 2)
    assert chunk_costs_ms(plan, h200_cost) == pytest.approx(
        [ms + h200_cost.micro_batch_overhead_ms() for ms in cc.chunk_ms]
    )


def test_largest_fitting_chunk_by_hand():
    cost = toy_cost()
    # budget of a 20-token cap: 1000 + 2000 B; a 10-token sample's store takes 960 B: 10 tokens of activations left
    assert largest_fitting_chunk(cost, 10, keep=1, max_tokens_per_rank=20, upper=9) == 5  # [5, 5]: 5 tokens kept
    assert largest_fitting_chunk(cost, 10, keep=2, max_tokens_per_rank=20, upper=9) == 5  # [5, 5]: both kept
    assert (
        largest_fitting_chunk(cost, 10, keep=3, max_tokens_per_rank=19, upper=9) == 3
    )  # [4, 3, 3] keeps 10 > 9.4; [3, 3, 2, 2] 7
    assert largest_fitting_chunk(cost, 10, keep=1, max_tokens_per_rank=20, upper=4) == 4
    assert largest_fitting_chunk(cost, 10, keep=1, max_tokens_per_rank=8, upper=8) == 0  # the store alone is too big


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 400), st.integers(1, 5), st.integers(1, 400), st.integers(1, 400))
def test_largest_fitting_chunk_matches_a_search_over_every_chunk_size(length, keep, cap, upper):
    _check_against_every_chunk_size(toy_cost(), length, keep, cap, upper)


def _check_against_every_chunk_size(cost, length, keep, cap, upper):
    budget = cost.memory_bytes(cap)
    fits = [
        c for c in range(1, upper + 1) if chunked_memory_bytes(cost, dependent_chunk_sizes(length, c), keep) <= budget
    ]
    got = largest_fitting_chunk(cost, length, keep, cap, upper)
    if not fits:
        assert got == 0
    else:
        assert 1 <= got <= upper
        assert dependent_chunk_sizes(length, got) == dependent_chunk_sizes(length, max(fits))


def _toy_hybrid_cost():
    """toy_cost's model as a hybrid: 1 softmax and 3 linear layers, each linear layer handing on a
    state of 6 float32 elements (and 2 window rows) at every chunk boundary: 48 B + 16 B of rows
    plus their accumulators per boundary and layer, so the states' bytes grow with the chunk count."""
    import dataclasses

    cost = toy_cost()
    dims = dataclasses.replace(DIMS, num_layers=4, attention_layers=1, recurrent_state_elements=6, conv_window=2)
    return type(cost)(dims, cost.profile)


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 400), st.integers(1, 5), st.integers(1, 400), st.integers(1, 400))
def test_largest_fitting_chunk_counts_a_hybrids_states_between_chunks(length, keep, cap, upper):
    _check_against_every_chunk_size(_toy_hybrid_cost(), length, keep, cap, upper)


def test_a_hybrids_states_make_the_fitting_chunk_smaller():
    import dataclasses

    hybrid = _toy_hybrid_cost()
    stateless = type(hybrid)(dataclasses.replace(hybrid.dims, recurrent_state_elements=0), hybrid.profile)
    # a 400-token sample at a 300-token cap: without the states chunks of 100 fit, with them 80
    assert largest_fitting_chunk(stateless, 400, keep=1, max_tokens_per_rank=300, upper=400) == 100
    with_states = largest_fitting_chunk(hybrid, 400, keep=1, max_tokens_per_rank=300, upper=400)
    assert with_states == 80
    budget = hybrid.memory_bytes(300)
    assert chunked_memory_bytes(hybrid, dependent_chunk_sizes(400, 80), 1) <= budget
    assert chunked_memory_bytes(hybrid, dependent_chunk_sizes(400, 100), 1) > budget
    # where states leave nothing for activations the sample does not fit
    assert largest_fitting_chunk(hybrid, 400, keep=1, max_tokens_per_rank=250, upper=400) == 0
