"""Measured per-rank compute balance of real training runs: `auto` beside `static`.

Trains the tiny Llama on the bundled long-tailed dataset with N processes (default 4) once
per balancer, from the same config (configs/bench-4proc-cpu.yaml), and prints per balancer
the measured per-rank compute time of every step (forward+backward of its micro-batches,
ending before the gradient reduction waits), max/mean over ranks, and the step wall time.

    python scripts/bench_train_balance.py [--nproc 4] [--balancers auto static] [--config ...]

On a machine with fewer cores than processes the ranks share cores: absolute times inflate,
and a rank that finishes early frees its core for the others, which understates imbalance.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(balancer: str, nproc: int, config: str, out: Path, extra) -> list:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "-m",
        "hf_cp.train",
        config,
        "--set",
        f"training.cp_balancer={balancer}",
        "--set",
        f"training.output_dir={out}",
    ] + [x for e in extra for x in ("--set", e)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{balancer}: training failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    print(f"  {balancer}: trained in {time.perf_counter() - t0:.0f} s (including start-up)", flush=True)
    return [json.loads(line) for line in (out / "cp_history" / "rank0.jsonl").read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--balancers", nargs="+", default=["auto", "static"])
    p.add_argument("--config", default="configs/bench-4proc-cpu.yaml")
    p.add_argument("--out", default="outputs/bench-train-balance")
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="SECTION.KEY=VALUE")
    a = p.parse_args()
    print(f"bench_train_balance: {a.nproc} processes, config {a.config}, {os.cpu_count()} CPU cores", flush=True)
    rows = {}
    for b in a.balancers:
        rows[b] = run(b, a.nproc, a.config, ROOT / a.out / b, a.extra)
    print()
    print(
        f"{'balancer':>10} {'steps':>5} {'max/mean':>9} {'sum max/sum mean':>16} {'pred max/mean':>13} "
        f"{'max ms/step':>11} {'mean ms/step':>12} {'wall ms/step':>12} {'loss last':>9}"
    )
    for b, hist in rows.items():
        mm = [max(r["measured_ms"]) / statistics.mean(r["measured_ms"]) for r in hist]
        pm = [max(r["predicted_ms"]) / statistics.mean(r["predicted_ms"]) for r in hist]
        smax = sum(max(r["measured_ms"]) for r in hist)
        smean = sum(statistics.mean(r["measured_ms"]) for r in hist)
        print(
            f"{b:>10} {len(hist):>5} {statistics.mean(mm):>9.3f} {smax / smean:>16.3f} {statistics.mean(pm):>13.3f} "
            f"{smax / len(hist):>11.0f} {smean / len(hist):>12.0f} "
            f"{statistics.mean(r['step_wall_ms'] for r in hist):>12.0f} {hist[-1]['loss']:>9.4f}"
        )
    print("max/mean: per step, max over ranks / mean over ranks of measured compute time, averaged over steps")


if __name__ == "__main__":
    main()
