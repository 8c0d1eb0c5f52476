"""Peak memory and time of the LM-head loss: full logits beside the chunked loss of CPTrainer.

Each variant runs forward+backward of cross-entropy over `--tokens` hidden states and a
`--vocab` x `--hidden` head in a fresh process, and reports the peak resident memory above
what the inputs already hold (ru_maxrss), the time, and that both give the same loss and
gradients.

    python scripts/bench_loss_memory.py [--tokens 8192] [--hidden 1024] [--vocab 32000] [--chunks 0 512 2048]

`--chunks 0` is the full-logits path (the model's own logits, then cross-entropy).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def measure(tokens: int, hidden: int, vocab: int, chunk: int, seed: int = 0) -> dict:
    import torch
    import torch.nn.functional as F

    from hf_cp.train.step.loss import chunked_lm_head_loss

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=g)
    t[::3] = -100  # prompt tokens carry no loss
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    if chunk == 0:
        loss = F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100, reduction="sum")
    else:
        loss = chunked_lm_head_loss(h, w, t, chunk, ignore_index=-100)
    loss.backward()
    secs = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "chunk": chunk,
        "extra_bytes": peak - base,
        "seconds": secs,
        "loss": float(loss),
        "grad_h": float(h.grad.double().norm()),
        "grad_w": float(w.grad.double().norm()),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 512, 2048])
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        print(json.dumps(measure(a.tokens, a.hidden, a.vocab, a.child)))
        return 0
    rows = []
    for chunk in a.chunks:  # a fresh process per variant: ru_maxrss is a high-water mark
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--tokens",
                str(a.tokens),
                "--hidden",
                str(a.hidden),
                "--vocab",
                str(a.vocab),
                "--child",
                str(chunk),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    logits_mb = a.tokens * a.vocab * 4 / 2**20
    print(
        f"LM-head loss, {a.tokens} tokens, hidden {a.hidden}, vocab {a.vocab} (fp32 logits {logits_mb:.0f} MB), "
        f"CPU, one thread"
    )
    print(f"{'variant':>14} {'peak extra MB':>14} {'time s':>8} {'loss':>14} {'|grad h|':>10} {'|grad W|':>10}")
    for r in rows:
        name = "full logits" if r["chunk"] == 0 else f"chunk {r['chunk']}"
        print(
            f"{name:>14} {r['extra_bytes'] / 2**20:14.0f} {r['seconds']:8.2f} {r['loss']:14.4f} "
            f"{r['grad_h']:10.4f} {r['grad_w']:10.4f}"
        )
    ref = rows[0]
    worst = max(abs(r["loss"] - ref["loss"]) / abs(ref["loss"]) for r in rows)
    print(f"largest relative loss difference between variants: {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
