"""One cost model for every planner, the simulator and the reports.

Per layer and rank (docs/design.md):
    time   = c0 (per micro-batch) + c1 * tokens + sum over query segments of
             c2 * causal_pairs / efficiency(segment length) [* head-split factor]
             + communication (bytes / link bandwidth + latency per message, hidden behind
               attention where the mode overlaps them, + cp_message_ms per message, never hidden)
    memory = alpha * tokens + beta
Times are milliseconds. The profile stores the fit made on one model's dimensions; for other
dimensions c1 and c2 are scaled by the ratio of FLOPs per token and per causal pair, which
is what a roofline-limited kernel would do. The dimensions are cost/dims.py's, the profile and
its links cost/hardware.py's.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Union

import numpy as np

from hf_cp.cost.dims import ATTENTION_FWD_BWD, GridTHW, ModelDims, VisionDims, vision_activation_tokens
from hf_cp.cost.execution import StepExecution
from hf_cp.cost.flops import vision_item_flops
from hf_cp.cost.hardware import HardwareProfile, Link, transfer_ms
from hf_cp.modes.registry import mode_spec, rank_segments
from hf_cp.modes.segments import Segment, ShardMode, doc_pairs, masked_doc_pairs, masked_segment_pairs, segment_tokens

# state passing (attention/state_passing.py) sends float32 states, and a ring mode gives each
# member two pieces of a document (zigzag: chunks r and 2g-1-r)
STATE_BYTES_PER_ELEMENT = 4
PIECES_PER_MEMBER = 2


def segments_builder(mode, doc_lengths: Sequence[int], group_size: int):
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


# RankCosts a CostModel keeps (distributed_rank_cost); a 64-rank masked step's members ask for a
# few thousand
_RANK_COSTS_KEPT = 1 << 15


class CostModel:
    """Cost of documents on ranks, for one model on one kind of hardware.

    `execution` (hf_cp/execution.py): how the run's waves synchronise; with it, `simulate`
    predicts the step's wall time (dummy micro-batches, gradient reductions, the step's fixed
    cost), without it the plan's compute alone."""

    def __init__(
        self,
        dims: ModelDims,
        profile: HardwareProfile,
        execution: Optional[StepExecution] = None,
        vision: Optional[VisionDims] = None,
    ):
        self.dims = dims
        self.profile = profile
        self.execution = execution
        self.vision = vision  # the vision tower of a vision-language model (None: text only)
        self._vision_item_ms: dict = {}  # grid -> vision_item_ms (a step repeats a few resolutions)
        self._causal_doc_ms: Dict[int, float] = {}  # length -> docs_attention_ms of one causal document
        # distributed_rank_cost of masked samples by its arguments: a masked group is priced by every member of
        # auto that lays it out (magi's and usp's ring candidates are the same groups) and again
        # by the pricer; emptied when full (_RANK_COSTS_KEPT)
        self._rank_costs: dict = {}
        fd = profile.fitted_dims
        # the profile's rates per FLOP (fitted on its own dimensions): what the vision tower's
        # matmuls and attention run at, so that a refitted profile moves both alike
        self.ms_per_matmul_flop = profile.c1_ms_per_token / fd.linear_flops_per_token
        self.ms_per_attention_flop = profile.c2_ms_per_pair / fd.attention_flops_per_pair
        # Per layer, scaled from the fitted dimensions by FLOP ratios.
        ratio = dims.linear_flops_per_token / fd.linear_flops_per_token
        softmax_c1 = profile.c1_ms_per_token * ratio
        # a hybrid's linear-time layers at their own measured rate where the profile has one
        # (scaled alike), else at a softmax layer's; c1 is the per-layer mean, so that every
        # L x c1 x tokens of the cost model is the sum over the layers as they are
        self.linear_layer_c1 = profile.linear_layer_ms_per_token * ratio or softmax_c1
        self.c1 = (dims.softmax_layers * softmax_c1 + dims.linear_layers * self.linear_layer_c1) / dims.num_layers
        self.c2 = profile.c2_ms_per_pair * dims.attention_flops_per_pair / fd.attention_flops_per_pair
        self.c0 = profile.c0_ms
        # LM head + embedding gradient: 6 * hidden * vocab FLOPs per token at the linear rate.
        self.head_ms_per_token = (
            6.0 * dims.hidden * dims.vocab_size * softmax_c1 / dims.linear_flops_per_token if dims.vocab_size else 0.0
        )
        self._eff_q = [q for q, _ in profile.chunk_efficiency]
        self._eff_v = [e for _, e in profile.chunk_efficiency]

    @classmethod
    def load(cls, model: Union[str, Path], profile: Union[str, Path]) -> CostModel:
        return cls(ModelDims.load(model), HardwareProfile.load(profile))

    def with_profile(self, profile: HardwareProfile) -> CostModel:
        """The same model and execution (and vision tower) on another profile (a refit)."""
        return CostModel(self.dims, profile, self.execution, self.vision)

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
            # per distinct length, once: the simulator prices every document of a step (at 4096
            # ranks 2.6e5 of them), the interpolation's logs per document were most of its time
            memo = self._causal_doc_ms
            out = 0.0
            for n in doc_lengths:
                ms = memo.get(n)
                if ms is None:
                    ms = memo[n] = self.c2 * doc_pairs(n) / self.chunk_efficiency(n)
                out += ms
            return out

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

    # ---- the vision tower: each image or clip encoded once, on one rank (plan/vision_encoders.py)
    def vision_dims(self) -> VisionDims:
        if self.vision is None:
            raise ValueError(
                "samples with images or clips need the vision tower's dimensions: give a vision-language model's "
                "config (its vision_config), e.g. --vision-model CONFIG.json for hf-cp plan"
            )
        return self.vision

    def vision_item_ms(self, grid: GridTHW) -> float:
        """Forward and backward time of the vision tower over one image or clip of patch grid
        `grid` (t, h, w): its matmuls at the profile's matmul rate, its attention window by window
        and frame by frame at the attention rate and the kernel efficiency of that length."""
        grid = tuple(int(x) for x in grid)
        ms = self._vision_item_ms.get(grid)
        if ms is None:
            v = self.vision_dims()
            matmul, _ = vision_item_flops(v, grid)
            per_pair = ATTENTION_FWD_BWD * v.forward_flops_per_pair * self.ms_per_attention_flop
            attention = sum(k * n * n * per_pair / self.chunk_efficiency(n) for n, k in v.attention_runs(grid))
            ms = self._vision_item_ms[grid] = matmul * self.ms_per_matmul_flop + attention
        return ms

    def vision_ms(self, grids: Sequence[GridTHW]) -> float:
        """The vision tower's time over items of patch grids `grids`, encoded on one rank."""
        return sum(self.vision_item_ms(tuple(g)) for g in grids)

    def vision_tokens(self, patches):
        """The activations a rank holds encoding `patches` patches, in tokens of the memory model
        (dims.vision_activation_tokens): what a rank's count against the cap adds for the items
        it encodes (StepPlan.held_tokens). 0 for no patches, with or without a tower."""
        if not isinstance(patches, np.ndarray) and not patches:
            return 0
        return vision_activation_tokens(self.vision_dims(), self.dims, patches)

    # ---- memory
    def memory_bytes(self, tokens: int) -> float:
        """A rank's peak bytes holding `tokens` tokens of activations (the items it encodes
        counted in, vision_tokens)."""
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
        segments_of=None,
    ) -> RankCost:
        """Cost for group member `member` (index into `ranks`) of one micro-batch in which the
        documents `doc_lengths` are distributed over the group with `mode` and `local_lengths`
        are this member's local documents (computed with no communication). `masks` and
        `local_masks` (aligned with the lengths; None entries causal) price masked samples by
        their masked area. Mode BLOCKS is priced from its layout: cost.blocks.block_group_costs.
        `segments_of`: segments_builder(mode, doc_lengths, group size), shared by a caller that
        costs every member (a ring member's cost also needs its successor's share)."""
        spec = mode_spec(mode)
        if spec.priced_per_group:
            raise ValueError(f"a {spec.name!r} group is priced from its placement: use cost.blocks.block_group_costs")
        # kept for distributed masked samples only: a causal member's cost, or local samples'
        # alone, is cheaper than its key
        key = (
            self._rank_cost_key(doc_lengths, spec, ranks, member, local_lengths, masks, local_masks)
            if doc_lengths and (masks or local_masks)
            else None
        )
        rc = self._rank_costs.get(key) if key is not None else None
        if rc is None:
            rc = self._rank_cost(
                doc_lengths,
                mode,
                ranks,
                member,
                local_lengths,
                segments_of or segments_builder(mode, doc_lengths, len(ranks)),
                self.link_for(ranks),
                masks,
                local_masks,
            )
            if key is not None:
                self._keep_rank_cost(key, rc)
        return rc

    @staticmethod
    def _rank_cost_key(doc_lengths, spec, ranks, member, local_lengths, masks, local_masks) -> tuple:
        """What a member's RankCost depends on besides the model (masks as given, aligned)."""
        return (
            tuple(doc_lengths),
            spec,
            tuple(ranks),
            member,
            tuple(local_lengths),
            tuple(masks) if masks else None,
            tuple(local_masks) if local_masks else None,
        )

    def _keep_rank_cost(self, key: tuple, rc) -> None:
        if len(self._rank_costs) >= _RANK_COSTS_KEPT:
            self._rank_costs.clear()
        self._rank_costs[key] = rc

    def kept(self, key: tuple, compute):
        """compute(), kept per `key` with the masked rank costs (the same values: a blocks
        group's member costs, cost.blocks.block_group_costs, which a layout's chooser and
        the pricer both ask for). `key` starts with a string naming what it keeps."""
        v = self._rank_costs.get(key)
        if v is None:
            v = compute()
            self._keep_rank_cost(key, v)
        return v

    def distributed_rank_costs(
        self,
        doc_lengths: Sequence[int],
        mode,
        ranks: Sequence[int],
        members: Sequence[int],
        local: Optional[Mapping[int, Sequence[int]]] = None,
        masks=None,
    ) -> List[RankCost]:
        """distributed_rank_cost of each of `members` (local: member index -> its local lengths;
        `masks` aligned with doc_lengths, as there), with every member's segments built once: a
        ring member's cost also needs its successor's share, so costing a whole group member by
        member would build each share twice."""
        local = local or {}
        segments_of = segments_builder(mode, doc_lengths, len(ranks))
        link = self.link_for(ranks)
        return [
            self._rank_cost(doc_lengths, mode, ranks, m, local.get(m, ()), segments_of, link, masks) for m in members
        ]

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
                comm_ms = transfer_ms(comm_bytes, link, spec.comm_messages(g))
                if spec.overlaps_compute:  # only the exchange that outlasts attention shows
                    comm_ms = max(0.0, comm_ms - dist_attn)
            comm_ms += self.exchange_sync_ms(spec.comm_messages(g))
        elif doc_lengths:
            dist_attn = self.segments_attention_ms(segs, doc_lengths, masks)
        compute = L * (self.c1 * tokens + local_attn + dist_attn) + self.head_ms_per_token * tokens
        mix_ms, mix_comm, mix_bytes = (
            self.spread_linear_layers(sum(doc_lengths), dist_tokens, g, link) if doc_lengths else (0, 0, 0)
        )
        return RankCost(
            compute_ms=compute + mix_ms,
            comm_ms=L * comm_ms + mix_comm,
            comm_bytes=L * comm_bytes + mix_bytes,
            tokens=tokens,
        )

    def spread_linear_layers(self, doc_tokens, own_tokens, group_size: int, link: Link):
        """(compute ms, unhidden comm ms, bytes) a hybrid's linear-time layers add to one member
        of a CP group whose distributed documents total `doc_tokens`, `own_tokens` of them its
        rows (numbers or numpy arrays; zeros for a plain transformer), as attention/recurrent.py
        runs them:
        - Gated DeltaNet (dims.passed_state_elements): state passing. Each member runs the mixer
          on its own rows once more (the transition run; the first and last pieces of a document
          skip one run each, not priced), sends its pieces' states to the g-1 others and the
          convolution's window rows to the next piece (two all-to-alls forward, two backward);
          PIECES_PER_MEMBER pieces a member, as the ring modes cut.
        - the others: every member sends its rows to the g-1 others (one all-to-all forward, its
          gradient backward) and runs the mixer over the rows it received too."""
        layers = self.dims.linear_layers
        if not layers or group_size <= 1:
            return 0.0, 0.0, 0.0
        d, bpe = self.dims, self.profile.bytes_per_element
        if d.passed_state_elements:
            compute = layers * self.linear_layer_c1 * d.mixer_share * own_tokens
            state = d.passed_state_elements * STATE_BYTES_PER_ELEMENT + d.conv_window * d.hidden * bpe
            nbytes = 2 * PIECES_PER_MEMBER * (group_size - 1) * state
            messages = 4 * (group_size - 1)
        else:
            compute = layers * self.linear_layer_c1 * d.mixer_share * (doc_tokens - own_tokens)
            nbytes = 2 * own_tokens * (group_size - 1) * d.hidden * bpe
            messages = 2 * (group_size - 1)
        comm = layers * (transfer_ms(nbytes, link, messages) + self.exchange_sync_ms(messages))
        return compute, comm, layers * nbytes

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
        return transfer_ms(share * nbytes, link, steps)

    def gradient_reduction_ms(self, world_size: int, hidden_behind_ms: float = 0.0) -> float:
        """One data-parallel gradient reduction over `world_size` ranks, as the wall clock sees
        it: the gradients' bytes in one ring collective (ring_collective_ms: a reduce-scatter,
        an all-reduce under DDP), less what ran during `hidden_behind_ms` of backward when the
        reduction overlaps it, plus what the link does not explain (reduction_fixed_ms)."""
        ex = self.execution
        fixed = self.reduction_fixed_ms()
        if world_size <= 1:
            return fixed
        ms = self.ring_collective_ms(self.gradient_bytes(), world_size, all_reduce=ex is not None and ex.all_reduce)
        if ex is not None and ex.overlaps_backward:
            ms = max(0.0, ms - hidden_behind_ms)
        return ms + fixed

    def reduction_fixed_ms(self) -> float:
        """The part of one gradient reduction that is not bytes over the link: the profile's fixed
        cost per reduction and the engine's work per GB of this model's gradients (neither is
        hidden behind backward: the engine does it when the collective is due)."""
        p = self.profile
        return p.reduction_overhead_ms + p.engine_reduction_ms_per_gb * self.gradient_bytes() / 1e9

    def gradient_bytes(self) -> float:
        """The bytes of one full set of the model's gradients (what a reduction moves), at the
        profile's element size."""
        return self.dims.parameters * self.profile.bytes_per_element

    def parameter_pass_comm_ms(self, world_size: int, backward: bool) -> float:
        """The parameter communication of one pass under a parameter-sharding execution (FSDP2,
        ZeRO-3; 0 otherwise), over `world_size` ranks at the link gradient_reduction_ms uses: a
        forward all-gathers every decoder layer's parameters and the root's (embedding, LM
        head), one collective each; a backward all-gathers the layers again (and the root,
        unless the execution keeps it gathered from forward: FSDP2) and reduce-scatters every
        gradient. Bytes at the profile's element size, as the gradient reduction's. Whether
        compute hides it is the simulator's business (sharded.sharded_wave_ms)."""
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
