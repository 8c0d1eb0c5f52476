"""What a run prints per log line: the Trainer's own keys and a handful of hf_cp's.

Every cp/ metric (metrics.aggregate, about 20 keys, more with CP group sizes) goes to the log
history in trainer_state.json, which `hf-cp report` reads, and to the trackers (`report_to`).
The console line keeps the ones a person watching a run reads: throughput, balance measured and
predicted, the step's time and the model FLOP rate. `cp_log_all_metrics: true` prints them all.
"""

from __future__ import annotations

import logging
from typing import Dict

from transformers.trainer_callback import PrinterCallback, ProgressCallback

logger = logging.getLogger(__name__)

PREFIX = "cp/"
CONSOLE_KEYS = (
    "cp/tokens_per_s",
    "cp/measured_max_over_mean",
    "cp/predicted_max_over_mean",
    "cp/step_wall_ms",
    "cp/predicted_step_ms",
    "cp/tflops",
    "cp/mfu",
)


def console_view(logs: Dict[str, float]) -> Dict[str, float]:
    """`logs` without the cp/ keys the console does not show (a new dict; `logs` is kept)."""
    return {k: v for k, v in logs.items() if not k.startswith(PREFIX) or k in CONSOLE_KEYS}


class _Quiet:
    """on_log of the Trainer's printing callback, given the console view of the logs; the first
    line that hides keys says where they are."""

    told = False

    def on_log(self, args, state, control, logs=None, **kwargs):
        view = console_view(logs) if logs is not None else logs
        if logs is not None and len(view) < len(logs) and not self.told and state.is_world_process_zero:
            self.told = True
            logger.warning(
                "hf_cp: log lines show %d of the %d cp/ metrics; all are in trainer_state.json's log history and "
                "the trackers (cp_log_all_metrics: true prints them)",
                sum(k.startswith(PREFIX) for k in view),
                sum(k.startswith(PREFIX) for k in logs),
            )
        return super().on_log(args, state, control, logs=view, **kwargs)


class QuietProgressCallback(_Quiet, ProgressCallback):
    """ProgressCallback printing the console view."""


class QuietPrinterCallback(_Quiet, PrinterCallback):
    """PrinterCallback (disable_tqdm) printing the console view."""


def quiet_console(callback_handler) -> None:
    """Replace the Trainer's printing callback (ProgressCallback, or PrinterCallback with
    disable_tqdm) by its console-view form, in place."""
    for plain, quiet in ((ProgressCallback, QuietProgressCallback), (PrinterCallback, QuietPrinterCallback)):
        if any(type(cb) is plain for cb in callback_handler.callbacks):
            callback_handler.remove_callback(plain)
            callback_handler.add_callback(quiet)
