"""hf_cp's CUDA paths at world 1 against CPU float64 references (marker `gpu`: deselected by
default; run on a GPU machine with `python -m pytest -m gpu tests/test_cuda.py`).

What runs on CUDA here, in bf16 (autocast, as training with `bf16: true`) and fp32:
- every attention kernel the device offers (torch varlen, flash-attn when installed, the math
  kernel that fp32 uses) over causal and full blocks with GQA;
- packed local attention inside a model: loss and every parameter gradient of a packed batch
  of documents, against the same weights in float64 on CPU running each document alone;
- packed attention under masks, a sliding window and sinks; the block engine's one-rank path;
- ChunkFlow's chunk attention over its K/V store; the chunked LM-head loss.
Every check prints its errors (`-s` shows them), so one run on a rented machine says by how much
a check passed or failed. HF_CP_TEST_DEVICE=cpu runs the same checks on CPU (to test the tests).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from hf_cp.attention.kernels import kernel_for

from helpers.kernel_checks import check_kernel

pytestmark = pytest.mark.gpu

DEVICE = torch.device(os.environ.get("HF_CP_TEST_DEVICE", "cuda"))
# relative to the reference's largest magnitude. bf16 keeps 8 bits of mantissa (eps 7.8e-3):
# sums of a few dozen rounded terms stay within a few eps; fp32 on CUDA runs without TF32
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 2e-5}


@pytest.fixture(autouse=True)
def _device():
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device (HF_CP_TEST_DEVICE=cpu runs them on CPU)")
    assert not torch.backends.cuda.matmul.allow_tf32, "fp32 references assume TF32 off"


def _kernel_cases():
    if DEVICE.type != "cuda":
        return [("cpu_flash", torch.float32), ("cpu_flash", torch.bfloat16), ("math", torch.float32)]
    cases = [("torch_varlen", torch.bfloat16), ("torch_varlen", torch.float16)]
    try:
        import flash_attn  # noqa: F401

        cases.append(("flash_attn", torch.bfloat16))
    except ImportError:
        pass
    return cases + [("math", torch.float32), ("math", torch.bfloat16)]


@pytest.mark.parametrize("name,dtype", _kernel_cases())
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_kernels_on_the_device_match_dense_float64(name, dtype, causal, heads):
    kernel = kernel_for(DEVICE, override=name)
    errors = check_kernel(kernel, DEVICE, dtype, 11, causal, heads=heads, head_dim=64, n_blocks=6, max_len=300)
    print(f"\nkernel {name} {str(dtype)[6:]} causal={causal} heads={heads}: " + _fmt(errors))
    assert max(errors.values()) <= TOL[dtype], errors


def test_the_default_kernel_follows_the_dtype(monkeypatch):
    monkeypatch.delenv("HF_CP_ATTENTION_KERNEL", raising=False)
    half = kernel_for(DEVICE, dtype=torch.bfloat16).name
    full = kernel_for(DEVICE, dtype=torch.float32).name
    print(f"\ndefault kernels on {DEVICE.type}: bf16 {half}, fp32 {full}")
    if DEVICE.type == "cuda":
        assert half in ("torch_varlen", "flash_attn") and full == "math"
    else:
        assert half == full == "cpu_flash"


def _fmt(errors) -> str:
    return " ".join(f"{k} {v:.2e}" for k, v in errors.items())


# ----------------------------------------------------------------------------- the model
LENGTHS = [200, 1, 77, 512, 33]


def _model(dtype=torch.float32, attn="hf_cp"):
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_cp.attention.interface  # noqa: F401  (registers "hf_cp")

    cfg = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=320,
        max_position_embeddings=4096,
        use_cache=False,
    )
    torch.manual_seed(5)
    model = LlamaForCausalLM(cfg).to(dtype)
    model.set_attn_implementation(attn)
    return model.train()


def _batch():
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 320, (1, sum(LENGTHS)), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    labels = ids.clone()
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    labels[0, starts] = -100  # no target across a document boundary (the shift is per document)
    labels[0, 250:270] = -100  # a masked span, as a prompt would be
    return ids, pos, labels


def _loss_sum(logits, labels):
    # next-token targets within the packed row: the first token of each document has label -100
    return F.cross_entropy(logits[0, :-1].double(), labels[0, 1:], ignore_index=-100, reduction="sum")


def _reference():
    """float64 on CPU, sdpa attention, each document run alone."""
    model = _model(torch.float64, attn="sdpa")
    ids, _, labels = _batch()
    total, o = 0.0, 0
    for n in LENGTHS:
        logits = model(input_ids=ids[:, o : o + n]).logits
        total = total + F.cross_entropy(logits[0, :-1], labels[0, o + 1 : o + n], ignore_index=-100, reduction="sum")
        o += n
    total.backward()
    return float(total.detach()), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("precision", ["bf16-autocast", "fp32"])
def test_packed_model_on_the_device_matches_each_document_alone_in_float64(precision):
    ref_loss, ref_grads = _reference()
    model = _model().to(DEVICE)
    ids, pos, labels = (x.to(DEVICE) for x in _batch())
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=precision == "bf16-autocast"):
        logits = model(input_ids=ids, position_ids=pos).logits
    loss = _loss_sum(logits, labels)
    loss.backward()
    loss_err = abs(float(loss) - ref_loss) / abs(ref_loss)
    grad_err = {
        n: float((p.grad.double().cpu() - ref_grads[n]).norm() / ref_grads[n].norm())
        for n, p in model.named_parameters()
    }
    worst = max(grad_err, key=grad_err.get)
    print(f"\nmodel {precision}: loss rel err {loss_err:.2e}; worst grad {worst} rel err {grad_err[worst]:.2e}")
    # bf16: a gradient passes through a dozen rounded matrix products (about 5 eps of 7.8e-3)
    tol = 4e-2 if precision == "bf16-autocast" else 1e-5
    assert loss_err <= tol / 4 and grad_err[worst] <= tol, (loss_err, worst, grad_err[worst])


# ----------------------------------------------------------------------------- masks, engine, chunks
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_masked_packed_attention_with_window_and_sinks_on_the_device(dtype):
    from hf_cp.attention import packed_attention
    from hf_cp.attention.dispatch import layer_slices
    from hf_cp.samples.masks import SampleMask

    from helpers.mask_reference import packed_dense_mask, reference_attention

    lengths = [150, 90, 260]
    masks = [None, SampleMask.shared_prompt(30, [20, 25, 15]), SampleMask.block_causal(260, 64)]
    window = 100
    g = torch.Generator().manual_seed(2)
    t, h, hkv, d = sum(lengths), 8, 2, 64
    q, k, v, dout = (torch.randn(t, n, d, generator=g) for n in (h, hkv, hkv, h))
    sinks = torch.randn(h, generator=g)
    ref_in = [x.double().requires_grad_() for x in (q, k, v, sinks)]
    ref = reference_attention(*ref_in[:3], packed_dense_mask(lengths, masks, window), 0.125, ref_in[3])
    ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
    mine = [x.to(DEVICE, dtype).requires_grad_() for x in (q, k, v)] + [sinks.to(DEVICE).requires_grad_()]
    out = packed_attention(*mine[:3], lengths, 0.125, None, layer_slices(lengths, masks, window), mine[3])
    grads = torch.autograd.grad(out, mine, dout.to(DEVICE, dtype))
    errors = {"out": _rel(out, ref)} | {f"d{n}": _rel(a, r) for n, a, r in zip("qkvs", grads, ref_grads)}
    print(f"\nmasked packed attention {str(dtype)[6:]}: " + _fmt(errors))
    assert max(errors.values()) <= TOL[dtype], errors


def _rel(a, r) -> float:
    return float((a.detach().double().cpu() - r.detach()).abs().max() / r.detach().abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_engine_one_rank_path_on_the_device(dtype):
    from hf_cp.attention.engine import EngineSpec, engine_attention
    from hf_cp.plan.block_layout import doc_slices, random_layout
    from hf_cp.samples.masks import SampleMask

    from helpers.mask_reference import packed_dense_mask, reference_attention

    lengths = [300, 140]
    masks = [None, SampleMask.shared_prompt(40, [60, 40])]
    slices = doc_slices(lengths, masks)
    lay = random_layout(lengths, 1, 8, slices, 3)
    g = torch.Generator().manual_seed(4)
    t, d = sum(lengths), 64
    q, k, v, dout = (torch.randn(t, n, d, generator=g) for n in (8, 2, 2, 8))
    rows = torch.cat([torch.arange(c.start, c.start + c.length) + sum(lengths[: c.doc]) for c in lay.chunks])
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref = reference_attention(*ref_in, packed_dense_mask(lengths, masks), 0.125)
    ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
    spec = EngineSpec(None, (0,), 0, lay, tuple(lengths), tuple(slices))
    mine = [x[rows].to(DEVICE, dtype).requires_grad_() for x in (q, k, v)]
    out = engine_attention(*mine, spec, 0.125)
    grads = torch.autograd.grad(out, mine, dout[rows].to(DEVICE, dtype))
    errors = {"out": _rel(out, ref[rows])} | {f"d{n}": _rel(a, r[rows]) for n, a, r in zip("qkv", grads, ref_grads)}
    print(f"\nblock engine, one rank, {str(dtype)[6:]}: " + _fmt(errors))
    assert max(errors.values()) <= TOL[dtype], errors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunkflow_chunk_attention_on_the_device(dtype):
    from hf_cp.plan.chunks import dependent_chunk_sizes

    from helpers.chunk_state_reference import dense_reference, leaves, run_chunked, tensors

    n = 700
    q, k, v, w = tensors(n, seed=3)
    rq, rk, rv = leaves(q.double(), k.double(), v.double())
    ref = dense_reference(rq, rk, rv)
    (ref * w.double()).sum().backward()
    cq, ck, cv = leaves(*(x.to(DEVICE, dtype) for x in (q, k, v)))
    out, _, _ = run_chunked(cq, ck, cv, w.to(DEVICE, dtype), dependent_chunk_sizes(n, 160), 2)
    errors = {"out": _rel(out, ref)} | {
        f"d{x}": _rel(a.grad, r.grad) for x, a, r in zip("qkv", (cq, ck, cv), (rq, rk, rv))
    }
    print(f"\nChunkFlow chunk attention {str(dtype)[6:]}: " + _fmt(errors))
    assert max(errors.values()) <= TOL[dtype], errors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_lm_head_loss_on_the_device(dtype):
    from hf_cp.train.step.loss import chunked_lm_head_loss

    g = torch.Generator().manual_seed(0)
    T, H, V = 3000, 256, 5000
    hidden, weight = torch.randn(T, H, generator=g) / math.sqrt(H), torch.randn(V, H, generator=g)
    targets = torch.randint(0, V, (T,), generator=g)
    targets[::7] = -100
    rh, rw = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want = F.cross_entropy(F.linear(rh, rw), targets, ignore_index=-100, reduction="sum")
    want.backward()
    h, w = hidden.to(DEVICE, dtype).requires_grad_(), weight.to(DEVICE, dtype).requires_grad_()
    got = chunked_lm_head_loss(h, w, targets.to(DEVICE), 1024, ignore_index=-100)
    got.backward()
    errors = {
        "loss": abs(float(got) - float(want)) / float(want),
        "dhidden": float((h.grad.double().cpu() - rh.grad).norm() / rh.grad.norm()),
        "dweight": float((w.grad.double().cpu() - rw.grad).norm() / rw.grad.norm()),
    }
    print(f"\nchunked LM-head loss {str(dtype)[6:]}: " + _fmt(errors))
    assert got.dtype == torch.float32
    assert max(errors.values()) <= TOL[dtype], errors
