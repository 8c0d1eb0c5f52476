"""One rank's vision work in a micro-batch: the items it encodes, and the all-to-all-v that
takes every item's embedding rows to the members holding its placeholder tokens.

A wave's group holds local samples (each on one member) and distributed samples (shards on every
member, plan/step_plan.py). Each item is encoded once (plan/vision_encoders.py: a local sample's
items by its holder, a distributed sample's by the least-loaded member). Every member lists, in
its row order, the (item, row) of each placeholder token it holds; from those lists, the same on
every member, each encoder knows which of its output rows go where, and each holder where each
received row lands. M-RoPE positions [3, T] ride along: the sample's own (the model's
rope-index function over the whole sample), cut like its tokens; a text-only sample's are its
1-D positions, three times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from hf_cp.plan.step_plan import Group
from hf_cp.plan.vision_encoders import assign_encoders
from hf_cp.samples.vision import SampleVision

VisionFn = Callable[[int], Optional[SampleVision]]


@dataclass
class WaveVision:
    pixels: torch.Tensor  # [P, D]: patches of the items this rank encodes, in encoding order
    grid_thw: torch.Tensor  # [n, 3]: their patch grids
    send_index: torch.Tensor  # encoder output rows to send, grouped by destination member
    send_rows: List[int]  # per member: rows sent to it
    recv_rows: List[int]  # per member: rows received from it
    recv_order: torch.Tensor  # received rows -> this rank's placeholder rows in row order
    token_positions: torch.Tensor  # positions of this rank's placeholder tokens in its row
    rope_positions: torch.Tensor  # [3, T] M-RoPE positions of the row
    encoded_patches: int = 0  # the encoder work this rank runs (patches)

    @property
    def encodes(self) -> bool:
        return int(self.grid_thw.shape[0]) > 0


def _pieces(group: Group, member: int, lengths: Dict[int, int]) -> List[Tuple[int, int, int]]:
    """(sample, start, length) of every piece of a member's row, in row order (the collator's layout)."""
    rank = group.ranks[member]
    out = [(sid, 0, lengths[sid]) for sid in group.local.get(rank, [])]
    if group.distributed:
        for seg in group.member_segments(member, {s: lengths[s] for s in group.distributed}):
            out.append((group.distributed[seg.doc], seg.start, seg.length))
    return out


def wave_vision(
    group: Group,
    member: int,
    lengths: Dict[int, int],
    vision_of: VisionFn,
    text_positions: Dict[int, np.ndarray],
    row_tokens: int,
) -> WaveVision:
    """This member's WaveVision (see the module's docstring). `lengths`: the group's samples;
    `text_positions`: sample -> its 1-D positions (rotary positions of a text-only sample);
    `row_tokens`: the length of this member's row (a padding token when it holds nothing)."""
    size = len(group.ranks)
    samples = [s for r in group.ranks for s in group.local.get(r, [])] + list(group.distributed)
    vis = {s: vision_of(s) for s in samples}
    items: List[Tuple[int, int]] = []  # (sample, item index) of the group, in a fixed order
    encoder: List[int] = []
    work = [0.0] * size
    dist_items = []
    for m, r in enumerate(group.ranks):
        for s in group.local.get(r, []):
            for k, it in enumerate(vis[s].items if vis[s] else ()):
                items.append((s, k))
                encoder.append(m)
                work[m] += it.patches
    pieces = [_pieces(group, m, lengths) for m in range(size)]
    for s in group.distributed:
        if vis[s] is None:
            continue
        item_of, _ = vis[s].item_of_token(lengths[s])
        for k, it in enumerate(vis[s].items):
            held = []
            for m in range(size):
                held.append(sum(int((item_of[a : a + n] == k).sum()) for (p, a, n) in pieces[m] if p == s))
            dist_items.append((len(items), it.patches, held))
            items.append((s, k))
            encoder.append(-1)
    chosen = assign_encoders([w for _, w, _ in dist_items], [h for _, _, h in dist_items], work)
    for (i, _, _), m in zip(dist_items, chosen):
        encoder[i] = m
    index = {it: i for i, it in enumerate(items)}
    # this member's items, in encoding order, and each one's first row in the encoder's output
    mine = [i for i, m in enumerate(encoder) if m == member]
    first_row, rows = {}, 0
    for i in mine:
        s, k = items[i]
        first_row[i] = rows
        rows += vis[s].items[k].tokens
    # every member's placeholder rows, in its row order: (item, row in item)
    holder_rows: List[List[Tuple[int, int]]] = []
    my_positions: List[int] = []
    for m in range(size):
        got = []
        off = 0
        for s, a, n in pieces[m]:
            if vis[s] is not None:
                item_of, row_of = vis[s].item_of_token(lengths[s])
                at = np.flatnonzero(item_of[a : a + n] >= 0)
                got += [(index[(s, int(item_of[a + j]))], int(row_of[a + j])) for j in at]
                if m == member:
                    my_positions += (at + off).tolist()
            off += n
        holder_rows.append(got)
    send_index, send_rows = [], []
    for m in range(size):
        sent = [first_row[i] + r for i, r in holder_rows[m] if encoder[i] == member]
        send_index += sent
        send_rows.append(len(sent))
    recv_rows = [sum(1 for i, _ in holder_rows[member] if encoder[i] == src) for src in range(size)]
    offsets = np.concatenate([[0], np.cumsum(recv_rows)])
    recv_order = []
    seen = [0] * size
    for i, _ in holder_rows[member]:
        src = encoder[i]
        recv_order.append(int(offsets[src]) + seen[src])
        seen[src] += 1
    pixels, grids = [], []
    for i in mine:
        s, k = items[i]
        it = vis[s].items[k]
        pixels.append(vis[s].pixels[it.kind][it.patch_start : it.patch_stop])
        grids.append(it.grid_thw)
    rope = _row_rope(pieces[member], vis, text_positions, row_tokens)
    dim = next((v.pixels[k].shape[1] for v in vis.values() if v is not None for k in v.pixels), 0)
    return WaveVision(
        pixels=torch.from_numpy(np.concatenate(pixels)) if pixels else torch.zeros(0, dim),
        grid_thw=torch.tensor(grids, dtype=torch.long).reshape(-1, 3),
        send_index=torch.tensor(send_index, dtype=torch.long),
        send_rows=send_rows,
        recv_rows=recv_rows,
        recv_order=torch.tensor(recv_order, dtype=torch.long),
        token_positions=torch.tensor(my_positions, dtype=torch.long),
        rope_positions=torch.from_numpy(rope),
        encoded_patches=sum(int(p.shape[0]) for p in pixels),
    )


def _row_rope(
    pieces: Sequence[Tuple[int, int, int]],
    vis: Dict[int, Optional[SampleVision]],
    text_positions: Dict[int, np.ndarray],
    row_tokens: int,
) -> np.ndarray:
    parts = []
    for s, a, n in pieces:
        v = vis[s]
        if v is not None and v.rope_positions is not None:
            parts.append(np.asarray(v.rope_positions[:, a : a + n], dtype=np.int64))
        else:
            parts.append(np.tile(np.asarray(text_positions[s][a : a + n], dtype=np.int64), (3, 1)))
    got = np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), dtype=np.int64)
    if got.shape[1] < row_tokens:  # a member's padding token
        got = np.concatenate([got, np.zeros((3, row_tokens - got.shape[1]), dtype=np.int64)], axis=1)
    return got
