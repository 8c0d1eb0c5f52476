"""cp_compile: torch.compile of every decoder layer, before the Trainer wraps the model.

Each layer is compiled in place (`nn.Module.compile()`): the module objects, their parameter
names and so every checkpoint stay as they were, and the Trainer's gradient checkpointing
still wraps each layer's call. hf_cp's attention is left out of the graphs (registered under
torch.compiler.disable): it is Python over plans, masks and collectives, and traced it breaks
the graph at every data-dependent step (two layers of a tiny Llama took 129 s to compile on
this repository's CPU machine, 7 s with attention left out, the same loss either way). What
compiling fuses is the rest of the layer: projections, norms, rotary embedding, MLP. Lengths
change from micro-batch to micro-batch: the second shape seen compiles a dynamic-shape graph,
which serves the rest.

Refused with ChunkFlow (cp_balancer: chunkflow, or `auto` with chunkflow among its members):
its dependent chunks run the same layers with and without a graph, over a K/V store that
attention mutates between calls, and recompute the early chunks in backward; none of that has
been checked under compilation.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from transformers import AttentionInterface

from hf_cp.attention.interface import ATTN_IMPLEMENTATION, hf_cp_attention
from hf_cp.planning.setup import PlanningSettings

# the start of the line the trainer logs once the layers are compiled
COMPILED_LINE = "cp_compile: torch.compile of every decoder layer"


def compile_problem(settings: PlanningSettings) -> Optional[str]:
    """Why cp_compile cannot be used with these planning settings (None: it can)."""
    if settings.balancer == "chunkflow":
        return "cp_compile is not supported with ChunkFlow (cp_balancer: chunkflow): choose another balancer"
    if settings.balancer == "auto":
        members = settings.balancer_options.get("members")
        if members is None or "chunkflow" in members:
            return (
                "cp_compile is not supported with ChunkFlow, and cp_balancer: auto may plan with it; list auto's "
                "members without chunkflow (cp_balancer_options: {members: [dynamic_cp, wlb, ...]}) or choose "
                "another balancer"
            )
    return None


def decoder_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The model's decoder layers: the modules of the classes a transformers model names in
    `_no_split_modules` (the blocks it never splits across devices), found inside wrappers
    (PEFT) too."""
    names = next((m._no_split_modules for m in model.modules() if getattr(m, "_no_split_modules", None)), None)
    if not names:
        raise ValueError(
            f"cp_compile: {type(model).__name__} names no decoder layer class (transformers' _no_split_modules), "
            f"so hf_cp cannot tell which modules to compile; set cp_compile: false"
        )
    layers = [m for m in model.modules() if type(m).__name__ in set(names)]
    if not layers:
        raise ValueError(f"cp_compile: {type(model).__name__} has no module of the classes {sorted(names)}")
    return layers


def compile_decoder_layers(model: torch.nn.Module) -> str:
    """Compile every decoder layer of `model` in place, hf_cp's attention left out of the graphs;
    returns the start-up line that says so."""
    layers = decoder_layers(model)
    # from the original function every time, so that a second call does not wrap the wrapper
    AttentionInterface.register(ATTN_IMPLEMENTATION, torch.compiler.disable(hf_cp_attention))
    for layer in layers:
        layer.compile()
    return (
        f"{COMPILED_LINE}: {len(layers)} {type(layers[0]).__name__} modules (hf_cp's attention left out of the graphs)"
    )
