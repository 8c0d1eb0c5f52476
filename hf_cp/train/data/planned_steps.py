"""The training loader's dataset: item k is this rank's share of planned global step k."""

from __future__ import annotations

from typing import Dict

import numpy as np
from torch.utils.data import Dataset

from hf_cp.planning.worker import Planner
from hf_cp.train.data.collator import PlanCollator, RankStep


def first_item(items):
    """The loader's collate_fn: one item is one planned step."""
    return items[0]


class PlannedSteps(Dataset):
    """Map-style dataset of planned steps for one rank: item k is global step k."""

    def __init__(self, planner: Planner, collator: PlanCollator, rank: int, valid_counts: np.ndarray):
        self.planner, self.collator, self.rank, self.valid_counts = planner, collator, rank, valid_counts

    def __len__(self) -> int:
        return len(self.planner.sampler)

    def __getitem__(self, index: int) -> Dict[str, RankStep]:
        ps = self.planner.get(int(index))
        gv = int(self.valid_counts[list(ps.batch.sample_ids)].sum())
        return {"cp_step": self.collator.rank_step(ps.plan, self.rank, gv, ps.batch.epoch, ps)}
