"""`hf-cp train CONFIG`: train from a YAML config with per-step balanced CP plans.

Runs in this process; start several with a launcher (accelerate launch / torchrun), or pass
--nproc N to have this command start N local processes through torch.distributed.run.
"""
from __future__ import annotations

import os
import subprocess
import sys

from .formatting import HelpFormatter


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model from a YAML config (CPTrainer on DeepSpeed ZeRO-2)",
        description="Train with CPTrainer from CONFIG (sections model, data, training; see hf_cp/train/main.py). "
                    "Under a launcher every process runs this command; with --nproc N it starts N local "
                    "processes itself (torch.distributed.run).",
        formatter_class=HelpFormatter,
    )
    p.add_argument("config", help="training config YAML, e.g. configs/tiny-cpu.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, e.g. --set training.max_steps=5 (repeatable)")
    p.add_argument("--nproc", type=int, default=0, help="start this many local processes (0: run in this one)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.nproc and args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
               "-m", "hf_cp.train", args.config] + [x for o in args.overrides for x in ("--set", o)]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        return subprocess.call(cmd, env=env)
    from ..train.main import run as train_run

    return train_run(args.config, args.overrides)
