"""Exactness harness: run CPTrainer on N processes and the same global batches on one.

The reference trains the same model on the same global batches with plain torch, one sample
at a time (no packing, no CP, no DeepSpeed): loss = sum of token losses / valid targets of
the batch, global-norm clipping, AdamW. A correct CP trainer ends with the same parameters.

    python -m torch.distributed.run --nproc_per_node N -m hf_cp.train.testing SPEC.json
runs one distributed job described by SPEC (see `run_distributed`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..planning import GlobalBatchSampler
from ..resources import BUILTIN_CONFIGS
from ..shard import ShardMode
from .collator import IGNORE_INDEX, shifted_targets, valid_targets

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = BUILTIN_CONFIGS / "models" / "tiny-llama.json"


def hf_cp_attention_available() -> bool:
    try:
        import hf_cp.attention.interface  # noqa: F401  (registers "hf_cp")
    except ImportError:
        return False
    return True


def tiny_model(seed: int = 0, attn: Optional[str] = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**json.loads(TINY_MODEL.read_text()))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.set_attn_implementation(attn or ("hf_cp" if hf_cp_attention_available() else "sdpa"))
    model.config.use_cache = False
    return model


def synthetic_rows(lengths: Sequence[int], seed: int = 0, prompt_every: int = 3) -> List[dict]:
    """Random byte-level samples; every `prompt_every`-th one has a masked prompt (a third)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, n in enumerate(lengths):
        ids = rng.integers(0, 256, size=int(n)).tolist()
        labels = list(ids)
        if prompt_every and i % prompt_every == 0 and n > 3:
            for p in range(n // 3):
                labels[p] = IGNORE_INDEX
        rows.append({"input_ids": ids, "labels": labels, "length": int(n)})
    return rows


def zero2_config(bucket: int = 500_000_000) -> dict:
    """DeepSpeed ZeRO-2, fp32, torch AdamW (no JIT builds); everything else from the Trainer."""
    return {
        "zero_optimization": {
            "stage": 2,
            "overlap_comm": False,
            "contiguous_gradients": True,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
        },
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", "torch_adam": True},
        },
        "gradient_clipping": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
    }


# --------------------------------------------------------------------- scripted test balancer
class FixedModeBalancer:
    """A deterministic plan shape that exercises one CP mode and every execution path.

    Wave 0: the longest samples distributed over ranks [0, g) with `mode` (g the smallest
    registered group of at least 2 ranks that holds the longest sample), one local sample on
    each other rank. Then the leftovers, first-fit packed to the cap, one pack per wave on
    rank 0 alone, so every other rank idles in those waves. Not registered (auto would pick
    it up as a member): pass it to CPTrainer(balancer=...).
    """

    def __init__(self, mode):
        self.mode = ShardMode(mode).value
        self.name = f"fixed_{self.mode}"

    def plan(self, req):
        from ..balance import max_member_tokens
        from ..balance.packing import first_fit
        from ..plan import Group, Wave

        cl = req.cluster
        W, cap = cl.world_size, cl.max_tokens_per_rank
        lens = dict(zip(req.sample_ids, req.lengths))
        order = sorted(req.sample_ids, key=lambda s: (-lens[s], s))
        plan = req.empty_plan(self.name)
        groups, rest = [], list(order)
        g = max(2, cl.smallest_group_for(lens[order[0]]) or 2) if W > 1 else 1
        if g > 1:
            dist = []
            while rest and max_member_tokens(self.mode, [lens[s] for s in dist + [rest[0]]], g) <= cap:
                dist.append(rest.pop(0))
                if len(dist) == 2:
                    break
            if dist:
                groups.append(Group(ranks=tuple(range(g)), distributed=dist, mode=self.mode))
        for r in range(g if g > 1 else 0, W):
            fits = [s for s in rest if lens[s] <= cap]
            if fits:
                rest.remove(fits[0])
                groups.append(Group(ranks=(r,), local={r: [fits[0]]}))
        if groups:
            plan.waves.append(Wave(groups))
        too_long = [s for s in rest if lens[s] > cap]
        for s in too_long:
            size = cl.smallest_group_for(lens[s])
            plan.waves.append(Wave([Group(ranks=tuple(range(size)), distributed=[s], mode=self.mode)]))
        short = [s for s in rest if lens[s] <= cap]
        if short:
            for pack in first_fit(short, [lens[s] for s in short], cap):
                plan.waves.append(Wave([Group(ranks=(0,), local={0: list(pack)})]))
        return plan


class SpreadEveryDocBalancer:
    """Every sample alone in its own wave, distributed over the whole world with `mode`:
    samples shorter than the split leave some members with an empty shard."""

    def __init__(self, mode):
        self.mode = ShardMode(mode).value
        self.name = f"spread_{self.mode}"

    def plan(self, req):
        from ..plan import Group, Wave

        plan = req.empty_plan(self.name)
        ranks = tuple(range(req.cluster.world_size))
        plan.waves = [Wave([Group(ranks=ranks, distributed=[s], mode=self.mode)]) for s in req.sample_ids]
        return plan


def balancer_for(name: str):
    """Scripted balancers for names fixed_<mode> and spread_<mode>, else None (use the registry)."""
    if name.startswith("fixed_"):
        return FixedModeBalancer(name[len("fixed_") :])
    if name.startswith("spread_"):
        return SpreadEveryDocBalancer(name[len("spread_") :])
    return None


# --------------------------------------------------------------------- reference
def reference_params(spec: dict) -> Dict[str, torch.Tensor]:
    """Parameters after spec['steps'] optimizer steps, trained on one process, sample by sample."""
    return {k: v.detach().clone() for k, v in reference_model(spec).state_dict().items()}


def reference_eval_loss(spec: dict, steps: int) -> float:
    """Loss over spec['eval_lengths'] rows (sum of token losses / valid targets) of the reference
    model after `steps` optimizer steps, one sample at a time."""
    model = reference_model(dict(spec, steps=steps))
    model.eval()
    total, valid = 0.0, 0
    with torch.no_grad():
        for row in eval_rows(spec):
            ids = torch.tensor(row["input_ids"])[None]
            tgt = torch.from_numpy(shifted_targets(row["input_ids"], row["labels"]))
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
            total += float(F.cross_entropy(logits, tgt, ignore_index=IGNORE_INDEX, reduction="sum"))
            valid += valid_targets(row["input_ids"], row["labels"])
    return total / valid


def eval_rows(spec: dict) -> List[dict]:
    return synthetic_rows(spec["eval_lengths"], spec.get("data_seed", 0) + 1)


def reference_model(spec: dict):
    """The model after spec['steps'] optimizer steps, trained on one process, sample by sample."""
    rows = synthetic_rows(spec["lengths"], spec.get("data_seed", 0))
    model = tiny_model(spec.get("model_seed", 0), attn="sdpa")
    model.train()
    sampler = GlobalBatchSampler(
        [r["length"] for r in rows],
        spec["tokens_per_step"],
        seed=spec.get("seed", 42),
        max_steps=spec["steps"],
        shuffle=spec.get("shuffle", False),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=spec.get("lr", 1e-3), betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    for k in range(spec["steps"]):
        batch = sampler[k]
        opt.zero_grad()
        gv = sum(valid_targets(rows[s]["input_ids"], rows[s]["labels"]) for s in batch.sample_ids)
        for s in batch.sample_ids:
            ids = torch.tensor(rows[s]["input_ids"])[None]
            tgt = torch.from_numpy(shifted_targets(rows[s]["input_ids"], rows[s]["labels"]))
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
            (F.cross_entropy(logits, tgt, ignore_index=IGNORE_INDEX, reduction="sum") / gv).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.get("max_grad_norm", 1.0))
        opt.step()
    return model


def max_relative_error(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Per tensor: max |a - b| / max |b| (the relative error at the tensor's scale)."""
    if set(a) != set(b):
        raise AssertionError(f"different parameter names: {sorted(set(a) ^ set(b))}")
    return {k: float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in b}


# --------------------------------------------------------------------- one distributed job
def run_job(spec: dict) -> None:
    from accelerate import PartialState

    from .args import CPTrainingArguments
    from .trainer import CPTrainer, skip_deepspeed_shm_build

    skip_deepspeed_shm_build()
    from datetime import timedelta

    timeout_s = spec.get("ddp_timeout", 1800)
    PartialState(backend="gloo", timeout=timedelta(seconds=timeout_s))
    from datasets import Dataset

    rows = synthetic_rows(spec["lengths"], spec.get("data_seed", 0))
    model = tiny_model(spec.get("model_seed", 0), attn=spec.get("attn"))
    out = Path(spec["out"])
    ds_config = zero2_config()
    if spec.get("load_universal"):  # resume a checkpoint converted by DeepSpeed's ds_to_universal
        ds_config["checkpoint"] = {"load_universal": True}
    args = CPTrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        deepspeed=ds_config,
        seed=spec.get("seed", 42),
        cp_balancer=spec["balancer"],
        cp_profile=spec.get("profile", "h200-qwen2.5-7b"),
        cp_max_tokens_per_rank=spec["max_tokens_per_rank"],
        cp_tokens_per_step=spec["tokens_per_step"],
        cp_shuffle=spec.get("shuffle", False),
        cp_compare_balancer=None,
        max_steps=spec["steps"],
        learning_rate=spec.get("lr", 1e-3),
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=spec.get("max_grad_norm", 1.0),
        logging_steps=1,
        report_to="none",
        save_strategy="steps" if spec.get("save_steps") else "no",
        save_steps=spec.get("save_steps") or 500,
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_timeout=timeout_s,
        cp_loss_chunk_tokens=spec.get("loss_chunk_tokens", 2048),
        eval_strategy="steps" if spec.get("eval_steps") else "no",
        eval_steps=spec.get("eval_steps"),
        enable_jit_checkpoint=bool(spec.get("jit_checkpoint")),
        activation_checkpointing=bool(spec.get("activation_checkpointing")),
        cp_stop_on_nonfinite_grad=spec.get("stop_on_nonfinite_grad", True),
    )
    evaluating = bool(spec.get("eval_lengths"))
    trainer = CPTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(eval_rows(spec)) if evaluating else None,
        balancer=balancer_for(spec["balancer"]),
    )
    if spec.get("fault"):
        _inject_fault(trainer, model, **spec["fault"])
    trainer.train(resume_from_checkpoint=spec.get("resume_from"))
    if spec.get("activation_checkpointing") and not trainer.model.is_gradient_checkpointing:
        raise RuntimeError("activation_checkpointing was asked for but the model trained without it")
    if evaluating:  # after training, on every rank: every rank must report the same numbers
        final = trainer.evaluate()
        (out / f"eval_rank{trainer.cp_rank}.json").write_text(json.dumps(final))
        if trainer.cp_rank == 0:
            (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
    if trainer.cp_rank == 0:
        params = {k: v.detach().clone().cpu() for k, v in trainer.model.state_dict().items()}
        torch.save(params, out / "params.pt")
        (out / "history.json").write_text(json.dumps([r.to_dict() for r in trainer.cp_history]))
    from .launch import shutdown_distributed

    shutdown_distributed()


def _inject_fault(trainer, model, kind: str, rank: int, step: int, attempt: int = 0, seconds: float = 0) -> None:
    """At the first forward of step `step` (0-based) on process `rank`, in torchrun restart
    `attempt` only: `kill` SIGKILLs the process (a crashed node, an OOM-killed worker), `stall`
    sleeps `seconds` (a hung rank) while the others wait in a collective, `sigterm` sends the
    process a SIGTERM (a preemption notice reaching one rank), `nan` makes that forward's
    hidden states NaN (an overflow on one rank)."""
    import time

    from transformers import TrainerCallback

    if kind not in ("kill", "stall", "sigterm", "nan"):
        raise ValueError(f"fault kind {kind!r}: expected kill, stall, sigterm or nan")
    if trainer.cp_rank != rank or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != attempt:
        return
    armed = {"on": False}

    class _Arm(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            armed["on"] = state.global_step == step

    def _fault(module, inputs):
        if armed["on"]:
            armed["on"] = False
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            if kind == "nan":  # the layer's input turns NaN: loss and gradients follow
                return (inputs[0] * float("nan"),) + tuple(inputs[1:])
            time.sleep(seconds)

    trainer.add_callback(_Arm())
    model.model.layers[0].register_forward_pre_hook(_fault)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_distributed(spec: dict, nproc: int, timeout: float = 240, max_restarts: int = 0) -> subprocess.CompletedProcess:
    """Run `run_job(spec)` on `nproc` gloo processes (torchrun, restarting the whole job up to
    `max_restarts` times when a worker dies); raise with the log on failure."""
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    spec_file = out / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = dict(
        os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore"
    )
    port = str(spec.get("port") or free_port())
    if max_restarts:
        # restarts need a fresh store per attempt (see hf_cp.train.elastic)
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        launch = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", str(max_restarts)]
    else:
        launch = ["--master_port", port]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        *launch,
        "-m",
        "hf_cp.train.testing",
        str(spec_file),
    ]
    # own session: on a timeout (a hung collective) the launcher *and* its workers are killed
    with subprocess.Popen(
        cmd, cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM lets torchrun stop its workers (they run in sessions of their own)
            p.send_signal(signal.SIGTERM)
            try:
                out, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                out, err = p.communicate(timeout=30)
            raise TimeoutError(f"distributed job did not finish in {timeout} s (killed):\n{err[-8000:]}") from None
    proc = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    if proc.returncode != 0:
        raise RuntimeError(
            f"distributed job failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


if __name__ == "__main__":
    run_job(json.loads(Path(sys.argv[1]).read_text()))
