"""A vision-language sample run as ChunkFlow's dependent chunks: its images and clips encoded on its
rank, their embedding rows handed to the chunks that hold their placeholder tokens, and the rows'
gradients, gathered over every chunk's backward, brought back through the tower once.

A chunked sample runs on one rank, which encodes all of its items (plan/vision_encoders.py).
Before its first chunk they are encoded without a graph: the rows E ([P, hidden x (1 + DeepStack
layers)], one per placeholder token in token order), which every chunk's forward reads. Chunk i
holds the placeholders whose rows are E[a_i:b_i]:

- a chunk after the first places a leaf copy of its slice in every forward (the no-graph state
  forward, the kept or recomputed forward); in the one whose backward follows, a hook adds the
  leaf's gradient into G, a float32 accumulator of E's shape. That gradient already holds what
  every later chunk adds through the K/V store, and chunk i's backward runs after theirs;
- chunk 0, whose backward is the sample's last (ChunkFlow's schedule runs chunks last first),
  encodes the items again with a graph in its forward with a graph, places rows E'[a_0:b_0] of
  it, and its backward adds sum(E'[b_0:] * G[b_0:]) to its loss: one backward through the tower
  carries every chunk's row gradients and chunk 0's own, so the tower's parameter gradients are
  those of the unchunked sample.

So the tower runs forward twice per sample (once without a graph, once with) and backward once,
never per chunk. Building the graph in chunk 0's pass, not before the first chunk, is what keeps
the data-parallel reduction right: the tower's work is recorded inside the embedding's forward
hook of the pass (VisionTower.placing_rows), after the embedding, as every other pass records it,
so autograd hands ZeRO-2's bucketed reduction the parameters' gradients in the same order on every
rank (built before the pass, the tower's gradients came after the embedding's on the chunked rank
only: at world 2 under ZeRO-2 the tower's and the embedding's gradients came out 0.2-365x off,
exact at world 1). It also holds the tower's activations only through chunk 0's pass instead of
across the whole sample. The rows of both encodings are equal only when the tower is
deterministic (the honoured towers have no dropout).

M-RoPE positions are the whole sample's (the model's rope-index function, vision_rows.py), cut
with each chunk (chunkflow.sample_chunks). Every forward with a graph of a later chunk (and each
chunk of a text-only sample in a vision run) adds the tower's zero-weighted dummy rows, as a
standalone micro-batch without items does: each backward reaches every tower parameter, which a
data-parallel reduction (ZeRO-2, DDP) expects of each rank's backward.

Memory beside the chunks' own (plan/chunks.py counts it for the whole sample, an upper bound):
the tower's activations for all the sample's patches in chunk 0's pass (cost.vision_tokens), and E
with its float32 accumulator G from the first chunk to the last backward (vision_rows_bytes).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from hf_cp.plan.chunks import chunk_starts
from hf_cp.train.data.vision_rows import WaveVision
from hf_cp.train.step.vision_tower import VisionTower

Tensor = torch.Tensor


class ChunkVision:
    """One chunked sample's vision rows (module docstring): chunkflow.ChunkInputs for
    run_chunked_sample and evaluate_chunked_sample. `vision`: the sample's WaveVision on its
    rank (every item encoded there); one without items (a text-only sample of a vision run)
    places only the dummy rows."""

    def __init__(self, tower: VisionTower, vision: WaveVision, chunk_sizes: Sequence[int], device: torch.device):
        self.tower = tower
        self.vision = vision
        self.device = device
        sizes = [int(n) for n in chunk_sizes]
        self.starts = chunk_starts(sizes)
        at = vision.token_positions.to(device)
        total = sum(sizes)
        if at.numel() and (int(at.min()) < 0 or int(at.max()) >= total):
            raise ValueError(
                f"placeholder positions {int(at.min())}..{int(at.max())} outside a sample of {total} tokens"
            )
        if at.numel() and vision.send_rows != [int(at.numel())]:
            raise ValueError(
                f"a chunked sample's items are encoded on its own rank: {int(at.numel())} placeholder rows, but the "
                f"rows sent are {vision.send_rows}"
            )
        self.rows: Optional[Tensor] = None  # E: [P, hidden x (1 + DeepStack layers)], no graph
        self.graph_rows: Optional[Tensor] = None  # E' of chunk 0's forward with a graph
        self.grad: Optional[Tensor] = None  # G: float32, E's gradient from chunks 1..N-1
        if vision.encodes:
            with torch.no_grad():
                self.rows = tower.placeholder_rows(vision, None, 0, device)[0]
            if int(self.rows.shape[0]) != int(at.numel()):
                raise ValueError(f"{int(self.rows.shape[0])} rows encoded for {int(at.numel())} placeholder tokens")
        self.width = int(self.rows.shape[1]) if self.rows is not None else tower.hidden * (1 + tower.deepstack_layers)
        ends = torch.tensor([s + n for s, n in zip(self.starts, sizes)], device=at.device)
        cut = torch.searchsorted(at, ends).tolist() if at.numel() else [0] * len(sizes)
        # per chunk: (first row, end row) of E, and its placeholders' positions in the chunk's row
        self.bounds: List[Tuple[int, int]] = [(0 if i == 0 else cut[i - 1], cut[i]) for i in range(len(sizes))]
        self.positions = [at[a:b] - s for (a, b), s in zip(self.bounds, self.starts)]

    def _accumulate(self, a: int, b: int):
        def add(g: Tensor) -> None:
            if self.grad is None:
                self.grad = torch.zeros(self.rows.shape, dtype=torch.float32, device=self.rows.device)
            self.grad[a:b].add_(g.float())

        return add

    def _rows_of(self, i: int, graph: bool, device: torch.device) -> Tuple[Tensor, Tensor, Tensor]:
        """(rows, positions, zero) of chunk i's pass, made inside the embedding's forward hook."""
        a, b = self.bounds[i]
        zero = torch.zeros((), device=device)
        dummy = graph and i > 0 or self.rows is None
        if graph and dummy:
            zero = self.tower.dummy_rows(device).sum()  # every tower parameter in this backward
        if self.rows is None:
            return torch.zeros(0, self.width, device=device), self.positions[i], zero
        if i == 0 and graph:  # the tower's one graph: chunk 0's backward runs through it (backward_term)
            self.graph_rows = self.tower.placeholder_rows(self.vision, None, 0, device)[0]
            return self.graph_rows[a:b], self.positions[i], zero
        rows = self.rows[a:b].detach()
        if graph:
            rows.requires_grad_(True)
            rows.register_hook(self._accumulate(a, b))
        return rows, self.positions[i], zero

    @contextlib.contextmanager
    def forward(self, i: int, graph: bool) -> Iterator[None]:
        graph = graph and torch.is_grad_enabled()
        with self.tower.placing_rows(lambda device: self._rows_of(i, graph, device)):
            yield

    def backward_term(self, i: int) -> Optional[Tensor]:
        """Chunk 0's: sum(E'[b_0:] * G[b_0:]), whose gradient through the tower is the later chunks'."""
        if i != 0 or self.graph_rows is None:
            return None
        rest = self.graph_rows[self.bounds[0][1] :]
        if self.grad is None:  # no later chunk holds a placeholder
            return rest.sum() * 0.0
        return (rest.float() * self.grad[self.bounds[0][1] :]).sum()

    def release(self) -> None:
        self.rows, self.graph_rows, self.grad = None, None, None
