"""`hf-cp train --dry-run`: what a launch would refuse, found without launching."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_cp.cli import main as cli_main
from hf_cp.train.checkpoint.schedule import ScheduleChangedError, schedule_record, write_schedule
from hf_cp.train.launch.dry_run import dry_run

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")


def test_dry_run_plans_the_first_steps_and_the_eval_set(tmp_path):
    lines = dry_run(TINY, [f"training.output_dir={tmp_path}"], world_size=2, steps=5)
    text = "\n".join(lines)
    assert "2 rank(s), balancer auto, 228 training samples, 46 steps of 8192 tokens" in text
    assert "longest sample 5479 tokens" in text
    assert "first 5 step(s) planned and valid" in text and "static would take" in text
    assert "evaluation: 12 samples in 1 planned batch(es), valid" in text


def test_dry_run_raises_what_the_launch_would(tmp_path):
    out = [f"training.output_dir={tmp_path}"]
    # one rank cannot hold the 5479-token sample whole: static refuses it, pointing to chunkflow
    message = r"sample 211 has 5479 tokens; the largest CP group .* or set cp_balancer: chunkflow"
    with pytest.raises(ValueError, match=message):
        dry_run(TINY, out + ["training.cp_balancer=static"], world_size=1, steps=2)
    # auto (chunkflow among its members) trains it as dependent chunks; static is not compared there
    with pytest.warns(RuntimeWarning, match="comparison balancer 'static' trains samples up to 4096 tokens"):
        text = "\n".join(dry_run(TINY, out, world_size=1, steps=2))
    assert "auto trains samples up to 18800 tokens (dependent chunks on one rank)" in text
    assert "first 2 step(s) planned and valid" in text
    with pytest.raises(ValueError, match="needs attn_implementation='hf_cp'.*model.attn_implementation: hf_cp"):
        dry_run(TINY, out + ["model.attn_implementation=sdpa"], world_size=2, steps=5)
    with pytest.raises(KeyError, match="unknown balancer"):
        dry_run(TINY, out + ["training.cp_balancer=nope"], world_size=2, steps=2)
    chunkflow = ["training.cp_balancer=chunkflow", "training.cp_balancer_options={chunk_size: 256}"]
    # ChunkFlow's dependent chunks reach their K/V state store through the hf_cp attention
    sdpa = chunkflow + [
        "model.attn_implementation=sdpa",
        "training.cp_max_group_size=1",  # no CP group: the chunks alone need hf_cp attention
        "training.cp_max_tokens_per_rank=8192",
    ]
    with pytest.raises(ValueError, match=r"the 'chunkflow' plans run samples \[.*\] as dependent chunks"):
        dry_run(TINY, out + sdpa, world_size=2, steps=2)
    text = "\n".join(dry_run(TINY, out + chunkflow, world_size=2, steps=2))  # and with it, they are valid plans
    assert "first 2 step(s) planned and valid" in text
    # a checkpoint in output_dir trained on another global batch size
    ckpt = tmp_path / "checkpoint-4"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    lengths = [0]  # any schedule other than the current one
    write_schedule(str(ckpt), dict(schedule_record(lengths, 4096, 0, True, 2), num_samples=228))
    with pytest.raises(ScheduleChangedError, match="tokens per step: 4096 in the checkpoint, 8192 now"):
        dry_run(TINY, out + ["training.resume_from_checkpoint=latest"], world_size=2, steps=2)


def test_dry_run_from_the_command_line(tmp_path, capsys):
    assert cli_main(["train", TINY, "--dry-run", "--world", "12", "--set", f"training.output_dir={tmp_path}"]) == 2
    assert "world_size 12 is not a power of two" in capsys.readouterr().err
    # --max-restarts resumes from the newest checkpoint, as the launch would; no checkpoints is a warning
    assert (
        cli_main(
            [
                "train",
                TINY,
                "--dry-run",
                "--nproc",
                "2",
                "--max-restarts",
                "1",
                "--dry-run-steps",
                "2",
                "--set",
                f"training.output_dir={tmp_path}",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert f"resume: no checkpoint in {tmp_path} yet, a fresh start" in text
    assert "warning: restarts are enabled but save_strategy is 'no'" in text
    assert text.rstrip().endswith("dry run passed: nothing was launched")


def test_the_memory_table_uses_the_memory_the_auto_cap_was_sized_from(tmp_path):
    """Before: "cp_max_tokens_per_rank auto: ... fits 25.3 GB" and then "device memory unknown" in
    the engines' table, which read the profile's device memory only (the CPU profile has none)."""
    lines = dry_run(
        TINY, [f"training.output_dir={tmp_path}", "training.cp_max_tokens_per_rank=auto"], world_size=1, steps=1
    )
    text = "\n".join(lines)
    sized = [line for line in lines if line.startswith("cp_max_tokens_per_rank auto: ")]
    assert sized, text
    gb = sized[0].rsplit(" fits ", 1)[1].split(" GB")[0]
    assert "device memory unknown" not in text, text
    assert f"largest model in {gb} GB" in text, text
