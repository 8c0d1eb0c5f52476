"""A `chunkflow` plan executed on 2 gloo ranks: each rank runs its standalone chunks as packed
micro-batches and its chunked samples with run_chunked_sample; the all-reduced gradients and
loss equal the single-process reference of the whole global batch (what CPTrainer will do)."""

import pytest
import torch

from helpers.attention_pool import pools  # noqa: F401  (pools: fixture)
from helpers.chunkflow_reference import grad_errors, reference, sample

TOL = 1e-5
LENGTHS = [45, 3, 9, 60, 5, 11, 2, 38, 7, 30, 1]


def _dp_worker(rank, world, model_name, lengths, cap, keep):
    import torch.distributed as dist

    from hf_cp.balance import PlanRequest, get_balancer
    from hf_cp.cost.dims import ModelDims
    from hf_cp.cost.hardware import HardwareProfile
    from hf_cp.cost.model import CostModel
    from hf_cp.plan.chunks import dependent_chunk_sizes
    from hf_cp.plan.cluster import ClusterSpec
    from hf_cp.train.step.chunkflow import run_chunked_sample, sample_chunks

    from helpers.attention_models import build_model

    model = build_model(model_name, "hf_cp")
    cost = CostModel(ModelDims.from_hf_config(model.config.to_dict()), HardwareProfile.load("cpu"))
    cluster = ClusterSpec(world, cap)
    plan = get_balancer("chunkflow", keep=keep, min_chunk_size=8, spread_stragglers=False).plan(
        PlanRequest(range(len(lengths)), lengths, cluster, cost)
    )
    plan.validate(cluster, cost)
    docs = [sample(n, 100 + i, model_name) for i, n in enumerate(lengths)]
    scale = 1.0 / sum(int((lab != -100).sum()) for _, lab in docs)
    loss = torch.zeros((), dtype=torch.float64)
    ran = {"chunked": [], "packed": []}
    for _, g in plan.rank_waves(rank):
        for c in g.chunked.get(rank, []):
            ids, labels = docs[c.sample]
            sizes = dependent_chunk_sizes(len(ids), c.chunk_size)
            loss += run_chunked_sample(model, sample_chunks(ids, labels, sizes), c.keep, scale)
            ran["chunked"].append((c.sample, len(sizes)))
        ids_ = g.local.get(rank, [])
        if ids_:  # a standalone chunk: one packed micro-batch, documents found from position_ids
            ids = torch.cat([docs[s][0] for s in ids_])[None]
            pos = torch.cat([torch.arange(len(docs[s][0])) for s in ids_])[None]
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
            part = torch.nn.functional.cross_entropy(
                logits.float(), torch.cat([docs[s][1] for s in ids_]), reduction="sum"
            )
            (part * scale).backward()
            loss += part.item()
            ran["packed"].append(list(ids_))
        if g.distributed:
            raise AssertionError(f"this step was chosen so that every sample fits one rank: {g}")
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
    dist.all_reduce(loss)
    ref_loss, ref_grads = reference(model_name, docs, scale, 0)
    return dict(
        rank=rank, loss=loss.item(), ref_loss=ref_loss, grad_err=max(grad_errors(model, ref_grads).values()), **ran
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("keep", [1, 2])
def test_chunkflow_plan_on_two_ranks_matches_single_process(pools, keep):
    rows = pools(2).run(_dp_worker, "qwen2", LENGTHS, 32, keep, timeout_s=180)
    assert len(rows) == 2
    for r in rows:
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=TOL), r
        assert r["grad_err"] <= TOL, r
    long = [i for i, n in enumerate(LENGTHS) if n > 32 // keep]  # longer than the chunk size: cap / K
    assert sorted(s for r in rows for s, _ in r["chunked"]) == long, "long samples run as dependent chunks"
    assert all(n > 1 for r in rows for _, n in r["chunked"])
    assert all(r["chunked"] or r["packed"] for r in rows), "both ranks have work"
    packed = sorted(s for r in rows for ids in r["packed"] for s in ids)
    assert packed == [i for i in range(len(LENGTHS)) if i not in long]
