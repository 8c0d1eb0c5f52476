"""`hf-cp`: the command line. Each subcommand lives in its own module."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ..cost import ConfigError
from ..lengths import LengthsError
from ..plan import PlanError

USER_ERRORS = (ConfigError, LengthsError, PlanError, ValueError, KeyError, FileNotFoundError)


def build_parser() -> argparse.ArgumentParser:
    from . import plan as plan_cmd

    p = argparse.ArgumentParser(
        prog="hf-cp",
        description="Load-balanced context parallelism for long-context training in the Hugging Face stack.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    plan_cmd.add_parser(sub)
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
