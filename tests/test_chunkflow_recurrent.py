"""ChunkFlow's dependent chunks through Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5 text) are
exact: one ~300-token sample cut into chunks whose borders cross the gated delta rule kernel's
64-token chunking and the convolution window (one chunk of 2 tokens, shorter than the window),
kept (K=N) or recomputed (K=1), against the whole sample through the eager model in one process.
Breaking the mechanism (no passed state, no halo, no gradient carried back) fails, and an
out-of-order backward is refused.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
from test_recurrent_mixers import BASE, GATED_DELTANET, _documents, _models, _reference_grads, _worst
from transformers import AutoConfig, AutoModelForCausalLM

from hf_cp.attention import ChunkOrderError, ChunkStateStore, chunk_recurrence
from hf_cp.attention.chunk_state import ChunkContext, chunk_context
from hf_cp.attention.recurrent import attach_recurrent_layers
from hf_cp.cost.dims import ModelDims
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.cost.model import CostModel
from hf_cp.plan.chunks import chunked_sample_cost
from hf_cp.train.step.chunkflow import ChunkRunStats, run_chunked_sample, sample_chunks, token_loss

from helpers.world2_job import FIXTURE_TIMEOUT, executed_plans

TOL = 1e-5
BROKEN = 1e-3
FAMILIES = ("qwen3_next", "qwen3_5_text")
LENGTH = 300
SIZES = [130, 2, 168]  # borders at 130 (inside the kernel's third 64-token chunk) and 132 (2 tokens < window)


def _setup(family):
    model, ref = _models(family)
    attach_recurrent_layers(model)
    (doc,) = _documents([LENGTH], seed=3)
    ref_loss, ref_grads = _reference_grads(ref, [doc])
    labels = torch.cat([doc[1:], torch.tensor([-100])])
    return model, doc, labels, ref_loss, ref_grads


def _run(model, doc, labels, keep, stats=None):
    model.zero_grad()
    scale = 1.0 / (LENGTH - 1)
    loss = run_chunked_sample(model, sample_chunks(doc, labels, SIZES), keep, scale, stats=stats) * scale
    return loss.item(), _worst({n: p.grad for n, p in model.named_parameters()}, _run.ref_grads)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("keep", [1, len(SIZES)])
def test_dependent_chunks_match_the_whole_sample(family, keep):
    model, doc, labels, ref_loss, ref_grads = _setup(family)
    _run.ref_grads = ref_grads
    stats = ChunkRunStats()
    loss, (err, name) = _run(model, doc, labels, keep, stats)
    print(f"{family} K={keep}: loss rel {abs(loss - ref_loss) / abs(ref_loss):.2e}, worst grad {err:.2e} ({name})")
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
    assert err <= TOL, (name, err)
    assert stats.recomputed == len(SIZES) - keep and stats.store_bytes_after == 0
    # the cost model prices the store as the executor holds it (the tiny models are float32)
    dims = ModelDims.from_hf_config(model.config.to_dict())
    cost = CostModel(dims, replace(HardwareProfile.load("h200-qwen2.5-7b"), bytes_per_element=4))
    assert stats.store_peak_bytes == chunked_sample_cost(cost, SIZES, keep).state_bytes


@contextlib.contextmanager
def _broken(what):
    """The mechanism with one part taken out."""
    store = ChunkStateStore
    saved = {k: getattr(store, k) for k in ("recurrent_inputs", "own_recurrent_grad")}

    def inputs(self, layer, i, width):
        state, halo = saved["recurrent_inputs"](self, layer, i, width)
        if what == "state" and state is not None:
            state = torch.zeros_like(state)
        if what == "halo" and halo is not None:
            halo = halo[:0]
        return state, halo

    def own(self, layer, i):
        return (None, None) if what == "gradient" else saved["own_recurrent_grad"](self, layer, i)

    store.recurrent_inputs, store.own_recurrent_grad = inputs, own
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(store, k, v)


@pytest.mark.parametrize("what", ["state", "halo", "gradient"])
def test_each_part_of_the_mechanism_is_needed(what):
    model, doc, labels, ref_loss, ref_grads = _setup("qwen3_next")
    _run.ref_grads = ref_grads
    with _broken(what):
        _, (err, name) = _run(model, doc, labels, 1)
    print(f"without the {what}: worst grad {err:.2e} ({name})")
    assert err > BROKEN, (what, name, err)


@pytest.mark.parametrize("layers", ["hybrid", "linear only"])
def test_backward_out_of_order_is_refused(layers):
    if layers == "hybrid":  # the attention layer's K/V store refuses first
        model, doc, labels, _, _ = _setup("qwen3_5_text")
    else:  # the recurrent layers' own check
        linear = dict(GATED_DELTANET, layer_types=["linear_attention"] * 2)
        cfg = AutoConfig.for_model("qwen3_5_text", **BASE, **linear)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="hf_cp").train()
        attach_recurrent_layers(model)
        (doc,) = _documents([LENGTH], seed=3)
        labels = torch.cat([doc[1:], torch.tensor([-100])])
    which = "layer 1" if layers == "hybrid" else "recurrent layer 1"
    chunks = sample_chunks(doc, labels, SIZES)
    store = ChunkStateStore(SIZES)
    loss_fn = token_loss()
    losses = []
    for i, ch in enumerate(chunks):
        with chunk_context(ChunkContext(store, i)):
            losses.append(loss_fn(model, ch))
    with pytest.raises(ChunkOrderError, match=f"^{which}: the backward of chunk 1 ran when chunk 2's was due"):
        losses[1].backward(retain_graph=True)
    losses[2].backward()
    with pytest.raises(ChunkOrderError, match=f"^{which}: the backward of chunk 0 ran when chunk 1's was due"):
        losses[0].backward()  # chunk 1's never ran
    store.release()


def test_other_recurrent_layers_are_refused_in_a_chunk():
    model, _ = _models("bamba")
    attach_recurrent_layers(model)
    (doc,) = _documents([40])
    labels = torch.cat([doc[1:], torch.tensor([-100])])
    with pytest.raises(ValueError, match=r"BambaMixer.*dependent chunk \(ChunkFlow\)"):
        run_chunked_sample(model, sample_chunks(doc, labels, [20, 20]), 1, 1.0)
    assert chunk_recurrence.STATE_PASSING_MIXERS >= {"Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet"}


@pytest.mark.timeout(FIXTURE_TIMEOUT)
def test_cptrainer_runs_dependent_chunks_of_the_hybrid(world2_job):
    """The shared world-2 job's Qwen3-Next chunkflow run (its exactness: test_trainer_exactness.py's
    Gated DeltaNet test) ran samples as dependent chunks, not only spread or whole."""
    plans = executed_plans(world2_job["qwen3_next-chunkflow"])
    chunked = [c for p in plans for w in p.waves for g in w.groups for cs in g.chunked.values() for c in cs]
    assert chunked, "no sample of the hybrid ran as dependent chunks"
