"""Restarts under torchrun: which attempt this is, where to resume, and a launcher check.

`torchrun --max-restarts N` restarts every worker when one dies. A restarted job must resume
from the last checkpoint (`resume_from_checkpoint: latest`); the sampler and planner are pure
functions of the step index, so the resumed run trains exactly the steps that were not saved.

Launcher pitfall (torch 2.13, gloo and NCCL alike): with the default *static* rendezvous, and
with c10d unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, the workers of every attempt share the
agent's key-value store. Process groups of the new attempt then read the addresses the dead
attempt published and fail with "connection refused" (pytorch/pytorch#135712, #167288). A
fresh store per attempt needs:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --rdzv-backend c10d \\
        --rdzv-endpoint HOST:PORT --max-restarts 3 ...
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional, Union

LATEST = ("latest", "last", "auto")
SHARED_STORE_ADVICE = ("restarts under torchrun's shared rendezvous store reconnect to the dead attempt's "
                       "addresses (pytorch/pytorch#135712); launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                       "and torchrun --rdzv-backend c10d --rdzv-endpoint HOST:PORT (accelerate launch --rdzv_backend c10d)")


def restart_attempt() -> int:
    """0 for the first run of the workers, k after the k-th torchrun restart."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def restart_problems(save_strategy: str, resume, env: Optional[dict] = None) -> List[str]:
    """Why a torchrun restart of this job would fail or lose work ([] when restarts are off or
    safe): a store shared across attempts, no checkpoints, or a resume setting other than latest."""
    env = os.environ if env is None else env
    if int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) <= 0:
        return []
    problems = []
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        problems.append(SHARED_STORE_ADVICE)
    if str(getattr(save_strategy, "value", save_strategy)).lower() == "no":
        problems.append("restarts are enabled but save_strategy is 'no': a restarted job starts again from step 0; "
                        "set save_strategy: steps and save_steps")
    # True needs a checkpoint to exist, which the first attempt does not have
    if not (isinstance(resume, str) and resume.lower() in LATEST):
        problems.append(f"restarts are enabled but resume_from_checkpoint is {resume!r}: a restarted job would not "
                        f"continue from its newest checkpoint; set resume_from_checkpoint: latest")
    return problems


def resolve_resume(resume: Union[None, bool, str], output_dir: str) -> Optional[str]:
    """The checkpoint to resume from.

    None/False: start fresh. "latest": the newest checkpoint-N of `output_dir`, or a fresh
    start when there is none yet (the first attempt of a restartable job). True: the newest
    checkpoint, which must exist (the Trainer's meaning). A path must exist: a typo must not
    silently restart training from scratch.
    """
    if resume is None or resume is False or resume == "":
        return None
    if resume is True or (isinstance(resume, str) and resume.lower() in LATEST):
        from transformers.trainer_utils import get_last_checkpoint

        found = get_last_checkpoint(output_dir) if Path(output_dir).is_dir() else None
        if found is None and resume is True:
            raise FileNotFoundError(f"resume_from_checkpoint=True but {output_dir} holds no checkpoint-N folder; "
                                    f"use 'latest' to start fresh when there is none")
        return found
    p = Path(str(resume))
    if not p.is_dir():
        raise FileNotFoundError(f"resume_from_checkpoint {resume!r} is not a checkpoint folder; use 'latest' to "
                                f"resume from the newest checkpoint of output_dir (or start fresh if none)")
    return str(p)


def checkpoint_step(checkpoint: str) -> int:
    """The optimizer steps a checkpoint folder has completed (its trainer_state.json)."""
    state = Path(checkpoint) / "trainer_state.json"
    if not state.is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint} has no trainer_state.json; is it a Trainer checkpoint?")
    return int(json.loads(state.read_text())["global_step"])


def truncate_history(path: Path, steps_done: int) -> int:
    """Keep the history lines of steps below `steps_done` (those the checkpoint holds); steps
    after it are trained again by the resumed run. Returns the number of lines dropped."""
    if not path.is_file():
        return 0
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    kept = [ln for ln in lines if json.loads(ln)["index"] < steps_done]
    if len(kept) != len(lines):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(ln + "\n" for ln in kept))
        tmp.replace(path)
    return len(lines) - len(kept)
