"""Issue 40: every bad or extreme input ends in a clear error within a second (no traceback, no
hang, nothing silently accepted), reproduced through the entry point a user reaches: the CLI's
`main([...])` (an exit code and a message on stderr) or the config loader.

    huge or fractional integer fields      load_config: named, with the int64 range / the epoch limit
    a model with 0 attention heads          hf-cp plan --model, a training config's model.config/pretrained
    --set KEY=<not YAML>                    named override, "not valid YAML"
    a directory where a file is expected    every path the CLI reads
    --world 3 with dcp / auto               planned (aligned blocks of 2 and a rank alone)
    100,000-deep nested JSON                refused by every JSON reader (and before pyarrow's)
    1e15-token caps, 1e300-byte alphas      largest_fitting_chunk by bisection; profile maxima
    a YAML alias bomb                       refused while read; no repr of a huge value
    --world 1048576                         refused above MAX_WORLD_SIZE, with the number
    duplicate YAML keys                     refused naming the key and both lines
    profile numbers that overflow to inf    refused by name; no plan output is non-finite
    negative device memory, 0 GPUs per node refused by flag
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from hf_cp.cli import main
from hf_cp.cost.config_files import ConfigError
from hf_cp.cost.dims import ModelDims
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.cost.model import CostModel
from hf_cp.plan.cluster import MAX_WORLD_SIZE, ClusterSpec
from hf_cp.plan.step_plan import StepPlan
from hf_cp.readers import MAX_JSON_DEPTH, YAMLInputError, brief, load_json, load_yaml
from hf_cp.resources import find_named
from hf_cp.train.setup.schema import TrainConfigError

from helpers.harness.models import ROOT

TINY = ROOT / "configs" / "tiny-cpu.yaml"
LENGTHS = [300, 40, 900, 120, 60, 700, 80, 200, 500, 90]
DEEP = "[" * 100_000 + "]" * 100_000  # the fuzzing user's input
PLAN = ["--model", "tiny-llama", "--profile", "cpu", "--max-tokens-per-rank", "512", "--steps", "2"]


def cli(*args) -> tuple:
    """(exit code, stdout, stderr, seconds) of hf_cp.cli.main in this process."""
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue(), time.perf_counter() - t0


def refused(*args, names=(), within: float = 1.0) -> str:
    """Run the CLI: exit 2, a one-line `hf-cp ...: error:` naming every one of `names`, within
    `within` seconds; returns the message."""
    rc, _, err, seconds = cli(*args)
    assert rc == 2, err
    assert err.startswith("hf-cp ") and ": error: " in err and "Traceback" not in err, err
    for n in names:
        assert str(n) in err, (n, err)
    assert seconds < within, f"{seconds:.2f} s: {err}"
    return err


@pytest.fixture
def lengths(tmp_path) -> Path:
    p = tmp_path / "lengths.txt"
    p.write_text("\n".join(map(str, LENGTHS)) + "\n")
    return p


@pytest.fixture(scope="module", autouse=True)
def warm():
    """Import what the first call of each entry point would (transformers for the training keys,
    the balancers), so that the timings below are the checks' own."""
    from hf_cp.train.setup.schema import training_types

    training_types()
    yield


def config(tmp_path, edit=None, name="config.yaml") -> Path:
    d = yaml.safe_load(TINY.read_text())
    d["training"]["output_dir"] = str(tmp_path / "out")
    if edit:
        edit(d)
    p = tmp_path / name
    p.write_text(yaml.safe_dump(d))
    return p


def load(path, overrides=()):
    """hf_cp.train.setup.config.load_config (what `hf-cp train` and the dry run read a config with)."""
    from hf_cp.train.setup.config import load_config

    return load_config(str(path), list(overrides))


def timed_refusal(call, error, *names, within: float = 1.0) -> str:
    t0 = time.perf_counter()
    with pytest.raises(error) as e:
        call()
    seconds = time.perf_counter() - t0
    text = str(e.value.args[0]) if isinstance(e.value, KeyError) else str(e.value)
    for n in names:
        assert n in text, (n, text)
    assert seconds < within, f"{seconds:.2f} s: {text}"
    return text


def profile_file(tmp_path, name="profile.yaml", **fields) -> Path:
    d = yaml.safe_load(find_named("cpu", "profiles", (".yaml",)).read_text())
    d.update(fields)
    p = tmp_path / name
    p.write_text(yaml.safe_dump(d))
    return p


def model_file(tmp_path, name="model.json", **fields) -> Path:
    d = json.loads(find_named("tiny-llama", "models", (".json",)).read_text())
    d.update(fields)
    p = tmp_path / name
    p.write_text(json.dumps(d))
    return p


# ------------------------------------------------------------------ integer training fields
@pytest.mark.parametrize(
    "section, key, value, message",
    [
        ("training", "max_steps", 1e20, "training.max_steps: expected an integer, got 1e+20"),
        ("training", "max_steps", 10**20, "training.max_steps: 100000000000000000000 is out of range"),
        ("training", "max_steps", 2.5, "training.max_steps: expected an integer, got 2.5"),
        ("training", "cp_max_tokens_per_rank", 10**20, "training.cp_max_tokens_per_rank: 100000000000000000000 is out"),
        ("training", "cp_tokens_per_step", 4096.5, "training.cp_tokens_per_step: expected an integer"),
        pytest.param("training", "logging_steps", 10**400, "training.logging_steps: 1000000000", id="10**400"),
        ("training", "num_train_epochs", 1e20, "training.num_train_epochs must be at most 10000"),
        ("model", "seed", 10**30, "model.seed: 1000000000000000000000000000000 is out of range"),
        ("data", "limit", 10**20, "data.limit: 100000000000000000000 is out of range"),
        ("data", "eval_seed", -1, "data.eval_seed must be in [0, 2**32 - 1]"),
    ],
)
def test_huge_and_fractional_integer_fields_are_refused_by_name(tmp_path, section, key, value, message):
    """max_steps: 1e20 and its kin: before, 10**20 steps died in an OverflowError (len() of the
    sampler) and 1e20 epochs hung in the sampler's epoch loop."""
    path = config(tmp_path, lambda d: d[section].__setitem__(key, value))
    timed_refusal(lambda: load(path), TrainConfigError, str(path), message)


def test_huge_counts_from_set_overrides_are_refused_too(tmp_path):
    path = config(tmp_path)
    timed_refusal(lambda: load(path, ["training.max_steps=1e20"]), TrainConfigError, "training.max_steps")
    timed_refusal(lambda: load(path, ["training.num_train_epochs=1e20"]), TrainConfigError, "num_train_epochs")


def test_a_huge_epoch_count_fails_in_the_dry_run_at_once_not_after_hours(tmp_path):
    path = config(tmp_path, lambda d: d["training"].__setitem__("num_train_epochs", 1e20))
    refused("train", path, "--dry-run", "--world", 2, names=("num_train_epochs", "10000"), within=5)


# ------------------------------------------------------------------ zero attention heads
@pytest.mark.parametrize(
    "fields, name",
    [
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"num_key_value_heads": 0}, "num_kv_heads"),
        ({"head_dim": 0}, "head_dim"),
        ({"hidden_size": 10**30}, "hidden_size"),
        pytest.param({"num_attention_heads": 10**400}, "num_attention_heads", id="10**400"),
    ],
)
def test_hf_cp_plan_refuses_a_model_with_no_heads_by_field(tmp_path, lengths, fields, name):
    model = model_file(tmp_path, **fields)
    refused("plan", "--lengths", lengths, "--world", 2, *PLAN, "--model", model, names=(str(model), name))


def test_a_training_config_with_no_heads_is_refused_naming_model_config(tmp_path):
    """Before: ZeroDivisionError inside transformers' LlamaConfig validation (hidden % heads)."""
    model = model_file(tmp_path, num_attention_heads=0)
    path = config(tmp_path, lambda d: d["model"].__setitem__("config", str(model)))
    refused(
        "train",
        path,
        "--dry-run",
        "--world",
        2,
        names=(str(path), "model.config", str(model), "'num_attention_heads' must be a whole number from 1"),
        within=5,
    )


def test_a_pretrained_folder_with_no_heads_is_refused_naming_model_pretrained(tmp_path):
    from hf_cp.train.setup.config import model_config

    folder = tmp_path / "pretrained"
    folder.mkdir()
    model_file(folder, "config.json", num_attention_heads=0)
    timed_refusal(
        lambda: model_config({"pretrained": str(folder)}, "run.yaml"),
        TrainConfigError,
        "run.yaml: model.pretrained",
        "num_attention_heads",
    )


# ------------------------------------------------------------------ --set VALUE that is not YAML
@pytest.mark.parametrize("override", ["training.lr=[", "training.learning_rate=[", "model.seed={", "data.limit=*x"])
def test_an_override_that_is_not_yaml_is_refused_naming_it(tmp_path, override):
    path = config(tmp_path)
    refused("train", path, "--dry-run", "--set", override, names=(f"override '{override}'", "not valid YAML"))


# ------------------------------------------------------------------ a directory for a file
def test_a_directory_given_for_a_file_is_refused_naming_it(tmp_path, lengths):
    folder = tmp_path / "a_folder"
    folder.mkdir()
    refused("train", folder, "--dry-run", names=(f"training config {folder}: is a directory",))
    refused("plan", "--lengths", folder, "--world", 2, *PLAN, names=(str(folder), "not a saved `datasets` folder"))
    refused("plan", "--lengths", lengths, "--world", 2, *PLAN, "--profile", folder, names=(f"profile {folder}",))
    refused("plan", "--plan-json", folder, "--model", "tiny-llama", names=(f"{folder}: is a directory",))
    refused("plan", "--lengths", lengths, "--world", 2, *PLAN, "--model", folder, names=(str(folder), "config.json"))


@pytest.mark.parametrize(
    "key, message", [("model.config", "is a directory"), ("data.path", "neither a saved dataset")]
)
def test_a_directory_in_a_training_config_is_refused_naming_the_key(tmp_path, key, message):
    folder = tmp_path / "a_folder"
    folder.mkdir()

    def edit(d):
        section, field = key.split(".")
        d[section][field] = str(folder)
        if key == "data.path":
            del d["data"]["bundled"]

    path = config(tmp_path, edit)
    refused("train", path, "--dry-run", "--world", 2, names=(key, str(folder), message), within=5)


# ------------------------------------------------------------------ a world that is not a power of two
@pytest.mark.parametrize("world", [3, 5, 6, 7])
@pytest.mark.parametrize("balancer", ["dcp", "auto"])
def test_dcp_and_auto_plan_a_world_that_is_not_a_power_of_two(tmp_path, lengths, world, balancer):
    """Before: IndexError in dcp's layout (a sample's block of 4 ranks in a world of 3: no such
    block). Now a long sample spreads over the largest aligned block that exists (2 or 4 ranks),
    and every plan validates against the cluster the trainer would build."""
    out = tmp_path / "plans.json"
    rc, stdout, err, _ = cli(
        "plan", "--lengths", lengths, "--world", world, *PLAN, "--balancer", balancer, "--json", out
    )
    assert rc == 0, err
    plans = StepPlan.load_file(out)
    cost = CostModel(ModelDims.load("tiny-llama"), HardwareProfile.load("cpu"))
    cluster = ClusterSpec(world, 512, HardwareProfile.load("cpu").gpus_per_node, any_size_groups=True)
    for plan in plans:
        assert plan.world_size == world
        plan.validate(cluster, cost)
    planned = [s for p in plans for s in p.sample_ids]
    assert planned and len(set(planned)) == len(planned) and set(planned) <= set(range(len(LENGTHS)))


def test_dcp_fallback_plans_a_world_of_three_too(tmp_path, lengths):
    out = tmp_path / "plans.json"
    rc, _, err, _ = cli(
        "plan", "--lengths", lengths, "--world", 3, *PLAN, "--balancer", "dcp", "--balancer-opt", "deadline_s=0.000000001",
        "--json", out,
    )  # fmt: skip
    assert rc == 0, err
    plans = StepPlan.load_file(out)
    assert any("fallback" in n for p in plans for n in p.notes)


def test_dcp_refuses_a_sample_no_aligned_block_of_a_world_of_three_holds(tmp_path):
    lengths = tmp_path / "long.txt"
    lengths.write_text("1400\n100\n")  # over 2 ranks x 512 tokens: only all 3 ranks hold it, as a ring
    refused(
        "plan", "--lengths", lengths, "--world", 3, *PLAN, "--balancer", "dcp", names=("sample 0", "1400"), within=5
    )


# ------------------------------------------------------------------ deeply nested JSON
def test_deep_json_is_refused_by_every_reader_the_cli_has(tmp_path, lengths):
    deep = tmp_path / "deep.json"
    deep.write_text(DEEP)
    deep_lines = tmp_path / "deep.jsonl"
    deep_lines.write_text('{"prompt": 3, "answers": [2]}\n{"prompt": ' + DEEP + ', "answers": [1]}\n')
    nested = f"nested deeper than {MAX_JSON_DEPTH} levels"
    refused("plan", "--plan-json", deep, "--model", "tiny-llama", names=(str(deep), nested))
    refused("plan", "--lengths", lengths, "--world", 2, *PLAN[2:], "--model", deep, names=(str(deep), nested))
    refused("plan", "--lengths", deep_lines, "--world", 2, *PLAN, names=(f"{deep_lines}, line 2", nested))
    path = config(tmp_path, lambda d: d["model"].__setitem__("config", str(deep)))
    refused("train", path, "--dry-run", names=("model.config", str(deep), nested), within=5)


def test_deep_json_in_history_and_training_data_is_refused_naming_the_line(tmp_path):
    from hf_cp.train.measure.step_record import HistoryError, latest_records
    from hf_cp.train.setup.config import load_datasets

    history = tmp_path / "rank0.jsonl"
    history.write_text(DEEP + "\n{}\n")
    timed_refusal(lambda: latest_records(history), HistoryError, f"{history}, line 1", "nested deeper")
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": [1, 2]}\n{"input_ids": ' + DEEP + "}\n")
    timed_refusal(
        lambda: load_datasets({"path": str(data)}, "run.yaml"), TrainConfigError, "data.path", "line 2", "nested deeper"
    )


def test_deep_json_for_preprocess_is_refused_before_pyarrow_crashes_the_process(tmp_path):
    """pyarrow's JSON reader (datasets' json builder) dies with SIGSEGV on 20,000 levels: run in
    a child process so that a regression fails this test, not the whole session."""
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"text": "fine"}\n{"text": ' + DEEP + "}\n")
    code = (
        "import sys\nfrom hf_cp.data_prep.inputs import InputError, load_input\n"
        f"try:\n    load_input({str(deep)!r})\nexcept InputError as e:\n    print(e); sys.exit(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-2000:])
    assert f"{deep}: line 2: arrays and objects nested deeper than {MAX_JSON_DEPTH}" in proc.stdout


def test_load_json_reads_what_json_loads_reads_up_to_the_depth():
    text = json.dumps({"a": [[{"b": "[[[[ {{ not brackets"}]], "c": '\\"[ \\\\'})
    assert load_json(text) == json.loads(text) and load_json(text.encode()) == json.loads(text)
    assert load_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)
    with pytest.raises(json.JSONDecodeError, match=r"nested deeper than 100 levels .*char 100\)"):
        load_json("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))


# ------------------------------------------------------------------ hangs: the chunk search
def _reference_largest_fitting_chunk(cost, length, keep, cap, upper):
    """The walk over chunk counts largest_fitting_chunk made before (it spun on 1e15 tokens)."""
    from hf_cp.plan.chunks import state_bytes

    free = (cost.memory_bytes(cap) - cost.memory_bytes(0) - state_bytes(cost, length)) / (
        cost.profile.activation_bytes_per_token
    )
    if free < 1:
        return 0
    m = max(-(-length // upper), 1)
    if length > free:
        m = max(m, int(length // (free / keep + 1)))
    while m <= length:
        c = -(-length // m)
        n = -(-length // c)
        q, r = divmod(length, n)
        kept = length if keep >= n else keep * q + max(0, r - (n - keep))
        if max(kept, q + (r > 0)) <= free:
            return c
        m += 1
    return 0


def test_largest_fitting_chunk_bisects_to_the_walks_answer():
    import random

    from hf_cp.plan.chunks import largest_fitting_chunk

    cost = CostModel(ModelDims.load("tiny-llama"), HardwareProfile.load("cpu"))
    rng = random.Random(40)
    for _ in range(3000):
        length, keep = rng.randint(1, 3000), rng.randint(1, 6)
        cap, upper = rng.randint(1, 600), rng.randint(1, 3000)
        assert largest_fitting_chunk(cost, length, keep, cap, upper) == _reference_largest_fitting_chunk(
            cost, length, keep, cap, upper
        ), (length, keep, cap, upper)


@pytest.mark.parametrize("cap, alpha", [(10**15, None), (4096, 1e300), (10**15, 1e300), (2**53, 1e-300)])
def test_the_sample_limit_search_ends_at_once_for_any_numbers(cap, alpha):
    """cp_max_tokens_per_rank: 1e15, or a profile's activation_bytes_per_token: 1e300 (past its
    check, built in code): largest_fitting_chunk and the bisection over sample lengths above it
    end within a second (they spun for hours)."""
    from hf_cp.balance.registry import get_balancer
    from hf_cp.balance.toolkit.sample_limit import sample_token_limit
    from hf_cp.plan.chunks import largest_fitting_chunk

    profile = HardwareProfile.load("cpu")
    if alpha is not None:
        profile = replace(profile, activation_bytes_per_token=alpha)
    cost = CostModel(ModelDims.load("tiny-llama"), profile)
    t0 = time.perf_counter()
    assert largest_fitting_chunk(cost, cap, 1, cap, cap) >= 0
    for name in ("chunkflow", "auto"):
        assert sample_token_limit(get_balancer(name), ClusterSpec(2, cap, 8), cost) > 0
    assert time.perf_counter() - t0 < 1.0


def test_hf_cp_plan_with_a_cap_of_1e15_tokens_finishes_in_seconds(lengths):
    rc, out, err, seconds = cli("plan", "--lengths", lengths, "--world", 2, *PLAN[:4], "--max-tokens-per-rank", 10**15)
    assert rc == 0, err
    assert seconds < 3, seconds
    assert "of cap 1000000000000000" in out


def test_a_config_capping_ranks_at_1e15_tokens_is_read(tmp_path):
    path = config(tmp_path, lambda d: d["training"].__setitem__("cp_max_tokens_per_rank", 10**15))
    assert load(path)["training"]["cp_max_tokens_per_rank"] == 10**15


def test_a_profile_alpha_of_1e300_bytes_is_refused_by_name(tmp_path, lengths):
    p = profile_file(tmp_path, activation_bytes_per_token=1e300)
    timed_refusal(lambda: HardwareProfile.load(p), ConfigError, str(p), "'activation_bytes_per_token' must be at most")
    refused(
        "plan", "--lengths", lengths, "--world", 2, *PLAN[:2], "--profile", p, names=("activation_bytes_per_token",)
    )
    path = config(tmp_path, lambda d: d["training"].__setitem__("cp_profile", str(p)))
    timed_refusal(lambda: load(path), ConfigError, "training.cp_profile", "activation_bytes_per_token")


# ------------------------------------------------------------------ hangs: alias bombs
def _bomb(levels: int = 9) -> str:
    """A "billion laughs": 9 levels of 9 aliases, 9^9 strings once expanded, 1 KB of YAML."""
    anchors = ['&a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    anchors += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "[" + ", ".join(anchors) + "]"


@pytest.mark.parametrize("key", ["output_dir", "learning_rate", "cp_balancer_options"])
def test_an_alias_bomb_in_a_config_is_refused_while_read(tmp_path, key):
    """Before: the schema's error message built repr() of the expanded value (9^9 strings) and
    hung; the reader now refuses it, and no message builds a whole repr first (brief)."""
    text = TINY.read_text().replace("training:\n", f"training:\n  {key}: {_bomb()}\n", 1)
    text = text.replace("  output_dir: outputs/tiny-cpu\n", "") if key == "output_dir" else text
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    timed_refusal(lambda: load(path), TrainConfigError, f"training config {path}", "alias bomb")


def test_an_alias_bomb_in_a_profile_an_override_or_a_balancer_option_is_refused(tmp_path, lengths):
    p = tmp_path / "profile.yaml"
    p.write_text(find_named("cpu", "profiles", (".yaml",)).read_text() + f"description: {_bomb()}\n")
    timed_refusal(lambda: HardwareProfile.load(p), ConfigError, f"profile {p}", "alias bomb")
    path = config(tmp_path)
    timed_refusal(lambda: load(path, [f"training.output_dir={_bomb()}"]), TrainConfigError, "override", "alias bomb")
    refused("plan", "--lengths", lengths, "--world", 2, *PLAN, "--balancer", "wlb", "--balancer-opt", f"fill={_bomb()}")


def test_messages_about_a_huge_value_do_not_build_its_whole_repr():
    from hf_cp.train.setup.schema import SchemaError, check_training_keys

    value = yaml.safe_load(_bomb())  # what PyYAML itself builds: 9^9 strings, shared
    t0 = time.perf_counter()
    assert len(brief(value)) <= 80
    with pytest.raises(SchemaError, match=r"training.output_dir: expected a string"):
        check_training_keys({"output_dir": value}, "run.yaml")
    assert time.perf_counter() - t0 < 1.0


def test_recursive_and_deeply_nested_yaml_is_refused():
    with pytest.raises(YAMLInputError, match=r"alias \*a .*contains it"):
        load_yaml("x: &a [1, *a]\n")
    with pytest.raises(YAMLInputError, match="nested deeper than 100 levels"):
        load_yaml(DEEP)


# ------------------------------------------------------------------ hangs: the world size
def test_a_world_of_a_million_ranks_is_refused_at_once(lengths, tmp_path):
    refused("plan", "--lengths", lengths, "--world", 1048576, *PLAN, names=("--world 1048576", f"{MAX_WORLD_SIZE:,}"))
    refused("train", config(tmp_path), "--dry-run", "--world", 1048576, names=("--world 1048576",))
    with pytest.raises(
        ValueError, match=f"world_size 1048576 is above the most ranks hf_cp plans for, {MAX_WORLD_SIZE}"
    ):
        ClusterSpec(1048576, 4096, 8)
    good = tmp_path / "plans.json"
    assert cli("plan", "--lengths", lengths, "--world", 2, *PLAN, "--json", good)[0] == 0
    d = json.loads(good.read_text())
    for p in d["plans"]:
        p["world_size"] = 1048576
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps(d))
    refused("plan", "--plan-json", huge, "--model", "tiny-llama", "--profile", "cpu", names=(str(huge), "1048576"))


# ------------------------------------------------------------------ duplicate YAML keys
def test_a_duplicate_training_section_is_refused_naming_both_lines(tmp_path):
    """Before: the second `training:` silently replaced the first (max_steps 1 and nothing else)."""
    path = tmp_path / "dup.yaml"
    text = TINY.read_text()
    path.write_text(text + "training:\n  max_steps: 1\n")
    first = text.splitlines().index("training:") + 1
    second = len(text.splitlines()) + 1
    timed_refusal(
        lambda: load(path),
        TrainConfigError,
        f"training config {path}",
        f"duplicate key 'training' at line {second}, column 1 (first at line {first}, column 1)",
    )


def test_a_duplicate_key_inside_a_section_or_a_profile_is_refused(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(
        TINY.read_text().replace("  seed: 0\n  num_train_epochs", "  seed: 0\n  seed: 1\n  num_train_epochs")
    )
    timed_refusal(lambda: load(path), TrainConfigError, "duplicate key 'seed' at line")
    p = tmp_path / "profile.yaml"
    p.write_text(find_named("cpu", "profiles", (".yaml",)).read_text() + "c0_ms: 2.0\n")
    timed_refusal(lambda: HardwareProfile.load(p), ConfigError, f"profile {p}", "duplicate key 'c0_ms'")


def test_merge_keys_are_yamls_own_override_not_duplicates():
    text = "base: &b {lr: 1, wd: 2}\nrun:\n  <<: *b\n  lr: 3\n"
    assert load_yaml(text) == yaml.safe_load(text) == {"base": {"lr": 1, "wd": 2}, "run": {"lr": 3, "wd": 2}}


# ------------------------------------------------------------------ inf and nan in plans
@pytest.mark.parametrize(
    "field, value",
    [
        ("c1_ms_per_token", 1e308),
        ("c2_ms_per_pair", 1e308),
        ("c0_ms", 1e308),
        ("static_bytes", 1e300),
        ("gpus_per_node", 10**20),
    ],
)
def test_profile_numbers_that_overflow_are_refused_by_name(tmp_path, lengths, field, value):
    """Before: a coefficient of 1e308 made `hf-cp plan` print inf and nan with exit code 0."""
    p = profile_file(tmp_path, **{field: value})
    refused("plan", "--lengths", lengths, "--world", 2, *PLAN[:2], "--profile", p, names=(str(p), field, "at most"))


def test_a_profile_at_every_maximum_plans_finite_numbers(tmp_path, lengths):
    from hf_cp.cost.hardware import PROFILE_MAXIMA

    top = {k: v for k, (v, _) in PROFILE_MAXIMA.items() if k in ("c1_ms_per_token", "c2_ms_per_pair", "c0_ms")}
    p = profile_file(tmp_path, **top)
    out = tmp_path / "plans.json"
    rc, stdout, err, _ = cli("plan", "--lengths", lengths, "--world", 2, *PLAN[:2], "--profile", p, "--json", out)
    assert rc == 0, err
    assert "inf" not in stdout and "nan" not in stdout
    json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))


def test_no_plan_report_carries_a_non_finite_number(lengths, monkeypatch):
    import hf_cp.cli.plan as plan_cli

    monkeypatch.setattr(plan_cli, "lower_bound_ms", lambda *a, **k: 0.0)  # ratio_to_bound: nan
    refused("plan", "--lengths", lengths, "--world", 2, *PLAN, names=("ratio_to_bound", "not a finite number"))


# ------------------------------------------------------------------ option ranges
@pytest.mark.parametrize(
    "flag, value",
    [
        ("--device-memory-gb", -5),
        ("--device-memory-gb", "nan"),
        ("--device-memory-gb", "inf"),
        ("--gpus-per-node", 0),
        ("--gpus-per-node", -1),
        ("--world", 0),
        ("--world", -2),
        ("--steps", 0),
        ("--seed", -1),
        ("--max-tokens-per-rank", 10**20),
        ("--tokens-per-step", 0),
        ("--chunk-keep", 0),
        ("--max-group-size", 0),
    ],
)
def test_plan_options_out_of_range_are_refused_by_flag(lengths, flag, value):
    args = ["--lengths", lengths, "--world", 2, *PLAN]
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    refused("plan", *args, names=(f"{flag} ",))


@pytest.mark.parametrize("flag, value", [("--world", -2), ("--dry-run-steps", 0), ("--nproc", -1)])
def test_train_options_out_of_range_are_refused_by_flag(tmp_path, flag, value):
    refused("train", config(tmp_path), "--dry-run", flag, value, names=(f"{flag} {value}",))


def test_a_valid_config_still_passes_the_dry_run(tmp_path):
    rc, out, err, _ = cli("train", config(tmp_path), "--dry-run", "--world", 2, "--dry-run-steps", 1)
    assert rc == 0 and "dry run passed" in out, err
