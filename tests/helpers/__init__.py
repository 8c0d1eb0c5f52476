"""Code the tests share; no test module imports another.

pytest puts tests/ on sys.path (tests/conftest.py, rootdir-relative "prepend" import mode), so
tests import these as `helpers.<module>`; the processes the helpers start (torchrun jobs, spawned
gloo pools) find them the same way: run_distributed and run_processes put the repository and
tests/ on PYTHONPATH, spawned processes inherit sys.path.

- harness/: CPTrainer exactness runs: tiny models and data, scripted balancers, the torchrun
  job, the single-process reference and the per-step check
- world2_job: the world-2 runs one shared torchrun job trains once per session (the
  `world2_job` fixture), specs of runs of their own, what the tests read back from a run
- masked_training: one CPTrainer step on a tiny Llama, in this process or under torchrun + DDP
- attention_pool: the session's long-lived gloo process pools (the `pools` fixture);
  dist_utils: a one-off gloo job of N spawned processes
- attention: attention_models, block_models, cp_layout, mask_reference, mask_specs,
  kernel_checks, chunk_state_reference, chunkflow_reference
- planning and data: balancer_checks, plan_gen, toy_cost, step_records, packed_docs,
  tiny_tokenizer

Test code: nothing under hf_cp/ imports it (tests/test_trainer_exactness.py checks that).
"""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "benchmarks" / "traces"  # the length traces committed with the repository


def load_file_module(name: str, relpath: str) -> ModuleType:
    """A script or recipe of the repository (not a package module) imported as module `name`:
    registered in sys.modules before it runs, as its dataclasses and pickling look it up."""
    spec = importlib.util.spec_from_file_location(name, REPO / relpath)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
