"""Profile files are checked as a whole: unknown keys (with the nearest known one), non-finite
numbers and numbers out of range are refused with the file and the field named."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hf_cp.cost.config_files import ConfigError
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.resources import find_named


def _base() -> dict:
    return yaml.safe_load(find_named("cpu", "profiles", (".yaml",)).read_text())


def _write(tmp_path, d, name="bad.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(d))
    return p


def _set(d, path, value):
    *head, last = path.split(".")
    for k in head:
        d = d[k]
    d[last] = value


CASES = [
    ("links.intra_node.bandwidth_gbps", -5, "links.intra_node.bandwidth_gbps must be positive"),
    ("links.inter_node.bandwidth_gbps", 0, "links.inter_node.bandwidth_gbps must be positive"),
    ("links.intra_node.latency_us", -1, "links.intra_node.latency_us must not be negative"),
    ("static_bytes", -1e12, "static_bytes must not be negative"),
    ("c1_ms_per_token", math.nan, "'c1_ms_per_token' must be a finite number"),
    ("c1_ms_per_token", math.inf, "'c1_ms_per_token' must be a finite number"),
    ("c2_ms_per_pair", -math.inf, "'c2_ms_per_pair' must be a finite number"),
    ("c0_ms", "fast", "'c0_ms' must be float"),
    ("head_split_factor", {2: 0.2}, "head_split_factor 2: 0.2"),
    ("head_split_factor", {0: 1.0}, "head_split_factor 0: 1.0"),
    ("chunk_efficiency", {128: math.nan}, "chunk_efficiency.128"),
    ("bytes_per_element", 2.5, "'bytes_per_element' must be a whole number"),
    ("gpus_per_node", True, "'gpus_per_node' must be int"),
    ("links", [1, 2], "'links' must be a mapping"),
]


@pytest.mark.parametrize("path,value,message", CASES, ids=[f"{c[0]}={c[1]}" for c in CASES])
def test_a_bad_number_is_refused_naming_the_file_and_the_field(tmp_path, path, value, message):
    d = _base()
    _set(d, path, value)
    f = _write(tmp_path, d)
    with pytest.raises(ConfigError) as e:
        HardwareProfile.load(f)
    assert str(f) in str(e.value) and message in str(e.value), str(e.value)


def test_unknown_keys_are_refused_with_the_nearest_known_key(tmp_path):
    d = _base()
    d["bandwith_gbps"] = 10
    f = _write(tmp_path, d)
    with pytest.raises(ConfigError, match=r"unknown field 'bandwith_gbps'"):
        HardwareProfile.load(f)
    d = _base()
    d["c1_ms_per_tokens"] = 1e-3
    with pytest.raises(ConfigError, match=r"did you mean 'c1_ms_per_token'\?"):
        HardwareProfile.load(_write(tmp_path, d))
    d = _base()
    d["links"]["intra_nodes"] = d["links"]["intra_node"]
    with pytest.raises(ConfigError, match=r"unknown link links.intra_nodes; did you mean 'intra_node'\?"):
        HardwareProfile.load(_write(tmp_path, d))
    d = _base()
    d["links"]["intra_node"]["bandwidth"] = 5
    with pytest.raises(ConfigError, match=r"links.intra_node needs exactly bandwidth_gbps and latency_us"):
        HardwareProfile.load(_write(tmp_path, d))


def test_every_shipped_profile_and_its_round_trip_pass_the_checks(tmp_path):
    for name in ("cpu", "h200-qwen2.5-7b", "h200-qwen2.5-7b-measured"):
        p = HardwareProfile.load(name)
        assert HardwareProfile.from_dict(p.to_dict(), source="round trip") == p


def test_hf_cp_plan_reports_a_bad_profile_without_a_traceback(tmp_path):
    d = _base()
    _set(d, "links.intra_node.bandwidth_gbps", 0)
    f = _write(tmp_path, d)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hf_cp",
            "plan",
            "--lengths",
            str(Path(__file__).resolve().parent.parent / "benchmarks" / "traces" / "chat_lmsys_chat1m_191conv.txt"),
            "--world",
            "4",
            "--profile",
            str(f),
            "--model",
            "qwen2.5-7b",
            "--steps",
            "1",
            "--progress",
            "off",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"{f}: links.intra_node.bandwidth_gbps must be positive" in out.stderr + out.stdout
