"""Chunked samples in a StepPlan (Group.chunked): JSON, validate(), the simulator's price, refusals."""

import pytest

from hf_cp.cost.simulate import simulate
from hf_cp.plan.chunks import chunked_sample_cost, dependent_chunk_sizes, standalone_chunk_ms, state_bytes
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import ChunkedSample, Group, PlanError, StepPlan, Wave

from helpers.toy_cost import toy_cost

CL = ClusterSpec(world_size=4, max_tokens_per_rank=1000)


def chunked_plan() -> StepPlan:
    return StepPlan(
        world_size=4,
        max_tokens_per_rank=1000,
        sample_ids=[10, 11, 12, 13],
        lengths=[3000, 500, 200, 2500],
        waves=[
            Wave(
                [
                    Group(ranks=(0,), chunked={0: [ChunkedSample(10, 1000, 1)]}),
                    Group(ranks=(1,), local={1: [11, 12]}),
                    Group(ranks=(2,), chunked={2: [ChunkedSample(13, 500, 2)]}),
                ]
            )
        ],
    )


def test_chunked_group_round_trips_and_counts_its_samples():
    p = chunked_plan().validate(CL)
    d = p.to_dict()
    assert d["waves"][0]["groups"][0] == {"ranks": [0], "chunked": {"0": [[10, 1000, 1]]}}
    q = StepPlan.from_json(p.to_json())
    assert q.to_json() == p.to_json() and q.digest() == p.digest()
    assert q.waves[0].groups[2].chunked == {2: [ChunkedSample(13, 500, 2)]}
    assert p.waves[0].groups[0].sample_ids() == [10]
    assert p.chunked_samples == [10, 13]
    assert p.cp_size_of_samples() == {10: 1, 11: 1, 12: 1, 13: 1}
    assert not p.spreads_samples
    # rank tokens: the activations of the kept chunks (K=2 of 500-token chunks), not the sample
    assert p.rank_tokens(p.waves[0].groups[2], 2) == 1000
    assert p.rank_tokens(p.waves[0].groups[0], 0) == 1000


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda p: setattr(p.waves[0].groups[0], "ranks", (0, 1)) or p.waves[0].groups.pop(1),
            r"chunked samples \[10\] on rank 0 in group \[0, 1\]: chunked samples run in a one-rank group",
        ),
        (
            lambda p: p.waves[0].groups[0].local.__setitem__(0, [11]) or p.waves[0].groups[1].local[1].remove(11),
            r"rank 0 runs chunked samples \[10\] and other samples in one group",
        ),
        (
            lambda p: p.waves[0].groups[0].chunked.__setitem__(0, [ChunkedSample(10, 0, 1)]),
            "chunked sample 10 has chunk_size 0 and keep 1; both must be positive",
        ),
        (
            lambda p: p.waves[0].groups[2].chunked.__setitem__(2, [ChunkedSample(13, 500, 3)]),
            r"rank 2 holds the activations of 1500 tokens of the chunked samples \[\[13, 500, 3\]\], over the cap of 1000",
        ),
        (
            lambda p: p.waves[0].groups[2].chunked[2].append(ChunkedSample(10, 500, 1)),
            "sample 10 is scheduled twice",
        ),
        (
            lambda p: p.waves[0].groups[2].chunked.__setitem__(2, [ChunkedSample(99, 500, 1)]),
            "sample 99 is not in the step's global batch",
        ),
        (lambda p: p.waves[0].groups[2].chunked.pop(2), r"samples \[13\] .* never scheduled"),
    ],
)
def test_validate_rejects_broken_chunked_groups(mutate, message):
    p = chunked_plan()
    mutate(p)
    with pytest.raises(PlanError, match=message):
        p.validate(CL)


def test_validate_with_a_cost_model_counts_the_state_store():
    cost = toy_cost()  # alpha 100 B/token, static 1000 B, state 96 B/token
    cap = 1000  # 101,000 B per rank
    ok = StepPlan(4, cap, [1], [900], [Wave([Group(ranks=(0,), chunked={0: [ChunkedSample(1, 50, 1)]})])])
    ok.validate(CL, cost)  # 1000 + 50 x 100 + 900 x 96 = 92,400 B <= 101,000 B
    assert cost.memory_bytes(50) + state_bytes(cost, 1040) > cost.memory_bytes(cap)  # 1040 x 96 + 6,000
    big = StepPlan(4, cap, [1], [1040], [Wave([Group(ranks=(0,), chunked={0: [ChunkedSample(1, 50, 1)]})])])
    big.validate(CL)  # activations alone fit
    with pytest.raises(PlanError, match=r"chunked sample 1 \(1040 tokens in 21 chunks, K=1\) needs .* GiB"):
        big.validate(CL, cost)


def test_simulator_prices_chunked_samples_with_the_chunk_cost():
    cost = toy_cost()
    p = StepPlan(
        world_size=2,
        max_tokens_per_rank=1000,
        sample_ids=[1, 2, 3],
        lengths=[40, 30, 10],
        waves=[
            Wave([Group(ranks=(0,), chunked={0: [ChunkedSample(1, 16, 1), ChunkedSample(2, 16, 2)]})]),
            Wave([Group(ranks=(0,), local={0: [3]})]),
        ],
    )
    sim = simulate(p.validate(), cost)
    one = chunked_sample_cost(cost, dependent_chunk_sizes(40, 16), 1)
    two = chunked_sample_cost(cost, dependent_chunk_sizes(30, 16), 2)
    assert sim.compute_ms[0] == pytest.approx(one.compute_ms + two.compute_ms + standalone_chunk_ms(cost, [10]))
    assert sim.makespan_ms == pytest.approx(sim.compute_ms[0])
    assert sim.compute_ms[1] == 0 and sim.idle_ms[1] == pytest.approx(sim.makespan_ms)
    # memory: the larger of the two samples' activations + their own store, one sample at a time
    assert sim.peak_memory_bytes[0] == pytest.approx(
        max(cost.memory_bytes(one.activation_tokens) + one.state_bytes, cost.memory_bytes(30) + two.state_bytes)
    )
    assert sim.peak_tokens[0] == max(one.activation_tokens, two.activation_tokens, 10)
    assert sim.cp_size_samples == {1: 3}


def test_the_collator_hands_chunked_samples_over_and_replay_refuses_them():
    from hf_cp.plan.chunks import dependent_chunk_sizes
    from hf_cp.profiling.replay import rank_micro_batches
    from hf_cp.train.data.collator import PlanCollator

    p = chunked_plan().validate(CL)
    lens = p.length_of()
    coll = PlanCollator(lambda sid: (list(range(lens[sid])), None))
    step = coll.rank_step(p, 0, global_valid_tokens=100)
    (mb,) = [m for m in step.waves if m is not None]
    (c,) = mb.chunked
    chunk = [x for w in p.waves for g in w.groups for cs in g.chunked.values() for x in cs if x.sample == 10][0]
    assert c.sample == 10 and c.chunk_sizes == dependent_chunk_sizes(lens[10], chunk.chunk_size)
    assert c.input_ids.tolist() == list(range(lens[10])) and mb.num_tokens == lens[10]
    assert c.shift_labels[-1] == -100 and c.shift_labels[:-1].tolist() == list(range(1, lens[10]))
    # every rank pads each wave to its largest backward count: one per dependent chunk, and one
    # more in a last wave with chunked samples (a padding micro-batch holds the accumulation boundary)
    calls = [p.backward_calls(0, r) for r in range(p.world_size)]
    assert len(p.waves) == 1 and calls[0] == len(c.chunk_sizes) and step.wave_backward_calls[0] == max(calls) + 1
    assert coll.rank_step(p, 1, global_valid_tokens=100).waves[0].local_ids == [11, 12]
    with pytest.raises(PlanError, match=r"rank 2 runs chunked samples \[13\]"):
        rank_micro_batches(p, 2)


def test_the_collator_counts_chunked_targets_pads_every_rank_and_refuses_masked_chunks():
    from hf_cp.samples.masks import SampleMask
    from hf_cp.train.data.collator import IGNORE_INDEX, PlanCollator

    p = chunked_plan().validate(CL)
    lens = p.length_of()

    def fetch(sid):  # token t at position t; every third label masked
        ids = list(range(lens[sid]))
        return ids, [t if t % 3 else IGNORE_INDEX for t in ids]

    steps = [PlanCollator(fetch).rank_step(p, r, global_valid_tokens=100) for r in range(4)]
    # under ZeRO-2 every backward reduces gradients: every rank pads wave 0 to rank 2's 5 chunks,
    # plus one padding micro-batch for the accumulation boundary (wave 0 is the last)
    assert [s.wave_backward_calls for s in steps] == [[6]] * 4
    mb = steps[0].waves[0]
    (rows,) = mb.chunked
    _, labels = fetch(10)
    assert rows.keep == 1 and rows.shift_labels.tolist() == labels[1:] + [IGNORE_INDEX]  # shifted over the sample
    assert mb.input_ids.shape == (1, 0) and mb.backward_calls == 3
    assert mb.num_valid == sum(t != IGNORE_INDEX for t in labels[1:]) and not mb.has_masks
    assert steps[0].trained_sample_ids == [10]
    two = steps[2].waves[0]
    assert [(c.sample, c.chunk_sizes, c.keep) for c in two.chunked] == [(13, [500] * 5, 2)] and two.backward_calls == 5
    assert steps[1].waves[0].backward_calls == 1 and steps[3].waves == [None]
    # dependent chunks attend causally over the K/V store: a masked sample is refused by name
    masked = PlanCollator(fetch, {10: SampleMask.shared_prompt(1000, [1000, 1000])})
    with pytest.raises(ValueError, match=r"sample 10 has a 'shared_prompt' mask; dependent chunks attend causally"):
        masked.rank_step(p, 0, global_valid_tokens=100)
