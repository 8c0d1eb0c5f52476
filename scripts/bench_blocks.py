#!/usr/bin/env python
"""Bytes moved and predicted attention time of one CP group's micro-batches under ring zigzag,
ring per-document and the block engine (the same geometries as blocks, and its default
placement), on a causal long-document trace, the shared-prompt trace and a sliding window.
Prints the table and writes it as markdown (default benchmarks/blocks.md).

Example (~1 minute on 2 cores):
    python scripts/bench_blocks.py
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACES = REPO / "benchmarks" / "traces"  # committed with the repository
sys.path.insert(0, str(REPO))

from hf_cp.cost.blocks import block_group_costs, default_layout  # noqa: E402
from hf_cp.cost.model import CostModel  # noqa: E402
from hf_cp.modes.segments import ShardMode  # noqa: E402
from hf_cp.plan.block_layout import doc_slices, per_doc_layout, ring_kv_transfers, zigzag_layout  # noqa: E402
from hf_cp.samples.masks import SampleMask  # noqa: E402

MODES = ("ring_zigzag", "ring_per_doc", "blocks_zigzag", "blocks_per_doc", "blocks_default")


def shown(path: Path) -> str:
    """`path` as the report names it: relative to the repository when inside it."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--traces-dir", default=str(DEFAULT_TRACES))
    p.add_argument("--cp", default="4,8", help="comma-separated CP group sizes")
    p.add_argument("--tokens-per-rank", type=int, default=16384, help="a micro-batch holds cp x this many tokens")
    p.add_argument("--micro-batches", type=int, default=12, help="micro-batches per workload (trace order)")
    p.add_argument("--window", type=int, default=4096, help="sliding window of the sliding-window workload")
    p.add_argument("--profile", default="h200-qwen2.5-7b")
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "blocks.md"), help="markdown output ('-' for none)")
    return p.parse_args(argv)


def workloads(traces: Path, window: int) -> Dict[str, List[Tuple[int, Optional[SampleMask]]]]:
    longdoc = [int(x) for x in (traces / "longdoc_leval_multiturn.txt").read_text().split()]
    shared = []
    for line in (traces / "shared_prompt_alpaca_eval_n8.jsonl").read_text().splitlines():
        r = json.loads(line)
        m = SampleMask.shared_prompt(r["prompt"], r["answers"])
        shared.append((m.length, m))
    return {
        "longdoc causal": [(n, None) for n in longdoc],
        "shared prompt n8": shared,
        f"longdoc, sliding window {window}": [
            (n, SampleMask.sliding_window(n, window) if n > window else None) for n in longdoc
        ],
    }


def pack(samples, capacity: int, count: int):
    """Greedy packing in trace order into micro-batches of at most `capacity` tokens."""
    out, cur, used = [], [], 0
    for n, m in samples:
        n = min(n, capacity)
        if m is not None and m.length != n:
            continue  # a masked sample longer than a micro-batch: left out rather than cut
        if used + n > capacity and cur:
            out.append(cur)
            cur, used = [], 0
            if len(out) == count:
                break
        cur.append((n, m))
        used += n
    if cur and len(out) < count:
        out.append(cur)
    return out


def measure(batch, g: int, cost: CostModel) -> Dict[str, Tuple[int, float, float]]:
    """mode -> (bytes, attention ms of the slowest member, micro-batch ms of the slowest member)."""
    lengths = [n for n, _ in batch]
    masks = [m for _, m in batch]
    ranks = list(range(g))
    L = cost.dims.num_layers

    def linear(tokens):
        return L * cost.c1 * tokens + cost.head_ms_per_token * tokens

    def summary(costs):
        return (
            sum(c.comm_bytes for c in costs),
            max(c.total_ms - linear(c.tokens) for c in costs),
            max(c.total_ms for c in costs),
        )

    out = {}
    for mode in (ShardMode.RING_ZIGZAG, ShardMode.RING_PER_DOC):
        out[mode.value] = summary([cost.distributed_rank_cost(lengths, mode, ranks, m, masks=masks) for m in ranks])
    slices = doc_slices(lengths, masks)
    h = cost.dims.num_heads
    for name, lay in (
        ("blocks_zigzag", zigzag_layout(lengths, g, h, slices)),
        ("blocks_per_doc", per_doc_layout(lengths, g, h, slices)),
        ("blocks_default", default_layout(lengths, ranks, cost, masks)),
    ):
        out[name] = summary(block_group_costs(lay, lengths, ranks, cost, masks))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    cost = CostModel.load(args.model, args.profile)
    cps = [int(x) for x in args.cp.split(",")]
    rows = []
    for wname, samples in workloads(Path(args.traces_dir), args.window).items():
        for g in cps:
            batches = pack(samples, g * args.tokens_per_rank, args.micro_batches)
            tot = {m: [0, 0.0, 0.0] for m in MODES}
            for b in batches:
                for m, (nb, attn, step) in measure(b, g, cost).items():
                    tot[m][0] += nb
                    tot[m][1] += attn
                    tot[m][2] += step
            base = tot["ring_zigzag"]
            best_fixed = min(tot["ring_zigzag"][1], tot["ring_per_doc"][1])
            for m in MODES:
                nb, attn, step = tot[m]
                rows.append(
                    dict(
                        workload=wname,
                        cp=g,
                        mode=m,
                        micro_batches=len(batches),
                        samples=sum(len(b) for b in batches),
                        gb=nb / len(batches) / 1e9,
                        bytes_vs_zigzag=base[0] / nb if nb else float("inf"),
                        attn_ms=attn / len(batches),
                        attn_vs_best_ring=best_fixed / attn,
                        step_ms=step / len(batches),
                    )
                )
    header = (
        "| workload | CP | mode | GB moved / micro-batch | ring zigzag bytes / these | attention ms | "
        "best ring attention / this | micro-batch ms |"
    )
    lines = [header, "|" + "---|" * 8]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['cp']} | {r['mode']} | {r['gb']:.3f} | {r['bytes_vs_zigzag']:.2f}x | "
            f"{r['attn_ms']:.1f} | {r['attn_vs_best_ring']:.2f}x | {r['step_ms']:.1f} |"
        )
    table = "\n".join(lines)
    transfers = ["| CP | engine (zigzag as blocks) | ring zigzag |", "|---|---|---|"]
    for g in cps:
        lay = zigzag_layout([2 * g * 1024], g, cost.dims.num_heads)
        transfers.append(f"| {g} | {lay.kv_transfers()} | {ring_kv_transfers(lay, g)} |")
    table += (
        "\n\nK/V chunk sends per layer and forward pass, one causal document in 2g zigzag chunks "
        "(block_plan.BlockLayout.kv_transfers; the executor's real sends equal it at CP 4 in "
        "tests/test_attention_engine.py):\n\n" + "\n".join(transfers)
    )
    print(table)
    if args.out != "-":
        cmd = "python scripts/bench_blocks.py" + (" " + shlex.join(argv) if argv else "")
        counts = sorted({(r["workload"], r["cp"], r["micro_batches"], r["samples"]) for r in rows})
        text = (
            "# Block engine against ring attention: bytes moved and predicted attention time\n\n"
            f"Made by:\n\n    {cmd}\n\n"
            f"Scenario: cost model {args.model} on {args.profile} (hf_cp.cost.model / hf_cp.cost.blocks), one CP group "
            f"(intra-node link) per micro-batch, micro-batches of CP x {args.tokens_per_rank} tokens packed "
            f"greedily in trace order from {shown(Path(args.traces_dir))} (the first "
            f"{args.micro_batches} per workload). Sliding-window workload: every sample of the long-document trace "
            f"with a sliding-window mask of {args.window} tokens (a model whose layers all slide, as sample masks).\n\n"
            "Modes: `ring_zigzag` / `ring_per_doc`: the ring modes (every K/V block travels g-1 hops, fwd and bwd); "
            "`blocks_zigzag` / `blocks_per_doc`: the same geometries as block plans (each K/V chunk only to the "
            "members that run a block needing it, all-to-all-v); `blocks_default`: whichever of the two the cost "
            "model finishes first (block_cost.default_layout; placement solvers come with issue 16).\n\n"
            "Columns: bytes sent by all members per micro-batch (all layers, fwd+bwd); *attention ms* = the slowest "
            "member's micro-batch time less its linear work (attention compute plus exposed communication); "
            "ratios are measured side by side in this run.\n\n"
            + table
            + "\n\nMicro-batches (workload, CP, micro-batches, samples): "
            + "; ".join(f"{w} CP{g}: {n} / {s}" for w, g, n, s in counts)
            + "\n"
        )
        Path(args.out).write_text(text)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
