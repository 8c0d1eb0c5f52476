"""Short token documents, some with prompt tokens masked, for the pre-packed input tests."""

import numpy as np


def docs_dataset(n_docs=23, seed=0, prompt_every=3):
    """`n_docs` rows of 2-39 random tokens; every `prompt_every`-th has its first third masked (-100)."""
    from datasets import Dataset

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n_docs):
        n = int(rng.integers(2, 40))
        ids = rng.integers(0, 256, n).tolist()
        labels = [-100 if (i % prompt_every == 0 and p < n // 3) else x for p, x in enumerate(ids)]
        rows.append({"input_ids": ids, "labels": labels})
    return Dataset.from_list(rows)
