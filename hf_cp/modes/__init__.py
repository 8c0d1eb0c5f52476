"""Shard modes: how a CP group spreads the documents it distributes over its members.

Each mode is one module here that registers (in registry.py) one `ShardModeSpec`: its geometry (which tokens each
member holds: shard segments), its cost (attention work per member, bytes exchanged, messages,
whether the exchange hides behind compute), its group checks (Ulysses must split the heads)
and its execution (the attention function, imported lazily so that planning stays torch-free).
The cost model, the simulator, the plan validator, the collator and the attention dispatch all
look a mode up here, so a new mode is one module plus its tests (CONTRIBUTING.md).

Built in: `ulysses` (modes/ulysses.py), `ring_zigzag` and `ring_per_doc` (modes/ring.py), and
`blocks` (modes/blocks.py: the block engine's placements, whose geometry is plan data).
"""

from __future__ import annotations

# Each mode module registers its spec on import; importing them here makes every built-in mode
# known to whoever imports the package.
from hf_cp.modes import blocks, ring, ulysses  # noqa: F401
from hf_cp.modes.registry import (
    SegmentsOf,
    ShardModeSpec,
    mode_attention,
    mode_name,
    mode_names,
    mode_spec,
    rank_segments,
    register_mode,
    unregister_mode,
)
from hf_cp.modes.segments import Segment, ShardMode

__all__ = [
    "Segment",
    "SegmentsOf",
    "ShardMode",
    "ShardModeSpec",
    "mode_attention",
    "mode_name",
    "mode_names",
    "mode_spec",
    "rank_segments",
    "register_mode",
    "unregister_mode",
]
