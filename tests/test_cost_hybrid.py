"""The cost model prices a hybrid by its layer mix (issue 36, item 3): attention time and the
K/V exchange on its softmax layers only, the linear-time part on every layer. Every balancer,
the vectorised pricer, the simulator and the bounds read the same numbers."""

import dataclasses
import json
import random

import pytest

from hf_cp.balance import PlanRequest, get_balancer
from hf_cp.balance.toolkit.pricing import pricer_for
from hf_cp.cli import main
from hf_cp.cost.bounds import charged_lower_bound_ms, lower_bound_ms
from hf_cp.cost.config_files import ConfigError, resolve_config
from hf_cp.cost.dims import ModelDims
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.cost.model import CostModel
from hf_cp.cost.simulate import simulate
from hf_cp.modes.segments import ShardMode
from hf_cp.plan.cluster import ClusterSpec

QWEN3_NEXT = "qwen3-next-80b-a3b"  # hf_cp/configs/models: 12 full-attention layers of 48


@pytest.fixture(scope="module")
def costs():
    """The shipped Qwen3-Next dimensions, and the same priced as if every layer were softmax."""
    hybrid = ModelDims.load(QWEN3_NEXT)
    profile = HardwareProfile.load("h200-qwen2.5-7b")
    softmax = dataclasses.replace(hybrid, attention_layers=None)
    return CostModel(hybrid, profile), CostModel(softmax, profile)


def test_the_layer_mix_is_read_from_each_way_hybrids_state_it():
    base = {"hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4, "intermediate_size": 128}
    kinds = ["linear_attention"] * 3 + ["full_attention"]
    cases = [
        ({"layer_types": kinds * 2}, 2),  # Qwen3-Next, Qwen3.5, Kimi Linear
        ({"layer_types": ["sliding_attention", "full_attention"] * 4}, 8),  # Gemma 3: all softmax
        ({"layers_block_type": ["mamba"] * 6 + ["hybrid"] * 2}, 2),  # Zamba2's shared attention blocks
        ({"attn_layer_indices": [2, 5]}, 2),  # Bamba
        ({"attn_layer_indices": None}, 0),  # Bamba with no attention layer
        ({"attn_layer_period": 4, "attn_layer_offset": 1}, 2),  # Jamba
        ({}, None),  # a plain transformer
    ]
    for extra, softmax in cases:
        dims = ModelDims.from_hf_config({**base, **extra})
        assert dims.attention_layers == softmax, extra
        assert dims.softmax_layers == (8 if softmax is None else softmax)
    with pytest.raises(ConfigError, match="layer_types must name each of the 8 layers"):
        ModelDims.from_hf_config({**base, "layer_types": kinds})
    with pytest.raises(ConfigError, match="attn_layer_indices must be layer numbers below 8"):
        ModelDims.from_hf_config({**base, "attn_layer_indices": [9]})
    assert ModelDims.load(QWEN3_NEXT).attention_layers == 12 and ModelDims.load(QWEN3_NEXT).num_layers == 48


def test_attention_and_the_kv_exchange_are_priced_on_the_softmax_layers_only(costs):
    hybrid, softmax = costs
    n = 20000
    linear = (hybrid.dims.num_layers * hybrid.c1 + hybrid.head_ms_per_token) * n  # every layer
    assert hybrid.c1 == softmax.c1
    attention = softmax.sample_local_ms(n) - linear
    assert hybrid.sample_local_ms(n) - linear == pytest.approx(attention * 12 / 48, rel=1e-12)
    ranks = list(range(4))
    for mode in (ShardMode.RING_PER_DOC, ShardMode.RING_ZIGZAG, ShardMode.ULYSSES):
        mine = hybrid.distributed_rank_costs([n], mode, ranks, ranks)
        theirs = softmax.distributed_rank_costs([n], mode, ranks, ranks)
        for a, b in zip(mine, theirs):
            # the 36 linear layers pass state: each member sends its 2 pieces' [B | P] (32 value
            # heads x 128 x 256 float32) and 3 window rows (hidden 2048, 2 bytes) to the 3 others,
            # forward and backward (attention/state_passing.py)
            passed = 36 * 2 * 2 * 3 * (32 * 128 * 256 * 4 + 3 * 2048 * 2)
            assert a.comm_bytes - passed == pytest.approx(b.comm_bytes * 12 / 48, rel=1e-12), mode
    # ChunkFlow's K/V state store holds the softmax layers' keys and values
    assert hybrid.dims.kv_bytes_per_token(2) * 4 == softmax.dims.kv_bytes_per_token(2)


@pytest.mark.parametrize("balancer", ["static", "dynamic_cp", "wlb", "flexsp", "magi", "usp", "dcp", "auto"])
def test_every_plan_is_priced_alike_by_the_pricer_the_simulator_and_the_bounds(costs, balancer):
    hybrid, _ = costs
    rng = random.Random(1)
    lengths = [rng.randint(200, 9000) for _ in range(600)] + [150000, 90000, 40000]
    cluster = ClusterSpec(16, 32768, 8)
    req = PlanRequest(range(len(lengths)), lengths, cluster, hybrid, dataset_max_length=max(lengths))
    plan = get_balancer(balancer).plan(req).validate(cluster, hybrid)
    made = simulate(plan, hybrid).makespan_ms
    assert pricer_for(hybrid).makespan_ms(plan) == pytest.approx(made, rel=1e-9)
    assert lower_bound_ms(lengths, cluster, hybrid) <= charged_lower_bound_ms(lengths, cluster, hybrid) <= made


def _linear_layer_extra(hybrid, softmax, n, ranks):
    """Per member: (tokens, what the hybrid's linear layers add beyond a softmax model's own rows'
    c1 work, with the hybrid's attention on its 12 softmax layers)."""
    mine = hybrid.distributed_rank_costs([n], ShardMode.RING_PER_DOC, ranks, ranks)
    theirs = softmax.distributed_rank_costs([n], ShardMode.RING_PER_DOC, ranks, ranks)
    out = []
    for a, b in zip(mine, theirs):
        attention = b.compute_ms - (48 * softmax.c1 + softmax.head_ms_per_token) * b.tokens  # all 48 layers
        out.append((a.tokens, a.compute_ms - (b.compute_ms - attention * 36 / 48), a))
    return out


def test_a_spread_gated_deltanet_document_passes_state_each_member_its_own_rows(costs):
    """Qwen3-Next's Gated DeltaNet layers run a distributed document by state passing
    (attention/state_passing.py): each member runs its own rows, once more for the transition,
    and sends a few MB of state per piece, not its rows."""
    hybrid, softmax = costs
    n, ranks = 40000, list(range(4))
    d = hybrid.dims
    assert d.passed_state_elements == 32 * 128 * (128 + 128) and d.conv_window == 3
    for tokens, extra, _ in _linear_layer_extra(hybrid, softmax, n, ranks):
        assert extra == pytest.approx(36 * hybrid.c1 * d.mixer_share * tokens, rel=1e-12)
    # a quarter of the document's rows a member: about a quarter of its time, with the rerun
    assert max(
        c.compute_ms for _, _, c in _linear_layer_extra(hybrid, softmax, n, ranks)
    ) < 0.4 * hybrid.sample_local_ms(n)


def test_a_spread_mamba_document_runs_its_linear_layers_whole_on_every_member(costs):
    """Mamba-style layers gather a distributed document and run it whole on every member
    (attention/recurrent.py), so spreading it saves those layers' mixer nothing: each member pays
    the mixer's share of c1 for the tokens it did not own."""
    hybrid, softmax = costs
    gathering = CostModel(dataclasses.replace(hybrid.dims, passed_state_elements=0, conv_window=0), hybrid.profile)
    n, ranks = 40000, list(range(4))
    for tokens, extra, _ in _linear_layer_extra(gathering, softmax, n, ranks):
        redundant = 36 * gathering.c1 * gathering.dims.mixer_share * (n - tokens)
        assert redundant > 0.2 * gathering.sample_local_ms(n) / 4
        assert extra == pytest.approx(redundant, rel=1e-12)
    # a quarter of the document's rows a member, but far more than a quarter of its time
    worst = max(c.compute_ms for _, _, c in _linear_layer_extra(gathering, softmax, n, ranks))
    assert worst > 1.2 * gathering.sample_local_ms(n) / 4


def test_a_hybrids_step_takes_less_and_gains_less_over_static_than_all_softmax_pricing_says(costs):
    """Attention is a quarter of Qwen3-Next's layers: the step is cheaper and the long tail
    matters less, so auto's gain over static shrinks (1.91x -> 1.64x on the long-document trace
    at 64 ranks, hf-cp plan; here a 16-rank step of the same kind)."""
    rng = random.Random(2)
    lengths = [rng.randint(2000, 56000) for _ in range(40)]
    gains = []
    for cost in costs:
        cluster = ClusterSpec(16, 32768, 8)
        req = PlanRequest(range(len(lengths)), lengths, cluster, cost, dataset_max_length=max(lengths))
        auto, static = (simulate(get_balancer(b).plan(req), cost).makespan_ms for b in ("auto", "static"))
        gains.append((auto, static / auto))
    (hybrid_ms, hybrid_gain), (softmax_ms, softmax_gain) = gains
    assert hybrid_ms < 0.7 * softmax_ms and 1.0 <= hybrid_gain < softmax_gain


def test_hf_cp_plan_prints_the_layer_mix_it_priced(capsys, traces_dir, tmp_path):
    rc = main(["plan", "--lengths", str(traces_dir / "longdoc_leval_multiturn.txt"), "--world", "8", "--steps", "1",
               "--model", QWEN3_NEXT, "--progress", "off"])  # fmt: skip
    out = capsys.readouterr().out
    assert (
        rc == 0 and "layer mix priced: 12 softmax attention and 36 linear-attention or state-space layers of 48" in out
    )
    assert "the linear ones passing state across a CP group" in out
    plain = tmp_path / "config.json"
    cfg = json.loads(resolve_config(QWEN3_NEXT, "models", (".json",)).read_text())
    cfg.pop("layer_types")
    plain.write_text(json.dumps(cfg))
    assert main(["plan", "--lengths", str(traces_dir / "longdoc_leval_multiturn.txt"), "--world", "8", "--steps", "1",
                 "--model", str(plain), "--progress", "off"]) == 0  # fmt: skip
    assert "layer mix" not in capsys.readouterr().out
