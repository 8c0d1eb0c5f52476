"""Wall time of pieces of device work, in milliseconds.

CUDA: CUDA events around each call, median of the repeats after warm-up (events time the
device, not the host, so launch-ahead does not hide work). CPU: perf_counter, the minimum of
the repeats, and the cases measured round-robin: on a shared CPU other processes only ever add
time, and a burst of outside load then hits one round of every case instead of all rounds of
one case, so the fastest round is the best estimate of the work itself.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, List, Sequence

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def time_each(fns: Sequence[Callable[[], object]], device: torch.device, warmup: int = 1,
              repeats: int = 3) -> List[float]:
    """Milliseconds of each `fn()`: median of `repeats` (CUDA) or minimum over round-robin rounds (CPU)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    device = torch.device(device)
    if device.type == "cuda":
        return [_cuda_ms(fn, device, warmup, repeats) for fn in fns]
    for fn in fns:
        for _ in range(warmup):
            fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], (time.perf_counter() - t0) * 1e3)
    return best


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int = 1, repeats: int = 3) -> float:
    return time_each([fn], device, warmup, repeats)[0]
