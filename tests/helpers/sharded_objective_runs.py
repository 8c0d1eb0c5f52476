"""DPO, KTO, GRPO and RLOO runs under each parameter engine for the tests: hf_cp's trainer of the
objective (the tiny chat Llama; DPO and KTO with a copy of it as `ref_model`, GRPO with beta > 0
has TRL build its reference from the model's folder) as a rank of one torchrun job
(`python -m helpers.sharded_objective_runs SPEC.json`), under DeepSpeed ZeRO-2, FSDP2 or ZeRO-3,
recording per step the loss and every parameter's whole gradient before the optimizer step
(harness.capture: DeepSpeed's safe_get_full_grad, FSDP2's gathered DTensors).

Under FSDP2 and ZeRO-3 every forward (the policy's, the reference's, with or without gradient)
gathers parameters layer by layer, so every rank must run as many as the others in each wave:
the runs spread a long sample over both ranks and leave a rank without work in some waves.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch

from helpers import dpo_runs, grpo_runs, kto_runs, rloo_runs
from helpers.harness.capture import capture_steps
from helpers.harness.job import engine_args
from helpers.tiny_tokenizer import tiny_chat_model

TRAINERS = {"dpo": dpo_runs, "kto": kto_runs, "grpo": grpo_runs, "rloo": rloo_runs}
ROLLOUTS = ("grpo", "rloo")  # built from a model folder (TRL loads GRPO's reference from it)
# the capture reads gradients where the Trainer clips: a bound no gradient reaches, so no clipping
NO_CLIP = 1e6


def _fresh_accelerate() -> None:
    """The previous run's Accelerator state must not leak into this one: its plugin, and the
    engine it wrote into the process's gloo state (DEEPSPEED or FSDP where MULTI_CPU was)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    grpo_runs._reset_accelerate()  # the plugin and gradient state
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_CPU
    for flag in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "FSDP_VERSION"):  # set by the last run's args
        os.environ.pop(flag, None)


def _record_plans(trainer, objective: str) -> dict:
    """{"passes": per step, per wave, each rank's own passes (StepPlan.rank_passes); "spread":
    the sizes of the CP groups that spread a sample}, as the steps ran."""
    seen = {"passes": [], "spread": set()}

    def of(step) -> None:
        plan = step.plan
        seen["passes"].append([plan.rank_passes(w) for w in range(len(plan.waves))])
        seen["spread"].update(len(g.ranks) for w in plan.waves for g in w.groups if g.distributed)

    if objective in ROLLOUTS:
        real = trainer._cp_rank_step

        def rank_step(groups, rollout, index):
            step, planned = real(groups, rollout, index)
            of(step)
            return step, planned

        trainer._cp_rank_step = rank_step
    else:
        agree = trainer._cp_agree

        def agreed(step):
            of(step)
            return agree(step)

        trainer._cp_agree = agreed
    return seen


def engine_in_use(trainer) -> str:
    """What actually ran: "zero<stage>" from the DeepSpeed engine, "fsdp2" when the parameters
    are DTensor shards, else "replicated"."""
    engine = getattr(trainer, "deepspeed", None)
    if engine is not None:
        return f"zero{engine.zero_optimization_stage()}"
    if any(hasattr(p, "full_tensor") for p in trainer.model.parameters()):
        return "fsdp2"
    return "replicated"


def train_run(run: dict, rows: list, steps: int, model_path: str) -> dict:
    """One run: {"losses", "grads": [per step {name: whole gradient}], "passes", "spread"}."""
    _fresh_accelerate()
    objective = run["trainer"]
    runs = TRAINERS[objective]
    settings = dict(run.get("settings", {}), max_grad_norm=NO_CLIP, ddp_timeout=120)
    settings.update(engine_args({"engine": run["engine"]}, tiny_chat_model(0)))
    if objective in ROLLOUTS:
        trainer = runs.hf_cp_trainer(rows, run["out"], steps, model_path, **settings)
    else:
        extra = {} if run.get("ref", True) else {"ref": False}
        trainer = runs.hf_cp_trainer(rows, run["out"], steps, **extra, **settings)
    records, stop = capture_steps(trainer)
    seen = _record_plans(trainer, objective)
    try:
        trainer.train()
    finally:
        stop()
    return {
        "losses": [x["loss"] for x in trainer.state.log_history if "loss" in x],
        "grads": [records[k]["grads"] for k in sorted(records)],
        "passes": seen["passes"],
        "engine": engine_in_use(trainer),
        "spread": sorted(seen["spread"]),
    }


def _job(spec_file: str) -> None:
    from accelerate import PartialState

    from hf_cp.train.launch.entry import shutdown_distributed
    from hf_cp.train.setup.trainer_setup import skip_deepspeed_shm_build

    skip_deepspeed_shm_build()
    PartialState(backend="gloo", timeout=timedelta(seconds=120))
    spec = json.loads(Path(spec_file).read_text())
    for run in spec["runs"]:
        got = train_run(run, spec["rows"][run["trainer"]], spec["steps"], spec.get("model", ""))
        if int(os.environ.get("RANK", "0")) == 0:
            torch.save(got, Path(run["out"]) / "run.pt")
    shutdown_distributed()


if __name__ == "__main__":
    _job(sys.argv[1])
