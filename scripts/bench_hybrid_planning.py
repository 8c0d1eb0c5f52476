#!/usr/bin/env python
"""How a hybrid's pricing changes its plans (issue 36): Qwen3-Next's full steps planned by `auto`
and `static` under three cost models of the same model, each plan simulated by the cost model it
was planned with:
- *as run*: 12 softmax layers of 48; the 36 Gated DeltaNet layers pass state across a CP group
  (attention/state_passing.py: each member runs its own rows, plus one transition run, and hands
  a few MB of state per piece);
- *gathered*: the same layer mix, the linear layers gathering a spread document whole on every
  member (how Mamba-style layers run, and how Gated DeltaNet ran before state passing);
- *all softmax*: every layer priced as attention.
Then the as-run cost of the plans the other two pricings would choose: what planning with the
wrong model of the hybrid costs.

    python scripts/bench_hybrid_planning.py [--world 64] [--steps 3] [--traces longdoc_leval_multiturn,code_numpy_files]

H200 profile, 32K tokens per rank, 64K tokens per rank per step. Predicted times, not measured.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

from hf_cp.balance.base import PlanRequest
from hf_cp.balance.registry import get_balancer
from hf_cp.cost.model import CostModel
from hf_cp.cost.simulate import simulate
from hf_cp.planning.setup import PlanningSettings, planning_setup
from hf_cp.samples.plan_inputs import read_plan_inputs

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "benchmarks" / "traces"
FULL_STEP = 0.95  # a step holding at least this share of the token budget is a full step


def pricings(cost: CostModel):
    d = cost.dims
    for name, dims in (
        ("as run", d),
        ("gathered", replace(d, passed_state_elements=0, conv_window=0)),
        ("all softmax", replace(d, attention_layers=None, passed_state_elements=0, conv_window=0)),
    ):
        yield name, CostModel(dims, cost.profile, cost.execution)


def spread(plan) -> str:
    sizes = Counter(plan.cp_size_of_samples().values())
    return " ".join(f"{g}:{n}" for g, n in sorted(sizes.items()) if g > 1) or "-"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default="longdoc_leval_multiturn,code_numpy_files")
    ap.add_argument("--world", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="full steps per trace")
    ap.add_argument("--model", default="qwen3-next-80b-a3b")
    ap.add_argument("--profile", default="h200-qwen2.5-7b")
    args = ap.parse_args(argv)
    head = (
        f"{'trace':<26} {'step':>4} {'pricing':<12} {'auto ms':>9} {'static ms':>10} {'gain':>6} "
        f"{'as-run ms':>10} {'spread (size:samples)':<24}"
    )
    print(f"model {args.model}, profile {args.profile}, world {args.world}, cap 32768 tokens/rank, 65536 a rank a step")
    print(head)
    print("-" * len(head))
    for trace in args.traces.split(","):
        lengths = read_plan_inputs(TRACES / f"{trace}.txt").lengths
        settings = PlanningSettings(profile=args.profile, model_dims=args.model, max_tokens_per_rank=32768)
        setup = planning_setup(settings, lengths, args.world)
        budget = setup.sampler.tokens_per_step
        steps = range(len(setup.sampler.epoch_batches(0)))
        batches = [b for b in map(setup.sampler.__getitem__, steps) if b.tokens >= FULL_STEP * budget][: args.steps]
        as_run = setup.cost
        for batch in batches:
            for name, cost in pricings(as_run):
                req = PlanRequest(
                    batch.sample_ids, batch.lengths, setup.cluster, cost, seed=settings.seed, step=batch.index
                )
                auto = get_balancer("auto").plan(req)
                static = get_balancer("static").plan(req)
                a, s = (simulate(p, cost, setup.cluster).makespan_ms for p in (auto, static))
                real = simulate(auto, as_run, setup.cluster).makespan_ms
                print(
                    f"{trace:<26} {batch.index:>4} {name:<12} {a:>9.1f} {s:>10.1f} {s / a:>6.2f} {real:>10.1f} "
                    f"{spread(auto):<24}"
                )
    print(
        "auto ms / static ms: each plan simulated by the pricing it was planned with; gain: static / auto; as-run ms: "
        "auto's plan simulated as hf_cp runs the hybrid (state passing)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
