"""The bundled long-tailed sample dataset, tokenised byte-level (token id = UTF-8 byte).

Byte-level ids need no tokenizer download and fit the tiny model's vocabulary of 256.
`scripts/make_sample_dataset.py` regenerates the file deterministically.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import List, Mapping

SAMPLE_FILE = Path(__file__).resolve().parent / "longtail_sample.jsonl.gz"
# 33 raw chat samples ({"messages": [...]}): `hf-cp preprocess`'s example, a config's `bundled: chat_sample`
CHAT_SAMPLE_FILE = Path(__file__).resolve().parent / "chat_sample.jsonl"
IGNORE_INDEX = -100


def byte_tokenize(prompt: str, response: str) -> dict:
    """input_ids = bytes of prompt + response; labels mask the prompt (-100), HF convention
    (labels aligned with input_ids; shifting to next-token targets is the collator's job)."""
    p, r = list(prompt.encode("utf-8")), list(response.encode("utf-8"))
    ids = p + r
    return {"input_ids": ids, "labels": [IGNORE_INDEX] * len(p) + r, "length": len(ids)}


def read_records(path: Path = SAMPLE_FILE) -> List[Mapping]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_sample_dataset(path=None, limit: int = 0):
    """A `datasets.Dataset` with input_ids, labels, length (and the record id as sample_id)."""
    from datasets import Dataset

    recs = read_records(Path(path) if path else SAMPLE_FILE)
    if limit:
        recs = recs[:limit]
    rows = [dict(byte_tokenize(r["prompt"], r["response"]), sample_id=int(r["id"])) for r in recs]
    return Dataset.from_list(rows)
