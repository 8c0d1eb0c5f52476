#!/usr/bin/env bash
# Plans of every committed length trace (worlds 64 and 512, auto and static, 3 steps; H200 profile,
# Qwen2.5-7B, 32K tokens per rank, 64K per rank per step) written as JSON into OUT_DIR, so that a
# refactor can be checked for unchanged plans: run it before and after, then
#   python scripts/diff_plans.py BEFORE_DIR AFTER_DIR
#   scripts/plan_snapshot.sh OUT_DIR [PYTHON]
set -euo pipefail
out=$1
python=${2:-python}
repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
for trace in "$repo"/benchmarks/traces/*.txt "$repo"/benchmarks/traces/*.jsonl; do
  name=$(basename "${trace%.*}")
  for world in 64 512; do
    for balancer in auto static; do
      "$python" -m hf_cp plan --profile h200-qwen2.5-7b --model qwen2.5-7b --lengths "$trace" \
        --world "$world" --max-tokens-per-rank 32768 --tokens-per-rank-per-step 65536 --steps 3 \
        --balancer "$balancer" --progress off --json "$out/$name-w$world-$balancer.json" > "$out/$name-w$world-$balancer.txt"
    done
  done
done
