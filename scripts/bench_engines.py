"""The main job's throughput under each parameter engine, side by side: the README's tiny CPU
job (configs/tiny-cpu.yaml, DeepSpeed ZeRO-2) against the same job under FSDP2
(configs/tiny-cpu-fsdp2.yaml) and, optionally, ZeRO-3 (tiny-cpu.yaml with
recipes/ds-zero3-cpu.json), each launched with accelerate on 2 CPU processes, in alternating
order `--rounds` times (this machine is noisy: the ratio is taken within each round). Prints
the tokens/s of the run summary and the ratio to ZeRO-2.

    python scripts/bench_engines.py [--rounds 2] [--engines zero2,fsdp2,zero3] [--max-steps 24]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINES = {
    "zero2": ["recipes/cpu-2proc-zero2.yaml", "configs/tiny-cpu.yaml"],
    "fsdp2": ["recipes/cpu-2proc-fsdp2.yaml", "configs/tiny-cpu-fsdp2.yaml"],
    "zero3": [
        "recipes/cpu-2proc-zero2.yaml",
        "configs/tiny-cpu.yaml",
        "--set",
        "training.deepspeed=recipes/ds-zero3-cpu.json",
    ],
}
TOKENS_S = re.compile(r"steps \d+, samples \d+, tokens \d+, (\d+) tokens/s")


def run_job(engine: str, max_steps: int, out: str) -> float:
    launch, config, *extra = ENGINES[engine]
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        launch,
        "-m",
        "hf_cp.train",
        config,
        *extra,
        "--set",
        f"training.max_steps={max_steps}",
        "--set",
        f"training.output_dir={out}/{engine}",
        "--set",
        "training.eval_strategy=no",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    found = TOKENS_S.search(done.stdout + done.stderr)
    if done.returncode or not found:
        raise RuntimeError(f"{engine}: the job failed (rc {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return float(found.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--engines", default="zero2,fsdp2")
    ap.add_argument("--max-steps", type=int, default=24)
    ap.add_argument("--out", default="outputs/bench-engines")
    a = ap.parse_args()
    engines = a.engines.split(",")
    if engines[0] != "zero2":
        ap.error("--engines must start with zero2 (the reference of the ratios)")
    rows = {e: [] for e in engines}
    for r in range(a.rounds):
        order = engines if r % 2 == 0 else engines[::-1]
        for e in order:
            rows[e].append(run_job(e, a.max_steps, a.out))
            print(f"round {r + 1}: {e} {rows[e][-1]:.0f} tokens/s", file=sys.stderr, flush=True)
    print(
        f"main job (configs/tiny-cpu*.yaml), {a.max_steps} steps, 2 CPU processes, {a.rounds} rounds in alternating order"
    )
    print(f"{'engine':7} {'tokens/s per round':>28} {'median':>8} {'x ZeRO-2 (per round, median)':>30}")
    for e in engines:
        ratios = [x / z for x, z in zip(rows[e], rows["zero2"])]
        per_round = " ".join(f"{x:.0f}" for x in rows[e])
        print(f"{e:7} {per_round:>28} {statistics.median(rows[e]):8.0f} {statistics.median(ratios):30.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
