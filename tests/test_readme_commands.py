"""The README's `hf-cp train CONFIG` commands run as written on a fresh checkout: a config whose
model.pretrained is a folder the run makes (under outputs/) has the command that makes it
earlier in the README (before: the DPO command failed with "model.pretrained
outputs/smollm2-135m-instruct does not exist", the convert step only in docs/commands.md)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_every_readme_train_config_finds_its_pretrained_folder_made_earlier_in_the_readme():
    lines = (ROOT / "README.md").read_text().splitlines()
    checked = []
    for i, line in enumerate(lines):
        for config in re.findall(r"hf-cp train (configs/[\w.-]+\.yaml)", line) + re.findall(
            r"# or (configs/[\w.-]+\.yaml)", line
        ):
            pretrained = (yaml.safe_load((ROOT / config).read_text()).get("model") or {}).get("pretrained")
            if not pretrained or not str(pretrained).startswith("outputs/"):
                continue  # a shipped model config, or a folder the user names
            made = [earlier for earlier in lines[:i] if f"--out {pretrained}" in earlier]
            assert made, f"README line {i + 1}: {config} trains {pretrained}, which no earlier README command makes"
            checked.append(config)
    assert {"configs/smollm2-dpo-cpu.yaml", "configs/smollm2-grpo-cpu.yaml"} <= set(checked), checked
