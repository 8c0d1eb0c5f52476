"""The process-group registry: every CP group a plan may use, built once at start-up.

`dist.new_group` is itself a collective over the whole world, so every rank builds every
group of `cluster.all_groups()` in the same order, whether or not it is a member. At run time
the trainer only looks groups up.

A cluster with `any_size_groups` registers every contiguous run of ranks inside a node as well
(ClusterSpec.all_groups: the aligned blocks first, then the other runs), so groups of 3, 5, 6
or 7 ranks are looked up here like the others. That is 28 groups per node of 8 instead of 7
(plus the blocks larger than a node), which is why the registry holds them only when a
planner asks for them.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Dict, Optional, Tuple

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d  # torch's group defaults live there

from hf_cp.plan.cluster import ClusterSpec

CONTROL_GROUP_DESC = "hf_cp control: plan agreement and metrics"


def cp_group_desc(ranks) -> str:
    return f"hf_cp CP group {list(ranks)}"


def bound_every_group(timeout: timedelta) -> int:
    """Make `timeout` bound every collective of this process: the groups that exist (DeepSpeed's
    clone of the world group and its data-parallel groups, when DeepSpeed was set up first)
    and those made later without a timeout of their own. DeepSpeed makes its groups with
    torch's default (30 min on gloo), not ddp_timeout: a rank stalled while the others waited
    in the ZeRO gradient reduction held them 30 min instead of failing at ddp_timeout.
    Returns how many existing groups were bounded."""
    # groups made from now on without a timeout (torch reads these module defaults)
    c10d.default_pg_timeout = timeout
    if hasattr(c10d, "default_pg_nccl_timeout") and c10d.default_pg_nccl_timeout is not None:
        c10d.default_pg_nccl_timeout = timeout
    bounded = 0
    for group in list(c10d._world.pg_map):
        try:
            c10d._set_pg_timeout(timeout, group)
            bounded += 1
        except (ValueError, RuntimeError, AssertionError):  # not a member, or a backend without timeouts
            continue
    return bounded


class CPGroups:
    def __init__(self, cluster: ClusterSpec, backend: Optional[str] = None, timeout: Optional[timedelta] = None):
        """`timeout`: how long any collective of these groups may wait before it fails (the
        training run's `ddp_timeout`); None keeps torch's default."""
        self.cluster = cluster
        self._groups: Dict[Tuple[int, ...], object] = {}
        self.control = None
        if cluster.world_size == 1:
            return
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"CPGroups: a world of {cluster.world_size} ranks needs torch.distributed initialised first"
            )
        if dist.get_world_size() != cluster.world_size:
            raise RuntimeError(
                f"CPGroups: torch.distributed has {dist.get_world_size()} ranks, the cluster spec {cluster.world_size}"
            )
        if timeout is not None:
            bound_every_group(timeout)
        # CPU-side agreement checks and metrics (plan digests, per-rank timings) go over gloo
        # whatever the default backend is: NCCL cannot carry CPU tensors
        # named groups: NCCL's watchdog and flight recorder print the description, so a timeout
        # there says which CP group stalled, as CollectiveStallError does on gloo
        self.control = dist.new_group(
            list(range(cluster.world_size)), backend="gloo", timeout=timeout, group_desc=CONTROL_GROUP_DESC
        )
        for ranks in cluster.all_groups():
            self._groups[ranks] = dist.new_group(
                list(ranks), backend=backend, timeout=timeout, group_desc=cp_group_desc(ranks)
            )

    def get(self, ranks) -> Optional[object]:
        """The process group of `ranks` (None for a single rank: no communication)."""
        ranks = tuple(ranks)
        if len(ranks) == 1:
            return None
        if ranks not in self._groups:
            raise KeyError(
                f"group {list(ranks)} is not in the registry (built: {len(self._groups)} groups of sizes "
                f"{sorted({len(r) for r in self._groups})})"
            )
        return self._groups[ranks]

    def __len__(self) -> int:
        return len(self._groups)
