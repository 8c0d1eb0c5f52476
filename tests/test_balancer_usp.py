"""USP (Ulysses x ring) as a placement: valid for every factorisation and mask, each member
owning its share of tokens, Ulysses within a ring position (head ranges over its u members)
and the ring across positions, with u = g being Ulysses and u = 1 a ring placement."""

import gc
import random

import pytest

from hf_cp.balance import PlanRequest, get_balancer
from hf_cp.balance.toolkit import relayout
from hf_cp.balance.toolkit.placement import sample_slices
from hf_cp.balance.toolkit.usp_layout import usp_factorisations, usp_placement
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.samples.masks import SampleMask

MASKS = [SampleMask.causal(301), SampleMask.shared_prompt(17, [40, 33, 61]), SampleMask.sliding_window(190, 24)]
LENS = [m.length for m in MASKS]


def test_factorisations_divide_the_group_and_the_heads():
    assert usp_factorisations(8, 28) == [(1, 8), (2, 4), (4, 2)]
    assert usp_factorisations(8, 32) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert usp_factorisations(4, 28, max_ulysses=2) == [(1, 4), (2, 2)]


@pytest.mark.parametrize("u,r", [(2, 2), (4, 2), (2, 4), (4, 1), (1, 4)])
@pytest.mark.parametrize("ring_layout", ["zigzag", "per_doc"])
def test_usp_placement_is_valid_and_runs_ulysses_within_a_ring_position(u, r, ring_layout):
    H = 8
    pl = usp_placement(LENS, u, r, H, MASKS, ring_layout)
    pl.check(LENS, sample_slices(LENS, MASKS))
    g = u * r
    tok = pl.member_tokens()
    assert max(tok) - min(tok) <= 2 * len(LENS) + 2  # equal shares up to the splits' remainders
    h = H // u
    for b in pl.compute:
        assert b.head_end - b.head_start == h
        pos_q = pl.chunks[b.q_chunk].owner // u
        assert b.executor == pos_q * u + b.head_start // h  # member i of the query's position
    # every member computes the same share of the masked pairs when the ring part is balanced
    pairs = pl.member_pairs()
    assert sum(pairs) == sum(m.pairs() for m in MASKS)
    if r == 1:  # pure Ulysses: each member runs all pairs on its heads
        assert max(pairs) == min(pairs)
    assert len(pairs) == g


def test_usp_refuses_a_head_count_it_cannot_split():
    with pytest.raises(ValueError, match="splits 28 query heads unevenly"):
        usp_placement([100], 8, 1, 28)


def test_a_group_spanning_nodes_prices_each_link_level_with_its_own_bytes(h200_cost):
    """Two samples, each placed inside one node of a 16-rank group, every block run by a
    neighbour in the same node (so no computation hides the exchange): nothing crosses nodes,
    and each member's communication costs exactly its bytes on NVLink, not on the inter-node
    link a single link level for the group would charge (block_cost's link levels, which USP's
    placement relies on: its head exchange stays inside a node, its ring crosses nodes)."""
    from hf_cp.balance.toolkit.placement import BlockPlacement, Chunk, add_compute_blocks
    from hf_cp.cost.blocks import block_group_costs, exchange_bytes, exchange_phases
    from hf_cp.cost.hardware import transfer_ms as _transfer_ms
    from hf_cp.plan.block_layout import doc_slices, layer_exchange

    lens = [64_000, 64_000]
    pl = BlockPlacement(16, h200_cost.dims.num_heads)
    for d in range(2):
        for i in range(8):  # sample d on node d, 8 contiguous chunks
            pl.chunks.append(Chunk(d, i * 8000, 8000, d * 8 + i))
    add_compute_blocks(
        pl, sample_slices(lens), lambda q, k, a, b: (pl.chunks[q].owner // 8) * 8 + (pl.chunks[q].owner + 1) % 8
    )
    lay = pl.to_layout()
    costs = block_group_costs(lay, lens, list(range(16)), h200_cost)
    ex = layer_exchange(lay, doc_slices(lens), h200_cost.dims.num_heads, h200_cost.dims.num_kv_heads)
    links, L = h200_cost.profile.links, h200_cost.dims.num_layers
    for m in (0, 7, 12):
        xb = exchange_bytes(lay, ex, m, h200_cost.dims.head_dim, h200_cost.profile.bytes_per_element)
        phases = (xb.fwd_dispatch, xb.fwd_return, xb.bwd_dispatch, xb.bwd_return)
        on = exchange_phases(ex)
        near = [_transfer_ms(x, links["intra_node"], 7) if o else 0.0 for x, o in zip(phases, on)]
        far = [_transfer_ms(x, links["inter_node"], 15) if o else 0.0 for x, o in zip(phases, on)]
        assert costs[m].comm_ms == pytest.approx(L * sum(near))
        assert L * sum(far) > 2 * costs[m].comm_ms  # what one inter-node link for the group would charge


def test_usp_after_magi_on_one_request_takes_its_base_plan_and_plans_what_it_plans_alone(h200_cost):
    """auto plans magi then usp, both relaid out from dynamic_cp's plan of the same request: usp
    takes the plan magi's base made (issue 39), and its plan is the one it makes alone; the
    kept plan goes with its request."""
    masks = {i: SampleMask.shared_prompt(3000 + 500 * i, [4000, 5000, 6000]) for i in range(6)}

    def request():
        return PlanRequest(
            list(range(6)), [m.length for m in masks.values()], ClusterSpec(8, 32768), h200_cost, masks=masks
        )

    alone = get_balancer("usp").plan(request()).to_json()
    req = request()
    get_balancer("magi").plan(req)
    usp = get_balancer("usp")
    usp.base.plan = None  # not asked: the base plan of this request is kept
    assert usp.plan(req).to_json() == alone
    del req
    gc.collect()
    assert relayout._last_base is None


def blocks_compute_bound_ms(cost, pl, local, local_masks) -> float:
    """The reference: the slowest member's computation summed over the built placement's own
    compute blocks (their pairs, head ranges and query chunks)."""
    H = cost.dims.num_heads
    attn = [0.0] * pl.group_size
    for b in pl.compute:
        h = b.head_end - b.head_start
        factor = cost.head_split_factor(max(1, round(H / h))) if h < H else 1.0
        attn[b.executor] += cost.c2 * b.pairs * h / H * factor / cost.chunk_efficiency(pl.chunks[b.q_chunk].length)
    return relayout.slowest_member_bound_ms(cost, pl.member_tokens(), attn, local, local_masks)


@pytest.mark.parametrize("families", [("magi",), ("usp",)])
@pytest.mark.parametrize("g", [2, 4, 8])
def test_a_placements_bound_before_it_is_built_is_its_compute_bound(h200_cost, g, families):
    """choose_layout bounds each placement (magi's windows, every USP factorisation in both ring
    layouts) from its chunks before building it: the same number as blocks_compute_bound_ms over the
    built placement's compute blocks, with masked, causal and local samples."""
    rng = random.Random(g)
    masks = [SampleMask.shared_prompt(rng.randint(10, 900), [rng.randint(50, 3000) for _ in range(4)]), None]
    masks += [SampleMask.sliding_window(5000, 700), None]
    lens = [m.length if m is not None else rng.randint(100, 9000) for m in masks]
    local = {0: [300, 1200]}
    local_masks = {0: [None, SampleMask.shared_prompt(200, [500, 500])]}
    opt = relayout.LayoutOptions(families=families)
    checked = 0
    for name, _mode, placement in relayout._candidates(h200_cost, lens, masks, g, opt, local, local_masks):
        if placement is None:
            continue
        bound, build = placement
        assert bound == pytest.approx(blocks_compute_bound_ms(h200_cost, build(), local, local_masks), rel=1e-12), name
        checked += 1
    assert checked >= 2
