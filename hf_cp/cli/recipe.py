"""`hf-cp recipe [NAME]`: the accelerate configs, DeepSpeed JSONs and recipe scripts hf_cp ships.

Without a name it lists them, one line each; with a name (with or without its extension) it
prints the absolute path of the installed file, for a launcher to read:

    accelerate launch --config_file "$(hf-cp recipe cpu-2proc-zero2)" -m hf_cp.train tiny-cpu
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from hf_cp.cli.formatting import HelpFormatter
from hf_cp.resources import BUILTIN_CONFIGS, RECIPES, find_recipe, shipped_recipes


def add_parser(sub) -> None:
    p = sub.add_parser(
        "recipe",
        help="list the shipped accelerate configs, DeepSpeed JSONs and recipe scripts, or print one's path",
        description="Without NAME: list the accelerate launch configs, DeepSpeed ZeRO JSONs and recipe "
        "scripts installed with hf_cp (the repository's recipes/), one line each. With NAME (a file "
        "name, with or without its extension): print the absolute path of the installed file. An "
        "accelerate config's deepspeed_config_file (recipes/ds-*.json) is resolved by hf_cp's training "
        "arguments, so the printed config works from any working directory.",
        epilog='example: accelerate launch --config_file "$(hf-cp recipe cpu-2proc-zero2)" -m hf_cp.train '
        "tiny-cpu --set training.max_steps=5",
        formatter_class=HelpFormatter,
    )
    p.add_argument("name", nargs="?", help="a recipe name, e.g. cpu-2proc-zero2 or trl_sft.py (default: list them)")
    p.set_defaults(func=run)


def _first_sentence(text: str) -> str:
    words = " ".join(text.split())
    return words.split(". ")[0].rstrip(".") + "." if words else ""


def describe(path: Path) -> str:
    """One line on what a shipped recipe is: the first sentence of an accelerate config's leading
    comment or of a script's docstring; a DeepSpeed JSON's ZeRO stage and the configs naming it."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        stage = (json.loads(text).get("zero_optimization") or {}).get("stage", "?")
        users = [
            f.stem
            for f in sorted(RECIPES.glob("*.yaml")) + sorted(BUILTIN_CONFIGS.glob("*.yaml"))
            if any(
                f"recipes/{path.name}" in ln and not ln.lstrip().startswith("#")
                for ln in f.read_text(encoding="utf-8").splitlines()
            )
        ]
        return f"DeepSpeed ZeRO-{stage} config" + (f", named by {', '.join(users)}." if users else ".")
    if path.suffix == ".py":
        doc = ast.get_docstring(ast.parse(text)) or ""
        return "recipe script: " + _first_sentence(doc.split("\n\n")[0])
    comment = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        comment.append(line.lstrip("#").strip())
    return _first_sentence(" ".join(comment)) or "accelerate launch config."


def run(args) -> int:
    if args.name:
        print(find_recipe(args.name))
        return 0
    recipes = shipped_recipes()
    width = max(len(p.stem) for p in recipes)
    print(f"hf_cp recipes, in {RECIPES} (hf-cp recipe NAME prints one's path):")
    for p in recipes:
        print(f"  {p.stem:<{width}}  {p.suffix[1:]:<4}  {describe(p)}")
    return 0
