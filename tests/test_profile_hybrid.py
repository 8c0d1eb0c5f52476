"""`hf-cp profile` on a hybrid (issue 36): its softmax attention layer gives c1, c2 and c0, its
linear-time (Gated DeltaNet) layer its own per-token rate, and the cost model prices each kind of
layer at its rate. A hybrid that does not name its layer kinds is refused, not profiled on
whichever layer comes first."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from hf_cp.cli import main
from hf_cp.cost.dims import ModelDims
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.cost.model import CostModel
from hf_cp.planning.calibration import Coefficients

HYBRID = dict(
    model_type="qwen3_next", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=4096,
    layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, num_experts=0, decoder_sparse_step=1, mlp_only_layers=[0, 1, 2, 3],
)  # fmt: skip


@pytest.fixture(scope="module")
def hybrid_profile(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_profile")
    (root / "config.json").write_text(json.dumps(HYBRID))
    out = root / "profile.yaml"
    assert main(["profile", "--model", str(root / "config.json"), "--out", str(out), "--device", "cpu", "--quick"]) == 0
    return out


def test_a_hybrid_profile_measures_its_linear_layer_apart(hybrid_profile):
    prof = HardwareProfile.load(hybrid_profile)
    assert prof.c1_ms_per_token > 0 and prof.c2_ms_per_pair > 0
    assert prof.linear_layer_ms_per_token > 0
    text = hybrid_profile.read_text()
    assert "# The hybrid's Qwen3NextDecoderLayer layer fwd+bwd on one document" in text
    # the softmax layer was timed for c1/c2: its compositions' times grow with attended pairs
    rows = {r["name"]: r["ms"] for r in yaml.safe_load(text)["calibration"]["layer"]}
    assert rows["uniform_512"] > 1.2 * rows["uniform_32"], rows


def test_the_cost_model_prices_each_kind_of_layer_at_its_own_rate(hybrid_profile):
    prof = HardwareProfile.load(hybrid_profile)
    dims = ModelDims.from_hf_config(HYBRID)
    measured = CostModel(dims, prof)
    as_softmax = CostModel(dims, dataclasses.replace(prof, linear_layer_ms_per_token=0.0))
    n = 3000
    # the same attention and head; the 3 linear layers at their rate instead of c1's
    ratio = dims.linear_flops_per_token / prof.fitted_dims.linear_flops_per_token
    expected = 3 * (prof.linear_layer_ms_per_token - prof.c1_ms_per_token) * ratio * n
    assert measured.sample_local_ms(n) - as_softmax.sample_local_ms(n) == pytest.approx(expected, rel=1e-9)
    assert measured.head_ms_per_token == as_softmax.head_ms_per_token
    # a calibration that rescales c1 moves the linear layers' rate with it
    k = Coefficients.of(prof)
    scaled = dataclasses.replace(k, c1_ms_per_token=2 * k.c1_ms_per_token).apply(prof)
    assert scaled.linear_layer_ms_per_token == pytest.approx(2 * prof.linear_layer_ms_per_token)


def test_a_hybrid_that_does_not_name_its_layer_kinds_is_refused(tmp_path, capsys):
    bamba = dict(
        model_type="bamba", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32,
        mamba_d_state=8,
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(bamba))
    rc = main(["profile", "--model", str(tmp_path / "config.json"), "--out", str(tmp_path / "p.yaml"), "--device", "cpu",
               "--quick"])  # fmt: skip
    assert rc != 0
    err = capsys.readouterr().err
    assert "measures a hybrid's softmax and linear-time layers apart" in err and "bamba" in err
    assert not (tmp_path / "p.yaml").exists()
