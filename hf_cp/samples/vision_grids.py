"""The patch grids of a sample's images and clips, as planning sees them: per sample a tuple of
(t, h, w) triples in patches (the processor's image_grid_thw rows, then video_grid_thw rows).
A text-only sample has none and is left out of every grids mapping. Pure Python.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence, Tuple

GridTHW = Tuple[int, int, int]  # an item's patch grid: temporal patches, height, width
SampleGrids = Tuple[GridTHW, ...]


class VisionGridError(ValueError):
    """A malformed vision grid; the message names the sample (or line) and the field."""


def parse_grids(value, where: str, field: str = "vision") -> SampleGrids:
    """`value` (a list of [t, h, w] of positive integers; None or empty: no items) as a tuple of
    triples; VisionGridError naming `where` and `field` otherwise."""
    if value is None:
        return ()
    if hasattr(value, "tolist"):  # a numpy array or a torch tensor
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise VisionGridError(f"{where}: {field} must be a list of [t, h, w] patch grids, got {value!r:.80}")
    out = []
    for k, g in enumerate(value):
        ok = isinstance(g, (list, tuple)) and len(g) == 3
        ok = ok and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in g)
        if not ok:
            raise VisionGridError(
                f"{where}: {field}[{k}] must be [t, h, w], three positive whole numbers of patches, got {g!r:.80}"
            )
        out.append((int(g[0]), int(g[1]), int(g[2])))
    return tuple(out)


def grids_tokens(grids: Sequence[GridTHW], merge: int) -> int:
    """LLM placeholder tokens of items of these grids: patches / merge^2 each."""
    return sum(t * h * w // (merge * merge) for t, h, w in grids)


def check_grids(
    grids: Mapping[int, Sequence[GridTHW]], lengths: Mapping[int, int], merge: int, label=str
) -> Dict[int, SampleGrids]:
    """The grids, checked against the encoder's spatial merge size: each item's h and w are
    multiples of it (an item's patches merge into whole tokens) and a sample's vision tokens fit
    in its length. `label(sample)` names a sample in the error."""
    out: Dict[int, SampleGrids] = {}
    for s, gs in grids.items():
        for k, (t, h, w) in enumerate(gs):
            if h % merge or w % merge:
                raise VisionGridError(
                    f"{label(s)}: vision[{k}] = [{t}, {h}, {w}]: h and w must be multiples of the encoder's "
                    f"spatial merge size {merge} (a processor's grids are)"
                )
        tokens = grids_tokens(gs, merge)
        n: Optional[int] = lengths.get(s)
        if n is not None and tokens > n:
            raise VisionGridError(
                f"{label(s)}: its vision grids make {tokens} placeholder tokens, more than its length {n} (the "
                "length counts LLM tokens, vision placeholders included)"
            )
        if gs:
            out[int(s)] = tuple(tuple(g) for g in gs)
    return out
