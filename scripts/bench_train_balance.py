"""Measured wall clock of real training runs: `auto` beside `static` (and any other balancer).

Trains the tiny Llama on the bundled long-tailed dataset with N processes (default 4) from one
config (default configs/bench-4proc-cpu.yaml), once per balancer per round, alternating the
order every round (A B, B A, A B, ...) so that a machine whose load drifts favours no balancer.
Per run it prints the measured tokens/s and step wall time (the slowest rank's training step,
waves and optimizer included), the predicted step time and how far it is from the measured
one on the steps planned after online calibration, and per-rank compute balance; then per
balancer the median over rounds with the spread, and the ratios auto/other measured side by
side in the same round.

    python scripts/bench_train_balance.py [--nproc 4] [--balancers auto static] [--rounds 3]
        [--config configs/bench-4proc-cpu.yaml] [--set training.num_train_epochs=3]

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
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.log").write_text(proc.stdout + proc.stderr)  # the calibration lines and the summary
    if proc.returncode != 0:
        sys.exit(f"{balancer}: training failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    print(f"  {balancer}: trained in {time.perf_counter() - t0:.0f} s (including start-up)", flush=True)
    return [json.loads(line) for line in (out / "cp_history" / "rank0.jsonl").read_text().splitlines()]


def run_metrics(hist: list) -> dict:
    """One run's numbers from its step records (rank 0's history: every record is global)."""
    wall_s = sum(r["step_wall_ms"] for r in hist) / 1e3
    calibrated = [r for r in hist if r.get("calibration", 0) > 0]
    tracked = calibrated or hist
    mm = [max(r["measured_ms"]) / statistics.mean(r["measured_ms"]) for r in hist]
    return {
        "steps": len(hist),
        "tokens_per_s": sum(r["global_tokens"] for r in hist) / wall_s,
        "wall_ms": statistics.mean(r["step_wall_ms"] for r in hist),
        "waves": statistics.mean(r["waves"] for r in hist),
        "max_over_mean": statistics.mean(mm),
        "calibrated_steps": len(calibrated),
        # on the steps planned with the calibrated model (all steps when none was)
        "predicted_ms": statistics.mean(r["predicted_step_ms"] for r in tracked),
        "measured_ms": statistics.mean(r["step_wall_ms"] for r in tracked),
        "tracking_err": statistics.median(
            abs(r["predicted_step_ms"] - r["step_wall_ms"]) / r["step_wall_ms"] for r in tracked
        ),
        "loss_last": hist[-1]["loss"],
    }


def spread(values) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--balancers", nargs="+", default=["auto", "static"])
    p.add_argument("--rounds", type=int, default=3, help="runs per balancer, alternating the order every round")
    p.add_argument("--config", default="configs/bench-4proc-cpu.yaml")
    p.add_argument("--out", default="outputs/bench-train-balance")
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="SECTION.KEY=VALUE")
    a = p.parse_args()
    print(
        f"bench_train_balance: {a.nproc} processes, config {a.config}, {a.rounds} rounds, {os.cpu_count()} CPU cores"
        + "".join(f", --set {e}" for e in a.extra),
        flush=True,
    )
    results = {b: [] for b in a.balancers}
    print(
        f"{'round':>5} {'balancer':>10} {'steps':>5} {'tokens/s':>9} {'wall ms/step':>12} {'waves':>5} "
        f"{'max/mean':>8} {'calibrated':>10} {'pred ms':>8} {'meas ms':>8} {'pred err':>8} {'loss last':>9}"
    )
    for k in range(a.rounds):
        order = a.balancers if k % 2 == 0 else list(reversed(a.balancers))
        for b in order:
            m = run_metrics(run(b, a.nproc, a.config, ROOT / a.out / f"{b}-{k}", a.extra))
            results[b].append(m)
            print(
                f"{k:>5} {b:>10} {m['steps']:>5} {m['tokens_per_s']:>9.0f} {m['wall_ms']:>12.0f} {m['waves']:>5.2f} "
                f"{m['max_over_mean']:>8.3f} {m['calibrated_steps']:>10} {m['predicted_ms']:>8.0f} "
                f"{m['measured_ms']:>8.0f} {100 * m['tracking_err']:>7.1f}% {m['loss_last']:>9.4f}",
                flush=True,
            )
    print()
    print("median over rounds [min-max]:")
    for b, ms in results.items():
        print(
            f"  {b:>10}: tokens/s {spread([m['tokens_per_s'] for m in ms])}, wall ms/step "
            f"{spread([m['wall_ms'] for m in ms])}, predicted-vs-measured step error (calibrated steps) "
            f"{spread([m['tracking_err'] for m in ms])}"
        )
    first = a.balancers[0]
    for other in a.balancers[1:]:
        ratios = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(results[first], results[other])]
        walls = [y["wall_ms"] / x["wall_ms"] for x, y in zip(results[first], results[other])]
        print(
            f"  {first}/{other} tokens/s per round: {' '.join(f'{r:.3f}' for r in ratios)} (median "
            f"{statistics.median(ratios):.3f}); {other}/{first} wall ms/step: {spread(walls)}"
        )
    print(
        "wall ms/step: the slowest rank's training step (agreement, waves, gradient reductions, optimizer); "
        "pred err: median |predicted - measured| / measured step time over the steps planned after online "
        "calibration (all steps when none were); max/mean: per-rank measured compute, averaged over steps"
    )


if __name__ == "__main__":
    main()
