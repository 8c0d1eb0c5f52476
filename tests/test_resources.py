"""hf_cp.resources: the built-in profiles, models, training configs and DeepSpeed JSONs ship in the
package, are found by name or path in the documented order, and work from a wheel outside a checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
import yaml

from hf_cp.cost.config_files import ConfigError
from hf_cp.cost.dims import ModelDims
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.resources import BUILTIN_CONFIGS, PACKAGE_ROOT, find_named, input_path
from hf_cp.train.setup.args import CPTrainingArguments
from hf_cp.train.setup.config import TrainConfigError, load_config, training_arguments

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A working directory with no checkout around it."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def _write_profile(path: Path, c1: float) -> None:
    prof = yaml.safe_load((BUILTIN_CONFIGS / "profiles" / "cpu.yaml").read_text())
    prof["c1_ms_per_token"] = c1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(prof))


# --------------------------------------------------------------------------- names
def test_profile_names_resolve_to_a_path_then_the_users_configs_then_the_built_ins(elsewhere):
    builtin = HardwareProfile.load("cpu")
    assert find_named("cpu", "profiles", (".yaml",)) == BUILTIN_CONFIGS / "profiles" / "cpu.yaml"
    # the user's configs/profiles/cpu.yaml shadows the built-in of that name
    _write_profile(elsewhere / "configs" / "profiles" / "cpu.yaml", 0.5)
    assert HardwareProfile.load("cpu").c1_ms_per_token == 0.5 != builtin.c1_ms_per_token
    assert HardwareProfile.load("cpu.yaml").c1_ms_per_token == 0.5
    # an existing path comes first, even where it spells a name
    _write_profile(elsewhere / "cpu", 0.25)
    assert HardwareProfile.load("cpu").c1_ms_per_token == 0.25
    # names the user does not shadow still reach the package
    assert HardwareProfile.load("h200-qwen2.5-7b").name == "h200-qwen2.5-7b"


def test_model_names_resolve_to_the_users_configs_then_the_built_ins(elsewhere):
    assert ModelDims.load("tiny-llama").hidden == 64
    cfg = json.loads((BUILTIN_CONFIGS / "models" / "tiny-llama.json").read_text())
    user = elsewhere / "configs" / "models" / "tiny-llama.json"
    user.parent.mkdir(parents=True)
    user.write_text(json.dumps(dict(cfg, hidden_size=128)))
    assert ModelDims.load("tiny-llama").hidden == 128
    assert ModelDims.load("qwen2.5-7b").hidden == 3584


def test_an_unknown_name_lists_the_users_names_and_the_built_ins(elsewhere):
    _write_profile(elsewhere / "configs" / "profiles" / "my-gpu.yaml", 0.5)
    with pytest.raises(ConfigError, match="no profile named 'nope'") as e:
        HardwareProfile.load("nope")
    for name in ("'cpu'", "'h200-qwen2.5-7b'", "'my-gpu'"):
        assert name in str(e.value)
    with pytest.raises(ConfigError, match=r"no model named 'nope'.*'qwen2.5-7b'.*'tiny-llama'"):
        ModelDims.load("nope")


# --------------------------------------------------------------------------- paths
def test_a_training_config_and_its_deepspeed_file_resolve_to_the_package_outside_a_checkout(elsewhere):
    cfg = load_config("configs/tiny-cpu.yaml")
    assert Path(cfg["_source"]) == PACKAGE_ROOT / "configs" / "tiny-cpu.yaml"
    args = training_arguments(cfg["training"], cfg["_source"])
    assert Path(args.deepspeed) == PACKAGE_ROOT / "recipes" / "ds-zero2-cpu.json"
    # outputs are never resolved: they stay where the user runs
    assert args.output_dir == "outputs/tiny-cpu"
    # from Python too (the README's CPTrainingArguments example)
    direct = CPTrainingArguments(output_dir="out", deepspeed="recipes/ds-zero2-cpu.json", use_cpu=True)
    assert Path(direct.deepspeed) == PACKAGE_ROOT / "recipes" / "ds-zero2-cpu.json"
    # a local file of the same relative path comes first
    local = elsewhere / "configs" / "tiny-cpu.yaml"
    local.parent.mkdir()
    local.write_text(yaml.safe_dump({"model": {"config": "tiny-llama"}, "data": {}, "training": {}}))
    assert Path(load_config("configs/tiny-cpu.yaml")["_source"]) == Path("configs/tiny-cpu.yaml")


def test_a_missing_training_config_names_the_shipped_ones(elsewhere):
    with pytest.raises(TrainConfigError, match=r"configs/nope.yaml: no such file here.*'configs/tiny-cpu.yaml'"):
        load_config("configs/nope.yaml")


def test_input_paths_do_not_leave_the_package(elsewhere):
    assert (PACKAGE_ROOT.parent / "setup.cfg").exists()  # the checkout's, beside the package
    assert input_path("../setup.cfg") == Path("../setup.cfg")  # unchanged: not found here
    assert input_path("resources.py") == PACKAGE_ROOT / "resources.py"  # inside the package


def test_the_checkout_links_to_the_package_files_instead_of_copying_them():
    shipped = sorted(PACKAGE_ROOT.glob("configs/*.yaml")) + sorted(PACKAGE_ROOT.glob("recipes/*.json"))
    assert len(shipped) >= 7
    for f in shipped:
        top = REPO / f.relative_to(PACKAGE_ROOT)
        assert top.is_symlink() and top.resolve() == f.resolve(), top
    for top in REPO.glob("configs/*.yaml"):
        assert top.is_symlink() and top.resolve().is_relative_to(PACKAGE_ROOT), top
    assert not (REPO / "configs" / "profiles").exists() and not (REPO / "configs" / "models").exists()


# --------------------------------------------------------------------------- the wheel
def _can_build_here() -> bool:
    """Whether this environment's setuptools builds the wheel itself (no index needed): pyproject.toml
    asks for setuptools>=68, and bdist_wheel is built in from 70.1 (a venv's own setuptools, 65.5 on
    Python 3.11, is older: pip's isolated build then fetches one)."""
    try:
        major, minor = (int(x) for x in version("setuptools").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (70, 1)


@pytest.fixture(scope="module")
def unpacked_wheel(tmp_path_factory):
    """The wheel built from this tree (outside it), unpacked as pip would install it."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO / "hf_cp", src / "hf_cp", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    isolation = ["--no-build-isolation"] if _can_build_here() else []
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(tmp / "dist"), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp / "dist").glob("hf_cp-*.whl")
    site = tmp / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
        names = set(z.namelist())
    return site, names


def test_the_wheel_carries_every_data_file_of_the_package(unpacked_wheel):
    _, names = unpacked_wheel
    data = {
        str(p.relative_to(PACKAGE_ROOT.parent))
        for p in PACKAGE_ROOT.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc")
    }
    assert {"hf_cp/configs/profiles/h200-qwen2.5-7b.yaml", "hf_cp/configs/models/qwen2.5-7b.json"} <= data
    assert {"hf_cp/configs/tiny-cpu.yaml", "hf_cp/recipes/ds-zero2-cpu.json"} <= data
    assert data - names == set()
    assert {"hf_cp/recipes/cpu-2proc-zero2.yaml", "hf_cp/recipes/trl_sft.py"} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(n for n in names if "dist-info" in n)


# slow (~13 s of subprocesses): .ci/check_wheel runs the same from a wheel installed in a fresh venv
@pytest.mark.slow
def test_the_installed_wheel_plans_and_dry_runs_from_a_directory_without_a_checkout(
    unpacked_wheel, elsewhere, traces_dir
):
    site, _ = unpacked_wheel
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")

    def run(*args):
        proc = subprocess.run(
            [sys.executable, *args], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    # the package and its data come from the wheel, not from this checkout
    where = run(
        "-c",
        "import hf_cp, hf_cp.resources as r; print(hf_cp.__file__); "
        "print(r.find_named('h200-qwen2.5-7b', 'profiles', ('.yaml',)).resolve()); "
        "print(r.input_path('recipes/ds-zero2-cpu.json'))",
    ).split()
    assert all(Path(p).resolve().is_relative_to(site.resolve()) for p in where), where
    out = run(
        "-m", "hf_cp", "plan", "--profile", "h200-qwen2.5-7b", "--model", "qwen2.5-7b",
        "--lengths", str(traces_dir / "code_numpy_files.txt"), "--world", "64", "--steps", "2",
    )  # fmt: skip
    assert "predicted time / lower bound over 2 steps" in out
    out = run("-m", "hf_cp", "train", "configs/tiny-cpu.yaml", "--dry-run", "--world", "2", "--dry-run-steps", "2")
    assert "config tiny-cpu.yaml: 2 rank(s)" in out and out.rstrip().endswith("dry run passed: nothing was launched")
    assert list(elsewhere.iterdir()) == []  # a dry run writes nothing
