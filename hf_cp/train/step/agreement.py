"""Agreement between ranks: the exchange that opens every training step, and collective failures
that name where they happened.

Ranks that disagree about a step's plan would issue collectives on different groups and hang.
Each step, before its first collective, every rank compares a fingerprint of its plan with all
others (one small all_gather); a mismatch is an error that names the step and the ranks. The
same exchange carries one flag per rank, so that a rank-local event (a SIGTERM seen by any rank,
checkpoint/stop_signal.py) becomes a decision every rank takes at the same step, at no extra collective,
and a payload, the online calibration's new coefficients, of which every rank adopts rank 0's
(measure/online_calibration.py). A balancer whose plans may depend on timing (balancer.timing_dependent:
a solver's time limit or deadline) makes ranks that disagree run the first rank's plan instead
of failing (PlanAgreement).
"""

from __future__ import annotations

import contextlib
import logging
import struct
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from hf_cp.cost.model import CostModel
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import StepPlan
from hf_cp.train.data.collator import PlanCollator, RankStep

logger = logging.getLogger(__name__)


class PlanDisagreementError(RuntimeError):
    """Ranks hold different plans for the same step."""


class CollectiveStallError(RuntimeError):
    """A collective failed or timed out inside a planned wave."""


def _digest_tensor(digest: str, flag: bool, payload: Sequence[float] = ()):
    import torch

    raw = bytes.fromhex(digest)[:8].ljust(8, b"\0") + bytes([int(bool(flag))])
    raw += struct.pack(f"<{len(payload)}d", *payload)
    return torch.tensor(list(raw), dtype=torch.uint8)


def _exchange(
    digest: str, flag: bool, group, payload: Sequence[float] = ()
) -> Optional[Tuple[List[str], List[int], List[List[float]]]]:
    """Every rank's digest (first 8 bytes, hex), the ranks that raised `flag` and every rank's
    `payload` (floats; as many on every rank), from one all_gather; None without a group of
    several ranks."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None
    mine = _digest_tensor(digest, flag, payload)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    n = len(payload)
    payloads = [list(struct.unpack(f"<{n}d", bytes(t[9:].tolist()))) for t in gathered]
    return [bytes(t[:8].tolist()).hex() for t in gathered], [r for r, t in enumerate(gathered) if int(t[8])], payloads


def _who_holds_what(digests: List[str], noun: str) -> Optional[str]:
    """'ranks [0, 1] hold <noun> ab..; ranks [2] hold <noun> cd..' when the digests differ."""
    if len(set(digests)) == 1:
        return None
    by_digest: Dict[str, List[int]] = defaultdict(list)
    for r, d in enumerate(digests):
        by_digest[d].append(r)
    return "; ".join(f"ranks {ranks} hold {noun}{d}" for d, ranks in sorted(by_digest.items(), key=lambda x: x[1]))


def assert_plans_agree(digest: str, step: int, group=None, phase: str = "step", flag: bool = False) -> List[int]:
    """All ranks of `group` (default: world) must pass the same plan digest for `step` (named
    "{phase} {step}" in the error; the trainer passes the Trainer's 1-based global step).
    Returns the ranks (of `group`) that passed `flag=True`."""
    return agree_on_step(digest, step, group, phase, flag)[0]


def agree_on_step(
    digest: str, step: int, group=None, phase: str = "step", flag: bool = False, payload: Sequence[float] = ()
) -> Tuple[List[int], List[float]]:
    """assert_plans_agree, carrying a payload in the same exchange: returns the flagged ranks and
    the payload of the group's first rank, which every rank then adopts (the online calibration's
    coefficients: fitted alike on every rank, taken from one so that no last bit differs).
    Every rank must pass a payload of the same length."""
    got = _exchange(digest, flag, group, payload)
    if got is None:
        return ([0] if flag else []), list(payload)
    digests, flagged, payloads = got
    groups = _who_holds_what(digests, "plan ")
    if groups:
        raise PlanDisagreementError(
            f"{phase} {step}: ranks disagree about the plan ({groups}). Plans must be a pure function of "
            f"(lengths, cluster, cost model, seed, step); check that every rank uses the same dataset, "
            f"config, profile and seed"
        )
    return flagged, payloads[0]


def agree_on_plan(
    plan_json: str, digest: str, step: int, group=None, flag: bool = False, adopt_first: bool = False
) -> Tuple[Optional[str], List[int]]:
    """assert_plans_agree, except that with `adopt_first` ranks that disagree adopt the plan of
    the group's first rank instead of failing: for balancers whose plans may depend on timing
    (a solver's time limit or deadline, balancer.timing_dependent), where ranks that planned the
    same step can legitimately differ. Returns (the first rank's plan JSON when this rank's
    plan differs from it, else None; the ranks that raised `flag`). Costs one broadcast, only
    on a step whose plans differ."""
    return agree_on_plan_and_payload(plan_json, digest, step, group, flag, adopt_first)[:2]


def agree_on_plan_and_payload(
    plan_json: str,
    digest: str,
    step: int,
    group=None,
    flag: bool = False,
    adopt_first: bool = False,
    payload: Sequence[float] = (),
) -> Tuple[Optional[str], List[int], List[float]]:
    """agree_on_plan, carrying a payload in the same exchange (as agree_on_step): returns also the
    payload of the group's first rank, which every rank adopts."""
    got = _exchange(digest, flag, group, payload)
    if got is None:
        return None, ([0] if flag else []), list(payload)
    digests, flagged, payloads = got
    groups = _who_holds_what(digests, "plan ")
    if not groups:
        return None, flagged, payloads[0]
    if not adopt_first:
        raise PlanDisagreementError(
            f"step {step}: ranks disagree about the plan ({groups}). Plans must be a pure function of "
            f"(lengths, cluster, cost model, seed, step); check that every rank uses the same dataset, "
            f"config, profile and seed"
        )
    import torch.distributed as dist

    box = [plan_json]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return (box[0] if digests[dist.get_rank(group)] != digests[0] else None), flagged, payloads[0]


class DataDisagreementError(RuntimeError):
    """Ranks loaded different training data."""


def assert_data_agrees(digest: str, name: str, group=None) -> None:
    """Once at start-up: every rank of `group` must have loaded the same data (`digest` of it).
    Per-step plan digests catch other lengths; this catches the same lengths with other tokens
    or targets (another tokeniser version or prompt masking on one node's copy)."""
    got = _exchange(digest, False, group)
    groups = _who_holds_what(got[0], "") if got is not None else None
    if groups:
        raise DataDisagreementError(
            f"ranks loaded different {name} ({groups}): every rank must read the same preprocessed data "
            f"(same files, tokeniser and prompt masking)"
        )


# what a collective that timed out or lost its peer says (gloo and NCCL alike)
COLLECTIVE_FAILURE_TEXTS = ("timed out", "timeout", "connection", "gloo", "nccl", "closed")


def is_collective_failure(e: BaseException) -> bool:
    """Whether `e` is a collective that failed or stalled (a peer died, stopped or was slow)."""
    return isinstance(e, RuntimeError) and any(k in str(e).lower() for k in COLLECTIVE_FAILURE_TEXTS)


@contextlib.contextmanager
def collective_scope(
    step: int, wave: int, group_ranks: Sequence[int], what: str = "micro-batch", phase: str = "step"
) -> Iterator[None]:
    """Re-raise a failed or timed-out collective with the step, wave and group it belongs to.

    Inside a wave a rank issues its CP group's collectives (attention) and, in backward, the
    data-parallel gradient reduction over all ranks; a one-rank group has only the latter.
    """
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, (PlanDisagreementError, CollectiveStallError)):
            raise
        text = str(e)
        if is_collective_failure(e):
            ranks = list(group_ranks)
            where = (
                f"the gradient reduction over all ranks during the local {what} of rank {ranks[0]}"
                if len(ranks) == 1
                else f"a collective of the {what} on CP group {ranks} (or the gradient reduction over all "
                f"ranks in its backward)"
            )
            raise CollectiveStallError(
                f"{phase} {step}, wave {wave}: {where} failed or stalled: "
                f"{text.splitlines()[0] if text else type(e).__name__}. A rank that died names the cause in its "
                f"own log; a rank that was only slow needs a larger ddp_timeout"
            ) from e
        raise


@dataclass
class Agreed:
    """What every rank agreed on for one step."""

    step: RankStep  # the step to run: this rank's, or rank 0's plan where this rank planned otherwise
    flagged: List[int]  # the ranks that raised the stop flag
    payload: List[float]  # rank 0's payload


class PlanAgreement:
    """Agreement over `group` (the control group of every rank). `collator` builds this rank's
    share of rank 0's plan when it is adopted; `cluster` and `cost` validate that plan."""

    def __init__(self, group, cluster: ClusterSpec, cost: CostModel, rank: int, collator: PlanCollator):
        self.group, self.cluster, self.cost, self.rank, self.collator = group, cluster, cost, rank, collator

    def agree(self, step: RankStep, balancer, flag: bool, payload: Sequence[float]) -> Agreed:
        """Agree on `step` (errors count steps as the Trainer does, from 1); `balancer`: the
        planner's (its `timing_dependent` decides whether disagreeing ranks adopt rank 0's plan)."""
        adopt = bool(getattr(balancer, "timing_dependent", False))
        plan_json = step.plan.to_json() if adopt else ""
        theirs, flagged, adopted = agree_on_plan_and_payload(
            plan_json,
            step.plan.digest(),
            step.index + 1,
            group=self.group,
            flag=flag,
            adopt_first=adopt,
            payload=payload,
        )
        if theirs is not None:  # this rank planned otherwise (a solver's time limit): run rank 0's plan
            plan = StepPlan.from_json(theirs, f"step {step.index + 1}: rank 0's plan")
            plan.validate(self.cluster, self.cost)
            logger.warning(
                "hf_cp: step %d: rank %d planned this step otherwise (%s depends on timing); running rank 0's plan",
                step.index + 1,
                self.rank,
                step.plan.balancer,
            )
            step = self.collator.rank_step(plan, self.rank, step.global_valid_tokens, step.epoch, step.planned)
        return Agreed(step, flagged, adopted)
