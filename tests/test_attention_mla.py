"""MLA models (DeepSeek-V3: the value head dim unlike the query/key head dim) under hf_cp attention.

hf_cp's kernels take one head dim for q, k and v; hf_cp_attention zero-pads the smaller side to
the larger (v to qk 24 when v is 16; q and k to 32 when v is 32, the softmax scale kept at 24**-0.5)
and slices the output back. Two tiny DeepSeek-V3 configs (tests/helpers/attention_models.py:
"deepseek_v3" v 16 < qk 16+8, no q LoRA; "deepseek_v3_wide_v" v 32 > qk 16+8, q LoRA 16).

The reference is independent of hf_cp: every document alone through the eager model (same seed,
same weights), token losses summed over the batch / valid targets. hf_cp must give its loss,
logits and every parameter gradient:
- in one process on packed rows (position_ids restarting at 0), one row and two;
- in ChunkFlow's dependent chunks of one sample (the K/V state store holds the padded dims);
- on world 2 (gloo) under ring zigzag, ring per document, Ulysses and the block engine (two
  placements), with every rank's bytes equal to the cost model's formula on the config's
  ModelDims (whose head dim for MLA is the padded one).
"""

from __future__ import annotations

import pytest
import torch

from hf_cp.cost.dims import ModelDims
from hf_cp.modes.segments import ShardMode

from helpers.attention_models import CONFIGS, build_model, packed_batch
from helpers.attention_pool import pools, process_group  # noqa: F401  (pools: fixture)
from helpers.chunkflow_reference import grad_errors
from helpers.chunkflow_reference import reference as chunk_reference
from helpers.chunkflow_reference import sample as chunk_sample
from helpers.cp_layout import expected_bytes, group_documents, member_rows

TOL = 1e-5  # relative to the largest entry of each reference tensor
MLA = ["deepseek_v3", "deepseek_v3_wide_v"]


def _loss_sum(logits, labels):
    return torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")


def _per_doc_reference(model_name, lengths, ids, labels, n_valid):
    """(loss, logits [T, V], gradients): each document of the packed sequence alone in the eager model."""
    model = build_model(model_name, "eager")
    loss_total, logits_all, o = 0.0, [], 0
    for n in lengths:
        logits = model(input_ids=ids[o : o + n][None], position_ids=torch.arange(n)[None]).logits[0]
        loss = _loss_sum(logits, labels[o : o + n]) / n_valid
        loss.backward()
        loss_total += loss.item()
        logits_all.append(logits.detach())
        o += n
    return loss_total, torch.cat(logits_all), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_mla_config_dims():
    """The cost model prices MLA at the dims hf_cp runs: heads of max(qk_nope + qk_rope, v), K/V per head."""
    for name, d in (("deepseek_v3", 24), ("deepseek_v3_wide_v", 32)):
        cfg = build_model(name, "hf_cp").config
        assert cfg.head_dim == 8, "transformers' DeepSeek-V3 head_dim is the rope dim, not the attention head dim"
        dims = ModelDims.from_hf_config(cfg.to_dict())
        assert (dims.head_dim, dims.num_heads, dims.num_kv_heads) == (d, 4, 4)
    mla = dict(CONFIGS["deepseek_v3"], intermediate_size=48, num_key_value_heads=1)
    assert ModelDims.from_hf_config(mla).num_kv_heads == 4  # MLA expands K/V to every head


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("model_name", MLA)
def test_packed_documents_match_per_document_eager(model_name, rows, one_torch_thread):
    per_row = [[7, 12, 5], [3, 9, 12]][:rows]
    batches = [packed_batch(lens, CONFIGS[model_name]["vocab_size"], seed=5 + r) for r, lens in enumerate(per_row)]
    n_valid = sum(int((b[2] != -100).sum()) for b in batches)
    refs = [_per_doc_reference(model_name, lens, b[0], b[2], n_valid) for lens, b in zip(per_row, batches)]
    ref_loss = sum(r[0] for r in refs)
    ref_grads = {n: sum(r[2][n] for r in refs) for n in refs[0][2]}

    model = build_model(model_name, "hf_cp")
    ids = torch.stack([b[0] for b in batches])
    pos = torch.stack([b[1] for b in batches])
    labels = torch.stack([b[2] for b in batches])
    logits = model(input_ids=ids, position_ids=pos).logits
    loss = _loss_sum(logits.flatten(0, 1), labels.flatten()) / n_valid
    loss.backward()
    assert loss.item() == pytest.approx(ref_loss, rel=TOL)
    for r in range(rows):
        want = refs[r][1]
        assert (logits[r].detach() - want).abs().max().item() <= TOL * want.abs().max().item()
    errs = grad_errors(model, ref_grads)  # asserts every reference gradient is nonzero
    assert max(errs.values()) <= TOL, errs


@pytest.mark.parametrize("model_name", MLA)
@pytest.mark.parametrize("chunk, keep", [(8, 1), (8, 5)])
def test_chunkflow_chunks_match_the_unchunked_sample(model_name, chunk, keep, one_torch_thread):
    from hf_cp.plan.chunks import dependent_chunk_sizes
    from hf_cp.train.step.chunkflow import ChunkRunStats, run_chunked_sample, sample_chunks

    length, scale = 29, 1 / 23.0
    ids, labels = chunk_sample(length, 3, model_name)
    ref_loss, ref_grads = chunk_reference(model_name, [(ids, labels)], scale, 3)
    model = build_model(model_name, "hf_cp")
    sizes = dependent_chunk_sizes(length, chunk)
    stats = ChunkRunStats()
    loss = run_chunked_sample(model, sample_chunks(ids, labels, sizes), keep, scale, stats=stats)
    assert loss.item() == pytest.approx(ref_loss, rel=TOL)
    errs = grad_errors(model, ref_grads)
    assert max(errs.values()) <= TOL, errs
    dims = ModelDims.from_hf_config(model.config.to_dict())
    assert stats.store_peak_bytes == 2 * dims.kv_bytes_per_token(4) * length  # padded K/V, and their fp32 grads


# ----------------------------------------------------------------------------- world 2 (gloo)
LAYOUT = dict(distributed=[37, 1, 6], locals=[[5, 1], [9]])
RING_MODES = [ShardMode.RING_ZIGZAG, ShardMode.RING_PER_DOC, ShardMode.ULYSSES]
PLACEMENTS = ["contiguous", "random"]


def _worker(rank, world, model_name):
    from dataclasses import replace

    import torch.distributed as dist

    from hf_cp.attention import COMM_COUNTER, CPContext, cp_context
    from hf_cp.cost.blocks import exchange_bytes
    from hf_cp.cost.hardware import HardwareProfile
    from hf_cp.cost.model import CostModel
    from hf_cp.plan.block_layout import contiguous_layout, doc_slices, layer_exchange, random_layout

    group = process_group(list(range(world)))
    distributed, locals_ = LAYOUT["distributed"], LAYOUT["locals"]
    lengths = group_documents(distributed, locals_)
    ids, pos, labels = packed_batch(lengths, CONFIGS[model_name]["vocab_size"], seed=17)
    n_valid = int((labels != -100).sum())
    ref_loss, ref_logits, ref_grads = _per_doc_reference(model_name, lengths, ids, labels, n_valid)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]

    nd, heads = len(distributed), CONFIGS[model_name]["num_attention_heads"]
    slices = doc_slices(distributed)
    layouts = {
        "contiguous": contiguous_layout(distributed, world, heads, slices),
        "random": random_layout(distributed, world, heads, slices, 7),
    }
    my_locals = list(range(nd + sum(len(m) for m in locals_[:rank]), nd + sum(len(m) for m in locals_[: rank + 1])))
    runs = [(m.value, m, None) for m in RING_MODES] + [
        (f"blocks/{p}", ShardMode.BLOCKS, layouts[p]) for p in PLACEMENTS
    ]

    results = []
    for label, mode, lay in runs:
        model = build_model(model_name, "hf_cp")
        dims = ModelDims.from_hf_config(model.config.to_dict())
        if lay is None:
            rows = member_rows(mode, distributed, locals_, rank)
            cost = CostModel(dims, replace(HardwareProfile.load("h200-qwen2.5-7b"), bytes_per_element=4))
            per_layer = expected_bytes(cost, mode, distributed, world, rank)
        else:
            pieces = [(d, 0, lengths[d]) for d in my_locals] + [
                (c.doc, c.start, c.length) for c in (lay.chunks[i] for i in lay.member_chunks(rank))
            ]
            rows = torch.cat([torch.arange(starts[d] + a, starts[d] + a + n) for d, a, n in pieces])
            ex = layer_exchange(lay, slices, dims.num_heads, dims.num_kv_heads)
            per_layer = exchange_bytes(lay, ex, rank, dims.head_dim, 4).total
        ctx = CPContext(
            group=group,
            group_ranks=tuple(range(world)),
            member=rank,
            mode=mode,
            distributed_lengths=tuple(distributed),
            local_lengths=tuple(locals_[rank]),
            blocks=lay,
        )
        COMM_COUNTER.reset()
        with cp_context(ctx):
            logits = model(input_ids=ids[rows][None], position_ids=pos[rows][None]).logits[0]
            loss = _loss_sum(logits, labels[rows]) / n_valid
            loss.backward()
        sent = COMM_COUNTER.snapshot().bytes_sent
        total_loss = loss.detach().clone()
        dist.all_reduce(total_loss)
        grad_err, worst = 0.0, ""
        for n, p in model.named_parameters():
            g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            e = (g - ref_grads[n]).abs().max().item() / ref_grads[n].abs().max().item()
            if e > grad_err:
                grad_err, worst = e, n
        results.append(
            dict(
                model=model_name,
                mode=label,
                rank=rank,
                loss=total_loss.item(),
                ref_loss=ref_loss,
                logits_err=(logits.detach() - ref_logits[rows]).abs().max().item() / ref_logits.abs().max().item(),
                grad_err=grad_err,
                worst_param=worst,
                bytes_sent=sent,
                expected_bytes=model.config.num_hidden_layers * per_layer,
                zero_ref_grads=[n for n, g in ref_grads.items() if not g.abs().max().item() > 0],
            )
        )
    return results


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model_name", MLA)
def test_mla_under_cp_matches_per_document_eager(pools, model_name):
    rows = pools(2).run(_worker, model_name, timeout_s=180)
    assert {r["mode"] for r in rows} == {m.value for m in RING_MODES} | {f"blocks/{p}" for p in PLACEMENTS}
    for r in rows:
        assert not r["zero_ref_grads"], "a reference gradient vanishes: the comparison would prove nothing"
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=TOL), r
        assert r["logits_err"] <= TOL, r
        assert r["grad_err"] <= TOL, r
        assert r["bytes_sent"] == r["expected_bytes"], f"bytes sent differ from the cost model's formula: {r}"
    assert any(r["bytes_sent"] for r in rows)
