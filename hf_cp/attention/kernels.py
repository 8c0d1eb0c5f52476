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
- CUDA: flash-attn 2's varlen functions when importable (`flash_attn`), else flash-attn-4's
  CuTe-DSL ones on Hopper and later (`flash_attn_4`, import name `flash_attn.cute`), else torch's
  `varlen_attn` (`torch_varlen`; `return_aux` gives the lse). All run fp16/bf16 only, so
  fp32/fp64 tensors on CUDA go to the math kernel.
- math: explicit scores in query tiles, any device and dtype; exact, but its memory grows with
  tile x keys, so it is the fallback, not the fast path.

A run chooses with the setting `cp_attention_kernel` (KERNEL_CHOICES; `use_attention_kernel`,
which refuses by name a kernel that is not installed or cannot run on the device, and returns
the line the trainer logs at start-up). HF_CP_ATTENTION_KERNEL=cpu_flash|torch_varlen|
flash_attn|flash_attn_4|math forces one for every dtype (tests, benchmarks).
"""

from __future__ import annotations

import importlib
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
    """flash-attn 2's varlen forward/backward. Not the public `flash_attn_varlen_func`: its
    autograd backward uses the out and lse of its own forward, where ring attention hands each
    block the *merged* out and lse of the row, so the private entry points are called (their
    keywords are matched by name because they changed between releases). GQA passes through:
    K/V keep their fewer heads. The window is always open ((-1, -1); causal closes its right
    side): masks and windows reach a kernel compiled to full and causal blocks (blocks.py)."""

    name = "flash_attn"

    def __init__(self):
        # flash-attn is an optional dependency (CUDA only): imported when this kernel is chosen
        fai = importlib.import_module(FLASH_ATTN_2_MODULE)
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
        return out, _lse_rows(lse, q.shape[0], q.shape[1])[0].to(_lse_dtype(q))

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


class FlashAttn4Kernel(AttentionKernel):
    """flash-attn-4's CuTe-DSL varlen forward/backward (`flash_attn.cute.interface`; Hopper and
    Blackwell). The private `_flash_attn_fwd` / `_flash_attn_bwd`, for the reason FlashAttnKernel
    gives: backward must take the merged out and lse. lse is [H, T] both ways; GQA passes through;
    no window is passed (None: open), causal closes its right side."""

    name = "flash_attn_4"

    def __init__(self):
        # flash-attn-4 is an optional dependency (CUDA, compute capability 9.0+): imported when chosen
        cute = importlib.import_module(FLASH_ATTN_4_MODULE)
        self._fwd, self._bwd = cute._flash_attn_fwd, cute._flash_attn_bwd

    @staticmethod
    def _varlen(q_lens, k_lens, device) -> Dict:
        return dict(
            cu_seqlens_q=_cu(q_lens, device),
            cu_seqlens_k=_cu(k_lens, device),
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(k_lens),
        )

    def forward(self, q, k, v, q_lens, k_lens, causal, scale):
        # (out, lse) in its first releases, (out, lse, p, row_max) later
        res = self._fwd(
            q, k, v, softmax_scale=scale, causal=causal, return_lse=True, **self._varlen(q_lens, k_lens, q.device)
        )
        out, lse = res[0], res[1]
        return out, _lse_rows(lse, q.shape[0], q.shape[1])[0].to(_lse_dtype(q))

    def backward(self, dout, q, k, v, out, lse, q_lens, k_lens, causal, scale):
        got = self._bwd(
            q,
            k,
            v,
            out.contiguous(),
            dout.contiguous(),
            lse.t().contiguous(),  # the kernel's [H, T]
            softmax_scale=scale,
            causal=causal,
            **self._varlen(q_lens, k_lens, q.device),
        )
        return got[0], got[1], got[2]  # (dq, dk, dv), then dsink with learnable sinks


class MathKernel(AttentionKernel):
    """Attention written out: scores, log-sum-exp and the softmax backward, in query tiles of at
    most TILE_ELEMENTS scores, accumulated in float32 (float64 for float64 inputs). Any device,
    any dtype; K/V heads are shared by groups of query heads as in GQA."""

    name = "math"
    TILE_ELEMENTS = 1 << 26  # scores (query rows x keys x heads) per tile: 256 MiB in float32

    def __init__(self, softcap: float = 0.0):
        # logit soft-capping (Gemma 2): score -> softcap * tanh(score / softcap), before the mask;
        # elementwise, so blocks merged by their lse (ring attention) stay exact
        if softcap < 0:
            raise ValueError(f"attention softcap must be >= 0, got {softcap}")
        self.softcap = float(softcap)

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

    def _scores(self, q, k, kl, ql, r0, causal, scale) -> Tuple[Tensor, Optional[Tensor]]:
        # q [rows, H, D], k [kl, H, D] -> [H, rows, kl]; causal blocks are square, so key j is
        # visible to query row i when j <= i (bottom-right alignment, as the flash kernels).
        # Also tanh(score / softcap) when soft-capping (its derivative is 1 - tanh^2), else None.
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        t = None
        if self.softcap:
            t = torch.tanh(s / self.softcap)
            s = t * self.softcap
        if causal:
            i = torch.arange(r0, r0 + q.shape[0], device=q.device)[:, None] + (kl - ql)
            s = s.masked_fill(torch.arange(kl, device=q.device)[None, :] > i, float("-inf"))
        return s, t

    def forward(self, q, k, v, q_lens, k_lens, causal, scale):
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[1], dtype=_lse_dtype(q), device=q.device)
        for qo, ko, ql, kl, r0, n in self._tiles(q_lens, k_lens, q.shape[1]):
            kb = self._acc(k[ko : ko + kl]).repeat_interleave(group, dim=1)
            vb = self._acc(v[ko : ko + kl]).repeat_interleave(group, dim=1)
            s, _ = self._scores(self._acc(q[qo + r0 : qo + r0 + n]), kb, kl, ql, r0, causal, scale)
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
            s, t = self._scores(qb, kb, kl, ql, r0, causal, scale)
            p = torch.exp(s - lse[rows].t().to(s.dtype)[..., None])  # [H, rows, kl], from the final lse
            dp = torch.einsum("qhd,khd->hqk", do, vb)
            ds = p * (dp - (do * ob).sum(-1).t()[..., None])  # softmax backward, D = rowsum(dout * out)
            if t is not None:  # through the cap: d(softcap * tanh(x / softcap)) / dx = 1 - tanh^2
                ds = ds * (1 - t * t)
            dq[rows] = (torch.einsum("hqk,khd->qhd", ds, kb) * scale).to(q.dtype)
            h_kv = k.shape[1]
            dk[ko : ko + kl] += (torch.einsum("hqk,qhd->khd", ds, qb) * scale).view(kl, h_kv, group, -1).sum(2)
            dv[ko : ko + kl] += torch.einsum("hqk,qhd->khd", p, do).view(kl, h_kv, group, -1).sum(2)
        return dq, dk.to(k.dtype), dv.to(v.dtype)


_KERNELS = {
    "cpu_flash": CpuFlashKernel,
    "torch_varlen": TorchVarlenKernel,
    "flash_attn": FlashAttnKernel,
    "flash_attn_4": FlashAttn4Kernel,
    "math": MathKernel,
}
_CACHE: Dict[str, AttentionKernel] = {}
_HALF = (torch.float16, torch.bfloat16)

# ---------------------------------------------------------------------------- the run's choice
FLASH_ATTN_2_MODULE = "flash_attn.flash_attn_interface"  # pip install flash-attn (2.x)
FLASH_ATTN_4_MODULE = "flash_attn.cute.interface"  # pip install flash-attn-4 (CuTe DSL)
# cp_attention_kernel's values: auto picks by device and dtype (kernel_for)
KERNEL_CHOICES = ("auto", "flash_attn", "flash_attn_4", "torch_varlen", "cpu_flash", "math")
_CUDA_ONLY = ("flash_attn", "flash_attn_4", "torch_varlen")
FLASH_ATTN_4_MIN_CAPABILITY = (9, 0)  # its kernels are for Hopper (sm90) and Blackwell (sm100+)
_DESCRIPTIONS = {
    "cpu_flash": "aten's CPU flash attention",
    "torch_varlen": "torch.nn.attention.varlen_attn",
    "flash_attn": "flash-attn 2 varlen",
    "flash_attn_4": "flash-attn-4 CuTe-DSL varlen",
    "math": "hf_cp's math kernel (explicit scores)",
}
ENV_KERNEL = "HF_CP_ATTENTION_KERNEL"
_chosen: Optional[str] = None  # the run's cp_attention_kernel (use_attention_kernel); None: auto
_auto_cuda: Dict[str, str] = {}  # device -> auto's half-precision kernel, decided once per device


def import_problem(module: str) -> Optional[str]:
    """Why `module` cannot be imported (None: it can)."""
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - a broken CUDA extension raises OSError or RuntimeError, not only ImportError
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


def cuda_capability(device: torch.device) -> Optional[Tuple[int, int]]:
    """(major, minor) of a CUDA device; None where CUDA is not available (a choice checked on a
    machine without a GPU, as the CPU tests do)."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def _kernel_problem(name: str, device: torch.device) -> Optional[str]:
    """Why kernel `name` cannot run on `device` (None: it can)."""
    if name not in KERNEL_CHOICES:
        return f"{name!r} is not one of {', '.join(KERNEL_CHOICES)}"
    if name in _CUDA_ONLY and device.type != "cuda":
        return f"{name} runs on CUDA only and this run is on {device.type} (choose auto, cpu_flash or math)"
    if name == "cpu_flash" and device.type == "cuda":
        return "cpu_flash is aten's CPU kernel and this run is on CUDA (choose auto, flash_attn, flash_attn_4, torch_varlen or math)"
    if name == "flash_attn":
        err = import_problem(FLASH_ATTN_2_MODULE)
        if err:
            return f"flash_attn needs flash-attn 2 (pip install flash-attn), and {FLASH_ATTN_2_MODULE} does not import ({err})"
    if name == "flash_attn_4":
        err = import_problem(FLASH_ATTN_4_MODULE)
        if err:
            return f"flash_attn_4 needs flash-attn-4 (pip install flash-attn-4), and {FLASH_ATTN_4_MODULE} does not import ({err})"
        got = cuda_capability(device)
        if got is not None and got < FLASH_ATTN_4_MIN_CAPABILITY:
            return (
                f"flash_attn_4 runs on compute capability {'.'.join(map(str, FLASH_ATTN_4_MIN_CAPABILITY))} and "
                f"above (Hopper, Blackwell); this GPU is {'.'.join(map(str, got))} (choose flash_attn or torch_varlen)"
            )
    if name == "torch_varlen":
        err = import_problem("torch.nn.attention.varlen")
        if err:
            return f"torch_varlen needs torch.nn.attention.varlen, which torch {torch.__version__} lacks ({err})"
    return None


def check_kernel_choice(name: str, device: torch.device) -> None:
    """Refuse, by name, a cp_attention_kernel that is unknown, not installed, or cannot run on
    `device` (CPTrainingArguments checks it when it is built)."""
    problem = _kernel_problem(name, device)
    if problem:
        raise ValueError(f"cp_attention_kernel: {problem}")


def _auto_kernel(device: torch.device, dtype: Optional[torch.dtype]) -> str:
    """auto's kernel: by device, then dtype; on CUDA the fastest installed flash kernel."""
    if device.type != "cuda":
        return "cpu_flash"
    if dtype is not None and dtype not in _HALF:
        return "math"  # the flash kernels run fp16/bf16 only
    key = str(device)
    if key not in _auto_cuda:
        if import_problem(FLASH_ATTN_2_MODULE) is None:
            _auto_cuda[key] = "flash_attn"
        elif import_problem(FLASH_ATTN_4_MODULE) is None and (cuda_capability(device) or (0, 0)) >= (
            FLASH_ATTN_4_MIN_CAPABILITY
        ):
            _auto_cuda[key] = "flash_attn_4"
        else:
            _auto_cuda[key] = "torch_varlen"
    return _auto_cuda[key]


def _run_kernel(device: torch.device, dtype: Optional[torch.dtype]) -> str:
    """The kernel of the run's choice for tensors of `dtype` on `device` (no override). The choice
    was checked against the run's device; tensors on another kind of device get auto's kernel."""
    if _chosen is None or _chosen == "math":
        return _chosen or _auto_kernel(device, dtype)
    if (device.type == "cuda") != (_chosen in _CUDA_ONLY):
        return _auto_kernel(device, dtype)
    if _chosen in _CUDA_ONLY and dtype is not None and dtype not in _HALF:
        return "math"  # the chosen flash kernel runs fp16/bf16 only
    return _chosen


def kernel_for(
    device: torch.device, override: Optional[str] = None, dtype: Optional[torch.dtype] = None
) -> AttentionKernel:
    """The kernel for tensors of `dtype` on `device`: the run's cp_attention_kernel
    (use_attention_kernel), else auto's; HF_CP_ATTENTION_KERNEL (or `override`) forces one."""
    name = override or os.environ.get(ENV_KERNEL) or _run_kernel(device, dtype)
    if name not in _KERNELS:
        raise ValueError(f"{ENV_KERNEL}={name!r} is not one of {sorted(_KERNELS)}")
    if name not in _CACHE:
        _CACHE[name] = _KERNELS[name]()
    return _CACHE[name]


_SOFTCAPPED: Dict[float, AttentionKernel] = {}


def softcapped_kernel(softcap: float) -> AttentionKernel:
    """The kernel of a layer with attention logit soft-capping (Gemma 2): the math kernel, which
    caps each score before the mask (exact, on any device; its memory is bounded by its tiles,
    and it is slower than the flash kernels, none of which hf_cp drives with a cap yet)."""
    cap = float(softcap)
    if cap not in _SOFTCAPPED:
        _SOFTCAPPED[cap] = MathKernel(cap)
    return _SOFTCAPPED[cap]


def use_attention_kernel(name: str, device: torch.device) -> str:
    """Make `name` (a KERNEL_CHOICES value) this process's attention kernel on `device`, refused
    by name where it cannot run; returns the start-up line that says which kernel runs."""
    global _chosen
    check_kernel_choice(name, device)
    forced = os.environ.get(ENV_KERNEL)
    if forced and name != "auto" and forced != name:
        raise ValueError(f"cp_attention_kernel: {name} and {ENV_KERNEL}={forced} disagree; unset one of them")
    _chosen = None if name == "auto" else name
    _auto_cuda.clear()  # decided again: an install may have changed since
    _CACHE.clear()
    return attention_kernel_line(device, name)


def attention_kernel_line(device: torch.device, setting: str = "auto") -> str:
    """Which kernel attention runs with on `device`, for half and full precision, and why."""
    forced = os.environ.get(ENV_KERNEL)
    half = kernel_for(device, dtype=torch.bfloat16).name
    full = kernel_for(device, dtype=torch.float32).name
    why = f"{ENV_KERNEL}={forced}" if forced else f"cp_attention_kernel: {setting}"
    line = f"attention kernel: {half} ({_DESCRIPTIONS[half]}) on {device.type}"
    if full != half:
        line += f" for bf16/fp16, {full} ({_DESCRIPTIONS[full]}) for fp32/fp64"
    return f"{line} [{why}]"
