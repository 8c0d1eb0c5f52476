import json

import pytest

from hf_cp.cost.blocks import block_group_costs
from hf_cp.cost.config_files import ConfigError
from hf_cp.cost.dims import ModelDims
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.cost.model import CostModel
from hf_cp.modes.segments import ShardMode
from hf_cp.modes.ulysses import ulysses_bytes_per_layer
from hf_cp.plan.block_layout import doc_slices, zigzag_layout
from hf_cp.samples.masks import SampleMask


def test_h200_profile_reproduces_calibration_fit(h200_cost):
    c = h200_cost
    calib = {"c1": 0.002411733715677996, "c2_sum_l2": 7.52989055941588e-08}
    # fitted on Qwen2.5-7B dims: coefficients are the fit's, unscaled
    assert c.c1 == pytest.approx(calib["c1"])
    assert c.c2 == pytest.approx(2 * calib["c2_sum_l2"])
    # one layer, one 16K document: the fit predicts the measured 59.5 ms within its 6% error
    one_layer = c.c1 * 16384 + c.c2 * 16384 * 16385 / 2 + c.c0
    assert one_layer == pytest.approx(59.54, rel=0.06)


def test_scaling_to_other_dims_follows_flops(h200_cost):
    llama = CostModel(ModelDims.load("llama-3-8b"), h200_cost.profile)
    d_q, d_l = h200_cost.dims, llama.dims
    assert llama.c1 / h200_cost.c1 == pytest.approx(d_l.linear_flops_per_token / d_q.linear_flops_per_token)
    assert llama.c2 / h200_cost.c2 == pytest.approx((32 * 128) / (28 * 128))


def test_chunk_efficiency_interpolates_and_is_monotone(h200_cost):
    e = [h200_cost.chunk_efficiency(q) for q in (1, 16, 32, 48, 64, 100, 4096, 100000)]
    assert e == sorted(e)
    assert h200_cost.chunk_efficiency(32) == pytest.approx(0.07487)
    assert 0.07487 < h200_cost.chunk_efficiency(48) < 0.14826
    assert h200_cost.chunk_efficiency(10**6) == 1.0


def test_attention_dominates_only_beyond_32k(h200_cost):
    c = h200_cost
    for n, attention_bigger in ((8192, False), (65536, True)):
        linear = c.c1 * n
        attn = c.c2 * n * (n + 1) / 2
        assert (attn > linear) == attention_bigger


def test_sharding_costs_more_in_total_than_local(h200_cost):
    # splitting a short document into tiny chunks wastes kernel efficiency
    n, g = 2048, 8
    ranks = list(range(g))
    per_doc = sum(h200_cost.distributed_rank_cost([n], ShardMode.RING_PER_DOC, ranks, m).compute_ms for m in ranks)
    assert per_doc > h200_cost.sample_local_ms(n)


def test_ulysses_bytes_formula_even_split(h200_cost):
    d = h200_cost.dims
    L, g = 8192, 4
    b = ulysses_bytes_per_layer(h200_cost, L // g, L, g)
    kv = max(d.num_kv_heads, g)
    expected = 2 * (L // g) * (g - 1) / g * d.head_dim * (2 * d.num_heads + 2 * kv) * 2
    assert b == pytest.approx(expected)


def test_ulysses_rejects_heads_that_do_not_divide(h200_cost):
    with pytest.raises(
        ValueError, match="group of 8 ranks needs the number of query heads to be divisible by 8; the model has 28"
    ):
        h200_cost.check_ulysses(8)  # 28 heads
    h200_cost.check_ulysses(4)


def test_model_config_errors_name_the_field(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ConfigError, match="num_attention_heads"):
        ModelDims.load(p)
    with pytest.raises(ConfigError, match="no model named 'nope'"):
        ModelDims.load("nope")


def test_profile_errors_name_the_field(tmp_path):
    good = HardwareProfile.load("h200-qwen2.5-7b").to_dict()
    HardwareProfile.from_dict(good)  # round trip
    bad = dict(good)
    del bad["c1_ms_per_token"]
    with pytest.raises(ConfigError, match="c1_ms_per_token"):
        HardwareProfile.from_dict(bad)
    bad = dict(good, chunk_efficiency={32: 0.5, 64: 0.3})
    with pytest.raises(ConfigError, match="must not decrease"):
        HardwareProfile.from_dict(bad)
    p = tmp_path / "p.yaml"
    p.write_text("c1_ms_per_token: [unclosed")
    with pytest.raises(ConfigError, match=str(p)):
        HardwareProfile.load(p)
    p.write_text("!!python/object/apply:os.system ['echo pwned']")
    with pytest.raises(ConfigError):  # safe loader: no code from profile files
        HardwareProfile.load(p)


def test_cp_message_ms_charges_every_exchange_message_of_a_group_unhidden():
    """Measured on 2 CPU ranks: a ring micro-batch costs ~17 ms beyond its compute and bytes (the
    members' rendezvous and ring steps at every layer), which attention does not hide."""
    from dataclasses import replace

    from hf_cp.cost.blocks import block_group_costs
    from hf_cp.modes.registry import mode_spec
    from hf_cp.plan.block_layout import zigzag_layout

    dims = ModelDims.load("tiny-llama")
    base = CostModel(dims, HardwareProfile.load("cpu"))
    synced = CostModel(dims, replace(base.profile, cp_message_ms=2.5))
    L, ranks = dims.num_layers, (0, 1, 2, 3)
    for mode in (ShardMode.RING_ZIGZAG, ShardMode.RING_PER_DOC, ShardMode.ULYSSES):
        for m in range(4):
            a = base.distributed_rank_cost([6000, 900], mode, ranks, m, [300])
            b = synced.distributed_rank_cost([6000, 900], mode, ranks, m, [300])
            assert b.compute_ms == a.compute_ms  # long attention hides the ring's bytes, not this
            assert b.comm_ms - a.comm_ms == pytest.approx(L * 2.5 * mode_spec(mode).comm_messages(4), rel=1e-12)
    # local work and one-rank groups exchange nothing
    assert synced.distributed_rank_cost([], ShardMode.RING_PER_DOC, ranks, 0, [3000]) == base.distributed_rank_cost(
        [], ShardMode.RING_PER_DOC, ranks, 0, [3000]
    )
    assert synced.distributed_rank_cost([3000], ShardMode.RING_PER_DOC, (0,), 0).comm_ms == 0.0
    # a blocks group: one message per peer in every phase that moves anything (a zigzag layout
    # runs every block where its queries live: K/V out twice and dK/dV back, 3 phases, as a ring)
    layout = zigzag_layout([6000, 900], 4, dims.num_heads)
    a = block_group_costs(layout, [6000, 900], ranks, base)
    b = block_group_costs(layout, [6000, 900], ranks, synced)
    for x, y in zip(a, b):
        assert y.compute_ms == x.compute_ms
        assert y.comm_ms - x.comm_ms == pytest.approx(L * 2.5 * 3 * 3, rel=1e-12)
    with pytest.raises(ConfigError, match="cp_message_ms must not be negative"):
        HardwareProfile.from_dict(dict(base.profile.to_dict(), cp_message_ms=-1), "p.yaml")


def test_model_state_bytes_follow_the_run_not_the_profile():
    """The memory model's static bytes are the run's model states: DeepSpeed's ZeRO stage, its
    precision and the world size, or the fp32 states of a run without DeepSpeed."""
    from types import SimpleNamespace

    from hf_cp.cost.execution import model_state_bytes_per_parameter as per_param
    from hf_cp.planning.setup import PlanningSettings, planning_setup

    assert per_param(False, 0, True, 8) == 16.0  # autocast: fp32 params, grads, Adam moments
    assert per_param(True, 2, True, 8) == 2 + 14 / 8
    assert per_param(True, 1, True, 4) == 4 + 12 / 4
    assert per_param(True, 3, False, 4) == 16 / 4
    assert per_param(True, 0, True, 4) == 16.0
    assert per_param(False, 0, True, 8, param_bytes=2) == 8.0  # a model built in bf16 stays in bf16

    lengths = [100, 200, 300]
    nominal = planning_setup(PlanningSettings(profile="h200-qwen2.5-7b", model_dims="qwen2.5-0.5b"), lengths, 8)
    args = SimpleNamespace(
        cp_balancer="auto",
        cp_balancer_options=None,
        cp_compare_balancer="",
        cp_profile="h200-qwen2.5-7b",
        cp_model_dims="qwen2.5-0.5b",
        cp_max_tokens_per_rank=32768,
        cp_tokens_per_step=None,
        cp_tokens_per_rank_per_step=65536,
        cp_max_group_size=None,
        cp_gpus_per_node=None,
        cp_chunk_size=None,
        cp_chunk_keep=1,
        seed=0,
        cp_shuffle=True,
        deepspeed={"zero_optimization": {"stage": 2}},
        bf16=True,
        cp_loss_chunk_tokens=None,
    )
    zero2 = planning_setup(PlanningSettings.from_training_args(args), lengths, 8)
    args.deepspeed = None
    plain = planning_setup(PlanningSettings.from_training_args(args), lengths, 8)
    args.cp_loss_chunk_tokens = 1024
    chunked = planning_setup(PlanningSettings.from_training_args(args), lengths, 8)
    params, vocab = nominal.cost.dims.parameters, nominal.cost.dims.vocab_size
    assert nominal.cost.profile.static_bytes == 41910000000  # the profile's nominal (7B, ZeRO-2 on 8)
    assert zero2.cost.profile.static_bytes == params * (2 + 14 / 8)
    assert plain.cost.profile.static_bytes == params * 16
    # the chunked loss's fp32 logits and their gradient: 1024 tokens x vocabulary x 8 bytes
    assert chunked.cost.profile.static_bytes == params * 16 + 1024 * vocab * 8
    # activations are untouched
    assert plain.cost.profile.activation_bytes_per_token == nominal.cost.profile.activation_bytes_per_token


def test_masked_rank_costs_and_block_group_costs_kept_by_the_model_are_the_values_computed_afresh():
    """A cost model keeps masked members' costs and blocks groups' costs (issue 39: auto's
    members and its pricer price the same groups): what it hands back again is what a fresh
    model computes, whatever was asked first."""

    def fresh():
        return CostModel.load("qwen2.5-7b", "h200-qwen2.5-7b")

    cost = fresh()
    lengths = [9000, 3000]
    masks = [SampleMask.shared_prompt(4000, [2000, 3000]), None]
    for mode in (ShardMode.RING_PER_DOC, ShardMode.RING_ZIGZAG):
        for g in (2, 4):
            ranks = list(range(g))
            group = cost.distributed_rank_costs(lengths, mode, ranks, ranks, {0: [700]}, masks)
            for m in reversed(ranks):
                local = [700] if m == 0 else []
                one = cost.distributed_rank_cost(lengths, mode, ranks, m, local, masks)
                assert one == group[m] == fresh().distributed_rank_cost(lengths, mode, ranks, m, local, masks)
                assert cost.distributed_rank_cost(lengths, mode, ranks, m, local, masks) is one  # kept
    layout = zigzag_layout(lengths, 4, cost.dims.num_heads, doc_slices(lengths, masks))
    args = (layout, lengths, range(4), cost, masks, {1: [500]}, {1: [SampleMask.shared_prompt(100, [200, 200])]})
    first = block_group_costs(*args)
    assert block_group_costs(*args) == first == block_group_costs(*args[:3], fresh(), *args[4:])
