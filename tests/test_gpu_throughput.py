"""scripts/gpu_throughput.py: the throughput numbers it derives from a run's step history, and
its CPU smoke run end to end (the same runs as on the GPU, tiny config, 1 step each), which must
write a table with a row per configuration."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from hf_cp.cost.flops import ModelFlops, device_peak
from hf_cp.train.measure.step_record import StepRecord

from helpers import REPO, load_file_module


@pytest.fixture(scope="module")
def script():
    return load_file_module("gpu_throughput", "scripts/gpu_throughput.py")


def _record(index, ids, tokens, wall_ms, peak, predicted):
    return StepRecord(
        index=index, epoch=0, global_step=index + 1, num_samples=len(ids), global_tokens=tokens,
        global_valid_tokens=tokens - len(ids), loss=3.0 - index, measured_ms=[wall_ms - 5], rank_tokens=[tokens],
        step_wall_ms=wall_ms, predicted_ms=[wall_ms], predicted_step_ms=wall_ms, waves=1, plan_digest="d",
        trained_sample_ids=ids, rank=0, peak_memory_gb=[peak], predicted_peak_memory_gb=[predicted],
    )  # fmt: skip


def test_numbers_leave_out_the_first_step_and_use_the_one_flops_definition(script):
    lengths = [100, 300, 400, 50]
    records = [
        _record(0, [0, 1], 400, 9000.0, 10.0, 12.0),  # compilation and warm-up: left out of the throughput
        _record(1, [2], 400, 200.0, 14.0, 13.0),
        _record(2, [3, 0], 150, 100.0, 13.5, 13.0),
    ]
    flops = ModelFlops(matmul_per_token=1e9, attention_per_pair=1e6)
    row = script.Row(run="auto", data="bundled")
    script.fill_numbers(row, records, lengths, flops, device_peak("NVIDIA H200"))
    step_flops = flops.samples([400], [None]) + flops.samples([50, 100], [None, None])
    assert row.steps == 3 and row.tokens_per_step == 275
    assert row.tokens_per_s == pytest.approx(550 / 0.3)
    assert row.tflops == pytest.approx(step_flops / 0.3 / 1e12)
    assert row.mfu == pytest.approx(row.tflops / 989.0)
    assert (row.peak_gb, row.model_gb) == (14.0, 13.0)  # the largest peak, beside that step's prediction
    assert row.loss_values == "3.000 -> 2.000 -> 1.000"


@pytest.mark.slow  # a dozen CPU training runs of one step and the TRL recipes: ~3 minutes
def test_the_smoke_run_writes_a_row_per_configuration(script, tmp_path):
    table = tmp_path / "throughput.md"
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "gpu_throughput.py"),
            "--smoke",
            "--out",
            str(tmp_path),
            "--table",
            str(table),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    text = table.read_text()
    rows = [
        line.split(" | ")
        for line in text.splitlines()
        if line.startswith("| bundled |") or line.startswith("| onedoc |")
    ]
    assert sorted((r[0][2:], r[1]) for r in rows) == sorted(
        (d, v.label) for d in script.DATA for v in script.VARIANTS
    ), "one row per data set and configuration"
    by = {(r[0][2:], r[1]): r for r in rows}
    for data in script.DATA:
        auto = by[(data, "auto")]
        assert auto[2] == "cpu_flash" and auto[-1].startswith("ok"), auto
        assert float(auto[7]) > 0 and float(auto[8]) > 0, "tokens/s and model TFLOP/s measured"
        assert by[(data, "torch_varlen")][-1].startswith("refused: cp_attention_kernel: torch_varlen runs on CUDA only")
        assert by[(data, "auto+liger")][-1].startswith("refused: use_liger_kernel is not supported on cpu")
        assert by[(data, "auto+compile")][-1].startswith("ok")
    assert "MFU not reported: no dense bf16 peak known for cpu" in text
    for recipe in ("TRL DPO", "TRL GRPO", "FSDP2"):
        assert re.search(rf"^\| {recipe} \|.*\| (ok|skipped: .* not in this checkout) \|$", text, re.M), recipe
