"""How much a planner thread slows the training thread's op dispatch, by GIL switch interval.

The training thread launches many small torch ops (GPU kernels are launched this way); a
balancer planning ahead on a background thread holds the GIL in pure Python. This times
`--ops` small in-place torch ops on the main thread alone, then while `auto` plans steps of a
shared trace on a background thread, for each switch interval in `--intervals`.

    python scripts/bench_planner_gil.py [--world 64] [--trace wikipedia_flexsp] [--intervals 0.005 0.0005]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    import torch

    from hf_cp.balance import PlanRequest, get_balancer
    from hf_cp.cost.model import CostModel
    from hf_cp.plan.cluster import ClusterSpec
    from hf_cp.samples.lengths import read_lengths, step_batches

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=64)
    p.add_argument("--trace", default="wikipedia_flexsp")
    p.add_argument("--traces-dir", default=str(REPO / "benchmarks" / "traces"))
    p.add_argument("--balancer", default="auto")
    p.add_argument("--ops", type=int, default=30000)
    p.add_argument("--intervals", type=float, nargs="+", default=[0.005, 0.0005])
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    cluster = ClusterSpec(a.world, 32768, 8)
    cost = CostModel.load("qwen2.5-7b", "h200-qwen2.5-7b")
    lengths = [n for n in read_lengths(Path(a.traces_dir) / f"{a.trace}.txt") if n <= cluster.largest_capacity]
    batches = step_batches(lengths, 65536 * a.world, seed=0)
    balancer = get_balancer(a.balancer)
    x = torch.zeros(16)

    def dispatch() -> float:
        t0 = time.perf_counter()
        for _ in range(a.ops):
            x.add_(1.0)
        return time.perf_counter() - t0

    def plan(k: int) -> None:
        ids = batches[k % len(batches)]
        balancer.plan(
            PlanRequest(ids, [lengths[i] for i in ids], cluster, cost, seed=0, step=k, dataset_max_length=max(lengths))
        )

    t0 = time.perf_counter()
    plan(0)
    plan_alone = time.perf_counter() - t0
    print(
        f"{a.balancer} at world {a.world} on {a.trace}: one plan alone {plan_alone * 1e3:.0f} ms; "
        f"{a.ops} small torch ops on the main thread"
    )
    print(f"{'switch interval':>16} {'ops alone s':>12} {'ops, planner busy s':>20} {'slowdown':>9}")
    default = sys.getswitchinterval()
    for interval in a.intervals:
        sys.setswitchinterval(interval)
        alone = min(dispatch() for _ in range(3))
        stop = threading.Event()

        def loop(stop=stop):
            k = 1
            while not stop.is_set():
                plan(k)
                k += 1

        th = threading.Thread(target=loop, daemon=True)
        th.start()
        time.sleep(0.2)
        busy = dispatch()
        stop.set()
        th.join()
        print(f"{interval * 1e3:13.2f} ms {alone:12.3f} {busy:20.3f} {busy / alone:8.1f}x")
    sys.setswitchinterval(default)
    return 0


if __name__ == "__main__":
    sys.exit(main())
