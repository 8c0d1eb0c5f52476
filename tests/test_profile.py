"""`hf-cp profile`: shard attention, fits, adaptive sizes, and the acceptance run on the tiny model."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from hf_cp.cli import main
from hf_cp.cost.dims import ModelDims
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.cost.model import CostModel
from hf_cp.profiling import fit_quality, measure, nonnegative_lstsq
from hf_cp.profiling.layers import DecoderStack, RankWork
from hf_cp.profiling.shard_attention import SegmentLayout

# timings and fits measured with one thread, as `hf-cp profile` does by default
pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --------------------------------------------------------------------------- shard attention
def _reference(q, k, v):
    """Causal attention over one whole document, [T, H, D] in and out (GQA by repetition)."""
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    return F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    ).transpose(0, 1)


def test_segments_attend_to_their_whole_prefix_exactly():
    """Query segments with prefix keys give the rows of whole-document causal attention, and the
    same gradients (what a ring rank computes, without the communication)."""
    torch.manual_seed(0)
    H, HKV, D = 4, 2, 8
    doc_a, doc_b = 50, 23
    qa, ka, va = (torch.randn(doc_a, h, D) for h in (H, HKV, HKV))
    qb, kb, vb = (torch.randn(doc_b, h, D) for h in (H, HKV, HKV))
    # segments: doc a positions 30..49 (prefix 0..29 remote), doc b whole, doc a positions 7..11
    layout = SegmentLayout([(30, 20), (0, doc_b)], "cpu")
    q = torch.cat([qa[30:], qb]).requires_grad_()
    k = torch.cat([ka[30:], kb]).requires_grad_()
    v = torch.cat([va[30:], vb]).requires_grad_()
    pk, pv = ka[:30].clone().requires_grad_(), va[:30].clone().requires_grad_()
    out = layout.attend(q, k, v, pk, pv, scale=1 / math.sqrt(D))
    ref_a, ref_b = _reference(qa, ka, va), _reference(qb, kb, vb)
    torch.testing.assert_close(out[:20], ref_a[30:])
    torch.testing.assert_close(out[20:], ref_b)
    # gradients: compare with the dense reference on the same leaves
    g = torch.randn_like(out)
    out.backward(g)
    qa2, ka2, va2 = (t.clone().requires_grad_() for t in (qa, ka, va))
    _reference(qa2, ka2, va2)[30:].backward(g[:20])
    torch.testing.assert_close(q.grad[:20], qa2.grad[30:])
    torch.testing.assert_close(k.grad[:20], ka2.grad[30:])
    torch.testing.assert_close(pk.grad, ka2.grad[:30])


def test_segment_layout_rejects_missing_prefix_and_bad_segments():
    layout = SegmentLayout([(5, 4)], "cpu")
    q, k = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="start up to position 5"):
        layout.attend(q, k, k, torch.randn(3, 2, 8), torch.randn(3, 2, 8))
    with pytest.raises(ValueError, match="segment 1"):
        SegmentLayout([(0, 4), (2, 0)], "cpu")


def test_decoder_layer_matches_transformers_sdpa_on_one_document():
    """The profiled layer is the model's own layer: with our attention it computes what
    transformers' SDPA path computes on the same weights."""
    stack = DecoderStack("tiny-llama", num_layers=1, device="cpu")
    prepared = stack.prepare(RankWork(((0, 40),)))
    layer = stack.layers[0]
    ours = layer(prepared.hidden, position_embeddings=prepared.position_embeddings, shard_plan=prepared)
    layer.self_attn.config._attn_implementation = "sdpa"
    try:
        theirs = layer(prepared.hidden, position_embeddings=prepared.position_embeddings, attention_mask=None)
    finally:
        layer.self_attn.config._attn_implementation = stack.config._attn_implementation
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- timing
def test_cpu_timing_counts_this_process_work_not_waiting():
    """With one thread a CPU time is this process's CPU time: time the core spends elsewhere
    (here: sleeping, on a shared machine: other processes) is not counted."""
    import time

    from hf_cp.profiling.timing import time_each

    a = torch.randn(256, 256)
    work = lambda: [a @ a for _ in range(20)]  # noqa: E731

    def work_and_wait():
        work()
        time.sleep(0.05)

    t_work, t_both = time_each([work, work_and_wait], torch.device("cpu"), warmup=1, repeats=3)
    assert 0 < t_work and t_both < t_work + 25.0  # the 50 ms of sleep are not in it
    with pytest.raises(ValueError, match="repeats"):
        time_each([work], torch.device("cpu"), repeats=0)


# --------------------------------------------------------------------------- fits
def test_nonnegative_lstsq_recovers_coefficients_and_never_goes_negative():
    rng = np.random.default_rng(0)
    T = rng.integers(100, 5000, 20).astype(float)
    P = rng.integers(1e4, 1e7, 20).astype(float)
    y = 0.01 * T + 2e-6 * P + 0.5
    c1, c2, c0 = nonnegative_lstsq(np.c_[T, P, np.ones(20)], y)
    assert c1 == pytest.approx(0.01, rel=1e-6) and c2 == pytest.approx(2e-6, rel=1e-6)
    assert c0 == pytest.approx(0.5, rel=1e-5)
    # data whose unconstrained intercept is negative: the fit pins it at zero instead
    y2 = 0.01 * T - 3.0
    sol = nonnegative_lstsq(np.c_[T, np.ones(20)], y2)
    assert sol[1] == 0.0 and sol[0] > 0
    unconstrained = np.linalg.lstsq(np.c_[T, np.ones(20)], y2, rcond=None)[0]
    assert unconstrained[1] < 0


def test_fit_quality_numbers():
    q = fit_quality([1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 5.0])
    assert q.r2 == pytest.approx(1 - 1 / 5)
    assert q.max_rel_err == pytest.approx(0.25)
    assert fit_quality([2.0, 4.0], [2.0, 4.0]).r2 == 1.0


def test_compositions_keep_the_token_count():
    comps = measure.compositions(2048, 32)
    assert "uniform_2048" in comps and "uniform_32" in comps and "uniform_16" not in comps
    for name, lens in comps.items():
        assert sum(lens) == 2048 and min(lens) > 0, name
    assert all(sum(v) < 2048 for v in measure.token_series(2048, 32).values())


def test_sizes_shrink_until_a_run_fits_the_budget(monkeypatch):
    """On a slow device the composition length halves until one document fits the time budget."""
    stack = DecoderStack("tiny-llama", num_layers=1, device="cpu")
    seen = []

    def fake_time_each(fns, device, warmup=1, repeats=3):  # the first two sizes are too slow
        return [1e9 if len(seen) < 3 else 1.0 for _ in fns]

    real_prepare = stack.prepare

    def prepare(work):
        seen.append(work.tokens)
        return real_prepare(work)

    monkeypatch.setattr(measure, "time_each", fake_time_each)
    monkeypatch.setattr(stack, "prepare", prepare)
    st = measure.choose_settings(stack, max_tokens=2048, log=lambda s: None)
    assert seen == [2048, 1024, 512]
    assert st.tokens == 512
    assert st.chunk_keys == 256 and st.chunk_q_lens[-1] == 256 and st.min_doc >= 16


# --------------------------------------------------------------------------- acceptance
@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "cpu.yaml"
    rc = main(["profile", "--model", "tiny-llama", "--out", str(out), "--device", "cpu"])
    assert rc == 0
    return out


def test_profile_of_the_tiny_model_fits_its_own_measurements(tiny_profile):
    prof = HardwareProfile.load(tiny_profile)  # what `hf-cp plan --profile` reads
    assert prof.c1_ms_per_token > 0 and prof.c2_ms_per_pair > 0 and prof.c0_ms >= 0
    assert prof.fitted_dims == ModelDims.load("tiny-llama")
    assert prof.bytes_per_element == 4 and prof.activation_bytes_per_token > 2 * 64 * 4
    effs = [e for _, e in prof.chunk_efficiency]
    assert effs == sorted(effs) and effs[-1] == 1.0 and effs[0] < 1.0
    assert all(f >= 1.0 for _, f in prof.head_split_factor)

    cal = yaml.safe_load(tiny_profile.read_text())["calibration"]
    st = cal["settings"]
    rows = {r["name"]: r for r in cal["layer"]}
    comps = {**measure.compositions(st["tokens"], st["min_doc"]), **measure.token_series(st["tokens"], st["min_doc"])}
    assert set(comps) == set(rows)
    # the written coefficients predict the recorded measurements through the planner's own CostModel
    one_layer = CostModel(dataclasses.replace(prof.fitted_dims, num_layers=1, vocab_size=0), prof)
    measured, predicted = [], []
    for name, lens in comps.items():
        p = one_layer.c0 + one_layer.local_ms(lens)
        assert p == pytest.approx(rows[name]["predicted_ms"], rel=1e-3)
        measured.append(rows[name]["ms"])
        predicted.append(p)
    quality = fit_quality(measured, predicted)
    assert quality.r2 >= 0.9, f"layer fit R^2 {quality.r2:.3f} on {len(measured)} runs: {cal['layer']}"
    assert quality.r2 == pytest.approx(cal["layer_fit"]["r2"], abs=1e-3)
    text = tiny_profile.read_text()
    assert "# command: hf-cp profile --model tiny-llama" in text and "nominal" in text


def test_profile_feeds_the_planner(tiny_profile, tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [300, 40, 900, 120, 60, 1500, 80, 200]))
    rc = main(
        [
            "plan",
            "--lengths",
            str(lengths),
            "--world",
            "4",
            "--model",
            "tiny-llama",
            "--profile",
            str(tiny_profile),
            "--max-tokens-per-rank",
            "512",
            "--tokens-per-rank-per-step",
            "800",
            "--steps",
            "1",
        ]
    )
    assert rc == 0
    assert "predicted time / lower bound" in capsys.readouterr().out


def test_profile_names_a_missing_model(tmp_path, capsys):
    rc = main(["profile", "--model", "no-such-model", "--out", str(tmp_path / "p.yaml"), "--device", "cpu"])
    assert rc == 2
    assert "no-such-model" in capsys.readouterr().err
    assert not (tmp_path / "p.yaml").exists()
