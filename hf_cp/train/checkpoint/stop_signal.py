"""Stop at a step boundary on SIGTERM, saving a checkpoint: preemption without lost steps.

Schedulers announce the end of a job with SIGTERM (Slurm `--signal=TERM@300`, Kubernetes pod
deletion, torchrun passing its own SIGTERM on to the workers), then kill it after a grace
period. `enable_jit_checkpoint` (the TrainingArguments field) turns this on.

transformers' own JIT checkpoint callback decides on each rank by itself, a few seconds after
the signal: ranks reach that moment at different steps, and one rank entering the collective
checkpoint save while the others start the next step would hang the job. Here the handler only
sets a flag; the flag travels in the plan-agreement exchange that opens every step, and every
rank stops after the same step, saves the same checkpoint and exits normally. The step on
which the signal arrives and the next one still run (the exchange opens a step), so the grace
period must cover two steps and one checkpoint save; under torchrun, raise its own
`--shutdown-timeout` (default 30 s) to match.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import List, Optional

logger = logging.getLogger(__name__)


class StopSignal:
    """Records that a stop signal arrived; does nothing else inside the handler."""

    def __init__(self, signum: int = signal.SIGTERM):
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.requested = False
        self._previous: Optional[object] = None
        self._installed = False

    def install(self) -> bool:
        """Install the handler; False where that is impossible (signal handlers belong to the
        main thread: a Trainer run from another thread keeps the default behaviour)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._previous = signal.signal(self.signum, self._handle)
        self._installed = True
        return True

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(self.signum, self._previous)
            self._installed = False

    def stop_after(self, step: int, ranks: List[int], rank: int) -> dict:
        """The agreed stop after `step` (1-based), the signal seen by `ranks`: its record
        ({"step", "signal", "ranks"}), the same on every rank; rank 0 says so."""
        if rank == 0:
            logger.warning(
                "hf_cp: %s on rank(s) %s: stopping after step %d with checkpoint-%d; resume with "
                "resume_from_checkpoint: latest",
                self.name,
                ranks,
                step,
                step,
            )
        return {"step": step, "signal": self.name, "ranks": ranks}


def replace_jit_checkpoint(callback_handler) -> StopSignal:
    """transformers' JIT checkpoint decides per rank, at different steps: a hang under
    distributed saving. Its callback leaves `callback_handler` (a Trainer's) and gives SIGTERM
    back; the StopSignal returned, agreed at every step, replaces it."""
    for cb in list(callback_handler.callbacks):
        if type(cb).__name__ == "JITCheckpointCallback":
            manager = getattr(cb, "jit_manager", None)
            if manager is not None and manager._original_sigterm_handler is not None:
                signal.signal(signal.SIGTERM, manager._original_sigterm_handler)
            callback_handler.remove_callback(cb)
    return StopSignal(signal.SIGTERM)
