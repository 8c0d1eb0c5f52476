"""The attention kernel a run uses (cp_attention_kernel): the choice by device and dtype, the
refusals by name, the start-up line, and the flash-attn adapters' argument mapping.

No GPU and no flash-attn here: fake `flash_attn` modules, with the real entry points' signatures
(flash-attn 2.8's `_flash_attn_varlen_forward/_backward`, flash-attn-4's `_flash_attn_fwd/_bwd`),
compute attention in float64 from exactly the arguments they are given (cu_seqlens, max_seqlen,
causal, window, softmax scale, K/V heads) and the backward from the out and lse handed back. The
adapters must then match dense float64 autograd (helpers.kernel_checks) to 1e-10."""

from __future__ import annotations

import sys
import types
from typing import Optional

import pytest
import torch

import hf_cp.attention.kernels as kernels
from hf_cp.attention.kernels import (
    FlashAttn4Kernel,
    FlashAttnKernel,
    attention_kernel_line,
    check_kernel_choice,
    kernel_for,
    use_attention_kernel,
)

from helpers.kernel_checks import check_kernel

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(autouse=True)
def _auto_choice(monkeypatch):
    """Every test starts and ends with the auto choice and no forced kernel."""
    monkeypatch.delenv("HF_CP_ATTENTION_KERNEL", raising=False)
    use_attention_kernel("auto", CPU)
    yield
    use_attention_kernel("auto", CPU)


# ----------------------------------------------------------------------------- the fakes
class Calls:
    """What the fake kernels were called with."""

    def __init__(self):
        self.forward, self.backward = [], []


def _blocks(cu: torch.Tensor):
    assert cu.dtype == torch.int32 and cu.dim() == 1 and int(cu[0]) == 0, cu
    c = cu.tolist()
    return list(zip(c[:-1], c[1:]))


def _allowed(ql: int, kl: int, causal: bool, left: Optional[int], right: Optional[int]) -> torch.Tensor:
    """[ql, kl] visible pairs, flash-attn's convention: bottom-right aligned, window (left, right)
    around the diagonal (None or negative: open on that side), causal closes the right side."""
    i = torch.arange(ql)[:, None] + (kl - ql)
    j = torch.arange(kl)[None, :]
    if causal:
        right = 0
    ok = torch.ones(ql, kl, dtype=torch.bool)
    if right is not None and right >= 0:
        ok &= j <= i + right
    if left is not None and left >= 0:
        ok &= j >= i - left
    return ok


def _reference_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, left, right):
    """float64 out [T, H, D] and lse [H, T] of varlen attention, K/V heads shared by groups."""
    assert max_q == max(b - a for a, b in _blocks(cu_q)) and max_k == max(b - a for a, b in _blocks(cu_k))
    assert isinstance(scale, float) and q.shape[1] % k.shape[1] == 0
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float64)
    for (qa, qb), (ka, kb) in zip(_blocks(cu_q), _blocks(cu_k)):
        qq = q[qa:qb].double().transpose(0, 1)
        kk = k[ka:kb].double().repeat_interleave(group, 1).transpose(0, 1)
        vv = v[ka:kb].double().repeat_interleave(group, 1).transpose(0, 1)
        s = (qq @ kk.transpose(1, 2)) * scale
        s = s.masked_fill(~_allowed(qb - qa, kb - ka, causal, left, right), float("-inf"))
        l = torch.logsumexp(s, -1)
        out[qa:qb] = (torch.exp(s - l[..., None]) @ vv).transpose(0, 1)
        lse[:, qa:qb] = l
    return out.to(q.dtype), lse.float() if q.dtype != torch.float64 else lse


def _reference_backward(dout, q, k, v, out, lse, cu_q, cu_k, scale, causal, left, right):
    """dq, dk, dv from the given out and lse [H, T] (not recomputed: as a flash kernel does)."""
    assert lse.shape == (q.shape[1], q.shape[0]), f"lse must come back as [H, T], got {tuple(lse.shape)}"
    group = q.shape[1] // k.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float64)
    dk = torch.zeros(k.shape, dtype=torch.float64)
    dv = torch.zeros(v.shape, dtype=torch.float64)
    for (qa, qb), (ka, kb) in zip(_blocks(cu_q), _blocks(cu_k)):
        qq, do, oo = (x[qa:qb].double().transpose(0, 1) for x in (q, dout, out))
        kk = k[ka:kb].double().repeat_interleave(group, 1).transpose(0, 1)
        vv = v[ka:kb].double().repeat_interleave(group, 1).transpose(0, 1)
        s = (qq @ kk.transpose(1, 2)) * scale
        s = s.masked_fill(~_allowed(qb - qa, kb - ka, causal, left, right), float("-inf"))
        p = torch.exp(s - lse[:, qa:qb].double()[..., None])
        dp = do @ vv.transpose(1, 2)
        ds = p * (dp - (do * oo).sum(-1, keepdim=True))
        dq[qa:qb] = (ds @ kk * scale).transpose(0, 1)
        hk = k.shape[1]
        dk[ka:kb] = (ds.transpose(1, 2) @ qq * scale).transpose(0, 1).reshape(kb - ka, hk, group, -1).sum(2)
        dv[ka:kb] = (p.transpose(1, 2) @ do).transpose(0, 1).reshape(kb - ka, hk, group, -1).sum(2)
    return dq, dk, dv


def fake_flash_attn_2(calls: Calls, old_returns: bool = False) -> types.ModuleType:
    """flash_attn.flash_attn_interface of flash-attn 2.8 (signatures as released). `old_returns`:
    the 8-tuple forward of releases up to 2.6."""

    def _flash_attn_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
        block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False, num_splits=0,
    ):  # fmt: skip
        assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None and not return_softmax
        calls.forward.append(dict(causal=causal, window=(window_size_left, window_size_right), scale=softmax_scale))
        out, lse = _reference_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
            window_size_left, window_size_right,
        )  # fmt: skip
        if old_returns:
            return out, q, k, v, out, lse, None, None
        return out, lse, None, None

    def _flash_attn_varlen_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
        deterministic, rng_state=None, zero_tensors=False,
    ):  # fmt: skip
        calls.backward.append(dict(causal=causal, window=(window_size_left, window_size_right), scale=softmax_scale))
        got = _reference_backward(
            dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
            window_size_left, window_size_right,
        )  # fmt: skip
        for into, g in zip((dq, dk, dv), got):  # flash-attn 2 writes the gradients into dq, dk, dv
            into.copy_(g)
        return dq, dk, dv, None

    mod = types.ModuleType("flash_attn.flash_attn_interface")
    mod._flash_attn_varlen_forward = _flash_attn_varlen_forward
    mod._flash_attn_varlen_backward = _flash_attn_varlen_backward
    return mod


def fake_flash_attn_4(calls: Calls) -> types.ModuleType:
    """flash_attn.cute.interface of flash-attn-4 (the keywords hf_cp uses, as released)."""

    def _flash_attn_fwd(
        q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
        max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None,
        causal=False, softcap=None, window_size_left=None, window_size_right=None, learnable_sink=None,
        pack_gqa=None, return_lse=False, out=None, lse=None,
    ):  # fmt: skip
        assert return_lse and cu_seqlens_q is not None and cu_seqlens_k is not None
        calls.forward.append(dict(causal=causal, window=(window_size_left, window_size_right), scale=softmax_scale))
        o, l = _reference_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
            window_size_left, window_size_right,
        )  # fmt: skip
        return o, l, None, None

    def _flash_attn_bwd(
        q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
        window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
        max_seqlen_q=None, max_seqlen_k=None, deterministic=False, dq=None, dk=None, dv=None,
    ):  # fmt: skip
        calls.backward.append(dict(causal=causal, window=(window_size_left, window_size_right), scale=softmax_scale))
        got = _reference_backward(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
            window_size_left, window_size_right,
        )  # fmt: skip
        return tuple(g.to(x.dtype) for g, x in zip(got, (q, k, v)))

    mod = types.ModuleType("flash_attn.cute.interface")
    mod._flash_attn_fwd = _flash_attn_fwd
    mod._flash_attn_bwd = _flash_attn_bwd
    return mod


def install(monkeypatch, fa2: Optional[types.ModuleType] = None, fa4: Optional[types.ModuleType] = None) -> None:
    """Put fake flash_attn packages into sys.modules (None: that one is not installed)."""
    pkg = types.ModuleType("flash_attn")
    pkg.__path__ = []  # a package, so that submodule imports go through sys.modules
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", fa2)
    cute = types.ModuleType("flash_attn.cute")
    cute.__path__ = []
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute if fa4 is not None else None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", fa4)
    if fa2 is not None:
        pkg.flash_attn_interface = fa2
    if fa4 is not None:
        cute.interface = fa4
        pkg.cute = cute


def not_installed(monkeypatch) -> None:
    """No flash-attn of either kind (a None entry in sys.modules makes its import fail)."""
    install(monkeypatch)


# ----------------------------------------------------------------------------- the adapters
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("old_returns", [False, True])
def test_flash_attn_2_adapter_maps_every_argument(monkeypatch, causal, heads, old_returns):
    calls = Calls()
    install(monkeypatch, fa2=fake_flash_attn_2(calls, old_returns))
    errors = check_kernel(FlashAttnKernel(), "cpu", torch.float64, 3, causal, heads=heads)
    assert max(errors.values()) <= 1e-10, errors
    # an open window on both sides (causal closes the right one), the scale passed as given
    assert calls.forward[0]["window"] == (-1, -1) and calls.backward[0]["window"] == (-1, -1)
    assert calls.forward[0]["causal"] is causal and calls.forward[0]["scale"] == pytest.approx(16**-0.5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_flash_attn_4_adapter_maps_every_argument(monkeypatch, causal, heads):
    calls = Calls()
    install(monkeypatch, fa4=fake_flash_attn_4(calls))
    errors = check_kernel(FlashAttn4Kernel(), "cpu", torch.float64, 4, causal, heads=heads)
    assert max(errors.values()) <= 1e-10, errors
    assert calls.forward[0]["window"] == (None, None) and calls.backward[0]["causal"] is causal


def test_the_fake_kernels_see_a_wrong_mapping(monkeypatch):
    """The check is sharp: a window or scale passed wrong shows in the errors."""
    calls = Calls()
    install(monkeypatch, fa2=fake_flash_attn_2(calls))
    narrow = FlashAttnKernel()
    real_fwd = narrow._fwd
    narrow._fwd = lambda **kw: real_fwd(**{**kw, "window_size_left": 3})
    assert check_kernel(narrow, "cpu", torch.float64, 3, True)["out"] > 1e-3
    scaled = FlashAttnKernel()
    real_bwd = scaled._bwd
    scaled._bwd = lambda **kw: real_bwd(**{**kw, "softmax_scale": kw["softmax_scale"] * 1.001})
    assert check_kernel(scaled, "cpu", torch.float64, 3, False)["dq"] > 1e-5


# ----------------------------------------------------------------------------- the choice
def test_auto_by_device_and_dtype(monkeypatch):
    not_installed(monkeypatch)
    use_attention_kernel("auto", CPU)
    assert kernel_for(CPU, dtype=torch.bfloat16).name == "cpu_flash"
    assert kernel_for(CUDA, dtype=torch.float32).name == "math"  # the flash kernels run half precision only
    assert kernel_for(CUDA, dtype=torch.bfloat16).name == "torch_varlen"  # no flash-attn: torch's


def test_auto_takes_flash_attn_2_then_4_on_hopper(monkeypatch):
    install(monkeypatch, fa2=fake_flash_attn_2(Calls()), fa4=fake_flash_attn_4(Calls()))
    use_attention_kernel("auto", CPU)
    assert kernel_for(CUDA, dtype=torch.bfloat16).name == "flash_attn"
    install(monkeypatch, fa4=fake_flash_attn_4(Calls()))
    monkeypatch.setattr(kernels, "cuda_capability", lambda device: (9, 0))
    use_attention_kernel("auto", CPU)
    assert kernel_for(CUDA, dtype=torch.bfloat16).name == "flash_attn_4"
    monkeypatch.setattr(kernels, "cuda_capability", lambda device: (8, 0))  # an A100: not for flash-attn-4
    use_attention_kernel("auto", CPU)
    assert kernel_for(CUDA, dtype=torch.bfloat16).name == "torch_varlen"


def test_a_chosen_kernel_runs_half_precision_and_fp32_goes_to_math(monkeypatch):
    install(monkeypatch, fa2=fake_flash_attn_2(Calls()))
    line = use_attention_kernel("flash_attn", CUDA)
    assert kernel_for(CUDA, dtype=torch.bfloat16).name == "flash_attn"
    assert kernel_for(CUDA, dtype=torch.float32).name == "math"
    assert line == (
        "attention kernel: flash_attn (flash-attn 2 varlen) on cuda for bf16/fp16, math (hf_cp's math kernel "
        "(explicit scores)) for fp32/fp64 [cp_attention_kernel: flash_attn]"
    )
    use_attention_kernel("torch_varlen", CUDA)
    assert kernel_for(CUDA, dtype=torch.float16).name == "torch_varlen"
    use_attention_kernel("math", CPU)
    assert kernel_for(CPU, dtype=torch.float32).name == "math"


def test_the_start_up_line_on_cpu():
    assert (
        attention_kernel_line(CPU)
        == "attention kernel: cpu_flash (aten's CPU flash attention) on cpu [cp_attention_kernel: auto]"
    )


def test_refusals_name_the_kernel_and_the_reason(monkeypatch):
    not_installed(monkeypatch)
    with pytest.raises(ValueError, match=r"cp_attention_kernel: 'sdpa' is not one of auto, flash_attn, flash_attn_4"):
        check_kernel_choice("sdpa", CUDA)
    for name in ("flash_attn", "flash_attn_4", "torch_varlen"):
        with pytest.raises(ValueError, match=f"cp_attention_kernel: {name} runs on CUDA only and this run is on cpu"):
            use_attention_kernel(name, CPU)
    with pytest.raises(ValueError, match="cpu_flash is aten's CPU kernel and this run is on CUDA"):
        check_kernel_choice("cpu_flash", CUDA)
    with pytest.raises(ValueError, match=r"flash_attn needs flash-attn 2 \(pip install flash-attn\), and "):
        check_kernel_choice("flash_attn", CUDA)
    with pytest.raises(ValueError, match=r"flash_attn_4 needs flash-attn-4 \(pip install flash-attn-4\)"):
        check_kernel_choice("flash_attn_4", CUDA)
    install(monkeypatch, fa4=fake_flash_attn_4(Calls()))
    monkeypatch.setattr(kernels, "cuda_capability", lambda device: (8, 0))
    with pytest.raises(ValueError, match=r"flash_attn_4 runs on compute capability 9.0 and above .* this GPU is 8.0"):
        check_kernel_choice("flash_attn_4", CUDA)
    check_kernel_choice("torch_varlen", CUDA)  # torch 2.11+ has torch.nn.attention.varlen
    assert kernels._chosen is None, "a refused choice leaves the previous one"


def test_a_choice_that_disagrees_with_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv("HF_CP_ATTENTION_KERNEL", "cpu_flash")
    with pytest.raises(ValueError, match="cp_attention_kernel: math and HF_CP_ATTENTION_KERNEL=cpu_flash disagree"):
        use_attention_kernel("math", CPU)
    assert use_attention_kernel("auto", CPU).endswith("[HF_CP_ATTENTION_KERNEL=cpu_flash]")
