"""The recipes (accelerate configs, DeepSpeed JSONs, recipe scripts) ship in the package, once:
the checkout's recipes/ links to hf_cp/recipes/; `hf-cp recipe` lists them and finds one by name;
an accelerate config's relative deepspeed_config_file resolves from any directory; a shipped
training config is found by name; and the wheel carries the recipes and the LICENSE."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
import yaml

from hf_cp.cli import main as cli_main
from hf_cp.resources import PACKAGE_ROOT, RECIPES, find_recipe, input_path, shipped_recipes, training_config_path
from hf_cp.train.setup.args import CPTrainingArguments
from hf_cp.train.setup.config import TrainConfigError, load_config

REPO = Path(__file__).resolve().parent.parent
SHIPPED = {
    "cpu-2proc-zero2.yaml",
    "cpu-2proc-fsdp2.yaml",
    "ds-zero2-cpu.json",
    "ds-zero2-gpu.json",
    "ds-zero3-cpu.json",
    "ds-zero3-gpu.json",
    "gpu-8x1-zero2.yaml",
    "gpu-8x1-fsdp2.yaml",
    "gpu-8x4-multinode-zero2.yaml",
    "trl_sft.py",
    "trl_dpo.py",
    "trl_grpo.py",
}


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A working directory with no checkout around it."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


# --------------------------------------------------------------------------- one copy
def test_the_checkout_recipes_are_links_to_the_package_files():
    assert {p.name for p in shipped_recipes()} == SHIPPED
    top = {p.name for p in (REPO / "recipes").iterdir()}
    assert top == SHIPPED, "recipes/ and hf_cp/recipes/ hold different files"
    for name in SHIPPED:
        link = REPO / "recipes" / name
        assert link.is_symlink(), f"recipes/{name} is a copy: make it a link to ../hf_cp/recipes/{name}"
        assert link.resolve() == (RECIPES / name).resolve(), link


def test_the_accelerate_configs_name_deepspeed_files_that_ship():
    for path in RECIPES.glob("*.yaml"):
        cfg = yaml.safe_load(path.read_text())
        ds = (cfg.get("deepspeed_config") or {}).get("deepspeed_config_file")
        if ds is not None:
            assert (PACKAGE_ROOT / ds).is_file(), f"{path.name}: deepspeed_config_file {ds} does not ship"
            assert (REPO / ds).is_file(), f"{path.name}: deepspeed_config_file {ds} is not in the checkout"


# --------------------------------------------------------------------------- hf-cp recipe
def test_recipe_lists_every_shipped_file_one_line_each(capsys):
    assert cli_main(["recipe"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert str(RECIPES) in out[0]
    rows = out[1:]
    assert len(rows) == len(SHIPPED)
    assert sorted(row.split()[0] for row in rows) == sorted(Path(n).stem for n in SHIPPED)
    line = {row.split()[0]: row for row in rows}
    assert "2 CPU processes on this machine, DeepSpeed ZeRO-2 over gloo." in line["cpu-2proc-zero2"]
    assert "DeepSpeed ZeRO-2 config, named by cpu-2proc-zero2" in line["ds-zero2-cpu"]
    assert "tiny-cpu" in line["ds-zero2-cpu"]
    assert line["trl_sft"].split()[1] == "py" and "recipe script: TRL SFT with hf_cp" in line["trl_sft"]


@pytest.mark.parametrize(
    "name", ["cpu-2proc-zero2", "cpu-2proc-zero2.yaml", "recipes/cpu-2proc-zero2.yaml", "recipes/cpu-2proc-zero2"]
)
def test_recipe_prints_the_installed_path_with_or_without_extension(name, capsys, elsewhere):
    assert cli_main(["recipe", name]) == 0
    out = capsys.readouterr().out
    assert out == f"{RECIPES / 'cpu-2proc-zero2.yaml'}\n"
    assert Path(out.strip()).is_absolute() and Path(out.strip()).is_file()


def test_recipe_finds_scripts_and_deepspeed_files_by_name():
    assert find_recipe("trl_sft") == RECIPES / "trl_sft.py"
    assert find_recipe("trl_sft.py") == RECIPES / "trl_sft.py"
    assert find_recipe("ds-zero2-gpu") == RECIPES / "ds-zero2-gpu.json"


def test_an_unknown_recipe_is_an_error_listing_the_names(capsys):
    assert cli_main(["recipe", "cpu-4proc"]) == 2
    err = capsys.readouterr().err
    assert "hf-cp recipe: error: no recipe named 'cpu-4proc'" in err
    for name in SHIPPED:
        assert name in err
    with pytest.raises(FileNotFoundError, match="no recipe named 'nope'"):
        find_recipe("nope")


# --------------------------------------------------------------------------- paths from any directory
def test_an_accelerate_configs_deepspeed_file_resolves_outside_a_checkout(elsewhere, monkeypatch):
    """accelerate launch exports the config's deepspeed_config_file as given (relative to the
    repository); without training.deepspeed accelerate reads it from there, so CPTrainingArguments
    resolves it the way it resolves training.deepspeed."""
    ds = yaml.safe_load((RECIPES / "cpu-2proc-zero2.yaml").read_text())["deepspeed_config"]["deepspeed_config_file"]
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", ds)
    CPTrainingArguments(output_dir="out", use_cpu=True)
    assert Path(os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"]) == PACKAGE_ROOT / "recipes" / "ds-zero2-cpu.json"
    # a file of that relative path in the working directory comes first; "none" stays "none"
    (elsewhere / "recipes").mkdir()
    (elsewhere / ds).write_text((PACKAGE_ROOT / ds).read_text())
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", ds)
    CPTrainingArguments(output_dir="out", use_cpu=True)
    assert os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == ds
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    CPTrainingArguments(output_dir="out", use_cpu=True)
    assert os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == "none"


def test_a_shipped_training_config_is_found_by_name(elsewhere):
    shipped = PACKAGE_ROOT / "configs" / "tiny-cpu.yaml"
    for name in ("tiny-cpu", "tiny-cpu.yaml", "configs/tiny-cpu.yaml"):
        assert training_config_path(name) == shipped, name
        assert Path(load_config(name)["_source"]) == shipped
    # the user's configs/ comes first, as for profiles and models; a path is never taken for a name
    local = elsewhere / "configs" / "tiny-cpu.yaml"
    local.parent.mkdir()
    local.write_text(yaml.safe_dump({"model": {"config": "tiny-llama"}, "data": {}, "training": {}}))
    assert training_config_path("tiny-cpu") == Path("configs/tiny-cpu.yaml")
    assert training_config_path("sub/tiny-cpu") == Path("sub/tiny-cpu")
    with pytest.raises(TrainConfigError, match=r"training config nope: no such file here.*'configs/tiny-cpu.yaml'"):
        load_config("nope")
    assert input_path("recipes/trl_sft.py") == RECIPES / "trl_sft.py"


# --------------------------------------------------------------------------- the wheel
def _can_build_here() -> bool:
    """Whether this environment's setuptools builds the wheel without an index (as test_resources)."""
    try:
        major, minor = (int(x) for x in version("setuptools").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (70, 1)


def test_the_wheel_carries_the_recipes_and_the_license(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(REPO / "hf_cp", src / "hf_cp", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    isolation = ["--no-build-isolation"] if _can_build_here() else []
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(tmp_path / "dist"), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("hf_cp-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert licenses, sorted(names)
        text = z.read(licenses[0]).decode()
    assert {f"hf_cp/recipes/{name}" for name in SHIPPED} <= names
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert text == (REPO / "LICENSE").read_text()
