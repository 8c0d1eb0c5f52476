"""The vision tower's memory in a rank's cap (issue 38): the activations of the images and clips a
rank encodes count against its cap beside its tokens, in the validator, the simulator's memory
report and every balancer's plan; a sample that fits no rank is refused by name."""

import random

import pytest

from hf_cp.balance.base import PlanRequest, VisionMemoryError
from hf_cp.balance.registry import get_balancer
from hf_cp.cost.dims import ModelDims, VisionDims
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.cost.model import CostModel
from hf_cp.cost.simulate import simulate
from hf_cp.cost.vision import alone_held_tokens
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import Group, PlanError, StepPlan, Wave
from hf_cp.plan.vision_encoders import assign_encoders, encoder_patch_bounds
from hf_cp.planning.predict import plan_and_predict

# Qwen2.5-VL-7B: a tower of 32 blocks of width 1280, a language model of 28 layers of width 3584;
# an image of 56 x 56 patches (784 placeholder tokens) holds 3136 x 32 x 1280 / (28 x 3584) =
# 1280 tokens of activations, exactly
IMAGE = (1, 56, 56)
IMAGE_TOKENS = 1280
CAP = 8192


@pytest.fixture(scope="module")
def vl_cost():
    return CostModel(
        ModelDims.load("qwen2.5-vl-7b"), HardwareProfile.load("h200-qwen2.5-7b"), None, VisionDims.load("qwen2.5-vl-7b")
    )


def test_an_items_activations_in_tokens_by_hand(vl_cost):
    assert 3136 * 32 * 1280 == IMAGE_TOKENS * 28 * 3584
    assert vl_cost.vision_tokens(3136) == IMAGE_TOKENS
    assert vl_cost.vision_tokens(3137) == IMAGE_TOKENS + 1  # rounded up
    assert vl_cost.vision_tokens(0) == 0
    # a sample alone: on one rank its tokens and its items'; spread over 2, its half and the item
    # on either member (which one encodes it depends on where its placeholders sit)
    assert alone_held_tokens(7000, (IMAGE,), 1, vl_cost) == 7000 + IMAGE_TOKENS
    assert alone_held_tokens(7000, (IMAGE,), 2, vl_cost) == 3500 + IMAGE_TOKENS


def _plan(groups, lengths, vision, waves=None):
    plan = StepPlan(2, CAP, list(range(len(lengths))), list(lengths), vision=vision, balancer="hand")
    plan.waves = waves or [Wave(groups)]
    return plan


def test_the_validator_refuses_a_rank_over_the_cap_with_its_encoders_activations(vl_cost):
    """7000 tokens fit a rank of 8192; with its image's 1280 tokens of activations they do not."""
    lengths, vision = [7000, 500], {0: (IMAGE,)}
    local = _plan([Group(ranks=(0,), local={0: [0]}), Group(ranks=(1,), local={1: [1]})], lengths, vision)
    local.validate(ClusterSpec(2, CAP))  # without a cost model: tokens only
    with pytest.raises(PlanError, match=r"rank 0 holds 8280 tokens, over the cap of 8192 .*3136 patches .*1280 tokens"):
        local.validate(ClusterSpec(2, CAP), vl_cost)
    # two samples that each fit their rank with their items, together over it (the bulk check)
    two = _plan([Group(ranks=(0,), local={0: [0, 1]})], [5000, 1000], {0: (IMAGE,), 1: (IMAGE,)})
    with pytest.raises(PlanError, match="rank 0 holds 8560 tokens"):
        two.validate(ClusterSpec(2, CAP), vl_cost)
    # spread over the group: each member holds its 3500 and may encode the image
    spread = _plan([Group(ranks=(0, 1), distributed=[0], mode="ring_per_doc"), Group(ranks=(1,), local={1: [1]})],
                   lengths, vision, waves=None)  # fmt: skip
    spread.waves = [Wave([Group(ranks=(0, 1), distributed=[0], mode="ring_per_doc")]),
                    Wave([Group(ranks=(1,), local={1: [1]})])]  # fmt: skip
    spread.validate(ClusterSpec(2, CAP), vl_cost)
    assert spread.held_tokens(spread.waves[0].groups[0], None, vl_cost) == [3500 + IMAGE_TOKENS] * 2
    # the simulator reports the same count as each rank's peak
    sim = simulate(local, vl_cost)
    assert sim.peak_tokens[0] == 7000 + IMAGE_TOKENS
    assert sim.peak_memory_bytes[0] == pytest.approx(vl_cost.memory_bytes(7000 + IMAGE_TOKENS))
    assert sim.peak_memory_bytes[0] == pytest.approx(
        vl_cost.profile.activation_bytes_per_token * 8280 + vl_cost.profile.static_bytes
    )


@pytest.mark.parametrize("balancer", ["dynamic_cp", "flexsp", "wlb", "static", "skrull", "libra", "magi", "auto"])
def test_a_sample_that_fits_as_text_but_not_with_its_image_is_spread(vl_cost, balancer):
    """Text-only accounting keeps the 7000-token sample on one rank (it fits 8192); its image's
    activations put that rank over: every balancer's plan spreads it (or moves work off its rank)
    and validates, its ranks' peaks within the cap."""
    cluster = ClusterSpec(2, CAP)
    lengths = [7000] + [600] * 12
    vision = {0: (IMAGE,), 3: ((1, 14, 14),)}
    req = PlanRequest(tuple(range(len(lengths))), tuple(lengths), cluster, vl_cost, vision=vision)
    bal = get_balancer(balancer)
    text = bal.plan(PlanRequest(req.sample_ids, req.lengths, cluster, vl_cost))
    text.vision = dict(vision)
    if text.cp_size_of_samples()[0] == 1:  # packed by tokens alone, it would not fit
        with pytest.raises(PlanError, match="vision activations"):
            text.validate(cluster, vl_cost)
    plan = bal.plan(req)
    plan.validate(cluster, vl_cost)
    assert plan.cp_size_of_samples()[0] == 2
    assert max(simulate(plan, vl_cost, cluster).peak_tokens) <= CAP
    assert plan_and_predict(bal, req).plan.to_dict() == plan.to_dict()  # the planner adds nothing


def test_a_plugin_balancer_packing_by_tokens_is_fitted_by_the_planner(vl_cost):
    """A balancer that knows nothing of vision (a plugin): the planner moves what overflows."""

    class Naive:
        name = "naive"

        def plan(self, req):
            plan = req.empty_plan(self.name)
            plan.waves = [Wave([Group(ranks=(0,), local={0: [0, 2]}), Group(ranks=(1,), local={1: [1, 3, 4]})])]
            return plan

    cluster = ClusterSpec(2, CAP)
    # rank 0: 7000 + 900 tokens, sample 0 over a rank alone with its image (8280); rank 1: 8100
    # tokens, 9380 with sample 3's image
    req = PlanRequest(range(5), (7000, 600, 900, 5000, 2500), cluster, vl_cost, vision={0: (IMAGE,), 3: (IMAGE,)})
    with pytest.raises(PlanError):
        Naive().plan(req).validate(cluster, vl_cost)
    planned = plan_and_predict(Naive(), req)
    plan = planned.plan.validate(cluster, vl_cost)
    # sample 0 spread over both ranks; sample 3 (rank 1's largest) in a micro-batch of its own on rank 1
    assert plan.cp_size_of_samples() == {0: 2, 1: 1, 2: 1, 3: 1, 4: 1}
    assert plan.waves[0].groups == [Group(ranks=(0,), local={0: [2]}), Group(ranks=(1,), local={1: [4, 1]})]
    assert [(g.ranks, g.local, g.distributed) for w in plan.waves[1:] for g in w.groups] == [
        ((1,), {1: [3]}, []),
        ((0, 1), {}, [0]),
    ]
    assert any("vision memory: samples [0, 3]" in n for n in plan.notes)
    assert max(planned.predicted.peak_tokens) <= CAP


def test_a_sample_whose_item_fits_no_rank_is_refused_by_name(vl_cost):
    """An image of 70 x 70 patches holds 2000 tokens of activations, whole on one rank: at a cap of
    2048 its 1300-token sample fits neither one rank (3300) nor a group of 2 (650 + 2000)."""
    assert vl_cost.vision_tokens(70 * 70) == 2000
    with pytest.raises(VisionMemoryError, match=r"sample 1 \(1300 tokens.*4900 patches\) fits no rank's memory") as e:
        PlanRequest((0, 1), (300, 1300), ClusterSpec(2, 2048), vl_cost, vision={1: ((1, 70, 70),)})
    msg = str(e.value)
    assert "holds 3300 tokens" in msg and "holds 2650" in msg and "cap of 2048" in msg and "2000 tokens" in msg
    # at a cap of 2700 a group of 2 holds it (650 + 2000)
    PlanRequest((0, 1), (300, 1300), ClusterSpec(2, 2700), vl_cost, vision={1: ((1, 70, 70),)})


def test_the_encoder_bound_holds_whatever_the_tokens_held_break_ties():
    """assign_encoders breaks ties by the tokens each member holds, which a plan does not know:
    under every draw of those, no member encodes more than encoder_patch_bounds says, and the
    bound is reached (it is the plan's own loads where no ties arise)."""
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 5)
        items = [rng.choice([4, 4, 8, 16, 64]) for _ in range(rng.randint(0, 7))]
        own = [rng.choice([0, 0, 4, 8, 16]) for _ in range(n)]
        bound = encoder_patch_bounds(items, own)
        reached = [0] * n
        for _ in range(30):
            held = [[rng.randint(0, 3) for _ in range(n)] for _ in items]
            load = list(own)
            for i, m in enumerate(assign_encoders(items, held, own)):
                load[m] += items[i]
            assert all(x <= b for x, b in zip(load, bound)), (items, own, held, load, bound)
            reached = [max(a, b) for a, b in zip(reached, load)]
        assert max(reached) == max(bound)
    # no ties: the plan's loads themselves
    assert encoder_patch_bounds([64, 16], [0, 8]) == [64, 24]
    # two members tied at nothing: the one image may go to either
    assert encoder_patch_bounds([64], [0, 0]) == [64, 64]
