"""Attention kernels that return the log-sum-exp, behind one interface, chosen by device.

A kernel computes variable-length attention over blocks laid out back to back (the varlen
convention): q [sum q_lens, H, D], k/v [sum k_lens, H_kv, D] with H % H_kv == 0 (GQA is
passed through, never expanded), every block either full or square-causal (blocks.py; an
inverse-causal square reaches the kernel as a causal one with its rows and keys reversed, and
every mask compiles to these three kinds, so no kernel here needs a mask of its own).
forward returns (out [Tq, H, D], lse [Tq, H] float32, float64 for float64 inputs); backward takes the *final* out and
lse of each query row, which is what makes per-block gradients add up exactly when a row's
result was merged from several blocks (ring attention).

- CPU: aten `_scaled_dot_product_flash_attention_for_cpu` (+ its backward), one batched call
  per run of equal-shaped blocks.
- CUDA: flash-attn's varlen functions when importable, else torch's `varlen_attn`
  (`return_aux` gives the lse). Both run fp16/bf16 only, so fp32/fp64 tensors on CUDA go to
  the math kernel.
- math: explicit scores in query tiles, any device and dtype; exact, but its memory grows with
  tile x keys, so it is the fallback, not the fast path.
Override with HF_CP_ATTENTION_KERNEL=cpu_flash|torch_varlen|flash_attn|math.
"""

from __future__ import annotations

import inspect
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch

Tensor = torch.Tensor


def _runs(q_lens: Sequence[int], k_lens: Sequence[int]):
    """(q_offset, k_offset, q_len, k_len, count) for runs of consecutive equal-shaped blocks."""
    qo = ko = 0
    i, n = 0, len(q_lens)
    while i < n:
        j = i
        while j < n and q_lens[j] == q_lens[i] and k_lens[j] == k_lens[i]:
            j += 1
        yield qo, ko, q_lens[i], k_lens[i], j - i
        qo += q_lens[i] * (j - i)
        ko += k_lens[i] * (j - i)
        i = j


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


class AttentionKernel:
    name = "abstract"

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, q_lens: List[int], k_lens: List[int], causal: bool, scale: float
    ) -> Tuple[Tensor, Tensor]:
        raise NotImplementedError

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        q_lens: List[int],
        k_lens: List[int],
        causal: bool,
        scale: float,
    ) -> Tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError


class CpuFlashKernel(AttentionKernel):
    """aten's CPU flash attention: batched [B, H, L, D], GQA native, returns logsumexp."""

    name = "cpu_flash"

    @staticmethod
    def _bhld(x: Tensor, off: int, n: int, length: int) -> Tensor:
        return x[off : off + n * length].view(n, length, x.shape[1], x.shape[2]).transpose(1, 2)

    @staticmethod
    def _rows(x: Tensor) -> Tensor:  # [n, H, L, ...] -> [n * L, H, ...]
        x = x.transpose(1, 2)
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])

    def forward(self, q, k, v, q_lens, k_lens, causal, scale):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[1], dtype=_lse_dtype(q), device=q.device)
        for qo, ko, ql, kl, n in _runs(q_lens, k_lens):
            o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                self._bhld(q, qo, n, ql), self._bhld(k, ko, n, kl), self._bhld(v, ko, n, kl), 0.0, causal, scale=scale
            )
            out[qo : qo + n * ql] = self._rows(o)
            lse[qo : qo + n * ql] = self._rows(l.unsqueeze(-1)).squeeze(-1)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, q_lens, k_lens, causal, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for qo, ko, ql, kl, n in _runs(q_lens, k_lens):
            lse_b = lse[qo : qo + n * ql].view(n, ql, -1).transpose(1, 2).to(_lse_dtype(q)).contiguous()
            g = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                self._bhld(dout, qo, n, ql),
                self._bhld(q, qo, n, ql),
                self._bhld(k, ko, n, kl),
                self._bhld(v, ko, n, kl),
                self._bhld(out, qo, n, ql),
                lse_b,
                0.0,
                causal,
                scale=scale,
            )
            dq[qo : qo + n * ql] = self._rows(g[0])
            dk[ko : ko + n * kl] = self._rows(g[1])
            dv[ko : ko + n * kl] = self._rows(g[2])
        return dq, dk, dv


def _cu(lens: Sequence[int], device) -> Tensor:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(list(lens), dtype=torch.int64).cumsum(0)
    return cu.to(device)


def _lse_rows(lse: Tensor, t: int, h: int) -> Tuple[Tensor, bool]:
    """Flash kernels return lse as [H, T] (varlen convention); we keep [T, H]. Also says
    whether the kernel's layout was heads-first, so backward can hand it back the same way."""
    if lse.shape == (h, t):
        return lse.t(), True
    return lse, False


class TorchVarlenKernel(AttentionKernel):
    """torch.nn.attention.varlen (flash backend on CUDA); not runnable on CPU."""

    name = "torch_varlen"

    def __init__(self):
        from torch.nn.attention import varlen  # noqa: F401  (registers torch.ops.torch_attn)

        self._varlen = varlen
        self._heads_first = True
        # torch 2.11 has no enable_gqa keyword (its flash backend takes fewer K/V heads as they
        # are); 2.13 refuses fewer K/V heads without it
        self._gqa_keyword = "enable_gqa" in inspect.signature(varlen.varlen_attn).parameters

    def forward(self, q, k, v, q_lens, k_lens, causal, scale):
        out, lse = self._varlen.varlen_attn(
            q,
            k,
            v,
            _cu(q_lens, q.device),
            _cu(k_lens, q.device),
            max(q_lens),
            max(k_lens),
            return_aux=self._varlen.AuxRequest(lse=True),
            scale=scale,
            window_size=(-1, 0) if causal else (-1, -1),
            **({"enable_gqa": k.shape[1] != q.shape[1]} if self._gqa_keyword else {}),
        )
        lse, self._heads_first = _lse_rows(lse, q.shape[0], q.shape[1])
        return out, lse.float()

    def backward(self, dout, q, k, v, out, lse, q_lens, k_lens, causal, scale):
        lse_native = (lse.t() if self._heads_first else lse).contiguous()  # the kernel's own layout
        return torch.ops.torch_attn._varlen_attn_backward(
            dout.contiguous(),
            q,
            k,
            v,
            out.contiguous(),
            lse_native,
            _cu(q_lens, q.device),
            _cu(k_lens, q.device),
            max(q_lens),
            max(k_lens),
            causal,
            torch.zeros(2, dtype=torch.uint64, device=q.device),
            scale,
            [-1, 0] if causal else [-1, -1],
        )


class FlashAttnKernel(AttentionKernel):
    """flash-attn 2's varlen forward/backward (private entry points: their keywords are matched
    by name because they changed between releases)."""

    name = "flash_attn"

    def __init__(self):
        from flash_attn import flash_attn_interface as fai

        self._fwd, self._bwd = fai._flash_attn_varlen_forward, fai._flash_attn_varlen_backward
        self._fwd_params = set(inspect.signature(self._fwd).parameters)
        self._bwd_params = set(inspect.signature(self._bwd).parameters)

    @staticmethod
    def _common(params, q_lens, k_lens, device, causal, scale) -> Dict:
        kw = dict(
            cu_seqlens_q=_cu(q_lens, device),
            cu_seqlens_k=_cu(k_lens, device),
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(k_lens),
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            window_size=(-1, -1),
            window_size_left=-1,
            window_size_right=-1,
            softcap=0.0,
            alibi_slopes=None,
            deterministic=False,
            return_softmax=False,
            block_table=None,
        )
        return {n: x for n, x in kw.items() if n in params}

    def forward(self, q, k, v, q_lens, k_lens, causal, scale):
        res = self._fwd(q=q, k=k, v=v, **self._common(self._fwd_params, q_lens, k_lens, q.device, causal, scale))
        # <= 2.6 returns (out, q, k, v, out_padded, lse, S_dmask, rng_state); later (out, lse, S_dmask, rng_state)
        out, lse = res[0], res[5] if len(res) == 8 else res[1]
        return out, _lse_rows(lse, q.shape[0], q.shape[1])[0].float()

    def backward(self, dout, q, k, v, out, lse, q_lens, k_lens, causal, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kw = self._common(self._bwd_params, q_lens, k_lens, q.device, causal, scale)
        if "rng_state" in self._bwd_params:
            kw["rng_state"] = None
        self._bwd(
            dout=dout.contiguous(),
            q=q,
            k=k,
            v=v,
            out=out.contiguous(),
            softmax_lse=lse.t().contiguous(),
            dq=dq,
            dk=dk,
            dv=dv,
            **kw,
        )
        return dq, dk, dv


class MathKernel(AttentionKernel):
    """Attention written out: scores, log-sum-exp and the softmax backward, in query tiles of at
    most TILE_ELEMENTS scores, accumulated in float32 (float64 for float64 inputs). Any device,
    any dtype; K/V heads are shared by groups of query heads as in GQA."""

    name = "math"
    TILE_ELEMENTS = 1 << 26  # scores (query rows x keys x heads) per tile: 256 MiB in float32

    @staticmethod
    def _acc(x: Tensor) -> Tensor:
        return x.double() if x.dtype == torch.float64 else x.float()

    def _tiles(self, q_lens, k_lens, heads):
        """(q_offset, k_offset, q_len, k_len, first query row in its block, rows) per tile."""
        qo = ko = 0
        for ql, kl in zip(q_lens, k_lens):
            rows = max(1, self.TILE_ELEMENTS // max(1, kl * heads))
            for r0 in range(0, ql, rows):
                yield qo, ko, ql, kl, r0, min(rows, ql - r0)
            qo += ql
            ko += kl

    @staticmethod
    def _scores(q, k, kl, ql, r0, causal, scale):
        # q [rows, H, D], k [kl, H, D] -> [H, rows, kl]; causal blocks are square, so key j is
        # visible to query row i when j <= i (bottom-right alignment, as the flash kernels)
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        if causal:
            i = torch.arange(r0, r0 + q.shape[0], device=q.device)[:, None] + (kl - ql)
            s = s.masked_fill(torch.arange(kl, device=q.device)[None, :] > i, float("-inf"))
        return s

    def forward(self, q, k, v, q_lens, k_lens, causal, scale):
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[1], dtype=_lse_dtype(q), device=q.device)
        for qo, ko, ql, kl, r0, n in self._tiles(q_lens, k_lens, q.shape[1]):
            kb = self._acc(k[ko : ko + kl]).repeat_interleave(group, dim=1)
            vb = self._acc(v[ko : ko + kl]).repeat_interleave(group, dim=1)
            s = self._scores(self._acc(q[qo + r0 : qo + r0 + n]), kb, kl, ql, r0, causal, scale)
            l = torch.logsumexp(s, dim=-1)  # [H, rows]
            o = torch.einsum("hqk,khd->qhd", torch.exp(s - l[..., None]), vb)
            out[qo + r0 : qo + r0 + n] = o.to(q.dtype)
            lse[qo + r0 : qo + r0 + n] = l.t()
        return out, lse

    def backward(self, dout, q, k, v, out, lse, q_lens, k_lens, causal, scale):
        group = q.shape[1] // k.shape[1]
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=self._acc(k).dtype, device=k.device)
        dv = torch.zeros_like(dk)
        for qo, ko, ql, kl, r0, n in self._tiles(q_lens, k_lens, q.shape[1]):
            rows = slice(qo + r0, qo + r0 + n)
            qb, do, ob = self._acc(q[rows]), self._acc(dout[rows]), self._acc(out[rows])
            kb = self._acc(k[ko : ko + kl]).repeat_interleave(group, dim=1)
            vb = self._acc(v[ko : ko + kl]).repeat_interleave(group, dim=1)
            s = self._scores(qb, kb, kl, ql, r0, causal, scale)
            p = torch.exp(s - lse[rows].t().to(s.dtype)[..., None])  # [H, rows, kl], from the final lse
            dp = torch.einsum("qhd,khd->hqk", do, vb)
            ds = p * (dp - (do * ob).sum(-1).t()[..., None])  # softmax backward, D = rowsum(dout * out)
            dq[rows] = (torch.einsum("hqk,khd->qhd", ds, kb) * scale).to(q.dtype)
            h_kv = k.shape[1]
            dk[ko : ko + kl] += (torch.einsum("hqk,qhd->khd", ds, qb) * scale).view(kl, h_kv, group, -1).sum(2)
            dv[ko : ko + kl] += torch.einsum("hqk,qhd->khd", p, do).view(kl, h_kv, group, -1).sum(2)
        return dq, dk.to(k.dtype), dv.to(v.dtype)


_KERNELS = {
    "cpu_flash": CpuFlashKernel,
    "torch_varlen": TorchVarlenKernel,
    "flash_attn": FlashAttnKernel,
    "math": MathKernel,
}
_CACHE: Dict[str, AttentionKernel] = {}
_HALF = (torch.float16, torch.bfloat16)


def kernel_for(
    device: torch.device, override: Optional[str] = None, dtype: Optional[torch.dtype] = None
) -> AttentionKernel:
    """The kernel for tensors of `dtype` on `device`; HF_CP_ATTENTION_KERNEL (or `override`)
    forces one."""
    name = override or os.environ.get("HF_CP_ATTENTION_KERNEL") or ""
    if not name:
        if device.type != "cuda":
            name = "cpu_flash"
        elif dtype is not None and dtype not in _HALF:
            name = "math"  # the flash kernels run fp16/bf16 only
        else:
            try:
                import flash_attn  # noqa: F401

                name = "flash_attn"
            except ImportError:
                name = "torch_varlen"
    if name not in _KERNELS:
        raise ValueError(f"HF_CP_ATTENTION_KERNEL={name!r} is not one of {sorted(_KERNELS)}")
    if name not in _CACHE:
        _CACHE[name] = _KERNELS[name]()
    return _CACHE[name]
