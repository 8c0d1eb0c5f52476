"""`hf-cp profile`: fit the cost model on this device and write a profile the planner loads."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from hf_cp.cli.formatting import HelpFormatter


def add_parser(sub) -> None:
    p = sub.add_parser(
        "profile",
        help="measure one decoder layer on this device and write a hardware profile (YAML)",
        description="Time one decoder layer of --model (built from its config with random weights, nothing is "
        "downloaded) and its attention over document compositions, query-chunk lengths and head "
        "splits; fit the cost model's c1 (per token), c2 (per causal pair) and c0 (per micro-batch); "
        "print the fit quality and write a profile for `hf-cp plan --profile`.",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--model",
        required=True,
        help="model config: a model name (configs/models/ here, then built in), a config.json, or a model folder",
    )
    p.add_argument("--out", required=True, metavar="PROFILE.yaml", help="where to write the profile")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer points (about a third of the time)")
    p.add_argument(
        "--max-tokens",
        type=int,
        help="longest composition in tokens (default: adaptive, up to 32768 on CUDA and 2048 on CPU)",
    )
    p.add_argument("--threads", type=int, help="CPU threads (default 1 on CPU: steadier timings on shared machines)")
    p.add_argument("--name", help="profile name (default: derived from the device and model)")
    p.add_argument(
        "--min-r2",
        type=float,
        default=0.0,
        help="exit with status 3 when the layer fit's R^2 is below this (the profile is still written)",
    )
    p.add_argument(
        "--deepspeed",
        metavar="DS_CONFIG.json",
        help="also measure the training engine's cost per gradient reduction under this ZeRO-1/2 config, on "
        "--reduction-ranks CPU processes with the whole --model (engine_reduction_ms_per_gb; CPU profiles only)",
    )
    p.add_argument("--reduction-ranks", type=int, default=2, help="processes of the --deepspeed measurement")
    p.add_argument(
        "--only-engine-reduction",
        action="store_true",
        help="measure only the --deepspeed engine cost and add it to the existing profile --out (its other "
        "numbers kept)",
    )
    p.set_defaults(func=run)


def _command(args, device: str, tail) -> str:
    """The command line that makes this profile, for its file's header."""
    parts = ["hf-cp", "profile", "--model", str(args.model), "--out", str(args.out), "--device", device]
    for flag, value in (("--max-tokens", args.max_tokens), ("--threads", args.threads), ("--name", args.name)):
        if value is not None:
            parts += [flag, str(value)]
    if args.deepspeed is not None:
        parts += ["--deepspeed", str(args.deepspeed), "--reduction-ranks", str(args.reduction_ranks)]
    return " ".join(shlex.quote(x) for x in parts + list(tail))


def _engine_reduction(args, device: str):
    """The --deepspeed measurement (None without it)."""
    from hf_cp.profiling.engine_reduction import EngineReductionError, measure_engine_reduction  # torch, deepspeed

    if args.deepspeed is None:
        return None
    if device != "cpu":
        raise ValueError(
            "--deepspeed: the engine's cost per reduction is measured on CPU ranks (gloo) only; on GPUs the online "
            "calibration (cp_calibrate) fits the cost per reduction during training"
        )
    print(f"measuring the engine's cost per gradient reduction: {args.deepspeed}, {args.reduction_ranks} ranks ...")
    try:
        r = measure_engine_reduction(args.model, args.deepspeed, world=args.reduction_ranks)
    except EngineReductionError as e:
        raise ValueError(f"--deepspeed {args.deepspeed}: {e}") from None
    print(r.describe())
    return r


def run(args) -> int:
    import torch

    from hf_cp.profiling import ProfileError, run_profile, write_profile  # torch, transformers

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here; use --device cpu")
    if args.max_tokens is not None and args.max_tokens < 256:
        raise ValueError(f"--max-tokens {args.max_tokens}: use at least 256")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads {args.threads}: use at least 1")
    if args.only_engine_reduction:
        from hf_cp.profiling.profile_file import add_engine_reduction  # torch

        if args.deepspeed is None:
            raise ValueError("--only-engine-reduction: give the engine's config with --deepspeed DS_CONFIG.json")
        if not Path(args.out).is_file():
            raise ValueError(f"--only-engine-reduction: --out {args.out} is not a profile file to add it to")
        r = _engine_reduction(args, device)
        command = _command(args, device, ["--only-engine-reduction"])
        print(f"wrote {add_engine_reduction(args.out, r, command)}: engine_reduction_ms_per_gb {r.ms_per_gb:.4g}")
        return 0
    engine = _engine_reduction(args, device)
    try:
        result = run_profile(
            args.model,
            device=device,
            quick=args.quick,
            max_tokens=args.max_tokens,
            threads=args.threads,
            name=args.name,
        )
    except ProfileError as e:
        print(f"hf-cp profile: {e}", file=sys.stderr)
        return 3
    if engine is not None:
        result.engine_reduction = engine
        result.profile["engine_reduction_ms_per_gb"] = engine.ms_per_gb
    command = _command(args, device, ["--quick"] if args.quick else [])
    path = write_profile(result, args.out, command)
    fit = result.layer_fit
    print(
        f"wrote {path}: c1 {result.profile['c1_ms_per_token']:.4g} ms/token, c2 {result.profile['c2_ms_per_pair']:.4g} "
        f"ms/pair, c0 {result.profile['c0_ms']:.4g} ms; layer fit R^2 {fit.r2:.4f}, max relative error "
        f"{fit.max_rel_err:.3f} ({result.wall_s:.1f} s)"
    )
    if fit.r2 < args.min_r2:
        print(f"hf-cp profile: layer fit R^2 {fit.r2:.4f} is below --min-r2 {args.min_r2}", file=sys.stderr)
        return 3
    return 0
