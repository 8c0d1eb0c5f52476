"""The one MFU definition (hf_cp/cost/flops.py): model FLOPs from the model config and the step's
samples under their masks, the peak by device name, and what the logs and the summary show."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import LlamaConfig

from hf_cp.cost.config_files import ConfigError
from hf_cp.cost.flops import ModelFlops, achieved_tflops, device_peak, mfu
from hf_cp.plan.step_plan import StepPlan
from hf_cp.resources import find_named
from hf_cp.samples.masks import SampleMask
from hf_cp.train.data.collator import RankStep
from hf_cp.train.measure.metrics import StepThroughput, aggregate, summary_lines
from hf_cp.train.measure.record_builder import step_model_flops

from helpers.step_records import records


def _qwen_05b() -> dict:
    return json.loads(find_named("qwen2.5-0.5b", "models", (".json",)).read_text())


def test_model_flops_count_every_matmul_and_the_head_but_not_the_embedding():
    cfg = _qwen_05b()
    h, inter, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    assert cfg["tie_word_embeddings"], "the head is tied: its matmul still counts"
    # written out from the config: q and o (h x heads*d), k and v (h x kv*d), gate/up/down (h x inter)
    per_layer = 2 * h * heads * d + 2 * h * kv * d + 3 * h * inter
    flops = ModelFlops.from_config(cfg)
    assert flops.matmul_per_token == 6 * (layers * per_layer + vocab * h)
    # 4 x heads x head_dim per pair forward, x 3.5 forward + backward, every layer
    assert flops.attention_per_pair == pytest.approx(4 * heads * d * 3.5 * layers)
    # 0.5B: 6 x ~494M parameters less the 136M embedding, plus the 136M head (tied)
    assert flops.matmul_per_token == pytest.approx(6 * 494.0e6, rel=0.01)


def test_a_config_without_vocabulary_is_refused_by_name():
    cfg = {k: v for k, v in _qwen_05b().items() if k != "vocab_size"}
    with pytest.raises(ConfigError, match="vocab_size"):
        ModelFlops.from_config(cfg)


def _window_pairs(n: int, w: int) -> int:
    return sum(min(i + 1, w) for i in range(n))  # query i sees keys max(0, i - w + 1) .. i


def test_sample_flops_use_the_masked_area():
    flops = ModelFlops(matmul_per_token=10.0, attention_per_pair=3.0)
    lengths = [100, 7, 50]
    masks = [None, None, SampleMask.sliding_window(50, 8)]
    pairs = 100 * 101 // 2 + 7 * 8 // 2 + _window_pairs(50, 8)
    assert flops.samples(lengths, masks) == 10.0 * 157 + 3.0 * pairs
    with pytest.raises(ValueError, match="3 sample lengths but 2 masks"):
        flops.samples(lengths, masks[:2])


def test_step_flops_take_each_sample_mask_by_id():
    flops = ModelFlops(matmul_per_token=1.0, attention_per_pair=1.0)
    plan = StepPlan(world_size=1, max_tokens_per_rank=1000, sample_ids=[4, 9], lengths=[20, 30])
    step = RankStep(rank=0, index=3, epoch=0, plan=plan, waves=[], global_valid_tokens=48)
    causal = 50 + 20 * 21 // 2 + 30 * 31 // 2
    assert step_model_flops(step, flops, {}) == causal
    windowed = step_model_flops(step, flops, {9: SampleMask.sliding_window(30, 4)})
    assert windowed == 50 + 20 * 21 // 2 + _window_pairs(30, 4)


@pytest.mark.parametrize(
    "name, gpu, peak",
    [
        ("NVIDIA H200", "NVIDIA H200 SXM", 989.0),
        ("NVIDIA H200 NVL", "NVIDIA H200 NVL", 835.0),
        ("NVIDIA GH200 480GB", "NVIDIA GH200", 989.0),
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM", 989.0),
        ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe", 756.0),
        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100", 312.0),
        ("NVIDIA A100 80GB PCIe", "NVIDIA A100", 312.0),
    ],
)
def test_the_peak_is_found_by_device_name(name, gpu, peak):
    p = device_peak(name)
    assert (p.gpu, p.tflops) == (gpu, peak)
    assert f"{gpu} dense bf16 peak {peak:g} TFLOP/s" == p.describe()


def test_no_peak_on_cpu_or_an_unknown_gpu():
    for name in ("cpu", "NVIDIA GeForce GT 710"):
        p = device_peak(name)
        assert p.tflops is None and mfu(1e15, 1.0, 1, p) is None
        assert p.describe() == f"no dense bf16 peak known for {name}"


def test_mfu_is_flops_over_time_gpus_and_peak():
    h200 = device_peak("NVIDIA H200")
    assert achieved_tflops(8 * 494e12, 2.0, 8) == pytest.approx(247.0)
    assert mfu(8 * 494e12, 2.0, 8, h200) == pytest.approx(247.0 / 989.0)
    with pytest.raises(ValueError, match="positive time"):
        achieved_tflops(1.0, 0.0)


def _throughput(device_name: str, world: int):
    recs = records(world)
    t = StepThroughput(ModelFlops(matmul_per_token=1e9, attention_per_pair=1e5), device_peak(device_name))
    for r in recs:
        plan = StepPlan(world_size=world, max_tokens_per_rank=4096, sample_ids=[0, 1], lengths=[600, 400])
        t.observe(RankStep(rank=0, index=r.index, epoch=0, plan=plan, waves=[], global_valid_tokens=998), {})
    per_step = 1000 * 1e9 + (600 * 601 // 2 + 400 * 401 // 2) * 1e5
    wall_s = sum(r.step_wall_ms for r in recs) / 1e3
    return recs, t, per_step * len(recs) / wall_s / world / 1e12


def test_logs_carry_tflops_and_mfu_against_the_named_peak():
    recs, t, tflops = _throughput("NVIDIA H100 80GB HBM3", 8)
    logs = aggregate(recs, throughput=t)
    assert logs["cp/tflops"] == pytest.approx(tflops)
    assert logs["cp/mfu"] == pytest.approx(tflops / 989.0)
    assert "cp/tflops" not in aggregate(recs), "no throughput keys without the step FLOPs"
    line = summary_lines(recs, "auto", throughput=t)[-1]
    assert re.search(r"MFU \d+\.\d% of the NVIDIA H100 SXM dense bf16 peak 989 TFLOP/s", line), line
    assert f"{tflops:.3g} TFLOP/s per GPU over 8 rank(s)" in line


def test_on_cpu_the_summary_gives_tflops_and_says_why_there_is_no_mfu():
    recs, t, tflops = _throughput("cpu", 2)
    logs = aggregate(recs, throughput=t)
    assert logs["cp/tflops"] == pytest.approx(tflops) and "cp/mfu" not in logs
    line = summary_lines(recs, "auto", throughput=t)[-1]
    assert "MFU not reported: no dense bf16 peak known for cpu" in line


def test_steps_without_observed_flops_are_left_out():
    recs, t, _ = _throughput("NVIDIA H200", 2)
    del t.step_flops[recs[0].index]
    kept = recs[1:]
    assert aggregate(recs, throughput=t)["cp/tflops"] == pytest.approx(aggregate(kept, throughput=t)["cp/tflops"])
    assert aggregate(recs[:1], throughput=t).get("cp/tflops") is None


def test_throughput_for_a_transformers_model_config():
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    t = StepThroughput.for_model(cfg, torch.device("cpu"))
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128
    assert t.model.matmul_per_token == 6 * (2 * per_layer + 100 * 64)
    assert t.peak.device == "cpu" and t.peak.tflops is None
