"""scripts/sweep_model_families.py classifies a family as exact (packed row against each document
alone), refused at set-up, or MISMATCH. A few families in the fast suite, each result kind shown;
every causal-LM family of the installed transformers in the slow one, where a MISMATCH fails.

test_every_family_is_exact_under_cp_or_refused (helpers/model_families.py): every causal-LM family,
built tiny, in one spawned gloo world of 2 ranks (about a minute on two cores): one document spread
over the CP group (ring per document and Ulysses or ring zigzag) and one local document per rank must
give the loss and every parameter gradient of each document run alone through eager attention, or
the family must be refused by name at set-up (hf_cp.train.checks.model). A family that runs and
mismatches, or raises in its forward, fails the test; docs/model_families.md lists what it measured."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from helpers import load_file_module
from helpers import model_families as families_cp

sweep = load_file_module("sweep_model_families", "scripts/sweep_model_families.py")


@pytest.mark.parametrize(
    "family, result",
    [
        ("llama", "exact"),
        ("qwen3_next", "exact"),  # Gated DeltaNet: run per document
        ("deepseek_v2", "crash"),  # the tiny config's head dims do not fit MLA: no verdict (MLA: test_attention_mla)
        ("openai-gpt", "refused"),  # measured not exact
        ("bart", "refused"),  # no position_ids
        ("nemotron_h", "refused"),  # a Mamba2 mixer hf_cp does not run per document
    ],
)
def test_families_are_classified(family, result):
    got = "crash"
    try:
        got, _ = sweep.classify(family)
    except Exception:  # noqa: BLE001  (what main() reports as crash)
        pass
    assert got == result


def test_the_sweep_would_see_a_mismatch(monkeypatch):
    # transformers' own recurrent layers on a packed row (nothing attached, nothing refused)
    monkeypatch.setattr(sweep, "attach_recurrent_layers", lambda model: [])
    monkeypatch.setattr(sweep, "model_refusals", lambda model: [])
    result, detail = sweep.classify("qwen3_next")
    assert result == "MISMATCH" and float(detail) > 1e-3


@pytest.mark.slow
def test_no_family_of_transformers_mismatches():
    mismatched = []
    for family in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            result, detail = sweep.classify(family)
        except Exception:  # noqa: BLE001  (a tiny config that does not build: no verdict)
            continue
        if result == "MISMATCH":
            mismatched.append((family, detail))
    assert not mismatched


# Families expected to be refused at set-up once hf_cp.train.checks.model covers them; until then
# they run here and must not be exact (so the list cannot go stale silently). Measured 2026-12-03
# with the model_checks of the working tree: each raises in hf_cp's attention at the first forward
# instead of at set-up.
KNOWN_PENDING: dict = {}  # doge, llama4, llama4_text: refused at set-up since 2026-12-03

# Without hf_cp.train.checks.model (the module absent) every family it refuses runs: these then
# mismatch or raise at the forward (measured 2026-12-03 with the set-up checks off).
PENDING_WITHOUT_MODEL_CHECKS = frozenset(
    """axk2 bailing_hybrid bart bert bert-generation big_bird bigbird_pegasus blenderbot blenderbot-small
    bloom camembert cpmant data2vec-text deepseek_v32 deepseek_v4 electra ernie falcon_mamba gemma2
    glm_moe_dsa gpt_neox_japanese granitemoehybrid hy_v4 inkling2_loop_text inkling2_text inkling_text
    kimi_linear lara_mini lfm2_moe lfm3 mamba mamba2 marian mbart megatron-bert minimax mvp nemotron_h
    olmo_hybrid openai-gpt pegasus plbart prophetnet recurrent_gemma rembert roberta roberta-prelayernorm
    roc_bert roformer rwkv trocr vaultgemma xglm xlm xlm-roberta xlm-roberta-xl xlstm zamba zamba2
    zaya""".split()
)

# Exact under CP on this harness: a set-up check that refused one of them would refuse a model
# hf_cp trains exactly (softmax attention of every kind, MoE, MLA, hybrids run per document).
MUST_BE_EXACT = frozenset(
    """llama qwen2 qwen3 qwen3_moe mistral mixtral gemma3_text gpt_oss olmo2 phi3 deepseek_v3 glm4
    cohere2 qwen3_next qwen3_5 bamba falcon_h1 jamba lfm2 gpt2 gemma2 vaultgemma""".split()
)


def _timed_out_family(progress) -> str:
    started = [json.loads(line) for line in progress.read_text().splitlines()] if progress.exists() else []
    done = {r["family"] for r in started if r.get("result") != "started"}
    pending = [r["family"] for r in started if r.get("result") == "started" and r["family"] not in done]
    return pending[-1] if pending else "?"


@pytest.mark.timeout(330)
def test_every_family_is_exact_under_cp_or_refused(tmp_path):
    names = families_cp.families()
    progress = tmp_path / "progress.jsonl"
    t0 = time.monotonic()
    try:
        rows = families_cp.run_all(names, timeout_s=300, progress=str(progress))
    except TimeoutError as e:
        pytest.fail(f"the family sweep hung or ran too long in {_timed_out_family(progress)!r}: {e}")
    seconds = time.monotonic() - t0
    by_family = {r["family"]: r for r in rows}
    table = families_cp.format_table(rows)
    print(f"{len(rows)} families in {seconds:.0f} s\n{table}")
    assert [r["family"] for r in rows] == names, (
        f"the sweep stopped after {rows[-1]['family'] if rows else 'nothing'}: {rows[-1] if rows else ''}"
    )

    pending = dict(KNOWN_PENDING)
    if importlib.util.find_spec("hf_cp.train.checks.model") is None:
        pending.update({f: "refused once hf_cp.train.checks.model lands" for f in PENDING_WITHOUT_MODEL_CHECKS})
    failing = [r for r in rows if r["result"] in ("MISMATCH", "crash") and r["family"] not in pending]
    assert not failing, (
        "families that run under hf_cp but are not exact (a refusal must come at set-up):\n"
        + "\n".join(f"  {r['family']}: {r['result']}: {r['detail']}" for r in failing)
    )
    stale = {
        f: by_family[f]["result"]
        for f in pending
        if f in by_family and by_family[f]["result"] in ("exact", "not built")
    }
    assert not stale, f"KNOWN_PENDING families no longer measured not exact (drop them from the list): {stale}"
    not_exact = {
        f: f"{by_family[f]['result']}: {by_family[f]['detail']}"
        for f in MUST_BE_EXACT
        if by_family[f]["result"] != "exact"
    }
    assert not not_exact, f"families hf_cp trains exactly, refused or not exact now: {not_exact}"
    built = [r for r in rows if r["result"] != "not built"]
    assert len(built) >= 0.8 * len(rows), (
        f"only {len(built)} of {len(rows)} families built tiny: helpers/model_families.py's tiny configs need a look"
    )
