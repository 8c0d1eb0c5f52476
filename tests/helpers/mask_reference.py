"""Dense references for masked attention, written from each mask kind's plain definition (not
from masks.py's slices or pair counts), and causal documents by torch's own SDPA in float64,
for the attention tests to compare against."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def dense_mask(mask, length, window=None):
    """[n, n] bool: query i may attend key j. mask None: causal. window: keys within `window`
    rotary positions of the query (itself included), positions as SampleMask.position_ids."""
    n = length
    q, k = np.arange(n)[:, None], np.arange(n)[None, :]
    pos = np.arange(n)
    kind = "causal" if mask is None else mask.kind
    if kind == "causal":
        m = k <= q
    elif kind == "sliding_window":
        m = (k <= q) & (k > q - mask.window)
    elif kind == "prefix_lm":
        m = (k <= q) | ((q < mask.prefix) & (k < mask.prefix))
    elif kind == "block_causal":
        m = k // mask.block <= q // mask.block
    elif kind == "shared_prompt":
        seg = np.zeros(n, dtype=int)
        start = mask.prompt
        pos = list(range(mask.prompt))
        for j, a in enumerate(mask.answers):
            seg[start : start + a] = j + 1
            pos.extend(range(mask.prompt, mask.prompt + a))
            start += a
        pos = np.asarray(pos)
        m = (k <= q) & ((seg[None, :] == seg[:, None]) | (seg[None, :] == 0))
    elif kind == "slices":  # each slice from its definition: a diagonal bottom-right (causal) / top-left (inv)
        m = np.zeros((n, n), dtype=bool)
        for sl in mask.explicit:
            qn, kn = sl.q_end - sl.q_start, sl.k_end - sl.k_start
            r, c = np.arange(qn)[:, None], np.arange(kn)[None, :]
            ok = np.ones((qn, kn), dtype=bool)
            if sl.kind.value in ("causal", "bi_causal"):
                ok &= c <= r + (kn - qn)
            if sl.kind.value in ("inv_causal", "bi_causal"):
                ok &= c >= r
            m[sl.q_start : sl.q_end, sl.k_start : sl.k_end] |= ok
    else:
        raise AssertionError(kind)
    if window is not None:
        m = m & ((pos[:, None] - pos[None, :]) < window)
    return m


def packed_dense_mask(lengths, masks, window=None):
    t = sum(lengths)
    out = np.zeros((t, t), dtype=bool)
    o = 0
    for d, n in enumerate(lengths):
        m = masks[d] if masks and d < len(masks) else None
        out[o : o + n, o : o + n] = dense_mask(m, n, window)
        o += n
    return torch.from_numpy(out)


def reference_attention(q, k, v, allowed, scale, sinks=None):
    """Softmax attention with an explicit [T, T] mask (GQA expanded), optionally with one sink
    logit per head in the denominator (GPT-OSS). q [T, H, D], k/v [T, H_kv, D]."""
    h, hkv = q.shape[1], k.shape[1]
    kx, vx = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, kx) * scale
    s = s.masked_fill(~allowed[None], -float("inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(-1, 1, 1).expand(h, q.shape[0], 1).to(s.dtype)], dim=-1)
    p = torch.softmax(s, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    return torch.einsum("hqk,khd->qhd", p, vx)


def causal_reference_attention(q, k, v, lengths, scale):
    """float64 SDPA, causal inside each document: the single-process truth."""
    outs, o = [], 0
    for n in lengths:
        sl = slice(o, o + n)
        outs.append(
            F.scaled_dot_product_attention(
                q[sl].transpose(0, 1),
                k[sl].transpose(0, 1),
                v[sl].transpose(0, 1),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            ).transpose(0, 1)
        )
        o += n
    return torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[2])
