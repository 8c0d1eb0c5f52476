"""One wave's hypergraph: vertices are the long samples' data blocks and compute blocks
(weight: predicted ms), nets join a data block with the compute blocks that read its keys (a
K/V net) or its queries (a Q net), weighted by the bytes a copy of it moves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from hf_cp.balance.balancers.dcp.weights import LongSample, Weights


@dataclass
class WaveGraph:
    """The vertices of one wave's long samples: data blocks then compute blocks, flat."""

    samples: List[LongSample]
    weight: List[float] = field(default_factory=list)  # ms
    tokens: List[int] = field(default_factory=list)  # owned rows (data blocks only)
    data_vertex: List[List[int]] = field(default_factory=list)  # per sample, per block
    comp_vertex: List[List[int]] = field(default_factory=list)  # per sample, per compute block
    nets: List[List[int]] = field(default_factory=list)
    net_bytes: List[float] = field(default_factory=list)
    row_of: List[Tuple[int, int]] = field(default_factory=list)  # vertex -> (sample pos, query block)

    @classmethod
    def build(cls, samples: List[LongSample], w: Weights) -> WaveGraph:
        g = cls(samples)
        for sp, s in enumerate(samples):
            dv = []
            for bi, (_, ln) in enumerate(s.blocks):
                dv.append(len(g.weight))
                g.weight.append(w.linear_ms(ln))
                g.tokens.append(ln)
                g.row_of.append((sp, bi))
            cv = []
            k_users: Dict[int, List[int]] = {}
            q_users: Dict[int, List[int]] = {}
            for qi, ki, p in s.compute:
                v = len(g.weight)
                cv.append(v)
                g.weight.append(w.attention_ms(p, s.blocks[qi][1]))
                g.tokens.append(0)
                g.row_of.append((sp, qi))
                k_users.setdefault(ki, []).append(v)
                q_users.setdefault(qi, []).append(v)
            for bi, (_, ln) in enumerate(s.blocks):
                g.nets.append([dv[bi]] + k_users.get(bi, []))
                g.net_bytes.append(w.kv_bytes_per_token * ln)
                g.nets.append([dv[bi]] + q_users.get(bi, []))
                g.net_bytes.append(w.q_bytes_per_token * ln)
            g.data_vertex.append(dv)
            g.comp_vertex.append(cv)
        return g

    def __len__(self) -> int:
        return len(self.weight)
