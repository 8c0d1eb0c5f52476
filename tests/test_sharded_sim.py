"""The simulator under parameter-sharding executions (FSDP2, ZeRO-3): every pass of a wave's pass
sequence (StepPlan.wave_passes) pays its parameter communication, overlapped with compute, and
dummy passes pay theirs; hand-computed step times and the price of an extra wave."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hf_cp.cost.dims import ModelDims
from hf_cp.cost.execution import execution_named
from hf_cp.cost.hardware import HardwareProfile, Link
from hf_cp.cost.model import CostModel
from hf_cp.cost.sharded import chunked_pass_ms, place_compute_ms, sharded_wave_ms
from hf_cp.cost.simulate import simulate
from hf_cp.plan.chunks import chunked_sample_cost
from hf_cp.plan.passes import chunked_passes, merge_passes
from hf_cp.plan.step_plan import ChunkedSample, Group, StepPlan, Wave

TINY = ModelDims.load("tiny-llama")  # 2 layers, hidden 64, intermediate 128, 4 heads, 2 KV heads of 16, vocab 256
CPU = HardwareProfile.load("cpu")
TINY_LAYER = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128
TINY_ROOT = 2 * 256 * 64
TINY_PARAMS = 2 * TINY_LAYER + TINY_ROOT


def test_parameter_communication_of_a_pass_by_hand():
    assert TINY.parameters == TINY_PARAMS
    element = CPU.bytes_per_element
    for world, link in ((2, CPU.links["intra_node"]), (16, CPU.links["inter_node"])):  # 8 ranks per node
        per_ms = link.bandwidth_gbps * 1e6  # bytes per ms
        steps_ms = (world - 1) * link.latency_us * 1e-3  # one ring collective's latency
        share = (world - 1) / world
        forward = share * TINY_PARAMS * element / per_ms + 3 * steps_ms  # 2 layers + the root
        reduce_scatter = share * TINY_PARAMS * element / per_ms + 3 * steps_ms
        fsdp2 = CostModel(TINY, CPU, execution_named("fsdp2"))
        zero3 = CostModel(TINY, CPU, execution_named("zero3"))
        for cost in (fsdp2, zero3):
            assert cost.parameter_pass_comm_ms(world, backward=False) == pytest.approx(forward)
        # FSDP2's root stays gathered from forward to backward: the backward gathers the layers only
        layers_again = share * 2 * TINY_LAYER * element / per_ms + 2 * steps_ms
        assert fsdp2.parameter_pass_comm_ms(world, backward=True) == pytest.approx(layers_again + reduce_scatter)
        assert zero3.parameter_pass_comm_ms(world, backward=True) == pytest.approx(forward + reduce_scatter)
    for name in ("zero2", "zero2-overlap", "ddp"):
        assert CostModel(TINY, CPU, execution_named(name)).parameter_pass_comm_ms(8, backward=True) == 0.0
    assert CostModel(TINY, CPU, execution_named("fsdp2")).parameter_pass_comm_ms(1, backward=True) == 0.0


def test_place_compute_and_wave_time_by_hand():
    passes = merge_passes(["fFBFB", "FB", ""])
    assert passes == "fFBFB"  # rank 1's micro-batch meets rank 0's kept chunk
    dummy = {"f": 0.1, "F": 0.1, "B": 0.2}
    places = place_compute_ms(passes, ["fFBFB", "FB", ""], [[1, 2, 3, 4, 5], [10, 20], []], dummy)
    assert places == [1, 10, 20, 4, 5]
    # each place lasts max(compute, communication): forwards 3 ms, backwards 6 ms
    assert sharded_wave_ms(passes, places, 3.0, 6.0) == 3 + 10 + 20 + 4 + 6
    # a wave of dummies only costs its communication
    assert sharded_wave_ms("FB", place_compute_ms("FB", ["", ""], [[], []], dummy), 3.0, 6.0) == 9.0
    with pytest.raises(ValueError, match="1 pass times"):
        place_compute_ms("FB", ["FB"], [[1.0]], dummy)
    with pytest.raises(ValueError, match="do not fit"):
        place_compute_ms("FB", ["FBFB"], [[1.0, 2.0, 3.0, 4.0]], dummy)


@pytest.mark.parametrize("sizes, keep", [([1000, 1000, 1000], 1), ([900, 800, 700, 600], 2), ([500, 400], 3)])
def test_chunked_pass_times_follow_the_schedule_and_sum_to_the_sample(sizes, keep):
    cost = CostModel(TINY, CPU)
    ms = chunked_pass_ms(cost, sizes, keep)
    assert len(ms) == len(chunked_passes(len(sizes), keep))
    assert sum(ms) == pytest.approx(chunked_sample_cost(cost, sizes, keep).compute_ms)
    assert all(t > 0 for t in ms)


def _two_rank_plan(extra_wave: bool = False) -> StepPlan:
    waves = [Wave([Group(ranks=(0,), local={0: [0]}), Group(ranks=(1,), local={1: [1]})])]
    if extra_wave:  # rank 1 alone: rank 0 runs dummy passes
        waves.append(Wave([Group(ranks=(1,), local={1: [2]})]))
    return StepPlan(
        world_size=2,
        max_tokens_per_rank=4096,
        sample_ids=[0, 1, 2] if extra_wave else [0, 1],
        lengths=[3000, 500, 100] if extra_wave else [3000, 500],
        waves=waves,
    )


def test_one_wave_under_fsdp2_by_hand():
    plan = _two_rank_plan()
    prof = replace(CPU, reduction_overhead_ms=7.0, step_overhead_ms=11.0)
    fs = prof.forward_share
    compute = CostModel(TINY, prof)
    a = compute.sample_local_ms(3000) + compute.micro_batch_overhead_ms()
    # fast links: compute hides the communication, the wave is rank 0's forward and backward
    fast = CostModel(TINY, prof, execution_named("fsdp2"))
    assert fast.parameter_pass_comm_ms(2, True) < (1 - fs) * a
    s = simulate(plan, fast)
    assert s.makespan_ms == pytest.approx(a + 7.0 + 11.0)
    assert s.parameter_comm_ms == pytest.approx(0.0) and s.reductions == 1
    assert sum(s.busy_ms) + sum(s.idle_ms) == pytest.approx(2 * s.makespan_ms)
    # a link so slow that communication outlasts compute: the passes take their communication
    slow_link = Link(bandwidth_gbps=1e-5, latency_us=50.0)
    slow = CostModel(
        TINY, replace(prof, links={"intra_node": slow_link, "inter_node": slow_link}), execution_named("fsdp2")
    )
    forward, backward = slow.parameter_pass_comm_ms(2, False), slow.parameter_pass_comm_ms(2, True)
    assert forward > fs * a and backward > (1 - fs) * a
    s = simulate(plan, slow)
    assert s.makespan_ms == pytest.approx(forward + backward + 7.0 + 11.0)
    assert s.parameter_comm_ms == pytest.approx(forward + backward - a)
    assert s.reduction_ms == pytest.approx(7.0)


def test_a_chunked_wave_under_fsdp2_runs_the_merged_passes():
    # rank 0: one sample as 3 dependent chunks (K=1): "ffFBFBFB"; rank 1: one short sample whose
    # forward and backward meet rank 0's last chunk. Three backwards, three reduce-scatters (ZeRO-2
    # pads a fourth on the last wave; sharded passes need none)
    plan = StepPlan(
        world_size=2,
        max_tokens_per_rank=4096,
        sample_ids=[0, 1],
        lengths=[3000, 500],
        waves=[
            Wave(
                [
                    Group(ranks=(0,), chunked={0: [ChunkedSample(0, 1000, 1)]}),
                    Group(ranks=(1,), local={1: [1]}),
                ]
            )
        ],
    )
    assert plan.wave_passes() == ["ffFBFBFB"]
    prof = replace(CPU, reduction_overhead_ms=7.0, step_overhead_ms=11.0)
    cost = CostModel(TINY, prof, execution_named("fsdp2"))
    chain = chunked_sample_cost(CostModel(TINY, prof), [1000, 1000, 1000], 1).compute_ms
    s = simulate(plan, cost)
    assert s.reductions == 3
    # rank 0 computes at every place and outlasts rank 1 and the (fast) communication everywhere
    assert s.makespan_ms == pytest.approx(chain + 3 * 7.0 + 11.0)


@pytest.mark.parametrize("world", [2, 8])
def test_an_extra_wave_costs_more_under_fsdp2_than_under_zero2(h200_cost, world):
    def plan(extra: bool) -> StepPlan:
        p = _two_rank_plan(extra)
        p.world_size = world  # ranks 2.. run dummies in every wave
        return p

    delta = {}
    for name in ("zero2", "zero2-overlap", "fsdp2", "zero3"):
        cost = CostModel(h200_cost.dims, h200_cost.profile, execution_named(name))
        delta[name] = simulate(plan(True), cost).makespan_ms - simulate(plan(False), cost).makespan_ms
    # by hand, the extra wave (one rank runs 100 tokens): under ZeRO-2 its compute, then one
    # reduce-scatter of all gradients; under FSDP2 a forward and a backward place, each as long
    # as its communication or its compute
    dims, prof = h200_cost.dims, h200_cost.profile
    link = prof.links["intra_node"]
    per_ms, latency, share = link.bandwidth_gbps * 1e6, link.latency_us * 1e-3, (world - 1) / world
    params_bytes = dims.parameters * prof.bytes_per_element
    layers_bytes = dims.num_layers * dims.linear_params_per_layer * prof.bytes_per_element
    ring_steps = world - 1
    reduce_scatter = share * params_bytes / per_ms + ring_steps * latency
    gather_all = share * params_bytes / per_ms + (dims.num_layers + 1) * ring_steps * latency
    gather_layers = share * layers_bytes / per_ms + dims.num_layers * ring_steps * latency
    scatter_all = share * params_bytes / per_ms + (dims.num_layers + 1) * ring_steps * latency
    c = h200_cost.sample_local_ms(100) + h200_cost.micro_batch_overhead_ms()
    fs = prof.forward_share
    assert delta["zero2"] == pytest.approx(c + reduce_scatter)
    assert delta["fsdp2"] == pytest.approx(max(fs * c, gather_all) + max((1 - fs) * c, gather_layers + scatter_all))
    assert delta["zero3"] == pytest.approx(max(fs * c, gather_all) + max((1 - fs) * c, gather_all + scatter_all))
    # a 7B model's gathers dwarf a 100-token wave: sharded engines price an extra wave far higher
    for name in ("fsdp2", "zero3"):
        assert delta[name] > 1.5 * delta["zero2"] and delta[name] > 1.5 * delta["zero2-overlap"]
