"""Entry point of a training run from one YAML config (hf_cp.train.setup.config reads it).

accelerate launch --config_file recipes/cpu-2proc-zero2.yaml -m hf_cp.train configs/tiny-cpu.yaml
torchrun --nproc_per_node 2 -m hf_cp.train configs/tiny-cpu.yaml
hf-cp train configs/tiny-cpu.yaml              # one process, or under a launcher
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import List, Optional

from hf_cp.train.checkpoint.run_lock import OutputDirLockedError, hold_run_lock
from hf_cp.train.checks.launch import check_ddp_timeout
from hf_cp.train.launch.trainers import TRAINERS, build_trainer
from hf_cp.train.setup import config as config_module
from hf_cp.train.setup.config import (
    DEFAULT_DDP_TIMEOUT_S,
    DataPreparation,
    apply_template,
    build_model,
    load_config,
    load_datasets,
    load_run_tokenizer,
    training_arguments,
)
from hf_cp.train.setup.data_section import CACHE_FOLDER
from hf_cp.train.setup.model_section import model_class
from hf_cp.train.setup.peft_section import wrap_model


def shutdown_distributed() -> None:
    """Leave the process group in step: exiting with gloo's threads still attached to live
    groups can abort the interpreter (std::terminate) after training finished."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def single_process_env(environ) -> bool:
    """A run started without a launcher (`hf-cp train CONFIG`, python -m hf_cp.train): the
    environment of a world of one. DeepSpeed otherwise looks for MPI to discover its world
    (ModuleNotFoundError: mpi4py). True when it was set."""
    if any(k in environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return False
    import socket

    with socket.socket() as sock:  # a free port for the one-process group
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    environ.setdefault("MASTER_PORT", str(port))
    return True


def start_cpu_processes(deepspeed: bool, ddp_timeout_s: float) -> None:
    """On a machine without CUDA: gloo for every collective (DeepSpeed's CPU default is not
    available here), set before the Trainer's Accelerator exists, the world group with the run's
    collective timeout (ddp_timeout, as on GPU); DeepSpeed's shared-memory op is not built."""
    import torch

    from hf_cp.train.setup.trainer_setup import skip_deepspeed_shm_build  # torch, transformers, deepspeed

    if torch.cuda.is_available():
        return
    if deepspeed:
        skip_deepspeed_shm_build()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from accelerate import PartialState

        if deepspeed:  # as accelerate launch sets it: DeepSpeed's own comm is set up on the same group
            # (without it, ZeRO-3's zero.Init saw a world of 1 under torchrun: "train_batch_size is not
            # equal to micro_batch_per_gpu * gradient_acc_step * world_size 2 != 1 * 1 * 1")
            os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")

        PartialState(backend="gloo", timeout=timedelta(seconds=int(ddp_timeout_s)))


def run(config_path: str, overrides: Optional[List[str]] = None, started: Optional[dict] = None) -> int:
    """`started["trainer"]`: the trainer once built (main tells set-up refusals from failures in training)."""
    cfg = load_config(config_path, overrides, TRAINERS)
    src = cfg["_source"]
    tcfg = cfg.get("training") or {}
    timeout = tcfg.get("ddp_timeout", DEFAULT_DDP_TIMEOUT_S)
    check_ddp_timeout(timeout, src)  # before the process group is made with it
    if tcfg.get("deepspeed"):
        single_process_env(os.environ)  # no launcher: a world of one, not MPI discovery
    start_cpu_processes(bool(tcfg.get("deepspeed")), timeout)
    t0 = time.perf_counter()
    # first: the cheap checks before the model loads
    args = training_arguments(tcfg, src, TRAINERS.config_class(cfg["trainer"]))
    tokenizer = load_run_tokenizer(cfg.get("model") or {}, src)
    model = build_model(cfg.get("model") or {}, src)
    if cfg["trainer"] == "cp":  # a TRL trainer wraps it itself, from peft_config (build_trainer)
        model = wrap_model(model, cfg)
    dcfg = cfg.get("data") or {}
    apply_template(dcfg, tokenizer, src)  # the run's tokenizer, saved with the final model, carries it
    # raw rows are preprocessed here (trainer cp): the main process of each node first, the others read its copy
    preparation = DataPreparation(
        cfg["trainer"],
        tokenizer,
        Path(args.output_dir) / CACHE_FOLDER,
        main_first=lambda desc: args.main_process_first(desc=desc),
        is_main=args.process_index == 0,
    )
    dataset, eval_dataset = load_datasets(dcfg, src, preparation)
    trainer = build_trainer(cfg, args, model, tokenizer, dataset, eval_dataset)
    if started is not None:
        started["trainer"] = trainer
    # output_dir's lock (checkpoint/run_lock.py) covers the saves after training too; train() takes it no second time
    with hold_run_lock(args.output_dir, trainer.cp_rank, trainer.cp_world, args.cp_break_lock):
        # `latest` resumes a restarted job (torchrun --max-restarts) from its newest checkpoint
        trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
        trainer.save_state()  # trainer_state.json (log history with eval losses) for `hf-cp report`
        # a stop signal (enable_jit_checkpoint): a checkpoint, no final model
        stopped = getattr(trainer, "cp_stopped_early", None)
        final = Path(args.output_dir) / "final"
        saved = args.cp_save_final_model and not stopped
        if saved:  # whatever save_strategy says about checkpoints: a run ends with its model
            trainer.save_model(str(final))  # every rank: DeepSpeed gathers collectively; the tokenizer too
    if trainer.cp_rank == 0:
        world = trainer.cp_world
        named = "" if cfg["trainer"] == "cp" else f", trainer {cfg['trainer']}"
        print(
            f"\n==== hf_cp training summary: {Path(src).name}, {world} process(es){named}, "
            f"balancer {args.cp_balancer}, {len(dataset)} samples, {time.perf_counter() - t0:.1f} s ===="
        )
        summary = trainer.cp_summary() if hasattr(trainer, "cp_summary") else []  # GRPO, RLOO: TRL's logs
        for line in summary:
            print("  " + line)
        evals = [(r["step"], r["eval_loss"]) for r in trainer.state.log_history if "eval_loss" in r]
        if evals:
            print(
                f"  eval loss ({len(eval_dataset)} samples): "
                + " -> ".join(f"{loss:.4f} at step {step}" for step, loss in evals)
            )
        if stopped:
            checkpoint = Path(args.output_dir) / f"checkpoint-{stopped['step']}"
            print(
                f"  stopped early by {stopped['signal']} (seen by rank(s) {stopped['ranks']}) after step "
                f"{stopped['step']}: {checkpoint} saved; run again with resume_from_checkpoint: latest"
            )
        if saved and cfg.get("peft"):  # save_model writes the adapter only
            print(f"  final LoRA adapter saved to {final} (peft.PeftModel.from_pretrained(base_model, {str(final)!r}))")
        elif saved:
            what = "model and tokenizer" if tokenizer is not None else "model (no tokenizer in this run)"
            loader = model_class(cfg.get("model") or {}, src).__name__  # a VLM's own class, not a causal LM's
            print(f"  final {what} saved to {final} ({loader}.from_pretrained({str(final)!r}))")
        elif not stopped:
            print("  final model not saved (cp_save_final_model: false)")
        print(f"  logs and per-step history: {args.output_dir}")
    shutdown_distributed()
    return 0


def _record_errors(fn):
    """torchrun's failure summary then shows the failing rank's exception, not 'To enable
    traceback see ...' (torch.distributed.elastic's @record; a no-op without torchrun)."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import record
    except ImportError:  # pragma: no cover - torch without the elastic package
        return fn
    return record(fn)


@_record_errors
def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m hf_cp.train",
        description=__doc__ + "\n" + config_module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    config_module.add_config_arguments(p)
    a = p.parse_args(argv)
    return run_refusing_once(a.config, a.overrides)


def run_refusing_once(config_path: str, overrides: Optional[List[str]] = None) -> int:
    """run(), with a refusal made before the first step said once (refuse_once)."""
    started: dict = {"trainer": None}
    try:
        return run(config_path, overrides, started)
    except SETUP_REFUSALS as err:
        trainer = started["trainer"]
        if trainer is not None and getattr(trainer, "cp_history", None):
            raise  # a step ran: a failure in training, each rank's own (a save, a stall)
        return refuse_once(err)


# what hf_cp's set-up checks raise (SetupError, TrainConfigError, CorruptCheckpointError,
# ScheduleChangedError, UntrustedCheckpointError are ValueErrors; an unknown balancer a KeyError;
# another run's lock on output_dir, on every rank)
SETUP_REFUSALS = (ValueError, KeyError, TypeError, FileNotFoundError, OutputDirLockedError)
TRACEBACK_ENV = "HF_CP_TRACEBACK"  # set to 1: a refusal prints its traceback too


def refuse_once(err: BaseException) -> int:
    """A refusal before the first step: every rank checks the same config, data and files and
    raises the same error, so rank 0 says it once, without a traceback (before: a traceback per
    rank); every rank exits with status 2."""
    if int(os.environ.get("RANK", "0") or 0) == 0:
        text = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"hf-cp train: error: {text}", file=sys.stderr)
        if os.environ.get(TRACEBACK_ENV):
            traceback.print_exception(err)
        else:
            print(f"(set {TRACEBACK_ENV}=1 for the traceback)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
