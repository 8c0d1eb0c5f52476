#!/usr/bin/env python
"""What pricing the vision tower buys a plan (issue 38): on a vision-language length trace, each
full step planned twice by the same balancer, once with the samples' vision work priced
(PlanRequest.vision) and once text-only (the request without it, as the planner priced samples
before), both plans then fitted to the vision memory as the planner fits every plan
(planning/predict.py: fitted_plan, toolkit/vision_memory.py), validated, and evaluated by the
vision-aware simulator (cost/simulate.py with the plan's grids) against the vision-aware charged
lower bound of the step.

    python scripts/bench_vision_planning.py [--world 64] [--steps 4] [--balancers dynamic_cp,wlb,auto]

Default trace: benchmarks/traces/vision_videomme_mix.jsonl (scripts/make_video_trace.py: Video-MME's
published duration buckets; see the traces README). Model: Qwen2.5-VL-7B's dimensions
(hf_cp/configs/models/qwen2.5-vl-7b.json) on the H200 profile, 128K tokens per rank (the trace's
longest clips hold up to 90K tokens of the tower's activations: at 32K they fit no rank), 64K
tokens per rank per step. Predicted times, not measured ones.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from hf_cp.balance.base import PlanRequest
from hf_cp.balance.registry import get_balancer
from hf_cp.balance.toolkit.vision_memory import fit_vision_memory
from hf_cp.cost.dims import VisionDims
from hf_cp.cost.simulate import simulate
from hf_cp.planning.predict import fitted_plan
from hf_cp.planning.setup import PlanningSettings, planning_setup
from hf_cp.samples.plan_inputs import read_plan_inputs
from hf_cp.samples.vision_grids import check_grids

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "benchmarks" / "traces" / "vision_videomme_mix.jsonl"
FULL_STEP = 0.95  # a step holding at least this share of the token budget is a full step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=Path, default=TRACE)
    ap.add_argument("--world", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4, help="full steps per balancer")
    ap.add_argument("--balancers", default="dynamic_cp,wlb,auto")
    ap.add_argument("--model", default="qwen2.5-vl-7b")
    ap.add_argument("--profile", default="h200-qwen2.5-7b")
    ap.add_argument("--max-tokens-per-rank", type=int, default=131072)
    ap.add_argument("--tokens-per-rank-per-step", type=int, default=65536)
    args = ap.parse_args(argv)

    inputs = read_plan_inputs(args.lengths)
    settings = PlanningSettings(
        profile=args.profile,
        model_dims=args.model,
        max_tokens_per_rank=args.max_tokens_per_rank,
        tokens_per_rank_per_step=args.tokens_per_rank_per_step,
    )
    setup = planning_setup(settings, inputs.lengths, args.world, vision=VisionDims.load(args.model))
    cost, cluster = setup.cost, setup.cluster
    grids = check_grids(inputs.vision, dict(enumerate(inputs.lengths)), cost.vision.spatial_merge_size)
    budget = setup.sampler.tokens_per_step
    steps = range(len(setup.sampler.epoch_batches(0)))
    batches = [b for b in map(setup.sampler.__getitem__, steps) if b.tokens >= FULL_STEP * budget][: args.steps]
    print(
        f"{args.lengths.name}: {len(inputs.lengths)} samples, {len(grids)} with images or clips; world {args.world}, "
        f"cap {args.max_tokens_per_rank} tokens/rank, {budget:,} tokens/step, model {args.model}, profile "
        f"{args.profile}; {len(batches)} full steps"
    )
    head = (
        f"{'balancer':<11} {'step':>4} {'samples':>7} {'videos':>6} {'bound ms':>9} {'vision ms':>10} "
        f"{'text ms':>9} {'vision/bd':>9} {'text/bd':>8} {'text/vision':>11}"
    )
    print(head)
    print("-" * len(head))
    for name in args.balancers.split(","):
        balancer = get_balancer(name)
        ratios = []
        for batch in batches:
            step_grids = {s: grids[s] for s in batch.sample_ids if s in grids}
            req = PlanRequest(
                batch.sample_ids, batch.lengths, cluster, cost, seed=settings.seed, step=batch.index, vision=step_grids
            )
            aware_plan = fitted_plan(balancer, req).validate(cluster, cost)
            aware = simulate(aware_plan, cost, cluster)
            text_plan = balancer.plan(replace(req, vision=None))  # priced as text only ...
            text_plan.vision = dict(step_grids)  # ... fitted to the memory, evaluated with its vision work
            text_plan = fit_vision_memory(text_plan, req).validate(cluster, cost)
            text = simulate(text_plan, cost, cluster)
            bound = aware.charged_bound_ms
            videos = sum(1 for s in step_grids if any(g[0] > 1 for g in step_grids[s]))
            ratios.append((aware.makespan_ms / bound, text.makespan_ms / bound))
            print(
                f"{name:<11} {batch.index:>4} {len(batch.sample_ids):>7} {videos:>6} {bound:>9.1f} "
                f"{aware.makespan_ms:>10.1f} {text.makespan_ms:>9.1f} {aware.makespan_ms / bound:>9.3f} "
                f"{text.makespan_ms / bound:>8.3f} {text.makespan_ms / aware.makespan_ms:>11.3f}"
            )
        v = statistics.mean(r[0] for r in ratios)
        t = statistics.mean(r[1] for r in ratios)
        print(f"{name:<11} {'mean':>4} {'':>7} {'':>6} {'':>9} {'':>10} {'':>9} {v:>9.3f} {t:>8.3f} {t / v:>11.3f}")
    print(
        "vision ms / text ms: the step's predicted time when planned with / without the vision tower priced, both "
        "simulated with it; /bd: over the vision-aware charged lower bound"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
