"""The config files the cost model reads (model configs, hardware profiles): where a name
points (hf_cp.resources), how a YAML mapping is read, and the error that names the bad file
and field. Torch-free."""

from __future__ import annotations

from pathlib import Path
from typing import Tuple, Union

import yaml

from hf_cp.readers import load_yaml
from hf_cp.resources import available_names, find_named


class ConfigError(ValueError):
    """A config, profile or plan file is malformed; the message names the file and field."""


def read_yaml_mapping(
    path: Union[str, Path], what: str, expect: str = "a mapping at top level", error: type = ConfigError
) -> dict:
    """A YAML file that must hold a mapping, read with the safe loader (no code from files) that
    refuses a key given twice and an alias bomb (hf_cp.readers.load_yaml)."""
    if Path(path).is_dir():
        raise error(f"{what} {path}: is a directory; expected a YAML file")
    try:
        d = load_yaml(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise error(f"{what} {path}: {e}") from None
    if not isinstance(d, dict):
        raise error(f"{what} {path}: expected {expect}")
    return d


def resolve_config(name_or_path: Union[str, Path], kind: str, suffixes: Tuple[str, ...]) -> Path:
    """The file a profile or model name stands for (resolution order: hf_cp.resources)."""
    p = find_named(name_or_path, kind, suffixes)
    if p is None:
        raise ConfigError(
            f"no {kind[:-1]} named {str(name_or_path)!r}: not a file, not in configs/{kind}/ here, and not "
            f"built in; available: {available_names(kind)}"
        )
    return p
