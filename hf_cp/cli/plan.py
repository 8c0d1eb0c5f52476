"""`hf-cp plan`: plan (or re-simulate) steps and report what a balanced plan buys."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from hf_cp.balance.options import parse_assignments
from hf_cp.balance.registry import available_balancers, describe_options
from hf_cp.balance.toolkit.sample_limit import check_sample_lengths
from hf_cp.balance.toolkit.vision_memory import fit_vision_memory
from hf_cp.cli.formatting import HelpFormatter
from hf_cp.cost.bounds import lower_bound_ms
from hf_cp.cost.dims import ModelDims, VisionDims, vision_dims_in
from hf_cp.cost.exchange import plan_exchange
from hf_cp.cost.execution import EXECUTIONS, execution_named
from hf_cp.cost.hardware import PROFILE_MAXIMA
from hf_cp.cost.model import CostModel
from hf_cp.cost.pipeline import bubble_share
from hf_cp.cost.simulate import SimResult, simulate
from hf_cp.cost.vision import step_vision
from hf_cp.plan.bins import first_fit
from hf_cp.plan.chunks import build_chunk_plan, chunk_costs_ms
from hf_cp.plan.cluster import MAX_WORLD_SIZE, ClusterSpec, is_power_of_two
from hf_cp.plan.step_plan import PlanError, StepPlan
from hf_cp.planning.predict import fitted_plan, predict
from hf_cp.planning.setup import PlanningSettings, engine_memory, engine_memory_lines, load_profile, planning_setup
from hf_cp.planning.worker import Planner
from hf_cp.samples.plan_inputs import PlanInputs, read_plan_inputs
from hf_cp.samples.vision_grids import SampleGrids, check_grids


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="plan steps of a length distribution with a balancer and simulate them",
        description="Plan optimizer steps for the samples in --lengths with --balancer, simulate each plan "
        "with the cost model (--model dimensions on --profile hardware) and print predicted step "
        "time, lower bound, balance, communication and memory. With --plan-json, simulate plans "
        "made elsewhere instead.",
        epilog="balancer options (--balancer-opt KEY=VALUE):\n" + options_text(),
        formatter_class=PlanHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--lengths",
        help="text file with one token count per line; a JSON-lines file of shared-prompt groups "
        '{"prompt": P, "answers": [a1, ...]} in tokens (one sample with a shared-prompt mask each); or a '
        "saved dataset folder (its 'length' and 'attn_mask' columns; pre-packed rows are planned as their documents)",
    )
    src.add_argument("--plan-json", help="simulate the plan(s) in this JSON file (a plan or a list of plans)")
    p.add_argument(
        "--world",
        type=int,
        help=f"number of ranks (a power of two, or any number up to one node's GPUs; at most {MAX_WORLD_SIZE:,}); "
        "taken from the plan with --plan-json",
    )
    p.add_argument(
        "--max-tokens-per-rank",
        type=int,
        default=PlanningSettings.default("max_tokens_per_rank"),
        help="memory cap per rank, in tokens",
    )
    tps = p.add_mutually_exclusive_group()
    tps.add_argument("--tokens-per-step", type=int, help="tokens in one global batch (all ranks together)")
    tps.add_argument(
        "--tokens-per-rank-per-step",
        type=int,
        default=PlanningSettings.default("tokens_per_rank_per_step"),
        help="tokens per rank in one global batch (global batch = this x world)",
    )
    p.add_argument(
        "--profile",
        default=PlanningSettings.default("profile"),
        help="hardware profile: a profile name (configs/profiles/ here, then built in) or a YAML file",
    )
    p.add_argument(
        "--model",
        default="qwen2.5-7b",
        help="model dimensions: a model name (configs/models/ here, then built in), a config.json, or a model folder",
    )
    p.add_argument(
        "--vision-model",
        metavar="CONFIG",
        help='vision tower dimensions, for samples with images or clips (a lengths record\'s "vision" grids, a '
        "dataset's image_grid_thw / video_grid_thw): a vision-language model's config.json, folder or name "
        "(default: the vision_config of --model's config, when it has one)",
    )
    p.add_argument(
        "--balancer",
        default=PlanningSettings.default("balancer"),
        help=f"balancer name; built in: {', '.join(available_balancers())}",
    )
    p.add_argument(
        "--balancer-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the balancer (repeatable; VALUE is read as YAML: 0.05, true, [1, 2]); the same "
        "options as training.cp_balancer_options in a training config; auto's members take theirs as "
        "member_options.NAME.KEY=VALUE. Each balancer's options are listed below and by --list-balancer-options",
    )
    p.add_argument(
        "--list-balancer-options",
        nargs="?",
        const="",
        metavar="BALANCER",
        action=ListBalancerOptions,
        help="print the options of every balancer (or of BALANCER): name, type, default and meaning; then exit",
    )
    p.add_argument(
        "--compare-balancer",
        default=PlanningSettings.default("compare_balancer"),
        help="also plan every step with this balancer and show its predicted step time ('none': off)",
    )
    p.add_argument(
        "--hierarchical",
        action="store_true",
        help="plan host by host (balancer hierarchical, --balancer planning each host's ranks) and report what "
        "each part costs: the first pass that splits the step over the hosts, the slowest host's planning CPU, "
        "and the plan against --balancer planning the whole world flat",
    )
    p.add_argument(
        "--host-ranks",
        type=int,
        help="with --hierarchical: ranks one host plans (a power of two; default: --gpus-per-node)",
    )
    p.add_argument("--steps", type=int, default=10, help="number of steps to plan (from the start of the epoch)")
    p.add_argument("--seed", type=int, default=PlanningSettings.default("seed"), help="shuffle seed of the epoch order")
    p.add_argument("--no-shuffle", action="store_true", help="keep the file's sample order")
    p.add_argument(
        "--execution",
        default="compute",
        choices=["compute", *EXECUTIONS],
        help="price plans by the plan's compute alone (compute), or by the step's wall time under this "
        "execution: zero2 (every wave ends in a gradient reduction over all ranks, as DeepSpeed ZeRO-2 "
        "runs it; zero2-overlap with overlap_comm), zero3 and fsdp2 (parameters sharded too: every forward "
        "all-gathers them, every backward all-gathers them again and reduce-scatters the gradients, "
        "overlapped with compute), ddp (one reduction per step); adds dummy micro-batches (passes), "
        "reductions and the profile's reduction_overhead_ms / step_overhead_ms (the lower bound stays compute)",
    )
    p.add_argument(
        "--device-memory-gb",
        type=float,
        help="memory of one device in GB, for the largest model each engine (ZeRO-2, ZeRO-3, FSDP2) fits at the "
        "cap (default: the profile's device_memory_gb)",
    )
    p.add_argument("--gpus-per-node", type=int, help="ranks per node (default: the profile's)")
    p.add_argument("--max-group-size", type=int, help="largest CP group a plan may use (default: the world)")
    p.add_argument(
        "--pipeline-stages",
        type=int,
        metavar="P",
        help="also print the 1F1B pipeline bubble of each step's micro-batches on P stages: packs of the samples "
        "(variable costs) against ChunkFlow's equal chunks",
    )
    p.add_argument(
        "--chunk-size",
        type=int,
        default=PlanningSettings.default("chunk_size"),
        help="ChunkFlow: most tokens of a dependent chunk (balancer chunkflow, auto's chunkflow member, "
        "--pipeline-stages); default: the cap / --chunk-keep",
    )
    p.add_argument(
        "--chunk-keep",
        type=int,
        default=PlanningSettings.default("chunk_keep"),
        help="ChunkFlow: K, dependent chunks whose activations are kept (the rest are recomputed)",
    )
    p.add_argument("--json", metavar="OUT", help="write the plans and per-step metrics as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="draw one step's per-rank timeline")
    p.add_argument("--plot-step", type=int, default=0, help="which planned step --plot draws")
    p.add_argument(
        "--progress",
        choices=("auto", "on", "off"),
        default="auto",
        help=f"report progress on stderr (reading, batching, a bar over the planned steps); auto: for inputs of "
        f"{PROGRESS_MIN_SAMPLES:,} samples or more, where planning takes seconds per step",
    )
    p.set_defaults(func=run)


def options_text(names: Optional[List[str]] = None) -> str:
    """Every option of each balancer (describe_options): a line per balancer, then one per option."""
    lines = []
    for name in names if names is not None else available_balancers():
        opts = describe_options(name)
        lines.append(f"{name}:" + ("" if opts else " no options"))
        lines += [f"  {o.line()}" for o in opts]
    return "\n".join(lines)


class PlanHelpFormatter(HelpFormatter):
    """Keeps the line breaks of the description and epilog (the options list), wrapping each line."""

    def _fill_text(self, text, width, indent):
        out = []
        for line in text.splitlines():
            depth = len(line) - len(line.lstrip())
            lead = indent + " " * depth
            more = lead + ("    " if depth else "")  # an option's help runs on under its name
            out.append(textwrap.fill(line.strip(), width, initial_indent=lead, subsequent_indent=more))
        return "\n".join(out)


class ListBalancerOptions(argparse.Action):
    """--list-balancer-options [BALANCER]: print the options and exit (like --help)."""

    def __call__(self, parser, namespace, values, option_string=None):
        names = available_balancers()
        if values and values not in names:
            parser.error(f"unknown balancer {values!r}; available: {', '.join(names)}")
        print(options_text([values] if values else None))
        parser.exit()


# from this many samples on, `--progress auto` reports progress (a 1M-line trace plans for 10-20 s)
PROGRESS_MIN_SAMPLES = 100_000


class Progress:
    """Stage lines and a bar over planned steps, on stderr (stdout keeps the report)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.t0 = time.perf_counter()

    def say(self, text: str) -> None:
        if self.enabled:
            print(f"[{time.perf_counter() - self.t0:6.1f} s] {text}", file=sys.stderr, flush=True)

    def steps(self, n: int, desc: str):
        from tqdm import tqdm

        return tqdm(range(n), desc=desc, unit="step", file=sys.stderr, disable=not self.enabled, leave=False)


def step_metrics(
    plan: StepPlan,
    sim: SimResult,
    lb: float,
    planner_ms: Tuple[float, float],
    compare_ms: Optional[float] = None,
    ring_zigzag_bytes: Optional[int] = None,
) -> dict:
    return {
        "step": plan.step,
        "samples": len(plan.sample_ids),
        "tokens": plan.total_tokens,
        "predicted_ms": sim.makespan_ms,
        "lower_bound_ms": lb,
        "ratio_to_bound": sim.makespan_ms / lb if lb > 0 else float("nan"),
        "max_over_mean": sim.imbalance,
        "idle_share": sim.idle_share,
        "comm_bytes": sim.comm_bytes,
        "cp_size_samples": sim.cp_size_samples,
        "peak_tokens": max(sim.peak_tokens),
        "peak_memory_gb": max(sim.peak_memory_bytes) / 1e9,
        "waves": len(plan.waves),
        "planner_ms": planner_ms[0],
        "planner_cpu_ms": planner_ms[1],
        "compare_ms": compare_ms,
        "charged_bound_ms": sim.charged_bound_ms,
        "ring_zigzag_comm_bytes": ring_zigzag_bytes,
        "flags": sim.flags,
    }


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.1f}"


def _gb(v: Optional[int]) -> str:
    return "-" if v is None else f"{v / 1e9:.2f}"


def _hist(c: dict) -> str:
    return " ".join(f"{g}:{n}" for g, n in sorted(c.items()))


def print_report(rows: List[dict], header: str, cap: int, compare: Optional[str] = None) -> None:
    print(header)
    cols = (
        f"{'step':>5} {'samples':>7} {'tokens':>9} {'pred ms':>10} {'bound ms':>10} {'charged':>10} {'ratio':>6} "
        f"{'max/mean':>8} {'idle%':>6} {'comm GB':>8} {'ring GB':>8} {'peak tok':>8} {'mem GB':>7} {'plan wall':>9} {'plan CPU':>8}  "
        f"cp-size:samples"
    )
    print(cols)
    print("-" * len(cols))
    for r in rows:
        print(
            f"{r['step']:>5} {r['samples']:>7} {r['tokens']:>9} {r['predicted_ms']:>10.1f} {r['lower_bound_ms']:>10.1f} "
            f"{_ms(r['charged_bound_ms']):>10} {r['ratio_to_bound']:>6.3f} {r['max_over_mean']:>8.3f} "
            f"{100 * r['idle_share']:>6.1f} {r['comm_bytes'] / 1e9:>8.2f} {_gb(r['ring_zigzag_comm_bytes']):>8} "
            f"{r['peak_tokens']:>8} {r['peak_memory_gb']:>7.1f} {r['planner_ms']:>9.1f} {r['planner_cpu_ms']:>8.1f}  "
            f"{_hist(r['cp_size_samples'])}"
        )
    print("-" * len(cols))
    tot_pred = sum(r["predicted_ms"] for r in rows)
    tot_lb = sum(r["lower_bound_ms"] for r in rows)
    hist: Counter = Counter()
    for r in rows:
        hist.update(r["cp_size_samples"])
    charged = [r["charged_bound_ms"] for r in rows]
    tot_charged = sum(charged) if all(c is not None for c in charged) else None
    rings = [r["ring_zigzag_comm_bytes"] for r in rows]
    tot_ring = sum(rings) if all(b is not None for b in rings) else None
    print(
        f"{'all':>5} {sum(r['samples'] for r in rows):>7} {sum(r['tokens'] for r in rows):>9} {tot_pred:>10.1f} "
        f"{tot_lb:>10.1f} {_ms(tot_charged):>10} {tot_pred / tot_lb if tot_lb else float('nan'):>6.3f} "
        f"{statistics.mean(r['max_over_mean'] for r in rows):>8.3f} "
        f"{100 * statistics.mean(r['idle_share'] for r in rows):>6.1f} "
        f"{sum(r['comm_bytes'] for r in rows) / 1e9:>8.2f} {_gb(tot_ring):>8} {max(r['peak_tokens'] for r in rows):>8} "
        f"{max(r['peak_memory_gb'] for r in rows):>7.1f} {statistics.median(r['planner_ms'] for r in rows):>9.1f} "
        f"{statistics.median(r['planner_cpu_ms'] for r in rows):>8.1f}  "
        f"{_hist(hist)}"
    )
    print(
        f"predicted time / lower bound over {len(rows)} steps: {tot_pred / tot_lb:.3f}; peak tokens per rank "
        f"{max(r['peak_tokens'] for r in rows)} of cap {cap}; planner median {statistics.median(r['planner_ms'] for r in rows):.1f} "
        f"ms wall, {statistics.median(r['planner_cpu_ms'] for r in rows):.1f} ms CPU (this process's)"
    )
    if tot_charged:
        print(
            f"predicted time / charged bound (a group's communication and kernel efficiency charged too): "
            f"{tot_pred / tot_charged:.3f}"
        )
    for r in rows:
        for flag in r["flags"]:
            print(f"step {r['step']}: {flag}")
    if compare and all(r.get("compare_ms") is not None for r in rows):
        theirs = sum(r["compare_ms"] for r in rows)
        print(
            f"comparison: {compare} would take {theirs:.1f} ms over these steps, {theirs / tot_pred:.3f}x the "
            f"plans above ({theirs / tot_lb if tot_lb else float('nan'):.3f}x the bound)"
        )


def text_only_ms(planner: Planner, steps: int, balancer) -> float:
    """The first `steps` steps' predicted time when `balancer` plans them with the vision tower
    unpriced (each sample's LLM tokens only, as planners did before vision pricing), each plan
    fitted to the vision memory (fit_vision_memory, as every plan is) and simulated with its
    vision work: what pricing the encoder gains."""
    total = 0.0
    for k in range(steps):
        req = planner.request(planner.sampler[k])
        plan = balancer.plan(dataclasses.replace(req, vision=None))
        plan.vision = dict(req.vision or {})
        total += simulate(fit_vision_memory(plan, req), req.cost, req.cluster).makespan_ms
    return total


def print_hierarchy(planner: Planner, planned: List, reports: List, member: str) -> None:
    """--hierarchical: per step, what the first pass and the slowest host cost, and the plan
    against `member` planning the whole world flat (planned here, on the same request)."""
    print(f"hierarchical planning (each host planned by {member}) against {member} planning the world flat:")
    cols = (
        f"{'step':>5} {'hosts':>6} {'first pass CPU':>14} {'slowest host CPU':>16} {'median host CPU':>15} "
        f"{'spread':>6} {'pred ms':>10} {'flat pred ms':>12} {'vs flat':>8} {'flat CPU':>9}"
    )
    print(cols)
    print("-" * len(cols))
    totals = [0.0, 0.0]
    worst = (0.0, 0.0)
    for ps, rep in zip(planned, reports):
        if rep is None:  # a world of one host: planned flat
            print(f"{ps.plan.step:>5} {'1':>6}  (the world is one host: planned flat by {member})")
            continue
        req = planner.request(ps.batch)
        c0 = time.process_time()
        flat = fitted_plan(planner.balancer.member, req)
        flat_cpu = (time.process_time() - c0) * 1e3
        flat_ms = predict(flat, req).makespan_ms
        mine = ps.predicted.makespan_ms
        totals[0] += mine
        totals[1] += flat_ms
        host, slowest = rep.slowest_host()
        worst = max(worst, (rep.first_pass_ms + slowest, mine))
        print(
            f"{ps.plan.step:>5} {rep.hosts:>6} {rep.first_pass_ms:>11.1f} ms {slowest:>9.1f} ms (h{host}) "
            f"{float(statistics.median(rep.host_total_ms())):>12.1f} ms {rep.spread_samples:>6} {mine:>10.1f} "
            f"{flat_ms:>12.1f} {mine / flat_ms:>8.4f} {flat_cpu:>6.1f} ms"
        )
    if totals[1]:
        print(
            f"hierarchical / flat over these steps: {totals[0] / totals[1]:.4f}; first pass + slowest host at worst "
            f"{worst[0]:.1f} ms CPU, {100 * worst[0] / worst[1]:.2f}% of its step"
        )


def print_pipeline(plans: List[StepPlan], cost: CostModel, cluster: ClusterSpec, stages: int, settings) -> None:
    """The 1F1B bubble a pipeline of `stages` stages would pay on each step's micro-batches: the
    step's samples packed to the per-rank cap as a pipeline user packs them (variable costs: the
    attention of long documents), against ChunkFlow's chunks of the same samples (nearly equal
    costs). Micro-batches are dealt to the world / stages data-parallel pipelines in turn."""

    if stages < 1:
        raise ValueError(f"--pipeline-stages must be at least 1, got {stages}")
    replicas = max(1, cluster.world_size // stages)
    cap = cluster.max_tokens_per_rank
    keep = settings.chunk_keep if settings is not None else 1
    chunk = (settings.chunk_size if settings is not None else None) or cap // keep
    overhead = cost.micro_batch_overhead_ms()

    def mean_bubble(costs: List[float]) -> float:
        shares = [costs[i::replicas] for i in range(replicas)]
        return statistics.mean(bubble_share(c, stages) for c in shares if c)

    print(
        f"pipeline of {stages} stages x {replicas} data-parallel pipeline(s), 1F1B (backward = 2 x forward): "
        f"bubble share of each step's micro-batches"
    )
    print(f"{'step':>5} {'packs':>6} {'bubble':>7}   {'chunks':>6} {'bubble':>7}  (ChunkFlow, chunk {chunk}, K={keep})")
    for p in plans:
        lens = p.length_of()
        fits = [(s, n) for s, n in zip(p.sample_ids, p.lengths) if n <= cap]
        # a sample over the cap is a micro-batch of its own (a pipeline alone cannot hold it)
        packs = first_fit([s for s, _ in fits], [n for _, n in fits], cap) if fits else []
        packs += [[s] for s, n in zip(p.sample_ids, p.lengths) if n > cap]
        pack_costs = [cost.local_ms([lens[s] for s in pack]) + overhead for pack in packs]
        chunk_costs = chunk_costs_ms(build_chunk_plan(p.sample_ids, p.lengths, chunk, keep), cost)
        print(
            f"{p.step:>5} {len(packs):>6} {100 * mean_bubble(pack_costs):>6.1f}%   {len(chunk_costs):>6} "
            f"{100 * mean_bubble(chunk_costs):>6.1f}%"
        )


def print_memory(cost: CostModel, cluster: ClusterSpec, device_memory_gb: Optional[float]) -> None:
    """One rank's peak memory at the cap under ZeRO-2, ZeRO-3 and FSDP2 for the model, and the
    largest model each fits in the device's memory (planning.setup.engine_memory). hf-cp plan
    knows no run's precision: half precision when the profile's elements are 2 bytes."""
    device = cost.profile.device_memory_gb if device_memory_gb is None else device_memory_gb
    half = cost.profile.bytes_per_element == 2
    world, cap = cluster.world_size, cluster.max_tokens_per_rank
    rows = engine_memory(cost.dims, cost.profile, world, cap, half, device_memory_gb=device)
    for line in engine_memory_lines(rows, world, cap, half, device):
        print(line)


def balancer_options(items: List[str]) -> dict:
    """--balancer-opt KEY=VALUE items -> options (values read as YAML; dotted keys nest:
    member_options.wlb.fill=0.8)."""
    return parse_assignments(items)


def settings_from_args(args) -> PlanningSettings:
    """The CLI's options as the planning settings the trainer and the dry run use."""
    compare = args.compare_balancer
    name, options = args.balancer, balancer_options(args.balancer_opt)
    if args.hierarchical:
        if name == "hierarchical":
            raise ValueError("--hierarchical plans with --balancer on each host: give the hosts' balancer, e.g. auto")
        hosts = {"host_ranks": args.host_ranks} if args.host_ranks else {}
        name, options = "hierarchical", {"member": name, "member_options": options, **hosts}
    elif args.host_ranks:
        raise ValueError("--host-ranks is an option of --hierarchical")
    return PlanningSettings(
        balancer=name,
        balancer_options=options,
        compare_balancer=None if not compare or str(compare).lower() == "none" else compare,
        profile=args.profile,
        model_dims=args.model,
        max_tokens_per_rank=args.max_tokens_per_rank,
        tokens_per_step=args.tokens_per_step,
        tokens_per_rank_per_step=args.tokens_per_rank_per_step,
        max_group_size=args.max_group_size,
        gpus_per_node=args.gpus_per_node,
        chunk_size=args.chunk_size,
        chunk_keep=args.chunk_keep,
        seed=args.seed,
        shuffle=not args.no_shuffle,
        execution=args.execution,
    )


def _replan(args) -> Tuple[List[StepPlan], ClusterSpec, CostModel, str]:
    """--plan-json: plans made elsewhere, to simulate again."""
    cost = CostModel(
        ModelDims.load(args.model),
        load_profile(args.profile),
        execution_named(args.execution),
        vision_dims_of(args, True),
    )
    plans = StepPlan.load_file(args.plan_json)  # read and checked, errors naming the file and plan
    world = plans[0].world_size
    if args.world and args.world != world:
        raise PlanError(f"--world {args.world} disagrees with the world_size {world} of {args.plan_json}")
    gpus = args.gpus_per_node or load_profile(args.profile).gpus_per_node
    # plans made with any_size_groups (dynamic_cp's option) use groups that are not aligned
    # blocks, and so may the plans for a world of one node that is not a power of two
    unaligned = (not is_power_of_two(world) and world <= gpus) or any(
        len(g.ranks) & (len(g.ranks) - 1) or g.ranks[0] % len(g.ranks) for p in plans for w in p.waves for g in w.groups
    )
    try:
        cluster = ClusterSpec(world, plans[0].max_tokens_per_rank, gpus, args.max_group_size, any_size_groups=unaligned)
    except ValueError as e:
        raise PlanError(f"{args.plan_json}: {e}") from None
    return plans, cluster, cost, f"simulated {len(plans)} plan(s) from {args.plan_json}"


def vision_dims_of(args, needed: bool) -> Optional[VisionDims]:
    """--vision-model's tower, else, when samples have images or clips (`needed`), --model's
    vision_config (None: neither gives one)."""
    if args.vision_model:
        return VisionDims.load(args.vision_model)
    return vision_dims_in(args.model) if needed else None


def checked_vision(inputs: PlanInputs, cost: CostModel, args) -> Dict[int, SampleGrids]:
    """The inputs' vision grids, checked against the tower's merge size and the samples'
    lengths; samples with grids but no tower to price them are refused by name."""
    if not inputs.vision:
        return {}
    first = min(inputs.vision)
    if cost.vision is None:
        raise ValueError(
            f"{args.lengths}: {len(inputs.vision)} samples have vision grids (the first, sample {first}, "
            f"{[list(g) for g in inputs.vision[first]]}), but model {args.model} has no vision tower to price them: give "
            "--vision-model CONFIG.json (a vision-language model's config, e.g. Qwen2.5-VL's) or a --model with a "
            "vision_config"
        )
    return check_grids(
        inputs.vision,
        dict(enumerate(inputs.lengths)),
        cost.vision.spatial_merge_size,
        label=lambda i: f"{args.lengths}: sample {i} (record {i + 1})",
    )


# the most tokens a token-count option may give: counts stay exact in the cost model's floats
MAX_TOKENS = 2**53


def check_args(args) -> None:
    """Every numeric option in its range, refused by its flag before anything is read or planned
    (ValueError: `hf-cp plan: error: --world 1048576: ...`)."""

    def whole(flag: str, v: Optional[int], lo: int, hi: int, what: str = "") -> None:
        if v is not None and not lo <= v <= hi:
            raise ValueError(f"{flag} {v}: must be from {lo:,} to {hi:,}{what}")

    if args.world is not None:
        whole("--world", args.world, 1, MAX_WORLD_SIZE, " ranks (the most hf_cp plans for)")
    for flag, key in (
        ("--max-tokens-per-rank", "max_tokens_per_rank"),
        ("--tokens-per-step", "tokens_per_step"),
        ("--tokens-per-rank-per-step", "tokens_per_rank_per_step"),
        ("--chunk-size", "chunk_size"),
    ):
        whole(flag, getattr(args, key), 1, MAX_TOKENS, " tokens")
    whole("--steps", args.steps, 1, 2**31 - 1)
    whole("--seed", args.seed, 0, 2**32 - 1, " (numpy's seed range)")
    whole("--gpus-per-node", args.gpus_per_node, 1, int(PROFILE_MAXIMA["gpus_per_node"][0]), " ranks per node")
    whole("--max-group-size", args.max_group_size, 1, MAX_WORLD_SIZE, " ranks")
    whole("--host-ranks", args.host_ranks, 1, MAX_WORLD_SIZE, " ranks")
    whole("--pipeline-stages", args.pipeline_stages, 1, MAX_WORLD_SIZE, " stages")
    whole("--chunk-keep", args.chunk_keep, 1, MAX_TOKENS, " chunks")
    whole("--plot-step", args.plot_step, 0, 2**31 - 1)
    gb = args.device_memory_gb
    top = PROFILE_MAXIMA["device_memory_gb"][0]
    if gb is not None and not (math.isfinite(gb) and 0 <= gb <= top):
        raise ValueError(f"--device-memory-gb {gb:g}: must be a number of GB from 0 (unknown) to {top:g}")


FINITE_METRICS = (
    "predicted_ms",
    "lower_bound_ms",
    "ratio_to_bound",
    "max_over_mean",
    "idle_share",
    "peak_memory_gb",
    "charged_bound_ms",
    "compare_ms",
)


def check_finite(rows: List[dict], args) -> None:
    """No report or JSON with inf or nan in it: a metric that is not a finite number means the
    model's or the profile's numbers are beyond what the cost model computes in (PlanError)."""
    for r in rows:
        for key in FINITE_METRICS:
            v = r.get(key)
            if v is not None and not math.isfinite(v):
                raise PlanError(
                    f"step {r['step']}: the predicted {key} is {v}, not a finite number, for model {args.model} on "
                    f"profile {args.profile}: their numbers are out of the range the cost model computes in"
                )


def run(args) -> int:
    check_args(args)
    compare_ms: List[Optional[float]] = []
    if args.plan_json:
        plans, cluster, cost, header = _replan(args)
        planner_ms = [(0.0, 0.0)] * len(plans)
        sims = []
        for i, plan in enumerate(plans):
            try:
                plan.validate(cluster, cost)
            except PlanError as e:
                raise PlanError(f"{args.plan_json}[{i}]: {e}") from None
            sims.append(simulate(plan, cost, cluster))
        compare_ms = [None] * len(plans)
    else:
        if not args.world:
            raise ValueError("--world is required with --lengths")
        settings = settings_from_args(args)
        progress = Progress(args.progress == "on")
        progress.say(f"reading lengths from {args.lengths}")
        inputs = read_plan_inputs(args.lengths)
        lengths, masks = inputs.lengths, inputs.masks
        progress.enabled = args.progress == "on" or (args.progress == "auto" and len(lengths) >= PROGRESS_MIN_SAMPLES)
        progress.say(f"{len(lengths):,} samples; cutting the epoch into steps of the token budget")
        setup = planning_setup(settings, lengths, args.world, vision=vision_dims_of(args, bool(inputs.vision)))
        cluster, cost = setup.cluster, setup.cost
        vision = checked_vision(inputs, cost, args)
        longest = max(lengths)
        # the longest sample the balancer trains (longer under chunkflow)
        check_sample_lengths(
            setup.balancer(),
            range(len(lengths)),
            lengths,
            cluster,
            cost,
            args.balancer,
            masks or (),
            label=lambda i: f"sample {i} (line {i + 1} of {args.lengths})",
        )
        planner = Planner.from_setup(setup, lookahead=0, masks=masks, vision=vision)
        steps = min(args.steps, len(setup.sampler.epoch_batches(0)))
        what = f"planning with {args.balancer}" + (f" (and {planner.compare_name})" if planner.compare_name else "")
        progress.say(f"{len(setup.sampler.epoch_batches(0)):,} steps in the epoch; {what}")
        # the epoch's first steps, as training plans them
        planned, reports = [], []
        for k in progress.steps(steps, "planning steps"):
            planned.append(planner.get(k))
            reports.append(getattr(planner.balancer, "last_report", None))
        progress.say("simulating and reporting")
        plans = [ps.plan for ps in planned]
        sims = [ps.predicted for ps in planned]
        planner_ms = [(ps.planner_ms, ps.planner_cpu_ms) for ps in planned]
        compare_ms = [ps.compare.makespan_ms if ps.compare is not None else None for ps in planned]
        opts = "".join(f" {k}={v}" for k, v in settings.balancer_options.items())
        header = (
            f"hf-cp plan: {args.lengths} ({len(lengths)} samples, longest {longest}"
            + (f"; {inputs.describe()}" if masks or vision or inputs.kind not in ("lengths", "dataset") else "")
            + f"), balancer {settings.balancer}{opts}, world {args.world}, cap {cluster.max_tokens_per_rank} tokens/rank, "
            f"{setup.sampler.tokens_per_step} tokens/step, model {args.model}, profile {args.profile}"
            + (f"; layer mix priced: {cost.dims.layer_mix()}" if cost.dims.softmax_share < 1 else "")
            + (f"; vision tower priced: {cost.vision.depth} blocks, hidden {cost.vision.hidden}" if vision else "")
        )
    rows = []
    for plan, sim, pms, cms in zip(plans, sims, planner_ms, compare_ms):
        # masked samples (shared prompts, windows) bound by their masked area, as they are simulated
        masks_of = [plan.masks.get(s) for s in plan.sample_ids] if plan.masks else None
        ring = sum(e.ring_zigzag_bytes for e in plan_exchange(plan, cost))  # the same groups, ring zigzag
        bound = lower_bound_ms(
            plan.lengths, cluster, cost, masks_of, vision=step_vision(plan.sample_ids, plan.vision, cost)
        )
        rows.append(step_metrics(plan, sim, bound, pms, cms, ring))
    check_finite(rows, args)
    compare = None if args.plan_json else settings.compare_balancer
    print_report(rows, header, cluster.max_tokens_per_rank, compare)
    if not args.plan_json and vision:
        mine, theirs = sum(r["predicted_ms"] for r in rows), text_only_ms(planner, len(rows), setup.balancer())
        print(
            f"vision pricing: {settings.balancer} planning these steps with the vision tower unpriced (LLM tokens "
            f"only) would take {theirs:.1f} ms, {theirs / mine:.3f}x the plans above"
        )
    if not args.plan_json and args.hierarchical:
        print_hierarchy(planner, planned, reports, args.balancer)
    print_memory(cost, cluster, args.device_memory_gb)
    if args.pipeline_stages:
        print_pipeline(plans, cost, cluster, args.pipeline_stages, settings_from_args(args) if args.lengths else None)
    if args.json:
        out = {"plans": [p.to_dict() for p in plans], "metrics": rows}
        Path(args.json).write_text(json.dumps(out, sort_keys=True, separators=(",", ":"), allow_nan=False))
        print(f"wrote {len(plans)} plans and metrics to {args.json}")
    if args.plot:
        from hf_cp.report.timeline import plot_timeline  # matplotlib, only with --plot

        k = args.plot_step
        if not 0 <= k < len(plans):
            raise ValueError(f"--plot-step {k}: only {len(plans)} steps were planned")
        r = rows[k]
        title = (
            f"step {k}, {plans[k].balancer or 'plan'}: {r['predicted_ms']:.0f} ms (bound {r['lower_bound_ms']:.0f}, "
            f"x{r['ratio_to_bound']:.2f}), max/mean {r['max_over_mean']:.3f}"
        )
        plot_timeline(sims[k], args.plot, title)
        print(f"wrote timeline of step {k} to {args.plot}")
    return 0
