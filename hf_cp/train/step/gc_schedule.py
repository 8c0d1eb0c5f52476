"""Garbage collection at planned points instead of whenever an allocation trips it.

Python's collector pauses the whole process (the planner thread too) whenever allocations
cross its thresholds, at different moments on different ranks: with torch and transformers
loaded, one full collection walks hundreds of thousands of objects (200-350 ms measured in
scripts/bench_balancers.py), which makes a random rank the straggler of that step.
With `cp_gc_interval_steps: N`, training freezes the objects alive at its start (model,
datasets, modules: never garbage), turns automatic collection off, and every rank collects
the young generations at the end of every N-th step, so pauses line up across ranks. The same
practice as torchtitan's gc_freq and Megatron-LM's manual GC.
"""

from __future__ import annotations

import gc

from transformers import TrainerCallback


class ScheduledGarbageCollection(TrainerCallback):
    def __init__(self, interval_steps: int):
        if interval_steps <= 0:
            raise ValueError(f"cp_gc_interval_steps must be positive to schedule collections, got {interval_steps}")
        self.interval = interval_steps
        self._was_enabled = True

    def on_train_begin(self, args, state, control, **kwargs):
        self._was_enabled = gc.isenabled()
        gc.collect()
        gc.freeze()  # what is alive now stays alive: keep it out of every later scan
        gc.disable()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.interval == 0:
            gc.collect(1)  # young generations: what the steps since the last collection left

    def on_train_end(self, args, state, control, **kwargs):
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
