"""Time of pieces of device work, in milliseconds.

CUDA: CUDA events around each call, median of the repeats after warm-up (events time the
device, not the host, so launch-ahead does not hide work).

CPU: with one torch thread, the CPU time of this process (time.process_time), which a
shared machine's other processes cannot inflate by taking the core away; with more threads,
wall time (CPU time would add the threads up). Either way the minimum of the repeats, with the
cases measured round-robin: interference (cache, memory bandwidth, descheduling) only ever
adds time, and a burst of it then hits one round of every case instead of all rounds of one.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, List, Sequence

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_clock_name() -> str:
    return "process CPU time" if torch.get_num_threads() == 1 else "wall time"


def _cuda_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end))
    return float(statistics.median(times))


def time_each(
    fns: Sequence[Callable[[], object]], device: torch.device, warmup: int = 1, repeats: int = 3
) -> List[float]:
    """Milliseconds of each `fn()`: median of `repeats` (CUDA) or minimum over round-robin rounds (CPU)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    device = torch.device(device)
    if device.type == "cuda":
        return [_cuda_ms(fn, device, warmup, repeats) for fn in fns]
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    for fn in fns:
        for _ in range(warmup):
            fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = clock()
            fn()
            best[i] = min(best[i], (clock() - t0) * 1e3)
    return best


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int = 1, repeats: int = 3) -> float:
    return time_each([fn], device, warmup, repeats)[0]
