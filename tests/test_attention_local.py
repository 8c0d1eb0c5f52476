"""Single-process parts of the attention: block geometry, packed local attention, the
transformers registration without a CP context, kernel choice and the clear errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_cp.attention import (
    CPContext,
    UlyssesSpec,
    cp_attention,
    cp_context,
    kernel_for,
    packed_attention,
    segment_blocks,
    ulysses_attention,
)
from hf_cp.attention.blocks import block_pairs, range_pair_blocks
from hf_cp.attention.kernels import CpuFlashKernel
from hf_cp.modes.registry import rank_segments
from hf_cp.modes.segments import WHOLE_DOCUMENT_MODES, ShardMode, doc_pairs

from helpers.mask_reference import causal_reference_attention


def _dense(blocks, n_q, n_k):
    """How many times each (query row, key row) pair is computed by the blocks."""
    m = torch.zeros(n_q, n_k, dtype=torch.int64)
    for b in blocks:
        tile = torch.ones(b.q_len, b.k_len, dtype=torch.int64)
        m[b.q_row : b.q_row + b.q_len, b.k_row : b.k_row + b.k_len] += tile.tril() if b.causal else tile
        if b.causal:
            assert b.q_len == b.k_len, b
    return m


@settings(max_examples=150, deadline=None)
@given(qs=st.integers(0, 20), ql=st.integers(1, 20), ks=st.integers(0, 20), kl=st.integers(1, 20))
def test_range_pair_blocks_cover_exactly_the_causal_pairs(qs, ql, ks, kl):
    blocks = range_pair_blocks(qs, ql, 0, ks, kl, 0)
    want = torch.tensor([[int(ks + j <= qs + i) for j in range(kl)] for i in range(ql)])
    assert torch.equal(_dense(blocks, ql, kl), want)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=6),
    g=st.integers(1, 4),
    mode=st.sampled_from(WHOLE_DOCUMENT_MODES),
)
def test_segment_blocks_of_all_members_compute_each_causal_pair_once(lengths, g, mode):
    """Over every (query member, key member) pair, the blocks mapped back to packed positions
    are exactly the block-diagonal causal mask, each pair once."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    t = sum(lengths)
    segs = [rank_segments(mode, lengths, g, m) for m in range(g)]
    where = [
        torch.tensor([starts[s.doc] + s.start + i for s in ss for i in range(s.length)], dtype=torch.long)
        for ss in segs
    ]
    total = torch.zeros(t, t, dtype=torch.int64)
    for a in range(g):
        for b in range(g):
            blocks = segment_blocks(segs[a], segs[b])
            if blocks:
                dense = _dense(blocks, len(where[a]), len(where[b]))
                total[where[a][:, None], where[b][None, :]] += dense
    want = torch.block_diag(*[torch.ones(n, n, dtype=torch.int64).tril() for n in lengths])
    assert torch.equal(total, want)
    assert sum(block_pairs(segment_blocks(segs[a], segs[b])) for a in range(g) for b in range(g)) == sum(
        doc_pairs(n) for n in lengths
    )


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=7),
    heads=st.sampled_from([(4, 4), (4, 2), (6, 1)]),
    seed=st.integers(0, 1000),
)
def test_packed_attention_matches_per_document_reference(lengths, heads, seed):
    h, hkv = heads
    gen = torch.Generator().manual_seed(seed)
    t, d = sum(lengths), 8
    q, k, v = (torch.randn(t, n, d, generator=gen) for n in (h, hkv, hkv))
    dout = torch.randn(t, h, d, generator=gen)
    scale = 1 / math.sqrt(d)
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref = causal_reference_attention(*ref_in, lengths, scale)
    ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
    mine = [x.clone().requires_grad_() for x in (q, k, v)]
    out = packed_attention(*mine, lengths, scale)
    grads = torch.autograd.grad(out, mine, dout)
    assert (out.double() - ref).abs().max() <= 1e-5
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.shape
        assert (g.double() - r).abs().max() <= 1e-5


def test_packed_attention_never_crosses_documents():
    """Changing one document's keys must leave every other document's output untouched."""
    lengths, d = [3, 5, 4], 8
    q, k, v = torch.randn(12, 2, d), torch.randn(12, 2, d), torch.randn(12, 2, d)
    base = packed_attention(q, k, v, lengths, 0.3)
    k2, v2 = k.clone(), v.clone()
    k2[3:8] += 5.0
    v2[3:8] -= 2.0
    moved = packed_attention(q, k2, v2, lengths, 0.3)
    assert torch.equal(base[:3], moved[:3]) and torch.equal(base[8:], moved[8:])
    assert not torch.allclose(base[3:8], moved[3:8])


def test_cpu_kernel_is_chosen_and_override_is_checked(monkeypatch):
    assert isinstance(kernel_for(torch.device("cpu")), CpuFlashKernel)
    monkeypatch.setenv("HF_CP_ATTENTION_KERNEL", "no_such_kernel")
    with pytest.raises(ValueError, match="no_such_kernel"):
        kernel_for(torch.device("cpu"))


def test_single_member_context_runs_locally_with_all_modes():
    """group_size 1: distributed documents are whole on the rank, in any layout, no group needed."""
    lengths, d = [7, 1, 12], 8
    q, k, v = torch.randn(20, 4, d), torch.randn(20, 2, d), torch.randn(20, 2, d)
    ref = packed_attention(q, k, v, lengths, 0.25)
    for mode in WHOLE_DOCUMENT_MODES:
        rows = torch.cat(
            [
                torch.arange(s.start, s.start + s.length) + sum(lengths[: s.doc])
                for s in rank_segments(mode, lengths, 1, 0)
            ]
        )
        ctx = CPContext(group=None, group_ranks=(0,), member=0, mode=mode, distributed_lengths=tuple(lengths))
        out = cp_attention(q[rows], k[rows], v[rows], ctx, 0.25)
        assert (out - ref[rows]).abs().max() <= 1e-6, mode


def test_clear_errors():
    q, k = torch.randn(10, 4, 8), torch.randn(10, 2, 8)
    ctx = CPContext(
        group=None,
        group_ranks=(0, 1),
        member=0,
        mode=ShardMode.RING_PER_DOC,
        distributed_lengths=(8,),
        local_lengths=(3,),
    )
    with pytest.raises(ValueError, match=r"got 10 tokens.*3 local tokens.*4 tokens of its shards"):
        cp_attention(
            q,
            k,
            k,
            CPContext(
                group=object(),
                group_ranks=(0, 1),
                member=0,
                mode=ShardMode.RING_PER_DOC,
                distributed_lengths=(8,),
                local_lengths=(3,),
            ),
            0.1,
        )
    with pytest.raises(ValueError, match="no process group"):
        cp_attention(q, k, k, ctx, 0.1)
    with pytest.raises(ValueError, match="divisible by 3.*4 query heads"):
        ulysses_attention(q[:4], k[:4], k[:4], UlyssesSpec(object(), 0, (4, 3, 3), (10,)), 0.1)
    with pytest.raises(ValueError, match="document lengths sum to 9"):
        packed_attention(q, k, k, [4, 5], 0.1)


# ----------------------------------------------------------------------------- transformers registration
def _tiny(attn, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_cp.attention.interface  # noqa: F401

    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
        use_cache=False,
        **extra,
    )
    torch.manual_seed(7)
    return LlamaForCausalLM._from_config(cfg, attn_implementation=attn).train()


def test_no_context_packed_model_matches_sdpa_and_separate_documents():
    lengths = [6, 1, 11, 4]
    ids = torch.randint(0, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    mine, ref = _tiny("hf_cp"), _tiny("sdpa")
    out = mine(input_ids=ids, position_ids=pos).logits
    want = ref(input_ids=ids, position_ids=pos).logits
    starts = [0, 6, 7, 18]
    separate = torch.cat([ref(input_ids=ids[:, s : s + n]).logits for s, n in zip(starts, lengths)], dim=1)
    assert (out - want).abs().max() <= 1e-5
    assert (out - separate).abs().max() <= 1e-5
    out.square().sum().backward()
    want.square().sum().backward()
    for (n, p), (_, r) in zip(mine.named_parameters(), ref.named_parameters()):
        assert (p.grad - r.grad).abs().max() <= 1e-4 * max(1.0, r.grad.abs().max().item()), n
    # flash-attn style kwargs name the same documents
    cu = torch.tensor([0, 6, 7, 18, 22], dtype=torch.int32)
    by_cu = mine(
        input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=11, max_length_k=11
    ).logits
    assert (by_cu - out).abs().max() <= 1e-6


def test_no_context_batch_of_rows_matches_sdpa():
    ids = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(4))
    out = _tiny("hf_cp")(input_ids=ids).logits
    want = _tiny("sdpa")(input_ids=ids).logits
    assert (out - want).abs().max() <= 1e-5


def test_autocast_bf16_model_matches_sdpa_under_autocast():
    """Under autocast, RoPE hands q and k over in fp32 and v in bf16: hf_cp casts all three to
    the autocast dtype, as SDPA does, and the packed model equals SDPA's."""
    lengths = [9, 14]
    ids = torch.randint(0, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(5))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _tiny("hf_cp")(input_ids=ids[:, :9], position_ids=pos[:, :9]).logits
        want = _tiny("sdpa")(input_ids=ids[:, :9]).logits
        packed = _tiny("hf_cp")(input_ids=ids, position_ids=pos).logits
    assert out.dtype == want.dtype
    assert (out - want).abs().max() <= 2e-2 * want.abs().max()
    assert (packed[:, :9] - want).abs().max() <= 2e-2 * want.abs().max()


def test_mixed_dtypes_outside_autocast_are_refused():
    from hf_cp.attention.interface import hf_cp_attention

    q = torch.randn(1, 4, 5, 8)
    kv = torch.randn(1, 2, 5, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="query, key and value arrive as torch.float32, torch.bfloat16"):
        hf_cp_attention(torch.nn.Module(), q, kv, kv, None)


def test_model_refuses_cache_in_training_and_padding():
    model = _tiny("hf_cp")
    ids, pos = torch.randint(0, 64, (1, 8)), torch.arange(8)[None]
    with pytest.raises(ValueError, match="use_cache=True in training"):
        model(input_ids=ids, position_ids=pos, use_cache=True)
    with pytest.raises(ValueError, match="padded batches"):
        model(input_ids=ids, attention_mask=torch.tensor([[1] * 6 + [0] * 2]))


def test_model_under_context_checks_the_layout():
    model = _tiny("hf_cp")
    ctx = CPContext(group=None, group_ranks=(0,), member=0, local_lengths=(5,))
    with cp_context(ctx), pytest.raises(ValueError, match="got 8 tokens.*5 local tokens"):
        model(input_ids=torch.randint(0, 64, (1, 8)), position_ids=torch.arange(8)[None])
    ctx = CPContext(group=None, group_ranks=(0,), member=0, local_lengths=(3, 5))
    with cp_context(ctx):  # all local: same as the packed model without a context
        out = model(input_ids=torch.arange(8)[None], position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])).logits
    plain = model(input_ids=torch.arange(8)[None], position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])).logits
    assert torch.equal(out, plain)


# ----------------------------------------------------------------------------- masks, sinks, the engine on one member
MASK_KINDS = st.one_of(
    st.none(),
    st.integers(1, 30).map(lambda w: ("sliding_window", w)),
    st.integers(0, 30).map(lambda p: ("prefix_lm", p)),
    st.integers(1, 7).map(lambda b: ("block_causal", b)),
)


def _mask(spec, n):
    from hf_cp.samples.masks import SampleMask

    if spec is None:
        return None
    kind, x = spec
    if kind == "sliding_window":
        return SampleMask.sliding_window(n, x)
    if kind == "prefix_lm":
        return SampleMask.prefix_lm(n, min(x, n))
    return SampleMask.block_causal(n, x)


@st.composite
def masked_docs(draw, max_len=30):
    from hf_cp.samples.masks import SampleMask

    lengths = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=4))
    masks = [_mask(draw(MASK_KINDS), n) for n in lengths]
    if draw(st.booleans()):
        m = SampleMask.shared_prompt(draw(st.integers(0, 6)), draw(st.lists(st.integers(1, 7), min_size=1, max_size=4)))
        lengths.append(m.length)
        masks.append(m)
    return lengths, masks


@settings(max_examples=150, deadline=None)
@given(docs=masked_docs(), window=st.one_of(st.none(), st.integers(1, 12)), data=st.data())
def test_masked_blocks_compute_each_attended_pair_once(docs, window, data):
    """Any rectangle of any masked document (under a layer window) as kernel blocks: each
    attended pair exactly once, causal and inverse-causal blocks square."""
    from hf_cp.attention.blocks import masked_range_blocks
    from hf_cp.samples.masks import SampleMask, window_slices

    from helpers.mask_reference import dense_mask

    lengths, masks = docs
    d = data.draw(st.integers(0, len(lengths) - 1))
    n, m = lengths[d], masks[d]
    a, b = sorted(data.draw(st.lists(st.integers(0, n), min_size=2, max_size=2)))
    c, e = sorted(data.draw(st.lists(st.integers(0, n), min_size=2, max_size=2)))
    slices = tuple(window_slices(m or SampleMask.causal(n), window))
    blocks = masked_range_blocks(slices, a, b - a, 3, c, e - c, 5)
    got = torch.zeros(n + 3, n + 5, dtype=torch.int64)
    for blk in blocks:
        tile = torch.ones(blk.q_len, blk.k_len, dtype=torch.int64)
        if blk.kind != 0:
            assert blk.q_len == blk.k_len, blk
            tile = tile.tril() if blk.kind == 1 else tile.triu()
        got[blk.q_row : blk.q_row + blk.q_len, blk.k_row : blk.k_row + blk.k_len] += tile
    want = torch.zeros(n + 3, n + 5, dtype=torch.int64)
    # query position a is stored at row 3, key position c at row 5
    want[3 : 3 + b - a, 5 : 5 + e - c] = torch.from_numpy(dense_mask(m, n, window)[a:b, c:e].astype("int64"))
    assert torch.equal(got, want)


@settings(max_examples=40, deadline=None)
@given(
    docs=masked_docs(),
    window=st.one_of(st.none(), st.integers(1, 12)),
    heads=st.sampled_from([(4, 4), (4, 2), (6, 1)]),
    sinks=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_packed_attention_under_masks_window_and_sinks_matches_dense_reference(docs, window, heads, sinks, seed):
    from hf_cp.attention.dispatch import layer_slices

    from helpers.mask_reference import packed_dense_mask
    from helpers.mask_reference import reference_attention as dense_reference

    lengths, masks = docs
    h, hkv = heads
    gen = torch.Generator().manual_seed(seed)
    t, d = sum(lengths), 8
    q, k, v = (torch.randn(t, n, d, generator=gen) for n in (h, hkv, hkv))
    s = torch.randn(h, generator=gen) if sinks else None
    dout = torch.randn(t, h, d, generator=gen)
    ref_in = [x.double().requires_grad_() for x in (q, k, v)] + ([s.double().requires_grad_()] if sinks else [])
    ref = dense_reference(*ref_in[:3], packed_dense_mask(lengths, masks, window), 0.3, ref_in[3] if sinks else None)
    ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
    mine = [x.clone().requires_grad_() for x in (q, k, v)] + ([s.clone().requires_grad_()] if sinks else [])
    out = packed_attention(
        *mine[:3], lengths, 0.3, None, layer_slices(lengths, masks, window), mine[3] if sinks else None
    )
    grads = torch.autograd.grad(out, mine, dout)
    assert (out.double() - ref).abs().max() <= 1e-5
    for name, g, r in zip("qkvs", grads, ref_grads):
        assert (g.double() - r).abs().max() <= 1e-5 * max(1.0, r.abs().max().item()), name


def test_sinks_change_the_output_and_a_window_drops_far_keys():
    """The features are not ignored: a sink shrinks every output, a window makes far keys
    irrelevant (and only far keys)."""
    from hf_cp.attention.dispatch import layer_slices

    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(12, 2, 8, generator=gen),
        torch.randn(12, 2, 8, generator=gen),
        torch.randn(12, 2, 8, generator=gen),
    )
    plain = packed_attention(q, k, v, [12], 0.3)
    sunk = packed_attention(q, k, v, [12], 0.3, sinks=torch.tensor([3.0, 3.0]))
    assert (sunk.norm(dim=-1) < plain.norm(dim=-1)).all()
    win = packed_attention(q, k, v, [12], 0.3, slices=layer_slices([12], [], 4))
    k2 = k.clone()
    k2[:4] += 10.0  # keys 0..3: beyond the window of queries 8..11
    moved = packed_attention(q, k2, v, [12], 0.3, slices=layer_slices([12], [], 4))
    assert torch.equal(win[8:], moved[8:]) and not torch.allclose(win[:8], moved[:8])
    assert not torch.allclose(win[8:], plain[8:])


@pytest.mark.parametrize("layout", ["contiguous", "random"])
def test_engine_on_one_member_runs_locally(layout):
    """A one-member block layout needs no process group and equals packed attention."""
    from hf_cp.attention.engine import EngineSpec, engine_attention
    from hf_cp.plan.block_layout import contiguous_layout, doc_slices, random_layout
    from hf_cp.samples.masks import SampleMask

    lengths = [9, 14]
    masks = [None, SampleMask.shared_prompt(4, [6, 4])]
    slices = doc_slices(lengths, masks)
    lay = (
        contiguous_layout(lengths, 1, 4, slices) if layout == "contiguous" else random_layout(lengths, 1, 4, slices, 3)
    )
    gen = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(23, 4, 8, generator=gen),
        torch.randn(23, 2, 8, generator=gen),
        torch.randn(23, 2, 8, generator=gen),
    )
    rows = torch.cat([torch.arange(c.start, c.start + c.length) + sum(lengths[: c.doc]) for c in lay.chunks])
    spec = EngineSpec(None, (0,), 0, lay, tuple(lengths), tuple(slices))
    out = engine_attention(q[rows], k[rows], v[rows], spec, 0.3)
    ref = packed_attention(q, k, v, lengths, 0.3, slices=[None, tuple(slices[1])])
    assert (out - ref[rows]).abs().max() <= 1e-6
