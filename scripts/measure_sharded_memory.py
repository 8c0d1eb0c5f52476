"""Measured peak memory per rank against the memory model, for FSDP2 (and ZeRO-2 or ZeRO-3) on
CPU processes: one torchrun job per engine trains a mid-size Llama (22M parameters, fp32,
AdamW) for 3 planned steps and reports each rank's peak resident memory above its baseline
(the process before the model is built) beside the memory model's peak per rank at the cap
(the trainer's own cost model: model states + gathered working set + logits chunk + alpha x
tokens). Large allocations are mmap'ed (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the
resident set at once and its peak is the peak of live memory.

    python scripts/measure_sharded_memory.py [--engines fsdp2,zero2] [--world 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=8192,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    use_cache=False,
)
CAP = 512  # tokens per rank per micro-batch
STEPS = 3


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes


def worker(engine: str, out: Path) -> None:
    """One rank of the job (under torchrun)."""
    from datetime import timedelta

    import torch
    from accelerate import PartialState
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_cp.train.setup.args import CPTrainingArguments
    from hf_cp.train.setup.trainer_setup import skip_deepspeed_shm_build
    from hf_cp.train.trainer import CPTrainer

    skip_deepspeed_shm_build()
    PartialState(backend="gloo", timeout=timedelta(seconds=600))
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    lengths = [200, 300, 150, 400, 250, 100, 350, 180, 220, 90, 310, 120]
    rows = [{"input_ids": [(7 * i + 3 * j) % 8000 + 1 for j in range(n)]} for i, n in enumerate(lengths)]
    engines = {
        "fsdp2": dict(
            fsdp=True, fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
        ),
        "zero2": dict(deepspeed=str(ROOT / "hf_cp" / "recipes" / "ds-zero2-cpu.json")),
        "zero3": dict(deepspeed=str(ROOT / "hf_cp" / "recipes" / "ds-zero3-cpu.json")),
    }
    base = rss_bytes()  # imports and the process group, before the model
    model = LlamaForCausalLM(LlamaConfig(**MODEL, attn_implementation="hf_cp"))
    args = CPTrainingArguments(
        output_dir=str(out / engine),
        use_cpu=True,
        cp_balancer="auto",
        cp_profile="cpu",
        cp_max_tokens_per_rank=CAP,
        cp_tokens_per_step=2 * CAP,
        cp_compare_balancer=None,
        cp_shuffle=False,
        max_steps=STEPS,
        learning_rate=1e-4,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        cp_record_history=False,
        **engines[engine],
    )
    trainer = CPTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows))
    trainer.train()
    profile = trainer.cp_cost.profile
    record = {
        "engine": engine,
        "rank": rank,
        "parameters": sum(p.numel() for p in model.parameters()) if engine != "zero3" else None,
        "measured_peak_bytes": peak_rss_bytes() - base,
        "model_static_bytes": profile.static_bytes,
        "model_peak_bytes": profile.static_bytes + profile.activation_bytes_per_token * CAP,
    }
    (out / f"{engine}_rank{rank}.json").write_text(json.dumps(record))


def run(engines, world: int) -> list:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", PYTHONWARNINGS="ignore")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
        for engine in engines:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                str(world),
                "--master_port",
                str(29500 + hash(engine) % 400),
                __file__,
                "--worker",
                engine,
                "--out",
                str(out),
            ]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{engine}: the job failed:\n{done.stderr[-4000:]}")
            rows += [json.loads((out / f"{engine}_rank{r}.json").read_text()) for r in range(world)]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="fsdp2,zero2")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, Path(a.out))
        return 0
    rows = run(a.engines.split(","), a.world)
    print(f"{'engine':7} {'rank':>4} {'measured MB':>12} {'model MB':>9} {'model/measured':>15}")
    for r in rows:
        ratio = r["model_peak_bytes"] / r["measured_peak_bytes"]
        print(
            f"{r['engine']:7} {r['rank']:>4} {r['measured_peak_bytes'] / 1e6:12.1f} {r['model_peak_bytes'] / 1e6:9.1f} {ratio:15.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
