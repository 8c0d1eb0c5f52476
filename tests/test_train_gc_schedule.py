"""ScheduledGarbageCollection (hf_cp/train/step/gc_schedule.py)."""

from __future__ import annotations

import pytest


def test_scheduled_garbage_collection_collects_only_at_the_interval():
    import gc
    from types import SimpleNamespace

    from hf_cp.train.step.gc_schedule import ScheduledGarbageCollection

    seen = []

    def on_gc(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    cb = ScheduledGarbageCollection(3)
    state = SimpleNamespace(global_step=0)
    assert gc.isenabled()
    gc.callbacks.append(on_gc)
    try:
        cb.on_train_begin(None, state, None)
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        seen.clear()
        for step in range(1, 8):
            state.global_step = step
            for _ in range(2000):  # cyclic garbage that would trip automatic collections
                a = []
                a.append(a)
            cb.on_step_end(None, state, None)
        assert seen == [1, 1], "one young-generation collection at steps 3 and 6, none in between"
        cb.on_train_end(None, state, None)
        assert gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.callbacks.remove(on_gc)
        gc.unfreeze()
        gc.enable()
    with pytest.raises(ValueError, match="cp_gc_interval_steps must be positive"):
        ScheduledGarbageCollection(0)
