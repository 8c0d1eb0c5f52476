"""`hf-cp train CONFIG`: train from a YAML config with per-step balanced CP plans.

Runs in this process; start several with a launcher (accelerate launch / torchrun), or pass
--nproc N to have this command start N local processes through torch.distributed.run.
"""

from __future__ import annotations

import os
import subprocess
import sys

from hf_cp.cli.formatting import HelpFormatter
from hf_cp.plan.cluster import MAX_WORLD_SIZE
from hf_cp.train.launch.trainers import TRAINERS
from hf_cp.train.setup.config import add_config_arguments, load_config


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model from a YAML config (CPTrainer on DeepSpeed ZeRO-2)",
        description="Train with CPTrainer from CONFIG (sections model, data, training; see hf_cp/train/setup/config.py). "
        "Under a launcher every process runs this command; with --nproc N it starts N local "
        "processes itself (torch.distributed.run).",
        formatter_class=HelpFormatter,
    )
    add_config_arguments(p)
    p.add_argument("--nproc", type=int, default=0, help="start this many local processes (0: run in this one)")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="with --nproc: restart all processes up to this many times when one dies, resuming from "
        "the newest checkpoint (sets resume_from_checkpoint=latest; save checkpoints with "
        "training.save_strategy=steps)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=int,
        default=None,
        metavar="SECONDS",
        help="with --nproc: how long the processes may take to stop after a SIGTERM before they are "
        "killed (torchrun's default 30 s); with training.enable_jit_checkpoint=true they finish "
        "the step, save a checkpoint and exit, so allow two steps and one save",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check everything a launch would (config, model config, data, plans of the first steps "
        "and of the eval set, resume and restart settings) for --nproc N ranks (or --world N), "
        "without loading weights or starting processes",
    )
    p.add_argument(
        "--world",
        type=int,
        default=0,
        metavar="N",
        help="with --dry-run: the number of ranks to plan for (default: --nproc, else 1)",
    )
    p.add_argument("--dry-run-steps", type=int, default=20, metavar="K", help="with --dry-run: steps to plan")
    p.add_argument(
        "--skip-checks",
        action="store_true",
        help="with --nproc: start the processes without first running the dry run's checks for N ranks "
        "(one planned step; a refusal is then said by rank 0 of the launch instead)",
    )
    p.set_defaults(func=run)


def _dry_run_errors(lines):
    """The dry run's report lines of problems it found without raising (another run's lock)."""
    return [line for line in lines if line.startswith("error: ")]


def _with_restart_overrides(overrides, max_restarts: int):
    """--max-restarts resumes a restarted job from its newest checkpoint unless told otherwise."""
    overrides = list(overrides)
    if max_restarts > 0 and not any(o.startswith("training.resume_from_checkpoint=") for o in overrides):
        overrides.append("training.resume_from_checkpoint=latest")
    return overrides


def check_args(args) -> None:
    """The numeric options in range, refused by flag (ValueError: `hf-cp train: error: --world -2: ...`)."""
    for flag, v, lo, hi in (
        ("--nproc", args.nproc, 0, MAX_WORLD_SIZE),
        ("--world", args.world, 0, MAX_WORLD_SIZE),
        ("--dry-run-steps", args.dry_run_steps, 1, 2**31 - 1),
        ("--max-restarts", args.max_restarts, 0, 2**31 - 1),
        ("--shutdown-timeout", args.shutdown_timeout, 0, 2**31 - 1),
    ):
        if v is not None and not lo <= v <= hi:
            raise ValueError(f"{flag} {v}: must be from {lo:,} to {hi:,}")


def run(args) -> int:
    check_args(args)
    if args.dry_run:
        from hf_cp.train.launch.dry_run import dry_run  # transformers (configs, tokenizer), datasets

        world = args.world or args.nproc or 1
        overrides = _with_restart_overrides(args.overrides, args.max_restarts)
        lines = dry_run(args.config, overrides, world, args.dry_run_steps, args.max_restarts)
        for line in lines:
            print(line)
        errors = _dry_run_errors(lines)
        if errors:
            print(f"dry run failed: {len(errors)} problem(s) a launch would refuse; nothing was launched")
            return 2
        print("dry run passed: nothing was launched")
        return 0
    if args.max_restarts and args.max_restarts > 0 and not (args.nproc and args.nproc > 1):
        raise SystemExit(
            "hf-cp train: --max-restarts needs --nproc N (N > 1); under your own launcher pass "
            "its restart option instead (see docs/faults.md)"
        )
    if args.nproc and args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        overrides = _with_restart_overrides(args.overrides, args.max_restarts)
        if not args.skip_checks:  # a refusal here is one message, before any process or torchrun output
            from hf_cp.train.launch.dry_run import dry_run  # transformers (configs, tokenizer), datasets

            # raw data it preprocesses is kept under output_dir: the launch reads it, preprocessing nothing again
            lines = dry_run(args.config, overrides, args.nproc, 1, args.max_restarts, keep_preprocessed=True)
            errors = _dry_run_errors(lines)
            if errors:
                print(f"hf-cp train: {errors[0]}", file=sys.stderr)
                return 2
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        launcher_args = []
        if args.max_restarts > 0:
            # --standalone is c10d rendezvous; a store of its own per attempt (hf_cp.train.checkpoint.resolve)
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            launcher_args = ["--max-restarts", str(args.max_restarts)]
        if args.shutdown_timeout is not None:
            launcher_args += ["--shutdown-timeout", str(args.shutdown_timeout)]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(args.nproc),
            *launcher_args,
            "-m",
            "hf_cp.train",
            args.config,
        ] + [x for o in overrides for x in ("--set", o)]
        jit = bool((load_config(args.config, overrides, TRAINERS).get("training") or {}).get("enable_jit_checkpoint"))
        return _run_forwarding_sigterm(cmd, env, to_workers=jit)
    from hf_cp.train.launch.entry import run_refusing_once  # torch, transformers, deepspeed

    return run_refusing_once(args.config, args.overrides)


def _workers(launcher_pid: int) -> list:
    """The training processes torchrun started (its children running hf_cp.train)."""
    import psutil  # an accelerate dependency

    try:
        children = psutil.Process(launcher_pid).children()
    except psutil.Error:
        return []
    out = []
    for c in children:
        try:
            if "hf_cp.train" in " ".join(c.cmdline()):
                out.append(c)
        except psutil.Error:
            continue
    return out


def _run_forwarding_sigterm(cmd, env, to_workers: bool = False) -> int:
    """Run the launcher; a SIGTERM sent to this command (a scheduler stopping the job) goes on:
    without this the launcher and its workers would be orphaned, training on. (Ctrl-C reaches
    the whole foreground process group by itself.) `to_workers` (enable_jit_checkpoint): the
    signal goes to the workers themselves, which finish the step, save and exit 0, so the launcher
    ends cleanly (rc 0); sent to torchrun, it would stop them the same way but then exit 1 with
    its own SignalException traceback. Without a stop handler in the workers, the launcher gets
    it (a worker killed by it would count as a failure, and be restarted)."""
    import signal

    proc = subprocess.Popen(cmd, env=env)

    def forward(signum, frame):
        workers = _workers(proc.pid) if to_workers else []
        for w in workers:
            w.send_signal(signal.SIGTERM)
        if not workers:
            proc.send_signal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        return proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
