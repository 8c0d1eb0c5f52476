"""Compare two folders written by scripts/plan_snapshot.sh: the plans and every per-step metric
but the planner's own CPU time must be identical.

    python scripts/diff_plans.py BEFORE_DIR AFTER_DIR
"""

import json
import sys
from pathlib import Path

TIMING = {"planner_ms"}  # measured, not planned: differs from run to run


def strip(metrics):
    return [{k: v for k, v in m.items() if k not in TIMING} for m in metrics]


def main(before: str, after: str) -> int:
    names = sorted(p.name for p in Path(before).glob("*.json"))
    if not names:
        print(f"no plans in {before}")
        return 2
    differ = 0
    for name in names:
        b = json.loads((Path(before) / name).read_text())
        a_path = Path(after) / name
        if not a_path.exists():
            print(f"{name}: missing in {after}")
            differ += 1
            continue
        a = json.loads(a_path.read_text())
        same_plans = b["plans"] == a["plans"]
        same_metrics = strip(b["metrics"]) == strip(a["metrics"])
        print(
            f"{name}: plans {'identical' if same_plans else 'DIFFER'}, metrics {'identical' if same_metrics else 'DIFFER'}"
        )
        differ += not (same_plans and same_metrics)
    print(f"{len(names) - differ} of {len(names)} identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
