"""The world-2 CPTrainer runs of the fast suite, trained by one torchrun job.

Starting two processes, importing torch, transformers and DeepSpeed and building the process
group costs more than training the tiny model for a few steps, so every run listed here is
trained by the same two gloo processes, one after the other (harness.job's "runs"), once per
test session: the `world2_job` fixture (conftest.py) returns {name: spec} with each run's
output folder. A fast world-2 test adds its run to world2_runs() and reads it from the
fixture (`shared_or_own_run`) instead of starting a job of its own. Below them: specs of runs
that start a job of their own (spec_for), and what the tests read back from any run.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Dict

from hf_cp.balance import available_balancers, get_balancer
from hf_cp.cost.dims import ModelDims, VisionDims
from hf_cp.cost.execution import execution_named
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.cost.model import CostModel
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.planning import GlobalBatchSampler, Planner
from hf_cp.samples.plan_inputs import GRID_COLUMNS, grid_columns_vision

from helpers.harness.balancers import balancer_for
from helpers.harness.check import check_run
from helpers.harness.job import MUTATIONS, run_distributed
from helpers.harness.models import tiny_config, train_rows
from helpers.lora_job import WORLD2_LORA_RUNS

# Unshuffled at 500 tokens per step: [0 1 2] (three packs at a 256 cap: a rank idles in one
# wave of static), [3] alone (a step that gives ranks no sample), [4..9], [10..16].
LENGTHS = [200, 150, 130, 250, 255, 90, 7, 33, 60, 40, 120, 100, 18, 5, 64, 21, 77]
CAP = 256
TOKENS_PER_STEP = 500

# At 600 tokens per step, unshuffled: [0 1 2 3] (sample 0 has 400 tokens, over the 256-token
# cap: some CP group of 2 must hold it) and [4..9] (short samples only). Every balancer but
# static (one CP size for the whole run) distributes sample 0 and keeps others local.
BALANCE_LENGTHS = [400, 60, 30, 90, 120, 100, 150, 90, 60, 70]
BALANCE_TOKENS_PER_STEP = 600
BALANCE_STEPS = 2

# 400 and 260 tokens exceed one rank's cap (256): evaluated over a CP group of 2
EVAL_LENGTHS = [400, 30, 7, 120, 90, 260, 5]

# every sample distributed over both ranks on its own: the 1-token ones leave rank 1 empty
EMPTY_SHARD_LENGTHS = [1, 40, 2, 1, 30, 3]

HAS_MEGATRON = importlib.util.find_spec("megatron") is not None
BALANCERS = [b for b in available_balancers() if b != "megatron" or HAS_MEGATRON]

# the balancers the Gated DeltaNet hybrid trains under in the shared job; chunkflow with 100-token
# chunks spreads the 400-token sample (state passing) and runs the 150- and 120-token ones as 2
# dependent chunks each (the state store carries the recurrent state: attention/chunk_recurrence.py)
HYBRID_BALANCERS = ("static", "auto", "magi", "usp", "dcp", "chunkflow")
QWEN3_5_BALANCERS = HYBRID_BALANCERS
HYBRID_OPTIONS = {"chunkflow": dict(balancer_options=dict(chunk_size=100, keep=1))}
MOE_BALANCERS = ("static", "auto", "magi", "usp")
# a tiny Qwen2.5-VL with random images and a clip (the 400-token sample's, over a CP group of 2)
VLM_BALANCERS = ("static", "auto", "magi")
# ... and under chunkflow with 100-token chunks keeping 1: step 1 runs the 400-token sample (an image
# and a clip) as 4 dependent chunks on rank 0 beside a packed micro-batch with an image on rank 1;
# step 2 the 150- and 120-token ones (each an image and a clip) as 2 chunks on each rank
VLM_CHUNKFLOW_OPTIONS = dict(chunk_size=100, keep=1, spread_stragglers=False)
# a tiny Qwen3-VL (DeepStack, each clip frame apart) on the same lengths: auto keeps the 400-token
# sample and its clip over the CP group of 2 and the others local, static spreads every sample
QWEN3_VL_BALANCERS = ("static", "auto")

# the deliberately broken trainers run this balancer (CP groups and local samples, see above)
MUTATED_BALANCER = "auto"

WORLD2_JOB_TIMEOUT = 900
FIXTURE_TIMEOUT = WORLD2_JOB_TIMEOUT + 60  # the first test to ask for the job waits for it
JOB_TIMEOUT = 300  # one job of one run
COLLECTIVE_TIMEOUT = 120  # a hung collective fails the job in minutes, not ddp_timeout's default


def lengths_spec(balancer: str, steps: int = 3, **kw) -> dict:
    """A run on LENGTHS (without its output folder), with AdamW's eps at CHUNKFLOW_ADAM_EPSILON
    (why: there): at the Trainer's 1e-8, ring zigzag's embedding came out 1.04e-5 off after one
    step on an AMD EPYC machine (over the 1e-5 tolerance), its gradients equal."""
    kw.setdefault("adam_epsilon", CHUNKFLOW_ADAM_EPSILON)
    return dict(
        lengths=LENGTHS, tokens_per_step=TOKENS_PER_STEP, max_tokens_per_rank=CAP, steps=steps, balancer=balancer, **kw
    )


def balance_spec(balancer: str, **kw) -> dict:
    """A run on BALANCE_LENGTHS (without its output folder)."""
    return dict(
        lengths=BALANCE_LENGTHS,
        tokens_per_step=BALANCE_TOKENS_PER_STEP,
        max_tokens_per_rank=CAP,
        steps=BALANCE_STEPS,
        balancer=balancer,
        **kw,
    )


def nan_spec(**kw) -> dict:
    """Rank 1's hidden states turn NaN in step 2 of 3, a checkpoint after every step."""
    return lengths_spec("auto", steps=3, save_steps=1, fault=dict(kind="nan", rank=1, step=1), **kw)


def empty_shard_spec(mode: str) -> dict:
    return dict(
        lengths=EMPTY_SHARD_LENGTHS, tokens_per_step=40, max_tokens_per_rank=64, steps=3, balancer=f"spread_{mode}"
    )


# ChunkFlow on BALANCE_LENGTHS (cap 256), chunks run on one rank instead of a CP group:
# 100-token chunks keeping 1: the 400-token sample is 4 dependent chunks, 3 of them recomputed;
# 60-token chunks keeping 4: the 150-token sample is 3 chunks, all kept (K >= N), the 400-token one 7
CHUNKFLOW_RUNS = {
    "balancer-chunkflow": dict(chunk_size=100, keep=1, spread_stragglers=False),
    "chunkflow-keep-all": dict(chunk_size=60, keep=4, spread_stragglers=False),
}


# ChunkFlow mixed with CP, on the tiny Qwen2 (GQA 4:1): chunkflow with 32-token chunks, K=1 and
# spread_stragglers (its default) plans, at 730 tokens per step unshuffled, step 1 = samples
# [0..4]: wave 0 the 400-token straggler on a CP group of both ranks; wave 1 the 150-token
# sample as 5 dependent chunks (4 recomputed) on rank 0 beside the 90-token one as 3 on rank 1
# (padded with 2 zero-weight micro-batches); then rank 1 alone (rank 0 pads) runs the 60-token
# sample as 2 chunks and the 30-token one whole. Step 2 runs dependent chunks on both ranks only.
CHUNKFLOW_MIXED_LENGTHS = [400, 150, 60, 30, 90, 120, 100, 150, 90, 60, 70]
CHUNKFLOW_MIXED_TOKENS_PER_STEP = 730
CHUNKFLOW_MIXED_OPTIONS = dict(chunk_size=32, keep=1)

# Samples longer than the whole world holds (2 x 256 tokens) train under chunkflow as dependent
# chunks on one rank: at 800 tokens per step, unshuffled, [0..3] (600 tokens: 6 chunks of 100, 5
# recomputed) and [4..6] (520 tokens: 6 chunks of 87 and 86); no CP group of 2 holds either.
CHUNKFLOW_BEYOND_WORLD_LENGTHS = [600, 60, 30, 90, 520, 120, 100]


def chunkflow_beyond_world_spec(model: str = "llama") -> dict:
    return dict(
        lengths=CHUNKFLOW_BEYOND_WORLD_LENGTHS,
        tokens_per_step=800,
        max_tokens_per_rank=CAP,
        steps=2,
        balancer="chunkflow",
        balancer_options=dict(chunk_size=100, keep=1),
        model=model,
        adam_epsilon=CHUNKFLOW_ADAM_EPSILON,
    )


# AdamW's eps for the ChunkFlow runs of the tiny Qwen2 and of the exact-N matrix
# (test_trainer_chunkflow.py), against the Trainer's 1e-8. The check compares parameters after
# AdamW, which moves an entry whose gradient is near eps by lr * g / eps: float rounding of that
# gradient is amplified lr / eps = 1e5 times at 1e-8. Measured (Llama, 250-token sample as one
# chunk): a gradient entry of 2.5e-9 (the tensor's are ~2e-3) off by 3e-10 left o_proj 1.6e-5
# off after one step, over the 1e-5 tolerance, while every gradient matched to 1.5e-7; at 1e-6
# the same runs are within 5e-7. The gradients (what hf_cp computes) are compared before the
# optimizer either way.
CHUNKFLOW_ADAM_EPSILON = 1e-6


def chunkflow_mixed_spec(model: str) -> dict:
    """chunkflow mixing dependent chunks and a CP group in one step, on `model` (harness.models)."""
    return dict(
        lengths=CHUNKFLOW_MIXED_LENGTHS,
        tokens_per_step=CHUNKFLOW_MIXED_TOKENS_PER_STEP,
        max_tokens_per_rank=CAP,
        steps=2,
        balancer="chunkflow",
        balancer_options=dict(CHUNKFLOW_MIXED_OPTIONS),
        model=model,
        adam_epsilon=CHUNKFLOW_ADAM_EPSILON,
        # evaluated (after each step and at the end) by the same plans: the 400- and 260-token
        # samples on a CP group, the 120- and 90-token ones as dependent chunks, forward only
        eval_lengths=EVAL_LENGTHS,
        eval_steps=1,
    )


def world2_runs() -> Dict[str, dict]:
    """name -> run spec (without its output folder)."""
    runs = {f"balancer-{b}": balance_spec(b) for b in BALANCERS if b != "chunkflow"}
    runs.update({name: balance_spec("chunkflow", balancer_options=o) for name, o in CHUNKFLOW_RUNS.items()})
    runs["chunkflow-mixed-qwen2"] = chunkflow_mixed_spec("qwen2")
    runs["chunkflow-beyond-world"] = chunkflow_beyond_world_spec()
    runs["rank-dependent-plans"] = balance_spec("rank_dependent")
    # hierarchical planning with two hosts of one rank: the 400-token sample spreads over a block
    # of both hosts, each host plans its own short samples, the merged plan trains (issue 39)
    runs["hierarchical-hosts"] = balance_spec(
        "hierarchical", balancer_options=dict(host_ranks=1, min_samples_per_rank=0)
    )
    # a Gated DeltaNet hybrid: its recurrent layers run per document, spread ones by state passing (attention/state_passing.py)
    runs.update(
        {f"qwen3_next-{b}": balance_spec(b, model="qwen3_next", **HYBRID_OPTIONS.get(b, {})) for b in HYBRID_BALANCERS}
    )
    # Qwen3.5's text model (the same mechanism, dense MLPs): spread by state passing, and in chunks
    runs.update(
        {
            f"qwen3_5_text-{b}": balance_spec(b, model="qwen3_5_text", **HYBRID_OPTIONS.get(b, {}))
            for b in QWEN3_5_BALANCERS
        }
    )
    # a MoE model with the router's load-balancing term on: one term over each whole step (step/router_balance.py)
    runs.update({f"qwen3_moe-{b}": balance_spec(b, model="qwen3_moe") for b in MOE_BALANCERS})
    # a vision-language model: each image or clip encoded once in its group, rows sent to their holders
    # (AdamW eps as lengths_spec's: parameters compared after AdamW stay well inside 1e-5)
    vlm = dict(model="qwen2_5_vl", adam_epsilon=CHUNKFLOW_ADAM_EPSILON)
    runs.update({f"qwen2_5_vl-{b}": balance_spec(b, **vlm) for b in VLM_BALANCERS})
    # ChunkFlow's dependent chunks with images and clips (train/step/chunk_vision.py)
    runs["qwen2_5_vl-chunkflow"] = balance_spec("chunkflow", balancer_options=dict(VLM_CHUNKFLOW_OPTIONS), **vlm)
    # Qwen3-VL: DeepStack inside the model's forward, each clip frame apart (about 4 s for both runs)
    qwen3_vl = dict(vlm, model="qwen3_vl")
    runs.update({f"qwen3_vl-{b}": balance_spec(b, **qwen3_vl) for b in QWEN3_VL_BALANCERS})
    # its planned evaluation: the 400- and 260-token eval samples (with a clip) over a CP group of 2
    runs["qwen2_5_vl-eval"] = balance_spec("auto", eval_lengths=EVAL_LENGTHS, eval_steps=1, **vlm)
    runs["mutation-router_local_counts"] = balance_spec(
        MUTATED_BALANCER, model="qwen3_moe", mutation="router_local_counts"
    )
    llama_mutations = [m for m in MUTATIONS if not m.startswith("router")]
    runs.update({f"mutation-{m}": balance_spec(MUTATED_BALANCER, mutation=m) for m in llama_mutations})
    # cp_compare_measured: step 1 (short samples only) runs static's plan (every sample over both
    # ranks, its CP size fixed by the 400-token sample) where auto keeps each on one rank
    runs["compare-measured"] = balance_spec("auto", compare_balancer="static", compare_measured=True)
    # test_train_distributed's fast cases
    runs["static"] = lengths_spec("static")
    runs["fixed_ring_zigzag"] = lengths_spec("fixed_ring_zigzag")
    runs["empty-shards-ring_per_doc"] = empty_shard_spec("ring_per_doc")
    for chunk in (0, 16):
        runs[f"loss-chunks-{chunk}"] = lengths_spec("fixed_ring_zigzag", loss_chunk_tokens=chunk)
    runs["eval-auto"] = lengths_spec("auto", eval_lengths=EVAL_LENGTHS, eval_steps=2)
    runs["eval-static"] = lengths_spec("static", eval_lengths=[5], eval_steps=2)
    runs["ckpt-fixed_ring_zigzag"] = lengths_spec("fixed_ring_zigzag", activation_checkpointing=True)
    # test_peft's LoRA runs (train_lora resets the Accelerator state and DeepSpeed's flag itself)
    runs.update(WORLD2_LORA_RUNS)
    # test_train_faults' non-finite gradient runs (last: the first one stops with an error)
    runs["nan-stop"] = nan_spec(expect_error=True)
    runs["nan-warn"] = nan_spec(stop_on_nonfinite_grad=False)
    return {name: dict(spec, ddp_timeout=COLLECTIVE_TIMEOUT) for name, spec in runs.items()}


def train_world2_runs(folder: Path) -> Dict[str, dict]:
    """Train every run of world2_runs() in one job under `folder`; {name: spec with out}."""
    runs = {name: dict(spec, out=str(folder / name)) for name, spec in world2_runs().items()}
    t0 = time.perf_counter()
    proc = run_distributed({"runs": list(runs.values())}, 2, timeout=WORLD2_JOB_TIMEOUT)
    print(f"world-2 job: {len(runs)} runs in {time.perf_counter() - t0:.1f} s")
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("harness.job:")))
    return runs


def shared_or_own_run(request, name: str, spec: dict, timeout: float) -> dict:
    """The run `name` of the session's world-2 job when world2_runs() lists it, else `spec`
    trained now by a job of its own (the slow variants of a parametrized test)."""
    shared = world2_runs().get(name)
    if shared is None:
        run_distributed(spec, 2, timeout=timeout)
        return spec
    mine = {k: v for k, v in spec.items() if k not in ("out", "ddp_timeout")}
    theirs = {k: v for k, v in shared.items() if k not in ("out", "ddp_timeout")}
    if mine != theirs:
        raise AssertionError(f"the test's run {name!r} is {mine}, but world2_runs() trains {theirs}")
    return request.getfixturevalue("world2_job")[name]


# ------------------------------------------------------------------ runs of their own, results
def spec_for(tmp_path: Path, balancer: str, steps: int = 3, **kw) -> dict:
    """A run on LENGTHS with its output folder under tmp_path (named by balancer and `tag`)."""
    out = str(tmp_path / f"{balancer}-{kw.pop('tag', 'run')}")
    return dict(lengths_spec(balancer, steps, **kw), out=out)


def assert_matches_reference(spec: dict) -> dict:
    """Every step of the run in spec['out'] against the single-process reference (harness.check:
    losses, gradients before the optimizer, parameters after it); the worst relative errors."""
    return check_run(spec).worst


def executed_plans(spec: dict, world: int = 2):
    """The plans of the run's steps, re-planned here and matched to the digests the run
    recorded (so the placement checks below are about what actually ran); `world`: the run's
    number of processes."""
    plans = replanned(spec, world)
    recorded = [r["plan_digest"] for r in json.loads((Path(spec["out"]) / "history.json").read_text())]
    assert [p.digest() for p in plans] == recorded, "the test's plans are not the ones the run executed"
    return plans


def replanned(spec: dict, world: int = 2):
    """The plans of the run's steps by spec['balancer'], planned here as the run's trainer plans
    them on `world` ranks."""
    config = tiny_config(spec.get("model") or "llama").to_dict()
    rows = train_rows(spec)
    present = [c for c in GRID_COLUMNS if any(r.get(c) is not None for r in rows)]
    # a vision-language run's planner prices its images' and clips' encoder work, as the trainer's does
    grids = grid_columns_vision({c: [r.get(c) for r in rows] for c in present}, "train") if present else {}
    sampler = GlobalBatchSampler(
        spec["lengths"], spec["tokens_per_step"], seed=42, max_steps=spec["steps"], shuffle=False
    )
    planner = Planner(
        sampler,
        balancer_for(spec["balancer"]) or get_balancer(spec["balancer"], **spec.get("balancer_options", {})),
        ClusterSpec(world, spec["max_tokens_per_rank"]),
        # the trainer's cost model: the model's own dimensions and the run's profile
        CostModel(
            ModelDims.from_hf_config(config),
            HardwareProfile.load(spec.get("profile", "h200-qwen2.5-7b")),
            # the engine's step rule: auto prices its members by the wall clock under it
            execution_named(json.loads((Path(spec["out"]) / "engine.json").read_text()).get("engine") or "ddp"),
            vision=VisionDims.from_hf_config(config, source="model config") if grids else None,
        ),
        seed=42,
        lookahead=0,
        vision=grids or None,
    )
    return [planner.get(k).plan for k in range(spec["steps"])]
