"""Did the run train every sample exactly once per epoch? An audit of the per-rank histories.

Each rank's `cp_history/rank<R>.jsonl` lists, per step, the sample ids that rank trained (a
sample spread over a CP group is listed by each member). A resumed run appends the steps it
trains again after truncating the ones its checkpoint lacks; should a record of a step appear
twice, the last one counts, as for the metrics. The audit counts, per epoch, the steps in which
each sample was trained: more than one is a duplicate; an epoch holding fewer distinct samples
than the dataset is incomplete (normal for the last epoch of a run cut by max_steps).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple, Union

from hf_cp.train.measure.step_record import read_history


@dataclass
class SampleAudit:
    pairs: int  # distinct (epoch, sample) pairs trained
    dataset_samples: Optional[int]  # from the records (None: histories written before it was recorded)
    per_epoch: Dict[int, int] = field(default_factory=dict)  # epoch -> distinct samples trained
    duplicates: List[Tuple[int, int, List[int]]] = field(default_factory=list)  # (epoch, sample, 1-based steps)

    @property
    def exactly_once(self) -> bool:
        return not self.duplicates


def audit_samples(run_dir: Union[str, Path]) -> Optional[SampleAudit]:
    """None when the run has no per-rank history, or one without sample ids."""
    files = sorted((Path(run_dir) / "cp_history").glob("rank*.jsonl"))
    if not files:
        return None
    # (rank file, step index) -> (epoch, sample ids): the last record of a step wins
    steps: Dict[Tuple[str, int], Tuple[int, List[int]]] = {}
    dataset_samples = None
    for f in files:
        for _, rec in read_history(f):
            if rec.trained_sample_ids is None:
                return None  # a history without sample ids (another writer): nothing to audit
            steps[(f.name, rec.index)] = (int(rec.epoch), [int(s) for s in rec.trained_sample_ids])
            dataset_samples = rec.dataset_samples if rec.dataset_samples is not None else dataset_samples
    # per step, the union over ranks (a CP group's members all list its distributed samples)
    by_step: Dict[int, Tuple[int, Set[int]]] = {}
    for (_, index), (epoch, ids) in steps.items():
        by_step.setdefault(index, (epoch, set()))[1].update(ids)
    seen: Dict[Tuple[int, int], List[int]] = defaultdict(list)
    for index in sorted(by_step):
        epoch, ids = by_step[index]
        for s in ids:
            seen[(epoch, s)].append(index + 1)
    per_epoch: Dict[int, int] = defaultdict(int)
    for epoch, _ in seen:
        per_epoch[epoch] += 1
    dups = sorted((e, s, st) for (e, s), st in seen.items() if len(st) > 1)
    return SampleAudit(len(seen), dataset_samples, dict(sorted(per_epoch.items())), dups)


def audit_lines(audit: SampleAudit) -> List[str]:
    n = audit.dataset_samples
    epochs = []
    for e, k in audit.per_epoch.items():
        epochs.append(f"{e}: {k}" + ("" if n is None else " (complete)" if k == n else f" of {n}"))
    lines = [f"samples: {audit.pairs} (epoch, sample) pairs trained; distinct samples per epoch " + ", ".join(epochs)]
    if audit.exactly_once:
        lines.append("every sample was trained at most once per epoch")
    else:
        shown = "; ".join(f"epoch {e} sample {s} at steps {st}" for e, s, st in audit.duplicates[:10])
        more = f" and {len(audit.duplicates) - 10} more" if len(audit.duplicates) > 10 else ""
        lines.append(f"WARNING: {len(audit.duplicates)} sample(s) trained more than once in an epoch: {shown}{more}")
    return lines
