"""Planner throughput with several worker processes (cp_plan_workers).

Steps are planned independently, so W forked workers plan up to W of the look-ahead steps at
once. This times how fast the Planner hands out consecutive planned steps (no training: pure
planning throughput) for W = 1, 2, ... on one length trace at a large world, and checks that
every W gives byte-identical plans.

    python scripts/bench_planner_workers.py --trace longdoc_leval_multiturn --world 512 --workers 1,2
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    from hf_cp.cost.model import CostModel
    from hf_cp.plan.cluster import ClusterSpec
    from hf_cp.planning import GlobalBatchSampler, Planner
    from hf_cp.samples.lengths import read_lengths

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces-dir", default=str(REPO / "benchmarks" / "traces"))
    p.add_argument("--trace", default="longdoc_leval_multiturn")
    p.add_argument("--world", type=int, default=512)
    p.add_argument("--balancer", default="auto")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeat", type=int, default=400, help="concatenate the trace this many times (enough samples)")
    p.add_argument("--workers", default="1,2")
    a = p.parse_args()
    lengths = read_lengths(str(Path(a.traces_dir) / f"{a.trace}.txt")) * a.repeat
    cost = CostModel.load("qwen2.5-7b", "h200-qwen2.5-7b")
    sampler = GlobalBatchSampler(lengths, 65536 * a.world, seed=0, max_steps=a.steps)
    cluster = ClusterSpec(a.world, 32768, 8)
    counts = [int(w) for w in a.workers.split(",")]
    print(
        f"{a.balancer} at world {a.world} on {a.trace} (x{a.repeat}), {a.steps} steps of {65536 * a.world} tokens, "
        f"look-ahead {max(counts)}; {os.cpu_count()} CPU cores\n"
    )
    print("| workers | s per step | speed-up | plans identical |")
    print("|---:|---:|---:|---|")
    base = None
    for w in counts:
        planner = Planner(sampler, a.balancer, cluster, cost, lookahead=max(counts), in_subprocess=True, workers=w)
        t0 = time.perf_counter()
        digests = [planner.get(k).plan.digest() for k in range(len(sampler))]
        per_step = (time.perf_counter() - t0) / len(sampler)
        planner.close()
        base = base or (per_step, digests)
        print(f"| {w} | {per_step:.2f} | {base[0] / per_step:.2f}x | {digests == base[1]} |")


if __name__ == "__main__":
    main()
