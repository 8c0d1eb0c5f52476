"""One distributed CPTrainer job, launched by the tests with torchrun on gloo processes.

    python -m torch.distributed.run --nproc_per_node N -m helpers.harness.job SPEC.json

(with the repository and its tests/ folder on PYTHONPATH, as run_distributed sets it)

SPEC describes one training run, or several under "runs" that the same processes train one
after the other (process start-up, imports and the process group are paid once). Each run
writes to its own `out` folder, on rank 0: params.pt (final parameters), steps.pt (per step:
gradients before clipping, parameters after the optimizer step; see capture.py),
history.json (CPTrainer's step records), log_history.json (the Trainer's logs: loss and
grad_norm per step).

Keys of a run: lengths, tokens_per_step, max_tokens_per_rank, steps, balancer (a registered
name, or a scripted one of balancers.py: fixed_<mode>, spread_<mode>, chunks_<N>_keep_<K>), out;
optional bf16 (mixed precision), engine ("zero2", the default: DeepSpeed ZeRO-2; "fsdp2": FSDP2 through the Trainer's
fsdp arguments; "zero3": DeepSpeed ZeRO-3), model ("llama" or "qwen2", models.py), balancer_options, model_seed,
data_seed, seed, lr, adam_epsilon, max_grad_norm, profile, attn, loss_chunk_tokens, eval_lengths,
eval_steps, save_steps, resume_from, load_universal, jit_checkpoint,
activation_checkpointing, stop_on_nonfinite_grad, ddp_timeout, fault (see _inject_fault),
mutation (see MUTATIONS: a deliberate bug, for the tests that show the exactness check fails),
streaming (the rows as a streaming datasets.IterableDataset) and expect_error (the run must stop
with an error on every rank: recorded, and the job goes on).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from .balancers import balancer_for
from .capture import capture_steps, deepspeed_snapshot
from .models import IGNORE_INDEX, ROOT, eval_rows, spec_model, train_rows

# A loss scaled by 0.1% is the smallest error the exactness check is required to catch.
MUTATION_SCALE = 1.001

MUTATIONS = {
    "loss_scale": "every wave's summed loss x 1.001: the loss the trainer records, logs and backpropagates",
    "grad_scale": "the loss handed to backward x 1.001: gradients only, the recorded loss unchanged",
    "drop_target": "the last valid target of every micro-batch on rank 0 is ignored",
    # (a MoE model's run only: model qwen3_moe)
    "router_local_counts": "the MoE router term weighs each rank's probabilities by its own expert counts, "
    "not the step's (the census's all-reduce dropped)",
}


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


def zero3_config() -> dict:
    """DeepSpeed ZeRO-3 as recipes/ds-zero3-cpu.json sets it (fp32, torch AdamW, no prefetch)."""
    return json.loads((ROOT / "hf_cp" / "recipes" / "ds-zero3-cpu.json").read_text())


def engine_args(spec: dict, model) -> dict:
    """The CPTrainingArguments that choose the run's engine (spec "engine")."""
    engine = spec.get("engine", "zero2")
    if engine == "zero2":
        ds_config = zero2_config()
        if spec.get("load_universal"):  # resume a checkpoint converted by DeepSpeed's ds_to_universal
            ds_config["checkpoint"] = {"load_universal": True}
        return {"deepspeed": ds_config}
    if engine == "zero3":
        return {"deepspeed": zero3_config()}
    if engine == "fsdp2":
        layer = type(model.model.layers[0]).__name__
        return {"fsdp": True, "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": [layer]}}
    raise ValueError(f"engine {engine!r}: expected zero2, zero3 or fsdp2")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient whole: an FSDP2 shard (DTensor) is gathered (a collective: every
    rank calls it, in the same order)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# --------------------------------------------------------------------- one distributed job
def run_job(spec: dict) -> None:
    from accelerate import PartialState

    from hf_cp.train.launch.entry import shutdown_distributed
    from hf_cp.train.setup.trainer_setup import skip_deepspeed_shm_build

    skip_deepspeed_shm_build()
    runs = spec.get("runs") or [spec]
    timeout_s = max(r.get("ddp_timeout", 1800) for r in runs)
    PartialState(backend="gloo", timeout=timedelta(seconds=timeout_s))
    for run in runs:
        t0 = time.perf_counter()
        if run.get("expect_error"):
            _train_expecting_error(run)
        elif run.get("lora"):
            from helpers.lora_job import train_lora  # peft: loaded only by a job that trains a LoRA run

            train_lora(run)
        else:
            train_one(run)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"harness.job: {Path(run['out']).name} trained in {time.perf_counter() - t0:.1f} s", flush=True)
    shutdown_distributed()


def _train_expecting_error(spec: dict) -> None:
    """A run the trainer must stop with an error on every rank (a fault it detects, in step on
    every rank): each rank writes its error to error_rank<r>.txt and the job goes on with its
    next run; a rank that trains to the end writes no file (the test fails on that)."""
    try:
        train_one(spec)
    except Exception as e:
        rank = int(os.environ.get("RANK", "0"))
        (Path(spec["out"]) / f"error_rank{rank}.txt").write_text(f"{type(e).__name__}: {e}")


def train_one(spec: dict) -> None:
    from accelerate.state import AcceleratorState, GradientState
    from datasets import Dataset

    from hf_cp.train.setup.args import CPTrainingArguments
    from hf_cp.train.trainer import CPTrainer

    timeout_s = spec.get("ddp_timeout", 1800)
    # the previous run's Accelerator state (its DeepSpeed plugin) must not leak into this one
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    model = spec_model(spec, attn=spec.get("attn", "hf_cp"))
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    args = CPTrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        **engine_args(spec, model),
        seed=spec.get("seed", 42),
        cp_balancer=spec["balancer"],
        cp_balancer_options=spec.get("balancer_options"),
        cp_profile=spec.get("profile", "h200-qwen2.5-7b"),
        cp_max_tokens_per_rank=spec["max_tokens_per_rank"],
        cp_tokens_per_step=spec["tokens_per_step"],
        cp_shuffle=spec.get("shuffle", False),
        cp_compare_balancer=spec.get("compare_balancer"),
        cp_compare_measured=bool(spec.get("compare_measured")),
        max_steps=spec["steps"],
        learning_rate=spec.get("lr", 1e-3),
        adam_epsilon=spec.get("adam_epsilon") or 1e-8,
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
        bf16=bool(spec.get("bf16")),
    )
    evaluating = bool(spec.get("eval_lengths"))
    train = Dataset.from_list(train_rows(spec))
    trainer = CPTrainer(
        model=model,
        args=args,
        train_dataset=train.to_iterable_dataset() if spec.get("streaming") else train,
        eval_dataset=Dataset.from_list(eval_rows(spec)) if evaluating else None,
        balancer=balancer_for(spec["balancer"]),
    )
    if spec.get("fault"):
        _inject_fault(trainer, model, **spec["fault"])
    if spec.get("mutation"):
        _inject_mutation(trainer, spec["mutation"])
    records, stop_capture = capture_steps(trainer)
    try:
        trainer.train(resume_from_checkpoint=spec.get("resume_from"))
    finally:
        stop_capture()
    if spec.get("activation_checkpointing") and not trainer.model.is_gradient_checkpointing:
        raise RuntimeError("activation_checkpointing was asked for but the model trained without it")
    if evaluating:  # after training, on every rank: every rank must report the same numbers
        final = trainer.evaluate()
        (out / f"eval_rank{trainer.cp_rank}.json").write_text(json.dumps(final))
    if spec.get("engine") == "zero3":  # partitioned: gathered whole (a collective on every rank)
        params = deepspeed_snapshot(trainer.model)
    else:
        params = {k: full_tensor(v).detach().clone().cpu() for k, v in trainer.model.state_dict().items()}
    if trainer.cp_rank == 0:
        engine = {
            "engine": spec.get("engine", "zero2"),
            "wrapper": type(trainer.model_wrapped).__name__,
            # FSDP2 leaves its parameters as shards (DTensors) between steps, ZeRO-3 as partitions
            "sharded_parameters": sum(
                hasattr(p, "to_local") or hasattr(p, "ds_id") for p in trainer.model.parameters()
            ),
            "parameters": sum(1 for _ in trainer.model.parameters()),
        }
        plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
        policy = getattr(plugin, "mixed_precision_policy", None)
        if policy is not None:
            engine["param_dtype"], engine["reduce_dtype"] = str(policy.param_dtype), str(policy.reduce_dtype)
        (out / "engine.json").write_text(json.dumps(engine))
        torch.save(params, out / "params.pt")
        torch.save(records, out / "steps.pt")
        (out / "history.json").write_text(json.dumps([r.to_dict() for r in trainer.cp_history]))
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))


def _inject_mutation(trainer, kind: str) -> None:
    """A deliberate bug in the trainer path under test (MUTATIONS), for the tests that show
    the exactness check catches it. Only test specs set it."""
    if kind == "loss_scale":
        setup = trainer._cp_setup  # the step executor is built there: scale this trainer's one only

        def scaled_setup():
            setup()
            executor = trainer.cp_runtime.executor
            if "wave_loss" not in vars(executor):
                wave_loss = executor.wave_loss
                executor.wave_loss = lambda model, mb: wave_loss(model, mb) * MUTATION_SCALE

        trainer._cp_setup = scaled_setup
    elif kind == "grad_scale":
        runtime = trainer.cp_runtime
        backward = runtime.backward  # the step executor is built with it at the first step
        runtime.backward = lambda loss, last: backward(loss * MUTATION_SCALE, last)
    elif kind == "drop_target":
        loader = trainer.get_train_dataloader

        def get_train_dataloader():
            dl = loader()
            collator = dl.dataset.collator
            micro_batch = collator.micro_batch

            def dropping(plan, wave, group, rank, *rest):
                mb = micro_batch(plan, wave, group, rank, *rest)
                if mb is not None and rank == 0:
                    valid = torch.nonzero(mb.shift_labels[0] != IGNORE_INDEX).flatten()
                    if len(valid):
                        mb.shift_labels[0, valid[-1]] = IGNORE_INDEX
                return mb

            collator.micro_batch = dropping
            return dl

        trainer.get_train_dataloader = get_train_dataloader
    elif kind == "router_local_counts":
        setup = trainer._cp_setup

        def local_census_setup():
            setup()
            executor = trainer.cp_runtime.executor
            if "router_census" not in vars(executor):
                census = executor.router_census

                def local_census(model, step):
                    world, executor.world_size = executor.world_size, 1  # no all-reduce: this rank's counts
                    try:
                        return census(model, step)
                    finally:
                        executor.world_size = world

                executor.router_census = local_census

        trainer._cp_setup = local_census_setup
    else:
        raise ValueError(f"mutation {kind!r}: expected one of {sorted(MUTATIONS)}")


STALL_STARTED = "stall_started.txt"  # in the run's output folder: time.time() as a stall begins


def _inject_fault(trainer, model, kind: str, rank: int, step: int, attempt: int = 0, seconds: float = 0) -> None:
    """At the first forward of step `step` (0-based) on process `rank`, in torchrun restart
    `attempt` only: `kill` SIGKILLs the process (a crashed node, an OOM-killed worker), `stall`
    sleeps `seconds` (a hung rank) while the others wait in a collective, `sigterm` sends the
    process a SIGTERM (a preemption notice reaching one rank), `nan` makes that forward's
    hidden states NaN (an overflow on one rank), `full_disk` fails every torch.save into the
    checkpoint saved after that step with ENOSPC (a full disk seen by one rank)."""
    from transformers import TrainerCallback

    if kind not in ("kill", "stall", "sigterm", "nan", "full_disk"):
        raise ValueError(f"fault kind {kind!r}: expected kill, stall, sigterm, nan or full_disk")
    if trainer.cp_rank != rank or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != attempt:
        return
    if kind == "full_disk":  # every torch.save into checkpoint-<step> (0-based step + 1) fails: ENOSPC
        import errno

        import torch

        save, folder = torch.save, f"checkpoint-{step + 1}"

        def full(obj, f, *args, **kwargs):
            if folder in str(f):
                raise OSError(errno.ENOSPC, "No space left on device", str(f))
            return save(obj, f, *args, **kwargs)

        torch.save = full
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
            # when the stall began: a test bounds the time from here to the job's failure
            (Path(trainer.args.output_dir) / STALL_STARTED).write_text(repr(time.time()))
            time.sleep(seconds)

    trainer.add_callback(_Arm())
    model.model.layers[0].register_forward_pre_hook(_fault)


# --------------------------------------------------------------------- launching it
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_launcher(cmd: list, env: dict, timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run a torchrun launcher in its own session and return it finished (any return code).
    On a timeout (a hung collective) SIGTERM lets torchrun stop its workers, which run in
    sessions of their own: killing the launcher's group alone would leave them holding the
    pipes (and this call) forever; SIGKILL of the group only if that does not end it."""
    with subprocess.Popen(
        cmd, cwd=str(cwd), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGTERM)
            try:
                out, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                out, err = p.communicate(timeout=30)
            raise TimeoutError(f"distributed job did not finish in {timeout} s (killed):\n{err[-8000:]}") from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


LOG_KEPT = 200_000  # characters of a failed job's stdout and stderr kept in its error


def run_distributed(
    spec: dict, nproc: int, timeout: float = 240, max_restarts: int = 0, module: str = "helpers.harness.job"
) -> subprocess.CompletedProcess:
    """Run `run_job(spec)` on `nproc` gloo processes (torchrun, restarting the whole job up to
    `max_restarts` times when a worker dies); raise with the log on failure. `module`: the job
    run as `python -m module SPEC.json` (a test's own job wrapping run_job)."""
    runs = spec.get("runs") or [spec]
    for run in runs:
        Path(run["out"]).mkdir(parents=True, exist_ok=True)
    spec_file = Path(runs[0]["out"]) / "spec.json"
    spec_file.write_text(json.dumps(spec))
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=path,
    )
    port = str(spec.get("port") or free_port())
    if max_restarts:
        # restarts need a fresh store per attempt (see hf_cp.train.checkpoint.resolve)
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
        module,
        str(spec_file),
    ]
    proc = run_launcher(cmd, env, timeout)
    if proc.returncode != 0:
        raise RuntimeError(
            # the whole log up to a generous cap: a test asserts on every rank's message, and the
            # first failing rank's comes before the others' tracebacks and torchrun's summary
            f"distributed job failed (rc {proc.returncode}):\n{proc.stdout[-LOG_KEPT:]}\n{proc.stderr[-LOG_KEPT:]}"
        )
    return proc


if __name__ == "__main__":
    run_job(json.loads(Path(sys.argv[1]).read_text()))


def run_recipe(config: str, out: Path, timeout: float) -> subprocess.CompletedProcess:
    """A shipped config trained as the README runs it: `accelerate launch --config_file
    recipes/cpu-2proc-zero2.yaml -m hf_cp.train CONFIG`, into `out` (any return code)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "recipes/cpu-2proc-zero2.yaml",
           "-m", "hf_cp.train", config, "--set", f"training.output_dir={out}"]  # fmt: skip
    return run_launcher(cmd, dict(os.environ, PYTHONWARNINGS="ignore"), timeout)
