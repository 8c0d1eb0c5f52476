"""Recurrent hybrids (Gated DeltaNet: Qwen3-Next, Qwen3.5 and its MoE; Mamba2: Bamba, Falcon-H1;
Mamba: Jamba; the short convolution of LFM2) are exact under hf_cp: on a packed row in one
process, and with documents spread over real gloo CP groups of 2 and 4 in every whole-document
shard mode. The reference runs each document ALONE through the same weights with eager
attention, so a recurrent state or convolution window that crosses a document start, or a rank
that runs its shard as if it were the whole document, shows as a gradient error.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_cp.attention.interface  # noqa: F401  (registers attn_implementation "hf_cp")
from hf_cp.attention.recurrent import attach_recurrent_layers
from hf_cp.modes.segments import ShardMode
from hf_cp.train.checks.model import model_refusals

from helpers.attention_pool import pools, process_group  # noqa: F401  (pools: fixture)
from helpers.cp_layout import group_documents, member_rows

TOL = 1e-5
BASE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=64,
    max_position_embeddings=128,
    use_cache=False,
)
GATED_DELTANET = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
FAMILIES = {  # family -> config overrides keeping both kinds of layer
    "qwen3_next": dict(GATED_DELTANET, **MOE),  # Gated DeltaNet + gated attention, MoE
    "qwen3_5_text": GATED_DELTANET,
    "qwen3_5_moe_text": dict(GATED_DELTANET, **MOE),
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8),  # Mamba2
    "falcon_h1": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=8),  # Mamba2 beside attention
    "jamba": dict(
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, num_experts=2, mamba_d_state=8, mamba_dt_rank=4
    ),  # Mamba
    "lfm2": dict(layer_types=["conv", "full_attention"]),  # short convolution
}
WORLD4_FAMILIES = ("qwen3_next", "bamba")


def _models(family: str):
    cfg = AutoConfig.for_model(family, **BASE, **FAMILIES[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="hf_cp").train()
    with torch.no_grad():  # slow decay (random init forgets within a token or two): the state must carry far
        for module in model.modules():
            if hasattr(module, "A_log"):
                module.A_log.fill_(math.log(0.05))
            if hasattr(module, "dt_bias"):
                module.dt_bias.fill_(-2.0)
    # a config of its own: from_config sets the attention implementation on the config it is given
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").train()
    ref.load_state_dict(model.state_dict())
    return model, ref


def _documents(lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (n,), generator=gen) for n in lengths]


def _doc_loss(logits, ids):
    return torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum")


def _reference_grads(ref, docs):
    """Each document alone through the eager model: the loss and every gradient."""
    n_valid = sum(len(d) - 1 for d in docs)
    ref.zero_grad()
    total = 0.0
    for d in docs:
        loss = _doc_loss(ref(input_ids=d[None]).logits[0], d) / n_valid
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}


def _worst(grads, ref_grads):
    """Largest relative gradient error over the parameters (and its name)."""
    worst = (0.0, "")
    for n, g in ref_grads.items():
        if g.norm() > 0:
            worst = max(worst, (((grads[n] - g).norm() / g.norm()).item(), n))
    return worst


def _packed_loss(model, docs):
    n_valid = sum(len(d) - 1 for d in docs)
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    logits = model(input_ids=ids, position_ids=pos).logits[0]
    loss, off = 0.0, 0
    for d in docs:
        loss = loss + _doc_loss(logits[off : off + len(d)], d)
        off += len(d)
    return loss / n_valid


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_documents_restart_the_recurrence(family):
    model, ref = _models(family)
    docs = _documents([13, 7, 20])
    ref_loss, ref_grads = _reference_grads(ref, docs)
    # transformers' own layer carries its state over the packed row's document starts
    _packed_loss(model, docs).backward()
    assert _worst({n: p.grad for n, p in model.named_parameters()}, ref_grads)[0] > 1e-2
    model.zero_grad()
    assert model.config._attn_implementation == "hf_cp"
    assert attach_recurrent_layers(model) and model_refusals(model) == []
    loss = _packed_loss(model, docs)
    loss.backward()
    err, name = _worst({n: p.grad for n, p in model.named_parameters()}, ref_grads)
    assert abs(loss.item() - ref_loss) <= TOL * abs(ref_loss)
    assert err <= TOL, (name, err)


def _own_rows_only(x, counts, ctx):
    before = sum(counts[: ctx.member])
    return torch.cat([x.new_zeros(before, x.shape[1]), x, x.new_zeros(sum(counts) - before - x.shape[0], x.shape[1])])


def _worker(rank, world, family, distributed, locals_per_member, modes, drop_gather=False):
    import hf_cp.attention.recurrent as recurrent

    group = process_group(list(range(world)))
    lengths = group_documents(distributed, locals_per_member)
    docs = _documents(lengths, seed=3)
    model, ref = _models(family)
    ref_loss, ref_grads = _reference_grads(ref, docs)
    attach_recurrent_layers(model)
    ids, pos = torch.cat(docs), torch.cat([torch.arange(n) for n in lengths])
    labels = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs])
    gather = recurrent._gather_rows
    if drop_gather:  # break the exchange on purpose: the other members' rows arrive as zeros
        recurrent._gather_rows = _own_rows_only
    try:
        return _run_modes(
            rank, world, model, ref_loss, ref_grads, ids, pos, labels, group, distributed, locals_per_member, modes
        )
    finally:
        recurrent._gather_rows = gather


def group_step(model, ctx, ids, pos, labels, rows, n_valid):
    """One forward and backward of this member's `rows` under `ctx`: the group's summed loss and
    every parameter's gradient summed over the group (the data-parallel reduction)."""
    import torch.distributed as dist

    from hf_cp.attention import cp_context

    model.zero_grad()
    with cp_context(ctx):
        logits = model(input_ids=ids[rows][None], position_ids=pos[rows][None]).logits[0]
        loss = torch.nn.functional.cross_entropy(logits.float(), labels[rows], ignore_index=-100, reduction="sum")
        (loss / n_valid).backward()
    total = (loss / n_valid).detach().clone()
    dist.all_reduce(total)
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        grads[n] = g
    return total.item(), grads


def _run_modes(
    rank, world, model, ref_loss, ref_grads, ids, pos, labels, group, distributed, locals_per_member, modes,
    masks=(), local_masks=(),
):  # fmt: skip
    """Per mode: the group's summed loss and gradients against the reference (masks: of the
    distributed documents; local_masks: of this rank's local ones)."""

    from hf_cp.attention import CPContext

    n_valid = int((labels != -100).sum())
    out = []
    for mode in modes:
        model.zero_grad()
        rows = member_rows(mode, distributed, locals_per_member, rank)
        ctx = CPContext(
            group=group,
            group_ranks=tuple(range(world)),
            member=rank,
            mode=mode,
            distributed_lengths=tuple(distributed),
            local_lengths=tuple(locals_per_member[rank]),
            masks=tuple(masks),
            local_masks=tuple(local_masks),
        )
        total, grads = group_step(model, ctx, ids, pos, labels, rows, n_valid)
        err, name = _worst(grads, ref_grads)
        out.append(dict(mode=mode.value, rank=rank, loss=total, ref_loss=ref_loss, err=err, worst=name))
    return out


MODES = [ShardMode.ULYSSES, ShardMode.RING_ZIGZAG, ShardMode.RING_PER_DOC]
LAYOUTS = {2: ([29, 6], [[5], [9, 3]]), 4: ([31, 9], [[4], [], [7, 2], [1]])}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world, family", [(2, f) for f in sorted(FAMILIES)] + [(4, f) for f in WORLD4_FAMILIES])
def test_spread_documents_are_exact_in_every_shard_mode(pools, world, family):
    distributed, locals_per_member = LAYOUTS[world]
    rows = pools(world).run(_worker, family, distributed, locals_per_member, MODES, timeout_s=180)
    assert {r["mode"] for r in rows} == {m.value for m in MODES}
    for r in rows:
        assert abs(r["loss"] - r["ref_loss"]) <= TOL * abs(r["ref_loss"]), r
        assert r["err"] <= TOL, r


@pytest.mark.timeout(240)
def test_a_rank_without_the_others_shards_is_caught(pools):
    # bamba's Mamba2 layers gather a spread document (Gated DeltaNet passes state instead:
    # tests/test_state_passing.py breaks that hand-off)
    rows = pools(2).run(_worker, "bamba", *LAYOUTS[2], [ShardMode.RING_PER_DOC], True, timeout_s=180)
    assert all(r["err"] > 1e-3 for r in rows), rows


def test_the_start_up_line_names_each_recurrent_layer_how_it_spreads_and_its_kernel():
    from hf_cp.attention.recurrent import recurrent_layers_line

    line = recurrent_layers_line(_models("qwen3_next")[0])
    assert line == (
        "recurrent layers: 1 x Qwen3NextGatedDeltaNet (per document; spread documents: state passing across a CP "
        "group; kernel: transformers' torch reference)"
    )
    assert "1 x BambaMixer (per document; spread documents: gathered on every member" in recurrent_layers_line(
        _models("bamba")[0]
    )
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **BASE))
    assert recurrent_layers_line(plain) is None
