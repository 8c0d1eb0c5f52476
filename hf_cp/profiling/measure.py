"""`hf-cp profile`: measure one decoder layer on this device and fit the cost model.

The method behind benchmarks/calibration/h200-qwen2.5-7b-dims.json (the project's H200 measurements), on the model's own layer classes:
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

from hf_cp.attention.kernels import kernel_for
from hf_cp.cost.dims import SOFTMAX_LAYER_TYPES, ModelDims
from hf_cp.cost.fit import FitQuality, fit_quality, nonnegative_lstsq
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.cost.model import CostModel
from hf_cp.modes.segments import doc_pairs
from hf_cp.profiling.engine_reduction import EngineReduction
from hf_cp.profiling.layers import DecoderStack, RankWork, load_hf_config
from hf_cp.profiling.shard_attention import SegmentLayout
from hf_cp.profiling.timing import cpu_clock_name, synchronize, time_each

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
    engine_reduction: Optional[EngineReduction] = None  # measured with `hf-cp profile --deepspeed`

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
    """The procedure of the module doc, stage by stage: settings, timing runs (each with the table
    it yields), the fits, and the profile with its report rows."""
    t_start = time.time()
    load_at_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    # settings
    dev, threads = _device_and_threads(device, threads)
    cfg, dims, stack = _load_layer(model_config, dev, log)
    st = choose_settings(stack, quick=quick, max_tokens=max_tokens, threads=threads, log=log)
    log(
        f"  compositions of {st.tokens} tokens, documents down to {st.min_doc}; query chunks {list(st.chunk_q_lens)} "
        f"against {st.chunk_keys} keys; head split {list(st.head_split_ways)}"
    )
    # timing runs, in this order (time_each's call order is part of what a run measures)
    chunk_rows, eff_table = _measure_chunk_efficiency(stack, st, log)
    head_split_rows, head_split = _measure_head_split(stack, st, log)
    one_layer = dims.with_layers(1, vocab_size=0)
    attention_units = _attention_units(one_layer, cfg, eff_table, dev)
    comps = {**compositions(st.tokens, st.min_doc), **token_series(st.tokens, st.min_doc)}
    prepared = {k: stack.prepare(RankWork(tuple((0, n) for n in lens))) for k, lens in comps.items()}
    layer = _time_layer(stack, st, comps, prepared, attention_units)
    att_ms = _time_attention_alone(stack, st, comps)
    mem_rows, layer_bytes_per_token = _measure_activation_memory(stack, st, comps, prepared)
    del prepared
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    _, linear_kind = layer_kinds(cfg, str(model_config))
    linear_rows = _time_linear_layer(model_config, dev, st, linear_kind, log) if linear_kind else None
    # fits and the profile
    profile, n_params = _assemble_profile(
        name, dev, dims, cfg, stack, eff_table, head_split, layer, layer_bytes_per_token
    )
    if linear_rows is not None:
        profile["linear_layer_ms_per_token"] = linear_rows[0]
        notes_linear = {"linear_layer_class": linear_rows[2]}
    else:
        notes_linear = {}
    layer_rows, layer_fit = _layer_report(one_layer, profile, comps, layer, log)
    attention_rows, attention_fit, att_model = _fit_attention_alone(comps, att_ms, attention_units, log)
    c1, c2, c0 = layer.coefficients
    log(
        f"  layer fit: c1 {c1:.4g} ms/token, c2 {c2:.4g} ms/pair, c0 {c0:.4g} ms  R^2 {layer_fit.r2:.4f}, "
        f"max rel err {layer_fit.max_rel_err:.3f} over {len(layer.names)} runs; c1/c2 = {c1 / c2:.0f} tokens"
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
            "attention_fit": att_model,
            "layer_class": type(stack.layers[0]).__name__,
            **notes_linear,
            "retimed": str(layer.retimed),
            "kernel": kernel_for(dev, dtype=stack.dtype).name,
            "clock": cpu_clock_name(),
            "load": f"1-minute load average {load_at_start:.1f} at start on {os.cpu_count()} cores "
            f"(other processes share the caches and memory bandwidth)",
        },
    )


# --------------------------------------------------------------------------- settings
def _device_and_threads(device: str, threads: Optional[int]) -> Tuple[torch.device, int]:
    """The checked device and the thread count measured with. On CPU the count (default 1) is set
    here; run_profile restores the caller's afterwards."""
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
    return dev, threads


def layer_kinds(cfg, source: str) -> Tuple[Optional[str], Optional[str]]:
    """(the softmax layer kind, the linear-time layer kind) of a hybrid's `layer_types` (None, None
    for a model of one kind). A hybrid that states its layers otherwise (Bamba's
    attn_layer_indices, Jamba's period) is refused: its first layer may be either kind."""
    dims = ModelDims.from_hf_config(cfg.to_dict(), source=source)
    if not dims.linear_layers:
        return None, None
    # the config's own layer_types: some families (Bamba) derive a read-only one from other fields
    types = list(cfg.to_dict().get("layer_types") or ())
    softmax = next((t for t in types if t in SOFTMAX_LAYER_TYPES), None)
    linear = next((t for t in types if t not in SOFTMAX_LAYER_TYPES), None)
    if softmax is None or linear is None:
        raise ProfileError(
            f"{source}: hf-cp profile measures a hybrid's softmax and linear-time layers apart, by the kinds its "
            f"config's layer_types names (Qwen3-Next, Qwen3.5, LFM2); this {cfg.model_type} config has "
            f"{dims.softmax_layers} softmax layers of {dims.num_layers} but layer_types {types or None}: profile a "
            "model of one kind of layer with its dimensions instead"
        )
    return softmax, linear


def _load_layer(model_config, dev: torch.device, log: Callable[[str], None]):
    """(transformers config, ModelDims, a DecoderStack of one layer with random weights on dev:
    a softmax attention layer, also for a hybrid)."""
    cfg = load_hf_config(model_config)
    dims = ModelDims.from_hf_config(cfg.to_dict(), source=str(model_config))
    softmax, _ = layer_kinds(cfg, str(model_config))
    stack = DecoderStack(model_config, num_layers=1, device=dev, layer_type=softmax)
    log(
        f"hf-cp profile: {model_config} (hidden {dims.hidden}, {stack.num_heads} heads / {stack.num_kv_heads} kv, "
        f"head dim {stack.head_dim}, MLP {dims.intermediate}) on {_machine(dev)}, "
        f"{str(stack.dtype).replace('torch.', '')}"
    )
    return cfg, dims, stack


def _timing(st: ProfileSettings) -> dict:
    """time_each's settings for the timed steps."""
    return dict(device=st.device, warmup=st.warmup, repeats=st.repeats)


# --------------------------------------------------------------------------- timing runs
def _measure_chunk_efficiency(
    stack: DecoderStack, st: ProfileSettings, log: Callable[[str], None]
) -> Tuple[List[dict], Dict[int, float]]:
    """Step 1: n chunks of q queries, each attending to chunk_keys keys, for each q. Returns the
    rows and the efficiency table: causal pairs per ms relative to the best q, made
    non-decreasing in q (the cost model needs a table that does not decrease with chunk length)."""
    H, HKV, D, LK = stack.num_heads, stack.num_kv_heads, stack.head_dim, st.chunk_keys
    cases = []
    for q in st.chunk_q_lens:
        n = max(1, (2 * LK) // q)
        cases.append((q, n, AttentionCase([(LK - q, q)] * n, H, HKV, D, st.device, stack.dtype)))
    chunk_ms = time_each([c for _, _, c in cases], **_timing(st))
    rows = []
    for (q, n, _), ms in zip(cases, chunk_ms):
        pairs = n * (q * (LK - q) + q * (q + 1) // 2)
        rows.append(dict(q_len=q, k_len=LK, chunks=n, ms=ms, pairs_per_ms=pairs / ms))
    del cases
    best = max(r["pairs_per_ms"] for r in rows)
    table: Dict[int, float] = {}
    running = 0.0
    for r in rows:
        r["efficiency_raw"] = r["pairs_per_ms"] / best
        running = max(running, r["efficiency_raw"])
        table[r["q_len"]] = round(running, 5)
        log(f"  chunk q={r['q_len']:>5} x{r['chunks']:<4} {r['ms']:9.3f} ms  efficiency {r['efficiency_raw']:.3f}")
    return rows, table


def _measure_head_split(
    stack: DecoderStack, st: ProfileSettings, log: Callable[[str], None]
) -> Tuple[List[dict], Dict[int, float]]:
    """Step 2 (Ulysses): two documents of T/2 tokens on heads/w query heads, for each w. Returns the
    rows and the factors: time x w over the time on all heads, at least 1 (splitting heads never
    makes the work smaller)."""
    H, HKV, D, T = stack.num_heads, stack.num_kv_heads, stack.head_dim, st.tokens
    cases = []
    for w in st.head_split_ways:
        kv_after = HKV if HKV >= w else w
        cases.append(AttentionCase([(0, T // 2)] * 2, H // w, kv_after // w, D, st.device, stack.dtype))
    hs_ms = time_each(cases, **_timing(st))
    del cases
    rows, factors = [], {}
    for w, ms in zip(st.head_split_ways, hs_ms):
        factor = ms * w / hs_ms[0]
        rows.append(dict(ways=w, heads=H // w, ms=ms, factor_raw=factor))
        factors[w] = round(max(1.0, factor), 5)
        log(f"  head split {w}: {H // w} heads {ms:9.3f} ms, x{w} / all heads = {factor:.3f}")
    return rows, factors


def _attention_units(
    one_layer: ModelDims, cfg, eff_table: Dict[int, float], dev: torch.device
) -> Callable[[Sequence[int]], float]:
    """lens -> sum over documents of pairs / efficiency, the quantity c2 multiplies, through the
    cost model's own efficiency interpolation (a CostModel with unit coefficients)."""
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
    return lambda lens: sum(doc_pairs(n) / shape_model.chunk_efficiency(n) for n in lens)


@dataclass
class LayerTimes:
    """Step 3's layer timings: one row per composition, with the layer fit they give."""

    names: List[str]  # composition names, in timing order
    features: List[List[float]]  # [tokens, attention units, 1] per composition
    ms: List[float]
    coefficients: Tuple[float, float, float]  # c1, c2, c0 fitted to ms
    retimed: int  # runs timed again (CPU) because the fit disagreed with them


def _time_layer(
    stack: DecoderStack,
    st: ProfileSettings,
    comps: Dict[str, List[int]],
    prepared: dict,
    attention_units: Callable[[Sequence[int]], float],
) -> LayerTimes:
    """Step 3: one decoder layer fwd+bwd over every composition, and the non-negative fit of
    t = c1*T + c2*units + c0. On CPU the runs the fit disagrees with most are timed again."""
    layer_fns = [(lambda p=p: stack.forward_backward(p)) for p in prepared.values()]
    layer_ms = time_each(layer_fns, **_timing(st))
    names = list(comps)
    X = [[sum(comps[k]), attention_units(comps[k]), 1.0] for k in names]
    c1, c2, c0 = nonnegative_lstsq(X, layer_ms)
    retimed = 0
    if st.device.type == "cpu":
        # Outside load only ever inflates a CPU time, and the minimum over more rounds converges to
        # the unloaded time: re-time the runs the fit disagrees with most, keep the faster time.
        for _ in range(3):
            rel = [abs(c1 * x[0] + c2 * x[1] + c0 - ms) / ms for x, ms in zip(X, layer_ms)]
            worst = [i for i in sorted(range(len(rel)), key=lambda i: -rel[i]) if rel[i] > 0.1][:8]
            if not worst:
                break
            again = time_each([layer_fns[i] for i in worst], st.device, warmup=0, repeats=st.repeats)
            for i, ms in zip(worst, again):
                layer_ms[i] = min(layer_ms[i], ms)
            retimed += len(worst)
            c1, c2, c0 = nonnegative_lstsq(X, layer_ms)
    return LayerTimes(names=names, features=X, ms=layer_ms, coefficients=(c1, c2, c0), retimed=retimed)


def _time_linear_layer(
    model_config, dev: torch.device, st: ProfileSettings, kind: str, log: Callable[[str], None]
) -> Tuple[float, float, str]:
    """A hybrid's linear-time layer (`kind` of its layer_types) fwd+bwd on one document of 1/8,
    1/4, 1/2 and all of the run's tokens (its mixer restarts at every document, so one document
    is its per-token cost), and the non-negative fit t = c*T + c0: (c ms per token, c0 ms, the
    decoder layer's class)."""
    stack = DecoderStack(model_config, num_layers=1, device=dev, layer_type=kind)
    counts = sorted({max(1, st.tokens // k) for k in (8, 4, 2, 1)})
    prepared = [stack.prepare(RankWork(((0, n),))) for n in counts]
    ms = time_each([(lambda p=p: stack.forward_backward(p)) for p in prepared], **_timing(st))
    c, c0 = nonnegative_lstsq([[float(n), 1.0] for n in counts], ms)
    if c <= 0:
        raise ProfileError(f"the {kind} layer's fit gave {c:.3g} ms per token over {counts} tokens: rerun")
    log(
        f"  {kind} layer ({type(stack.layers[0]).__name__}): {c:.4g} ms/token + {c0:.4g} ms over one document of "
        + ", ".join(f"{n} ({t:.1f} ms)" for n, t in zip(counts, ms))
    )
    return c, c0, type(stack.layers[0]).__name__


def _time_attention_alone(stack: DecoderStack, st: ProfileSettings, comps: Dict[str, List[int]]) -> Dict[str, float]:
    """Step 3, attention alone: fwd+bwd over the compositions of the full token count (name -> ms)."""
    cases = {
        k: AttentionCase(
            [(0, n) for n in lens], stack.num_heads, stack.num_kv_heads, stack.head_dim, st.device, stack.dtype
        )
        for k, lens in comps.items()
        if sum(lens) == st.tokens
    }
    return dict(zip(cases, time_each(list(cases.values()), **_timing(st))))


def _measure_activation_memory(
    stack: DecoderStack, st: ProfileSettings, comps: Dict[str, List[int]], prepared: dict
) -> Tuple[List[dict], float]:
    """Step 4: one layer's activation memory over the token series (and the full-length uniform
    composition): peak allocation on CUDA, bytes saved for backward on CPU. Returns the rows and
    their slope in bytes per token (at least 0)."""
    rows = []
    full = f"uniform_{series_doc(st.tokens, st.min_doc)}"
    for k in [k for k in token_series(st.tokens, st.min_doc)] + ([full] if full in comps else []):
        p = prepared[k]
        if st.device.type == "cuda":
            synchronize(st.device)
            torch.cuda.reset_peak_memory_stats(st.device)
            base = torch.cuda.memory_allocated(st.device)
            stack.forward_backward(p)
            synchronize(st.device)
            b = torch.cuda.max_memory_allocated(st.device) - base
        else:
            b = _saved_activation_bytes(stack, p)
        rows.append(dict(name=k, tokens=p.work.tokens, bytes=int(b)))
    (slope, _), *_ = np.linalg.lstsq(
        np.array([[r["tokens"], 1.0] for r in rows]),
        np.array([r["bytes"] for r in rows], dtype=np.float64),
        rcond=None,
    )
    return rows, max(0.0, float(slope))


# --------------------------------------------------------------------------- fits and the profile
def _assemble_profile(
    name: Optional[str],
    dev: torch.device,
    dims: ModelDims,
    cfg,
    stack: DecoderStack,
    eff_table: Dict[int, float],
    head_split: Dict[int, float],
    layer: LayerTimes,
    layer_bytes_per_token: float,
) -> Tuple[dict, int]:
    """The fit's result: the HardwareProfile fields (description left empty) and the model's parameter
    count. Raises ProfileError when the layer fit cannot separate linear from attention work."""
    c1, c2, c0 = layer.coefficients
    if c1 <= 0 or c2 <= 0:
        raise ProfileError(
            f"the layer fit gave c1={c1:.3g}, c2={c2:.3g} ms: the measurements do not separate "
            f"linear from attention work (too noisy or too small); rerun, or raise --max-tokens"
        )
    bpe = torch.finfo(stack.dtype).bits // 8
    n_params = _model_parameters(cfg, dims, stack.parameters_per_layer)
    profile = {
        "name": name or f"{dev.type}-{dims.hidden}h",
        "description": "",
        "c1_ms_per_token": c1,
        "c2_ms_per_pair": c2,
        "c0_ms": c0,
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
        # checkpointed layer inputs of every layer, plus one layer's recompute working set
        "activation_bytes_per_token": float(round(dims.num_layers * dims.hidden * bpe + layer_bytes_per_token)),
        # ZeRO-2 model states: parameters and gradients whole, optimizer states sharded
        "static_bytes": float(round(n_params * (2 * bpe + (12 if bpe == 2 else 8) / ZERO2_RANKS))),
        "bytes_per_element": bpe,
        "gpus_per_node": 8,
        "links": NOMINAL_LINKS[dev.type],
    }
    return profile, n_params


def _layer_report(
    one_layer: ModelDims, profile: dict, comps: Dict[str, List[int]], layer: LayerTimes, log: Callable[[str], None]
) -> Tuple[List[dict], FitQuality]:
    """The fit's check: each composition's measured time beside the planner's own CostModel prediction
    from the fitted profile, and the fit quality over them."""
    cost = CostModel(one_layer, HardwareProfile.from_dict(profile, source="measured profile"))
    pred = [cost.c0 + cost.local_ms(comps[k]) for k in layer.names]
    rows = [
        dict(
            name=k,
            tokens=sum(comps[k]),
            docs=len(comps[k]),
            pairs=sum(doc_pairs(n) for n in comps[k]),
            ms=ms,
            predicted_ms=p,
        )
        for k, ms, p in zip(layer.names, layer.ms, pred)
    ]
    for r in rows:
        log(
            f"  layer {r['name']:<22} T={r['tokens']:>6} docs={r['docs']:>4} {r['ms']:9.3f} ms  "
            f"predicted {r['predicted_ms']:9.3f} ({100 * (r['predicted_ms'] / r['ms'] - 1):+5.1f}%)"
        )
    return rows, fit_quality(layer.ms, pred)


def _fit_attention_alone(
    comps: Dict[str, List[int]],
    att_ms: Dict[str, float],
    attention_units: Callable[[Sequence[int]], float],
    log: Callable[[str], None],
) -> Tuple[List[dict], FitQuality, str]:
    """Attention alone fitted as t = a*units + b (a check on the efficiency table; the
    profile does not use it). Returns the rows, the fit quality and the fitted formula."""
    names = list(att_ms)
    a, b = nonnegative_lstsq([[attention_units(comps[k]), 1.0] for k in names], [att_ms[k] for k in names])
    pred = [a * attention_units(comps[k]) + b for k in names]
    quality = fit_quality([att_ms[k] for k in names], pred)
    rows = [dict(name=k, docs=len(comps[k]), ms=att_ms[k], predicted_ms=p) for k, p in zip(names, pred)]
    log(
        f"  attention alone: t = {a:.4g} ms * sum(pairs/eff) + {b:.4g} ms  R^2 {quality.r2:.4f}, "
        f"max rel err {quality.max_rel_err:.3f}"
    )
    return rows, quality, f"t = {a:.6g} * sum(pairs/eff) + {b:.6g}"
