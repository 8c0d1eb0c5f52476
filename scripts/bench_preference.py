#!/usr/bin/env python
"""Preference and RL samples (issue 26): hf_cp's shared-prompt layout against TRL's layout, in
tokens computed and predicted step time, on the committed shared-prompt length traces.

hf_cp trains a prompt with n answers as ONE sample [prompt][answer 1]...[answer n] with the
mask SampleMask.shared_prompt(P, answers): the prompt is computed once, every answer attends to
the prompt and to itself. The step's groups are planned by the `auto` balancer over the world.
TRL's trainers repeat the prompt per answer: a DPO batch row is prompt+chosen or
prompt+rejected, right-padded to the longest row of the per-device batch (DPOTrainer's
collator); GRPO computes every (prompt, completion) as its own sequence and its RepeatSampler
puts all G completions of one prompt on one process. Both layouts train the same groups each
step (equal groups per rank, as TRL's sampler deals them) and both are priced by the same cost
model (hf_cp.cost.simulate.simulate, H200 profile, Qwen2.5-7B dimensions): TRL's assignment as a
plan of one-rank groups, every rank's sequences local, no CP.

Sections:
1. tokens computed and predicted step time, hf_cp vs TRL: DPO pairs (from the n8 trace) and
   GRPO groups of 8 and 16 (and their long-completion variants), worlds 8 and 64;
2. GRPO per-rank max/mean of predicted busy time: groups planned by hf_cp vs all of a group's
   siblings on one rank, with normal and long completions;
3. (--measure) measured CPU step time of a tiny Llama under CPTrainer, world 1: shared-prompt
   groups vs the same prompts repeated per answer, beside the predicted ratio.

Examples:
    python scripts/bench_preference.py --measure --write      # everything, rewrites benchmarks/preference.md
    python scripts/bench_preference.py --worlds 8 --steps 1   # a quick look, prints only
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACES = REPO / "benchmarks" / "traces"  # committed with the repository
DEFAULT_OUT = REPO / "benchmarks" / "preference.md"

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
warnings.filterwarnings("ignore", category=DeprecationWarning)

# (prompt tokens, answer tokens): one GRPO group or one DPO pair (answers = (chosen, rejected))
Group = Tuple[int, Tuple[int, ...]]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--traces-dir", default=str(DEFAULT_TRACES), help="folder of the shared-prompt *.jsonl traces")
    p.add_argument("--worlds", default="8,64", help="comma-separated world sizes")
    p.add_argument("--steps", type=int, default=5, help="full steps per workload and world")
    p.add_argument("--max-tokens-per-rank", type=int, default=32768)
    p.add_argument("--tokens-per-rank-per-step", type=int, default=65536)
    p.add_argument("--profile", default="h200-qwen2.5-7b")
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--balancer", default="auto", help="hf_cp's planner for the shared-prompt groups")
    p.add_argument("--seed", type=int, default=0, help="epoch shuffle seed")
    p.add_argument(
        "--dpo-batch", type=int, default=8, help="TRL's per_device_train_batch_size for DPO (pairs per padded batch)"
    )
    p.add_argument(
        "--grpo-batch",
        type=int,
        default=8,
        help="completions per per-device batch, for the padded-GRPO token count only",
    )
    p.add_argument("--long-scale", type=int, default=8, help="long-completion variant: answers x this")
    p.add_argument("--max-completion", type=int, default=16384, help="long-completion variant: answer cap (tokens)")
    p.add_argument("--measure", action="store_true", help="also measure CPU step time of a tiny model (~1-2 min)")
    p.add_argument("--measure-steps", type=int, default=8, help="optimizer steps per measured run (first dropped)")
    p.add_argument("--measure-rounds", type=int, default=3, help="interleaved runs of each layout per measured case")
    p.add_argument("--write", action="store_true", help=f"rewrite {DEFAULT_OUT.relative_to(REPO)}")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="markdown written with --write")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- workloads
def read_groups(path: Path) -> List[Group]:
    """A shared-prompt trace: one {"prompt": P, "answers": [...]} per line."""
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out.append((int(r["prompt"]), tuple(int(a) for a in r["answers"])))
    return out


def dpo_pairs(groups: Sequence[Group]) -> List[Group]:
    """chosen = answers[0], rejected = answers[1] of each group (a stand-in: no real preference trace)."""
    return [(p, (a[0], a[1])) for p, a in groups]


def long_completions(groups: Sequence[Group], scale: int, max_completion: int) -> List[Group]:
    """Every answer x `scale`, capped at `max_completion` tokens (prompts unchanged)."""
    return [(p, tuple(min(a * scale, max_completion) for a in ans)) for p, ans in groups]


def packed_tokens(g: Group) -> int:
    """hf_cp's layout: the prompt once, then every answer."""
    return g[0] + sum(g[1])


def repeated_tokens(g: Group) -> int:
    """The prompt repeated per answer, no padding."""
    return len(g[1]) * g[0] + sum(g[1])


def groups_per_rank(groups: Sequence[Group], tokens_per_rank: int) -> int:
    """Groups each rank gets per step so that a step holds about `tokens_per_rank` x world
    tokens in hf_cp's layout (at least one)."""
    mean = statistics.mean(packed_tokens(g) for g in groups)
    return max(1, round(tokens_per_rank / mean))


def step_streams(n: int, per_step: int, steps: int, seed: int) -> List[List[int]]:
    """Steps 0..steps-1 of the stream of shuffled epochs cut into `per_step` groups each;
    id = epoch x n + index (a group of a later epoch is another sample)."""
    from hf_cp.samples.lengths import epoch_order

    need = per_step * steps
    epochs = -(-need // n)
    ids = np.concatenate([epoch_order(n, seed, e) + e * n for e in range(epochs)])[:need]
    return [ids[s * per_step : (s + 1) * per_step].tolist() for s in range(steps)]


# ----------------------------------------------------------------------------- TRL's layout
def deal(step_groups: Sequence, world: int) -> List[list]:
    """Equal groups per rank, consecutive chunks (TRL's sampler: a process gets whole GRPO groups)."""
    if len(step_groups) % world:
        raise ValueError(f"{len(step_groups)} groups do not deal evenly over {world} ranks")
    k = len(step_groups) // world
    return [list(step_groups[r * k : (r + 1) * k]) for r in range(world)]


def grpo_micro_batches(rank_groups: Sequence[Group], cap: int) -> List[List[int]]:
    """One rank's GRPO rows (prompt + completion, each its own causal sequence), in order,
    packed into micro-batches of at most `cap` tokens without padding (padding-free: the most
    favourable layout for TRL)."""
    out: List[List[int]] = []
    cur: List[int] = []
    for p, ans in rank_groups:
        for a in ans:
            n = p + a
            if n > cap:
                raise ValueError(f"a prompt+completion of {n} tokens does not fit one rank's cap of {cap}")
            if cur and sum(cur) + n > cap:
                out.append(cur)
                cur = []
            cur.append(n)
    if cur:
        out.append(cur)
    return out


def dpo_micro_batches(rank_pairs: Sequence[Group], cap: int, batch: int) -> List[List[int]]:
    """One rank's DPO batches: up to `batch` pairs each, rows prompt+chosen and prompt+rejected
    right-padded to the batch's longest row (DPOTrainer's collator); a batch closes early when
    its padded rows would pass `cap`. Returns the padded row lengths per micro-batch."""
    out: List[List[int]] = []
    cur: List[Group] = []

    def width(pairs) -> int:
        return max(p + a for p, ans in pairs for a in ans)

    for pair in rank_pairs:
        if 2 * width([pair]) > cap:
            raise ValueError(f"a DPO pair {pair} padded to its longest row does not fit one rank's cap of {cap}")
        if cur and (len(cur) >= batch or 2 * (len(cur) + 1) * width(cur + [pair]) > cap):
            out.append([width(cur)] * (2 * len(cur)))
            cur = []
        cur.append(pair)
    if cur:
        out.append([width(cur)] * (2 * len(cur)))
    return out


def grpo_padded_tokens(rank_groups: Sequence[Group], batch: int) -> int:
    """Tokens GRPOTrainer computes when it pads (prompts left-padded to the batch's longest,
    completions right-padded to its longest) in per-device batches of `batch` completions."""
    rows = [(p, a) for p, ans in rank_groups for a in ans]
    total = 0
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch]
        total += len(chunk) * (max(p for p, _ in chunk) + max(a for _, a in chunk))
    return total


def trl_layout(step_groups: Sequence[Group], world: int, kind: str, cap: int, dpo_batch: int) -> List[List[List[int]]]:
    """Per rank, its micro-batches, each a list of row lengths (padded rows for DPO)."""
    ranks = deal(step_groups, world)
    if kind == "dpo":
        return [dpo_micro_batches(r, cap, dpo_batch) for r in ranks]
    return [grpo_micro_batches(r, cap) for r in ranks]


def layout_plan(layout: List[List[List[int]]], cap: int, step: int = 0):
    """TRL's assignment as a StepPlan: wave i holds every rank's i-th micro-batch, each row a
    local causal document on its rank (a padded row counts as a document of the padded width)."""
    from hf_cp.plan.step_plan import Group as PlanGroup
    from hf_cp.plan.step_plan import StepPlan, Wave

    ids: List[int] = []
    lens: List[int] = []
    waves: List[Wave] = []
    for w in range(max(len(mbs) for mbs in layout)):
        groups = []
        for r, mbs in enumerate(layout):
            if w < len(mbs):
                rows = list(range(len(ids), len(ids) + len(mbs[w])))
                ids += rows
                lens += mbs[w]
                groups.append(PlanGroup((r,), local={r: rows}))
        waves.append(Wave(groups))
    return StepPlan(len(layout), cap, ids, lens, waves=waves, step=step, balancer="trl_layout")


# ----------------------------------------------------------------------------- one comparison
def cpu_s() -> float:
    """CPU seconds of this process and of its waited-for children (a solver's worker process)."""
    t = os.times()
    return time.process_time() + t.children_user + t.children_system


@dataclass
class StepResult:
    hf_tokens: int
    trl_tokens: int
    trl_unpadded_tokens: int  # the prompt repeated per answer, no padding
    trl_padded_tokens: int  # GRPO as TRL pads it (tokens only); DPO: = trl_tokens
    hf_ms: float
    trl_ms: float
    lower_bound_ms: float
    charged_bound_ms: float
    hf_imbalance: float
    trl_imbalance: float
    winner: str
    planner_ms: float


def compare_step(
    step_groups: Sequence[Group],
    ids: Sequence[int],
    kind: str,
    cluster,
    cost,
    balancer,
    step: int = 0,
    dpo_batch: int = 8,
    grpo_batch: int = 8,
    dataset_max_length: Optional[int] = None,
) -> StepResult:
    """One step's groups in both layouts, priced by `cost`: hf_cp's (one shared-prompt sample per
    group, planned by `balancer` over the cluster) and TRL's (rows dealt evenly, each rank's rows local)."""
    from hf_cp.balance import PlanRequest
    from hf_cp.balance.toolkit.sample_limit import check_request_lengths
    from hf_cp.cost.simulate import simulate
    from hf_cp.planning.predict import predict
    from hf_cp.samples.masks import SampleMask

    masks = {int(i): SampleMask.shared_prompt(p, ans) for i, (p, ans) in zip(ids, step_groups)}
    lens = [masks[int(i)].length for i in ids]
    req = PlanRequest(
        list(ids), lens, cluster, cost, step=step, masks=masks, dataset_max_length=dataset_max_length or max(lens)
    )
    # planning.predict.plan_and_predict, with the balancer timed in CPU time (solver workers
    # included) as bench_balancers does: on a shared machine wall time counts the waits for a CPU
    check_request_lengths(balancer, req)
    c0 = cpu_s()
    hf_plan = balancer.plan(req)
    planner_ms = (cpu_s() - c0) * 1e3
    hf = predict(hf_plan, req)  # validated, simulated, with the bounds
    W, cap = cluster.world_size, cluster.max_tokens_per_rank
    layout = trl_layout(step_groups, W, kind, cap, dpo_batch)
    plan = layout_plan(layout, cap, step).validate(cluster, cost)
    trl = simulate(plan, cost)
    trl_tokens = sum(plan.lengths)
    padded = trl_tokens if kind == "dpo" else sum(grpo_padded_tokens(r, grpo_batch) for r in deal(step_groups, W))
    return StepResult(
        hf_tokens=sum(lens),
        trl_tokens=trl_tokens,
        trl_unpadded_tokens=sum(repeated_tokens(g) for g in step_groups),
        trl_padded_tokens=padded,
        hf_ms=hf.makespan_ms,
        trl_ms=trl.makespan_ms,
        lower_bound_ms=hf.lower_bound_ms,
        charged_bound_ms=hf.charged_bound_ms,
        hf_imbalance=hf.imbalance,
        trl_imbalance=trl.imbalance,
        winner=hf_plan.balancer.split(":", 1)[-1],
        planner_ms=planner_ms,
    )


@dataclass
class Workload:
    name: str
    kind: str  # "dpo" or "grpo"
    groups: List[Group]


def workloads(tdir: Path, scale: int, max_completion: int) -> List[Workload]:
    n8 = read_groups(tdir / "shared_prompt_alpaca_eval_n8.jsonl")
    n16 = read_groups(tdir / "shared_prompt_alpaca_eval_n16.jsonl")
    return [
        Workload("DPO pairs (n8: answers 0, 1)", "dpo", dpo_pairs(n8)),
        Workload("GRPO G=8", "grpo", n8),
        Workload("GRPO G=16", "grpo", n16),
        Workload(f"GRPO G=8, long (x{scale})", "grpo", long_completions(n8, scale, max_completion)),
        Workload(f"GRPO G=16, long (x{scale})", "grpo", long_completions(n16, scale, max_completion)),
    ]


def run_workload(wl: Workload, world: int, args, cost, balancer) -> dict:
    from hf_cp.plan.cluster import ClusterSpec

    cluster = ClusterSpec(world, args.max_tokens_per_rank, cost.profile.gpus_per_node)
    groups = [g for g in wl.groups if packed_tokens(g) <= cluster.largest_capacity]
    dropped = len(wl.groups) - len(groups)
    k = groups_per_rank(groups, args.tokens_per_rank_per_step)
    longest = max(packed_tokens(g) for g in groups)
    results = []
    for step, ids in enumerate(step_streams(len(groups), k * world, args.steps, args.seed)):
        sg = [groups[i % len(groups)] for i in ids]
        r = compare_step(sg, ids, wl.kind, cluster, cost, balancer, step, args.dpo_batch, args.grpo_batch, longest)
        results.append(r)
    hf_t = sum(r.hf_tokens for r in results)
    trl_t = sum(r.trl_tokens for r in results)
    hf_ms = sum(r.hf_ms for r in results)
    trl_ms = sum(r.trl_ms for r in results)
    lb = sum(r.lower_bound_ms for r in results)
    row = dict(
        workload=wl.name,
        kind=wl.kind,
        world=world,
        steps=len(results),
        groups_per_step=k * world,
        dropped=dropped,
        hf_tokens=hf_t / len(results),
        trl_tokens=trl_t / len(results),
        trl_unpadded_tokens=sum(r.trl_unpadded_tokens for r in results) / len(results),
        trl_padded_tokens=sum(r.trl_padded_tokens for r in results) / len(results),
        saved=1 - hf_t / trl_t,
        hf_ms=hf_ms / len(results),
        trl_ms=trl_ms / len(results),
        speedup=trl_ms / hf_ms,
        hf_lb=hf_ms / lb,
        hf_charged=hf_ms / sum(r.charged_bound_ms for r in results),
        trl_lb=trl_ms / lb,
        hf_imb=statistics.mean(r.hf_imbalance for r in results),
        trl_imb=statistics.mean(r.trl_imbalance for r in results),
        winners=",".join(sorted({r.winner for r in results})),
        planner_ms=statistics.median(r.planner_ms for r in results),
    )
    print(
        f"W={world:<3} {wl.name:30s} groups/step {row['groups_per_step']:5d} tokens hf {hf_t / len(results):>11,.0f} "
        f"trl {trl_t / len(results):>11,.0f} saved {100 * row['saved']:5.1f}% | pred ms hf {row['hf_ms']:8.1f} "
        f"trl {row['trl_ms']:8.1f} trl/hf {row['speedup']:.3f} | hf/LB {row['hf_lb']:.3f} "
        f"(charged {row['hf_charged']:.3f}) trl/LB {row['trl_lb']:.3f} | max/mean hf {row['hf_imb']:.3f} "
        f"trl {row['trl_imb']:.3f} ({row['winners']}, plan CPU {row['planner_ms']:.0f} ms)",
        flush=True,
    )
    return row


# ----------------------------------------------------------------------------- measured on CPU
@dataclass
class MeasureCase:
    name: str
    groups: List[Group]  # one optimizer step trains all of them


def measure_cases(tdir: Path) -> List[MeasureCase]:
    """Scaled-down lengths (hundreds of tokens): the first 4 groups of the n8 trace with every
    length / 4; the same with each group's answers set to their mean length (a control: equal
    block shapes); and a constructed long-prompt case where sharing the prompt matters."""
    n8 = read_groups(tdir / "shared_prompt_alpaca_eval_n8.jsonl")[:4]
    scaled = [(max(1, p // 4), tuple(max(1, a // 4) for a in ans)) for p, ans in n8]
    equal = [(p, (round(sum(ans) / len(ans)),) * len(ans)) for p, ans in scaled]
    return [
        MeasureCase("AlpacaEval n8, first 4 groups, lengths / 4", scaled),
        MeasureCase("the same, each group's answers at their mean length", equal),
        MeasureCase("long prompt: 4 x (384-token prompt + 8 x 48-token answers)", [(384, (48,) * 8)] * 4),
    ]


def measured_rows(groups: Sequence[Group], shared: bool, seed: int = 0) -> List[dict]:
    """Dataset rows of the groups: one shared-prompt sample per group, or the prompt repeated per
    answer as causal samples; random token ids, prompt tokens untrained (labels -100)."""
    from hf_cp.samples.mask_column import MASK_COLUMN, encode_mask
    from hf_cp.samples.masks import SampleMask

    rng = np.random.default_rng(seed)
    rows = []
    for p, ans in groups:
        prompt = rng.integers(3, 256, p).tolist()  # no special ids (BOS 1, EOS 2)
        answers = [rng.integers(3, 256, a).tolist() for a in ans]
        if shared:
            ids = prompt + [x for a in answers for x in a]
            labels = [-100] * p + [x for a in answers for x in a]
            rows.append(
                {"input_ids": ids, "labels": labels, MASK_COLUMN: encode_mask(SampleMask.shared_prompt(p, ans))}
            )
        else:
            for a in answers:
                rows.append({"input_ids": prompt + a, "labels": [-100] * p + a, MASK_COLUMN: None})
    return rows


def tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_cp.attention.interface  # noqa: F401  registers attn_implementation="hf_cp"

    cfg = LlamaConfig(**json.loads((REPO / "hf_cp" / "configs" / "models" / "tiny-llama.json").read_text()))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.set_attn_implementation("hf_cp")
    model.config.use_cache = False
    return model


def measure_run(rows: List[dict], steps: int, cap: int, out_dir: str) -> dict:
    """Train `steps` optimizer steps, each the whole of `rows` (one global batch), world 1 on CPU
    with the cpu profile; per step after the first (which warms up): wall ms (StepRecord.step_wall_ms),
    process CPU ms, predicted ms (StepRecord.predicted_step_ms)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    from hf_cp.train import CPTrainer, CPTrainingArguments

    tokens = sum(len(r["input_ids"]) for r in rows)
    args = CPTrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        seed=42,
        cp_balancer="static",  # world 1: one rank, nothing to balance
        cp_profile="cpu",
        cp_max_tokens_per_rank=cap,
        cp_tokens_per_step=tokens,
        cp_shuffle=False,
        cp_compare_balancer=None,
        cp_calibrate=False,  # predictions from the profile as given
        cp_plan_in_subprocess=False,
        max_steps=steps,
        learning_rate=1e-4,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1000,
        dataloader_num_workers=0,
    )
    cpu_ms: List[float] = []

    class StepCpu(TrainerCallback):
        """Process CPU time of each optimizer step: on a loaded machine it leaves out the waits
        for a CPU that wall time includes (one torch thread: it is the step's compute)."""

        def on_step_begin(self, *a, **kw):
            self.t0 = time.process_time()

        def on_step_end(self, *a, **kw):
            cpu_ms.append((time.process_time() - self.t0) * 1e3)

    trainer = CPTrainer(model=tiny_llama(), args=args, train_dataset=Dataset.from_list(rows), callbacks=[StepCpu()])
    trainer.remove_callback(PrinterCallback)  # the end-of-training summary line
    trainer.train()
    recs = trainer.cp_history[1:]
    return dict(
        tokens=tokens,
        wall=[r.step_wall_ms for r in recs],
        cpu=cpu_ms[1:],
        pred=[r.predicted_step_ms for r in recs],
    )


def measure(tdir: Path, steps: int, rounds: int) -> List[dict]:
    """Per case, `rounds` runs of each layout, interleaved (shared first in even rounds,
    repeated first in odd ones) so that a change of the machine's load hits both; medians (and
    the CPU time's minimum) over every measured step of a layout."""
    import torch

    torch.set_num_threads(1)  # the cpu profile was fitted on one thread; a shared machine
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for c, case in enumerate(measure_cases(tdir)):
            cap = max(4096, max(packed_tokens(g) for g in case.groups))
            rows = {shared: measured_rows(case.groups, shared) for shared in (True, False)}
            got: Dict[bool, Dict[str, list]] = {True: {}, False: {}}
            for rnd in range(rounds):
                for shared in (True, False) if rnd % 2 == 0 else (False, True):
                    r = measure_run(rows[shared], steps, cap, os.path.join(tmp, f"{c}_{rnd}_{int(shared)}"))
                    for k, v in r.items():
                        got[shared].setdefault(k, []).extend(v if isinstance(v, list) else [v])
            res = {
                shared: dict(
                    tokens=g["tokens"][0],
                    wall_ms=statistics.median(g["wall"]),
                    cpu_ms=statistics.median(g["cpu"]),
                    cpu_min_ms=min(g["cpu"]),
                    pred_ms=statistics.median(g["pred"]),
                    steps=len(g["cpu"]),
                )
                for shared, g in got.items()
            }
            row = dict(
                case=case.name,
                cap=cap,
                shared=res[True],
                repeated=res[False],
                wall_ratio=res[True]["wall_ms"] / res[False]["wall_ms"],
                cpu_ratio=res[True]["cpu_ms"] / res[False]["cpu_ms"],
                cpu_min_ratio=res[True]["cpu_min_ms"] / res[False]["cpu_min_ms"],
                pred_ratio=res[True]["pred_ms"] / res[False]["pred_ms"],
            )
            print(
                f"measured: {case.name}: tokens {res[True]['tokens']} vs {res[False]['tokens']}; median step wall "
                f"{res[True]['wall_ms']:.1f} vs {res[False]['wall_ms']:.1f} ms (ratio {row['wall_ratio']:.3f}), CPU "
                f"{res[True]['cpu_ms']:.1f} vs {res[False]['cpu_ms']:.1f} ms (ratio {row['cpu_ratio']:.3f}, of the "
                f"minima {row['cpu_min_ratio']:.3f}); predicted {res[True]['pred_ms']:.1f} vs "
                f"{res[False]['pred_ms']:.1f} ms (ratio {row['pred_ratio']:.3f})",
                flush=True,
            )
            out.append(row)
    return out


# ----------------------------------------------------------------------------- report
def table_tokens_time(rows) -> List[str]:
    out = [
        "| workload | world | groups/step | hf_cp tokens/step | TRL tokens/step | saved | hf_cp pred ms | TRL pred ms "
        "| TRL / hf_cp | hf_cp / LB (/ charged) | TRL / LB | hf_cp planner CPU (won) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['workload']} | {r['world']} | {r['groups_per_step']:,} | {r['hf_tokens']:,.0f} | "
            f"{r['trl_tokens']:,.0f} | {100 * r['saved']:.1f}% | {r['hf_ms']:,.1f} | {r['trl_ms']:,.1f} | "
            f"{r['speedup']:.3f}x | {r['hf_lb']:.3f} ({r['hf_charged']:.3f}) | {r['trl_lb']:.3f} | "
            f"{r['planner_ms']:.0f} ms ({r['winners']}) |"
        )
    return out


def table_breakdown(rows) -> List[str]:
    out = [
        "| workload | world | hf_cp tokens/step | + prompt repeats | + padding (as priced above) | TRL tokens/step "
        "| GRPO as TRL pads it: tokens/step (hf_cp saves) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        hf, rep, trl = r["hf_tokens"], r["trl_unpadded_tokens"], r["trl_tokens"]
        padded = (
            f"{r['trl_padded_tokens']:,.0f} ({100 * (1 - hf / r['trl_padded_tokens']):.1f}%)"
            if r["kind"] == "grpo"
            else "-"
        )
        out.append(
            f"| {r['workload']} | {r['world']} | {hf:,.0f} | {rep - hf:,.0f} (+{100 * (rep - hf) / hf:.1f}%) | "
            f"{trl - rep:,.0f} (+{100 * (trl - rep) / hf:.1f}%) | {trl:,.0f} | {padded} |"
        )
    return out


def table_balance(rows) -> List[str]:
    out = [
        "| workload | world | groups/step | tokens/group (mean) | planned max/mean | siblings-on-one-rank max/mean "
        "| planned / LB (/ charged) | siblings / LB | step time siblings / planned |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["kind"] != "grpo":
            continue
        out.append(
            f"| {r['workload']} | {r['world']} | {r['groups_per_step']:,} | "
            f"{r['hf_tokens'] / r['groups_per_step']:,.0f} | "
            f"{r['hf_imb']:.3f} | {r['trl_imb']:.3f} | {r['hf_lb']:.3f} ({r['hf_charged']:.3f}) | {r['trl_lb']:.3f} | "
            f"{r['speedup']:.3f}x |"
        )
    return out


def table_measured(rows) -> List[str]:
    out = [
        "| case | tokens/step shared / repeated | step wall ms shared / repeated | step CPU ms shared / repeated "
        "| predicted ms shared / repeated | measured wall ratio | measured CPU ratio (of the minima) "
        "| predicted ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s, p = r["shared"], r["repeated"]
        out.append(
            f"| {r['case']} | {s['tokens']:,} / {p['tokens']:,} | {s['wall_ms']:.1f} / {p['wall_ms']:.1f} | "
            f"{s['cpu_ms']:.1f} / {p['cpu_ms']:.1f} | {s['pred_ms']:.1f} / {p['pred_ms']:.1f} | "
            f"{r['wall_ratio']:.3f} | {r['cpu_ratio']:.3f} ({r['cpu_min_ratio']:.3f}) | {r['pred_ratio']:.3f} |"
        )
    return out


def headline(rows, measured) -> List[str]:
    out = []
    for kind, label in (("dpo", "DPO pairs"), ("grpo", "GRPO")):
        sel = [r for r in rows if r["kind"] == kind and "long" not in r["workload"]]
        if sel:
            out.append(
                f"- {label} (AlpacaEval lengths): tokens saved {min(100 * r['saved'] for r in sel):.1f}-"
                f"{max(100 * r['saved'] for r in sel):.1f}%, predicted step TRL / hf_cp "
                f"{min(r['speedup'] for r in sel):.3f}-{max(r['speedup'] for r in sel):.3f}x; hf_cp's plan "
                f"{min(r['hf_lb'] for r in sel):.3f}-{max(r['hf_lb'] for r in sel):.3f}x the lower bound"
            )
    long = [r for r in rows if "long" in r["workload"]]
    if long:
        out.append(
            "- GRPO with long completions: per-rank max/mean planned "
            f"{min(r['hf_imb'] for r in long):.3f}-{max(r['hf_imb'] for r in long):.3f} vs siblings on one rank "
            f"{min(r['trl_imb'] for r in long):.3f}-{max(r['trl_imb'] for r in long):.3f}; predicted step "
            f"siblings / planned {min(r['speedup'] for r in long):.2f}-{max(r['speedup'] for r in long):.2f}x; "
            f"hf_cp's plan {min(r['hf_lb'] for r in long):.3f}-{max(r['hf_lb'] for r in long):.3f}x the lower bound "
            f"(planner CPU up to {max(r['planner_ms'] for r in long) / 1e3:.1f} s a step)"
        )
    for m in measured:
        out.append(
            f"- measured on CPU ({m['case']}): shared / repeated step wall {m['wall_ratio']:.3f} "
            f"(CPU time {m['cpu_ratio']:.3f}), predicted {m['pred_ratio']:.3f}"
        )
    return out


def write_markdown(path: Path, command: str, scenario: str, rows, measured, args, runtime_s: float) -> None:
    scale, maxc = args.long_scale, args.max_completion
    dropped = [r for r in rows if r["dropped"]]
    lines = [
        "# Preference and RL samples: shared-prompt groups vs TRL's layout",
        "",
        "Made by (one run; every ratio below compares numbers of the same run):",
        "",
        f"    {command}",
        "",
        f"Scenario: {scenario}. Runtime {runtime_s:.0f} s (CPU {getattr(args, 'cpu_s', 0):.0f} s) on "
        f"{os.cpu_count()} CPUs.",
        "",
        "## Headline",
        "",
        *headline(rows, measured),
        "",
        "## 1. Tokens computed and predicted step time (predicted, H200 cost model)",
        "",
        "*hf_cp tokens* = prompt once + every answer; *TRL tokens* = prompt repeated per answer, and for DPO every "
        "row right-padded to the longest row of its per-device batch (padding counted: TRL computes it). *pred ms* = "
        "simulated step time (hf_cp.cost.simulate.simulate, the planner's cost model), averaged over the steps; "
        "*TRL / hf_cp* = its ratio (higher: hf_cp faster); *LB* = hf_cp.cost.bounds.lower_bound_ms of the "
        "step's shared-prompt samples (the same bound for both columns); */ charged*: hf_cp's time over "
        "charged_lower_bound_ms, which also charges every micro-batch its overhead. *hf_cp planner CPU* = "
        "median CPU time of the balancer's plan() per step (its solver worker processes included; validation and "
        "simulation not), and the `auto` members that won.",
        "",
        *table_tokens_time(rows),
        "",
        "Where the saving comes from: the prompt's repeats, and padding. The TRL column above counts DPO rows "
        "padded (TRL 1.16's DPOTrainer turns `padding_free` off and always pads) and GRPO rows padding-free, the "
        "most favourable reading of TRL; the last column counts GRPO as GRPOTrainer pads it (prompts left-padded, "
        f"completions right-padded to the longest of a per-device batch of {args.grpo_batch} completions), tokens "
        "only, not priced.",
        "",
        *table_breakdown(rows),
        "",
        "## 2. GRPO: per-rank balance, groups planned by hf_cp vs all siblings on one rank (predicted)",
        "",
        "*max/mean* = the slowest rank's predicted busy time (compute + communication) over the mean, per step, "
        "averaged over the steps. Siblings on one rank = TRL's layout (RepeatSampler: each process holds whole "
        "groups, every completion a causal sequence). Max/mean alone is not a quality signal: read it with the "
        "ratio to the bound.",
        "",
        *table_balance(rows),
        "",
    ]
    if measured:
        lines += [
            "## 3. Measured CPU step time beside the prediction",
            "",
            "A tiny Llama (hf_cp/configs/models/tiny-llama.json: 2 layers, hidden 64, random token ids) trained by "
            "CPTrainer, world 1, use_cpu, one torch thread, profile `cpu` (cp_calibrate off, so the prediction is the "
            f"profile's), balancer static, {args.measure_steps} optimizer steps per run, each step the same global "
            f"batch; {args.measure_rounds} runs of each layout per case, interleaved in one process; medians over "
            "every step after each run's first. *shared* = one sample per group with the attn_mask column "
            "(SampleMask.shared_prompt, prompt labels -100); *repeated* = the prompt repeated per answer as causal "
            "samples. *wall* = StepRecord.step_wall_ms; *CPU* = the process's CPU time per optimizer step (a "
            "TrainerCallback; on a loaded machine it leaves out waits for a CPU); *predicted* = "
            "StepRecord.predicted_step_ms. Ratios are shared / repeated (lower: sharing saves more). "
            f"The machine was shared with other work: {getattr(args, 'load', '')}.",
            "",
            *table_measured(measured),
            "",
            "Reading it: with the long prompt the tokens saved dominate and the measured ratio follows the "
            "prediction. With AlpacaEval's 2-8-token (scaled) prompts there is almost nothing to save, and the shared "
            "layout measured slower than the repeated one while the model predicts 0.98. On this tiny model "
            "(hidden 64) attention is most of the step, and hf_cp's CPU execution of a shared-prompt mask runs every "
            "answer as two blocks (a full block over the prompt and a causal one over itself, merged by "
            "log-sum-exp): two kernel passes per layer instead of one, each one aten flash-attention call per run of "
            "equal-shaped blocks (hf_cp/attention/kernels.py, CpuFlashKernel). The cpu profile prices tokens, "
            "attended pairs and query-chunk efficiency, not kernel calls. A cProfile of the first case, made "
            "outside this run (9 steps of each layout), put attention forward + backward at about 370 vs 265 ms per "
            "step, with 74 vs 38 kernel passes. Equal answer lengths (the second case: fewer distinct block shapes, so "
            "fewer calls) narrowed the gap in some runs and not in others; on this shared machine the measurement "
            "varies from run to run by more than the predicted difference. The GPU "
            "kernels (varlen) take every block of one kind in one call; that path is not measured here. Absolute "
            "predictions are below the measured times (the profile times layers, not the trainer's loss, optimizer "
            "and Python), so compare ratios.",
            "",
        ]
    lines += [
        "## Notes",
        "",
        "- Everything in sections 1 and 2 is predicted by hf_cp's cost model (the H200 profile fitted on "
        "Qwen2.5-7B layers, see docs/design.md), not measured on a GPU. Both layouts are priced by the same model: "
        "TRL's assignment as a plan of one-rank groups (every rank's rows local, no CP). Section 3 is measured.",
        "- Traces: benchmarks/traces/shared_prompt_alpaca_eval_n8.jsonl and _n16.jsonl (AlpacaEval instructions "
        "with the outputs of 8 / 16 fine-tuned models, SmolLM2 tokenizer; sources in benchmarks/traces/README.md).",
        "- DPO pairs are built from the n8 trace: chosen = answers[0], rejected = answers[1] of each record. They "
        "are not a real preference data set: no preference-data length trace was available (none under "
        "/work/shared/data/). AlpacaEval prompts are short (median 22 tokens next to ~430-token answers), so "
        "sharing the prompt saves little; the saving grows with the prompt's share (long-context RL, multi-turn "
        "preference data, the constructed long-prompt case of section 3).",
        f"- DPO batches: up to {args.dpo_batch} pairs per per-device batch (TRL's default "
        "per_device_train_batch_size), closed early when its 2 x pairs padded rows would pass the cap. A padded "
        "row is priced as a causal document of the padded width: a dense kernel over the padded batch computes "
        "all of it (a varlen kernel would skip the pads' attention, not their linear work); at these widths "
        "(rows of at most 2,034 tokens) attention is a few percent of a row's time, so that choice moves little. TRL "
        "1.16's DPOTrainer turns `padding_free` off (it warns and pads) and truncates rows to max_length (1024 "
        "by default): here no row is truncated, as with max_length=None, so both layouts train the same tokens. "
        "The reference model's forward, which both layouts need, is not counted.",
        "- GRPO rows are counted and priced padding-free and packed to the cap per micro-batch: the most favourable "
        "reading of TRL (its trainer pads, see the table of section 1). Generation is not counted.",
        f"- Long completions: every answer x {scale}, capped at {maxc:,} tokens (a max_completion_length), prompts "
        "unchanged; groups longer than the world's memory (world x cap) are dropped"
        + (
            ": " + ", ".join(f"{r['dropped']} at world {r['world']} ({r['workload']})" for r in dropped)
            if dropped
            else " (none was)"
        )
        + ". In TRL's layout a group's G completions run on one rank as several micro-batches.",
        "- Steps: the trace's shuffled epochs read as one stream; every step holds groups/step = world x "
        "round(tokens per rank per step / mean group tokens) groups, the same groups in both layouts, dealt to "
        "ranks in equal consecutive chunks in TRL's layout.",
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    from hf_cp.balance import get_balancer
    from hf_cp.cost.model import CostModel

    tdir = Path(args.traces_dir)
    worlds = [int(w) for w in args.worlds.split(",")]
    cost = CostModel.load(args.model, args.profile)
    balancer = get_balancer(args.balancer)
    command = "python scripts/bench_preference.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    scenario = (
        f"profile {args.profile}, model {args.model}, cap {args.max_tokens_per_rank} tokens per rank per "
        f"micro-batch, about {args.tokens_per_rank_per_step} tokens per rank per step in hf_cp's layout, worlds "
        f"{args.worlds}, {args.steps} full steps per workload and world, balancer {args.balancer}, seed {args.seed}"
    )
    print(f"scenario: {scenario}")
    rows = []
    for world in worlds:
        for wl in workloads(tdir, args.long_scale, args.max_completion):
            rows.append(run_workload(wl, world, args, cost, balancer))
    load_start = os.getloadavg()
    measured = measure(tdir, args.measure_steps, args.measure_rounds) if args.measure else []
    load_end = os.getloadavg()
    runtime = time.perf_counter() - t0
    args.cpu_s = cpu_s()
    if measured:
        args.load = (
            f"machine load average (1/5/15 min) at the start of the measured section {load_start[0]:.1f}/"
            f"{load_start[1]:.1f}/{load_start[2]:.1f}, at its end "
            f"{load_end[0]:.1f}/{load_end[1]:.1f}/{load_end[2]:.1f} "
            f"on {os.cpu_count()} CPUs"
        )
        print(args.load)
    print("\n".join(headline(rows, measured)))
    print(f"runtime {runtime:.0f} s (CPU {args.cpu_s:.0f} s)")
    if args.write:
        write_markdown(Path(args.out), command, scenario, rows, measured, args, runtime)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
