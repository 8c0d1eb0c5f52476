"""One cost model for every planner, the simulator and the reports.

Per layer and rank (DESIGN.md):
    time   = c0 (per micro-batch) + c1 * tokens + sum over query segments of
             c2 * causal_pairs / efficiency(segment length) [* head-split factor]
             + communication (bytes / link bandwidth + latency per message, hidden behind
               attention where the mode overlaps them, + cp_message_ms per message, never hidden)
    memory = alpha * tokens + beta
Times are milliseconds. The profile stores the fit made on one model's dimensions; for other
dimensions c1 and c2 are scaled by the ratio of FLOPs per token and per causal pair, which
is what a roofline-limited kernel would do.
"""

from __future__ import annotations

import bisect
import difflib
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import List, Mapping, Optional, Sequence, Tuple, Union

import yaml

from hf_cp.cost.execution import StepExecution
from hf_cp.modes.registry import mode_spec, rank_segments
from hf_cp.modes.segments import Segment, ShardMode, doc_pairs, masked_doc_pairs, masked_segment_pairs, segment_tokens
from hf_cp.readers import brief, load_json, load_yaml
from hf_cp.resources import available_names, find_named


class ConfigError(ValueError):
    """A config, profile or plan file is malformed; the message names the file and field."""


# the largest model dimension read from a config (hidden size, heads, layers, vocabulary, ...):
# far above any real model's (a 1M vocabulary, 128K intermediate), and small enough that the cost
# model's FLOP and byte counts stay exact integers and finite floats
MAX_MODEL_DIM = 2**24


# --------------------------------------------------------------------------- model dimensions
@dataclass(frozen=True)
class ModelDims:
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int = 0
    tie_word_embeddings: bool = False

    def __post_init__(self):
        for f in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate"):
            if int(getattr(self, f)) <= 0:
                raise ConfigError(f"model dimension {f} must be positive, got {getattr(self, f)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def linear_params_per_layer(self) -> int:
        h, d = self.hidden, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o, k, v
        mlp = 3 * h * self.intermediate  # gate, up, down
        return attn + mlp

    @property
    def embedding_parameters(self) -> int:
        """The embedding and the LM head (one matrix when tied): what FSDP2's root group holds."""
        return self.vocab_size * self.hidden * (1 if self.tie_word_embeddings else 2)

    @property
    def parameters(self) -> int:
        """Trained parameters, to the precision the gradient reduction needs: the decoder layers'
        matrices and the embedding (and the LM head unless tied); norms are negligible."""
        return self.num_layers * self.linear_params_per_layer + self.embedding_parameters

    @property
    def linear_flops_per_token(self) -> float:
        """fwd + bwd matmul FLOPs per token and layer (2 fwd + 4 bwd per parameter)."""
        return 6.0 * self.linear_params_per_layer

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        """Bytes of one token's keys and values over all layers (ChunkFlow's state store):
        2 (K and V) * kv heads * head dim * bytes * layers."""
        return 2 * self.num_kv_heads * self.head_dim * int(bytes_per_element) * self.num_layers

    @property
    def attention_flops_per_pair(self) -> float:
        """fwd + bwd FLOPs per causal query-key pair and layer: fwd 4*H*D, flash bwd 2.5x fwd."""
        return 14.0 * self.num_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: Mapping, source: str = "config") -> ModelDims:
        """Read a transformers config dict (config.json) without importing transformers."""
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"{source}: expected a transformers config (a JSON object), got {type(cfg).__name__}")
        cfg = dict(cfg)
        if isinstance(cfg.get("text_config"), Mapping) and "hidden_size" not in cfg:
            cfg = dict(cfg["text_config"])

        def dim(key: str, default=None) -> int:
            """A whole number of the config (null or absent: `default`); never rounded."""
            v = cfg[key] if default is None else cfg.get(key)
            if v is None and default is not None:
                return default
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (isinstance(v, int) or v.is_integer()):
                raise ConfigError(f"{source}: field {key!r} must be a whole number, got {brief(v)}")
            if abs(v) > MAX_MODEL_DIM:
                raise ConfigError(f"{source}: field {key!r} must be at most {MAX_MODEL_DIM:,}, got {brief(v)}")
            return int(v)

        try:
            hidden = dim("hidden_size")
            heads = dim("num_attention_heads")
            if heads <= 0:
                raise ConfigError(f"{source}: field 'num_attention_heads' must be positive, got {heads}")
            if dim("vocab_size", 0) < 0:
                raise ConfigError(f"{source}: field 'vocab_size' must not be negative, got {cfg['vocab_size']}")
            if "v_head_dim" in cfg and "qk_nope_head_dim" in cfg:
                # MLA (DeepSeek-V2/V3): hf_cp pads q/k/v to the larger of the q/k and v head dims
                # (interface.hf_cp_attention), and the keys and values it exchanges are per head
                kv_heads = heads
                head_dim = max(dim("qk_nope_head_dim") + dim("qk_rope_head_dim"), dim("v_head_dim"))
            else:
                kv_heads, head_dim = dim("num_key_value_heads", heads), dim("head_dim", hidden // heads)
            return cls(
                num_layers=dim("num_hidden_layers"),
                hidden=hidden,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                intermediate=dim("intermediate_size"),
                vocab_size=dim("vocab_size", 0),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise ConfigError(f"{source}: missing field {e.args[0]!r} (expected a transformers config.json)") from None
        except ConfigError as e:
            raise ConfigError(str(e) if str(e).startswith(f"{source}:") else f"{source}: {e}") from None
        except (TypeError, ValueError, OverflowError) as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def load(cls, name_or_path: Union[str, Path]) -> ModelDims:
        """A config.json path, a folder holding one, or a model name (hf_cp.resources: the user's
        configs/models/ under the working directory, then the package's built-ins)."""
        p = resolve_config(name_or_path, "models", (".json",))
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise ConfigError(f"model config {p}: a directory without a config.json; expected a config.json file")
            p = p / "config.json"
        try:
            cfg = load_json(p.read_text())
        except (OSError, ValueError) as e:  # JSONDecodeError (nested too deep too), UnicodeDecodeError
            raise ConfigError(f"model config {p}: {e}") from None
        return cls.from_hf_config(cfg, source=str(p))


def read_yaml_mapping(
    path: Union[str, Path], what: str, expect: str = "a mapping at top level", error: type = ConfigError
) -> dict:
    """A YAML file that must hold a mapping, read with the safe loader (no code from files) that
    refuses a key given twice and an alias bomb (hf_cp.readers.load_yaml)."""
    if Path(path).is_dir():
        raise error(f"{what} {path}: is a directory; expected a YAML file")
    try:
        d = load_yaml(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise error(f"{what} {path}: {e}") from None
    if not isinstance(d, dict):
        raise error(f"{what} {path}: expected {expect}")
    return d


def resolve_config(name_or_path: Union[str, Path], kind: str, suffixes: Tuple[str, ...]) -> Path:
    """The file a profile or model name stands for (resolution order: hf_cp.resources)."""
    p = find_named(name_or_path, kind, suffixes)
    if p is None:
        raise ConfigError(
            f"no {kind[:-1]} named {str(name_or_path)!r}: not a file, not in configs/{kind}/ here, and not "
            f"built in; available: {available_names(kind)}"
        )
    return p


# --------------------------------------------------------------------------- hardware profile
# The largest value of each number of a profile, with its unit: orders of magnitude above what
# any device measures (an H200: c1 ~1e-4 ms, alpha ~1e5 B, 141 GB, 450 GB/s), so that a number
# past it is a typo or a fuzz (1e308 made `hf-cp plan` print inf and nan), refused by name
# (forward_share and chunk_efficiency have their own ranges, within (0, 1]).
PROFILE_MAXIMA: Mapping[str, Tuple[float, str]] = {
    "c1_ms_per_token": (1e3, "ms per token and layer"),
    "c2_ms_per_pair": (1e3, "ms per causal pair and layer"),
    "c0_ms": (1e6, "ms per layer and micro-batch"),
    "activation_bytes_per_token": (1e12, "bytes per token"),
    "static_bytes": (1e18, "bytes"),
    "bytes_per_element": (16, "bytes"),
    "gpus_per_node": (4096, "ranks"),
    "bandwidth_gbps": (1e6, "GB/s"),
    "latency_us": (1e9, "microseconds"),
    "reduction_overhead_ms": (1e6, "ms"),
    "step_overhead_ms": (1e6, "ms"),
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


@dataclass(frozen=True)
class Link:
    bandwidth_gbps: float  # GB/s per rank, one direction
    latency_us: float


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
            cp_attention_scale=need("cp_attention_scale") if "cp_attention_scale" in d else 1.0,
            cp_message_ms=need("cp_message_ms") if "cp_message_ms" in d else 0.0,
            device=str(d.get("device") or ((d.get("calibration") or {}).get("settings") or {}).get("device") or ""),
            device_memory_gb=need("device_memory_gb") if "device_memory_gb" in d else 0.0,
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
            "cp_message_ms",
            "device_memory_gb",
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


# --------------------------------------------------------------------------- the cost model
def _segments_builder(mode, doc_lengths: Sequence[int], group_size: int):
    """member -> its query segments (registry.rank_segments), each member's built once: a ring
    member's cost also needs its successor's share."""
    built: dict = {}

    def segments_of(m: int) -> List[Segment]:
        s = built.get(m)
        if s is None:
            s = built[m] = rank_segments(mode, doc_lengths, group_size, m)
        return s

    return segments_of


@dataclass(frozen=True)
class RankCost:
    """Predicted work of one rank in one micro-batch (already multiplied by the layer count)."""

    compute_ms: float
    comm_ms: float  # communication not hidden behind compute
    comm_bytes: int
    tokens: int

    @property
    def total_ms(self) -> float:
        return self.compute_ms + self.comm_ms


class CostModel:
    """Cost of documents on ranks, for one model on one kind of hardware.

    `execution` (hf_cp/execution.py): how the run's waves synchronise; with it, `simulate`
    predicts the step's wall time (dummy micro-batches, gradient reductions, the step's fixed
    cost), without it the plan's compute alone."""

    def __init__(self, dims: ModelDims, profile: HardwareProfile, execution: Optional[StepExecution] = None):
        self.dims = dims
        self.profile = profile
        self.execution = execution
        fd = profile.fitted_dims
        # Per layer, scaled from the fitted dimensions by FLOP ratios.
        self.c1 = profile.c1_ms_per_token * dims.linear_flops_per_token / fd.linear_flops_per_token
        self.c2 = profile.c2_ms_per_pair * dims.attention_flops_per_pair / fd.attention_flops_per_pair
        self.c0 = profile.c0_ms
        # LM head + embedding gradient: 6 * hidden * vocab FLOPs per token at the linear rate.
        self.head_ms_per_token = (
            6.0 * dims.hidden * dims.vocab_size * self.c1 / dims.linear_flops_per_token if dims.vocab_size else 0.0
        )
        self._eff_q = [q for q, _ in profile.chunk_efficiency]
        self._eff_v = [e for _, e in profile.chunk_efficiency]

    @classmethod
    def load(cls, model: Union[str, Path], profile: Union[str, Path]) -> CostModel:
        return cls(ModelDims.load(model), HardwareProfile.load(profile))

    # ---- kernel efficiency terms
    def chunk_efficiency(self, q_len: int) -> float:
        """Relative attention throughput of a query chunk of q_len tokens (log-linear interp)."""
        qs, es = self._eff_q, self._eff_v
        if not qs or q_len >= qs[-1]:
            return es[-1] if qs else 1.0
        if q_len <= qs[0]:
            return es[0] * max(q_len, 1) / qs[0]  # below the table: time per chunk stops shrinking
        i = bisect.bisect_right(qs, q_len)
        lq0, lq1 = math.log(qs[i - 1]), math.log(qs[i])
        t = (math.log(q_len) - lq0) / (lq1 - lq0)
        return es[i - 1] + t * (es[i] - es[i - 1])

    def head_split_factor(self, ways: int) -> float:
        tab = self.profile.head_split_factor
        for w, f in tab:
            if w == ways:
                return f
        # log-linear extrapolation in the number of ways from the largest measured point
        w_max, f_max = tab[-1]
        if w_max <= 1 or ways <= 1:
            return 1.0
        per_doubling = (f_max - 1.0) / math.log2(w_max)
        return 1.0 + per_doubling * math.log2(ways)

    def segments_attention_ms(self, segments: Sequence[Segment], doc_lengths=None, masks=None) -> float:
        """Attention of query segments over their documents' keys, per layer: causal pairs, or the
        masked area of a masked sample (masks aligned with doc_lengths, None entries causal)."""
        c2 = self.c2
        total = 0.0
        for s in segments:
            if masks and masks[s.doc] is not None:  # a masked sample: its masked area (modes/segments.py)
                pairs = masked_segment_pairs(s, doc_lengths[s.doc], masks[s.doc])
            else:
                pairs = s.length * s.start + s.length * (s.length + 1) // 2
            total += c2 * pairs / self.chunk_efficiency(s.length)
        return total

    def docs_attention_ms(self, doc_lengths: Sequence[int], masks=None) -> float:
        """Attention of whole documents on one rank, per layer (masked area where masked)."""
        if not masks or all(m is None for m in masks):
            return sum(self.c2 * doc_pairs(n) / self.chunk_efficiency(n) for n in doc_lengths)

        return sum(self.c2 * masked_doc_pairs(n, m) / self.chunk_efficiency(n) for n, m in zip(doc_lengths, masks))

    # ---- local documents: no communication
    def local_ms(self, doc_lengths: Sequence[int], masks=None) -> float:
        """Whole-model fwd+bwd time of documents packed on one rank (excluding c0); `masks`
        (aligned with the lengths, None entries causal) price masked samples by their area."""
        if not doc_lengths:
            return 0.0
        L = self.dims.num_layers
        t = sum(doc_lengths)
        attn = self.docs_attention_ms(doc_lengths, masks)
        return L * (self.c1 * t + attn) + self.head_ms_per_token * t

    def sample_local_ms(self, length: int) -> float:
        return self.local_ms([length])

    # ---- memory
    def memory_bytes(self, tokens: int) -> float:
        return self.profile.activation_bytes_per_token * tokens + self.profile.static_bytes

    def check_ulysses(self, group_size: int) -> None:
        mode_spec(ShardMode.ULYSSES).check_group(self.dims, group_size)

    def link_for(self, ranks: Sequence[int]) -> Link:
        gpn = self.profile.gpus_per_node
        nodes = {r // gpn for r in ranks}
        return self.profile.links["intra_node" if len(nodes) == 1 else "inter_node"]

    # ---- distributed documents: one rank's share
    def distributed_rank_cost(
        self,
        doc_lengths: Sequence[int],
        mode,
        ranks: Sequence[int],
        member: int,
        local_lengths: Sequence[int] = (),
        masks=None,
        local_masks=None,
    ) -> RankCost:
        """Cost for group member `member` (index into `ranks`) of one micro-batch in which the
        documents `doc_lengths` are distributed over the group with `mode` and `local_lengths`
        are this member's local documents (computed with no communication). `masks` and
        `local_masks` (aligned with the lengths; None entries causal) price masked samples by
        their masked area. Mode BLOCKS is priced from its layout: cost.blocks.block_group_costs."""
        if mode_spec(mode).priced_per_group:
            raise ValueError(
                f"a {mode_spec(mode).name!r} group is priced from its placement: use cost.blocks.block_group_costs"
            )
        return self._rank_cost(
            doc_lengths,
            mode,
            ranks,
            member,
            local_lengths,
            _segments_builder(mode, doc_lengths, len(ranks)),
            self.link_for(ranks),
            masks,
            local_masks,
        )

    def distributed_rank_costs(
        self,
        doc_lengths: Sequence[int],
        mode,
        ranks: Sequence[int],
        members: Sequence[int],
        local: Optional[Mapping[int, Sequence[int]]] = None,
    ) -> List[RankCost]:
        """distributed_rank_cost of each of `members` (local: member index -> its local lengths),
        with every member's segments built once: a ring member's cost also needs its successor's
        share, so costing a whole group member by member would build each share twice."""
        local = local or {}
        segments_of = _segments_builder(mode, doc_lengths, len(ranks))
        link = self.link_for(ranks)
        return [self._rank_cost(doc_lengths, mode, ranks, m, local.get(m, ()), segments_of, link) for m in members]

    def _rank_cost(
        self,
        doc_lengths: Sequence[int],
        mode,
        ranks: Sequence[int],
        member: int,
        local_lengths: Sequence[int],
        segments_of,
        link: Link,
        masks=None,
        local_masks=None,
    ) -> RankCost:
        g = len(ranks)
        L = self.dims.num_layers
        segs = segments_of(member) if doc_lengths else []
        dist_tokens = segment_tokens(segs)
        local_tokens = sum(local_lengths)
        tokens = dist_tokens + local_tokens
        local_attn = self.docs_attention_ms(local_lengths, local_masks)
        comm_bytes = 0
        comm_ms = 0.0
        dist_attn = 0.0
        if doc_lengths and g > 1:
            spec = mode_spec(mode)
            # attention in a CP group runs slower than alone (split kernels, merges, waiting on
            # peers): the profile's factor, 1 unless measured (online calibration fits it)
            cp_scale = self.profile.cp_attention_scale
            dist_attn = spec.attention_ms(self, doc_lengths, g, segs, masks) * cp_scale
            local_attn *= cp_scale
            comm_bytes = spec.comm_bytes_per_layer(self, doc_lengths, g, member, segments_of)
            if comm_bytes:
                comm_ms = comm_bytes / (link.bandwidth_gbps * 1e6) + spec.comm_messages(g) * link.latency_us * 1e-3
                if spec.overlaps_compute:  # only the exchange that outlasts attention shows
                    comm_ms = max(0.0, comm_ms - dist_attn)
            comm_ms += self.exchange_sync_ms(spec.comm_messages(g))
        elif doc_lengths:
            dist_attn = self.segments_attention_ms(segs, doc_lengths, masks)
        compute = L * (self.c1 * tokens + local_attn + dist_attn) + self.head_ms_per_token * tokens
        return RankCost(compute_ms=compute, comm_ms=L * comm_ms, comm_bytes=L * comm_bytes, tokens=tokens)

    def micro_batch_overhead_ms(self) -> float:
        return self.dims.num_layers * self.c0

    def exchange_sync_ms(self, messages: int) -> float:
        """Per layer: what `messages` messages of a CP group's exchange cost beyond their bytes and
        latency (HardwareProfile.cp_message_ms each; compute does not hide it)."""
        return messages * self.profile.cp_message_ms

    # ---- wall clock beyond compute (used by simulate when `execution` is set)
    def dummy_micro_batch_ms(self) -> float:
        """The zero-weight one-token micro-batch a rank without work runs in a wave."""
        return self.local_ms([1]) + self.micro_batch_overhead_ms()

    def ring_collective_ms(
        self, nbytes: float, world_size: int, all_reduce: bool = False, collectives: int = 1
    ) -> float:
        """World-wide ring collectives over `world_size` ranks moving `nbytes` (the unsharded
        size) in all: an all-gather or a reduce-scatter moves (W-1)/W of the bytes per rank over
        the slowest link the ring crosses, an all-reduce twice that; each of the `collectives`
        calls pays a latency per ring step (W-1, twice for an all-reduce)."""
        if world_size <= 1:
            return 0.0
        link = self.link_for(range(world_size))
        rounds = 2 if all_reduce else 1
        share = (world_size - 1) / world_size * rounds
        steps = (world_size - 1) * rounds * collectives
        return share * nbytes / (link.bandwidth_gbps * 1e6) + steps * link.latency_us * 1e-3

    def gradient_reduction_ms(self, world_size: int, hidden_behind_ms: float = 0.0) -> float:
        """One data-parallel gradient reduction over `world_size` ranks, as the wall clock sees
        it: the gradients' bytes in one ring collective (ring_collective_ms: a reduce-scatter,
        an all-reduce under DDP), less what ran during `hidden_behind_ms` of backward when the
        reduction overlaps it, plus the profile's fixed cost per reduction."""
        ex = self.execution
        fixed = self.profile.reduction_overhead_ms
        if world_size <= 1:
            return fixed
        grad_bytes = self.dims.parameters * self.profile.bytes_per_element
        ms = self.ring_collective_ms(grad_bytes, world_size, all_reduce=ex is not None and ex.all_reduce)
        if ex is not None and ex.overlaps_backward:
            ms = max(0.0, ms - hidden_behind_ms)
        return ms + fixed

    def parameter_pass_comm_ms(self, world_size: int, backward: bool) -> float:
        """The parameter communication of one pass under a parameter-sharding execution (FSDP2,
        ZeRO-3; 0 otherwise), over `world_size` ranks at the link gradient_reduction_ms uses: a
        forward all-gathers every decoder layer's parameters and the root's (embedding, LM
        head), one collective each; a backward all-gathers the layers again (and the root,
        unless the execution keeps it gathered from forward: FSDP2) and reduce-scatters every
        gradient. Bytes at the profile's element size, as the gradient reduction's. Whether
        compute hides it is the simulator's business (simulate.sharded_wave_ms)."""
        ex = self.execution
        if ex is None or not ex.shards_parameters or world_size <= 1:
            return 0.0
        d, element = self.dims, self.profile.bytes_per_element
        layers = d.num_layers * d.linear_params_per_layer
        regather_root = not (backward and ex.keeps_root_gathered)
        gathered = layers + (d.embedding_parameters if regather_root else 0)
        ms = self.ring_collective_ms(gathered * element, world_size, collectives=d.num_layers + int(regather_root))
        if backward:
            ms += self.ring_collective_ms(d.parameters * element, world_size, collectives=d.num_layers + 1)
        return ms
