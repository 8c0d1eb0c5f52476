"""`megatron`: the real peer, Megatron-Core's hybrid-CP `BalancedCPScheduler`, as a balancer.

We call megatron-core's own scheduler (optional extra `megatron`: megatron-core==0.16.1,
`megatron/core/pipeline_parallel/hybrid_cp_schedule.py`) and only translate its answer:

- it returns "groups": barrier-separated rounds in which every DPxCP rank runs a list of
  sub-samples; a sub-sample listed on k ranks runs with CP size k on those ranks, each
  sub-sample as its own forward/backward;
- each round becomes a run of our waves: a set of ranks sharing the same sample list is one
  CP group, and its sub-samples are packed, in Megatron's order, into micro-batches whose
  per-document (THD) shards fit the cap: per-document sharding is what Transformer Engine
  does for packed THD input, and packing only saves per-micro-batch overhead, so the
  translation never makes Megatron's plan slower than Megatron would run it;
- Megatron fills its groups from the lowest free rank and may shift them when it enlarges
  one, so a group can sit on a non-aligned block (ranks 2-5). Megatron-Core itself only
  builds aligned power-of-two groups (`create_hybrid_dp_cp_groups`), so within each round we
  move its groups to aligned blocks, largest first (always possible for power-of-two sizes
  that add up to at most the world). A round's groups are disjoint and run independently,
  so their position does not change the round's time;
- Megatron puts a barrier between rounds; a StepPlan has none (a group starts when its own
  members are free), which can only make the translated plan faster than Megatron's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict, List, Tuple

from hf_cp.balance.base import PlanRequest
from hf_cp.balance.options import BalancerOptions
from hf_cp.balance.registry import register_balancer
from hf_cp.balance.toolkit.costs import CostMemo, cost_memo
from hf_cp.balance.toolkit.vision_memory import fit_vision_memory
from hf_cp.balance.toolkit.waves import WaveBuilder, block_ranks
from hf_cp.modes.segments import ShardMode
from hf_cp.plan.step_plan import Group, StepPlan

INSTALL_HINT = (
    "the `megatron` balancer needs megatron-core, the optional extra `megatron`: "
    "pip install 'hf_cp[megatron]' (or pip install megatron-core==0.16.1)"
)


def load_scheduler_class():
    """megatron-core's BalancedCPScheduler, or ImportError naming the extra to install."""
    try:
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from None
    return BalancedCPScheduler


class StandInGroup:
    """The only thing BalancedCPScheduler asks of its DPxCP process group is its size."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def megatron_rounds(req: PlanRequest) -> List[List[List[int]]]:
    """Megatron's schedule: per round, per DPxCP rank, the sample ids it runs (in order)."""
    scheduler_cls = load_scheduler_class()
    scheduler = scheduler_cls(
        max_seq_len_per_rank=req.cluster.max_tokens_per_rank, dp_cp_group=StandInGroup(req.cluster.world_size)
    )
    # A fresh scheduler per step: it counts processed sub-samples on the instance, and its
    # lru_caches are keyed by instance, so no step sees another's state.
    _, sample_id_groups = scheduler.get_groups_and_subsamples(list(zip(req.sample_ids, req.lengths)), None)
    return sample_id_groups


def round_groups(per_rank: List[List[int]], rnd: int, sizes: Tuple[int, ...]) -> List[Tuple[int, List[int]]]:
    """(CP size, sample ids) of each group of one round.

    Megatron lists a sample on every rank of the group that runs it and puts each rank in one
    group per round, so the ranks holding the same (non-empty) list are one group.
    """
    by_list: Dict[Tuple[int, ...], List[int]] = {}
    for r, ids in enumerate(per_rank):
        if ids:
            by_list.setdefault(tuple(ids), []).append(r)
    out = []
    for ids, ranks in by_list.items():
        if len(ranks) not in sizes:
            raise RuntimeError(
                f"megatron round {rnd}: samples {list(ids)[:5]} run on {len(ranks)} ranks "
                f"{ranks[:8]}, not a registered group size {sizes}"
            )
        out.append((len(ranks), list(ids)))
    return out


@dataclass(frozen=True)
class MegatronOptions(BalancerOptions):
    """megatron takes no options."""

    BALANCER: ClassVar[str] = "megatron"


@register_balancer("megatron")
class MegatronBalancer:
    """Megatron-Core 0.16.1 BalancedCPScheduler (hybrid CP), translated into a StepPlan.

    Not one of `auto`'s members: it is the external peer `auto` is compared against."""

    name = "megatron"
    options_class = MegatronOptions

    def __init__(self, **options):
        self.options = MegatronOptions.from_dict(options)
        load_scheduler_class()  # fail at construction, with the install hint

    def plan(self, req: PlanRequest) -> StepPlan:
        cl = req.cluster
        cap = cl.max_tokens_per_rank
        lens: Dict[int, int] = dict(zip(req.sample_ids, req.lengths))
        memo = cost_memo(req.cost)
        waves = WaveBuilder(cl.world_size)
        seen: Dict[int, int] = {}
        for rnd, per_rank in enumerate(megatron_rounds(req)):
            groups = round_groups(per_rank, rnd, cl.group_sizes)
            # aligned placement, largest first: power-of-two sizes summing to <= world always fit
            groups.sort(key=lambda g: -g[0])  # stable: Megatron's order within a size
            start = 0
            for size, ids in groups:
                ranks = block_ranks(start // size, size)
                start += size
                for s in ids:
                    if s in seen:
                        raise RuntimeError(f"megatron scheduled sample {s} in rounds {seen[s]} and {rnd}")
                    seen[s] = rnd
                for pack in pack_in_order(ids, lens, size, cap, memo):
                    if size == 1:
                        waves.add(Group(ranks=ranks, local={ranks[0]: pack}))
                    else:
                        waves.add(Group(ranks=ranks, distributed=pack, mode=ShardMode.RING_PER_DOC))
        missing = [s for s in req.sample_ids if s not in seen]
        if missing:
            raise RuntimeError(f"megatron left samples {missing[:10]} unscheduled")
        plan = req.empty_plan(self.name)
        plan.waves = waves.build()
        return fit_vision_memory(plan, req)  # within the cap with its encoders' activations


def pack_in_order(ids: List[int], lens: Dict[int, int], size: int, cap: int, memo: CostMemo) -> List[List[int]]:
    """Sub-samples in Megatron's order, packed while every member's per-document share fits."""
    packs: List[List[int]] = []
    cur: List[int] = []
    held = [0] * size
    for s in ids:
        share = memo.per_doc_member_tokens(lens[s], size) if size > 1 else (lens[s],)
        if cur and any(h + t > cap for h, t in zip(held, share)):
            packs.append(cur)
            cur, held = [], [0] * size
        cur.append(s)
        held = [h + t for h, t in zip(held, share)]
    if cur:
        packs.append(cur)
    return packs
