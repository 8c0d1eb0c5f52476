"""DCP's planner as a registered balancer ("dcp"): plan_layout's waves as a StepPlan."""

from __future__ import annotations

from hf_cp.balance.balancers.dcp import hypergraph
from hf_cp.balance.balancers.dcp.layout import plan_layout
from hf_cp.balance.balancers.dcp.options import DcpOptions
from hf_cp.balance.base import PlanRequest
from hf_cp.balance.registry import register_balancer
from hf_cp.balance.toolkit.placement import blocks_group, request_masks
from hf_cp.modes.segments import ShardMode
from hf_cp.plan.step_plan import Group, StepPlan, Wave


@register_balancer("dcp", auto_member=True)
class DcpBalancer:
    """DCP's planner as a balancer: options are DcpOptions' fields. The last plan's planner time
    (seconds) and partitioner are kept in `last_planner_s` / `last_backend`."""

    name = "dcp"
    handles_masks = True  # blocks and atoms are priced by their masked pairs

    def __init__(self, **options):
        self.options = DcpOptions(**options)
        self.last_planner_s = 0.0
        self.last_backend = ""

    def warm_up(self) -> None:
        """Initialise the partitioner now (Balancer.warm_up)."""
        if self.options.backend() == "mtkahypar":
            hypergraph.warm_up()

    def plan(self, req: PlanRequest) -> StepPlan:
        masks = request_masks(req)
        cl = req.cluster
        lay = plan_layout(
            req.lengths,
            cl.world_size,
            cl.gpus_per_node,
            cl.max_tokens_per_rank,
            req.cost,
            [masks.get(s) for s in req.sample_ids],
            self.options,
            cl.max_group_size,
        )
        self.last_planner_s, self.last_backend = lay.planner_s, lay.backend
        ids = req.sample_ids
        plan = req.empty_plan(self.name)
        plan.masks = {s: m for s, m in masks.items() if s in set(ids)}
        for groups in lay.waves:
            wave = []
            for ranks, docs, pl, div, local in groups:
                loc = {r: [ids[i] for i in v] for r, v in local.items()}
                if docs and pl is None:  # too large for blocks: ring per-document sharding
                    wave.append(Group(ranks=ranks, distributed=[ids[i] for i in docs], mode=ShardMode.RING_PER_DOC))
                    continue
                wave.append(
                    blocks_group(ranks, [ids[i] for i in docs], pl, loc, div if self.options.divisions > 1 else None)
                )
            plan.waves.append(Wave(sorted(wave, key=lambda g: g.ranks[0])))
        return plan
