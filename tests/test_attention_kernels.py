"""The attention kernels on CPU against dense float64 autograd, and the kernel choice by device
and dtype (tests/test_cuda.py runs the same check on CUDA)."""

from __future__ import annotations

import pytest
import torch

from hf_cp.attention.kernels import CpuFlashKernel, MathKernel, kernel_for, softcapped_kernel

from helpers.kernel_checks import check_kernel


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("seed", [0, 1])
def test_cpu_kernels_match_dense_float64(causal, heads, seed):
    for kernel in (CpuFlashKernel(), MathKernel()):
        errors = check_kernel(kernel, "cpu", torch.float64, seed, causal, heads=heads)
        assert max(errors.values()) <= 1e-10, (kernel.name, errors)


def test_math_kernel_tiles_give_the_same_result(monkeypatch):
    """Query tiles of one row each (and of a few rows) change nothing: the tiling is exact."""
    whole = check_kernel(MathKernel(), "cpu", torch.float64, 3, True)
    monkeypatch.setattr(MathKernel, "TILE_ELEMENTS", 1)
    one_row = check_kernel(MathKernel(), "cpu", torch.float64, 3, True)
    monkeypatch.setattr(MathKernel, "TILE_ELEMENTS", 7 * 40 * 4)
    some_rows = check_kernel(MathKernel(), "cpu", torch.float64, 3, True)
    for errs in (whole, one_row, some_rows):
        assert max(errs.values()) <= 1e-10, errs


@pytest.mark.parametrize("causal", [True, False])
def test_the_softcapped_math_kernel_caps_each_score_before_the_mask(causal):
    # Gemma 2's attn_logit_softcapping: forward, lse and gradients through the cap
    kernel = softcapped_kernel(1.5)
    assert kernel is softcapped_kernel(1.5) and kernel.softcap == 1.5
    errors = check_kernel(kernel, "cpu", torch.float64, 2, causal, softcap=1.5)
    assert max(errors.values()) <= 1e-10, errors
    # the cap matters at these scores: the plain kernel is far from the capped reference
    plain = check_kernel(MathKernel(), "cpu", torch.float64, 2, causal, softcap=1.5)
    assert min(plain["out"], plain["dq"]) > 1e-2, plain
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        MathKernel(-1.0)


def test_math_kernel_in_bf16_accumulates_in_float32():
    errors = check_kernel(MathKernel(), "cpu", torch.bfloat16, 5, True)
    assert max(errors.values()) <= 2e-2, errors


def test_kernel_choice_by_device_and_dtype(monkeypatch):
    monkeypatch.delenv("HF_CP_ATTENTION_KERNEL", raising=False)
    cpu = torch.device("cpu")
    assert kernel_for(cpu).name == "cpu_flash"
    assert kernel_for(cpu, dtype=torch.float32).name == "cpu_flash"
    # the flash kernels on CUDA run fp16/bf16 only: fp32 goes to the math kernel. The choice is
    # made before any CUDA call, so it is checked here without a GPU.
    assert kernel_for(torch.device("cuda"), dtype=torch.float32).name == "math"
    assert kernel_for(torch.device("cuda"), dtype=torch.float64).name == "math"
    monkeypatch.setenv("HF_CP_ATTENTION_KERNEL", "math")
    assert kernel_for(cpu).name == "math"
