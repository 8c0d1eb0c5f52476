"""The shard-mode registry: every mode registers one `ShardModeSpec` here, and the cost model,
the simulator, the plan validator, the collator and the attention dispatch look it up by name.

A spec states its geometry (which tokens each member holds), its group checks and the name of
its attention function; pricing hooks receive the cost model as an argument, so this layer
imports none of it.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Callable, Dict, List, Mapping, Optional, Sequence

from hf_cp.modes.segments import Segment, segment_tokens

if TYPE_CHECKING:  # pragma: no cover
    from hf_cp.cost.dims import ModelDims
    from hf_cp.cost.model import CostModel

# member index -> that member's segments (built once per group and reused: a ring member's
# exchange depends on its successor's share)
SegmentsOf = Callable[[int], List[Segment]]


class ShardModeSpec:
    """One shard mode. Subclasses set `name` and implement `segments`; the rest has defaults
    for a mode whose members compute their own query segments with no exchange.

    `params` is the mode's own plan data for modes that need more than the document lengths
    (a placement); None for the built-in modes.
    """

    name: str = ""
    description: str = ""
    splits_heads: bool = False  # members compute all tokens on a share of the heads (Ulysses)
    overlaps_compute: bool = False  # the exchange runs behind attention; only the excess shows
    priced_per_group: bool = False  # its cost needs the whole group's placement (sim asks block_cost)
    # its geometry is plan data, the group's block layout (plan.Group.blocks), not a function of
    # the lengths: segments, tokens and transfers come from that layout
    carries_layout: bool = False
    # the built-in ring split its members hold, with the ring's exchange (ring_bytes_per_layer,
    # 3(g-1) messages behind attention): "zigzag" (ring_zigzag: the packed sequence in 2g chunks),
    # "per_doc" (ring_per_doc: every document in 2g parts), "" for any other mode (ulysses,
    # blocks). The plan pricer (balance/toolkit/pricing.py) prices the two splits from its
    # vectorised tables and every other mode through the cost model; a subclass of a ring mode
    # that changes its segments or its exchange sets it back to "".
    ring_split: str = ""
    attention: str = ""  # "module:function" executing the mode (hf_cp.attention), see dispatch.py

    # ---- geometry
    def segments(
        self, doc_lengths: Sequence[int], group_size: int, member: int, params: Optional[Mapping] = None
    ) -> List[Segment]:
        raise NotImplementedError

    def member_tokens(self, doc_lengths: Sequence[int], group_size: int, params: Optional[Mapping] = None) -> List[int]:
        """Tokens every member holds (planners call this in their inner loops: override with a
        closed form where there is one)."""
        return [segment_tokens(self.segments(doc_lengths, group_size, m, params)) for m in range(group_size)]

    # ---- checks
    def check_group(self, dims: ModelDims, group_size: int) -> None:
        """Raise ValueError when the mode cannot run this model on a group of this size."""

    # ---- cost (per layer, one member)
    def attention_ms(
        self,
        cost: CostModel,
        doc_lengths: Sequence[int],
        group_size: int,
        segments: Sequence[Segment],
        masks: Optional[Sequence] = None,
    ) -> float:
        """Attention compute of one member holding `segments` (masks: per document, None causal)."""
        return cost.segments_attention_ms(segments, doc_lengths, masks)

    def comm_bytes_per_layer(
        self, cost: CostModel, doc_lengths: Sequence[int], group_size: int, member: int, segments_of: SegmentsOf
    ) -> int:
        """Bytes this member sends per layer, forward and backward (the attention code's
        comm counter must agree: tests check it)."""
        return 0

    def comm_messages(self, group_size: int) -> int:
        """Messages per layer and member (each pays the link latency)."""
        return 0


_REGISTRY: Dict[str, ShardModeSpec] = {}


def register_mode(spec: ShardModeSpec) -> ShardModeSpec:
    if not spec.name:
        raise ValueError(f"{type(spec).__name__}: a shard mode needs a name")
    if spec.name in _REGISTRY and type(_REGISTRY[spec.name]) is not type(spec):
        raise ValueError(f"a shard mode named {spec.name!r} is already registered ({_REGISTRY[spec.name]!r})")
    _REGISTRY[spec.name] = spec
    return spec


def unregister_mode(name) -> ShardModeSpec:
    """Remove a registered mode (a name or a ShardMode member) and return its spec; for plugins
    and tests that register a mode for a while. Plans that still name it no longer resolve."""
    key = getattr(name, "value", name)
    if key not in _REGISTRY:
        raise ValueError(f"unknown shard mode {key!r}; registered modes: {', '.join(mode_names())}")
    return _REGISTRY.pop(key)


def mode_names() -> List[str]:
    return sorted(_REGISTRY)


def mode_spec(name) -> ShardModeSpec:
    """The spec of a mode name (a str, or a ShardMode member)."""
    key = getattr(name, "value", name)
    spec = _REGISTRY.get(key)
    if spec is None:
        raise ValueError(f"unknown shard mode {key!r}; registered modes: {', '.join(mode_names())}")
    return spec


def mode_attention(name) -> Callable:
    """The attention function of a mode (imports torch: execution only)."""
    module, _, fn = mode_spec(name).attention.partition(":")
    if not module or not fn:
        raise ValueError(f"shard mode {mode_spec(name).name!r} has no attention function")
    return getattr(import_module(module), fn)


def rank_segments(mode, doc_lengths: Sequence[int], group_size: int, rank: int, params=None) -> List[Segment]:
    """Member `rank`'s segments of the documents a group distributes with `mode` (a mode name)."""
    if not 0 <= rank < group_size:
        raise ValueError(f"rank {rank} outside group of size {group_size}")
    return mode_spec(mode).segments(doc_lengths, group_size, rank, params)


def mode_name(mode) -> str:
    """A mode's registered name, from a name or a ShardMode member (checked against the registry)."""
    return mode_spec(mode).name
