"""The chunked LM-head loss equals the full-logits loss and never keeps the full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_cp.train.step.loss import chunkable_head, chunked_lm_head_loss, head_output_is_logits, lm_head_bypassed

from helpers.harness.models import tiny_model

IGNORE = -100


def _case(T, H=12, V=40, ignored=0.3, dtype=torch.float64, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(V, generator=g, dtype=dtype, requires_grad=True) if bias else None
    targets = torch.randint(0, V, (T,), generator=g)
    targets[torch.rand(T, generator=g) < ignored] = IGNORE
    return hidden, weight, b, targets


def _loss_and_grads(fn, hidden, weight, b, targets):
    for t in (hidden, weight, b):
        if t is not None:
            t.grad = None
    loss = fn(hidden, weight, b, targets)
    loss.backward()
    return loss.detach(), [t.grad.clone() for t in (hidden, weight, b) if t is not None]


def _full(hidden, weight, b, targets):
    logits = F.linear(hidden, weight, b)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")


@pytest.mark.parametrize("T,chunk", [(1, 1), (7, 3), (64, 16), (100, 16), (100, 1000), (33, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_chunked_loss_and_gradients_equal_full_logits(T, chunk, bias):
    case = _case(T, bias=bias, seed=T + chunk)
    want, want_g = _loss_and_grads(_full, *case)
    got, got_g = _loss_and_grads(
        lambda h, w, b, t: chunked_lm_head_loss(h, w, t, chunk, bias=b, ignore_index=IGNORE), *case
    )
    assert got.dtype == torch.float64 and float(want) != 0.0
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, e in zip(got_g, want_g):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_all_targets_ignored_still_gives_the_head_a_zero_gradient():
    hidden, weight, b, targets = _case(20, ignored=1.1)
    loss = chunked_lm_head_loss(hidden, weight, targets, 8, bias=b, ignore_index=IGNORE)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert weight.grad is not None and float(weight.grad.abs().max()) == 0.0


def test_bf16_head_matches_full_path_in_fp32_accumulation():
    hidden, weight, _, targets = _case(50, dtype=torch.bfloat16, bias=False)
    want = _full(hidden, weight, None, targets)
    got = chunked_lm_head_loss(hidden, weight, targets, 7, ignore_index=IGNORE)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def _largest_saved(fn, *args) -> int:
    """numel of the largest tensor autograd keeps for backward while fn runs."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return max(sizes)


def test_chunked_loss_never_keeps_the_full_logits_for_backward():
    T, V, chunk = 256, 500, 32
    hidden, weight, _, targets = _case(T, V=V, dtype=torch.float32, bias=False)
    assert _largest_saved(_full, hidden, weight, None, targets) >= T * V  # the full path keeps [T, V]
    kept = _largest_saved(
        lambda h, w, t: chunked_lm_head_loss(h, w, t, chunk, ignore_index=IGNORE), hidden, weight, targets
    )
    assert kept <= max(T * hidden.shape[1], V * hidden.shape[1]), "only the inputs (hidden, weight) are kept"


def test_bad_arguments_are_named():
    hidden, weight, _, targets = _case(10, bias=False)
    with pytest.raises(ValueError, match="chunk_tokens must be positive"):
        chunked_lm_head_loss(hidden, weight, targets, 0)
    with pytest.raises(ValueError, match=r"hidden \[T, H\] and targets \[T\] with T > 0"):
        chunked_lm_head_loss(hidden, weight, targets[:5], 4)
    with pytest.raises(ValueError, match=r"with T > 0 expected, got \(0, 12\)"):
        chunked_lm_head_loss(hidden[:0], weight, targets[:0], 4)


def test_bypassed_head_hands_back_hidden_states_and_model_loss_matches():
    model = tiny_model(0, attn="sdpa")
    head = chunkable_head(model)
    assert head is not None and head_output_is_logits(model, head, "cpu")
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    targets = torch.cat([ids[0, 1:], torch.tensor([IGNORE])])
    full = F.cross_entropy(model(input_ids=ids).logits[0].float(), targets, ignore_index=IGNORE, reduction="sum")
    full.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    captured = []
    with lm_head_bypassed(head, captured):
        out = model(input_ids=ids)
    assert out.logits.shape[-1] == 0 and len(captured) == 1
    assert "forward" not in vars(head), "the head's own forward is back after the block"
    got = chunked_lm_head_loss(captured[0][0], head.weight, targets, 9, bias=head.bias, ignore_index=IGNORE)
    got.backward()
    torch.testing.assert_close(got, full, rtol=1e-6, atol=1e-5)
    for n, p in model.named_parameters():  # fp32 rounding only: at each tensor's scale
        err = float((p.grad - want[n]).abs().max() / want[n].abs().max())
        assert err < 1e-6, f"{n}: {err:.2g}"


def test_soft_capped_logits_are_detected():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=3.0,
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(cfg)
    head = chunkable_head(model)
    assert head is not None and not head_output_is_logits(model, head, "cpu")
    cfg.final_logit_softcapping = None
    uncapped = Gemma2ForCausalLM(cfg)
    assert head_output_is_logits(uncapped, chunkable_head(uncapped), "cpu")


def test_bypassed_head_under_ddp_with_find_unused_parameters(tmp_path):
    """CPTrainer under torchrun without DeepSpeed wraps the model in DDP with the Trainer's
    default find_unused_parameters=True. DDP then walks the forward's outputs for unused
    parameters: a bypassed head that the output did not depend on was marked ready at once and
    again by the chunked loss's backward ("lm_head.weight has been marked as ready twice"), so
    every multi-process run without DeepSpeed failed at its first step. World 1 over gloo shows
    it in-process; the gradients must equal the full-logits ones."""
    import torch.distributed as dist

    model = tiny_model(0, attn="sdpa")
    head = chunkable_head(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    targets = torch.cat([ids[0, 1:], torch.tensor([IGNORE])])
    F.cross_entropy(model(input_ids=ids).logits[0].float(), targets, ignore_index=IGNORE, reduction="sum").backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        for _ in range(2):  # the second iteration would also fail on a reduction left unfinished
            model.zero_grad()
            captured = []
            with lm_head_bypassed(head, captured):
                ddp(input_ids=ids, use_cache=False)
            chunked_lm_head_loss(captured[0][0], head.weight, targets, 9, bias=head.bias).backward()
    finally:
        dist.destroy_process_group()
    for n, p in model.named_parameters():
        err = float((p.grad - want[n]).abs().max() / want[n].abs().max())
        assert err < 1e-6, f"{n}: {err:.2g}"


def test_per_token_log_probs_are_minus_the_token_cross_entropies_chunk_by_chunk():
    """chunked_lm_head_token_logps: log p(target) per row and per extra target, 0 where ignored;
    their sum is minus the summed loss, and gradients agree."""
    import torch

    from hf_cp.train.step.loss import chunked_lm_head_loss, chunked_lm_head_token_logps

    torch.manual_seed(0)
    hidden = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([3, -100, 4, 0, 10, -100, 2])
    rows, extra = torch.tensor([2, 2]), torch.tensor([5, 6])
    own, more = chunked_lm_head_token_logps(hidden, weight, targets, 3, extra_rows=rows, extra_targets=extra)
    logits = hidden @ weight.T
    want = torch.log_softmax(logits, -1)
    assert own[1] == 0 and own[5] == 0
    assert torch.allclose(own[0], want[0, 3]) and torch.allclose(more, want[[2, 2], [5, 6]])
    total = -(own.sum() + more.sum())
    loss = chunked_lm_head_loss(hidden, weight, targets, 3, extra_rows=rows, extra_targets=extra)
    assert torch.allclose(total, loss)
    g1 = torch.autograd.grad(total, (hidden, weight))
    g2 = torch.autograd.grad(loss, (hidden, weight))
    assert all(torch.allclose(a, b) for a, b in zip(g1, g2))
