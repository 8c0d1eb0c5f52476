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

import signal
import threading
from typing import Optional


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
