"""State passing for Gated DeltaNet layers (hf_cp/attention/state_passing.py): documents spread
over real gloo CP groups of 2 and 4, each member running the layer on its own rows only, in every
shard mode (Ulysses, ring zigzag and per document, blocks), against each document ALONE through
the eager model (tests/test_recurrent_mixers.py's reference). The documents are long enough that
a member's piece spans several of the kernel's 64-token chunks, and short enough that a piece's
convolution window reaches over several other members' pieces. At world 4 the tiny config's 2
linear key heads do not divide the group: state passing needs no head divisibility.
"""

from __future__ import annotations

import pytest
import torch
from test_recurrent_mixers import TOL, _documents, _models, _reference_grads, _worst, group_step

from hf_cp.attention import state_passing
from hf_cp.modes.segments import Segment, ShardMode

from helpers.attention_pool import pools, process_group  # noqa: F401  (pools: fixture)
from helpers.cp_layout import group_documents

LAYOUTS = {2: ([150, 3, 70], [[5], [9, 3]]), 4: ([200, 3, 90], [[4], [], [7, 2], [1]])}
RUNS = ["ulysses", "ring_zigzag", "ring_per_doc", "blocks"]


def test_halo_routes_reach_over_several_members():
    # a 7-token document in pieces of 1-3 tokens on three members; a window of 3
    segments_of = [
        [Segment(0, 0, 2), Segment(0, 5, 2)],
        [Segment(0, 2, 1)],
        [Segment(0, 3, 2)],
    ]
    routes = state_passing.halo_routes(segments_of, 3)
    assert routes[0] == [[], [(1, 0, 1), (2, 0, 2)]]  # tokens 2-4: member 1's row 0, member 2's rows 0-1
    assert routes[1] == [[(0, 0, 2)]]  # tokens 0-1: member 0's rows 0-1
    assert routes[2] == [[(0, 0, 2), (1, 0, 1)]]  # tokens 0-2: member 0, then member 1
    with pytest.raises(ValueError, match="held by no member"):
        state_passing.halo_routes([[Segment(0, 0, 2)], [Segment(0, 3, 2)]], 3)


def _layout_rows(mode, lay, distributed, locals_, rank, lengths):
    from helpers.cp_layout import member_rows

    if lay is None:
        return member_rows(mode, distributed, locals_, rank)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    nd = len(distributed)
    mine = range(nd + sum(len(m) for m in locals_[:rank]), nd + sum(len(m) for m in locals_[: rank + 1]))
    pieces = [(d, 0, lengths[d]) for d in mine] + [
        (c.doc, c.start, c.length) for c in (lay.chunks[i] for i in lay.member_chunks(rank))
    ]
    return torch.cat([torch.arange(starts[d] + a, starts[d] + a + n) for d, a, n in pieces])


def _worker(rank, world, family, break_with=None, checkpointing=False):

    from hf_cp.attention import CPContext
    from hf_cp.attention.recurrent import attach_recurrent_layers
    from hf_cp.plan.block_layout import doc_slices, random_layout

    group = process_group(list(range(world)))
    distributed, locals_ = LAYOUTS[world]
    lengths = group_documents(distributed, locals_)
    docs = _documents(lengths, seed=5)
    model, ref = _models(family)
    if checkpointing:  # backward recomputes each layer's forward, its exchanges included
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_loss, ref_grads = _reference_grads(ref, docs)
    attach_recurrent_layers(model)
    ids, pos = torch.cat(docs), torch.cat([torch.arange(n) for n in lengths])
    labels = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs])
    n_valid = int((labels != -100).sum())
    heads = model.config.num_attention_heads
    seen = []  # (own rows, longest batch row) of every state-passing forward on this member
    call = state_passing._PassedStateKernel.__call__

    def recording(self, query, *args, **kwargs):
        seen.append((sum(n for _, n in self.pieces), query.shape[1]))
        return call(self, query, *args, **kwargs)

    state_passing._PassedStateKernel.__call__ = recording
    chain, routes = state_passing.chain_states, state_passing.halo_routes
    if break_with == "drop_state":  # every piece starts from zero, as if run alone
        state_passing.chain_states = lambda every, segs, dv: [None] * sum(len(s) for s in segs)
    if break_with == "drop_halo":  # every piece's convolution starts from zeros
        state_passing.halo_routes = lambda segs, width: [[[] for _ in s] for s in segs]
    out = []
    try:
        for label in RUNS:
            mode = ShardMode(label)
            lay = random_layout(distributed, world, heads, doc_slices(distributed), 11) if label == "blocks" else None
            rows = _layout_rows(mode, lay, distributed, locals_, rank, lengths)
            ctx = CPContext(
                group=group,
                group_ranks=tuple(range(world)),
                member=rank,
                mode=mode,
                distributed_lengths=tuple(distributed),
                local_lengths=tuple(locals_[rank]),
                blocks=lay,
            )
            seen.clear()
            total, grads = group_step(model, ctx, ids, pos, labels, rows, n_valid)
            err, worst = _worst(grads, ref_grads)
            own = sum(s.length for s in ctx.segments())
            out.append(
                dict(run=label, rank=rank, loss=total, ref_loss=ref_loss, err=err, worst=worst, own=own,
                     seen=list(seen), longest=max(s.length for s in ctx.segments()) if own else 0)
            )  # fmt: skip
    finally:
        state_passing._PassedStateKernel.__call__ = call
        state_passing.chain_states, state_passing.halo_routes = chain, routes
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, family", [(2, "qwen3_next"), (2, "qwen3_5_text"), (4, "qwen3_next")])
def test_spread_documents_pass_state_exactly_in_every_shard_mode(pools, world, family):
    rows = pools(world).run(_worker, family, timeout_s=240)
    assert {r["run"] for r in rows} == set(RUNS)
    for r in rows:
        assert abs(r["loss"] - r["ref_loss"]) <= TOL * abs(r["ref_loss"]), r
        assert r["err"] <= TOL, r
        # one state-passing forward per linear layer, over this member's rows only (plus at most a
        # 3-row window per piece): no member runs another member's rows
        if not r["own"]:  # a member with no piece only takes part in the exchanges
            assert r["seen"] == [], r
            continue
        assert len(r["seen"]) == 1, r
        own, longest = r["seen"][0]
        assert own == r["own"], r
        assert longest <= r["longest"] + 3, r
    assert any(not r["own"] for r in rows) == (world == 4)  # the random block layout leaves a member out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("broken", ["drop_state", "drop_halo"])
def test_a_dropped_state_or_window_is_caught(pools, broken):
    rows = pools(2).run(_worker, "qwen3_next", broken, timeout_s=240)
    for r in rows:
        assert r["err"] > 1e-3, r


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "bamba"])
def test_the_cost_model_prices_state_passing_exactly_where_it_runs(family):
    """ModelDims reads from the config what the runtime does: state passing for the model types
    whose linear layers are in STATE_PASSING_MIXERS (and their state's size), gathering for the
    others (cost/dims.py STATE_PASSING_MODEL_TYPES against attention/state_passing.py)."""
    from hf_cp.cost.dims import ModelDims

    model, _ = _models(family)
    cfg = model.config
    dims = ModelDims.from_hf_config(cfg.to_dict())
    linear = [m for m in model.modules() if hasattr(m, "conv_kernel_size")]
    assert linear
    passes = {type(m).__name__ in state_passing.STATE_PASSING_MIXERS for m in linear}
    assert passes == {bool(dims.passed_state_elements)}
    if dims.passed_state_elements:
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        assert dims.passed_state_elements == cfg.linear_num_value_heads * dk * (dv + dk)
        assert dims.conv_window == cfg.linear_conv_kernel_dim - 1


@pytest.mark.timeout(300)
def test_state_passing_is_exact_under_activation_checkpointing(pools):
    rows = pools(2).run(_worker, "qwen3_next", None, True, timeout_s=240)
    for r in rows:
        assert abs(r["loss"] - r["ref_loss"]) <= TOL * abs(r["ref_loss"]), r
        assert r["err"] <= TOL, r
        assert len(r["seen"]) == 2, r  # the forward, and its recomputation in backward
