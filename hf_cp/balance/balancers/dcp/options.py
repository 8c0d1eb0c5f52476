"""DCP's options (DcpOptions) and the error a step that cannot be placed raises."""

from __future__ import annotations

from dataclasses import dataclass

from hf_cp.balance.balancers.dcp import hypergraph

PARTITIONERS = ("auto", "mtkahypar", "greedy")


class DcpError(ValueError):
    """The step cannot be placed (it names the wave and the rank)."""


@dataclass(frozen=True)
class DcpOptions:
    block_size: int = 0  # tokens per data block; 0: the largest power of two <= cap / 4
    max_blocks: int = 64  # data blocks per sample at most, unless it spreads over more than half as many parts
    epsilon: float = 0.05  # a part's time may exceed its share of the wave by this fraction
    fill: float = 0.8  # a wave's owned tokens at most this share of world x cap
    partitioner: str = "auto"  # "mtkahypar", "greedy", or "auto" (Mt-KaHyPar when installed)
    # computation/communication divisions per group (the seed uses several). The engine's
    # executor runs a layout's exchange before its blocks and does not pipeline divisions yet,
    # so the default, 1, predicts what runs; more divisions are scheduled, carried in the
    # layouts and priced as the pipeline (cost.blocks.division_comm_ms) for an executor that does
    divisions: int = 1
    refine_max_vertices: int = 2000  # Mt-KaHyPar refines a block's top level up to this many vertices

    def __post_init__(self):
        if self.partitioner not in PARTITIONERS:
            raise ValueError(f"dcp: partitioner {self.partitioner!r} must be one of {PARTITIONERS}")
        if not 0 < self.fill <= 1:
            raise ValueError(f"dcp: fill {self.fill} must be in (0, 1]")
        if self.epsilon < 0:
            raise ValueError(f"dcp: epsilon {self.epsilon} must be >= 0")
        if self.block_size < 0 or self.max_blocks < 1 or self.divisions < 1:
            raise ValueError("dcp: block_size >= 0, max_blocks >= 1 and divisions >= 1 are required")

    def backend(self) -> str:
        if self.partitioner == "auto":
            return "mtkahypar" if hypergraph.available() else "greedy"
        if self.partitioner == "mtkahypar" and not hypergraph.available():
            raise ImportError(
                "dcp: partitioner 'mtkahypar' needs Mt-KaHyPar: pip install mtkahypar (or hf_cp[dcp]); "
                "partitioner='greedy' or 'auto' plans without it"
            )
        return self.partitioner
