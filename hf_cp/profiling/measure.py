"""`hf-cp profile`: measure one decoder layer on this device and fit the cost model.

The method of ../shared/data/calibration/measure.py, on the model's own layer classes:
  1. query-chunk efficiency: attention fwd+bwd of query chunks of length q against a fixed
     number of keys, causal pairs per millisecond relative to the best chunk length;
  2. head split (Ulysses): attention with heads/w heads, times w, over all heads;
  3. one decoder layer fwd+bwd (and its attention alone) over document compositions at a fixed
     token count and over token counts: fit t = c1*T + c2*sum(pairs(l)/eff(l)) + c0, with
     pairs(l) = l(l+1)/2 and eff the table of step 1, which is exactly what CostModel predicts;
  4. memory: activation bytes per token from the measured peak (CUDA) or from the bytes autograd
     saves for backward (CPU), plus nominal model states.
Sizes adapt: the longest composition is the largest power of two (up to 32K tokens on CUDA, 4K
on CPU) whose single-document fwd+bwd fits a time budget, so small devices finish quickly.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..attention.kernels import kernel_for
from ..cost import CostModel, HardwareProfile, ModelDims
from ..shard import doc_pairs
from .fit import FitQuality, fit_quality, nonnegative_lstsq
from .layers import DecoderStack, RankWork, load_hf_config
from .shard_attention import SegmentLayout
from .timing import cpu_clock_name, synchronize, time_each

# Nominal links, not measured (a single device cannot measure them).
NOMINAL_LINKS = {
    "cuda": {
        "intra_node": {"bandwidth_gbps": 350.0, "latency_us": 10.0},  # NVLink 4, derated
        "inter_node": {"bandwidth_gbps": 40.0, "latency_us": 25.0},
    },  # 400 Gb/s IB per GPU, derated
    "cpu": {
        "intra_node": {"bandwidth_gbps": 5.0, "latency_us": 50.0},  # gloo over shared memory
        "inter_node": {"bandwidth_gbps": 1.25, "latency_us": 100.0},
    },  # 10 GbE
}
ZERO2_RANKS = 8  # model states are counted as sharded ZeRO-2 over this many ranks (nominal)


class ProfileError(RuntimeError):
    """The measurements cannot give a usable profile (for example a non-positive coefficient)."""


@dataclass
class ProfileSettings:
    device: torch.device
    dtype: torch.dtype
    tokens: int  # token count of the layer compositions
    min_doc: int  # shortest uniform document in the compositions
    chunk_keys: int  # keys each query chunk attends in the chunk-efficiency sweep
    chunk_q_lens: Tuple[int, ...]
    head_split_ways: Tuple[int, ...]
    warmup: int
    repeats: int
    threads: int

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["device"], d["dtype"] = str(self.device), str(self.dtype).replace("torch.", "")
        d["chunk_q_lens"], d["head_split_ways"] = list(self.chunk_q_lens), list(self.head_split_ways)
        return d


@dataclass
class ProfileResult:
    profile: dict  # the HardwareProfile fields, ready for HardwareProfile.from_dict
    layer_rows: List[dict]
    attention_rows: List[dict]
    chunk_rows: List[dict]
    head_split_rows: List[dict]
    memory_rows: List[dict]
    layer_fit: FitQuality
    attention_fit: FitQuality
    settings: ProfileSettings
    machine: str
    wall_s: float
    notes: Dict[str, str] = field(default_factory=dict)

    def hardware_profile(self) -> HardwareProfile:
        return HardwareProfile.from_dict(self.profile, source="measured profile")


# --------------------------------------------------------------------------- sizes
def _pow2_floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def compositions(T: int, min_doc: int, seed: int = 0) -> Dict[str, List[int]]:
    """Document compositions of T tokens, from one document to many short ones, and mixes."""
    comps: Dict[str, List[int]] = {}
    n = T
    while n >= min_doc:
        comps[f"uniform_{n}"] = [n] * (T // n)
        n //= 2
    small = max(min_doc, T // 64)
    comps[f"half+{small}"] = [T // 2] + [small] * ((T - T // 2) // small)
    small = max(min_doc, T // 32)
    comps[f"quarter2+{small}"] = [T // 4] * 2 + [small] * ((T - T // 2) // small)
    rng = random.Random(seed)
    for sigma in (1.0, 1.6):
        lens, rem = [], T
        while rem > 0:
            x = int(min(rem, max(min_doc // 2, rng.lognormvariate(math.log(max(min_doc, T // 24)), sigma))))
            lens.append(x)
            rem -= x
        comps[f"lognormal_s{sigma}"] = lens
    return {k: [n for n in v if n > 0] for k, v in comps.items()}


def series_doc(T: int, min_doc: int) -> int:
    return max(min_doc, T // 16)


def token_series(T: int, min_doc: int) -> Dict[str, List[int]]:
    """Fewer tokens with the same document length: separates c1 from c0."""
    doc = series_doc(T, min_doc)
    return {f"T{t}_uniform_{doc}": [doc] * (t // doc) for t in (T // 8, T // 4, T // 2) if t >= doc}


def choose_settings(
    stack: DecoderStack,
    quick: bool = False,
    max_tokens: Optional[int] = None,
    threads: int = 1,
    log: Callable[[str], None] = print,
) -> ProfileSettings:
    """The longest composition: the largest power of two whose one-document fwd+bwd fits the budget."""
    dev = stack.device
    cuda = dev.type == "cuda"
    if max_tokens:
        top = _pow2_floor(max_tokens)
    elif cuda:
        top = 16384 if quick else 32768
    else:
        top = 1024 if quick else 2048
    budget_ms = (150.0 if quick else 400.0) if cuda else (150.0 if quick else 400.0)
    floor = 256
    T = top
    while True:
        prepared = stack.prepare(RankWork(((0, T),)))
        ms = time_each([lambda prepared=prepared: stack.forward_backward(prepared)], dev, warmup=1, repeats=1)[0]
        del prepared
        log(f"  size probe: one document of {T} tokens, layer fwd+bwd {ms:.1f} ms (budget {budget_ms:.0f} ms)")
        if ms <= budget_ms or T <= floor:
            break
        T //= 2
    # Shorter documents than this are dominated by per-call overheads (kernel launches on CUDA,
    # a kernel call per distinct document length on CPU) that the cost model has no term for.
    min_doc = (128 if T >= 4096 else max(32, T // 32)) if cuda else max(16, min(32, T // 32))
    if quick:
        min_doc = max(min_doc, T // 32)
    chunk_keys = min(T // 2, 4096) if cuda else T // 2
    q_min = 32 if cuda else 8
    q_lens = []
    q = q_min
    while q <= chunk_keys:
        q_lens.append(q)
        q *= 2 if not quick or q >= chunk_keys // 4 else 4
    ways = tuple(w for w in (1, 2, 4, 8) if stack.num_heads % w == 0 and w <= stack.num_heads)
    return ProfileSettings(
        device=dev,
        dtype=stack.dtype,
        tokens=T,
        min_doc=min_doc,
        chunk_keys=chunk_keys,
        chunk_q_lens=tuple(q_lens),
        head_split_ways=ways,
        warmup=(2 if cuda else 1),
        repeats=(5 if cuda else 3),
        threads=threads,
    )


# --------------------------------------------------------------------------- attention-only cases
class AttentionCase:
    """Attention fwd+bwd alone over `segments`, with the given head counts; inputs made up front."""

    def __init__(
        self,
        segments: Sequence[Tuple[int, int]],
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.layout = SegmentLayout(segments, device)
        T = self.layout.tokens
        mk = lambda n, h, g=True: torch.randn(n, h, head_dim, device=device, dtype=dtype, requires_grad=g)
        self.q, self.k, self.v = mk(T, q_heads), mk(T, kv_heads), mk(T, kv_heads)
        P = self.layout.max_start
        self.pk = mk(P, kv_heads, False) if P else None
        self.pv = mk(P, kv_heads, False) if P else None
        self.grad = torch.randn(T, q_heads, head_dim, device=device, dtype=dtype)
        self.scale = 1.0 / math.sqrt(head_dim)

    def __call__(self) -> None:
        for t in (self.q, self.k, self.v):
            t.grad = None
        self.layout.attend(self.q, self.k, self.v, self.pk, self.pv, self.scale).backward(self.grad)


# --------------------------------------------------------------------------- the procedure
def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, host {platform.node()} (torch {torch.__version__})"


def _model_parameters(cfg, dims: ModelDims, per_layer: int) -> int:
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    return dims.num_layers * per_layer + dims.vocab_size * dims.hidden * (1 if tied else 2) + dims.hidden


def _saved_activation_bytes(stack: DecoderStack, prepared) -> int:
    """Bytes autograd keeps for backward in one layer forward (distinct storages, parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in stack.layers.parameters()}
    params.add(prepared.hidden.untyped_storage().data_ptr())  # the layer input is counted per layer already
    seen: Dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = prepared.hidden
        for layer in stack.layers:
            h = layer(h, position_embeddings=prepared.position_embeddings, shard_plan=prepared)
    del h
    return sum(seen.values())


def run_profile(
    model_config,
    device: str = "cpu",
    quick: bool = False,
    max_tokens: Optional[int] = None,
    threads: Optional[int] = None,
    name: Optional[str] = None,
    log: Callable[[str], None] = print,
) -> ProfileResult:
    """Measure one decoder layer of `model_config` on `device` and fit a profile (see the module doc).

    On CPU the torch thread count is set to `threads` (default 1) while measuring and restored after.
    """
    prev_threads = torch.get_num_threads()
    try:
        return _run_profile(model_config, device, quick, max_tokens, threads, name, log)
    finally:
        torch.set_num_threads(prev_threads)


def _run_profile(model_config, device, quick, max_tokens, threads, name, log) -> ProfileResult:
    t_start = time.time()
    load_at_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError("--device cuda: torch sees no CUDA device here; use --device cpu")
    if dev.type not in ("cuda", "cpu"):
        raise ProfileError(f"--device {device}: only cuda and cpu are supported")
    if dev.type == "cpu":
        # one thread by default: an OpenMP team on a shared CPU waits for its slowest thread
        threads = threads or 1
        torch.set_num_threads(threads)
    else:
        threads = threads or torch.get_num_threads()
    cfg = load_hf_config(model_config)
    dims = ModelDims.from_hf_config(cfg.to_dict(), source=str(model_config))
    stack = DecoderStack(model_config, num_layers=1, device=dev)
    H, HKV, D = stack.num_heads, stack.num_kv_heads, stack.head_dim
    log(
        f"hf-cp profile: {model_config} (hidden {dims.hidden}, {H} heads / {HKV} kv, head dim {D}, "
        f"MLP {dims.intermediate}) on {_machine(dev)}, {str(stack.dtype).replace('torch.', '')}"
    )
    st = choose_settings(stack, quick=quick, max_tokens=max_tokens, threads=threads, log=log)
    T = st.tokens
    log(
        f"  compositions of {T} tokens, documents down to {st.min_doc}; query chunks {list(st.chunk_q_lens)} "
        f"against {st.chunk_keys} keys; head split {list(st.head_split_ways)}"
    )
    timing = dict(device=dev, warmup=st.warmup, repeats=st.repeats)

    # 1. query-chunk efficiency: n chunks of q queries, each attending to chunk_keys keys
    LK = st.chunk_keys
    chunk_cases = []
    for q in st.chunk_q_lens:
        n = max(1, (2 * LK) // q)
        chunk_cases.append((q, n, AttentionCase([(LK - q, q)] * n, H, HKV, D, dev, stack.dtype)))
    chunk_ms = time_each([c for _, _, c in chunk_cases], **timing)
    chunk_rows = []
    for (q, n, _), ms in zip(chunk_cases, chunk_ms):
        pairs = n * (q * (LK - q) + q * (q + 1) // 2)
        chunk_rows.append(dict(q_len=q, k_len=LK, chunks=n, ms=ms, pairs_per_ms=pairs / ms))
    del chunk_cases
    best = max(r["pairs_per_ms"] for r in chunk_rows)
    eff_table: Dict[int, float] = {}
    running = 0.0
    for r in chunk_rows:
        r["efficiency_raw"] = r["pairs_per_ms"] / best
        # the cost model needs a table that does not decrease with chunk length
        running = max(running, r["efficiency_raw"])
        eff_table[r["q_len"]] = round(running, 5)
        log(f"  chunk q={r['q_len']:>5} x{r['chunks']:<4} {r['ms']:9.3f} ms  efficiency {r['efficiency_raw']:.3f}")

    # 2. head split: documents of T/2 tokens, attention on heads/w query heads
    hs_cases = []
    for w in st.head_split_ways:
        kv_after = HKV if HKV >= w else w
        hs_cases.append((w, AttentionCase([(0, T // 2)] * 2, H // w, kv_after // w, D, dev, stack.dtype)))
    hs_ms = time_each([c for _, c in hs_cases], **timing)
    del hs_cases
    head_split_rows, head_split = [], {}
    for w, ms in zip(st.head_split_ways, hs_ms):
        factor = ms * w / hs_ms[0]
        head_split_rows.append(dict(ways=w, heads=H // w, ms=ms, factor_raw=factor))
        head_split[w] = round(max(1.0, factor), 5)  # splitting heads never makes the work smaller
        log(f"  head split {w}: {H // w} heads {ms:9.3f} ms, x{w} / all heads = {factor:.3f}")

    # 3. the layer (and its attention alone) over compositions and token counts
    comps = {**compositions(T, st.min_doc), **token_series(T, st.min_doc)}
    prepared = {k: stack.prepare(RankWork(tuple((0, n) for n in lens))) for k, lens in comps.items()}
    layer_fns = [(lambda p=p: stack.forward_backward(p)) for p in prepared.values()]
    layer_ms = time_each(layer_fns, **timing)
    one_layer = dataclasses.replace(dims, num_layers=1, vocab_size=0)
    shape_model = CostModel(
        one_layer,
        HardwareProfile.from_dict(
            {
                "c1_ms_per_token": 1.0,
                "c2_ms_per_pair": 1.0,
                "c0_ms": 0.0,
                "fitted_dims": cfg.to_dict(),
                "chunk_efficiency": eff_table,
                "activation_bytes_per_token": 1.0,
                "static_bytes": 0.0,
                "bytes_per_element": 1,
                "gpus_per_node": 1,
                "links": NOMINAL_LINKS[dev.type],
            },
            source="efficiency table",
        ),
    )

    def attention_units(lens):  # sum of pairs / efficiency; c2 is the slope on this
        return sum(doc_pairs(n) / shape_model.chunk_efficiency(n) for n in lens)

    names = list(comps)
    X = [[sum(comps[k]), attention_units(comps[k]), 1.0] for k in names]
    c1, c2, c0 = nonnegative_lstsq(X, layer_ms)
    retimed = 0
    if dev.type == "cpu":
        # Outside load only ever inflates a CPU time, and the minimum over more rounds converges to
        # the unloaded time: re-time the runs the fit disagrees with most, keep the faster time.
        for _ in range(3):
            rel = [abs(c1 * x[0] + c2 * x[1] + c0 - ms) / ms for x, ms in zip(X, layer_ms)]
            worst = [i for i in sorted(range(len(rel)), key=lambda i: -rel[i]) if rel[i] > 0.1][:8]
            if not worst:
                break
            again = time_each([layer_fns[i] for i in worst], dev, warmup=0, repeats=st.repeats)
            for i, ms in zip(worst, again):
                layer_ms[i] = min(layer_ms[i], ms)
            retimed += len(worst)
            c1, c2, c0 = nonnegative_lstsq(X, layer_ms)
    del layer_fns
    att_cases = {
        k: AttentionCase([(0, n) for n in lens], H, HKV, D, dev, stack.dtype)
        for k, lens in comps.items()
        if sum(lens) == T
    }
    att_ms = dict(zip(att_cases, time_each(list(att_cases.values()), **timing)))
    del att_cases

    # 4. memory per token of one layer: peak (CUDA) or saved-for-backward bytes (CPU), over T
    mem_rows = []
    full = f"uniform_{series_doc(T, st.min_doc)}"
    for k in [k for k in token_series(T, st.min_doc)] + ([full] if full in comps else []):
        p = prepared[k]
        if dev.type == "cuda":
            synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            stack.forward_backward(p)
            synchronize(dev)
            b = torch.cuda.max_memory_allocated(dev) - base
        else:
            b = _saved_activation_bytes(stack, p)
        mem_rows.append(dict(name=k, tokens=p.work.tokens, bytes=int(b)))
    del prepared
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    (slope, _), *_ = np.linalg.lstsq(
        np.array([[r["tokens"], 1.0] for r in mem_rows]),
        np.array([r["bytes"] for r in mem_rows], dtype=np.float64),
        rcond=None,
    )
    layer_bytes_per_token = max(0.0, float(slope))

    # 5. fit with exactly the cost model's formula
    bpe = torch.finfo(stack.dtype).bits // 8
    profile = {
        "name": name or f"{dev.type}-{dims.hidden}h",
        "description": "",
        "c1_ms_per_token": 1.0,
        "c2_ms_per_pair": 1.0,
        "c0_ms": 0.0,  # replaced below
        "fitted_dims": {
            "num_hidden_layers": dims.num_layers,
            "hidden_size": dims.hidden,
            "num_attention_heads": dims.num_heads,
            "num_key_value_heads": dims.num_kv_heads,
            "head_dim": dims.head_dim,
            "intermediate_size": dims.intermediate,
            "vocab_size": dims.vocab_size,
        },
        "chunk_efficiency": eff_table,
        "head_split_factor": head_split,
        "activation_bytes_per_token": 1.0,
        "static_bytes": 0.0,
        "bytes_per_element": bpe,
        "gpus_per_node": 8,
        "links": NOMINAL_LINKS[dev.type],
    }
    if c1 <= 0 or c2 <= 0:
        raise ProfileError(
            f"the layer fit gave c1={c1:.3g}, c2={c2:.3g} ms: the measurements do not separate "
            f"linear from attention work (too noisy or too small); rerun, or raise --max-tokens"
        )
    profile.update(c1_ms_per_token=c1, c2_ms_per_pair=c2, c0_ms=c0)
    profile["activation_bytes_per_token"] = float(round(dims.num_layers * dims.hidden * bpe + layer_bytes_per_token))
    n_params = _model_parameters(cfg, dims, stack.parameters_per_layer)
    profile["static_bytes"] = float(round(n_params * (2 * bpe + (12 if bpe == 2 else 8) / ZERO2_RANKS)))
    cost = CostModel(one_layer, HardwareProfile.from_dict(profile, source="measured profile"))
    pred = [cost.c0 + cost.local_ms(comps[k]) for k in names]
    layer_fit = fit_quality(layer_ms, pred)
    layer_rows = [
        dict(
            name=k,
            tokens=sum(comps[k]),
            docs=len(comps[k]),
            pairs=sum(doc_pairs(n) for n in comps[k]),
            ms=ms,
            predicted_ms=p,
        )
        for k, ms, p in zip(names, layer_ms, pred)
    ]
    for r in layer_rows:
        log(
            f"  layer {r['name']:<22} T={r['tokens']:>6} docs={r['docs']:>4} {r['ms']:9.3f} ms  "
            f"predicted {r['predicted_ms']:9.3f} ({100 * (r['predicted_ms'] / r['ms'] - 1):+5.1f}%)"
        )
    anames = list(att_ms)
    (a, b) = nonnegative_lstsq([[attention_units(comps[k]), 1.0] for k in anames], [att_ms[k] for k in anames])
    att_pred = [a * attention_units(comps[k]) + b for k in anames]
    attention_fit = fit_quality([att_ms[k] for k in anames], att_pred)
    attention_rows = [dict(name=k, docs=len(comps[k]), ms=att_ms[k], predicted_ms=p) for k, p in zip(anames, att_pred)]
    log(
        f"  attention alone: t = {a:.4g} ms * sum(pairs/eff) + {b:.4g} ms  R^2 {attention_fit.r2:.4f}, "
        f"max rel err {attention_fit.max_rel_err:.3f}"
    )
    log(
        f"  layer fit: c1 {c1:.4g} ms/token, c2 {c2:.4g} ms/pair, c0 {c0:.4g} ms  R^2 {layer_fit.r2:.4f}, "
        f"max rel err {layer_fit.max_rel_err:.3f} over {len(names)} runs; c1/c2 = {c1 / c2:.0f} tokens"
    )
    machine = _machine(dev)
    profile["description"] = (
        f"{machine}, {str(stack.dtype).replace('torch.', '')}, {threads} thread(s); "
        f"one {type(stack.layers[0]).__name__} fwd+bwd of {model_config}; "
        f"layer fit R^2 {layer_fit.r2:.4f}"
    )
    HardwareProfile.from_dict(profile, source="measured profile")  # what the planner will load
    return ProfileResult(
        profile=profile,
        layer_rows=layer_rows,
        attention_rows=attention_rows,
        chunk_rows=chunk_rows,
        head_split_rows=head_split_rows,
        memory_rows=mem_rows,
        layer_fit=layer_fit,
        attention_fit=attention_fit,
        settings=st,
        machine=machine,
        wall_s=time.time() - t_start,
        notes={
            "layer_bytes_per_token": f"{layer_bytes_per_token:.0f}",
            "model_parameters": str(n_params),
            "attention_fit": f"t = {a:.6g} * sum(pairs/eff) + {b:.6g}",
            "layer_class": type(stack.layers[0]).__name__,
            "retimed": str(retimed),
            "kernel": kernel_for(dev).name,
            "clock": cpu_clock_name(),
            "load": f"1-minute load average {load_at_start:.1f} at start on {os.cpu_count()} cores "
            f"(other processes share the caches and memory bandwidth)",
        },
    )
