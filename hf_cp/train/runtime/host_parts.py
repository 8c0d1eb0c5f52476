"""The exchange of a step's host-by-host plan parts (`cp_balancer: hierarchical`, its option
plan_own_host; issue 39).

With hierarchical planning over several hosts, the first rank of each host plans only that
host's parts of a step (Planner.plan_own_host: the first pass, the blocks of hosts it owns,
its own samples) in its planner worker, ahead of training. Where the trainer takes a step
(Planner.get, in the training process, before the step's plan agreement), every rank calls
the exchange for the next step (and for this one when it was not exchanged yet: the first
step, a resumed one, one after a new cost model): one all_gather_object over the control
group (gloo, CPU), in which each host's first rank sends its parts and every other rank None.
Every rank then merges the same parts into the same whole-world StepPlan (Planner.merge, on
the planner worker while the step before trains), validated and simulated as any plan. A
host with no samples still sends its (empty) parts, so that every rank issues the collective
at every such step, and a host whose planning failed sends the error, which every rank raises
naming the host.

What it costs: all_gather_object pads every rank's message to the longest one, so each rank
receives world x the largest host's parts (pickled waves and groups only, not the request):
measured 1.5 MB a step at 512 ranks of chat samples (64 hosts, 32K samples; 3 KB per host,
185 KB for all of them, against the whole plan's 0.6 MB of JSON) and 13 MB at 4096 ranks of
code (docs/balancers.md).
"""

from __future__ import annotations

from typing import List, Optional

import torch.distributed as dist

from hf_cp.balance.hierarchical import HostParts
from hf_cp.planning.worker import PartsExchange


class HostPartsExchangeError(RuntimeError):
    """The exchange of a step's host plan parts failed (a rank died, stopped or timed out)."""


def host_parts_exchange(group) -> PartsExchange:
    """The exchange over `group` (the control group of every rank) that Planner.plan_own_host
    takes: (step index, this rank's host's parts or None) -> every rank's, in rank order. A
    failed collective is re-raised naming the step, counted from 1 as the Trainer counts."""

    def exchange(index: int, parts: Optional[HostParts]) -> List[Optional[HostParts]]:
        every: List[Optional[HostParts]] = [None] * dist.get_world_size(group)
        try:
            dist.all_gather_object(every, parts, group=group)
        except RuntimeError as e:
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise HostPartsExchangeError(
                f"step {index + 1}: exchanging the hosts' plan parts (cp_balancer hierarchical, plan_own_host) "
                f"failed: {text}. A rank that died names the cause in its own log; a rank that was only slow needs "
                "a larger ddp_timeout; cp_balancer_options plan_own_host: false plans every host on every rank"
            ) from e
        return every

    return exchange
