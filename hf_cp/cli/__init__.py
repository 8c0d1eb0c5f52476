"""`hf-cp`: the command line. Each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from hf_cp.cost.config_files import ConfigError
from hf_cp.plan.step_plan import PlanError
from hf_cp.samples.lengths import LengthsError

USER_ERRORS = (ConfigError, LengthsError, PlanError, ValueError, KeyError, FileNotFoundError)


# Subcommands, one module each under hf_cp/cli/, in the order `--help` lists them. A module
# defines add_parser(subparsers) and sets `func` on its parser.
SUBCOMMANDS = ("preprocess", "plan", "train", "recipe", "profile", "replay", "report")


def build_parser() -> argparse.ArgumentParser:
    from importlib import import_module
    from pathlib import Path

    p = argparse.ArgumentParser(
        prog="hf-cp",
        description="Load-balanced context parallelism for long-context training in the Hugging Face stack.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    here = Path(__file__).parent
    for name in SUBCOMMANDS:
        if (here / f"{name}.py").exists():
            import_module(f"{__name__}.{name}").add_parser(sub)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"hf-cp {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
