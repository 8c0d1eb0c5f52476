"""Attention over blocks on one rank: packed documents, causal inside each, never across.

BlockPlan turns a list of blocks into gather indices once, runs a kernel on them, and merges
the per-block results of each query row by log-sum-exp (a row may be covered by several
blocks: a ring step, or the key range before a diagonal). The ring and Ulysses code reuse it.
Tensors are token-major: q [T, H, D], k/v [T, H_kv, D].
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from hf_cp.attention.blocks import FULL, INV_CAUSAL, Block, Slices, document_blocks
from hf_cp.attention.kernels import AttentionKernel, kernel_for

Tensor = torch.Tensor


def _range_index(starts: Sequence[int], lens: Sequence[int], reverse: Optional[Sequence[bool]] = None) -> Tensor:
    """Concatenation of arange(s, s + n) for each (s, n) (descending where `reverse`), built
    without a Python loop per row."""
    starts_t = torch.tensor(list(starts), dtype=torch.long)
    lens_t = torch.tensor(list(lens), dtype=torch.long)
    total = int(lens_t.sum())
    offsets = torch.cumsum(lens_t, 0) - lens_t
    step = torch.arange(total) - torch.repeat_interleave(offsets, lens_t, output_size=total)  # 0..n-1 per block
    if reverse is not None and any(reverse):
        rev = torch.repeat_interleave(torch.tensor(list(reverse), dtype=torch.bool), lens_t, output_size=total)
        last = torch.repeat_interleave(lens_t - 1, lens_t, output_size=total)
        step = torch.where(rev, last - step, step)
    return torch.repeat_interleave(starts_t, lens_t, output_size=total) + step


class _KindPlan:
    """The blocks a kernel runs with one mask (causal or full), sorted so equal shapes are
    adjacent. Inverse-causal squares run as causal ones on reversed rows and keys: query i sees
    keys j >= i exactly when reversed query n-1-i sees reversed keys n-1-j <= n-1-i."""

    def __init__(self, blocks: List[Block], causal: bool, device):
        blocks = sorted(blocks, key=lambda b: (b.q_len, b.k_len))
        self.causal = causal
        self.q_lens = [b.q_len for b in blocks]
        self.k_lens = [b.k_len for b in blocks]
        rev = [b.kind == INV_CAUSAL for b in blocks]
        self.q_index = _range_index([b.q_row for b in blocks], self.q_lens, rev).to(device)
        self.k_index = _range_index([b.k_row for b in blocks], self.k_lens, rev).to(device)


def merge_lse(out_a: Optional[Tensor], lse_a: Optional[Tensor], out_b: Tensor, lse_b: Tensor) -> Tuple[Tensor, Tensor]:
    """Online-softmax merge of two partial results over disjoint key sets (rows with lse -inf
    in one of them take the other's values)."""
    if out_a is None:
        return out_b, lse_b
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe).unsqueeze(-1)
    w_b = torch.exp(lse_b - safe).unsqueeze(-1)
    return out_a * w_a + out_b * w_b, lse


class BlockPlan:
    """Blocks between a query tensor of n_q rows and a key tensor, ready to run."""

    def __init__(self, blocks: Sequence[Block], n_q: int, device=None):
        self.blocks = list(blocks)
        self.n_q = n_q
        device = torch.device("cpu") if device is None else device
        self.kinds = [
            _KindPlan([b for b in self.blocks if (b.kind != FULL) == c], c, device)
            for c in (True, False)
            if any((b.kind != FULL) == c for b in self.blocks)
        ]

    def __bool__(self) -> bool:
        return bool(self.blocks)

    def forward(self, kernel: AttentionKernel, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tuple[Tensor, Tensor]:
        """(out [n_q, H, D] float32, lse [n_q, H] float32); rows no block covers: 0 and -inf."""
        h, d = q.shape[1], v.shape[2]
        rows, outs, lses = [], [], []
        for kp in self.kinds:
            o, l = kernel.forward(
                q.index_select(0, kp.q_index),
                k.index_select(0, kp.k_index),
                v.index_select(0, kp.k_index),
                kp.q_lens,
                kp.k_lens,
                kp.causal,
                scale,
            )
            rows.append(kp.q_index), outs.append(o.float()), lses.append(l)
        if not rows:
            return q.new_zeros(self.n_q, h, d, dtype=torch.float32), q.new_full(
                (self.n_q, h), -float("inf"), dtype=torch.float32
            )
        rows_t, out_e, lse_e = torch.cat(rows), torch.cat(outs), torch.cat(lses)
        peak = lse_e.new_full((self.n_q, h), -float("inf")).scatter_reduce_(
            0, rows_t.unsqueeze(1).expand(-1, h), lse_e, "amax"
        )
        w = torch.exp(lse_e - peak.index_select(0, rows_t))
        wsum = lse_e.new_zeros(self.n_q, h).index_add_(0, rows_t, w)
        out = out_e.new_zeros(self.n_q, h, d).index_add_(0, rows_t, out_e * w.unsqueeze(-1))
        covered = wsum > 0
        out = out / torch.where(covered, wsum, torch.ones_like(wsum)).unsqueeze(-1)
        lse = torch.where(covered, peak + torch.log(torch.where(covered, wsum, torch.ones_like(wsum))), peak)
        return out, lse

    def backward(
        self,
        kernel: AttentionKernel,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        scale: float,
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """float32 (dq, dk, dv) of these blocks given each query row's final out and lse."""
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for kp in self.kinds:
            qi, ki = kp.q_index, kp.k_index
            g = kernel.backward(
                dout.index_select(0, qi),
                q.index_select(0, qi),
                k.index_select(0, ki),
                v.index_select(0, ki),
                out.index_select(0, qi),
                lse.index_select(0, qi),
                kp.q_lens,
                kp.k_lens,
                kp.causal,
                scale,
            )
            dq.index_add_(0, qi, g[0].float())
            dk.index_add_(0, ki, g[1].float())
            dv.index_add_(0, ki, g[2].float())
        return dq, dk, dv


def apply_sinks(out: Tensor, lse: Tensor, sinks: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """Attention sinks (GPT-OSS `s_aux`): one extra logit per head in every row's softmax
    denominator, with no value. On merged (out, lse) it is one more log-sum-exp merge with an
    empty output: out * exp(lse - lse'), lse' = logaddexp(lse, sink)."""
    if sinks is None:
        return out, lse
    s = sinks.detach().float().reshape(1, -1)
    lse2 = torch.logaddexp(lse, s)
    return out * torch.exp(lse - lse2).unsqueeze(-1), lse2


def sinks_grad(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """d loss / d sink per head, from the rows' final out and lse (sinks included): the sink's
    probability p = exp(sink - lse) scales every row's output by (1 - p), so the gradient is
    -sum over rows of p * (dO . O)."""
    p = torch.exp(sinks.detach().float().reshape(1, -1) - lse)
    return -((dout.float() * out.float()).sum(-1) * p).sum(0).to(sinks.dtype)


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, plan: BlockPlan, kernel: AttentionKernel, scale: float):
        out, lse = plan.forward(kernel, q, k, v, scale)
        out, lse = apply_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.plan, ctx.kernel, ctx.scale = plan, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = ctx.plan.backward(ctx.kernel, dout, q, k, v, out, lse, ctx.scale)
        dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None


def block_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    blocks: Sequence[Block],
    scale: float,
    kernel: Optional[AttentionKernel] = None,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Differentiable attention of q rows over k/v rows restricted to `blocks` (no
    communication); `sinks` [H]: one extra logit per head (apply_sinks)."""
    kernel = kernel or kernel_for(q.device, dtype=q.dtype)
    return _BlockAttention.apply(q, k, v, sinks, BlockPlan(blocks, q.shape[0], q.device), kernel, scale)


def packed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    doc_lengths: Sequence[int],
    scale: float,
    kernel: Optional[AttentionKernel] = None,
    slices: Optional[Sequence[Optional[Slices]]] = None,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Attention inside each of the documents packed back to back in q/k/v: causal, or under
    the document's mask slices where `slices` gives them (None entries causal)."""
    if sum(doc_lengths) != q.shape[0]:
        raise ValueError(f"document lengths sum to {sum(doc_lengths)} but the packed sequence has {q.shape[0]} tokens")
    return block_attention(q, k, v, document_blocks(doc_lengths, 0, slices), scale, kernel, sinks)
