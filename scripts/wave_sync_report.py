"""How a run's waves synchronised, from its per-rank history (`wave_timeline` of every step).

For every step: each wave's per-rank time (start to the end of the rank's compute), how far
apart the ranks' wave ends lie, and the step's wall time against two models:
  barrier  sum over waves of the slowest rank's time in the wave (every wave a world barrier),
  free     the slowest rank's own sum over its waves (waves flow freely, one barrier at the end).
A run whose wave ends lie within a few ms while the ranks' times differ by far more, and whose
wall time follows `barrier`, synchronises at every wave (DeepSpeed ZeRO-2 reduces gradients in
every backward). Ranks must share a clock (one host): the timeline is seconds since the epoch.

    python scripts/wave_sync_report.py OUTPUT_DIR [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def load(out: Path):
    files = sorted((out / "cp_history").glob("rank*.jsonl"), key=lambda p: int(p.stem[4:]))
    if not files:
        raise SystemExit(f"{out}: no cp_history/rank*.jsonl")
    runs = [[json.loads(line) for line in f.read_text().splitlines() if line.strip()] for f in files]
    n = min(len(r) for r in runs)
    return [[runs[k][i] for k in range(len(runs))] for i in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="a training run's output_dir")
    p.add_argument("--steps", type=int, default=10, help="steps to print one by one")
    a = p.parse_args()
    steps = load(Path(a.out))
    if any(s.get("wave_timeline") is None for step in steps for s in step):
        raise SystemExit("the history has no wave_timeline (written by CPTrainer since the calibration work)")
    spreads, tails, gaps, over_barrier, over_free, multi = [], [], [], [], [], []
    for i, ranks in enumerate(steps):
        n_waves = ranks[0]["waves"]
        wall = ranks[0]["step_wall_ms"]
        per_rank = [[(c - s) * 1e3 for s, c, _ in r["wave_timeline"]] for r in ranks]
        barrier = sum(max(col) for col in zip(*per_rank))
        free = max(sum(row) for row in per_rank)
        for w in range(n_waves):
            ends = [r["wave_timeline"][w][2] for r in ranks]
            comp_ends = [r["wave_timeline"][w][1] for r in ranks]
            spreads.append((max(ends) - min(ends)) * 1e3)
            tails.append((min(ends) - max(comp_ends)) * 1e3)
            gaps.append(max(col for col in [row[w] for row in per_rank]) - min(row[w] for row in per_rank))
        over_barrier.append(wall - barrier)
        over_free.append(wall - free)
        if n_waves > 1:
            multi.append((barrier, free, wall))
        if i < a.steps:
            waves = " | ".join(
                "w{}: {}".format(w, " ".join(f"{row[w]:6.1f}" for row in per_rank)) for w in range(n_waves)
            )
            print(f"step {i + 1:3d}  wall {wall:7.1f}  barrier {barrier:7.1f}  free {free:7.1f}  ms per rank {waves}")
    med = statistics.median
    print(f"\n{len(steps)} steps, {len(steps[0])} ranks, {sum(len(s[0]['wave_timeline']) for s in steps)} waves")
    print(f"wave ends across ranks: median spread {med(spreads):.1f} ms (max {max(spreads):.1f})")
    print(f"ranks' times within a wave: median difference {med(gaps):.1f} ms (max {max(gaps):.1f})")
    print(f"slowest rank's compute end -> first backward return (reduction, sync): median {med(tails):.1f} ms")
    print(f"wall - barrier model: median {med(over_barrier):.1f} ms; wall - free model: median {med(over_free):.1f} ms")
    apart = [(b, f, w) for b, f, w in multi if b > 1.1 * f]  # steps where the two models disagree
    if apart:
        closer = sum(abs(w - b) < abs(w - f) for b, f, w in apart)
        err_b = med([abs(w - b) / w for b, f, w in apart])
        err_f = med([abs(w - f) / w for b, f, w in apart])
        print(
            f"steps where the models differ by over 10% ({len(apart)} of {len(multi)} with several waves): wall "
            f"closer to the barrier model in {closer}; median |wall - model| / wall: barrier {100 * err_b:.1f}%, "
            f"free {100 * err_f:.1f}%"
        )


if __name__ == "__main__":
    main()
