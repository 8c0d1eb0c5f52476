"""DCP's options (DcpOptions) and the error a step that cannot be placed raises.

DcpOptions is a BalancerOptions like every balancer's: from Python, YAML
(`training.cp_balancer_options`), the command line (`--balancer-opt fill=0.9`) and `auto`
(`member_options.dcp.fill=0.9`) alike, an unknown key is refused with the nearest valid name,
values are typed (command-line text read as YAML) and ranged (`check`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from hf_cp.balance.balancers.dcp import hypergraph
from hf_cp.balance.options import BalancerOptionError, BalancerOptions, option

PARTITIONERS = ("auto", "mtkahypar", "greedy")


class DcpError(ValueError):
    """The step cannot be placed (it names the wave and the rank)."""


@dataclass(frozen=True)
class DcpOptions(BalancerOptions):
    BALANCER: ClassVar[str] = "dcp"

    block_size: int = option(0, "tokens per data block of a long sample; 0: the largest power of two <= cap / 4")
    max_blocks: int = option(
        64, "data blocks per long sample at most, unless it spreads over more than max_blocks / 2 ranks"
    )
    epsilon: float = option(0.05, "a part's time may exceed its share of the wave by this fraction (>= 0)")
    fill: float = option(0.8, "a wave's owned tokens per rank at most this share of the cap, in (0, 1]")
    partitioner: str = option("auto", "mtkahypar, greedy, or auto (Mt-KaHyPar when installed, else greedy)")
    # the engine's executor runs a layout's exchange before its blocks and does not pipeline
    # divisions yet, so the default, 1, predicts what runs; more divisions are scheduled,
    # carried in the layouts and priced as the pipeline (cost.blocks.division_comm_ms)
    divisions: int = option(
        1,
        "computation/communication divisions per group (>= 1); 1 predicts what the executor runs today, "
        "more are scheduled and priced as DCP's pipeline",
    )
    refine_max_vertices: int = option(
        2000, "Mt-KaHyPar refines a block's top level only up to this many vertices (>= 0; the planner-time bound)"
    )
    keep_fallback: bool = option(
        True,
        "also make the fallback plan (the long samples ring per-document on the groups dcp gives them) and keep it "
        "when the pricer predicts it faster than the block placement (false: the block placement, within the deadline)",
    )
    deadline_s: Optional[float] = option(
        5.0,
        "wall-clock deadline of the block placement, checked between its bounded steps (each Mt-KaHyPar call is "
        "bounded by refine_max_vertices); past it the step gets dcp's fallback plan (the long samples ring "
        "per-document on groups of the sizes dcp gives them, no blocks) and a note saying so (null: no deadline)",
    )

    def check(self) -> None:
        if self.partitioner not in PARTITIONERS:
            raise BalancerOptionError(f"dcp: partitioner {self.partitioner!r} must be one of {PARTITIONERS}")
        if not 0 < self.fill <= 1:
            raise BalancerOptionError(f"dcp: fill {self.fill} must be in (0, 1]")
        if not self.epsilon >= 0:
            raise BalancerOptionError(f"dcp: epsilon {self.epsilon} must be >= 0")
        if self.block_size < 0:
            raise BalancerOptionError(f"dcp: block_size {self.block_size} must be >= 0 (0: chosen from the cap)")
        if self.max_blocks < 1:
            raise BalancerOptionError(f"dcp: max_blocks {self.max_blocks} must be >= 1")
        if self.divisions < 1:
            raise BalancerOptionError(f"dcp: divisions {self.divisions} must be >= 1")
        if self.refine_max_vertices < 0:
            raise BalancerOptionError(f"dcp: refine_max_vertices {self.refine_max_vertices} must be >= 0")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise BalancerOptionError(f"dcp: deadline_s {self.deadline_s} must be positive (or null)")

    def backend(self) -> str:
        if self.partitioner == "auto":
            return "mtkahypar" if hypergraph.available() else "greedy"
        if self.partitioner == "mtkahypar" and not hypergraph.available():
            raise ImportError(
                "dcp: partitioner 'mtkahypar' needs Mt-KaHyPar: pip install mtkahypar (or hf_cp[dcp]); "
                "partitioner='greedy' or 'auto' plans without it"
            )
        return self.partitioner
