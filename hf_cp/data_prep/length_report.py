"""What a length distribution costs: percentiles, a histogram, and per length bucket the share
of samples, of tokens and of predicted attention time (hf_cp.cost.model.CostModel).

Tokens drive memory and linear compute; attention grows with the square of each document's
length, so a few long samples can hold most of the attention work. Buckets are powers of two.
A sample with a mask (a shared prompt, say) is priced by the pairs its mask attends.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Union

import numpy as np

from hf_cp.cost.model import CostModel
from hf_cp.figures import pyplot, save_figure
from hf_cp.modes.segments import doc_pairs
from hf_cp.samples.masks import SampleMask

PERCENTILES = (50, 90, 99, 99.9)


@dataclass
class Bucket:
    low: int  # exclusive
    high: int  # inclusive
    samples: int
    tokens: int
    attention_ms: float  # predicted attention time of the whole model, fwd+bwd, run locally
    compute_ms: float  # predicted total compute (linear + attention + LM head), run locally

    @property
    def label(self) -> str:
        return f"{_k(self.low + 1)}-{_k(self.high)}"


def _k(n: int) -> str:
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}K"
    return str(n)


@dataclass
class LengthReport:
    samples: int
    tokens: int
    trained_tokens: Optional[int]
    mean: float
    minimum: int
    maximum: int
    percentiles: List[tuple]  # (percentile, length)
    buckets: List[Bucket]
    model: str
    profile: str
    vision_tokens: Optional[Dict[str, int]] = None  # vision data: kind -> placeholder tokens, inside `tokens`

    @property
    def text_tokens(self) -> int:
        return self.tokens - sum((self.vision_tokens or {}).values())

    @property
    def attention_ms(self) -> float:
        return sum(b.attention_ms for b in self.buckets)

    @property
    def compute_ms(self) -> float:
        return sum(b.compute_ms for b in self.buckets)

    def to_dict(self) -> dict:
        return {
            "samples": self.samples,
            "tokens": self.tokens,
            "trained_tokens": self.trained_tokens,
            "mean": self.mean,
            "min": self.minimum,
            "max": self.maximum,
            "percentiles": {str(p): v for p, v in self.percentiles},
            "model": self.model,
            "profile": self.profile,
            **(
                {"text_tokens": self.text_tokens, "vision_tokens": dict(self.vision_tokens)}
                if self.vision_tokens is not None
                else {}
            ),
            "buckets": [
                {
                    "low": b.low,
                    "high": b.high,
                    "samples": b.samples,
                    "tokens": b.tokens,
                    "attention_ms": b.attention_ms,
                    "compute_ms": b.compute_ms,
                }
                for b in self.buckets
            ],
        }

    def text(self, bar_width: int = 30) -> str:
        pct = ", ".join(f"p{p:g} {v}" for p, v in self.percentiles)
        lines = [
            f"length report: {self.samples} samples, {self.tokens} tokens"
            + (
                f" ({self.trained_tokens} trained, {100 * self.trained_tokens / max(self.tokens, 1):.1f}%)"
                if self.trained_tokens is not None
                else ""
            ),
            *(
                [
                    f"  tokens: {self.text_tokens} text + {sum(self.vision_tokens.values())} vision ("
                    + ", ".join(f"{n} {kind}" for kind, n in self.vision_tokens.items())
                    + "); lengths below count both"
                ]
                if self.vision_tokens is not None
                else []
            ),
            f"  min {self.minimum}, mean {self.mean:.1f}, {pct}, max {self.maximum}",
            f"  cost shares predicted for {self.model} on {self.profile} (each sample on one rank):",
            f"  {'length':>12} {'samples':>8} {'samples%':>8} {'tokens%':>8} {'attn%':>7} {'compute%':>8}  histogram",
        ]
        top = max((b.samples for b in self.buckets), default=1) or 1
        for b in self.buckets:
            bar = "#" * (math.ceil(bar_width * b.samples / top) if b.samples else 0)
            lines.append(
                f"  {b.label:>12} {b.samples:>8} {100 * b.samples / self.samples:>8.1f} "
                f"{100 * b.tokens / max(self.tokens, 1):>8.1f} {100 * b.attention_ms / max(self.attention_ms, 1e-300):>7.1f} "
                f"{100 * b.compute_ms / max(self.compute_ms, 1e-300):>8.1f}  {bar}"
            )
        return "\n".join(lines)


def length_report(
    lengths: Sequence[int],
    cost: CostModel,
    trained_tokens: Optional[int] = None,
    model: str = "",
    profile: str = "",
    masks: Optional[Mapping[int, SampleMask]] = None,
    vision_tokens: Optional[Dict[str, int]] = None,
) -> LengthReport:
    """`masks`: sample index -> its mask; a masked sample's attention is priced by its exact
    attended pairs (SampleMask.pairs) instead of a causal document's. `vision_tokens`: kind ->
    the image and video placeholder tokens the lengths include (shown apart from text tokens)."""
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.size == 0:
        raise ValueError("length report: no samples")
    values, counts = np.unique(lens, return_counts=True)
    layers = cost.dims.num_layers
    # one cost evaluation per distinct length keeps this fast for millions of samples
    attn = np.array([layers * cost.c2 * doc_pairs(int(n)) / cost.chunk_efficiency(int(n)) for n in values])
    comp = np.array([cost.sample_local_ms(int(n)) for n in values])
    # masked samples: the difference to the causal price of their length, added per distinct length
    fix = np.zeros(len(values))
    for i, m in (masks or {}).items():
        n = int(lens[i])
        fix[np.searchsorted(values, n)] += layers * cost.c2 * (m.pairs() - doc_pairs(n)) / cost.chunk_efficiency(n)
    top_exp = max(7, int(math.ceil(math.log2(max(int(values[-1]), 1)))))
    low_exp = min(7, top_exp)
    edges = [0] + [2**e for e in range(low_exp, top_exp + 1)]
    which = np.searchsorted(np.asarray(edges[1:]), values, side="left")  # bucket i holds (edges[i], edges[i+1]]
    buckets = []
    for i in range(len(edges) - 1):
        sel = which == i
        buckets.append(
            Bucket(
                low=edges[i],
                high=edges[i + 1],
                samples=int(counts[sel].sum()),
                tokens=int((values[sel] * counts[sel]).sum()),
                attention_ms=float((attn[sel] * counts[sel]).sum() + fix[sel].sum()),
                compute_ms=float((comp[sel] * counts[sel]).sum() + fix[sel].sum()),
            )
        )
    pct = [(p, int(np.percentile(lens, p, method="inverted_cdf"))) for p in PERCENTILES]
    return LengthReport(
        samples=int(lens.size),
        tokens=int(lens.sum()),
        trained_tokens=trained_tokens,
        mean=float(lens.mean()),
        minimum=int(lens.min()),
        maximum=int(lens.max()),
        percentiles=pct,
        buckets=buckets,
        model=model,
        profile=profile,
        vision_tokens=dict(vision_tokens) if vision_tokens is not None else None,
    )


def write_lengths_jsonl(
    path: Union[str, Path], lengths: Sequence[int], vision: Optional[Sequence[Sequence[Sequence[int]]]] = None
) -> Path:
    """One JSON record per sample, {"length": N} or, for vision data, {"length": N, "vision": [[t, h, w],
    ...]}: the sample's LLM tokens (vision placeholders included) and its items' patch grids, images
    then clips, as `hf-cp plan --lengths` reads them (hf_cp.samples.vision_grids)."""
    if vision is not None and len(vision) != len(lengths):
        raise ValueError(f"lengths file: {len(lengths)} lengths but {len(vision)} vision grid lists")
    out = Path(path)
    with open(out, "w") as f:
        for k, n in enumerate(lengths):
            row = {"length": int(n)}
            if vision is not None:
                row["vision"] = [[int(x) for x in g] for g in vision[k]]
            f.write(json.dumps(row) + "\n")
    return out


# files every model folder has under the same name: the folder names the model, not the file
MODEL_FOLDER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


def display_name(name: str) -> str:
    """A name short enough for a figure: a path's last part (a tokenizer or data folder given by
    its full path clipped both panels' titles); a Hub name (org/model) as it is; a model folder's
    own file (…/SmolLM2/config.json, the model a tokenizer's length report is priced with) as
    the folder's name, which says which model it is."""
    text = str(name).rstrip("/\\")
    path = Path(text)
    if path.name in MODEL_FOLDER_FILES and path.parent.name:
        return path.parent.name
    if text.count("/") <= 1 and not text.startswith((".", "/", "~")) and "\\" not in text:
        return text
    return path.name or text


def plot_length_report(report: LengthReport, out: Union[str, Path], title: str = "") -> Path:

    plt = pyplot()

    labels = [b.label for b in report.buckets]
    x = np.arange(len(labels))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(7.0, 0.6 * len(labels) + 3), 7), sharex=True)
    ax1.bar(x, [b.samples for b in report.buckets], color="tab:blue")
    ax1.set_ylabel("samples")
    ax1.set_title(
        title
        or f"{report.samples} samples, {report.tokens} tokens; median {report.percentiles[0][1]}, max {report.maximum}"
    )
    w = 0.27
    shares = {
        "samples": [b.samples / report.samples for b in report.buckets],
        "tokens": [b.tokens / max(report.tokens, 1) for b in report.buckets],
        "attention time": [b.attention_ms / max(report.attention_ms, 1e-300) for b in report.buckets],
    }
    for k, (name, vals) in enumerate(shares.items()):
        ax2.bar(x + (k - 1) * w, [100 * v for v in vals], width=w, label=name)
    ax2.set_ylabel("share (%)")
    ax2.set_xlabel("sample length (tokens)")
    ax2.set_xticks(x, labels, rotation=45, ha="right")
    legend = f"{display_name(report.model)} on {display_name(report.profile)}" if report.model else None
    ax2.legend(title=legend, fontsize=8)
    return save_figure(fig, out)
