"""`dcp`: DCP's planner (Jiang et al., SOSP 2025; survey section 3.2) over the whole world.

No CP group is fixed in advance. Per step:

1. Blocks. A sample longer than the block size is cut into data blocks (token chunks: the
   Q, K, V, O and labels of a chunk stay together on its owner) and compute blocks (one per
   (query block, key block) pair with masked pairs, masks.rect_pairs). Shorter samples are
   atoms: one rank computes each whole. Block size heuristic: the largest power of two at
   most cap/4 tokens, but at least two blocks per rank the sample spreads over, in a
   multiple of that, and at most max(`max_blocks`, 2 x those ranks) blocks. A sample over p
   ranks so has about 2p^2 compute blocks (2.1M at p = 1024): they are numpy arrays, never
   walked in Python, and the planner's deadline (below) bounds the rest.
2. Where a long sample runs. hf_cp's collectives run on pre-built groups (aligned
   power-of-two blocks of ranks), and every member of a group meets the others at every
   layer's exchange, so a sample's placement spans one such block and spreads over all of
   it: as many ranks as its predicted time (against a rank's share of the step) and its
   memory need, rounded up to a power of two, on the block with the least work so far,
   heaviest samples first; samples share a wave while their ranks' owned tokens allow (`fill`).
   A wave's blocks may overlap (a sample on ranks 0-63, another on rank 0): each is placed
   against what the wave already holds on its ranks, largest blocks first, and one that no
   longer fits moves to the next wave. Within the block the placement is DCP's: the ranks talk
   only as the placement needs.
3. Placement within the block: a hypergraph whose vertices are the compute blocks (weight:
   predicted time) and data blocks (weight: their linear work), with one net per data block
   joining its users (a K/V net: the blocks that read its keys; a Q net: the blocks that read
   its queries), weighted by the bytes a copy of it moves (fwd + bwd). The partition
   minimises the bytes moved (connectivity - 1) with every part's time within (1 + epsilon)
   of its share. Hierarchical: first across the block's nodes (inter-node bytes are the
   expensive ones), then across the GPUs of each node. Memory is the hard constraint: every
   rank's owned tokens plus received rows must fit its cap, counted over the whole wave by
   block_layout.held_tokens, the one function StepPlan.validate and the simulator count with,
   so every plan dcp returns validates.
   KaHyPar-family partitioners balance one weight, and DCP needs two (memory hard, time
   within epsilon). So the initial partition is a greedy fill that balances both: each long
   sample's query rows (a data block and the compute blocks reading its queries), paired
   zigzag-fashion (row i with row n-1-i), go onto the current part while its time and memory
   have room, else onto the part with the most time left. With Mt-KaHyPar installed (extra
   `dcp`, deterministic preset) its V-cycles then refine that partition for fewer bytes
   under the time caps; data blocks may move only while every part's memory still fits,
   else they stay and only compute blocks move. Only a block's top level (its nodes, or its
   GPUs within one node) is refined, and only up to `refine_max_vertices` vertices: the
   rest keeps the greedy partition (the planner-time bound). Without Mt-KaHyPar, or with
   `partitioner="greedy"`, the greedy partition is the placement (every compute block on its
   query block's owner).
4. Atoms: heaviest first onto the rank with the least time in the step (LPT: they fill what
   the long samples leave), then each rank's atoms in micro-batches of its own after the
   long samples' waves (first fit decreasing to the cap).
5. Groups of a wave: ranks that exchange data form a component, each runs in the smallest
   registered block covering it (overlapping covers merge); a rank with only atoms runs alone.
6. Divisions. Each group's compute blocks are scheduled in `divisions` divisions so that the
   communication of division i+1 overlaps the computation of division i (the seed's
   algorithm: division 0 holds the blocks whose inputs are all local; the middle divisions
   take, device by device in order of least computation, the next block unless it would push
   a device pair over its per-division share of the traffic; the last division takes the
   rest). `division_overlap_ms` prices that pipeline, and block_cost prices layouts that carry
   divisions the same way. Off by default (`divisions=1`): the engine's executor does not
   pipeline divisions yet, and a plan's prediction must be what runs.

Deadline. `deadline_s` (wall clock) is checked between the placement's bounded steps (a
block's partition level, 65,536 compute blocks of a group's layout; each Mt-KaHyPar call is
bounded by `refine_max_vertices`). Past it the step gets the fallback plan (the long samples
ring per-document on aligned groups of the same sizes, the atoms as above; no partitioner) and
a note in StepPlan.notes; `plan_fallback(request)` rebuilds it.

Options are a BalancerOptions (checked by name, type and range from Python, YAML, the command
line and `auto`'s member_options; listed by `hf-cp plan --list-balancer-options dcp`).

Modules: options.py (DcpOptions, DcpError), weights.py (the cost model's numbers for blocks,
long samples cut in data and compute blocks), graph.py (a wave's hypergraph), hypergraph.py
(Mt-KaHyPar), partition.py (greedy fill, refinement, hierarchical placement of a block),
placement.py (a wave's placement -> groups and block placements), divisions.py (the
computation/communication schedule), layout.py (plan_layout: one step; fallback_layout: the
deadline's plan) and balancer.py (DcpBalancer, registered as "dcp").
"""

from hf_cp.balance.balancers.dcp import balancer  # noqa: F401  registers "dcp"
