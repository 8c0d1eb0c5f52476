"""Planning with the vision tower priced (issue 38): the tower's FLOPs and time, the grids that
reach the balancers, placements that change with the price, the simulator and bounds that count
it, the lengths file's `vision` field and `hf-cp plan` with it."""

import json
from dataclasses import replace

import numpy as np
import pytest

from hf_cp.balance.base import PlanRequest
from hf_cp.balance.registry import get_balancer
from hf_cp.balance.toolkit.pricing import pricer_for
from hf_cp.cli import main
from hf_cp.cost.bounds import charged_lower_bound_ms, lower_bound_ms
from hf_cp.cost.dims import ModelDims, VisionDims
from hf_cp.cost.flops import vision_item_flops
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.cost.model import CostModel
from hf_cp.cost.simulate import simulate
from hf_cp.cost.vision import group_vision, step_vision
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import Group, PlanError, StepPlan, Wave
from hf_cp.planning.predict import fitted_plan
from hf_cp.planning.setup import PlanningSettings, planning_setup
from hf_cp.planning.worker import Planner
from hf_cp.samples.lengths import LengthsError
from hf_cp.samples.plan_inputs import read_plan_inputs
from hf_cp.samples.vision_grids import VisionGridError, check_grids

# a tiny Qwen2.5-VL tower: 3 blocks, block 1 full attention, windows of 2 x 2 merged cells
TINY_TOWER = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=56,
    fullatt_block_indexes=[1],
    out_hidden_size=40,
    in_channels=3,
)
# grids whose windows tile evenly (2 frames of 6 x 4 cells) and unevenly (5 x 3 cells)
GRIDS = [(2, 12, 8), (1, 10, 6)]


def counted_tower_flops(dims, grids) -> int:
    """The tower's forward FLOPs on `grids` as VisionDims counts them: per patch, and per attended pair."""
    return sum(dims.forward_flops_per_patch * t * h * w + dims.forward_flops_per_pair * dims.attention_pairs((t, h, w))
               for t, h, w in grids)  # fmt: skip


@pytest.fixture(scope="module")
def vl_cost():
    """Qwen2.5-VL-7B's dimensions (LLM and tower) on the H200 profile."""
    return CostModel(
        ModelDims.load("qwen2.5-vl-7b"), HardwareProfile.load("h200-qwen2.5-7b"), None, VisionDims.load("qwen2.5-vl-7b")
    )


def tiny_tower():
    import torch
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    cfg = Qwen2_5_VLVisionConfig(**TINY_TOWER)
    cfg._attn_implementation = "eager"  # explicit matmuls, which the FLOP counter sees
    torch.manual_seed(0)
    return Qwen2_5_VisionTransformerPretrainedModel(cfg).eval(), cfg


def test_tower_forward_flops_equal_torch_flop_counter(one_torch_thread):
    """The count per patch and per attended pair against torch's FlopCounterMode on a real
    Qwen2.5-VL tower: every matmul (patch embedding, qkv, proj, MLP, merger) and every window's
    and frame's attention, an uneven window cut included."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    model, cfg = tiny_tower()
    dims = VisionDims.from_hf_config(cfg.to_dict(), source="tiny tower")
    assert dims.window_cells == 2 and dims.full_attention_layers == 1
    for grids in ([GRIDS[0]], [GRIDS[1]], GRIDS):
        patches = sum(t * h * w for t, h, w in grids)
        x = torch.randn(patches, 3 * 2 * 14 * 14)
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model(x, grid_thw=torch.tensor(grids))
        assert counter.get_total_flops() == counted_tower_flops(dims, grids), grids


def test_qwen2_vl_tower_flops_equal_torch_flop_counter(one_torch_thread):
    """Qwen2-VL's tower (width embed_dim, a two-matrix MLP of mlp_ratio, full attention per frame in
    every block) read from its config and counted as torch counts it."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    cfg = Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=40, mlp_ratio=3, num_heads=2, patch_size=14)
    cfg._attn_implementation = "eager"
    model = Qwen2VisionTransformerPretrainedModel(cfg).eval()
    dims = VisionDims.from_hf_config(cfg.to_dict())
    assert (dims.hidden, dims.intermediate, dims.out_hidden, dims.gated_mlp) == (32, 96, 40, False)
    assert dims.window_attention_layers == 0
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.randn(sum(t * h * w for t, h, w in GRIDS), 3 * 2 * 14 * 14), grid_thw=torch.tensor(GRIDS))
    assert counter.get_total_flops() == counted_tower_flops(dims, GRIDS)


def test_qwen3_vl_tower_with_deepstack_flops_equal_torch_flop_counter(one_torch_thread):
    """Qwen3-VL's tower, its DeepStack mergers (one after each block of deepstack_visual_indexes,
    each the final merger's shape) included, counted as torch counts it."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    cfg = Qwen3VLVisionConfig(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                              out_hidden_size=40, num_position_embeddings=16, deepstack_visual_indexes=[0, 2])  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen3VLVisionModel(cfg).eval()
    dims = VisionDims.from_hf_config(cfg.to_dict())
    assert dims.deepstack_mergers == 2 and dims.full_attention_layers == 3 and not dims.gated_mlp
    grids = [(2, 8, 12), (1, 4, 8)]
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 4 * 4), grid_thw=torch.tensor(grids))
    assert counter.get_total_flops() == counted_tower_flops(dims, grids)
    by_module = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    deepstack = (
        by_module["Qwen3VLVisionModel.deepstack_merger_list.0"]
        + by_module["Qwen3VLVisionModel.deepstack_merger_list.1"]
    )
    assert deepstack == 2 * by_module["Qwen3VLVisionModel.merger"] > 0


def test_deepstack_mergers_priced_on_qwen3_vl(vl_cost):
    """Qwen3-VL's own config (transformers' defaults: 27 blocks of width 1152, DeepStack after blocks
    8, 16 and 24, merge 2, out 3584): per item, the tower with DeepStack costs the tower without it
    plus exactly its mergers' FLOPs at the profile's matmul rate: per merged cell and merger, two
    linears of (1152 x 4)^2 and (1152 x 4) x 3584 (2 FLOPs a parameter forward, 3x that forward and
    backward) and the 3584 additions into the language model's hidden states (forward only)."""
    from transformers import Qwen3VLConfig

    cfg = Qwen3VLConfig().to_dict()
    vc = cfg["vision_config"]
    dims = VisionDims.from_hf_config(cfg)
    bare = replace(dims, deepstack_visual_indexes=())
    assert dims.deepstack_visual_indexes == tuple(vc["deepstack_visual_indexes"]) == (8, 16, 24)
    wide = vc["hidden_size"] * vc["spatial_merge_size"] ** 2
    per_cell = len(vc["deepstack_visual_indexes"]) * (
        3 * 2 * (wide * wide + wide * vc["out_hidden_size"]) + vc["out_hidden_size"]
    )
    cost = CostModel(ModelDims.from_hf_config(cfg), vl_cost.profile, None, dims)
    without = CostModel(cost.dims, vl_cost.profile, None, bare)
    for grid in [(1, 32, 48), (8, 24, 32)]:
        cells = grid[0] * grid[1] * grid[2] // vc["spatial_merge_size"] ** 2
        (m, a), (m0, a0) = vision_item_flops(dims, grid), vision_item_flops(bare, grid)
        assert (m - m0, a - a0) == (per_cell * cells, 0)
        assert cost.vision_item_ms(grid) - without.vision_item_ms(grid) == pytest.approx(
            per_cell * cells * cost.ms_per_matmul_flop, rel=1e-9
        )
        assert cost.vision_item_ms(grid) > without.vision_item_ms(grid)
    # Qwen3.5's tower has no DeepStack: priced as before
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config

    assert VisionDims.from_hf_config(Qwen3_5Config().to_dict()).deepstack_mergers == 0


def test_window_cut_follows_transformers_window_index():
    """The windows' lengths are those of transformers' get_vision_window_index (cu_window_seqlens)."""
    import torch
    from transformers.vision_utils import get_vision_window_index

    dims = VisionDims.from_hf_config(TINY_TOWER)
    for grid in [*GRIDS, (3, 14, 22), (1, 4, 4)]:
        _, cu = get_vision_window_index(torch.tensor([grid]), 2, 56, 14)
        seqlens = np.diff(torch.unique_consecutive(torch.as_tensor(cu)).numpy())  # in patches
        counts = dict(zip(*np.unique(seqlens, return_counts=True)))
        assert dict(dims.window_lengths(grid)) == {int(n): int(k) for n, k in counts.items()}, grid


def test_vision_dims_read_from_a_vl_config_and_refused_without_one():
    from transformers import Qwen2_5_VLConfig

    cfg = Qwen2_5_VLConfig(vision_config=TINY_TOWER).to_dict()
    assert VisionDims.from_hf_config(cfg) == VisionDims.from_hf_config(TINY_TOWER)
    with pytest.raises(ValueError, match="no vision tower dimensions"):
        VisionDims.from_hf_config({"hidden_size": 8}, source="text.json")
    with pytest.raises(ValueError, match="fullatt_block_indexes"):
        VisionDims.from_hf_config(dict(TINY_TOWER, fullatt_block_indexes=[7]))


def test_tower_time_uses_the_llm_profile_rates(vl_cost):
    """Matmuls at the profile's ms per matmul FLOP (c1 over its fitted FLOPs per token),
    attention at its ms per attention FLOP over the kernel efficiency of each window's length:
    a profile with twice the c1 doubles exactly the matmul part."""
    grid = (4, 36, 64)
    v = vl_cost.vision
    fd = vl_cost.profile.fitted_dims
    matmul, attention = vision_item_flops(v, grid)
    assert matmul == 3 * v.forward_flops_per_patch * 4 * 36 * 64
    assert attention == 3.5 * v.forward_flops_per_pair * v.attention_pairs(grid)
    attn_ms = sum(
        k
        * n
        * n
        * 3.5
        * v.forward_flops_per_pair
        * vl_cost.profile.c2_ms_per_pair
        / fd.attention_flops_per_pair
        / vl_cost.chunk_efficiency(n)
        for n, k in v.attention_runs(grid)
    )
    matmul_ms = matmul * vl_cost.profile.c1_ms_per_token / fd.linear_flops_per_token
    assert vl_cost.vision_item_ms(grid) == pytest.approx(matmul_ms + attn_ms, rel=1e-12)
    doubled = vl_cost.with_profile(replace(vl_cost.profile, c1_ms_per_token=2 * vl_cost.profile.c1_ms_per_token))
    assert doubled.vision_item_ms(grid) == pytest.approx(2 * matmul_ms + attn_ms, rel=1e-12)
    assert doubled.vision is v  # a refit keeps the tower


def test_text_only_cost_model_refuses_vision_by_name(h200_cost):
    cluster = ClusterSpec(2, 8192)
    with pytest.raises(ValueError, match="vision tower's dimensions"):
        PlanRequest((0, 1), (500, 600), cluster, h200_cost, vision={1: ((1, 14, 14),)})


def _plan(world, cap, groups, lengths, vision):
    plan = StepPlan(world, cap, list(range(len(lengths))), list(lengths), vision=vision)
    plan.waves = [Wave(groups)]
    return plan


def test_simulator_counts_each_item_on_its_encoder(vl_cost):
    """A local sample's items on its rank; a distributed sample's items one per member (LPT by
    patches, plan/vision_encoders.assign_encoders); activations on the encoding rank."""
    clip, image = (8, 24, 32), (1, 28, 28)
    lengths = [4000, 3000]
    vision = {0: (clip, image), 1: (image,)}
    groups = [Group(ranks=(0, 1), distributed=[0], mode="ring_per_doc", local={1: [1]})]
    with_v = simulate(_plan(2, 16384, groups, lengths, vision), vl_cost)
    assert pricer_for(vl_cost).makespan_ms(_plan(2, 16384, groups, lengths, vision)) == pytest.approx(
        with_v.makespan_ms
    )
    text = simulate(_plan(2, 16384, groups, lengths, {}), vl_cost)
    # the clip goes to the member with least encoder work: member 0 (member 1 encodes sample 1's image)
    assert [v.patches for v in group_vision(groups[0], vision, vl_cost)] == [8 * 24 * 32, 2 * 28 * 28]
    assert with_v.compute_ms[0] - text.compute_ms[0] == pytest.approx(vl_cost.vision_item_ms(clip))
    assert with_v.compute_ms[1] - text.compute_ms[1] == pytest.approx(2 * vl_cost.vision_item_ms(image))
    # the clip's activations on member 0: its patches x (tower depth x width) / (LLM layers x
    # width) tokens (32 x 1280 over 28 x 3584 for Qwen2.5-VL-7B), rounded up, at alpha bytes a token
    clip_tokens = -(-8 * 24 * 32 * 32 * 1280 // (28 * 3584))
    assert clip_tokens == 2508
    assert with_v.peak_memory_bytes[0] - text.peak_memory_bytes[0] == pytest.approx(
        vl_cost.profile.activation_bytes_per_token * clip_tokens
    )
    assert with_v.peak_tokens[0] - text.peak_tokens[0] == clip_tokens
    # a local sample's items on its rank, in a one-rank group
    one = simulate(_plan(2, 16384, [Group(ranks=(0,), local={0: [0, 1]})], lengths, vision), vl_cost)
    bare = simulate(_plan(2, 16384, [Group(ranks=(0,), local={0: [0, 1]})], lengths, {}), vl_cost)
    assert one.compute_ms[0] - bare.compute_ms[0] == pytest.approx(vl_cost.vision_ms([clip, image, image]))


def test_bounds_count_encoder_time(vl_cost):
    """The encoder work joins the world's work, and no item is encoded faster than alone: one
    huge clip bounds a step of short samples."""
    cluster = ClusterSpec(8, 32768)
    lengths = [30000] + [300] * 20
    vision = {0: ((240, 20, 24),)}
    sv = step_vision(range(len(lengths)), vision, vl_cost)
    item = vl_cost.vision_item_ms((240, 20, 24))
    assert sv.largest_item_ms == item
    text = lower_bound_ms(lengths, cluster, vl_cost)
    assert text < item  # the text alone would let the step end before the clip is encoded
    assert lower_bound_ms(lengths, cluster, vl_cost, vision=sv) == pytest.approx(item)
    assert charged_lower_bound_ms(lengths, cluster, vl_cost, vision=sv) >= item
    many = {s: ((2, 28, 28),) for s in range(1, 21)}
    sv = step_vision(range(len(lengths)), many, vl_cost)
    base = lower_bound_ms(lengths, ClusterSpec(1, 65536), vl_cost)
    assert lower_bound_ms(lengths, ClusterSpec(1, 65536), vl_cost, vision=sv) == pytest.approx(
        base + 20 * vl_cost.vision_item_ms((2, 28, 28))
    )


def test_charged_bound_holds_a_distributed_clip_group_and_stays_below_plans(vl_cost, traces_dir):
    """On a full step of the bundled vision trace (8 ranks): a sample over the cap keeps its
    group waiting for its clip's encoder, which the charged bound counts (above the bound that
    lets encoder time spread), no balancer's plan beats it, and the balancers' pricer agrees with
    the simulator."""
    inputs = read_plan_inputs(traces_dir / "vision_videomme_mix.jsonl")
    # a cap the trace's longest clips fit (at 32768 a clip's activations alone overflow a rank)
    settings = PlanningSettings(model_dims="qwen2.5-vl-7b", compare_balancer=None, max_tokens_per_rank=131072)
    setup = planning_setup(settings, inputs.lengths, 8, vision=vl_cost.vision)
    batch = setup.sampler[0]
    grids = {s: inputs.vision[s] for s in batch.sample_ids if s in inputs.vision}
    sv = step_vision(batch.sample_ids, grids, setup.cost)
    tight = charged_lower_bound_ms(batch.lengths, setup.cluster, setup.cost, vision=sv)
    spread = charged_lower_bound_ms(batch.lengths, setup.cluster, setup.cost, vision=replace(sv, sample_grids=()))
    assert tight > 1.01 * spread
    req = PlanRequest(batch.sample_ids, batch.lengths, setup.cluster, setup.cost, vision=grids)
    # some sample with a clip is over one rank's memory with its activations: its group waits for the encoder
    assert any(
        m > setup.cluster.max_tokens_per_rank and s in grids for s, m in zip(batch.sample_ids, req.memory_length_array)
    )
    pricer = pricer_for(setup.cost)
    for name in ("dynamic_cp", "wlb", "auto"):
        plan = fitted_plan(get_balancer(name), req)  # as the planner runs it: within the vision memory
        plan.validate(setup.cluster, setup.cost)
        sim = simulate(plan, setup.cost, setup.cluster)
        assert sim.charged_bound_ms == pytest.approx(tight)
        assert tight <= sim.makespan_ms, name
        # the balancers' fast pricer counts the encoders as the simulator does
        assert pricer.makespan_ms(plan) == pytest.approx(sim.makespan_ms, rel=1e-9), name


@pytest.mark.parametrize("balancer", ["dynamic_cp", "wlb", "auto"])
def test_vision_pricing_keeps_a_big_clip_off_a_full_rank(vl_cost, balancer):
    """Text-only pricing packs a sample with a big clip beside as much text as any other rank
    holds, and its rank ends last by the clip's encoder time; priced, the clip's rank gets less
    text, and the step (simulated with the tower either way) is faster, never above the bound."""
    cluster = ClusterSpec(4, 32768)
    lengths = [6000] + [500] * 60
    vision = {0: ((24, 28, 28),)}  # 4704 tokens of the 6000
    req = PlanRequest(tuple(range(len(lengths))), tuple(lengths), cluster, vl_cost, vision=vision)
    bal = get_balancer(balancer)
    aware = bal.plan(req)
    text = bal.plan(replace(req, vision=None))
    assert aware.vision == vision and text.vision == {}
    text.vision = dict(vision)
    sa, st = simulate(aware, vl_cost, cluster), simulate(text, vl_cost, cluster)
    assert sa.makespan_ms < 0.97 * st.makespan_ms
    assert sa.makespan_ms >= sa.charged_bound_ms * (1 - 1e-9)

    # priced, the clip's rank holds less text than the others do on average
    tokens = [0] * 4
    clip_rank = None
    for w in aware.waves:
        for g in w.groups:
            for m, t in enumerate(aware.member_tokens(g)):
                tokens[g.ranks[m]] += t
            clip_rank = next((r for r, ids in g.local.items() if 0 in ids), clip_rank)
    assert clip_rank is not None and tokens[clip_rank] < 0.9 * sum(tokens) / 4


def test_plan_carries_its_grids_through_json(vl_cost):
    plan = _plan(
        2, 8192, [Group(ranks=(0,), local={0: [0]}), Group(ranks=(1,), local={1: [1]})], [800, 900], {1: ((2, 14, 14),)}
    )
    back = StepPlan.from_dict(json.loads(plan.to_json()))
    assert back.vision == {1: ((2, 14, 14),)}
    assert "vision" not in _plan(1, 8192, [Group(ranks=(0,), local={0: [0]})], [5], {}).to_dict()
    plan.vision[7] = ((1, 2, 2),)
    with pytest.raises(PlanError, match="vision grids are given for sample 7"):
        plan.validate(ClusterSpec(2, 8192), vl_cost)
    bad = json.loads(back.to_json())
    bad["vision"] = {"1": [[2, 14]]}
    with pytest.raises(PlanError, match=r"sample 1: vision\[0\]"):
        StepPlan.from_dict(bad)


def _jsonl(tmp_path, rows, name="v.jsonl"):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


def test_lengths_file_reads_vision_grids(tmp_path):
    p = _jsonl(
        tmp_path,
        [
            {"length": 300},
            {"length": 2000, "vision": [[1, 36, 64], [2, 14, 14]]},
            "",
            {"prompt": 100, "answers": [20, 30], "vision": [[1, 14, 14]]},
            {"length": 50, "vision": []},
        ],
    )
    inputs = read_plan_inputs(p)
    assert inputs.lengths == [300, 2000, 150, 50]
    assert inputs.vision == {1: ((1, 36, 64), (2, 14, 14)), 2: ((1, 14, 14),)}
    assert set(inputs.masks) == {2}
    assert "2 with images or clips (3 items)" in inputs.describe()


@pytest.mark.parametrize(
    "row, message",
    [
        ({"length": 20, "vision": [[1, 2]]}, r"line 2: field 'vision'\[0\] must be \[t, h, w\]"),
        ({"length": 20, "vision": [[1, 0, 2]]}, r"line 2: field 'vision'\[0\]"),
        ({"length": 20, "vision": [[1, 2.5, 2]]}, r"line 2: field 'vision'\[0\]"),
        ({"length": 20, "vision": "img.png"}, r"line 2: field 'vision' must be a list"),
        ({"length": -3}, r"line 2: field 'length' must be a positive token count"),
        ({"length": True}, r"line 2: field 'length'"),
        ({"tokens": 5}, r'line 2: expected a record \{"length": N\}'),
    ],
)
def test_lengths_file_refuses_bad_rows_by_line_and_field(tmp_path, row, message):
    with pytest.raises(LengthsError, match=message):
        read_plan_inputs(_jsonl(tmp_path, [{"length": 5}, row]))


def test_grids_checked_against_the_merge_and_the_length():
    assert check_grids({3: ((1, 4, 6),)}, {3: 6}, 2) == {3: ((1, 4, 6),)}
    with pytest.raises(VisionGridError, match="sample 3: vision\\[0\\] = \\[1, 5, 6\\]: h and w must be multiples"):
        check_grids({3: ((1, 5, 6),)}, {3: 100}, 2, label=lambda s: f"sample {s}")
    with pytest.raises(
        VisionGridError, match="sample 3: its vision grids make 6 placeholder tokens, more than its length 5"
    ):
        check_grids({3: ((1, 4, 6),)}, {3: 5}, 2, label=lambda s: f"sample {s}")


def test_hf_cp_plan_takes_vision_lengths(capsys, tmp_path):
    p = _jsonl(
        tmp_path,
        [{"length": 300}, {"length": 2000, "vision": [[1, 36, 64]]}, {"length": 9000, "vision": [[32, 24, 42]]}] * 4,
    )
    # the 9000-token sample's clip holds 13166 tokens of activations: its fullest member of 4 holds 15416
    common = ["plan", "--lengths", str(p), "--world", "4", "--max-tokens-per-rank", "16384", "--steps", "1"]
    assert (
        main(common + ["--model", "qwen2.5-vl-7b", "--balancer", "dynamic_cp", "--json", str(tmp_path / "o.json")]) == 0
    )
    out = capsys.readouterr().out
    assert "8 with images or clips (8 items)" in out and "vision tower priced: 32 blocks, hidden 1280" in out
    assert "vision pricing: dynamic_cp planning these steps with the vision tower unpriced (LLM tokens only)" in out
    plans = json.loads((tmp_path / "o.json").read_text())["plans"]
    assert any(plan.get("vision") for plan in plans)
    # the plans resimulate with their grids (the tower from --vision-model)
    assert (
        main(
            [
                "plan",
                "--plan-json",
                str(tmp_path / "o.json"),
                "--model",
                "qwen2.5-7b",
                "--vision-model",
                "qwen2.5-vl-7b",
            ]
        )
        == 0
    )
    capsys.readouterr()
    # a text-only model without --vision-model is refused by name; with it the run goes on
    assert main(common + ["--model", "qwen2.5-7b"]) == 2
    err = capsys.readouterr().err
    assert "8 samples have vision grids" in err and "--vision-model" in err
    assert main(common + ["--model", "qwen2.5-7b", "--vision-model", "qwen2.5-vl-7b"]) == 0
    capsys.readouterr()
    bad = _jsonl(tmp_path, [{"length": 300}, {"length": 20, "vision": [[1, 28, 28]]}], "bad.jsonl")
    assert main(["plan", "--lengths", str(bad), "--world", "2", "--model", "qwen2.5-vl-7b"]) == 2
    assert "sample 1 (record 2): its vision grids make 196 placeholder tokens" in capsys.readouterr().err


def test_hf_cp_plan_shows_what_vision_pricing_gains_on_the_video_trace(capsys, traces_dir):
    """The bundled Video-MME-shaped trace at world 64 (issue 38's acceptance): auto's first full
    step planned with the encoder priced against the same balancer pricing LLM tokens only, both
    simulated with the encoder's work (scripts/bench_vision_planning.py: 1.059x on this step)."""
    rc = main(["plan", "--lengths", str(traces_dir / "vision_videomme_mix.jsonl"), "--model", "qwen2.5-vl-7b",
               "--world", "64", "--max-tokens-per-rank", "131072", "--tokens-per-rank-per-step", "65536",
               "--steps", "1", "--compare-balancer", "none", "--progress", "off"])  # fmt: skip
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("vision pricing: auto"))
    gain = float(line.rsplit(",", 1)[1].split("x")[0])
    assert rc == 0 and gain > 1.03, line


def test_planning_setup_grids_reach_every_request(vl_cost):
    """PlanningSetup.vision -> Planner.from_setup -> each step's PlanRequest (its own samples only)."""
    settings = PlanningSettings(
        balancer="dynamic_cp", compare_balancer=None, model_dims="qwen2.5-vl-7b", tokens_per_step=5000
    )
    lengths = [1000] * 10
    setup = planning_setup(settings, lengths, 2, vision=vl_cost.vision)
    setup.vision = {3: ((1, 28, 28),), 8: ((2, 14, 14),)}
    planner = Planner.from_setup(setup, lookahead=0)
    seen = {}
    for k in range(len(setup.sampler)):
        batch = setup.sampler[k]
        req = planner.request(batch)
        assert set(req.vision or {}) <= set(batch.sample_ids)
        seen.update(req.vision or {})
        assert planner.get(k).plan.vision == (req.vision or {})
    assert seen == setup.vision


def test_trainer_reads_the_grid_columns():
    from datasets import Dataset

    from hf_cp.train.setup.trainer_setup import planning_vision_grids

    ds = Dataset.from_dict(
        {
            "input_ids": [[1], [2], [3]],
            "image_grid_thw": [[[1, 4, 4]], None, [[1, 2, 2], [1, 6, 2]]],
            "video_grid_thw": [None, [[4, 2, 2]], []],
        }
    )
    tower = object()  # any tower: only its presence matters here
    assert planning_vision_grids(ds, tower) == {0: ((1, 4, 4),), 1: ((4, 2, 2),), 2: ((1, 2, 2), (1, 6, 2))}
    assert planning_vision_grids(ds, None) == {}
    assert planning_vision_grids(Dataset.from_dict({"input_ids": [[1]]}), tower) == {}
    bad = Dataset.from_dict({"input_ids": [[1]], "image_grid_thw": [[[1, 4]]]})
    with pytest.raises(VisionGridError, match="train dataset: sample 0: image_grid_thw\\[0\\]"):
        planning_vision_grids(bad, tower)


def test_cptrainer_plans_its_vision_samples_with_the_models_tower(tmp_path):
    """CPTrainer on a tiny Qwen2.5-VL and a dataset of a processor's columns: the planning setup
    holds every sample's grids and the tower of the model's own vision_config, and each step's
    plan carries its samples' grids (what the simulator and the balancer priced)."""
    from datasets import Dataset

    from hf_cp.train import CPTrainer, CPTrainingArguments

    from helpers.harness.models import vision_rows
    from helpers.tiny_vlm import build_vlm

    rows = vision_rows([120, 40, 60, 30, 90, 50], seed=0)
    model = build_vlm("hf_cp")
    trainer = CPTrainer(
        model=model,
        args=CPTrainingArguments(
            output_dir=str(tmp_path),
            use_cpu=True,
            cp_max_tokens_per_rank=256,
            cp_tokens_per_step=256,
            max_steps=1,
            report_to=[],
        ),
        train_dataset=Dataset.from_list(rows),
    )
    setup = trainer.cp_setup

    def grids(row):
        return tuple(
            tuple(int(x) for x in g)
            for key in ("image_grid_thw", "video_grid_thw")
            if row.get(key) is not None
            for g in np.asarray(row[key]).reshape(-1, 3).tolist()
        )

    want = {i: grids(r) for i, r in enumerate(rows)}
    assert setup.vision == {i: g for i, g in want.items() if g} and setup.vision
    assert setup.cost.vision == VisionDims.from_hf_config(model.config.to_dict())
    planned = Planner.from_setup(setup, lookahead=0).get(0)
    assert planned.plan.vision == {s: setup.vision[s] for s in planned.plan.sample_ids if s in setup.vision}
