"""The training engine's cost per gradient reduction, measured: the profile's engine_reduction_ms_per_gb.

A data-parallel gradient reduction under DeepSpeed ZeRO-2 is more than its bytes over the link:
the engine copies every gradient into its buckets, averages them, reduces each partition and
keeps its own copies, once per backward pass. On 2 CPU ranks (gloo, fp32, SmolLM2-135M) that is
about 5 s a backward while the same bytes take 0.4 s in a bare all-reduce, and it is what a step of
a real model mostly waits on there. It grows with the model's gradients, not with the step's
tokens, so the profile keeps it per GB of gradients (CostModel.reduction_fixed_ms prices it).

`measure_engine_reduction` runs `world` processes on this machine, each building the model from
its config with random weights: one forward+backward of a short input without the engine (the
fastest of a few), then the same under `deepspeed.initialize` with the given config over several
micro-steps and optimizer steps; the engine's extra time per backward (the median), over the
gradients' GB, is the number. Launched on CPU (gloo); CUDA would need `world` devices.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Union

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_cp.cost.config_files import ConfigError
from hf_cp.cost.execution import zero_stage_of
from hf_cp.profiling.layers import load_hf_config
from hf_cp.readers import load_json


class EngineReductionError(RuntimeError):
    """The measurement could not run (settings, the engine, a worker's failure)."""


@dataclass(frozen=True)
class EngineReduction:
    """What one measurement found. `engine_ms`: each micro-step's forward+backward under the engine
    (rank 0's clock; the ranks wait for each other in the reduction); `plain_ms`: the fastest
    forward+backward of the same input without it."""

    deepspeed_config: str
    world: int
    parameters: int
    gradient_gb: float
    tokens: int
    plain_ms: float
    engine_ms: List[float]

    @property
    def extra_ms(self) -> float:
        """The engine's time per backward beyond the plain pass (median over micro-steps)."""
        return max(0.0, statistics.median(self.engine_ms) - self.plain_ms)

    @property
    def ms_per_gb(self) -> float:
        return self.extra_ms / self.gradient_gb

    def describe(self) -> str:
        spread = f"{min(self.engine_ms):.0f}-{max(self.engine_ms):.0f}"
        return (
            f"engine reduction: {self.extra_ms:.0f} ms per backward beyond the plain pass ({self.plain_ms:.0f} ms; "
            f"under the engine {spread} ms over {len(self.engine_ms)} micro-steps) for {self.gradient_gb:.3f} GB of "
            f"gradients on {self.world} ranks: {self.ms_per_gb:.0f} ms per GB"
        )


def engine_config(path: Union[str, Path], accumulation: int) -> dict:
    """The DeepSpeed config of `path` made concrete for a bare engine: a micro-batch of 1,
    `accumulation` micro-steps per optimizer step, AdamW where the config leaves the optimizer to
    the Trainer ("auto" values are the Trainer's to fill, so they go)."""
    try:
        cfg = load_json(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"DeepSpeed config {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"DeepSpeed config {path}: a JSON object is needed")
    stage = zero_stage_of(cfg)
    if stage not in (1, 2):
        raise ConfigError(
            f"DeepSpeed config {path}: zero_optimization.stage {stage}: the per-reduction engine cost is measured "
            "for ZeRO-1/2 (the executions whose reductions the cost model prices; ZeRO-3 shards parameters)"
        )

    def concrete(d):
        return {k: concrete(v) if isinstance(v, dict) else v for k, v in d.items() if v != "auto"}

    cfg = concrete(cfg)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-6, "torch_adam": True}}
    cfg["train_micro_batch_size_per_gpu"] = 1
    cfg["gradient_accumulation_steps"] = accumulation
    cfg.pop("train_batch_size", None)
    cfg.pop("scheduler", None)
    return cfg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, model_config: dict, ds_config: dict, tokens: int, steps: int, out: str):
    import deepspeed  # the engine under measurement; importing it sets up its accelerator, so only here
    from transformers import AutoModelForCausalLM

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)  # as `hf-cp profile` times: one thread per rank, steadier on shared machines
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(load_hf_config(model_config))
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(1))

    def pass_ms(run) -> float:
        t = time.perf_counter()
        run()
        return (time.perf_counter() - t) * 1e3

    plain = min(pass_ms(lambda: model(input_ids=ids, labels=ids).loss.backward()) for _ in range(3))
    model.zero_grad(set_to_none=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    times = []
    for _ in range(steps):
        dist.barrier()
        times.append(pass_ms(lambda: engine.backward(engine(input_ids=ids, labels=ids).loss)))
        engine.step()
    if rank == 0:
        parameters = sum(p.numel() for p in model.parameters())
        Path(out).write_text(json.dumps({"parameters": parameters, "plain_ms": plain, "engine_ms": times}))
    dist.destroy_process_group()


def measure_engine_reduction(
    model: Union[str, Path, dict],
    deepspeed_config: Union[str, Path],
    world: int = 2,
    tokens: int = 64,
    steps: int = 8,
    accumulation: int = 2,
    bytes_per_element: int = 4,
) -> EngineReduction:
    """Measure the engine's cost per backward on `world` CPU processes (module docstring). `model`:
    a model config as `hf-cp profile --model` takes; `tokens`: the input of every pass (short: the
    number is about the gradients, not the compute); `steps` micro-steps, an optimizer step every
    `accumulation` of them (the first micro-step after an optimizer step measured slower)."""
    if world < 2:
        raise EngineReductionError(f"world {world}: a reduction needs at least 2 ranks")
    if steps < 2 or accumulation < 1 or tokens < 1:
        raise EngineReductionError(f"steps {steps} (>= 2), accumulation {accumulation}, tokens {tokens} (>= 1)")
    cfg = load_hf_config(model)
    ds = engine_config(deepspeed_config, accumulation)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        try:
            mp.spawn(_worker, args=(world, _free_port(), cfg.to_dict(), ds, tokens, steps, out), nprocs=world)
        except mp.ProcessRaisedException as e:
            raise EngineReductionError(f"a measuring process failed: {str(e).strip().splitlines()[-1]}") from None
        got = json.loads(Path(out).read_text())
    gb = got["parameters"] * bytes_per_element / 1e9
    return EngineReduction(
        str(deepspeed_config), world, got["parameters"], gb, tokens, got["plain_ms"], got["engine_ms"]
    )
