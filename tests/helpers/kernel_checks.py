"""Kernel-level check shared by the CPU tests and the CUDA tests: a kernel's forward (out, lse)
and backward (dq, dk, dv) over back-to-back blocks against dense float64 autograd."""

from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch


def random_blocks(seed: int, n_blocks: int, max_len: int, causal: bool) -> Tuple[List[int], List[int]]:
    """Query and key lengths of `n_blocks` blocks; causal blocks are square (the kernels' contract)."""
    g = torch.Generator().manual_seed(seed)
    q_lens = torch.randint(1, max_len + 1, (n_blocks,), generator=g).tolist()
    if causal:
        return q_lens, list(q_lens)
    return q_lens, torch.randint(1, max_len + 1, (n_blocks,), generator=g).tolist()


def dense_reference(
    q, k, v, dout, q_lens: Sequence[int], k_lens: Sequence[int], causal: bool, scale: float, softcap: float = 0.0
):
    """float64 (out, lse [T, H], dq, dk, dv), one block at a time, GQA by repeating K/V heads;
    with `softcap`, each score s becomes softcap * tanh(s / softcap) before the mask (Gemma 2)."""
    q, k, v, dout = (x.detach().double().cpu() for x in (q, k, v, dout))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    group = q.shape[1] // k.shape[1]
    outs, lses, qo, ko = [], [], 0, 0
    for ql, kl in zip(q_lens, k_lens):
        qb = q[qo : qo + ql].transpose(0, 1)  # [H, ql, D]
        kb = k[ko : ko + kl].repeat_interleave(group, dim=1).transpose(0, 1)
        vb = v[ko : ko + kl].repeat_interleave(group, dim=1).transpose(0, 1)
        s = qb @ kb.transpose(1, 2) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if causal:
            s = s.masked_fill(torch.ones(ql, kl, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        outs.append((torch.softmax(s, dim=-1) @ vb).transpose(0, 1))
        lses.append(lse.t())
        qo, ko = qo + ql, ko + kl
    out, lse = torch.cat(outs), torch.cat(lses)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), lse.detach(), dq, dk, dv


def check_kernel(
    kernel, device, dtype, seed: int, causal: bool, heads=(4, 2), head_dim=16, n_blocks=5, max_len=40, softcap=0.0
):
    """Largest relative error (to the reference's largest magnitude) of out, lse, dq, dk, dv."""
    q_lens, k_lens = random_blocks(seed, n_blocks, max_len, causal)
    h, hkv = heads
    g = torch.Generator().manual_seed(seed + 1)
    spread = 4.0 if softcap else 1.0  # scores of several units: a cap of ~1 then changes them
    mk = lambda n, hh: (spread * torch.randn(n, hh, head_dim, generator=g)).to(device=device, dtype=dtype)
    q, k, v = mk(sum(q_lens), h), mk(sum(k_lens), hkv), mk(sum(k_lens), hkv)
    dout = mk(sum(q_lens), h)
    scale = 1 / math.sqrt(head_dim)
    out, lse = kernel.forward(q, k, v, q_lens, k_lens, causal, scale)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, q_lens, k_lens, causal, scale)
    ref = dense_reference(q, k, v, dout, q_lens, k_lens, causal, scale, softcap)
    got = (out, lse, dq, dk, dv)
    errors = {}
    for name, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        assert a.shape == r.shape, (name, a.shape, r.shape)
        errors[name] = float((a.detach().double().cpu() - r).abs().max() / max(1e-12, float(r.abs().max())))
    return errors
