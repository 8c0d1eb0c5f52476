"""Where hf_cp finds the files it ships, and the user's own.

The package carries its built-in files as package data, so that a wheel installed anywhere has them:

    hf_cp/configs/profiles/*.yaml   hardware profiles (cp_profile, --profile)
    hf_cp/configs/models/*.json     model dimensions, transformers config.json files (model.config, --model)
    hf_cp/configs/*.yaml            the example training configs (hf-cp train configs/tiny-cpu.yaml)
    hf_cp/recipes/*.json            the DeepSpeed configs those name (training.deepspeed)
    hf_cp/recipes/*.yaml, *.py      the accelerate launch configs and recipe scripts (hf-cp recipe)

The package directory mirrors the repository's layout: the checkout's top-level configs/*.yaml and
recipes/* are symlinks to these files, so each exists once.

A RECIPE name (`hf-cp recipe NAME`, `find_recipe`) is a file name in hf_cp/recipes/, with or
without its extension (and with or without a leading recipes/): cpu-2proc-zero2 ->
hf_cp/recipes/cpu-2proc-zero2.yaml, an absolute path that `accelerate launch --config_file` takes.
An accelerate config names its DeepSpeed JSON relative to the repository (deepspeed_config_file:
recipes/ds-zero2-cpu.json); CPTrainingArguments resolves that path (ACCELERATE_DEEPSPEED_CONFIG_FILE)
like any input below, so the installed config works from any working directory.

A TRAINING CONFIG named by path resolves like any input below; a bare name (tiny-cpu, tiny-cpu.yaml)
that is no file here is looked up as configs/<name>[.yaml|.yml], the user's configs/ first, then the
package's (`training_config_path`).

A profile or model NAME resolves to the first of:
  1. an existing path, as given (absolute, or relative to the working directory);
  2. the user's own file: configs/<kind>/<name> under the working directory, as given or with
     one of the kind's suffixes (configs/profiles/my-gpu.yaml for `my-gpu`);
  3. the package's built-in file hf_cp/configs/<kind>/<name>[suffix].
When none exists the caller's error lists the names of 2 and 3 (`available_names`).

A PATH an input is read from (a training config; the data and pretrained folder it names; the
deepspeed file of CPTrainingArguments, from a config or from Python) resolves to the first of:
  1. the path as given, if it exists (absolute, or relative to the working directory);
  2. the same relative path inside the package, which is where hf_cp ships the repository's
     configs/*.yaml and recipes/*.json (configs/tiny-cpu.yaml -> hf_cp/configs/tiny-cpu.yaml);
  3. the path as given, so that the error names the user's path.
Outputs (output_dir, logging_dir, hf-cp profile --out) are never resolved: they go where the user says.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence, Union

PACKAGE_ROOT = Path(__file__).resolve().parent
BUILTIN_CONFIGS = PACKAGE_ROOT / "configs"
RECIPES = PACKAGE_ROOT / "recipes"
RECIPE_SUFFIXES = (".yaml", ".json", ".py")
USER_CONFIGS = Path("configs")  # relative: looked up under the working directory at each call
KINDS = ("profiles", "models")


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: expected one of {list(KINDS)}")


def find_named(name_or_path: Union[str, Path], kind: str, suffixes: Sequence[str]) -> Optional[Path]:
    """The file (or model folder) a profile or model name stands for, in the order of the module
    doc; None when there is none. `suffixes` are tried after the name as given (".yaml", ".yml")."""
    _check_kind(kind)
    p = Path(name_or_path)
    if p.exists():
        return p
    for root in (USER_CONFIGS / kind, BUILTIN_CONFIGS / kind):
        for suffix in ("", *suffixes):
            cand = root / f"{name_or_path}{suffix}"
            if cand.exists():
                return cand
    return None


def available_names(kind: str) -> List[str]:
    """The names `find_named` resolves by name alone, sorted: the user's configs/<kind>/ under the
    working directory and the package's built-ins (a user's file shadows a built-in of its name)."""
    _check_kind(kind)
    roots = [root for root in (USER_CONFIGS / kind, BUILTIN_CONFIGS / kind) if root.is_dir()]
    return sorted({p.stem for root in roots for p in root.iterdir()})


def input_path(path: Union[str, Path]) -> Path:
    """Where an input named by `path` is read from, in the order of the module doc. A relative path
    that exists neither here nor in the package comes back unchanged (the caller's error names it)."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    shipped = (PACKAGE_ROOT / p).resolve()
    if shipped.is_relative_to(PACKAGE_ROOT) and shipped.exists():  # no `..` out of the package
        return shipped
    return p


def shipped_training_configs() -> List[str]:
    """The example training configs the package ships, as the relative paths `input_path` accepts."""
    return sorted(str(p.relative_to(PACKAGE_ROOT)) for p in BUILTIN_CONFIGS.glob("*.yaml"))


def training_config_path(name_or_path: Union[str, Path]) -> Path:
    """Where a training config named by path or by bare name is read from (module doc); the path
    as given when there is none, so that the caller's error names it."""
    p = input_path(name_or_path)
    if p.exists() or len(Path(name_or_path).parts) != 1:
        return p
    for suffix in ("", ".yaml", ".yml"):
        cand = input_path(Path("configs") / f"{name_or_path}{suffix}")
        if cand.exists():
            return cand
    return p


def shipped_recipes() -> List[Path]:
    """The accelerate configs, DeepSpeed JSONs and recipe scripts the package ships, sorted by name."""
    return sorted(p for p in RECIPES.iterdir() if p.is_file() and p.suffix in RECIPE_SUFFIXES)


def find_recipe(name: str) -> Path:
    """The installed file a recipe name stands for (module doc): its absolute path.
    FileNotFoundError names the shipped recipes when there is none."""
    bare = name[len("recipes/") :] if name.startswith("recipes/") else name
    for p in shipped_recipes():
        if bare in (p.name, p.stem):
            return p
    names = ", ".join(p.name for p in shipped_recipes())
    raise FileNotFoundError(f"no recipe named {name!r}; hf_cp ships {names} (a name with or without its extension)")
