"""Write the bundled long-tailed sample dataset (hf_cp/data/longtail_sample.jsonl.gz).

Deterministic: the same file comes out on every run (seeded generator, gzip without a
timestamp). Each record is a prompt and a response in pseudo-English built from a small word
list with a fixed word-bigram table, so a byte-level model (vocab 256) learns it quickly.
Response lengths are log-normal with a long tail, like real SFT data: most samples are a few
hundred bytes, a few are several thousand.

    python scripts/make_sample_dataset.py [--samples 240] [--seed 0] [--out PATH]
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import math
import random
from pathlib import Path

WORDS = (
    "the of and to in is was for on as with by at from that this which it be are an or not have "
    "has had but all one two new more time data model train token rank group plan step wave batch "
    "long short length balance cost memory ring zigzag layer head attention context parallel sample "
    "loss gradient update optimizer compute split shard chunk queue worker node device fast slow"
).split()
QUESTIONS = (
    "How does {} work?",
    "Explain {} in detail.",
    "Why is {} slow?",
    "Summarise the {} notes.",
    "What limits {}?",
)


def _bigram_table(rng: random.Random):
    # every word gets a few likely successors, so the text has learnable structure
    return {w: rng.sample(WORDS, 5) for w in WORDS}


def _text(rng: random.Random, table, n_bytes: int) -> str:
    out, size = [], 0
    w = rng.choice(WORDS)
    sentence = 0
    while size < n_bytes:
        w = rng.choice(table[w]) if rng.random() < 0.85 else rng.choice(WORDS)
        tok = w.capitalize() if sentence == 0 else w
        sentence += 1
        if sentence > rng.randint(6, 14):
            tok += "."
            sentence = 0
        out.append(tok)
        size += len(tok) + 1
    return " ".join(out)[:n_bytes]


def make_records(n_samples: int, seed: int):
    rng = random.Random(seed)
    table = _bigram_table(rng)
    records = []
    for i in range(n_samples):
        # log-normal body, median ~280 bytes; every 40th sample is a long document (2K-6K bytes)
        if i % 40 == 7:
            n = rng.randint(2000, 6000)
        else:
            n = int(min(1800, max(24, math.exp(rng.gauss(math.log(280), 0.8)))))
        topic = rng.choice(WORDS[20:])
        prompt = "User: " + rng.choice(QUESTIONS).format(topic) + "\nAssistant: "
        records.append({"id": i, "prompt": prompt, "response": _text(rng, table, n) + "\n"})
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=240)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "hf_cp/data/longtail_sample.jsonl.gz"))
    args = p.parse_args()
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, filename="") as gz:
        for r in make_records(args.samples, args.seed):
            gz.write((json.dumps(r, sort_keys=True) + "\n").encode())
    Path(args.out).write_bytes(buf.getvalue())
    recs = make_records(args.samples, args.seed)
    lens = sorted(len((r["prompt"] + r["response"]).encode()) for r in recs)
    print(
        f"wrote {args.out}: {len(recs)} samples, {sum(lens)} byte tokens, median {lens[len(lens) // 2]}, max {lens[-1]}"
    )


if __name__ == "__main__":
    main()
