"""One CPTrainer step on a tiny Llama, returning its loss and the gradients before the optimizer,
in this process (world 1) or on N gloo processes (torchrun + DDP, no DeepSpeed: every rank holds
the full averaged gradient). Used by the pre-packed and shared-prompt exactness tests.

    PYTHONPATH=.:tests python -m torch.distributed.run --nproc_per_node N -m helpers.masked_training SPEC.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

REPO = Path(__file__).resolve().parents[2]
TINY_LLAMA = REPO / "hf_cp" / "configs" / "models" / "tiny-llama.json"


def tiny_llama(seed: int = 0, attn: str = "hf_cp"):
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_cp.attention.interface  # noqa: F401  (registers "hf_cp")

    cfg = LlamaConfig(**json.loads(TINY_LLAMA.read_text()))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.set_attn_implementation(attn)
    model.config.use_cache = False
    return model


class BlocksBalancer:
    """Every sample of the step distributed over the whole world in mode "blocks", in one wave:
    `placement` identity (contiguous chunks, blocks run by their query's owner), random (random
    cuts, owners in a random permutation) or remote (random chunks, every block run away from
    its query's owner)."""

    handles_masks = True

    def __init__(self, placement: str):
        if placement not in ("identity", "random", "remote"):
            raise ValueError(f"placement {placement!r}: expected identity, random or remote")
        self.placement, self.name = placement, f"blocks_{placement}"

    def plan(self, req):
        from hf_cp.plan.block_layout import all_remote_layout, contiguous_layout, doc_slices, random_layout
        from hf_cp.plan.step_plan import Group, Wave

        g, heads = req.cluster.world_size, req.cost.dims.num_heads
        masks = req.masks or {}
        slices = doc_slices(list(req.lengths), [masks.get(s) for s in req.sample_ids])
        if self.placement == "identity":
            layout = contiguous_layout(list(req.lengths), g, heads, slices)
        else:
            layout = random_layout(list(req.lengths), g, heads, slices, seed=req.step + 1)
            if self.placement == "remote":
                layout = all_remote_layout(layout, g, seed=req.step + 2)
        plan = req.empty_plan(self.name)
        plan.waves = [Wave([Group(tuple(range(g)), list(req.sample_ids), "blocks", blocks=layout)])]
        return plan


def one_step(
    rows: List[dict],
    out_dir: str,
    balancer="static",
    cap: int = 4096,
    attn: str = "hf_cp",
    eval_rows: Optional[List[dict]] = None,
    **extra,
) -> dict:
    """Train one optimizer step over all of `rows` (one global batch); return
    {"loss", "grads", "history"} as the trainer saw them (gradients before the optimizer step,
    no clipping), and with `eval_rows` "eval_loss": CPTrainer.evaluate on them before training."""
    from datasets import Dataset
    from transformers import TrainerCallback

    from hf_cp.train import CPTrainer, CPTrainingArguments

    grads: Dict[str, torch.Tensor] = {}

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            for name, p in model.named_parameters():
                grads[name.removeprefix("module.")] = p.grad.detach().clone()

    tokens = sum(len(r["input_ids"]) for r in rows)
    args = CPTrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        seed=42,
        cp_balancer=balancer if isinstance(balancer, str) else "static",
        cp_max_tokens_per_rank=cap,
        cp_tokens_per_step=max(tokens, 1),
        cp_shuffle=False,
        cp_compare_balancer=None,
        max_steps=1,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        dataloader_num_workers=0,
        cp_plan_in_subprocess=False,
        **extra,
    )
    if isinstance(balancer, str) and balancer.startswith("blocks_"):
        balancer = BlocksBalancer(balancer[len("blocks_") :])
    elif isinstance(balancer, str) and balancer.startswith("chunks_"):  # harness.balancers' ChunkFlow shapes
        from helpers.harness.balancers import balancer_for

        balancer = balancer_for(balancer)
    trainer = CPTrainer(
        model=tiny_llama(0, attn),
        args=args,
        train_dataset=Dataset.from_list(rows),
        balancer=None if isinstance(balancer, str) else balancer,
        callbacks=[Grab()],
    )
    out = {}
    if eval_rows is not None:
        out["eval_loss"] = trainer.evaluate(Dataset.from_list(eval_rows))["eval_loss"]
    trainer.train()
    return dict(out, loss=trainer.cp_history[0].loss, grads=grads, history=[r.to_dict() for r in trainer.cp_history])


def max_relative_error(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in b)


# ----------------------------------------------------------------------------- several processes
def _job(spec_file: str) -> None:
    from accelerate import PartialState

    spec = json.loads(Path(spec_file).read_text())
    PartialState(backend="gloo")
    # the chunked LM-head loss over several chunks per micro-batch, as long samples run it: under
    # plain DDP (find_unused_parameters) the bypassed head must still count as used in forward
    got = one_step(
        spec["rows"],
        spec["out"],
        spec.get("balancer", "static"),
        spec.get("cap", 4096),
        cp_loss_chunk_tokens=spec.get("loss_chunk_tokens", 8),
    )
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(got, Path(spec["out"]) / "result.pt")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run_processes(spec: dict, nproc: int, timeout: float = 240) -> dict:
    """`one_step` on `nproc` gloo processes; rank 0's {"loss", "grads"}."""
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]),
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port)]
    cmd += ["-m", "helpers.masked_training", str(out / "spec.json")]
    from helpers.harness.job import run_launcher

    p = run_launcher(cmd, env, timeout, cwd=REPO)
    if p.returncode != 0:
        raise RuntimeError(f"{nproc}-process job failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return torch.load(out / "result.pt")


if __name__ == "__main__":
    _job(sys.argv[1])
