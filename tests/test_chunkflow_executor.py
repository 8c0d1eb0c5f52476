"""ChunkFlow's executor (hf_cp/train/step/chunkflow.py) on tiny Llama and Qwen2 (GQA) models.

A long sample cut into N dependent chunks, run by the state-aware schedule keeping K, must give
the loss and every parameter gradient of one unchunked forward and backward of the same sample
in the same model built with sdpa attention (the single-process reference), in fp32.
"""

import pytest
import torch

from hf_cp.attention.chunk_state import ChunkStateStore
from hf_cp.attention.context import CPContext, cp_context
from hf_cp.plan.chunks import dependent_chunk_sizes
from hf_cp.train.step.chunkflow import ChunkRunStats, run_chunked_sample, sample_chunks, token_loss
from hf_cp.train.step.loss import chunkable_head

from helpers.attention_models import CONFIGS, build_model
from helpers.chunkflow_reference import grad_errors, reference, sample

TOL = 1e-5  # relative to the largest entry of each reference tensor
LENGTH = 37


CASES = [  # (chunk size, keep): N = 1, 2 and 5 chunks of a 37-token sample; K = 1, between, and >= N
    (37, 1),
    (19, 1),
    (19, 2),
    (8, 1),
    (8, 2),
    (8, 5),
    (8, 7),
]


@pytest.mark.parametrize("model_name", ["llama", "qwen2"])
@pytest.mark.parametrize("chunk, keep", CASES)
def test_chunked_sample_equals_the_unchunked_reference(model_name, chunk, keep, one_torch_thread):
    ids, labels = sample(LENGTH, 3, model_name)
    scale = 1 / 29.0
    ref_loss, ref_grads = reference(model_name, [(ids, labels)], scale, 3)
    model = build_model(model_name, "hf_cp")
    sizes = dependent_chunk_sizes(LENGTH, chunk)
    stats = ChunkRunStats()
    loss = run_chunked_sample(model, sample_chunks(ids, labels, sizes), keep, scale, stats=stats)
    assert loss.item() == pytest.approx(ref_loss, rel=TOL)
    errs = grad_errors(model, ref_grads)
    assert max(errs.values()) <= TOL, errs
    n = len(sizes)
    assert (stats.chunks, stats.recomputed, stats.backwards) == (n, max(0, n - keep), n)
    assert stats.store_bytes_after == 0, "the state store is freed after the sample"
    cfg = CONFIGS[model_name]
    kv = 2 * cfg["num_hidden_layers"] * LENGTH * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    assert stats.store_peak_bytes == (kv * 2 if n > 1 else kv)  # values, and fp32 gradients once a chunk follows


def test_chunked_lm_head_loss_and_several_samples_in_one_step(one_torch_thread):
    """One optimizer step's worth on one rank: a long sample in 3 chunks (K=1), a packed
    standalone chunk of two short samples, and a second long sample in 2 chunks (K=2),
    gradients accumulating in .grad, loss through the chunked LM head."""
    name = "qwen2"
    a, b, c, d = (sample(n, s, name) for n, s in ((30, 5), (7, 6), (4, 7), (21, 8)))
    valid = sum(int((lab != -100).sum()) for _, lab in (a, b, c, d))
    scale = 1 / valid
    ref_loss, ref_grads = reference(name, [a, b, c, d], scale, 0)

    model = build_model(name, "hf_cp")
    loss_fn = token_loss(chunkable_head(model), loss_chunk_tokens=4)
    calls = []

    def backward(loss, is_last):
        calls.append(is_last)
        loss.backward()

    total = run_chunked_sample(
        model, sample_chunks(*a, dependent_chunk_sizes(30, 10)), 1, scale, loss_fn, backward, last=False
    )
    # the standalone chunk: an ordinary packed micro-batch (hf_cp attention, no chunk context)
    ids = torch.cat([b[0], c[0]])[None]
    pos = torch.cat([torch.arange(7), torch.arange(4)])[None]
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    packed = torch.nn.functional.cross_entropy(logits.float(), torch.cat([b[1], c[1]]), reduction="sum")
    (packed * scale).backward()
    total += packed.item()
    total += run_chunked_sample(model, sample_chunks(*d, dependent_chunk_sizes(21, 11)), 2, scale, loss_fn, backward)
    assert total.item() == pytest.approx(ref_loss, rel=TOL)
    errs = grad_errors(model, ref_grads)
    assert max(errs.values()) <= TOL, errs
    assert calls == [False] * 3 + [False, True], "only the step's very last backward is the accumulation boundary"


def test_dropping_the_carried_kv_gradient_is_caught(monkeypatch, one_torch_thread):
    """Break on purpose: without the gradient later chunks give earlier chunks' K/V, the
    parameter gradients are wrong, and the comparison above sees it."""
    ids, labels = sample(LENGTH, 3, "llama")
    _, ref_grads = reference("llama", [(ids, labels)], 1.0, 3)
    for broken in ("own_grad", "add_prefix_grad"):
        with monkeypatch.context() as m:
            m.setattr(ChunkStateStore, broken, lambda self, *a, **k: None)
            model = build_model("llama", "hf_cp")
            run_chunked_sample(model, sample_chunks(ids, labels, dependent_chunk_sizes(LENGTH, 8)), 1, 1.0)
        errs = grad_errors(model, ref_grads)
        assert max(errs.values()) > 100 * TOL, (broken, errs)


def test_with_activation_checkpointing(one_torch_thread):
    ids, labels = sample(LENGTH, 4, "llama")
    ref_loss, ref_grads = reference("llama", [(ids, labels)], 0.5, 4)
    model = build_model("llama", "hf_cp")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    loss = run_chunked_sample(model, sample_chunks(ids, labels, dependent_chunk_sizes(LENGTH, 13)), 1, 0.5)
    assert loss.item() == pytest.approx(ref_loss, rel=TOL)
    assert max(grad_errors(model, ref_grads).values()) <= TOL


def test_a_recompute_sees_the_random_numbers_of_its_first_forward(one_torch_thread):
    """With dropout in the model, K=1 (recomputing every chunk but the last) must equal K=N (no
    recompute) under the same seed: the recompute restores the RNG state of the first forward."""
    ids, labels = sample(LENGTH, 5, "llama")
    grads = []
    for keep in (1, 5):
        model = build_model("llama", "hf_cp")
        model.model.embed_tokens.register_forward_hook(lambda mod, inp, out: torch.nn.functional.dropout(out, 0.3))
        torch.manual_seed(99)
        run_chunked_sample(model, sample_chunks(ids, labels, dependent_chunk_sizes(LENGTH, 8)), keep, 1.0)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7)


def test_saved_activations_follow_keep_not_the_sample_length(one_torch_thread):
    """Bytes autograd holds for backward at once (saved_tensors_hooks accounting): with K=1 the
    graph of one chunk at a time; with K=N all of them."""
    ids, labels = sample(64, 9, "llama")

    def peak_saved(keep):
        live, peak = {}, [0]

        class Handle:
            def __init__(self, t):
                self.t, self.key = t, (t.untyped_storage().data_ptr(), id(self))
                live[self.key] = t.untyped_storage().nbytes()
                peak[0] = max(peak[0], sum(live.values()))

            def __del__(self):
                live.pop(self.key, None)

        model = build_model("llama", "hf_cp")
        with torch.autograd.graph.saved_tensors_hooks(Handle, lambda h: h.t):
            run_chunked_sample(model, sample_chunks(ids, labels, dependent_chunk_sizes(64, 16)), keep, 1.0)
        assert not live, "every saved tensor is freed after the sample"
        return peak[0]

    one, all_four = peak_saved(1), peak_saved(4)
    assert one < 0.5 * all_four, (one, all_four)


def test_bad_input_is_refused():
    model = build_model("llama", "hf_cp")
    ids, labels = sample(12, 1, "llama")
    chunks = sample_chunks(ids, labels, [6, 6])
    chunks[1].position_ids = chunks[1].position_ids - 6
    with pytest.raises(ValueError, match=r"chunk 1: position_ids must run 6..11 .* got 0..5"):
        run_chunked_sample(model, chunks, 1, 1.0)
    with pytest.raises(ValueError, match=r"chunk sizes \[6, 5\] do not cut a sample of 12 tokens"):
        sample_chunks(ids, labels, [6, 5])
    with pytest.raises(ValueError, match=r"keep \(K\) must be positive"):
        run_chunked_sample(model, sample_chunks(ids, labels, [12]), 0, 1.0)
    with cp_context(CPContext(group=None, group_ranks=(0,), member=0, local_lengths=(6,))):
        with pytest.raises(ValueError, match="a chunk context and a CP context at once"):
            run_chunked_sample(model, sample_chunks(ids, labels, [6, 6]), 1, 1.0)
