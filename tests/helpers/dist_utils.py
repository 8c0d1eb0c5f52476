"""Run a function in N gloo processes with a timeout; collect results or errors per rank."""

from __future__ import annotations

import os
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, queue, timeout_s):
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        out = fn(rank, world, *args)
        queue.put((rank, "ok", out))
    except BaseException as e:  # report everything to the parent
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_distributed(
    fn, world: int, *args, timeout_s: float = 120, collective_timeout_s: float = 60, daemon: bool = True
):
    """Returns {rank: ("ok", result) | ("error", text)}; raises TimeoutError if ranks hang.
    `daemon=False`: ranks that start processes of their own (a planner worker, a solver's)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, fn, args, queue, collective_timeout_s), daemon=daemon)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(results))} did not finish in {timeout_s} s")
            try:
                rank, status, value = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                continue
            results[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return results
