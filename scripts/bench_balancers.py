#!/usr/bin/env python
"""Benchmark every balancer on the shared length traces: predicted step time against two lower
bounds, the static baseline and Megatron-Core's scheduler, balance, communication and planner
CPU time. Full steps and an epoch's partial last step are reported apart. Prints the tables
and writes them as markdown (default benchmarks/balancers.md).

Full steps are filled to the token budget, as a multi-epoch run fills them: the trace's
epochs, each shuffled with its own seed, are read as one stream and cut into global batches
(a sample of a later epoch gets id epoch x samples + index). The partial step is the last,
under-filled batch of the first epoch (lengths.step_batches), where a small trace may put
the whole dataset in one step: it says little about a balancer and is kept out of the
headline numbers.

Example (all traces, worlds 8/64/512, 3 full steps each; megatron needs ~25 s a step at 512):
    python scripts/bench_balancers.py --steps 3
Planner time at 1024 ranks, auto only:
    python scripts/bench_balancers.py --worlds 1024 --balancers auto --no-partial --out -
Quick look:
    python scripts/bench_balancers.py --worlds 64 --steps 1 --balancers static,dynamic_cp,auto --out -
The placement solvers of issue 16 on their own workloads (shared prompts, a sliding window, an
outlier document; group layouts and whole steps; writes benchmarks/solvers.md; ~15 minutes):
    python scripts/bench_balancers.py --solvers
Planner scale (issue 28): `auto` from 64 to 4096 ranks on three traces, planner CPU with its
solver workers, validation and share of the step, into the scaling section of balancers.md
(with, at 64 ranks, a step of ~28K short samples: chat_alpaca's samples cut at 192 tokens,
SCALING_SHORT):
    python scripts/bench_balancers.py --scaling --steps 3
CP groups of any size within a node (dynamic_cp and auto as planned, and again as NAME+any with
option any_size_groups on a cluster that registers those groups; summary lines compare them):
    python scripts/bench_balancers.py --worlds 64,512 --balancers dynamic_cp,auto --any-size-groups --no-partial --out -
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import statistics
import sys
import time
import warnings
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACES = REPO / "benchmarks" / "traces"  # committed with the repository

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
warnings.filterwarnings("ignore", category=DeprecationWarning)

TARGET_CPU_MS = {64: 20.0, 512: 300.0}  # issue 14: auto's median planner CPU time per full step
TARGET_SHARE_OF_STEP = {1024: 0.10}  # ... and at 1024 ranks, as a share of the predicted step
TARGET_RATIO = 1.02  # auto / lower bound on full steps at 64 and 512 ranks
ANY_SIZE_SUFFIX = "+any"  # --any-size-groups: the balancer with option any_size_groups on
# --scaling (issue 28): worlds and traces of the planner-scale table, and its targets
SCALING_WORLDS = "64,128,256,512,1024,2048,4096"
SCALING_TRACES = "chat_lmsys_chat1m_191conv,longdoc_leval_multiturn,code_numpy_files"
SCALING_SHARE_AT = {4096: 0.10}  # auto's planner CPU / predicted step, at most
SCALING_CPU_MS = {64: 20.0}  # auto's median planner CPU ms, at most
SCALING_VALIDATE_SHARE = 0.5  # validation / planning, at most
SCALING_MARKERS = ("<!-- scaling: made by bench_balancers.py --scaling -->", "<!-- /scaling -->")
# ... and the step of ~28K short samples the 64-rank target is set on (issue 28): no shared
# trace has one, so chat_alpaca's samples are cut into turn-sized pieces (split_lengths: at most
# 192 tokens, mean ~152, ~27.7K samples per 64-rank step of 64K tokens per rank)
SCALING_SHORT = ("chat_alpaca_eval_outputs", 192, 64)
# --hierarchical (issue 39): worlds, markers and targets of the hierarchical-planning table
HIERARCHY_WORLDS = "512,1024,4096,16384"
HIERARCHY_MARKERS = ("<!-- hierarchy: made by bench_balancers.py --hierarchical -->", "<!-- /hierarchy -->")
HIERARCHY_HOST_CPU_X = 2.0  # slowest host's CPU / flat auto's at 64 ranks, at most (4096 and 16384 ranks)
HIERARCHY_SHARE = 0.03  # (first pass + slowest host) / predicted step, at most
HIERARCHY_QUALITY = 1.003  # hierarchical / flat predicted step, at most


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--traces-dir", default=str(DEFAULT_TRACES), help="folder of *.txt length traces")
    p.add_argument("--traces", help="comma-separated trace names (file stems); default: every *.txt")
    p.add_argument("--worlds", default="8,64,512", help="comma-separated world sizes")
    p.add_argument("--balancers", help="comma-separated balancers; default: every registered one")
    p.add_argument("--steps", type=int, default=3, help="full steps per trace and world, spread over the first epoch")
    p.add_argument("--no-partial", action="store_true", help="skip the epoch's partial last step")
    p.add_argument(
        "--megatron-max-world",
        type=int,
        default=512,
        help="plan with megatron only up to this world (its pure-Python scheduler takes ~25 s a step at 512)",
    )
    p.add_argument("--max-tokens-per-rank", type=int, default=32768)
    p.add_argument("--tokens-per-rank-per-step", type=int, default=65536)
    p.add_argument("--profile", default="h200-qwen2.5-7b")
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--seed", type=int, default=0, help="epoch shuffle seed")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "balancers.md"), help="markdown output ('-' for none)")
    p.add_argument(
        "--any-size-groups",
        action="store_true",
        help="also plan with every listed balancer that has option any_size_groups (dynamic_cp, auto) with it on, "
        "as NAME+any, on a cluster that registers contiguous groups of any size within a node",
    )
    p.add_argument(
        "--scaling",
        action="store_true",
        help="planner scale instead (issue 28): `auto` on full steps at every world of --worlds (default "
        f"{SCALING_WORLDS}) on --traces (default {SCALING_TRACES}): planner CPU (solver workers included), "
        "validation and share of the predicted step; writes its table between the scaling markers of --out",
    )
    p.add_argument(
        "--hierarchical",
        action="store_true",
        help="hierarchical planning instead (issue 39): `hierarchical` (auto on each host of --host-ranks ranks) against "
        f"flat `auto` at every world of --worlds (default {HIERARCHY_WORLDS}) on --traces (default {SCALING_TRACES}, "
        "and chat_alpaca cut at 192 tokens: the most samples per step); writes its table between the hierarchy "
        "markers of --out",
    )
    p.add_argument("--host-ranks", type=int, default=8, help="--hierarchical: ranks of one host")
    p.add_argument(
        "--solvers",
        action="store_true",
        help="run the placement solvers' workloads instead (solver_workloads; default output benchmarks/solvers.md)",
    )
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- steps
def full_step_ids(lengths: Sequence[int], tokens_per_step: int, seed: int, wanted: Sequence[int]) -> Dict[int, list]:
    """Sample ids of the full steps numbered `wanted`: the stream of shuffled epochs (epoch e in
    lengths.epoch_order(n, seed, e)) cut by lengths.step_batches' rule, a batch closing when
    the next sample would overflow it; id = epoch x len(lengths) + index."""
    from hf_cp.samples.lengths import epoch_order

    n = len(lengths)
    lens = np.asarray(lengths, dtype=np.int64)
    epochs = -(-(max(wanted) + 2) * tokens_per_step // int(lens.sum())) + 1
    ids = np.concatenate([epoch_order(n, seed, e) + e * n for e in range(epochs)])
    prefix = np.concatenate([[0], np.cumsum(lens[ids % n])])
    out: Dict[int, list] = {}
    start = 0
    for step in range(max(wanted) + 1):
        end = max(int(np.searchsorted(prefix, prefix[start] + tokens_per_step, side="right")) - 1, start + 1)
        if step in wanted:
            out[step] = ids[start:end].tolist()
        start = end
    return out


def split_lengths(lengths: Sequence[int], at_most: int) -> List[int]:
    """Every sample cut into ceil(n / at_most) pieces of near-equal length (the longer ones
    first), in trace order: a conversation trace read as turn-sized samples."""
    out: List[int] = []
    for n in lengths:
        k = -(-n // at_most)
        q, r = divmod(n, k)
        out += [q + 1] * r + [q] * (k - r)
    return out


def cpu_s() -> float:
    """CPU seconds of this process, of its waited-for children and of the live solver worker:
    flexsp's MILP runs in a long-lived worker process (balance/toolkit/deadline.py), whose time
    counts as the planner's. os.times() sees a child's time only once it is waited for, so the
    live worker's is read from /proc (62% of flexsp's CPU at 64 ranks went uncounted without it)."""
    t = os.times()
    return time.process_time() + t.children_user + t.children_system + worker_cpu_s()


def worker_cpu_s() -> float:
    """CPU seconds used so far by the running solver worker (0 when none runs, or off Linux).
    When a worker is replaced between two readings, the one that ended was waited for
    (SolverWorker stops it with join), so os.times() counts it from then on."""
    from hf_cp.balance.toolkit.deadline import solver_worker

    pid = solver_worker().pid
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def sampled(count: int, steps: int) -> List[int]:
    if steps >= count:
        return list(range(count))
    return sorted({int(round(x)) for x in np.linspace(0, count - 1, steps)})


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.solvers:
        from bench_solver_workloads import solver_workloads

        out = args.out if "--out" in (argv or sys.argv[1:]) else str(REPO / "benchmarks" / "solvers.md")
        return solver_workloads(args, out, argv)
    if args.scaling:
        return scaling(args, argv)
    if args.hierarchical:
        return hierarchy(args, argv)
    from hf_cp.balance import PlanRequest, available_balancers, balancer_options, get_balancer
    from hf_cp.cost.bounds import charged_lower_bound_ms, lower_bound_ms
    from hf_cp.cost.model import CostModel
    from hf_cp.cost.simulate import simulate
    from hf_cp.plan.cluster import ClusterSpec
    from hf_cp.samples.lengths import read_lengths, step_batches

    tdir = Path(args.traces_dir)
    names = args.traces.split(",") if args.traces else sorted(p.stem for p in tdir.glob("*.txt"))
    worlds = [int(w) for w in args.worlds.split(",")]
    balancers = args.balancers.split(",") if args.balancers else available_balancers()
    for need in ("static", "megatron"):
        if need not in balancers and not args.balancers:
            balancers.insert(0, need)
    cap, tpr = args.max_tokens_per_rank, args.tokens_per_rank_per_step
    command = "python scripts/bench_balancers.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    scenario = (
        f"profile {args.profile}, model {args.model}, cap {cap} tokens per rank per micro-batch, "
        f"{tpr} tokens per rank per step (global batch = {tpr} x world), gpus per node from the "
        f"profile, epochs shuffled with seed {args.seed}; {args.steps} full steps per trace and world, "
        f"spread over the first epoch's worth of steps"
        + ("" if args.no_partial else ", and separately the first epoch's partial last step")
    )
    print(f"scenario: {scenario}")
    load_start = os.getloadavg()
    print(f"balancers: {', '.join(balancers)}")
    insts = {b: get_balancer(b) for b in balancers}
    if args.any_size_groups:
        for b in list(balancers):
            opts = balancer_options(b)
            if opts is not None and "any_size_groups" in {h.name for h in opts.describe()}:
                balancers.insert(balancers.index(b) + 1, f"{b}{ANY_SIZE_SUFFIX}")
                insts[f"{b}{ANY_SIZE_SUFFIX}"] = get_balancer(b, any_size_groups=True)
        print(f"balancers with groups of any size: {', '.join(b for b in balancers if b.endswith(ANY_SIZE_SUFFIX))}")
    # a CostModel per balancer: each one warms its own per-length caches, none profits from another's
    costs = {b: CostModel.load(args.model, args.profile) for b in balancers}
    ref_cost = CostModel.load(args.model, args.profile)
    # A planner call should pay only for the collections its own allocations cause. Building
    # `megatron` imports torch and megatron-core: ~380k GC-tracked objects that live as long as
    # the process, which every full collection walks (200-350 ms here) inside whichever call is
    # running when it trips. Freeze them out of the collector, and collect before each timed call.
    gc.collect()
    gc.freeze()

    rows = []
    notes = []
    for world in worlds:
        for name in names:
            lengths = read_lengths(tdir / f"{name}.txt")
            cluster = ClusterSpec(world, cap, ref_cost.profile.gpus_per_node)
            too_long = [n for n in lengths if n > cluster.largest_capacity]
            if too_long:
                note = (
                    f"world {world}, {name}: dropped {len(too_long)} samples longer than the largest group "
                    f"({cluster.largest_capacity} tokens), longest {max(too_long)}"
                )
                notes.append(note)
                print(note)
                lengths = [n for n in lengths if n <= cluster.largest_capacity]
            longest = max(lengths)
            n = len(lengths)
            epoch0 = step_batches(lengths, tpr * world, seed=args.seed)
            full_in_epoch = sum(1 for b in epoch0 if sum(lengths[i] for i in b) >= 0.9 * tpr * world)
            picked = sampled(max(full_in_epoch, args.steps), args.steps)
            kinds = [("full", full_step_ids(lengths, tpr * world, args.seed, picked))]
            last = epoch0[-1]
            if not args.no_partial and sum(lengths[i] for i in last) < tpr * world:
                kinds.append(("partial", {len(epoch0) - 1: last}))
            for kind, steps in kinds:
                rows.extend(
                    bench_steps(
                        kind,
                        world,
                        name,
                        steps,
                        lengths,
                        n,
                        longest,
                        cluster,
                        balancers,
                        insts,
                        costs,
                        ref_cost,
                        args,
                        PlanRequest,
                        simulate,
                        lower_bound_ms,
                        charged_lower_bound_ms,
                    )
                )

    summary = acceptance(rows)
    load_end = os.getloadavg()
    summary.append(
        f"- machine load average (1/5/15 min) at start {load_start[0]:.1f}/{load_start[1]:.1f}/"
        f"{load_start[2]:.1f}, at end {load_end[0]:.1f}/{load_end[1]:.1f}/{load_end[2]:.1f} on "
        f"{os.cpu_count()} CPUs: CPU times exclude waiting for a CPU but not the cache and core "
        f"sharing of a loaded machine"
    )
    print("\n".join(summary))
    if args.out != "-":
        write_markdown(Path(args.out), command, scenario, balancers, rows, notes, summary)
        print(f"wrote {args.out}")
    return 0


def bench_steps(
    kind, world, name, steps, lengths, n, longest, cluster, balancers, insts, costs, ref_cost, args,
    PlanRequest, simulate, lower_bound_ms, charged_lower_bound_ms,
):  # fmt: skip
    per: Dict[str, Dict[str, list]] = defaultdict(lambda: defaultdict(list))
    n_samples = []
    # a balancer planning groups of any size needs a cluster that registers them (the same
    # ranks, cap and aligned blocks: the bounds are those of `cluster`)
    any_size = replace(cluster, any_size_groups=True)
    for step, ids in sorted(steps.items()):
        lens = [lengths[i % n] for i in ids]
        n_samples.append(len(ids))
        lb = lower_bound_ms(lens, cluster, ref_cost)
        charged = charged_lower_bound_ms(lens, cluster, ref_cost)
        for b in balancers:
            if b == "megatron" and world > args.megatron_max_world:
                continue
            cl = any_size if getattr(insts[b], "needs_any_size_groups", False) else cluster
            req = PlanRequest(ids, lens, cl, costs[b], seed=args.seed, step=step, dataset_max_length=longest)
            gc.collect()
            c0 = cpu_s()
            plan = insts[b].plan(req)
            cpu_ms = (cpu_s() - c0) * 1e3
            c1 = time.process_time()
            plan.validate(cl, ref_cost)
            check_ms = (time.process_time() - c1) * 1e3
            sim = simulate(plan, ref_cost)
            d = per[b]
            d["pred"].append(sim.makespan_ms)
            d["lb"].append(lb)
            d["charged"].append(charged)
            d["imb"].append(sim.imbalance)
            d["comm"].append(sim.comm_bytes)
            d["cpu_ms"].append(cpu_ms)
            d["check_ms"].append(check_ms)
            d["far"].append(sim.makespan_ms >= 1.5 * charged)
            # a size with more than one bit set is not a power of two
            d["off_power_of_two"].append(any(g.size & (g.size - 1) for w in plan.waves for g in w.groups))
            if getattr(insts[b], "name", b) == "auto":  # auto and auto+any record their winners
                d["winner"].append(plan.balancer.split(":", 1)[-1])
                d["planned"].append(len(insts[b].last_makespans))
    rows = []
    for b in balancers:
        d = per.get(b)
        if not d:
            continue
        pred = sum(d["pred"])
        static = sum(per["static"]["pred"]) if "static" in per else float("nan")
        mega = sum(per["megatron"]["pred"]) if "megatron" in per else float("nan")
        row = {
            "kind": kind,
            "world": world,
            "trace": name,
            "balancer": b,
            "steps": len(d["pred"]),
            "samples_per_step": statistics.mean(n_samples),
            "pred_ms": statistics.mean(d["pred"]),
            "ratio": pred / sum(d["lb"]),
            "ratio_charged": pred / sum(d["charged"]),
            "vs_static": static / pred,
            "vs_megatron": mega / pred,
            "max_mean": statistics.mean(d["imb"]),
            "far": sum(d["far"]),
            "comm_gb": statistics.mean(d["comm"]) / 1e9,
            "cpu_ms": statistics.median(d["cpu_ms"]),
            "check_ms": statistics.median(d["check_ms"]),
            "winners": ",".join(sorted(set(d["winner"]))) if d["winner"] else "",
            "planned": statistics.mean(d["planned"]) if d["planned"] else None,
            "off_power_of_two": sum(d["off_power_of_two"]),
        }
        rows.append(row)
        print(
            f"{kind:7s} W={world:<4} {name:28s} {b:11s} steps {row['steps']} pred/LB {row['ratio']:.3f} "
            f"pred/charged {row['ratio_charged']:.3f} vs static {row['vs_static']:.2f}x vs megatron "
            f"{row['vs_megatron']:.2f}x max/mean {row['max_mean']:.3f} comm {row['comm_gb']:.1f} GB "
            f"plan CPU {row['cpu_ms']:.1f} ms (validate {row['check_ms']:.1f})"
            + (f" (won: {row['winners']}; members planned {row['planned']:.1f})" if row["winners"] else ""),
            flush=True,
        )
    return rows


def acceptance(rows) -> List[str]:
    out = ["Full steps only (the partial steps are in their own tables below):"]
    full = [r for r in rows if r["kind"] == "full"]
    for world in sorted({r["world"] for r in full}):
        auto = [r for r in full if r["world"] == world and r["balancer"] == "auto"]
        if not auto:
            continue
        worst_ratio = max(r["ratio"] for r in auto)
        worst_cpu = max(auto, key=lambda r: r["cpu_ms"])
        line = (
            f"- world {world}, `auto` / lower bound: "
            + ", ".join(f"{r['trace']} {r['ratio']:.3f}" for r in auto)
            + f" (worst {worst_ratio:.3f}"
            + (
                f"; target <= {TARGET_RATIO}: {'met' if worst_ratio <= TARGET_RATIO else 'MISSED'})"
                if world in (64, 512)
                else ")"
            )
        )
        out.append(line)
        line = (
            f"- world {world}, `auto` planner CPU ms (median per step): "
            + ", ".join(f"{r['trace']} {r['cpu_ms']:.1f}" for r in auto)
            + f" (worst {worst_cpu['cpu_ms']:.1f}"
        )
        if world in TARGET_CPU_MS:
            t = TARGET_CPU_MS[world]
            line += f"; target <= {t:.0f}: {'met' if worst_cpu['cpu_ms'] <= t else 'MISSED'})"
        elif world in TARGET_SHARE_OF_STEP:
            share = max(r["cpu_ms"] / r["pred_ms"] for r in auto)
            t = TARGET_SHARE_OF_STEP[world]
            line += f"; worst share of the predicted step {100 * share:.1f}%, target <= {100 * t:.0f}%: {'met' if share <= t else 'MISSED'})"
        else:
            line += ")"
        out.append(line)
        out.append(
            "  - plus validating the winner (the caller's job, StepPlan.validate): median "
            + ", ".join(f"{r['trace']} {r['check_ms']:.1f}" for r in auto)
            + " ms; members planned per step: "
            + ", ".join(f"{r['trace']} {r['planned']:.1f}" for r in auto)
        )
        mega = [r for r in auto if r["vs_megatron"] == r["vs_megatron"]]
        if mega:
            out.append(
                f"- world {world}, `auto` speedup vs `megatron` (predicted step time), mean over traces: "
                f"{statistics.mean(r['vs_megatron'] for r in mega):.2f}x (per trace: "
                + ", ".join(f"{r['vs_megatron']:.2f}" for r in mega)
                + f"); vs `static`: {statistics.mean(r['vs_static'] for r in auto):.2f}x"
            )
    out.extend(any_size_summary(full))
    flagged = [r for r in full if r["far"]]
    if flagged:
        out.append(
            "- plans at least 1.5x the charged bound (flagged by SimResult.flags), full steps: "
            + ", ".join(f"{r['balancer']}@{r['world']}/{r['trace']} ({r['far']})" for r in flagged)
        )
    under = [r for r in rows if r["ratio_charged"] < 1 - 1e-9]
    out.append(
        "- plans below the charged bound (which does not cover zigzag packs): "
        + (", ".join(f"{r['balancer']}@{r['world']}/{r['trace']} {r['ratio_charged']:.3f}" for r in under) or "none")
    )
    return out


def any_size_summary(full_rows) -> List[str]:
    """--any-size-groups: per world, NAME+any against NAME on every trace (predicted step time
    summed over the steps, its ratio to the lower bound and the steps whose plan used a group
    that is not a power of two)."""
    out = []
    by_key = {(r["world"], r["trace"], r["balancer"]): r for r in full_rows}
    for r in full_rows:
        if not r["balancer"].endswith(ANY_SIZE_SUFFIX):
            continue
        base = by_key.get((r["world"], r["trace"], r["balancer"][: -len(ANY_SIZE_SUFFIX)]))
        if base is None:
            continue
        out.append(
            f"- world {r['world']}, {r['trace']}, `{r['balancer']}` vs `{base['balancer']}`: predicted step "
            f"{r['pred_ms']:.1f} vs {base['pred_ms']:.1f} ms ({base['pred_ms'] / r['pred_ms']:.4f}x), "
            f"pred/LB {r['ratio']:.4f} vs {base['ratio']:.4f}, pred/charged {r['ratio_charged']:.4f} vs "
            f"{base['ratio_charged']:.4f}; steps with a group that is not a power of two: "
            f"{r['off_power_of_two']} of {r['steps']}; plan CPU {r['cpu_ms']:.1f} vs {base['cpu_ms']:.1f} ms"
        )
    return out


def scaling(args, argv) -> int:
    """--scaling: `auto` on --steps full steps per trace and world, median planner CPU (its solver
    workers included, cpu_s), median validation of the winner (StepPlan.validate with the
    cluster and cost model, as every caller does) and their share of the predicted step; the
    table replaces the one between SCALING_MARKERS in --out (appended when there is none)."""
    from hf_cp.balance import PlanRequest, get_balancer
    from hf_cp.cost.model import CostModel
    from hf_cp.cost.simulate import simulate
    from hf_cp.plan.cluster import ClusterSpec
    from hf_cp.samples.lengths import read_lengths

    given = argv if argv is not None else sys.argv[1:]
    worlds = [int(w) for w in (args.worlds if "--worlds" in given else SCALING_WORLDS).split(",")]
    names = (args.traces or SCALING_TRACES).split(",")
    cap = args.max_tokens_per_rank
    cost = CostModel.load(args.model, args.profile)
    auto = get_balancer("auto")
    gc.collect()
    gc.freeze()
    rows = []
    runs = [(name, name, None, worlds) for name in names]
    short, at_most, short_world = SCALING_SHORT
    if short_world in worlds and (Path(args.traces_dir) / f"{short}.txt").exists():
        runs.append((f"{short} cut at {at_most}", short, at_most, [short_world]))
    for name, stem, split_at, run_worlds in runs:
        all_lengths = read_lengths(Path(args.traces_dir) / f"{stem}.txt")
        if split_at is not None:
            all_lengths = split_lengths(all_lengths, split_at)
        for world in run_worlds:
            cluster = ClusterSpec(world, cap, cost.profile.gpus_per_node)
            lengths = [n for n in all_lengths if n <= cluster.largest_capacity]
            steps = full_steps(lengths, world, args)
            d = defaultdict(list)
            n = len(lengths)
            for step, ids in sorted(steps.items()):
                req = PlanRequest(ids, [lengths[i % n] for i in ids], cluster, cost, seed=args.seed, step=step,
                                  dataset_max_length=max(lengths))  # fmt: skip
                gc.collect()
                c0 = cpu_s()
                plan = auto.plan(req)
                d["cpu"].append((cpu_s() - c0) * 1e3)
                gc.collect()
                c0 = cpu_s()
                plan.validate(cluster, cost)
                d["check"].append((cpu_s() - c0) * 1e3)
                d["pred"].append(simulate(plan, cost).makespan_ms)
                d["samples"].append(len(ids))
            row = {
                "trace": name,
                "world": world,
                "steps": len(d["cpu"]),
                "samples": statistics.mean(d["samples"]),
                "cpu_ms": statistics.median(d["cpu"]),
                "check_ms": statistics.median(d["check"]),
                "pred_ms": statistics.mean(d["pred"]),
                "share": max(c / p for c, p in zip(d["cpu"], d["pred"])),
            }
            row["per_sample_us"] = 1e3 * row["cpu_ms"] / row["samples"]
            rows.append(row)
            print(
                f"scaling W={world:<5} {name:28s} samples/step {row['samples']:.0f} plan CPU {row['cpu_ms']:.1f} ms "
                f"validate {row['check_ms']:.1f} ms pred step {row['pred_ms']:.1f} ms share {100 * row['share']:.1f}%",
                flush=True,
            )
    load = os.getloadavg()
    command = "python scripts/bench_balancers.py " + " ".join(shlex.quote(a) for a in given)
    lines = scaling_markdown(rows, command, args, load)
    print("\n".join(lines))
    if args.out != "-":
        replace_between(Path(args.out), SCALING_MARKERS, lines)
        print(f"wrote the scaling table into {args.out}")
    return 0


def full_steps(lengths, world, args) -> Dict[int, list]:
    """--steps full steps of `lengths` at `world` ranks, spread over the first epoch's worth."""
    from hf_cp.samples.lengths import step_batches

    tpr = args.tokens_per_rank_per_step
    epoch0 = step_batches(lengths, tpr * world, seed=args.seed)
    full_in_epoch = sum(1 for b in epoch0 if sum(lengths[i] for i in b) >= 0.9 * tpr * world)
    return full_step_ids(lengths, tpr * world, args.seed, sampled(max(full_in_epoch, args.steps), args.steps))


def made_by(title: str, command: str) -> List[str]:
    """A markdown section's heading and the command that made it."""
    return [f"## {title}", "", "Made by:", "", f"    {command}", ""]


def replace_between(path: Path, markers, lines: List[str]) -> None:
    """Write `lines` between the two markers of `path` (appended with them when absent)."""
    text = path.read_text() if path.exists() else ""
    block = "\n".join([markers[0], *lines, markers[1]])
    if markers[0] in text and markers[1] in text:
        head, rest = text.split(markers[0], 1)
        text = head + block + rest.split(markers[1], 1)[1]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    path.write_text(text)


def hierarchy(args, argv) -> int:
    """--hierarchical: per trace and world, `hierarchical` (auto on each host) against flat `auto`
    on --steps full steps: the first pass's CPU, the slowest host's (the blocks of hosts it
    belongs to and its own plan), their share of the predicted step, and the predicted step
    against flat planning; flat auto's CPU at 64 ranks on the same trace is the reference."""
    from hf_cp.balance import PlanRequest, get_balancer
    from hf_cp.balance.hierarchical import plan_hierarchically
    from hf_cp.cost.model import CostModel
    from hf_cp.cost.simulate import simulate
    from hf_cp.plan.cluster import ClusterSpec
    from hf_cp.samples.lengths import read_lengths

    given = argv if argv is not None else sys.argv[1:]
    worlds = [int(w) for w in (args.worlds if "--worlds" in given else HIERARCHY_WORLDS).split(",")]
    names = (args.traces or SCALING_TRACES).split(",")
    short, at_most, _ = SCALING_SHORT
    runs = [(name, name, None) for name in names] + [(f"{short} cut at {at_most}", short, at_most)]
    cap = args.max_tokens_per_rank
    cost = CostModel.load(args.model, args.profile)
    auto = get_balancer("auto")
    hosts_member = get_balancer("hierarchical", host_ranks=args.host_ranks).member  # auto as each host runs it
    gc.collect()
    gc.freeze()

    def timed(fn):
        # the collector is off while a plan is timed: a host's planner process collects only
        # its own objects, not the whole step's (a full collection walks ~10^6 here)
        gc.collect()
        gc.freeze()
        gc.disable()
        try:
            c0 = cpu_s()
            out = fn()
            return out, (cpu_s() - c0) * 1e3
        finally:
            gc.enable()

    rows = []
    for name, stem, split_at in runs:
        all_lengths = read_lengths(Path(args.traces_dir) / f"{stem}.txt")
        if split_at is not None:
            all_lengths = split_lengths(all_lengths, split_at)
        reference = None
        for world in [64] + worlds:
            cluster = ClusterSpec(world, cap, cost.profile.gpus_per_node)
            lengths = [n for n in all_lengths if n <= cluster.largest_capacity]
            d = defaultdict(list)
            n = len(lengths)
            for step, ids in sorted(full_steps(lengths, world, args).items()):
                req = PlanRequest(ids, [lengths[i % n] for i in ids], cluster, cost, seed=args.seed, step=step,
                                  dataset_max_length=max(lengths))  # fmt: skip
                flat, flat_ms = timed(lambda req=req: auto.plan(req))
                d["flat_cpu"].append(flat_ms)
                d["samples"].append(len(ids))
                if world == 64:
                    continue
                # a request of its own, as each host builds it (its tuples and arrays: PlanRequest's
                # construction, timed apart; flat planning builds the same request)
                req, request_ms = timed(lambda req=req: replace(req))
                d["request"].append(request_ms)
                (plan, report, _), _ = timed(
                    lambda req=req: plan_hierarchically(req, hosts_member.plan, args.host_ranks, clock=cpu_s)
                )
                plan.validate(cluster, cost)
                pred, flat_pred = simulate(plan, cost).makespan_ms, simulate(flat, cost).makespan_ms
                host, slowest = report.slowest_host()
                d["first"].append(report.first_pass_ms)
                d["host"].append(slowest)
                d["share"].append((report.first_pass_ms + slowest) / pred)
                d["quality"].append(pred / flat_pred)
                d["spread"].append(report.spread_samples)
                d["pred"].append(pred)
            if world == 64:
                reference = statistics.median(d["flat_cpu"])
                continue
            row = {
                "trace": name,
                "world": world,
                "hosts": world // args.host_ranks,
                "steps": len(d["first"]),
                "samples": statistics.mean(d["samples"]),
                "first_ms": statistics.median(d["first"]),
                "host_ms": statistics.median(d["host"]),
                "host_x": statistics.median(d["host"]) / reference,
                "share": max(d["share"]),
                "share_median": statistics.median(d["share"]),
                "request_ms": statistics.median(d["request"]),
                "quality": max(d["quality"]),
                "flat_ms": statistics.median(d["flat_cpu"]),
                "ref_ms": reference,
                "spread": statistics.mean(d["spread"]),
                "pred_ms": statistics.mean(d["pred"]),
            }
            rows.append(row)
            print(
                f"hierarchy W={world:<6} {name:34s} samples/step {row['samples']:.0f} first pass {row['first_ms']:.1f} "
                f"ms slowest host {row['host_ms']:.1f} ms ({row['host_x']:.2f}x flat at 64: {reference:.1f} ms) share "
                f"{100 * row['share']:.2f}% (median {100 * row['share_median']:.2f}%) vs flat {row['quality']:.4f} (flat CPU "
                f"{row['flat_ms']:.1f} ms, request {row['request_ms']:.1f} ms)",
                flush=True,
            )
    command = "python scripts/bench_balancers.py " + " ".join(shlex.quote(a) for a in given)
    lines = hierarchy_markdown(rows, command, args, os.getloadavg())
    print("\n".join(lines))
    if args.out != "-":
        replace_between(Path(args.out), HIERARCHY_MARKERS, lines)
        print(f"wrote the hierarchy table into {args.out}")
    return 0


def hierarchy_markdown(rows, command, args, load) -> List[str]:
    big = [r for r in rows if r["world"] >= 4096]
    out = made_by("Hierarchical planning: each host plans its own ranks (issue 39)", command) + [
        f"Profile {args.profile}, model {args.model}, cap {args.max_tokens_per_rank} tokens per rank per micro-batch, "
        f"{args.tokens_per_rank_per_step} tokens per rank per step, hosts of {args.host_ranks} ranks, {args.steps} full "
        "steps per trace and world. `hierarchical` splits each step over the hosts (toolkit/host_split.py) and "
        "plans each host with `auto`; flat is `auto` on the whole world. *first pass*: median CPU ms of the split "
        "(every host computes it); *slowest host*: median over steps of the largest CPU ms one host spends on its "
        "own share (the blocks of hosts it belongs to, then its own ranks), and its ratio to flat `auto` at 64 "
        "ranks on the same trace; *share*: the worst step's (first pass + slowest host) / its predicted step, and "
        "the median step's; *request*: median CPU ms of building the step's PlanRequest (its tuples and arrays, "
        "as every rank builds it, flat or hierarchical: not in the share); "
        "*vs flat*: the worst step's predicted time / flat `auto`'s; *spread*: samples placed on blocks of hosts "
        "per step. CPU is this process's and the solver workers' (cpu_s), the collector off during each timed "
        "plan (a host's planner process collects only its own objects). The hosts are planned one after another "
        "here; on a cluster each runs in its own host's planner.",
        "",
    ]
    if big:
        out.append(
            f"- slowest host's CPU at 4096 and 16384 ranks, worst: {max(r['host_x'] for r in big):.2f}x flat `auto` at 64 "
            f"ranks, target <= {HIERARCHY_HOST_CPU_X:g}x: {'met' if max(r['host_x'] for r in big) <= HIERARCHY_HOST_CPU_X else 'missed'}"
        )
    if rows:
        share = max(r["share"] for r in rows)
        quality = max(r["quality"] for r in rows)
        out.append(
            f"- first pass + slowest host, worst share of the step: {100 * share:.2f}%, target <= "
            f"{100 * HIERARCHY_SHARE:g}%: {'met' if share <= HIERARCHY_SHARE else 'missed'} (the median step's, worst "
            f"over the rows: {100 * max(r['share_median'] for r in rows):.2f}%)"
        )
        out.append(
            f"- hierarchical / flat predicted step, worst: {quality:.4f}, target <= {HIERARCHY_QUALITY}: "
            f"{'met' if quality <= HIERARCHY_QUALITY else 'missed'} (best {min(r['quality'] for r in rows):.4f})"
        )
    out += [
        f"- machine load average (1/5/15 min) at the end {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} on {os.cpu_count()} CPUs",
        "",
        "| trace | world | hosts | samples/step | first pass ms | slowest host ms | vs flat at 64 | share (worst / median) "
        "| vs flat | spread | flat auto CPU ms | request ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['trace']} | {r['world']} | {r['hosts']} | {r['samples']:.0f} | {r['first_ms']:.1f} | {r['host_ms']:.1f} | "
            f"{r['host_x']:.2f}x | {100 * r['share']:.2f}% / {100 * r['share_median']:.2f}% | {r['quality']:.4f} | "
            f"{r['spread']:.0f} | {r['flat_ms']:.1f} | {r['request_ms']:.1f} |"
        )
    return out


def scaling_markdown(rows, command, args, load) -> List[str]:
    """The scaling section: how it was made, the targets met or missed, one row per trace and world."""
    out = made_by("Planner scale: `auto` from 64 to 4096 ranks (full steps)", command) + [
        f"Profile {args.profile}, model {args.model}, cap {args.max_tokens_per_rank} tokens per rank per micro-batch, "
        f"{args.tokens_per_rank_per_step} tokens per rank per step, {args.steps} full steps per trace and world. "
        "*plan CPU ms*: median CPU time of `auto`'s plan() per step, its solver worker processes included "
        "(the live worker's time read from /proc); *validate ms*: median CPU time of StepPlan.validate(cluster, cost) "
        "of the winner, which every caller runs; *share*: the worst step's plan CPU / its predicted step time; "
        "*us/sample*: plan CPU per sample of the step (flat when growth is linear in samples per step).",
        "",
    ]
    short, at_most, _ = SCALING_SHORT
    for world, t in SCALING_CPU_MS.items():
        got = [r for r in rows if r["world"] == world and r["trace"] == f"{short} cut at {at_most}"]
        if got:
            r = got[0]
            out.append(
                f"- world {world}, a step of {r['samples']:.0f} short samples ({short} cut at {at_most} tokens, "
                f"split_lengths): median plan CPU {r['cpu_ms']:.1f} ms, target <= {t:.0f}: "
                f"{'met' if r['cpu_ms'] <= t else 'MISSED'}"
            )
        got = [r for r in rows if r["world"] == world and r["trace"] != f"{short} cut at {at_most}"]
        if got:
            worst = max(got, key=lambda r: r["cpu_ms"])
            out.append(
                f"- world {world}, the other traces (their steps hold {min(r['samples'] for r in got):.0f}-"
                f"{max(r['samples'] for r in got):.0f} samples): worst median plan CPU {worst['cpu_ms']:.1f} ms "
                f"({worst['trace']})"
            )
    for world, t in SCALING_SHARE_AT.items():
        got = [r for r in rows if r["world"] == world]
        if got:
            worst = max(r["share"] for r in got)
            out.append(
                f"- world {world}: worst share of the predicted step {100 * worst:.1f}%, target <= {100 * t:.0f}%: "
                f"{'met' if worst <= t else 'MISSED'}"
            )
    if rows:
        worst = max(rows, key=lambda r: r["check_ms"] / r["cpu_ms"])
        ratio = worst["check_ms"] / worst["cpu_ms"]
        out.append(
            f"- validation / planning, worst: {ratio:.2f} ({worst['trace']} at {worst['world']}), target <= "
            f"{SCALING_VALIDATE_SHARE}: {'met' if ratio <= SCALING_VALIDATE_SHARE else 'MISSED'}"
        )
    out.append(
        f"- machine load average (1/5/15 min) at the end {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} on "
        f"{os.cpu_count()} CPUs (CPU times exclude waiting for a CPU, not a loaded machine's cache sharing)"
    )
    out += [
        "",
        "| trace | world | samples/step | plan CPU ms | validate ms | pred step ms | share | us/sample |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['trace']} | {r['world']} | {r['samples']:.0f} | {r['cpu_ms']:.1f} | {r['check_ms']:.1f} | "
            f"{r['pred_ms']:.1f} | {100 * r['share']:.1f}% | {r['per_sample_us']:.2f} |"
        )
    out.append("")
    return out


def fmt_row(r) -> str:
    bal = r["balancer"] + (f" ({r['winners']})" if r["winners"] else "")
    return (
        f"| {r['trace']} | {r['samples_per_step']:.0f} | {bal} | {r['steps']} | {r['ratio']:.3f} | "
        f"{r['ratio_charged']:.3f} | {r['vs_static']:.2f} | {r['vs_megatron']:.2f} | {r['max_mean']:.3f} | "
        f"{r['far'] or ''} | {r['comm_gb']:.1f} | {r['cpu_ms']:.1f} |"
    )


def write_markdown(path: Path, command, scenario, balancers, rows, notes, summary) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Balancers on the shared length traces",
        "",
        "Made by:",
        "",
        f"    {command}",
        "",
        f"Scenario: {scenario}.",
        "",
        "Columns: *pred/LB* = predicted step time (hf_cp.cost.simulate.simulate, summed over the steps) / lower bound "
        "(hf_cp.cost.bounds.lower_bound_ms); *pred/charged* = the same over the bound that charges the costliest samples "
        "their group's communication and efficiency and every micro-batch its overhead "
        "(hf_cp.cost.bounds.charged_lower_bound_ms); *vs static*, *vs megatron* = their predicted time / this balancer's "
        "(higher is better); *max/mean* = slowest rank's busy time over the mean (per step, averaged); *far* = "
        "steps whose plan is at least 1.5x the charged bound (SimResult.flags: balanced or not); *comm GB* = bytes "
        "sent by all ranks per step; *plan CPU ms* = median CPU time of the balancer's plan() per step, "
        "its solver worker processes included (time.process_time + os.times children, after a gc.collect(), "
        "start-up objects frozen out of the collector), validation not included. `megatron` is Megatron-Core 0.16.1's BalancedCPScheduler translated into a StepPlan "
        "(hf_cp/balance/megatron.py). `auto (x)` names the members that won.",
        "",
        "## Acceptance",
        "",
        *summary,
        "",
    ]
    if notes:
        lines += ["## Samples dropped (longer than the whole world holds)", ""] + [f"- {n}" for n in notes] + [""]
    header = [
        "| trace | samples/step | balancer | steps | pred/LB | pred/charged | vs static | vs megatron | max/mean | far | comm GB | plan CPU ms |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, title in (("full", "full steps"), ("partial", "the first epoch's partial last step")):
        for world in sorted({r["world"] for r in rows if r["kind"] == kind}):
            lines += [f"## World {world}, {title}", ""] + header
            lines += [fmt_row(r) for r in rows if r["kind"] == kind and r["world"] == world]
            lines.append("")
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
