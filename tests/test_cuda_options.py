"""The throughput options of issue 30 on CUDA at world 1, against CPU float64 references (marker
`gpu`: deselected by default; scripts/gpu_first_run.sh runs it beside tests/test_cuda.py):
- flash-attn-4's varlen kernels (cp_attention_kernel: flash_attn_4), when installed;
- Liger's fused linear cross-entropy (use_liger_kernel), when installed, against the same sum
  the chunked LM-head loss computes;
- cp_compile: a packed model with compiled decoder layers against the same model run eagerly;
- the MFU peak of the device the tests run on.
Every check prints its errors (`-s`). HF_CP_TEST_DEVICE=cpu runs what can run on CPU."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from hf_cp.attention.interface import ATTN_IMPLEMENTATION, hf_cp_attention
from hf_cp.attention.kernels import FLASH_ATTN_4_MODULE, import_problem, kernel_for
from hf_cp.cost.flops import device_peak
from hf_cp.train.measure.metrics import device_name
from hf_cp.train.step.layer_compile import compile_decoder_layers
from hf_cp.train.step.loss import LIGER_FUNCTIONAL, liger_lm_head_loss

from helpers.harness.models import tiny_model
from helpers.kernel_checks import check_kernel

pytestmark = pytest.mark.gpu

DEVICE = torch.device(os.environ.get("HF_CP_TEST_DEVICE", "cuda"))
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 2e-5}


@pytest.fixture(autouse=True)
def _device():
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device (HF_CP_TEST_DEVICE=cpu runs them on CPU)")


def _fmt(errors) -> str:
    return " ".join(f"{k} {v:.2e}" for k, v in errors.items())


def _needs_cuda_and(module: str) -> None:
    if DEVICE.type != "cuda":
        pytest.skip(f"{module}: CUDA only")
    problem = import_problem(module)
    if problem:
        pytest.skip(f"{module} does not import: {problem}")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_flash_attn_4_kernel_matches_dense_float64(causal, heads):
    _needs_cuda_and(FLASH_ATTN_4_MODULE)
    if torch.cuda.get_device_capability(DEVICE) < (9, 0):
        pytest.skip("flash-attn-4 runs on compute capability 9.0 and above")
    kernel = kernel_for(DEVICE, override="flash_attn_4")
    errors = check_kernel(kernel, DEVICE, torch.bfloat16, 11, causal, heads=heads, head_dim=64, n_blocks=6, max_len=300)
    print(f"\nkernel flash_attn_4 bf16 causal={causal} heads={heads}: " + _fmt(errors))
    assert max(errors.values()) <= TOL[torch.bfloat16], errors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_liger_loss_on_the_device(dtype):
    _needs_cuda_and(LIGER_FUNCTIONAL)
    g = torch.Generator().manual_seed(0)
    T, H, V = 3000, 256, 5000
    hidden, weight = torch.randn(T, H, generator=g) / math.sqrt(H), torch.randn(V, H, generator=g)
    targets = torch.randint(0, V, (T,), generator=g)
    targets[::7] = -100
    rows, extra = torch.tensor([5, 5, 900]), torch.tensor([1, 2, 3])
    rh, rw = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want = F.cross_entropy(F.linear(rh, rw), targets, ignore_index=-100, reduction="sum")
    want = want + F.cross_entropy(F.linear(rh[rows], rw), extra, reduction="sum")
    want.backward()
    h, w = hidden.to(DEVICE, dtype).requires_grad_(), weight.to(DEVICE, dtype).requires_grad_()
    got = liger_lm_head_loss(h, w, targets.to(DEVICE), None, -100, rows.to(DEVICE), extra.to(DEVICE))
    got.backward()
    errors = {
        "loss": abs(float(got) - float(want)) / float(want),
        "dhidden": float((h.grad.double().cpu() - rh.grad).norm() / rh.grad.norm()),
        "dweight": float((w.grad.double().cpu() - rw.grad).norm() / rw.grad.norm()),
    }
    print(f"\nLiger fused linear cross-entropy {str(dtype)[6:]}: " + _fmt(errors))
    assert max(errors.values()) <= TOL[dtype], errors


def test_compiled_layers_match_eager_on_the_device():
    lengths = [200, 1, 77, 512, 33]
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 256, (1, sum(lengths)), generator=g).to(DEVICE)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(DEVICE)
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    losses = []
    try:
        for compiled in (False, True):
            model = tiny_model(seed=5).to(DEVICE)
            if compiled:
                compile_decoder_layers(model)
            with torch.autocast(DEVICE.type, dtype=dtype, enabled=dtype != torch.float32):
                logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0, :-1]
            loss = F.cross_entropy(logits.float(), ids[0, 1:], reduction="sum")
            loss.backward()
            grad = torch.cat([p.grad.flatten().float() for p in model.parameters()])
            losses.append((float(loss), grad))
    finally:
        AttentionInterface.register(ATTN_IMPLEMENTATION, hf_cp_attention)
    (eager, g0), (comp, g1) = losses
    errors = {"loss": abs(comp - eager) / abs(eager), "grad": float((g1 - g0).norm() / g0.norm())}
    print(f"\ncp_compile vs eager, {str(dtype)[6:]}: " + _fmt(errors))
    assert max(errors.values()) <= (4e-2 if dtype == torch.bfloat16 else 1e-5), errors


def test_the_device_has_a_named_peak():
    peak = device_peak(device_name(DEVICE))
    print(f"\nMFU peak on {device_name(DEVICE)}: {peak.describe()}")
    if DEVICE.type == "cuda" and "H200" in device_name(DEVICE):
        assert peak.tflops == 989.0
