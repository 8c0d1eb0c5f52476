"""Pricing block plans and masked samples: areas from rect_pairs, bytes from the placement,
the simulator on blocks groups, and the per-group comparison with ring zigzag."""

from __future__ import annotations

import pytest

from hf_cp.cost.blocks import block_group_costs, default_layout, exchange_bytes
from hf_cp.cost.bounds import lower_bound_ms
from hf_cp.cost.exchange import plan_exchange, ring_zigzag_group_bytes
from hf_cp.cost.simulate import simulate
from hf_cp.modes.segments import ShardMode, masked_doc_pairs
from hf_cp.plan.block_layout import all_remote_layout, contiguous_layout, doc_slices, layer_exchange, zigzag_layout
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import Group, StepPlan, Wave
from hf_cp.samples.masks import SampleMask


def _linear(cost, tokens):
    return cost.dims.num_layers * cost.c1 * tokens + cost.head_ms_per_token * tokens


def test_whole_document_modes_price_masked_samples_by_their_area(h200_cost):
    n = 65536
    window = SampleMask.sliding_window(n, 4096)
    pairs = masked_doc_pairs(n, window)
    assert pairs == window.pairs() < n * (n + 1) // 2
    want = h200_cost.dims.num_layers * h200_cost.c2 * pairs / h200_cost.chunk_efficiency(n) + _linear(h200_cost, n)
    assert h200_cost.local_ms([n], [window]) == pytest.approx(want)
    assert h200_cost.local_ms([n], [window]) < h200_cost.local_ms([n])
    # ring per-document: the members' attention adds up to the masked area, not the causal one
    ranks = range(4)
    for mask, full in ((window, False), (None, True)):
        costs = [h200_cost.distributed_rank_cost([n], ShardMode.RING_PER_DOC, ranks, m, masks=[mask]) for m in ranks]
        attn = sum(c.compute_ms - _linear(h200_cost, c.tokens) for c in costs)
        assert (attn > 0.9 * h200_cost.local_ms([n]) - _linear(h200_cost, n)) == full
    ul = h200_cost.distributed_rank_cost([n], ShardMode.ULYSSES, ranks, 0, masks=[window])
    assert ul.compute_ms < h200_cost.distributed_rank_cost([n], ShardMode.ULYSSES, ranks, 0).compute_ms


def test_block_costs_charge_each_block_once_at_its_executor(h200_cost):
    lengths, masks = [8192, 4096], [None, SampleMask.shared_prompt(512, [900, 1200, 1484])]
    lay = contiguous_layout(lengths, 4, 28, doc_slices(lengths, masks))
    costs = block_group_costs(lay, lengths, range(4), h200_cost, masks)
    # one executor: the whole group's attention lands on member 0 (plus all the exchange)
    solo = type(lay)(lay.chunks, tuple(b._replace(executor=0) for b in lay.compute))
    solo_costs = block_group_costs(solo, lengths, range(4), h200_cost, masks)
    attn = [c.compute_ms - _linear(h200_cost, c.tokens) for c in costs]
    solo_attn = [c.compute_ms - _linear(h200_cost, c.tokens) for c in solo_costs]
    assert sum(attn) == pytest.approx(solo_attn[0]) and solo_attn[1:] == [pytest.approx(0.0)] * 3
    assert solo_costs[0].comm_bytes > costs[0].comm_bytes


def test_causal_zigzag_as_blocks_moves_54_of_the_ring_80_chunk_units(h200_cost):
    """One causal document in 8 equal chunks at CP 4: forward K/V 18 chunks, backward K/V 18
    again and dK/dV 18 home (54); the ring moves 2(T - T/g) + T per member and layer (80)."""
    n = 8 * 1024
    lay = zigzag_layout([n], 4, 28)
    d = h200_cost.dims
    chunk_bytes = (n // 8) * 2 * d.num_kv_heads * d.head_dim * h200_cost.profile.bytes_per_element
    ex = layer_exchange(lay, doc_slices([n]), d.num_heads, d.num_kv_heads)
    per_layer = sum(exchange_bytes(lay, ex, m, d.head_dim, h200_cost.profile.bytes_per_element).total for m in range(4))
    assert per_layer == 54 * chunk_bytes
    assert ring_zigzag_group_bytes([n], range(4), h200_cost) == d.num_layers * 80 * chunk_bytes


def test_simulator_prices_blocks_groups_and_the_plan_exchange_sits_beside_ring_zigzag(h200_cost):
    lengths = [30000, 12000]
    masks = {1: SampleMask.shared_prompt(2000, [2500] * 4)}
    slices = doc_slices(lengths, [None, masks[1]])
    lay = all_remote_layout(zigzag_layout(lengths, 4, 28, slices), 4, seed=2)
    plan = StepPlan(4, 32768, [0, 1], lengths, [Wave([Group((0, 1, 2, 3), [0, 1], ShardMode.BLOCKS, blocks=lay)])])
    plan.masks = masks
    cl = ClusterSpec(4, 32768)
    plan.validate(cl, h200_cost)
    sim = simulate(plan, h200_cost)
    costs = block_group_costs(lay, lengths, range(4), h200_cost, [None, masks[1]])
    assert sim.comm_bytes == sum(c.comm_bytes for c in costs) > 0
    assert sim.makespan_ms == pytest.approx(max(c.total_ms for c in costs) + h200_cost.micro_batch_overhead_ms())
    assert lower_bound_ms(lengths, cl, h200_cost, [None, masks[1]]) <= sim.makespan_ms
    (row,) = plan_exchange(plan, h200_cost)
    assert row.mode == "blocks" and row.bytes == sim.comm_bytes
    assert row.ring_zigzag_bytes == ring_zigzag_group_bytes(lengths, range(4), h200_cost)
    assert row.kv_transfers == lay.kv_transfers() and row.ring_kv_transfers == 3 * len(lay.chunks)
    # the default placement: same rows as a ring geometry, fewer bytes on a shared prompt
    best = default_layout(lengths, range(4), h200_cost, [None, masks[1]])
    best_bytes = sum(c.comm_bytes for c in block_group_costs(best, lengths, range(4), h200_cost, [None, masks[1]]))
    assert best_bytes < row.ring_zigzag_bytes
