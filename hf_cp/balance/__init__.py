"""Balancers: pluggable planners of one optimizer step, found by name.

`registry.py` finds them by name, `base.py` is the protocol every balancer follows (a
`PlanRequest` in, a `StepPlan` out), `options.py` checks their options, `auto.py` plans with
every member and keeps the fastest plan. Each built-in balancer is one module of
`balancers/` that registers itself; `toolkit/` holds what several of them share (packing,
assignment, CP sizes, bounds, pricing, placement, waves, deadlines).
"""

from __future__ import annotations

# Importing the package registers every built-in balancer (balancers/ imports each of its
# modules) and `auto`, which plans with them.
from hf_cp.balance import auto, balancers, hierarchical  # noqa: F401
from hf_cp.balance.base import (
    Balancer,
    PlanRequest,
    SampleTooLongError,
    UnsupportedMaskError,
    check_mask_support,
    max_member_tokens,
)
from hf_cp.balance.options import BalancerOptionError, BalancerOptions, OptionHelp, options_of, parse_assignments
from hf_cp.balance.registry import (
    auto_member_balancers,
    available_balancers,
    balancer_options,
    balancers_handling_masks,
    describe_options,
    get_balancer,
    register_balancer,
)

__all__ = [
    "Balancer",
    "BalancerOptionError",
    "BalancerOptions",
    "OptionHelp",
    "PlanRequest",
    "SampleTooLongError",
    "UnsupportedMaskError",
    "auto_member_balancers",
    "available_balancers",
    "balancer_options",
    "balancers_handling_masks",
    "check_mask_support",
    "describe_options",
    "get_balancer",
    "max_member_tokens",
    "options_of",
    "parse_assignments",
    "register_balancer",
]
