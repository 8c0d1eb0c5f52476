"""Models under the block engine with masked samples, on real gloo groups (worlds 2 and 4).

Every rank builds the same tiny model and the same micro-batch: distributed samples of every
mask kind and masked local samples. The single-process reference is built independently:
- a causal sample runs alone;
- a shared-prompt sample runs as one sequence per answer, (prompt, answer_i), with the prompt's
  targets counted once (its logits are the same in every run);
- any other masked sample runs alone with a dense 4D mask written from the mask's definition
  (tests/helpers/mask_reference.py), per layer type for a model with sliding-window layers (the
  window in rotary positions).
The loss is the sum of token losses over the valid targets of the whole batch; summed loss,
each rank's logits rows and the summed parameter gradients must equal the reference under
three placements (identity, a random permutation, every block away from its query's owner),
and every rank's bytes must equal block_cost's model summed over the layers.
"""

from __future__ import annotations

import pytest
import torch

from helpers.attention_pool import pools, process_group  # noqa: F401  (pools: fixture)
from helpers.block_models import (
    CASES,
    MODELS,
    build_model,
    check_rows,
    layer_windows,
    loss_sum,
    reference_sample,
    sample_data,
)
from helpers.mask_specs import make_mask, spec_length

PLACEMENTS = ["identity", "random", "remote"]


def _worker(rank, world, model_name, case, placements):
    import torch.distributed as dist

    from hf_cp.attention import COMM_COUNTER, CPContext, cp_context
    from hf_cp.attention.dispatch import layer_slices
    from hf_cp.cost.blocks import exchange_bytes
    from hf_cp.modes.segments import ShardMode
    from hf_cp.plan.block_layout import (
        all_remote_layout,
        causal_slices,
        contiguous_layout,
        doc_slices,
        layer_exchange,
        random_layout,
    )

    group = process_group(list(range(world)))
    specs = list(case["distributed"]) + [s for mem in case["locals"] for s in mem]
    masks = [make_mask(s) for s in specs]
    lengths = [spec_length(s) for s in specs]
    gen = torch.Generator().manual_seed(99)
    data = [sample_data(m, n, gen) for m, n in zip(masks, lengths)]
    n_valid = sum(int((t != -100).sum()) for _, _, t in data)

    ref = build_model(model_name, "sdpa")
    ref_logits = [reference_sample(ref, m, n, ids, tgt, n_valid) for m, n, (ids, _, tgt) in zip(masks, lengths, data)]
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref_loss = sum(
        loss_sum(lg, tgt).item() / n_valid for lg, (_, _, tgt) in zip(ref_logits, data)
    )  # from the reference logits

    nd = len(case["distributed"])
    dist_lengths, dist_masks = lengths[:nd], masks[:nd]
    first_local = nd + sum(len(m) for m in case["locals"][:rank])
    my_locals = list(range(first_local, first_local + len(case["locals"][rank])))
    slices = doc_slices(dist_lengths, dist_masks)
    layouts = {
        "identity": contiguous_layout(dist_lengths, world, 4, slices),
        "random": random_layout(dist_lengths, world, 4, slices, 7),
        "remote": all_remote_layout(random_layout(dist_lengths, world, 4, slices, 7), world, 3),
    }
    results = []
    for name in placements:
        lay = layouts[name]
        pieces = [(d, 0, lengths[d]) for d in my_locals] + [
            (c.doc, c.start, c.length) for c in (lay.chunks[i] for i in lay.member_chunks(rank))
        ]
        ids = torch.cat([data[d][0][a : a + ln] for d, a, ln in pieces])
        pos = torch.cat([data[d][1][a : a + ln] for d, a, ln in pieces])
        tgt = torch.cat([data[d][2][a : a + ln] for d, a, ln in pieces])
        want = torch.cat([ref_logits[d][a : a + ln] for d, a, ln in pieces])
        model = build_model(model_name, "hf_cp")
        ctx = CPContext(
            group=group,
            group_ranks=tuple(range(world)),
            member=rank,
            mode=ShardMode.BLOCKS,
            distributed_lengths=tuple(dist_lengths),
            local_lengths=tuple(lengths[d] for d in my_locals),
            blocks=lay,
            masks=tuple(dist_masks),
            local_masks=tuple(masks[d] for d in my_locals),
        )
        COMM_COUNTER.reset()
        with cp_context(ctx):
            logits = model(input_ids=ids[None], position_ids=pos[None]).logits[0]
            loss = loss_sum(logits, tgt) / n_valid
            loss.backward()
        sent = COMM_COUNTER.snapshot().bytes_sent
        expected = 0
        for w in layer_windows(model.config):
            sl = layer_slices(tuple(dist_lengths), dist_masks, w)
            sl = [s if s is not None else causal_slices(n) for s, n in zip(sl or [None] * nd, dist_lengths)]
            expected += exchange_bytes(
                lay, layer_exchange(lay, sl, 4, model.config.num_key_value_heads), rank, 16, 4
            ).total
        total_loss = loss.detach().clone()
        dist.all_reduce(total_loss)
        grad_err, worst = 0.0, ""
        for n, p in model.named_parameters():
            g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            e = (g - ref_grads[n]).abs().max().item()
            if e > grad_err:
                grad_err, worst = e, n
        results.append(
            dict(
                model=model_name,
                placement=name,
                rank=rank,
                loss=total_loss.item(),
                ref_loss=ref_loss,
                logits_err=(logits.detach() - want).abs().max().item(),
                grad_err=grad_err,
                worst_param=worst,
                bytes_sent=sent,
                expected_bytes=expected,
                grad_scale=max(v.abs().max().item() for v in ref_grads.values()),
            )
        )
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_model_with_masked_samples_under_the_block_engine_matches_reference(pools, world, model_name):
    rows = pools(world).run(_worker, model_name, CASES[world], PLACEMENTS, timeout_s=240)
    check_rows(rows)
    assert {r["placement"] for r in rows} == set(PLACEMENTS)
    assert any(r["bytes_sent"] for r in rows)
