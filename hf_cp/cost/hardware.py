"""A hardware profile: the fitted compute coefficients of one device, its memory, its links
(bandwidth and latency within and across nodes) and the time to move bytes over one
(transfer_ms), read from a profile YAML file and checked field by field. Torch-free.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Mapping, Optional, Tuple, Union

from hf_cp.cost.config_files import ConfigError, read_yaml_mapping, resolve_config
from hf_cp.cost.dims import ModelDims
from hf_cp.readers import brief

# The largest value of each number of a profile, with its unit: orders of magnitude above what
# any device measures (an H200: c1 ~1e-4 ms, alpha ~1e5 B, 141 GB, 450 GB/s), so that a number
# past it is a typo or a fuzz (1e308 made `hf-cp plan` print inf and nan), refused by name
# (forward_share and chunk_efficiency have their own ranges, within (0, 1]).
PROFILE_MAXIMA: Mapping[str, Tuple[float, str]] = {
    "c1_ms_per_token": (1e3, "ms per token and layer"),
    "c2_ms_per_pair": (1e3, "ms per causal pair and layer"),
    "c0_ms": (1e6, "ms per layer and micro-batch"),
    "linear_layer_ms_per_token": (1e3, "ms per token and linear-time layer"),
    "activation_bytes_per_token": (1e12, "bytes per token"),
    "static_bytes": (1e18, "bytes"),
    "bytes_per_element": (16, "bytes"),
    "gpus_per_node": (4096, "ranks"),
    "bandwidth_gbps": (1e6, "GB/s"),
    "latency_us": (1e9, "microseconds"),
    "reduction_overhead_ms": (1e6, "ms"),
    "step_overhead_ms": (1e6, "ms"),
    "engine_reduction_ms_per_gb": (1e9, "ms per GB of gradients"),
    "cp_attention_scale": (1e3, "a factor"),
    "cp_message_ms": (1e6, "ms"),
    "device_memory_gb": (1e9, "GB"),
    "head_split_factor": (1e3, "a factor"),
}
MAX_PROFILE_TABLE_KEY = 2**40  # a chunk_efficiency chunk length, a head_split_factor way count


def _profile_key(field: str) -> str:
    """The PROFILE_MAXIMA key of a field path: links.intra_node.latency_us -> latency_us,
    chunk_efficiency.8 -> chunk_efficiency."""
    parts = field.split(".")
    return parts[-1] if parts[0] == "links" else parts[0]


# Units of a link: bandwidth in GB/s is bytes per millisecond x 1e6 (1e9 bytes / 1e3 ms), and
# latency in microseconds is milliseconds x 1e-3.
BYTES_PER_MS_PER_GBPS = 1e6
MS_PER_US = 1e-3


@dataclass(frozen=True)
class Link:
    bandwidth_gbps: float  # GB/s per rank, one direction
    latency_us: float


def transfer_ms(nbytes, link: Link, messages=1):
    """Milliseconds to move `nbytes` over `link` in `messages` messages: the bytes at the link's
    bandwidth plus one latency per message (messages=0: the bytes alone). `nbytes` may be a numpy
    array (one time per entry)."""
    return nbytes / (link.bandwidth_gbps * BYTES_PER_MS_PER_GBPS) + messages * link.latency_us * MS_PER_US


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    c1_ms_per_token: float  # one decoder layer fwd+bwd, per token
    c2_ms_per_pair: float  # one decoder layer fwd+bwd, per causal query-key pair
    c0_ms: float  # per layer and micro-batch (kernel launches, fixed overheads)
    fitted_dims: ModelDims  # the dimensions c1, c2 were measured with
    chunk_efficiency: Tuple[Tuple[int, float], ...]  # (query-chunk length, efficiency in (0, 1])
    head_split_factor: Tuple[Tuple[int, float], ...]  # (ways, attention time multiplier)
    activation_bytes_per_token: float  # alpha, whole model
    static_bytes: float  # beta
    bytes_per_element: int
    gpus_per_node: int
    links: Mapping[str, Link]
    description: str = ""
    # share of fwd+bwd time that is the forward alone (what a recomputed forward costs);
    # 1/3 (backward twice the forward) unless the profile measured it
    forward_share: float = 1.0 / 3.0
    # Wall clock beyond compute (hf_cp/execution.py), used only when the cost model is given an
    # execution; 0 by default, so that plain compute comparisons keep their numbers. Online
    # calibration (hf_cp/planning/calibration.py) fits them to a run's measured step times.
    reduction_overhead_ms: float = 0.0  # per gradient reduction, beyond its bytes over the link
    step_overhead_ms: float = 0.0  # per optimizer step (optimizer update, plan agreement, bookkeeping)
    # per GB of gradients, per data-parallel gradient reduction (ZeRO-2, DDP), beyond the bytes over
    # the link: the training engine's own work around the collective (DeepSpeed's bucket copies,
    # averaging, partition bookkeeping), which grows with the model, not with the step. Measured by
    # `hf-cp profile --deepspeed CONFIG` (profiling/engine_reduction.py); 0: not measured. On 2 CPU
    # ranks under ZeRO-2 (gloo, fp32) it is about 100x the link's own time for the same bytes.
    engine_reduction_ms_per_gb: float = 0.0
    # attention of a micro-batch whose documents are distributed over a CP group, relative to the
    # same attention run alone (1: as the per-rank kernels predict)
    cp_attention_scale: float = 1.0
    # per layer and message of a CP group's attention exchange (the shard mode's comm_messages):
    # the members' rendezvous and the work around each step (ring merges, per-step buffers), which
    # compute does not hide; 0 (default): messages cost only their link's latency, hidden behind
    # attention. Measured on 2 CPU ranks (gloo, tiny Llama): 2.9 ms, 17 ms per ring micro-batch.
    cp_message_ms: float = 0.0
    device: str = ""  # the device type it was measured on ("cuda", "cpu"; "" unknown)
    # memory of one device in GB (1e9 bytes; 0 unknown): what `hf-cp plan` and the dry run fit the
    # largest model into under each engine
    device_memory_gb: float = 0.0
    # a hybrid's linear-time layer (Gated DeltaNet, Mamba, a short convolution) fwd+bwd per token at
    # fitted_dims, measured by `hf-cp profile` on a hybrid (0: not measured, priced as c1: a softmax
    # layer's per-token part)
    linear_layer_ms_per_token: float = 0.0

    @classmethod
    def from_dict(cls, d: Mapping, source: str = "profile") -> HardwareProfile:
        """Build and check a profile: every key known (else the nearest known key is named), every
        number finite and in its range; each message names `source` (the file) and the field."""
        known = {f.name for f in fields(cls)} | {"calibration"}  # calibration: how it was made, free text
        for k in d:
            if k not in known:
                near = difflib.get_close_matches(str(k), sorted(known), n=1)
                hint = f"; did you mean {near[0]!r}?" if near else f"; known fields: {', '.join(sorted(known))}"
                raise ConfigError(f"{source}: unknown field {k!r}{hint}")

        def number(field: str, v, typ=float, limit: Optional[Tuple[float, str]] = None) -> float:
            """`v` as a finite `typ` of at most its field's PROFILE_MAXIMA (or `limit`)."""
            if isinstance(v, bool) or v is None:
                raise ConfigError(f"{source}: field {field!r} must be {typ.__name__}, got {brief(v)}")
            try:
                x = float(v)
            except (TypeError, ValueError, OverflowError):  # OverflowError: an integer beyond any float
                raise ConfigError(f"{source}: field {field!r} must be {typ.__name__}, got {brief(v)}") from None
            if not math.isfinite(x):
                raise ConfigError(f"{source}: field {field!r} must be a finite number, got {brief(v)}")
            hi, unit = limit or PROFILE_MAXIMA.get(_profile_key(field), (None, ""))
            if hi is not None and x > hi:
                raise ConfigError(
                    f"{source}: field {field!r} must be at most {hi:g} ({unit}), got {brief(v)}: beyond what any "
                    "hardware measures (a number that large overflows the cost model's sums to inf)"
                )
            if typ is int:
                if not x.is_integer() or (isinstance(v, str) and not v.strip().lstrip("+-").isdigit()):
                    raise ConfigError(f"{source}: field {field!r} must be a whole number, got {brief(v)}")
                return int(x)
            return x

        def need(k, typ=float):
            if k not in d:
                raise ConfigError(f"{source}: missing field {k!r}")
            if typ is dict:
                if not isinstance(d[k], Mapping):
                    raise ConfigError(f"{source}: field {k!r} must be a mapping, got {d[k]!r}")
                return dict(d[k])
            return number(k, d[k], typ)

        def table(k, default) -> Tuple[Tuple[int, float], ...]:
            t = d.get(k)
            if t is None:
                t = default
            if not isinstance(t, Mapping):
                raise ConfigError(f"{source}: field {k!r} must be a mapping of integer keys to numbers, got {t!r}")
            return tuple(
                sorted(
                    (int(number(f"{k}.{q}", q, int, (MAX_PROFILE_TABLE_KEY, "tokens or ways"))), number(f"{k}.{q}", e))
                    for q, e in t.items()
                )
            )

        eff = table("chunk_efficiency", {})
        hs = table("head_split_factor", {1: 1.0})
        links = {}
        for name, v in need("links", dict).items():
            if name not in ("intra_node", "inter_node"):
                near = difflib.get_close_matches(str(name), ["intra_node", "inter_node"], n=1)
                raise ConfigError(
                    f"{source}: unknown link links.{name}"
                    + (f"; did you mean {near[0]!r}?" if near else "")
                    + " (links are intra_node and inter_node)"
                )
            if not isinstance(v, Mapping) or set(v) != {"bandwidth_gbps", "latency_us"}:
                raise ConfigError(f"{source}: links.{name} needs exactly bandwidth_gbps and latency_us, got {v!r}")
            links[name] = Link(
                number(f"links.{name}.bandwidth_gbps", v["bandwidth_gbps"]),
                number(f"links.{name}.latency_us", v["latency_us"]),
            )
            if not links[name].bandwidth_gbps > 0:
                raise ConfigError(
                    f"{source}: links.{name}.bandwidth_gbps must be positive, got {v['bandwidth_gbps']!r}"
                )
            if links[name].latency_us < 0:
                raise ConfigError(f"{source}: links.{name}.latency_us must not be negative, got {v['latency_us']!r}")
        for q, e in eff:
            if not (q > 0 and 0 < e <= 1.0):
                raise ConfigError(f"{source}: chunk_efficiency {q}: {e} must be in (0, 1]")
        if any(a[1] > b[1] for a, b in zip(eff, eff[1:])):
            raise ConfigError(f"{source}: chunk_efficiency must not decrease with chunk length: {dict(eff)}")
        for w, f in hs:
            if w < 1 or f < 1:
                raise ConfigError(
                    f"{source}: head_split_factor {w}: {f}: ways must be >= 1 and the factor (attention time "
                    "with the heads split that many ways, relative to unsplit) >= 1"
                )
        for k in ("intra_node", "inter_node"):
            if k not in links:
                raise ConfigError(f"{source}: links.{k} missing")
        prof = cls(
            name=str(d.get("name", source)),
            c1_ms_per_token=need("c1_ms_per_token"),
            c2_ms_per_pair=need("c2_ms_per_pair"),
            c0_ms=need("c0_ms"),
            fitted_dims=ModelDims.from_hf_config(need("fitted_dims", dict), source=f"{source}: fitted_dims"),
            chunk_efficiency=eff,
            head_split_factor=hs,
            activation_bytes_per_token=need("activation_bytes_per_token"),
            static_bytes=need("static_bytes"),
            bytes_per_element=need("bytes_per_element", int),
            gpus_per_node=need("gpus_per_node", int),
            links=links,
            description=str(d.get("description", "")),
            forward_share=need("forward_share") if "forward_share" in d else 1.0 / 3.0,
            reduction_overhead_ms=need("reduction_overhead_ms") if "reduction_overhead_ms" in d else 0.0,
            step_overhead_ms=need("step_overhead_ms") if "step_overhead_ms" in d else 0.0,
            engine_reduction_ms_per_gb=(
                need("engine_reduction_ms_per_gb") if "engine_reduction_ms_per_gb" in d else 0.0
            ),
            cp_attention_scale=need("cp_attention_scale") if "cp_attention_scale" in d else 1.0,
            cp_message_ms=need("cp_message_ms") if "cp_message_ms" in d else 0.0,
            device=str(d.get("device") or ((d.get("calibration") or {}).get("settings") or {}).get("device") or ""),
            device_memory_gb=need("device_memory_gb") if "device_memory_gb" in d else 0.0,
            linear_layer_ms_per_token=need("linear_layer_ms_per_token") if "linear_layer_ms_per_token" in d else 0.0,
        )
        if not 0 < prof.forward_share < 1:
            raise ConfigError(f"{source}: forward_share must be in (0, 1), got {prof.forward_share}")
        for k in ("c1_ms_per_token", "c2_ms_per_pair", "activation_bytes_per_token", "cp_attention_scale"):
            if getattr(prof, k) <= 0:
                raise ConfigError(f"{source}: {k} must be positive, got {getattr(prof, k)}")
        for k in (
            "c0_ms",
            "static_bytes",
            "reduction_overhead_ms",
            "step_overhead_ms",
            "engine_reduction_ms_per_gb",
            "cp_message_ms",
            "device_memory_gb",
            "linear_layer_ms_per_token",
        ):
            if getattr(prof, k) < 0:
                raise ConfigError(f"{source}: {k} must not be negative, got {getattr(prof, k)}")
        for k in ("gpus_per_node", "bytes_per_element"):
            if getattr(prof, k) <= 0:
                raise ConfigError(f"{source}: {k} must be positive, got {getattr(prof, k)}")
        return prof

    @classmethod
    def load(cls, name_or_path: Union[str, Path]) -> HardwareProfile:
        p = resolve_config(name_or_path, "profiles", (".yaml", ".yml"))
        return cls.from_dict(read_yaml_mapping(p, "profile"), source=str(p))

    def to_dict(self) -> dict:
        d = asdict(self)
        fd = self.fitted_dims
        d["fitted_dims"] = {
            "num_hidden_layers": fd.num_layers,
            "hidden_size": fd.hidden,
            "num_attention_heads": fd.num_heads,
            "num_key_value_heads": fd.num_kv_heads,
            "head_dim": fd.head_dim,
            "intermediate_size": fd.intermediate,
            "vocab_size": fd.vocab_size,
            "tie_word_embeddings": fd.tie_word_embeddings,
        }
        d["chunk_efficiency"] = {q: e for q, e in self.chunk_efficiency}
        d["head_split_factor"] = {w: f for w, f in self.head_split_factor}
        d["links"] = {k: asdict(v) for k, v in self.links.items()}
        return d
