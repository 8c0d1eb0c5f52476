"""Weighted hypergraph partitioning for placement solvers, through Mt-KaHyPar when installed.

`refine(vertex_weights, nets, net_weights, max_part_weights, initial)` improves a partition
of the vertices into k parts: the connectivity objective, sum over nets of weight * (parts the
net spans - 1), goes down (for DCP: the bytes a placement moves) while each part's summed
vertex weight stays under its maximum. Mt-KaHyPar (`pip install mtkahypar`, the `dcp` extra) runs with its
DETERMINISTIC preset on one thread and a fixed seed, so a plan stays a pure function of its
request. Without it `available()` is False and callers use their own greedy placement.
"""

from __future__ import annotations

import importlib.util
from typing import List, Optional, Sequence

_MT = None  # (module, initializer), made once per process
_CONTEXTS: dict = {}  # k -> a DETERMINISTIC context (making one costs milliseconds)
MAX_TOTAL_WEIGHT = 10**8  # integer weights are scaled to stay well inside int32 sums
SEED = 0


def available() -> bool:
    """Whether Mt-KaHyPar can be imported (the optional `dcp` extra)."""
    return importlib.util.find_spec("mtkahypar") is not None


def warm_up() -> None:
    """Load and initialise Mt-KaHyPar now, when installed. Its initialisation turns on interleaved
    memory allocation, and hwloc's migrate_pages walks every page of the process: 11 ms in a bare
    interpreter, 0.1-0.3 s of CPU in a process that has loaded torch and a model. A planner pays
    it at start-up (Planner.start), not in the step during which a partition is first needed."""
    if available():
        _mt()


def _mt():
    global _MT
    if _MT is None:
        import mtkahypar

        _MT = (mtkahypar, mtkahypar.initialize(1, False))
    return _MT


def _scale(values: Sequence[float], total_limit: float) -> List[int]:
    s = float(sum(values))
    f = total_limit / s if s > 0 else 1.0
    return [max(1, int(v * f)) for v in values]


def refine(
    vertex_weights: Sequence[float],
    nets: Sequence[Sequence[int]],
    net_weights: Sequence[float],
    max_part_weights: Sequence[float],
    initial: Sequence[int],
    fixed: Optional[Sequence[int]] = None,
    vcycles: int = 1,
) -> List[int]:
    """Improve a partition (`initial`: a part per vertex, k = len(max_part_weights)) by
    Mt-KaHyPar's V-cycles: the connectivity (km1) of the weighted nets goes down, each part's
    weight stays at most its maximum (or at most what `initial` had there, when that was
    already over). `fixed`: a part per vertex, or -1 for a free one; a fixed vertex keeps its
    part. Raises ImportError when Mt-KaHyPar is missing."""
    k = len(max_part_weights)
    n = len(vertex_weights)
    if k == 1 or n == 0:
        return list(initial)
    mt, init = _mt()
    loads = [0.0] * k
    for v, p in enumerate(initial):
        loads[p] += vertex_weights[v]
    maxw = [max(c, l) for c, l in zip(max_part_weights, loads)]
    f = MAX_TOTAL_WEIGHT / float(sum(maxw))
    vw = [max(1, int(w * f)) for w in vertex_weights]
    caps = [0] * k
    for v, p in enumerate(initial):
        caps[p] += vw[v]  # what the initial partition holds after rounding ...
    caps = [max(c, int(m * f) + 1) for c, m in zip(caps, maxw)]  # ... or the maximum, if larger
    kept = [i for i, e in enumerate(nets) if len(set(e)) > 1]
    edges = [sorted(set(nets[i])) for i in kept]
    ew = _scale([net_weights[i] for i in kept], MAX_TOTAL_WEIGHT) if kept else []
    ctx = _CONTEXTS.get(k)
    if ctx is None:
        ctx = _CONTEXTS[k] = init.context_from_preset(mt.PresetType.DETERMINISTIC)
        ctx.set_partitioning_parameters(k, 0.03, mt.Objective.KM1)
        ctx.logging = False
    ctx.set_individual_target_block_weights(caps)
    mt.set_seed(SEED)
    hg = init.create_hypergraph(ctx, n, len(edges), edges, vw, ew)
    if fixed is not None and any(p >= 0 for p in fixed):
        hg.add_fixed_vertices([int(p) for p in fixed], k)
    ph = hg.create_partitioned_hypergraph(ctx, k, [int(p) for p in initial])
    before = ph.km1()
    ph.improve_partition(ctx, vcycles)
    if ph.km1() > before:  # V-cycles never should; keep the initial partition if they did
        return list(initial)
    return [ph.block_id(v) for v in range(n)]
