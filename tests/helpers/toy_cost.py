"""A cost model of round numbers, to price ChunkFlow plans by hand."""

from hf_cp.cost.dims import ModelDims
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.cost.model import CostModel

DIMS = ModelDims(num_layers=2, hidden=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate=16)


def toy_cost(**overrides) -> CostModel:
    """Round numbers to price by hand: c1 = 1 ms/token, c2 = 0.1 ms/pair, c0 = 0.5 ms per layer,
    2 layers, efficiency 1 for every chunk, no LM head, alpha 100 B/token, static 1000 B."""
    d = dict(
        c1_ms_per_token=1.0,
        c2_ms_per_pair=0.1,
        c0_ms=0.5,
        fitted_dims=dict(
            num_hidden_layers=2,
            hidden_size=8,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=4,
            intermediate_size=16,
        ),
        chunk_efficiency={1: 1.0},
        activation_bytes_per_token=100,
        static_bytes=1000,
        bytes_per_element=2,
        gpus_per_node=8,
        links=dict(intra_node=dict(bandwidth_gbps=1, latency_us=1), inter_node=dict(bandwidth_gbps=1, latency_us=1)),
    )
    d.update(overrides)
    return CostModel(DIMS, HardwareProfile.from_dict(d))
