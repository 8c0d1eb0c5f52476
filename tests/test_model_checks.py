"""Model features hf_cp does not keep exact are refused when the trainer (or the dry run) is
built, by name, never run: token mixers outside the attention interface (Gated DeltaNet, Mamba,
Mamba2, short convolutions, sparse indexers), attention dropout and the MoE
router's auxiliary loss. Each case builds a tiny real transformers model; the same family with
the feature off (or a plain attention family) is accepted, so a refusal cannot pass by accident.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_cp.attention.interface  # noqa: F401  (registers attn_implementation "hf_cp")
from hf_cp.attention.recurrent import attach_recurrent_layers
from hf_cp.train.checks.model import (
    attention_bypassing_interface,
    check_model_config_supported,
    check_model_supported,
    check_recurrent_layers_fit,
    model_refusals,
    token_mixers_bypassing_attention,
)
from hf_cp.train.checks.setup import SetupError

from helpers import REPO
from helpers.harness.models import synthetic_rows

SMALL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=256,  # the byte tokens of synthetic_rows and the bundled data
    max_position_embeddings=128,
    use_cache=False,
)


def _config(model_type: str, **extra):
    return AutoConfig.for_model(model_type, **{**SMALL, **extra})


def _model(model_type: str, **extra):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(model_type, **extra), attn_implementation="hf_cp")


HYBRIDS = {
    # family: (config overrides that keep both layer kinds, the mixer class named in the refusal)
    "bamba": (dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8), "BambaMixer"),
    "falcon_h1": (dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=8), "FalconH1Mixer"),
    "jamba": (
        dict(
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            num_experts=2,
            mamba_d_state=8,
            mamba_dt_rank=4,
        ),
        "JambaMamba",
    ),
    "lfm2": (dict(layer_types=["conv", "full_attention"]), "Lfm2ShortConv"),
    # a Mamba2 layer whose per-document run does not match yet: refused even after attaching
    "granitemoehybrid": (
        dict(
            layer_types=["mamba", "attention"],
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            num_local_experts=2,
            num_experts_per_tok=1,
        ),
        "GraniteMoeHybridMambaLayer",
    ),
}
HONOURED = ("bamba", "falcon_h1", "jamba", "lfm2")  # run per document once attached (test_recurrent_mixers.py)


@pytest.mark.parametrize("family", sorted(HYBRIDS))
def test_token_mixers_outside_attention_are_refused_by_class(family):
    extra, mixer = HYBRIDS[family]
    model = _model(family, **extra)
    with pytest.raises(SetupError, match=rf"mixes tokens outside the attention interface .*class [^)]*{mixer}"):
        check_model_supported(model)
    assert any(mixer in cls for _, cls in token_mixers_bypassing_attention(model))
    attach_recurrent_layers(model)  # what CPTrainer does: honoured families pass, the others stay refused
    assert (model_refusals(model) == []) == (family in HONOURED), model_refusals(model)


def test_gated_deltanet_layers_are_accepted_and_run_per_document():
    # hf_cp/attention/recurrent.py runs them one document at a time (tests/test_recurrent_mixers.py)
    model = _model(
        "qwen3_next",
        layer_types=["linear_attention", "full_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    with pytest.raises(SetupError, match="Qwen3NextGatedDeltaNet"):  # as transformers runs them: refused
        check_model_supported(model)
    assert attach_recurrent_layers(model) == ["Qwen3NextGatedDeltaNet"]
    assert model_refusals(model) == []
    assert token_mixers_bypassing_attention(model) == []


def test_plain_attention_families_pass():
    for family in ("llama", "qwen2", "qwen3_moe", "mistral", "gemma3_text"):
        model = _model(family)
        assert model_refusals(model) == [], family
    # the vision tower of a VL model is not a token mixer of its language model
    assert token_mixers_bypassing_attention(_model("llama")) == []


def test_an_attention_class_that_computes_attention_itself_is_refused():
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("bloom", n_layer=2, hidden_size=32, n_head=4))
    assert attention_bypassing_interface(model) == ["BloomAttention"]
    with pytest.raises(SetupError, match="BloomAttention computes attention itself"):
        check_model_supported(model)


def test_softcapping_is_honoured_and_dropout_refused():
    # Gemma 2's soft-capped attention runs the capping kernel (test_attention_kernels.py; exact
    # under CP in test_model_families.py's sweep), so the set-up check lets it through
    cap = _model("gemma2", layer_types=["full_attention"] * 2, attn_logit_softcapping=50.0)
    assert model_refusals(cap) == []
    with pytest.raises(SetupError, match=r"attention dropout attention_dropout=0.1 .* set attention_dropout=0"):
        check_model_supported(_model("llama", attention_dropout=0.1))


def test_the_moe_router_term_is_honoured_where_exact_and_refused_by_name_elsewhere(monkeypatch):
    import sys

    from hf_cp.train.step.router_balance import RouterBalance, router_balance_of

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    on = _model("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.01, **moe)
    assert model_refusals(on) == []  # computed over the step (step/router_balance.py, tests/test_trainer_exactness.py)
    assert router_balance_of(on) == RouterBalance(0.01, 4, 2, "qwen3_moe")
    assert router_balance_of(_model("qwen3_moe", output_router_logits=False, router_aux_loss_coef=0.01, **moe)) is None
    with pytest.raises(SetupError, match=r"router z-loss \(router_z_loss_coef=0.001\)"):
        router_balance_of(_model("qwen3_moe", output_router_logits=True, router_z_loss_coef=1e-3, **moe))
    mixtral = dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01)
    assert router_balance_of(_model("mixtral", **mixtral)) == RouterBalance(0.01, 4, 2, "mixtral")
    with pytest.raises(SetupError, match=r"mixtral: router_jitter_noise=0.1 routes each forward at random"):
        router_balance_of(_model("mixtral", router_jitter_noise=0.1, **mixtral))
    # a family whose own term is another formula is refused, not computed as Switch Transformer's
    module = sys.modules[type(on).__module__]
    real = module.load_balancing_loss_func
    monkeypatch.setattr(module, "load_balancing_loss_func", lambda *a: real(*a) * 1.01)
    with pytest.raises(SetupError, match=r"qwen3_moe: the MoE router's auxiliary loss .* is not Switch Transformer's"):
        router_balance_of(on)


def test_chunked_attention_and_a_models_own_dense_mask_are_refused_at_set_up():
    # before: both ran until hf_cp's attention refused them at the first forward
    llama4 = dict(attention_chunk_size=16, layer_types=["chunked_attention", "full_attention"], no_rope_layers=[1, 0])
    with pytest.raises(SetupError, match=r"chunked attention \(attention_chunk_size 16"):
        check_model_supported(_model("llama4_text", **llama4))
    assert model_refusals(_model("llama4_text", **dict(llama4, layer_types=["full_attention"] * 2))) == []
    with pytest.raises(SetupError, match=r"attention class DogeAttention builds a dense mask of its own"):
        check_model_supported(_model("doge"))


def test_the_trainer_refuses_when_it_is_built(tmp_path):
    from datasets import Dataset

    from hf_cp.train import CPTrainer, CPTrainingArguments

    args = CPTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        cp_max_tokens_per_rank=256,
        cp_tokens_per_step=500,
        cp_compare_balancer=None,
        cp_profile="cpu",
    )
    ds = Dataset.from_list(synthetic_rows([100, 80, 30]))
    extra, _ = HYBRIDS["granitemoehybrid"]
    with pytest.raises(SetupError, match=r"(?s)CPTrainer: the model cannot be trained exactly.*GraniteMoeHybridMamba"):
        CPTrainer(model=_model("granitemoehybrid", **extra), args=args, train_dataset=ds)
    CPTrainer(model=_model("llama"), args=args, train_dataset=ds)  # the same set-up with an attention-only model
    # the MoE router term: computed, except where it cannot be (refused when built, not at the first step)
    mixtral = dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01)
    CPTrainer(model=_model("mixtral", **mixtral), args=args, train_dataset=ds)
    with pytest.raises(SetupError, match="mixtral: router_jitter_noise=0.1"):
        CPTrainer(model=_model("mixtral", router_jitter_noise=0.1, **mixtral), args=args, train_dataset=ds)
    args.cp_balancer = "chunkflow"
    with pytest.raises(SetupError, match="mixtral: the MoE router's load-balancing term .* ChunkFlow"):
        CPTrainer(model=_model("mixtral", **mixtral), args=args, train_dataset=ds)


def test_the_dry_run_refuses_what_the_trainer_would(tmp_path):
    from hf_cp.train.launch.dry_run import dry_run

    config = tmp_path / "granite.json"
    extra, _ = HYBRIDS["granitemoehybrid"]
    config.write_text(json.dumps(_config("granitemoehybrid", **extra).to_dict()))
    tiny = str(REPO / "configs" / "tiny-cpu.yaml")
    with pytest.raises(SetupError, match=r"(?s)the model cannot be trained exactly.*GraniteMoeHybridMamba"):
        dry_run(tiny, [f"training.output_dir={tmp_path}", f"model.config={config}"], world_size=2, steps=2)
    with pytest.raises(SetupError, match="GraniteMoeHybridMamba"):  # on the meta device: no weights allocated
        check_model_config_supported(_config("granitemoehybrid", **extra))
    check_model_config_supported(_config("bamba", **HYBRIDS["bamba"][0]))  # attached as CPTrainer does
    bamba = tmp_path / "bamba.json"
    bamba.write_text(json.dumps(_config("bamba", **HYBRIDS["bamba"][0]).to_dict()))
    with pytest.raises(SetupError, match=r"recurrent layers \(BambaMixer\).*ChunkFlow"):
        dry_run(tiny, [f"training.output_dir={tmp_path}", f"model.config={bamba}", "training.cp_balancer=chunkflow"])
    jitter = tmp_path / "mixtral.json"
    moe = dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01)
    jitter.write_text(json.dumps(_config("mixtral", router_jitter_noise=0.1, **moe).to_dict()))
    with pytest.raises(SetupError, match="mixtral: router_jitter_noise=0.1"):
        dry_run(tiny, [f"training.output_dir={tmp_path}", f"model.config={jitter}"], world_size=2, steps=2)


def test_recurrent_layers_are_refused_where_a_document_cannot_run_whole():
    model = _model("bamba", **HYBRIDS["bamba"][0])
    check_recurrent_layers_fit(
        model, "CPTrainer", {"sliding_window"}, "auto"
    )  # not attached: nothing runs per document yet
    attach_recurrent_layers(model)
    check_recurrent_layers_fit(model, "CPTrainer", set(), "auto")
    # shared prompts run each answer after the prompt (tests/test_recurrent_shared_prompts.py)
    check_recurrent_layers_fit(model, "CPDPOTrainer", {"shared_prompt"}, "auto")
    with pytest.raises(
        SetupError,
        match=r"CPTrainer: the model has recurrent layers \(BambaMixer\), and samples with prefix_lm, sliding_window",
    ):
        check_recurrent_layers_fit(model, "CPTrainer", {"shared_prompt", "sliding_window", "prefix_lm"}, "auto")
    with pytest.raises(SetupError, match=r"\(BambaMixer\), which ChunkFlow's dependent chunks"):
        check_recurrent_layers_fit(model, "CPTrainer", set(), "chunkflow")
    # Gated DeltaNet layers carry their state across dependent chunks (tests/test_chunkflow_recurrent.py)
    linear = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
    gated = _model("qwen3_5_text", layer_types=["linear_attention", "full_attention"], **linear)
    attach_recurrent_layers(gated)
    check_recurrent_layers_fit(gated, "CPTrainer", set(), "chunkflow")
    check_recurrent_layers_fit(_model("llama"), "CPDPOTrainer", {"sliding_window"}, "chunkflow")  # attention only: fine


def test_families_measured_not_exact_and_positions_that_ignore_position_ids_are_refused():
    with torch.device("meta"):
        gpt = AutoModelForCausalLM.from_config(AutoConfig.for_model("openai-gpt", n_layer=2, n_embd=32, n_head=4))
        bart = AutoModelForCausalLM.from_config(AutoConfig.for_model("bart", d_model=32, decoder_layers=2))
        bert = AutoModelForCausalLM.from_config(
            AutoConfig.for_model("bert", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, is_decoder=False)
        )
    with pytest.raises(SetupError, match=r"openai-gpt family was measured not exact .*79% off"):
        check_model_supported(gpt)
    with pytest.raises(SetupError, match=r"BartForCausalLM.forward takes no position_ids"):
        check_model_supported(bart)
    with pytest.raises(SetupError, match=r"BertSelfAttention\) is not causal"):
        check_model_supported(bert)
