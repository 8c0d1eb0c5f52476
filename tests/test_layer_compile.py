"""cp_compile: every decoder layer compiled (torch.compile, inductor) gives the eager model's
loss and gradients within fp32 rounding, hf_cp's attention left out of the graphs; refused by
name with ChunkFlow and for models whose decoder layers hf_cp cannot find."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from hf_cp.attention.interface import ATTN_IMPLEMENTATION, hf_cp_attention
from hf_cp.train.setup.args import CPTrainingArguments
from hf_cp.train.step.layer_compile import compile_decoder_layers, decoder_layers

from helpers.harness.models import tiny_model


@pytest.fixture
def restore_attention():
    yield
    AttentionInterface.register(ATTN_IMPLEMENTATION, hf_cp_attention)


def _packed_loss_and_grads(model, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids[0, 1:].clone()
    starts = torch.tensor(lengths[:-1]).cumsum(0) - 1
    labels[starts] = -100  # no target across a document boundary
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0, :-1]
    loss = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow  # inductor compiles forward and backward graphs: ~20 s on 2 CPU cores
def test_compiled_layers_give_the_eager_loss_and_gradients(restore_attention):
    eager, compiled = tiny_model(seed=3), tiny_model(seed=3)
    assert compile_decoder_layers(compiled) == (
        "cp_compile: torch.compile of every decoder layer: 2 LlamaDecoderLayer modules (hf_cp's attention left out "
        "of the graphs)"
    )
    # the same module objects and parameter names: checkpoints do not change
    assert [n for n, _ in eager.named_parameters()] == [n for n, _ in compiled.named_parameters()]
    for lengths, seed in (([90, 7, 160], 0), ([33, 200], 1)):  # a second shape: the dynamic-shape graph
        want, want_grads = _packed_loss_and_grads(eager, lengths, seed)
        got, got_grads = _packed_loss_and_grads(compiled, lengths, seed)
        assert torch.allclose(got, want, rtol=2e-6), (float(got), float(want))
        for g, w in zip(got_grads, want_grads):
            assert float((g - w).abs().max()) <= 2e-5 * max(1.0, float(w.abs().max()))


def test_decoder_layers_are_the_classes_transformers_never_splits():
    model = tiny_model()
    layers = decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    assert {type(m).__name__ for m in layers} == set(model._no_split_modules)
    with pytest.raises(ValueError, match=r"cp_compile: Sequential names no decoder layer class"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(cp_balancer="chunkflow"), r"cp_compile is not supported with ChunkFlow \(cp_balancer: chunkflow\)"),
        (dict(cp_balancer="auto"), r"cp_balancer: auto may plan with it; list auto's members without chunkflow"),
        (
            dict(cp_balancer="auto", cp_balancer_options={"members": ["dynamic_cp", "chunkflow"]}),
            "cp_balancer: auto may plan with it",
        ),
    ],
)
def test_cp_compile_is_refused_with_chunkflow(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        CPTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", cp_compile=True, **settings)


def test_cp_compile_without_chunkflow_is_accepted(tmp_path):
    for settings in (dict(cp_balancer="dynamic_cp"), dict(cp_balancer_options={"members": ["dynamic_cp", "wlb"]})):
        args = CPTrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, report_to="none", cp_compile=True, **settings
        )
        assert args.cp_compile


def test_the_attention_kernel_setting_is_checked_against_the_run_device(tmp_path):
    with pytest.raises(ValueError, match="CPTrainingArguments: cp_attention_kernel: flash_attn runs on CUDA only"):
        CPTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", cp_attention_kernel="flash_attn")
    with pytest.raises(ValueError, match="cp_attention_kernel: 'flash' is not one of auto, flash_attn"):
        CPTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", cp_attention_kernel="flash")
    args = CPTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", cp_attention_kernel="math")
    assert args.cp_attention_kernel == "math"
