"""Liger's fused linear cross-entropy in place of the chunked LM-head loss (use_liger_kernel on
CUDA): the same contract, summed loss over the valid targets with ignore_index and the extra
targets' rows, checked here against the chunked loss with a fake `liger_kernel` package (no
GPU, no Triton) that computes the fused loss in plain torch from the arguments it is given."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from hf_cp.train.setup.args import CPTrainingArguments
from hf_cp.train.step.loss import chunked_lm_head_loss, liger_lm_head_loss, liger_loss_problem

IGNORE = -100


def _fake_liger(monkeypatch, calls: list, with_accum_dtype: bool = True) -> None:
    """liger_kernel.transformers.functional with liger_fused_linear_cross_entropy's released signature."""

    def fused(input, weight, target, bias, ignore_index, reduction, **more):
        calls.append(dict(ignore_index=ignore_index, reduction=reduction, rows=input.shape[0], **more))
        logits = F.linear(input, weight, bias)
        logits = logits if logits.dtype == torch.float64 else logits.float()
        return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)

    def liger_fused_linear_cross_entropy(
        input,
        weight,
        target,
        bias=None,
        ce_weight=None,
        ignore_index=-100,
        lse_square_scale=0.0,
        label_smoothing=0.0,
        reduction="mean",
        softcap=None,
        return_z_loss=False,
        accum_dtype=None,
        use_token_scaling=False,
        return_token_accuracy=False,
        return_predicted_tokens=False,
    ):  # fmt: skip  (liger-kernel 0.8)
        return fused(input, weight, target, bias, ignore_index, reduction, accum_dtype=accum_dtype)

    def liger_fused_linear_cross_entropy_0_5(
        input,
        weight,
        target,
        bias=None,
        ce_weight=None,
        ignore_index=-100,
        lse_square_scale=0.0,
        label_smoothing=0.0,
        reduction="mean",
        softcap=None,
        return_z_loss=False,
    ):  # fmt: skip  (before accum_dtype, liger-kernel 0.6.2)
        return fused(input, weight, target, bias, ignore_index, reduction)

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = (
        liger_fused_linear_cross_entropy if with_accum_dtype else liger_fused_linear_cross_entropy_0_5
    )
    for name in ("liger_kernel", "liger_kernel.transformers"):
        pkg = types.ModuleType(name)
        pkg.__path__ = []
        monkeypatch.setitem(sys.modules, name, pkg)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)


def _case(seed=0, T=50, H=12, V=40):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (T,), generator=g)
    targets[torch.rand(T, generator=g) < 0.3] = IGNORE
    extra_rows = torch.tensor([3, 3, 17, 40])  # a shared prompt's last token predicts several answers
    extra_targets = torch.tensor([5, 9, 0, 39])
    return hidden, weight, bias, targets, extra_rows, extra_targets


def _loss_and_grads(fn, hidden, weight, bias, targets, rows, extra):
    for t in (hidden, weight, bias):
        t.grad = None
    loss = fn(hidden, weight, targets, bias, rows, extra)
    loss.backward()
    return loss.detach(), [t.grad.clone() for t in (hidden, weight, bias)]


def _chunked(hidden, weight, targets, bias, rows, extra):
    return chunked_lm_head_loss(hidden, weight, targets, 16, bias, IGNORE, rows, extra)


def _liger(hidden, weight, targets, bias, rows, extra):
    return liger_lm_head_loss(hidden, weight, targets, bias, IGNORE, rows, extra)


@pytest.mark.parametrize("with_accum_dtype", [True, False])
def test_liger_loss_keeps_the_chunked_loss_contract(monkeypatch, with_accum_dtype):
    calls = []
    _fake_liger(monkeypatch, calls, with_accum_dtype)
    case = _case()
    want, want_grads = _loss_and_grads(_chunked, *case)
    got, got_grads = _loss_and_grads(_liger, *case)
    assert torch.allclose(got, want, rtol=1e-12, atol=0), (got, want)
    for g, w in zip(got_grads, want_grads):
        assert torch.allclose(g, w, rtol=1e-10, atol=1e-12)
    # one fused call over every row, one more over the extra targets' rows, each a sum
    assert [(c["rows"], c["reduction"], c["ignore_index"]) for c in calls] == [(50, "sum", IGNORE), (4, "sum", IGNORE)]
    assert all(c.get("accum_dtype") == (torch.float64 if with_accum_dtype else None) for c in calls)


def test_liger_loss_without_extra_targets_and_every_target_ignored(monkeypatch):
    calls = []
    _fake_liger(monkeypatch, calls)
    hidden, weight, bias, targets, _, _ = _case(seed=1)
    got = liger_lm_head_loss(hidden, weight, targets, bias, IGNORE)
    assert torch.allclose(got, chunked_lm_head_loss(hidden, weight, targets, 7, bias, IGNORE), rtol=1e-12)
    assert len(calls) == 1
    none = liger_lm_head_loss(hidden, weight, torch.full_like(targets, IGNORE), bias, IGNORE)
    none.backward()
    assert float(none.detach()) == 0.0 and weight.grad is not None and float(weight.grad.abs().max()) == 0.0


def test_liger_loss_checks_its_rows(monkeypatch):
    _fake_liger(monkeypatch, [])
    hidden, weight, bias, targets, rows, extra = _case()
    with pytest.raises(ValueError, match=r"hidden \[T, H\] and targets \[T\]"):
        liger_lm_head_loss(hidden, weight, targets[:-1], bias)
    with pytest.raises(ValueError, match="extra_rows must index the 50 rows"):
        liger_lm_head_loss(hidden, weight, targets, bias, IGNORE, rows + 40, extra)


def test_use_liger_kernel_is_refused_by_name_where_it_cannot_run(monkeypatch):
    assert liger_loss_problem("cpu", 2048).startswith("use_liger_kernel is not supported on cpu: Liger's kernels")
    assert "cp_loss_chunk_tokens: 0" in liger_loss_problem("cuda", 0)
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # not installed
    assert liger_loss_problem("cuda", 2048).startswith(
        "use_liger_kernel needs liger-kernel (pip install liger-kernel): liger_kernel.transformers.functional "
        "does not import"
    )
    _fake_liger(monkeypatch, [])
    assert liger_loss_problem("cuda", 2048) is None


def test_cpu_training_arguments_still_refuse_liger(tmp_path):
    with pytest.raises(ValueError, match="use_liger_kernel is not supported on cpu"):
        CPTrainingArguments(output_dir=str(tmp_path), use_cpu=True, use_liger_kernel=True, report_to="none")
