"""Every causal-LM family of the installed transformers, built tiny, classified under hf_cp: refused
at set-up (hf_cp.train.checks.model, after attaching the recurrent layers as CPTrainer does), or
trained on one packed row of three documents and compared, parameter by parameter, with each
document run alone through the same weights with eager attention (exact: every gradient within
2e-5 relative). Prints one tab-separated line per family: family, result, detail, seconds.
`crash` and `not built` are this script's tiny configs failing (or a forward refusal), not a
verdict on the family. Usage: python scripts/sweep_model_families.py [model_type ...]
"""

import copy
import sys
import time
import warnings

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import hf_cp.attention.interface  # noqa: F401  (registers attn_implementation "hf_cp")
from hf_cp.attention.recurrent import attach_recurrent_layers
from hf_cp.train.checks.model import model_refusals

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=96,
    max_position_embeddings=256,
    use_cache=False,
    num_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_routed_experts=4,
    n_shared_experts=1,
)
MAX_PARAMETERS = 5_000_000  # a config the overrides cannot make tiny is skipped (memory)
TOLERANCE = 2e-5


def _is_rate(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def tiny_config(model_type: str):
    """The family's default config with TINY's fields where it has them, every dropout and router
    jitter at 0 (random in training, so no reference can match them), and two layers of its layer kinds."""
    base = AutoConfig.for_model(model_type)
    text = base.get_text_config() if hasattr(base, "get_text_config") else base
    over = {k: v for k, v in TINY.items() if hasattr(text, k)}
    for k in list(vars(text)):
        if ("dropout" in k or k.endswith("_pdrop") or "jitter" in k) and _is_rate(getattr(text, k)):
            over[k] = 0.0
    kinds = list(dict.fromkeys(getattr(text, "layer_types", None) or ()))
    if kinds:
        over["layer_types"] = (kinds * 2)[:2]
    if text is base:
        return AutoConfig.for_model(model_type, **over)
    for k, v in over.items():
        setattr(text, k, v)
    return base


def _token_loss(logits, ids):
    return torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum")


def classify(model_type: str):
    """(result, detail): refused (first reason), exact / MISMATCH (worst relative gradient error)."""
    cfg = tiny_config(model_type)
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    if n > MAX_PARAMETERS:
        return "not built", f"tiny config still has {n / 1e6:.0f}M parameters"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="hf_cp").train()
    attach_recurrent_layers(model)  # as CPTrainer does
    reasons = model_refusals(model)
    if reasons:
        return "refused", reasons[0][:120]
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").train()
    ref.load_state_dict(model.state_dict())
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    lengths = [11, 5, 16]
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, min(text.vocab_size, 90), (n,), generator=gen) for n in lengths]
    valid = sum(n - 1 for n in lengths)
    for d in docs:  # the reference: each document alone
        (_token_loss(ref(input_ids=d[None], use_cache=False).logits[0], d) / valid).backward()
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    loss, off = 0.0, 0
    for n, d in zip(lengths, docs):
        loss = loss + _token_loss(logits[off : off + n], d)
        off += n
    (loss / valid).backward()
    worst = 0.0
    grads = [(p, q) for p, q in zip(model.parameters(), ref.parameters()) if q.grad is not None]
    # a gradient that is mathematically zero (a key bias under softmax) is rounding noise: each
    # parameter's error is measured against at least 1e-3 of the whole gradient's norm
    floor = 1e-3 * torch.sqrt(sum(q.grad.double().pow(2).sum() for _, q in grads)).item()
    for p, q in grads:
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        worst = max(worst, ((got - q.grad).norm() / max(q.grad.norm().item(), floor)).item())
    return ("exact" if worst <= TOLERANCE else "MISMATCH"), f"{worst:.1e}"


def main() -> None:
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    for model_type in sys.argv[1:] or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        t0 = time.time()
        try:
            result, detail = classify(model_type)
        except Exception as e:  # noqa: BLE001  (a tiny config the family rejects, or a forward refusal)
            first = str(e).splitlines()[0][:140] if str(e) else ""
            result, detail = "crash", f"{type(e).__name__}: {first}"
        print(f"{model_type}\t{result}\t{detail}\t{time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
