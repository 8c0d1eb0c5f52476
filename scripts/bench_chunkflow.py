#!/usr/bin/env python
"""ChunkFlow on one rank: peak memory of a training step against sample length at a fixed
ChunkSize, and step time against K, each next to the same sample unchunked, and (time table)
the same sample unchunked on a CP group of 2.

Every point runs one forward+backward of one sample (a Llama-shaped model built from a config,
random weights, fp32, CPU, one thread, chunked LM-head loss) in a fresh process and reports:
- peak RSS above the process after building the model and a warm-up step (ru_maxrss);
- the peak of the bytes autograd holds for backward at once (saved_tensors_hooks accounting,
  storages counted once), i.e. the activations;
- the peak bytes of the K/V state store (values and fp32 gradient accumulators) and the
  cost model's prediction of it (hf_cp.plan.chunks.state_bytes);
- CPU time of the step (process time, one thread: other processes on the machine do not
  inflate it as they do wall time), the fastest of `--repeats` steps for the time table, and
  the cost model's predicted time ratio to the unchunked sample (profile `cpu`, whose c1/c2
  were fitted on this kind of machine);
- the loss, which must equal the unchunked one.

The CP rows run the same step on a CP group of two gloo processes (a torchrun child, one thread
each): each rank holds its shard of the sample (shard.rank_segments: ring zigzag, or Ulysses'
contiguous halves) and runs hf_cp attention under a CP context, as CPTrainer does for a
distributed sample. They report each rank's CPU seconds (process time, gloo's threads
included), all ranks' CPU seconds together, the step's wall time (barrier to barrier), and the
loss summed over the ranks. Every row also reports its wall time: on this shared 2-core machine
wall time depends on the load, CPU time much less.

    python scripts/bench_chunkflow.py                       # both tables, ~10 minutes on 2 cores
    python scripts/bench_chunkflow.py --lengths 2048 4096 --ks 1 2 --k-length 4096   # quick
    python scripts/bench_chunkflow.py --cp-modes       # no CP rows
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

MODEL = dict(
    model_type="llama",
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=1024,
    max_position_embeddings=1 << 20,
)


def build_model():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_cp.attention.interface  # noqa: F401  (registers "hf_cp")

    cfg = dict(MODEL)
    config = AutoConfig.for_model(
        cfg.pop("model_type"), **cfg, use_cache=False, attention_dropout=0.0, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="hf_cp", dtype=torch.float32).train()


def cost_model():
    from hf_cp.cost.dims import ModelDims
    from hf_cp.cost.hardware import HardwareProfile
    from hf_cp.cost.model import CostModel

    return CostModel(ModelDims.from_hf_config(MODEL), HardwareProfile.load("cpu"))


class SavedBytes:
    """Live bytes of the tensors autograd saves for backward (each storage once), and their peak."""

    def __init__(self):
        self.live, self.peak = {}, 0

    def pack(self, t):
        return _Handle(self, t)

    @staticmethod
    def unpack(h):
        return h.t


class _Handle:
    def __init__(self, acct: SavedBytes, t):
        self.acct, self.t = acct, t
        self.key = t.untyped_storage().data_ptr()
        n, refs = acct.live.get(self.key, (t.untyped_storage().nbytes(), 0))
        acct.live[self.key] = (n, refs + 1)
        acct.peak = max(acct.peak, sum(b for b, _ in acct.live.values()))

    def __del__(self):
        n, refs = self.acct.live.get(self.key, (0, 1))
        if refs <= 1:
            self.acct.live.pop(self.key, None)
        else:
            self.acct.live[self.key] = (n, refs - 1)


def measure(length: int, chunk: int, keep: int, repeats: int = 1) -> dict:
    """One training step of a `length`-token sample; chunk 0: unchunked."""
    import torch

    from hf_cp.plan.chunks import dependent_chunk_sizes
    from hf_cp.train.step.chunkflow import ChunkRunStats, SampleChunk, run_chunked_sample, sample_chunks, token_loss
    from hf_cp.train.step.loss import chunkable_head

    torch.set_num_threads(1)
    model = build_model()
    loss_fn = token_loss(chunkable_head(model), loss_chunk_tokens=1024)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MODEL["vocab_size"], (length,), generator=g)
    labels = torch.cat([ids[1:], torch.tensor([-100])])

    def step(n_tokens, stats=None):
        i, t = ids[:n_tokens], labels[:n_tokens]
        if chunk == 0:
            whole = SampleChunk(i[None], t[None], torch.arange(n_tokens)[None])
            loss = loss_fn(model, whole)
            loss.backward()
            return float(loss)
        sizes = dependent_chunk_sizes(n_tokens, min(chunk, n_tokens))
        return float(run_chunked_sample(model, sample_chunks(i, t, sizes), keep, 1.0, loss_fn, stats=stats))

    step(min(256, length))  # warm-up: kernels, allocator, lazy imports
    model.zero_grad(set_to_none=True)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    acct, stats = SavedBytes(), ChunkRunStats()
    t0, w0 = time.process_time(), time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(acct.pack, acct.unpack):
        loss = step(length, stats)
    secs, walls = [time.process_time() - t0], [time.perf_counter() - w0]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grad_norm = float(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None) ** 0.5)
    for _ in range(repeats - 1):  # same work: the high-water mark of memory does not move
        model.zero_grad(set_to_none=True)
        t0, w0 = time.process_time(), time.perf_counter()
        step(length)
        secs.append(time.process_time() - t0)
        walls.append(time.perf_counter() - w0)
    return dict(
        length=length,
        chunk=chunk,
        keep=keep,
        chunks=stats.chunks or 1,
        rss_extra=max(0, peak - base),
        saved_peak=acct.peak,
        store_peak=stats.store_peak_bytes,
        seconds=min(secs),
        wall=min(walls),
        loss=loss,
        grad_norm=grad_norm,
    )


def measure_cp(length: int, mode: str, repeats: int = 1) -> list:
    """One training step of a `length`-token sample, unchunked, on a CP group of all the ranks
    of this torchrun job (one thread each); every rank's numbers, gathered on every rank."""
    import torch
    import torch.distributed as dist

    from hf_cp.attention.context import CPContext, cp_context
    from hf_cp.modes.registry import rank_segments
    from hf_cp.modes.segments import ShardMode
    from hf_cp.train.step.chunkflow import SampleChunk, token_loss
    from hf_cp.train.step.loss import chunkable_head

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))  # as the trainer's registry: a group of its own
    model = build_model()
    loss_fn = token_loss(chunkable_head(model), loss_chunk_tokens=1024)
    g = torch.Generator().manual_seed(1)  # the same sample as measure()
    ids = torch.randint(0, MODEL["vocab_size"], (length,), generator=g)
    labels = torch.cat([ids[1:], torch.tensor([-100])])
    shard_mode = ShardMode(mode)

    def step(n_tokens):
        # this rank's rows of the sample (CPContext's layout), targets shifted over the whole sample
        i, t = ids[:n_tokens], labels[:n_tokens]
        rows = torch.cat(
            [torch.arange(s.start, s.start + s.length) for s in rank_segments(shard_mode, [n_tokens], world, rank)]
        )
        ctx = CPContext(
            group=group,
            group_ranks=tuple(range(world)),
            member=rank,
            mode=shard_mode,
            distributed_lengths=(n_tokens,),
        )
        with cp_context(ctx):
            loss = loss_fn(model, SampleChunk(i[rows][None], t[rows][None], rows[None]))
            loss.backward()
        return loss.detach()

    step(min(256, length))  # warm-up: kernels, allocator, lazy imports, the group's first messages
    model.zero_grad(set_to_none=True)
    acct = SavedBytes()
    secs, walls = [], []
    for k in range(repeats):
        model.zero_grad(set_to_none=True)
        dist.barrier(group)
        t0, w0 = time.process_time(), time.perf_counter()
        if k == 0:
            with torch.autograd.graph.saved_tensors_hooks(acct.pack, acct.unpack):
                loss = step(length)
        else:
            step(length)
        secs.append(time.process_time() - t0)
        dist.barrier(group)  # the step ends when its slowest rank does
        walls.append(time.perf_counter() - w0)
    total = loss.clone()
    dist.all_reduce(total)
    mine = dict(
        rank=rank,
        seconds=min(secs),
        wall=min(walls),
        saved_peak=acct.peak,
        rank_loss=float(loss),
        loss=float(total),
    )
    rows = [None] * world
    dist.all_gather_object(rows, mine)
    dist.destroy_process_group()
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cp_point(length: int, mode: str, repeats: int = 1, ranks: int = 2) -> dict:
    """measure_cp on `ranks` gloo processes (torchrun); the per-rank rows and their summary."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(ranks),
        "--master_port",
        str(_free_port()),
        __file__,
        "--cp-child",
        f"{length},{mode},{repeats}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"CP point {length},{mode} failed (rc {out.returncode}):\n{out.stderr[-4000:]}")
    rows = next(json.loads(line[len("CP_ROWS ") :]) for line in out.stdout.splitlines() if line.startswith("CP_ROWS "))
    return dict(
        ranks=rows,
        seconds=max(r["seconds"] for r in rows),  # per rank: the slower rank's
        cpu_all=sum(r["seconds"] for r in rows),
        wall=max(r["wall"] for r in rows),
        saved_peak=max(r["saved_peak"] for r in rows),
        loss=rows[0]["loss"],
    )


def run_point(length: int, chunk: int, keep: int, repeats: int = 1) -> dict:
    cmd = [sys.executable, __file__, "--child", f"{length},{chunk},{keep},{repeats}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def predicted(length: int, chunk: int, keep: int):
    """(state bytes, compute ms) of the cost model for this point (unchunked: no state)."""
    from hf_cp.plan.chunks import chunked_sample_cost, dependent_chunk_sizes, standalone_chunk_ms

    cost = cost_model()
    if chunk == 0:
        return 0.0, standalone_chunk_ms(cost, [length])
    cc = chunked_sample_cost(cost, dependent_chunk_sizes(length, min(chunk, length)), keep)
    return cc.state_bytes, cc.compute_ms


def predicted_cp(length: int, mode: str, ranks: int = 2) -> float:
    """The cost model's step time of the sample on a CP group of `ranks`: its slowest member's
    compute and unhidden communication (the `cpu` profile's links are nominal, not measured)
    plus the micro-batch overhead."""
    from hf_cp.modes.segments import ShardMode

    cost = cost_model()
    members = cost.distributed_rank_costs([length], ShardMode(mode), list(range(ranks)), range(ranks))
    return max(c.total_ms for c in members) + cost.micro_batch_overhead_ms()


def mb(x: float) -> str:
    return f"{x / 2**20:.1f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384], help="memory table")
    p.add_argument("--chunk", type=int, default=1024, help="ChunkSize")
    p.add_argument("--keep", type=int, default=1, help="K of the memory table")
    p.add_argument("--k-length", type=int, default=8192, help="sample length of the time-vs-K table")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8], help="K values of the time table")
    p.add_argument("--repeats", type=int, default=2, help="steps timed per row of the time table (fastest kept)")
    p.add_argument(
        "--cp-modes",
        nargs="*",
        default=["ring_zigzag", "ulysses"],
        help="shard modes of the time table's CP-group-of-2 rows (none: no CP rows)",
    )
    p.add_argument("--out", default="-", help="also write the tables as markdown here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--cp-child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        length, chunk, keep, repeats = (int(x) for x in a.child.split(","))
        print(json.dumps(measure(length, chunk, keep, repeats)))
        return 0
    if a.cp_child:
        length, mode, repeats = a.cp_child.split(",")
        rows = measure_cp(int(length), mode, int(repeats))
        if int(os.environ.get("RANK", "0")) == 0:
            print("CP_ROWS " + json.dumps(rows), flush=True)
        return 0

    lines = [
        f"model: {MODEL}",
        "fp32, CPU, one thread, chunked LM-head loss (1024 tokens), one sample per step, a fresh process per row",
        "",
        f"## Peak memory against sample length (ChunkSize {a.chunk}, K={a.keep})",
        "",
        "| tokens | variant | chunks | peak RSS extra MB | saved activations peak MB | K/V store peak MB "
        "| store predicted MB | CPU s | loss |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = []
    for n in a.lengths:
        for chunk in (0, a.chunk):
            r = run_point(n, chunk, a.keep)
            rows.append(r)
            pred_state, _ = predicted(n, chunk, a.keep)
            name = "unchunked" if chunk == 0 else f"chunked K={a.keep}"
            lines.append(
                f"| {n} | {name} | {r['chunks']} | {mb(r['rss_extra'])} | {mb(r['saved_peak'])} | "
                f"{mb(r['store_peak'])} | {mb(pred_state)} | {r['seconds']:.2f} | {r['loss']:.4f} |"
            )
            print(lines[-1], flush=True)
    loss_gap = max(
        abs(x["loss"] - y["loss"]) / abs(x["loss"])
        for x, y in zip(rows[::2], rows[1::2])  # unchunked, chunked of the same length
    )
    lines += ["", f"largest relative loss difference chunked vs unchunked: {loss_gap:.1e}", ""]

    lines += [
        f"## Step time against K ({a.k_length} tokens, ChunkSize {a.chunk}), and on a CP group of 2",
        "",
        "| variant | ranks | chunks | recomputed | CPU s per rank | CPU s all ranks | wall s | CPU per rank / unchunked "
        "| predicted / unchunked | saved activations peak MB per rank | loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = run_point(a.k_length, 0, 1, a.repeats)
    _, base_pred = predicted(a.k_length, 0, 1)
    lines.append(
        f"| unchunked | 1 | 1 | 0 | {base['seconds']:.2f} | {base['seconds']:.2f} | {base['wall']:.2f} | 1.00 | 1.00 | "
        f"{mb(base['saved_peak'])} | {base['loss']:.4f} |"
    )
    print(lines[-1], flush=True)
    losses = [base["loss"]]
    for k in a.ks:
        r = run_point(a.k_length, a.chunk, k, a.repeats)
        _, pred = predicted(a.k_length, a.chunk, k)
        lines.append(
            f"| chunked K={k} | 1 | {r['chunks']} | {max(0, r['chunks'] - k)} | {r['seconds']:.2f} | "
            f"{r['seconds']:.2f} | {r['wall']:.2f} | {r['seconds'] / base['seconds']:.2f} | {pred / base_pred:.2f} | "
            f"{mb(r['saved_peak'])} | {r['loss']:.4f} |"
        )
        print(lines[-1], flush=True)
        losses.append(r["loss"])
    for mode in a.cp_modes:
        r = run_cp_point(a.k_length, mode, a.repeats)
        pred = predicted_cp(a.k_length, mode)
        lines.append(
            f"| unchunked, CP group of 2 ({mode}) | 2 | 1 | 0 | {r['seconds']:.2f} | {r['cpu_all']:.2f} | "
            f"{r['wall']:.2f} | {r['seconds'] / base['seconds']:.2f} | {pred / base_pred:.2f} | "
            f"{mb(r['saved_peak'])} | {r['loss']:.4f} |"
        )
        print(lines[-1], flush=True)
        losses.append(r["loss"])
    gap = max(abs(x - base["loss"]) / abs(base["loss"]) for x in losses)
    lines += ["", f"largest relative loss difference against unchunked on one rank: {gap:.1e}"]
    lines += [
        "",
        "command: python " + " ".join(shlex.quote(x) for x in ["scripts/bench_chunkflow.py", *(argv or sys.argv[1:])]),
    ]
    text = "\n".join(lines)
    print()
    print(text)
    if a.out != "-":
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
