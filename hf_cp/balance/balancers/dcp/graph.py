"""One wave's hypergraph: vertices are the long samples' data blocks and compute blocks
(weight: predicted ms), nets join a data block with the compute blocks that read its keys (a
K/V net) or its queries (a Q net), weighted by the bytes a copy of it moves.

Vertices are numpy arrays (a sample over 1024 ranks has 2.1M compute blocks); the nets are
built only for the vertices Mt-KaHyPar refines (at most refine_max_vertices of them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

from hf_cp.balance.balancers.dcp.weights import LongSample, Weights


@dataclass
class WaveGraph:
    """The vertices of some long samples: per sample its data blocks, then its compute blocks."""

    samples: List[LongSample]
    first: np.ndarray  # per sample, its first vertex (its data blocks come first); one more at the end
    weight: np.ndarray  # vertex -> ms
    tokens: np.ndarray  # vertex -> owned rows (data blocks; 0 for compute blocks)
    sp: np.ndarray  # vertex -> sample position
    qi: np.ndarray  # vertex -> query block (a data block: itself)
    ki: np.ndarray  # vertex -> key block of a compute block; -1 for a data block
    kv_bytes_per_token: float
    q_bytes_per_token: float

    @classmethod
    def build(cls, samples: Sequence[LongSample], w: Weights) -> WaveGraph:
        parts = []
        for s in samples:
            nb = len(s.lens)
            parts.append(
                (
                    np.concatenate([w.linear_ms(s.lens.astype(np.float64)), w.attention_ms(s.pairs, s.lens[s.cq])]),
                    np.concatenate([s.lens, np.zeros(len(s.cq), dtype=np.int64)]),
                    np.concatenate([np.arange(nb, dtype=np.int64), s.cq]),
                    np.concatenate([np.full(nb, -1, dtype=np.int64), s.ck]),
                )
            )
        sizes = np.array([len(p[1]) for p in parts], dtype=np.int64)
        first = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

        def cat(j, dtype):
            return np.concatenate([p[j] for p in parts]).astype(dtype) if parts else np.zeros(0, dtype=dtype)

        return cls(
            list(samples),
            first,
            cat(0, np.float64),
            cat(1, np.int64),
            np.repeat(np.arange(len(samples), dtype=np.int64), sizes),
            cat(2, np.int64),
            cat(3, np.int64),
            w.kv_bytes_per_token,
            w.q_bytes_per_token,
        )

    @classmethod
    def concat(cls, graphs: Sequence[WaveGraph]) -> WaveGraph:
        """The graphs' samples and vertices one after another (vertex v of graph j becomes
        v + the vertices of graphs 0..j-1)."""
        if len(graphs) == 1:
            return graphs[0]
        v_off = np.cumsum([0] + [len(g) for g in graphs])
        s_off = np.cumsum([0] + [len(g.samples) for g in graphs])
        return cls(
            [s for g in graphs for s in g.samples],
            np.concatenate([g.first[:-1] + o for g, o in zip(graphs, v_off)] + [[v_off[-1]]]).astype(np.int64),
            np.concatenate([g.weight for g in graphs]),
            np.concatenate([g.tokens for g in graphs]),
            np.concatenate([g.sp + o for g, o in zip(graphs, s_off)]),
            np.concatenate([g.qi for g in graphs]),
            np.concatenate([g.ki for g in graphs]),
            graphs[0].kv_bytes_per_token,
            graphs[0].q_bytes_per_token,
        )

    def __len__(self) -> int:
        return len(self.weight)

    def vertices(self, sp: int) -> np.ndarray:
        """Every vertex of sample `sp` (its data blocks, then its compute blocks)."""
        return np.arange(self.first[sp], self.first[sp + 1])

    def data_vertices(self, sp: int) -> np.ndarray:
        return np.arange(self.first[sp], self.first[sp] + len(self.samples[sp].lens))

    def compute_vertices(self) -> np.ndarray:
        return np.flatnonzero(self.ki >= 0)

    def q_data(self, v: np.ndarray) -> np.ndarray:
        """The data vertex holding the queries of each vertex (a data vertex: itself)."""
        return self.first[self.sp[v]] + self.qi[v]

    def k_data(self, v: np.ndarray) -> np.ndarray:
        """The data vertex holding the keys of each compute vertex."""
        return self.first[self.sp[v]] + self.ki[v]

    def nets(self, vertices: Sequence[int]) -> Tuple[List[List[int]], List[float]]:
        """The nets restricted to `vertices` (pins as positions in it) with two or more pins, and
        their bytes: per data block a K/V net (it and the blocks reading its keys) and a Q net
        (it and the blocks reading its queries), samples and blocks in order."""
        vs = [int(v) for v in vertices]
        local = {v: i for i, v in enumerate(vs)}
        kv: Dict[Tuple[int, int], List[int]] = {}
        q: Dict[Tuple[int, int], List[int]] = {}
        keys = set()
        for i, v in enumerate(vs):
            s, qb, kb = int(self.sp[v]), int(self.qi[v]), int(self.ki[v])
            keys.add((s, qb))
            if kb >= 0:
                keys.add((s, kb))
                kv.setdefault((s, kb), []).append(i)
                q.setdefault((s, qb), []).append(i)
        nets: List[List[int]] = []
        nbytes: List[float] = []
        for s, b in sorted(keys):
            head = [local[v] for v in (int(self.first[s]) + b,) if v in local]
            rows = int(self.samples[s].lens[b])
            for users, per_token in (
                (kv.get((s, b), []), self.kv_bytes_per_token),
                (q.get((s, b), []), self.q_bytes_per_token),
            ):
                if len(head) + len(users) > 1:
                    nets.append(head + users)
                    nbytes.append(per_token * rows)
        return nets, nbytes
