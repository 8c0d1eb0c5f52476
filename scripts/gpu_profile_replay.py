#!/usr/bin/env python
"""Profile + replay on one GPU: does the fitted cost model predict real per-rank time?

1. `hf-cp profile` on --model's dimensions (default: the h200 profile's, Qwen2.5-7B), one layer;
2. plans of one step of a shared length trace at world 8 with the balancers named in
   --balancers (default auto and static), with the freshly fitted profile;
3. replay of each plan: every rank's fwd+bwd of --layers decoder layers on its shards, one rank
   after the other on this GPU, beside the prediction;
4. one table: per rank predicted and measured time and error; per balancer measured and
   predicted max/mean and the median per-rank prediction error.
Budget: under 5 minutes on one H200. `--smoke` runs the same logic on CPU at toy sizes (the
tiny model, lengths scaled down 16x) so that it is tested without a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRACE = "longdoc_leval_multiturn.txt"


def default_trace() -> str:
    return str(REPO / "benchmarks" / "traces" / TRACE)  # committed with the repository


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, toy sizes: tests the logic")
    p.add_argument("--model", help="model config (default qwen2.5-7b; tiny-llama with --smoke)")
    p.add_argument("--lengths", default=None, help=f"length trace (default: benchmarks/traces/{TRACE})")
    p.add_argument("--length-scale", type=float, help="multiply every length by this (default 1; 1/16 with --smoke)")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--max-tokens-per-rank", type=int, help="default 32768 (512 with --smoke)")
    p.add_argument("--tokens-per-rank-per-step", type=int, help="default 65536 (1024 with --smoke)")
    p.add_argument("--balancers", default="auto,static", help="comma-separated balancer names")
    p.add_argument("--step", type=int, default=0, help="which step of the shuffled trace to plan")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=1, help="decoder layers per micro-batch in the replay")
    p.add_argument("--repeats", type=int, help="timed runs per micro-batch (default 3 on CUDA, 2 with --smoke)")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the profile and results")
    args = p.parse_args(argv)
    smoke = args.smoke
    args.device = "cpu" if smoke else "cuda"
    args.model = args.model or ("tiny-llama" if smoke else "qwen2.5-7b")
    args.lengths = args.lengths or default_trace()
    args.length_scale = args.length_scale or (1 / 16 if smoke else 1.0)
    args.max_tokens_per_rank = args.max_tokens_per_rank or (512 if smoke else 32768)
    args.tokens_per_rank_per_step = args.tokens_per_rank_per_step or (1024 if smoke else 65536)
    args.repeats = args.repeats or (2 if smoke else 3)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from hf_cp.balance import PlanRequest, available_balancers, get_balancer
    from hf_cp.cost.dims import ModelDims
    from hf_cp.cost.hardware import HardwareProfile
    from hf_cp.cost.model import CostModel
    from hf_cp.plan.cluster import ClusterSpec
    from hf_cp.profiling import run_profile, write_profile
    from hf_cp.profiling.layers import DecoderStack
    from hf_cp.profiling.replay import replay_plan
    from hf_cp.samples.lengths import read_lengths, step_batches

    t0 = time.time()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --smoke to test the logic on CPU", file=sys.stderr)
        return 2
    names = [b.strip() for b in args.balancers.split(",") if b.strip()]
    missing = [b for b in names if b not in available_balancers()]
    if missing:
        print(f"unknown balancer(s) {missing}; available: {available_balancers()}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # 1. profile
    result = run_profile(
        args.model,
        device=args.device,
        quick=args.smoke,
        max_tokens=512 if args.smoke else None,
        name=f"{args.device}-{Path(args.model).stem}-fitted",
        log=lambda s: print(s, flush=True),
    )
    profile_path = write_profile(
        result, out / "fitted_profile.yaml", f"scripts/gpu_profile_replay.py {' '.join(sys.argv[1:])}"
    )
    t_profile = time.time() - t0
    print(
        f"profile written to {profile_path} in {t_profile:.0f} s: layer fit R^2 {result.layer_fit.r2:.4f}, "
        f"max rel err {result.layer_fit.max_rel_err:.3f}",
        flush=True,
    )

    # 2. plans of one step of the trace with the fitted profile
    cost = CostModel(ModelDims.load(args.model), HardwareProfile.load(profile_path))
    lengths = [max(1, int(round(n * args.length_scale))) for n in read_lengths(args.lengths)]
    cluster = ClusterSpec(args.world, args.max_tokens_per_rank, cost.profile.gpus_per_node)
    if max(lengths) > cluster.largest_capacity:
        print(
            f"the longest sample ({max(lengths)} tokens) exceeds what {args.world} ranks x "
            f"{args.max_tokens_per_rank} tokens hold; raise --max-tokens-per-rank or lower --length-scale",
            file=sys.stderr,
        )
        return 2
    batches = step_batches(lengths, args.tokens_per_rank_per_step * args.world, seed=args.seed)
    if not 0 <= args.step < len(batches):
        print(f"--step {args.step}: the trace gives {len(batches)} steps", file=sys.stderr)
        return 2
    ids = batches[args.step]
    plans = {}
    for name in names:
        req = PlanRequest(
            sample_ids=ids,
            lengths=[lengths[i] for i in ids],
            cluster=cluster,
            cost=cost,
            seed=args.seed,
            step=args.step,
            dataset_max_length=max(lengths),
        )
        plans[name] = get_balancer(name).plan(req).validate(cluster)

    # 3. replay every plan on this device (on CPU with one thread, as the profile measured)
    if args.device == "cpu":
        torch.set_num_threads(1)
    stack = DecoderStack(args.model, num_layers=args.layers, device=args.device)
    replays = {
        name: replay_plan(plan, stack, cost, repeats=args.repeats, log=lambda s: print(s, flush=True))
        for name, plan in plans.items()
    }

    # 4. one table
    print()
    print(
        f"{args.model} on {result.machine}, {args.layers} layer(s) fwd+bwd per micro-batch, communication "
        f"excluded; step {args.step} of {Path(args.lengths).name} (x{args.length_scale:g}), {len(ids)} samples, "
        f"world {args.world}, cap {args.max_tokens_per_rank} tokens/rank; profile fitted here "
        f"(R^2 {result.layer_fit.r2:.3f})"
    )
    head = (
        f"{'balancer':>10} {'rank':>5} {'mbs':>4} {'tokens':>8} {'predicted ms':>13} {'measured ms':>12} {'error':>7}"
    )
    print(head)
    print("-" * len(head))
    for name, rep in replays.items():
        for r in rep.ranks:
            err = f"{100 * r.error:+6.1f}%" if r.predicted_ms > 0 else f"{'-':>7}"
            print(
                f"{name:>10} {r.rank:>5} {r.micro_batches:>4} {r.tokens:>8} {r.predicted_ms:>13.2f} "
                f"{r.measured_ms:>12.2f} {err}"
            )
        print(
            f"{name:>10} {'all':>5} {sum(r.micro_batches for r in rep.ranks):>4} "
            f"{sum(r.tokens for r in rep.ranks):>8}  max/mean measured {rep.measured_max_over_mean:.3f} "
            f"predicted {rep.predicted_max_over_mean:.3f}; |error| median {100 * rep.median_abs_error:.1f}% "
            f"max {100 * rep.max_abs_error:.1f}%; measured max {max(r.measured_ms for r in rep.ranks):.1f} ms"
        )
        print("-" * len(head))
    print(f"total {time.time() - t0:.0f} s (profile {t_profile:.0f} s)")
    import json

    (out / "replay.json").write_text(json.dumps({n: r.to_dict() for n, r in replays.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
