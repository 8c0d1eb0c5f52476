"""Headless matplotlib for every picture hf_cp draws."""

from __future__ import annotations

from pathlib import Path
from typing import Union


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, out: Union[str, Path]) -> Path:
    """Lay out, write as PNG (creating folders), close; returns the path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    pyplot().close(fig)
    return out
