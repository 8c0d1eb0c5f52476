"""`hf-cp replay`: run a plan's per-rank compute on this device, next to the cost model's prediction."""

from __future__ import annotations

import json
from pathlib import Path

from hf_cp.cli.formatting import HelpFormatter
from hf_cp.cost.model import CostModel


def add_parser(sub) -> None:
    p = sub.add_parser(
        "replay",
        help="run each rank's compute of a plan on this device and compare with the prediction",
        description="Run every rank's assigned compute of one step plan (fwd+bwd of --layers decoder layers of "
        "--model on the rank's local documents and shards, communication excluded) one rank after "
        "the other on one device; print measured time per rank beside the cost model's prediction, "
        "measured max/mean and the per-rank prediction error.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("plan", metavar="PLAN.json", help="output of `hf-cp plan --json`, a list of plans, or one plan")
    p.add_argument(
        "--model",
        required=True,
        help="model config: a model name (configs/models/ here, then built in), a config.json, or a model folder",
    )
    p.add_argument(
        "--profile", help="hardware profile for the prediction (default: cpu on CPU, h200-qwen2.5-7b on CUDA)"
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    p.add_argument("--step", type=int, help="which step of the file to replay (default: the first plan)")
    p.add_argument(
        "--layers",
        type=int,
        default=1,
        help="decoder layers to run per micro-batch (the prediction is for the same number)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per micro-batch (median on CUDA, minimum on CPU)")
    p.add_argument("--threads", type=int, help="CPU threads (default 1, as `hf-cp profile` measures)")
    p.add_argument("--json", metavar="OUT", help="write the per-rank results as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from hf_cp.profiling.layers import DecoderStack  # torch, transformers
    from hf_cp.profiling.replay import format_replay, load_plans, replay_plan, select_plan  # torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here; use --device cpu")
    if device == "cpu":
        torch.set_num_threads(args.threads or 1)
    if args.layers < 1 or args.repeats < 1:
        raise ValueError(f"--layers ({args.layers}) and --repeats ({args.repeats}) must be at least 1")
    profile = args.profile or ("cpu" if device == "cpu" else "h200-qwen2.5-7b")
    cost = CostModel.load(args.model, profile)
    plan = select_plan(load_plans(args.plan), args.step, source=args.plan)
    stack = DecoderStack(args.model, num_layers=args.layers, device=device)
    result = replay_plan(plan, stack, cost, repeats=args.repeats, log=print)
    print(format_replay(result))
    if args.json:
        Path(args.json).write_text(
            json.dumps(result.to_dict() | {"profile": profile, "model": str(args.model)}, indent=1)
        )
        print(f"wrote {args.json}")
    return 0
