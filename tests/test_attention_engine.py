"""The block engine on real gloo process groups against a single-process float64 reference.

Each case is one CP group's micro-batch: distributed samples with masks of every kind, local
samples (masked too), a layer window and attention sinks optionally. Every rank builds the
whole micro-batch, the dense masked reference (tests/helpers/mask_reference.py, written from each
mask's definition) and its gradients; then runs its own rows under several placements of the
same chunks (identity, a random permutation, every block away from its query's owner, random
head splits) and compares its output rows, dQ/dK/dV rows and the sinks' gradient (summed over
ranks) with the reference, the bytes it sent with block_cost's model, and the K/V chunks it sent.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from helpers.attention_pool import pools, process_group  # noqa: F401  (pools: fixture)
from helpers.mask_specs import make_mask, spec_length

TOL = 1e-5


# ----------------------------------------------------------------------------- the worker
def _layouts(lengths, slices, g, heads, seed, names):
    from hf_cp.plan.block_layout import (
        all_remote_layout,
        contiguous_layout,
        per_doc_layout,
        random_layout,
        ulysses_layout,
        zigzag_layout,
    )

    make = {
        "identity": lambda: contiguous_layout(lengths, g, heads, slices),
        "random": lambda: random_layout(lengths, g, heads, slices, seed),
        "remote": lambda: all_remote_layout(random_layout(lengths, g, heads, slices, seed), g, seed),
        "random_heads": lambda: random_layout(lengths, g, heads, slices, seed + 1, split_heads=True),
        "zigzag": lambda: zigzag_layout(lengths, g, heads, slices),
        "per_doc": lambda: per_doc_layout(lengths, g, heads, slices),
        "ulysses": lambda: ulysses_layout(lengths, g, heads, slices),
    }
    return {n: make[n]() for n in names}


def _worker(rank, world, cases):
    import torch.distributed as dist

    from hf_cp.attention import COMM_COUNTER, CPContext, cp_attention
    from hf_cp.attention.dispatch import layer_slices
    from hf_cp.cost.blocks import exchange_bytes
    from hf_cp.modes.registry import rank_segments
    from hf_cp.modes.segments import ShardMode
    from hf_cp.plan.block_layout import causal_slices, layer_exchange

    from helpers.mask_reference import packed_dense_mask, reference_attention

    group = process_group(list(range(world)))
    results = []
    for ci, case in enumerate(cases):
        heads, kv_heads, d = case["heads"]
        dist_masks = [make_mask(s) for s in case["distributed"]]
        dist_lengths = [spec_length(s) for s in case["distributed"]]
        local_masks = [[make_mask(s) for s in mem] for mem in case["locals"]]
        local_lengths = [[spec_length(s) for s in mem] for mem in case["locals"]]
        window = case.get("window")
        lengths = dist_lengths + [n for mem in local_lengths for n in mem]
        masks = dist_masks + [m for mem in local_masks for m in mem]
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        gen = torch.Generator().manual_seed(case["seed"])
        t = sum(lengths)
        q = torch.randn(t, heads, d, generator=gen)
        k = torch.randn(t, kv_heads, d, generator=gen)
        v = torch.randn(t, kv_heads, d, generator=gen)
        dout = torch.randn(t, heads, d, generator=gen)
        sinks = torch.randn(heads, generator=gen) if case.get("sinks") else None
        scale = 1.0 / math.sqrt(d)
        ref_in = [x.double().requires_grad_() for x in (q, k, v)]
        ref_sinks = sinks.double().requires_grad_() if sinks is not None else None
        ref_out = reference_attention(*ref_in, packed_dense_mask(lengths, masks, window), scale, ref_sinks)
        ref_grads = torch.autograd.grad(ref_out, ref_in + ([ref_sinks] if sinks is not None else []), dout.double())
        slices = layer_slices(tuple(dist_lengths), dist_masks, None)  # the plan's masks (no layer window)
        none = [None] * len(dist_lengths)
        plan_slices = [s if s is not None else causal_slices(n) for s, n in zip(slices or none, dist_lengths)]
        layer = layer_slices(tuple(dist_lengths), dist_masks, window)
        layer_sl = [s if s is not None else causal_slices(n) for s, n in zip(layer or none, dist_lengths)]
        first_local = len(dist_lengths) + sum(len(m) for m in local_lengths[:rank])
        local_rows = [
            r
            for i in range(len(local_lengths[rank]))
            for r in range(starts[first_local + i], starts[first_local + i + 1])
        ]
        outs = {}
        placements = _layouts(dist_lengths, plan_slices, world, heads, case["seed"], case["placements"])
        for mode in case.get("modes", []):  # the whole-document modes, for comparison
            placements["mode_" + mode] = None
        for name, lay in placements.items():
            if lay is not None:
                segs = lay.member_segments(rank)
                ctx_mode = ShardMode.BLOCKS
            else:
                ctx_mode = ShardMode(name[len("mode_") :])
                segs = rank_segments(ctx_mode, dist_lengths, world, rank)
            rows = torch.tensor(
                local_rows + [starts[s.doc] + s.start + i for s in segs for i in range(s.length)], dtype=torch.long
            )
            mine = [x[rows].clone().requires_grad_() for x in (q, k, v)]
            my_sinks = sinks.clone().requires_grad_() if sinks is not None else None
            ctx = CPContext(
                group=group,
                group_ranks=tuple(range(world)),
                member=rank,
                mode=ctx_mode,
                distributed_lengths=tuple(dist_lengths),
                local_lengths=tuple(local_lengths[rank]),
                blocks=lay,
                masks=tuple(dist_masks),
                local_masks=tuple(local_masks[rank]),
            )
            COMM_COUNTER.reset()
            out = cp_attention(*mine, ctx, scale, window=window, sinks=my_sinks)
            fwd = COMM_COUNTER.snapshot()
            inputs = mine + ([my_sinks] if sinks is not None else [])
            grads = torch.autograd.grad(out, inputs, dout[rows])
            stats = COMM_COUNTER.snapshot()
            errs = {"out": (out.double() - ref_out[rows]).abs().max().item() if rows.numel() else 0.0}
            for nm, gm, gr in zip(("dq", "dk", "dv"), grads, ref_grads):
                errs[nm] = (gm.double() - gr[rows]).abs().max().item() if rows.numel() else 0.0
            if sinks is not None:
                ds = grads[3].clone()
                dist.all_reduce(ds)
                errs["dsinks"] = (ds.double() - ref_grads[3]).abs().max().item() / max(
                    1.0, ref_grads[3].abs().max().item()
                )
            expected = None
            if lay is not None:
                ex = layer_exchange(lay, layer_sl, heads, kv_heads)
                expected = exchange_bytes(lay, ex, rank, d, 4).total if world > 1 else 0
            outs[name] = out.detach()
            results.append(
                dict(
                    case=ci,
                    placement=name,
                    rank=rank,
                    errors=errs,
                    bytes_sent=stats.bytes_sent,
                    expected_bytes=expected,
                    kv_chunks_sent=fwd.items.get("kv_chunks", 0),
                    ring_fwd_messages=fwd.calls.get("p2p", 0),
                    layout_kv_transfers=lay.kv_transfers() if lay is not None else None,
                )
            )
        for a, b in case.get("compare", []):  # the engine's placement against the fast path with the same rows
            results.append(dict(case=ci, rank=rank, pair=(a, b), diff=(outs[a] - outs[b]).abs().max().item()))
    return results


def _check(rows):
    assert rows
    for r in rows:
        if "pair" in r:
            assert r["diff"] <= 1e-6, f"engine placement differs from the fast path: {r}"
            continue
        for name, err in r["errors"].items():
            assert err <= TOL, f"{name} mismatch vs reference ({err:.3g}): {r}"
        if r["expected_bytes"] is not None:
            assert r["bytes_sent"] == r["expected_bytes"], f"bytes sent differ from block_cost's model: {r}"


# ----------------------------------------------------------------------------- fixed cases
EVERY_KIND = [
    ("causal", 29),
    ("sliding_window", 23, 5),
    ("prefix_lm", 19, 7),
    ("shared_prompt", 0, 5, [6, 3, 7]),
    ("block_causal", 17, 4),
    ("slices", 15),
]
PLACEMENTS = ["identity", "random", "remote", "random_heads"]


def _every_kind_cases(world):
    return [
        dict(  # every mask kind distributed, masked locals, GQA 2 kv heads
            distributed=EVERY_KIND,
            locals=[[("shared_prompt", 0, 2, [3, 2])], [("sliding_window", 9, 3)], [], [("causal", 4)]][:world],
            heads=(4, 2, 8),
            placements=PLACEMENTS,
            seed=11,
        ),
        dict(  # one kv head, a layer window over masked samples, and attention sinks
            distributed=EVERY_KIND[1:],
            locals=[[("prefix_lm", 6, 2)], [], [("causal", 5)], []][:world],
            heads=(4, 1, 8),
            placements=PLACEMENTS,
            window=4,
            sinks=True,
            seed=12,
        ),
    ]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_every_mask_kind_under_three_placements_matches_reference(world, pools):
    rows = pools(world).run(_worker, _every_kind_cases(world), timeout_s=240)
    _check(rows)
    placed = {(r["case"], r["placement"]) for r in rows if "placement" in r}
    assert placed == {(c, p) for c in range(2) for p in PLACEMENTS}
    assert any(r["bytes_sent"] > 0 for r in rows if r.get("placement") == "remote")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_ring_and_ulysses_placements_as_blocks_equal_the_fast_paths(world, pools):
    """Zigzag, per-document and Ulysses expressed as blocks hold the same rows as the ring and
    Ulysses modes: the outputs agree, and every mode honours the masks, window and sinks."""
    case = dict(
        distributed=[("causal", 37), ("shared_prompt", 0, 3, [5, 4]), ("sliding_window", 21, 6)],
        locals=[[("block_causal", 7, 3)], [], [("causal", 2)], []][:world],
        heads=(4, 2, 8),
        placements=["zigzag", "per_doc", "ulysses"],
        modes=["ring_zigzag", "ring_per_doc", "ulysses"],
        compare=[("zigzag", "mode_ring_zigzag"), ("per_doc", "mode_ring_per_doc"), ("ulysses", "mode_ulysses")],
        window=9,
        sinks=True,
        seed=21,
    )
    rows = pools(world).run(_worker, [case], timeout_s=240)
    _check(rows)
    assert sum("pair" in r for r in rows) == 3 * world


@pytest.mark.timeout(240)
def test_causal_zigzag_sends_18_kv_chunks_at_cp4_where_the_ring_sends_24(pools):
    """Counted from the executor's real sends: the engine sends each K/V chunk only to members
    running a block that needs it; the ring forwards every member's two chunks g-1 times."""
    case = dict(
        distributed=[("causal", 64)],
        locals=[[], [], [], []],
        heads=(4, 2, 8),
        placements=["zigzag"],
        modes=["ring_zigzag"],
        seed=5,
    )
    rows = pools(4).run(_worker, [case], timeout_s=180)
    _check(rows)
    engine = [r for r in rows if r.get("placement") == "zigzag"]
    ring = [r for r in rows if r.get("placement") == "mode_ring_zigzag"]
    assert sum(r["kv_chunks_sent"] for r in engine) == 18 == engine[0]["layout_kv_transfers"]
    # every ring message in forward carries the sender's two zigzag chunks
    assert 2 * sum(r["ring_fwd_messages"] for r in ring) == 24


# ----------------------------------------------------------------------------- random cases
SPECS = st.one_of(
    st.integers(1, 30).map(lambda n: ("causal", n)),
    st.tuples(st.integers(1, 30), st.integers(1, 10)).map(lambda x: ("sliding_window", x[0], x[1])),
    st.integers(1, 30).flatmap(lambda n: st.integers(0, n).map(lambda p: ("prefix_lm", n, p))),
    st.tuples(st.integers(0, 6), st.lists(st.integers(1, 8), min_size=1, max_size=3)).map(
        lambda x: ("shared_prompt", 0, x[0], x[1])
    ),
    st.tuples(st.integers(1, 30), st.integers(1, 6)).map(lambda x: ("block_causal", x[0], x[1])),
)


@st.composite
def engine_case(draw, world):
    return dict(
        distributed=draw(st.lists(SPECS, min_size=1, max_size=4)),
        locals=[draw(st.lists(SPECS, max_size=2)) for _ in range(world)],
        heads=draw(st.sampled_from([(4, 4, 8), (4, 2, 8), (4, 1, 8), (6, 2, 8)])),
        placements=["random", "remote", "random_heads"],
        window=draw(st.one_of(st.none(), st.integers(1, 12))),
        sinks=draw(st.booleans()),
        seed=draw(st.integers(0, 10_000)),
    )


HYPOTHESIS = settings(
    max_examples=8,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.timeout(300)
@HYPOTHESIS
@given(case=engine_case(2))
def test_world2_random_placements_match_reference(pools, case):
    _check(pools(2).run(_worker, [case]))


@pytest.mark.timeout(300)
@HYPOTHESIS
@given(case=engine_case(4))
def test_world4_random_placements_match_reference(pools, case):
    _check(pools(4).run(_worker, [case]))
