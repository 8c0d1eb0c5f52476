"""Model features hf_cp does not honour, refused when a trainer (or the dry run) is built.

hf_cp keeps training exact by owning how tokens see each other: packed documents never mix and a
document spread over a CP group computes what it would alone. That holds only for token mixers
routed through transformers' attention interface (hf_cp.attention.interface). A layer that mixes
tokens some other way runs on each rank's rows as if they were one sequence:
- a linear recurrence (Gated DeltaNet in Qwen3-Next / Qwen3.5, Mamba and Mamba2 in Jamba, Bamba,
  Falcon-H1, RWKV, Lightning / Kimi delta attention) carries its state across document starts
  and across ranks;
- a short causal convolution (LFM2, and inside most recurrent layers) reads the previous
  document's last tokens;
- a sparse-attention indexer (DeepSeek-V3.2 and its relatives) picks keys outside the interface.
Measured on 2026-12-03: such models trained with gradients off by 72-820% while the loss moved by
1e-5. The layers hf_cp/attention/recurrent.py runs once per document (Gated DeltaNet, Mamba,
Mamba2, LFM2's convolution: attach_recurrent_layers, which CPTrainer calls) are exact; every other
one is refused by name here, never run. Config features that the attention function
would only meet at the first forward (attention dropout) and the MoE router's
auxiliary loss, which CPTrainer's own loss would drop, are refused here too.

Pure inspection of module classes and config values: no forward runs, so the check also runs on
a model built on the meta device (the dry run).
"""

from __future__ import annotations

import inspect
import re
from typing import Iterable, List, Optional, Tuple

import torch
from transformers import AutoModelForCausalLM

from hf_cp.attention.recurrent import ATTACHED, attach_recurrent_layers
from hf_cp.attention.state_passing import STATE_PASSING_MIXERS
from hf_cp.train.checks.setup import SetupError

# Layer kinds that the attention interface carries (a window is applied there too).
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention", "global", "local"})

# Class names of token mixers that bypass the attention interface (see the module docstring).
_MIXER_NAME = re.compile(
    r"(Mamba|Mixer|GatedDeltaNet|DeltaAttention|DeltaNet|ShortConv|LinearAttention|LightningAttention|Indexer|"
    r"Rglru|RecurrentBlock|Rwkv|Retention|Hyena|Xlstm|MLSTM|SLSTM)",
    re.IGNORECASE,
)

# Families whose packed rows were measured to differ from each document run alone (2026-12-03,
# scripts/sweep_model_families.py: every parameter's gradient against a per-document eager
# reference, one packed row without a CP context) for reasons the checks above do not see. Under a
# CP context (tests/helpers/model_families.py, world 2) they measured exact, so this may refuse more
# than it must; it stays until the packed-row path is made exact for them.
# the method of an attention class that builds its own dense mask (Doge's dynamic mask)
DYNAMIC_MASK = "prepare_dynamic_mask"
MEASURED_NOT_EXACT = {
    "ctrl": "gradients 130% off",
    "openai-gpt": "gradients 79% off",
    "gpt_bigcode": "gradients 72% off",
    "persimmon": "gradients 130% off",
    "dory": "gradients 110% off",
    "moshi": "gradients 79% off",
}

_WHAT_WORKS = (
    "What works: models whose every token mixer is softmax attention through transformers' attention "
    "interface (Llama, Qwen2/2.5/3 and their MoEs, Mistral, Mixtral, Gemma 3, GPT-OSS, OLMo 2, Phi-3, GLM-4, "
    "Cohere 2, DeepSeek-V2/V3 MLA, ...), and the hybrids whose recurrent layers hf_cp runs per document "
    "(Qwen3-Next, Qwen3.5, Bamba, Falcon-H1, Jamba, LFM2): see docs/attention.md and docs/model_families.md"
)


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The text stack a plan's tokens run through (a vision tower's convolutions mix patches, not tokens)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    return decoder if isinstance(decoder, torch.nn.Module) else base


def _depthwise_conv(module: torch.nn.Module) -> bool:
    """A causal convolution along the sequence: depthwise Conv1d with a kernel longer than one token."""
    return isinstance(module, torch.nn.Conv1d) and module.groups == module.in_channels and module.kernel_size[0] > 1


def token_mixers_bypassing_attention(model: torch.nn.Module) -> List[Tuple[str, str]]:
    """(module path, class name) of every module of the language model that mixes tokens outside the
    attention interface: a recurrent / linear-attention / state-space / indexer class by its name, or
    the owner of a depthwise causal Conv1d. Outermost match only (a Mamba mixer's conv is not listed
    twice); a module attached to run per document (attach_recurrent_layers), and the layers around
    it, are honoured."""
    names = dict(language_model(model).named_modules())
    attached = [p for p, m in names.items() if getattr(m, ATTACHED, False)]

    def honoured(path: str) -> bool:
        return any(a == path or a.startswith(path + ".") or path.startswith(a + ".") for a in attached)

    found: List[Tuple[str, str]] = []
    for path, module in names.items():
        if not path or honoured(path) or any(path.startswith(p + ".") for p, _ in found):
            continue  # the stack itself (MambaModel) is named by its layers
        if _MIXER_NAME.search(type(module).__name__):
            found.append((path, type(module).__name__))
        elif _depthwise_conv(module):
            owner = path.rsplit(".", 1)[0] if "." in path else path
            if not honoured(owner) and not any(owner == p for p, _ in found):
                found.append((owner, type(names.get(owner, module)).__name__))
    return found


def _calls_attention_interface(cls: type) -> bool:
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):  # no source to read (compiled, built-in): cannot tell, do not refuse
        return True
    return "ALL_ATTENTION_FUNCTIONS" in source or "attention_interface" in source


def attention_bypassing_interface(model: torch.nn.Module) -> List[str]:
    """Class names of the language model's attention modules whose forward does not dispatch
    through transformers' attention interface (ALL_ATTENTION_FUNCTIONS): hf_cp_attention is never
    called there. Read from the classes' source, so it holds for a model on the meta device."""
    classes = {
        type(m)
        for m in language_model(model).modules()
        if type(m).__name__.endswith("Attention") and any(isinstance(c, torch.nn.Linear) for c in m.children())
    }
    return sorted(c.__name__ for c in classes if not _calls_attention_interface(c))


def _unhonoured_layer_types(model: torch.nn.Module, layer_types) -> List[str]:
    """The config's layer kinds that are neither attention nor a layer holding a recurrent
    module attached to run per document (chunked attention has its own refusal in model_refusals)."""
    layers = getattr(language_model(model), "layers", None)
    bad = set()
    for i, kind in enumerate(layer_types):
        if kind in ATTENTION_LAYER_TYPES or kind == "chunked_attention":
            continue
        layer = layers[i] if isinstance(layers, torch.nn.ModuleList) and i < len(layers) else None
        if layer is None or not any(getattr(m, ATTACHED, False) for m in layer.modules()):
            bad.add(kind)
    return sorted(bad)


def _chunked_attention(config) -> bool:
    """Llama 4's chunked attention: attention_chunk_size set and a layer of that kind (or no
    layer_types to say which layers)."""
    layer_types = getattr(config, "layer_types", None) or ()
    if "chunked_attention" in layer_types:
        return True
    return bool(getattr(config, "attention_chunk_size", None)) and not layer_types


def _config_of(model: torch.nn.Module):
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return config, text


def _nonzero(configs: Iterable, *names: str) -> Optional[Tuple[str, float]]:
    for cfg in configs:
        for name in names:
            value = getattr(cfg, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value:
                return name, float(value)
    return None


def model_refusals(model: torch.nn.Module) -> List[str]:
    """Every reason this model cannot train exactly under hf_cp, in words naming the layer or the
    setting and the way forward; empty when it can."""
    config, text = _config_of(model)
    family = getattr(config, "model_type", type(model).__name__)
    configs = [c for c in (config, text) if c is not None]
    reasons: List[str] = []
    mixers = token_mixers_bypassing_attention(model)
    if mixers:
        classes = sorted({cls for _, cls in mixers})
        reasons.append(
            f"the {family} model mixes tokens outside the attention interface in {len(mixers)} module(s) of "
            f"class {', '.join(classes)} (e.g. {mixers[0][0]}): a recurrent, linear-attention, state-space, "
            f"convolution or sparse-indexer layer that hf_cp does not yet keep exact on packed documents or "
            f"across a CP group (it would carry state across document starts and ranks, silently). {_WHAT_WORKS}"
        )
    layer_types = _unhonoured_layer_types(model, getattr(text, "layer_types", None) or ())
    if layer_types and not mixers:
        reasons.append(
            f"the {family} model's config lists layer_types {layer_types}, which are not softmax attention "
            f"layers that hf_cp's attention carries. {_WHAT_WORKS}"
        )
    bypassing = attention_bypassing_interface(model)
    if bypassing and not mixers:
        reasons.append(
            f"the {family} model's attention class {', '.join(bypassing)} computes attention itself instead of "
            f"calling transformers' attention interface, so hf_cp's attention never runs and packed documents "
            f"would attend to each other. {_WHAT_WORKS}"
        )
    chunked = next((c for c in configs if _chunked_attention(c)), None)
    if chunked is not None:
        size = getattr(chunked, "attention_chunk_size", None)
        reasons.append(
            f"the {family} model uses chunked attention (attention_chunk_size {size}, layers "
            f"'chunked_attention'): a token attends only inside its chunk of {size} tokens, a mask hf_cp's "
            f"attention does not carry; it would attend across chunk starts. {_WHAT_WORKS}"
        )
    dynamic = sorted({type(m).__name__ for m in model.modules() if callable(getattr(type(m), DYNAMIC_MASK, None))})
    if dynamic:
        reasons.append(
            f"the {family} model's attention class {', '.join(dynamic)} builds a dense mask of its own "
            f"({DYNAMIC_MASK}) and hands it to attention as a 4-D tensor, which hf_cp's attention cannot honour on "
            f"packed documents or across a CP group. {_WHAT_WORKS}"
        )
    measured = MEASURED_NOT_EXACT.get(family) or MEASURED_NOT_EXACT.get(getattr(text, "model_type", None))
    if measured:
        reasons.append(
            f"the {family} family was measured not exact on packed documents against each document run alone "
            f"({measured}; scripts/sweep_model_families.py). {_WHAT_WORKS}"
        )
    top = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    if "position_ids" not in inspect.signature(type(top).forward).parameters:
        reasons.append(
            f"{type(top).__name__}.forward takes no position_ids, so the positions of a packed row's documents "
            f"would run on from one document into the next (and a CP shard would start at 0). {_WHAT_WORKS}"
        )
    encoders = sorted(
        {type(m).__name__ for m in language_model(model).modules() if getattr(m, "is_causal", True) is False}
    )
    if encoders:
        reasons.append(
            f"the {family} model's attention ({', '.join(encoders)}) is not causal (is_causal=False: an encoder, or "
            f"a decoder config without is_decoder), which hf_cp's causal shards and masks do not compute. {_WHAT_WORKS}"
        )
    dropout = _nonzero(configs, "attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")
    if dropout:
        reasons.append(
            f"{family}: attention dropout {dropout[0]}={dropout[1]:g} is not applied by hf_cp's attention "
            f"(each rank would need the same random mask of a spread document); set {dropout[0]}=0"
        )
    return reasons


def check_model_supported(model: torch.nn.Module, where: str = "the model") -> None:
    """Raise SetupError naming every feature of `model` that hf_cp does not honour (model_refusals)."""
    reasons = model_refusals(model)
    if reasons:
        lines = "\n".join(f"- {r}" for r in reasons)
        raise SetupError(f"{where} cannot be trained exactly by hf_cp:\n{lines}")


def check_model_config_supported(config, where: str = "the model", model_class=None) -> torch.nn.Module:
    """check_model_supported for a config alone: the model built on the meta device (no memory, no
    weights), as the dry run needs it before any launch. Returns that model (recurrent layers attached).
    `model_class`: the config's model.model_class (a transformers model class; default AutoModelForCausalLM)."""
    with torch.device("meta"):
        cls = model_class or AutoModelForCausalLM
        model = cls._from_config(config) if hasattr(cls, "config_class") else cls.from_config(config)  # Auto: none
    attach_recurrent_layers(model)  # as CPTrainer does
    check_model_supported(model, where)
    return model


def recurrent_layer_names(model: torch.nn.Module) -> List[str]:
    """Classes of the model's layers attached to run per document (attach_recurrent_layers)."""
    return sorted({type(m).__name__ for m in language_model(model).modules() if getattr(m, ATTACHED, False)})


def check_recurrent_layers_fit(model: torch.nn.Module, who: str, mask_kinds: Iterable[str], balancer: str) -> None:
    """A model with recurrent layers (run per document, hf_cp/attention/recurrent.py) is refused
    where a sample cannot run through them as it would alone: samples with a mask other than a
    shared prompt (`mask_kinds`: the kinds the run's samples carry; a shared prompt's answers
    each run after the prompt), ChunkFlow's dependent chunks with shared-prompt samples, and
    ChunkFlow's chunks through any layer but Gated DeltaNet (the state store carries only its
    state: attention/chunk_recurrence.py)."""
    layers = recurrent_layer_names(model)
    if not layers:
        return
    other = sorted(set(mask_kinds) - {"causal", "shared_prompt"})
    if other:
        raise SetupError(
            f"{who}: the model has recurrent layers ({', '.join(layers)}), and samples with {', '.join(other)} "
            f"attention masks, a pattern a recurrent layer does not have (it reads every earlier token of its "
            f"sequence); only shared-prompt samples run through one. Train such masks with attention-only models"
        )
    if balancer == "chunkflow" and "shared_prompt" in set(mask_kinds):
        raise SetupError(
            f"{who}: the model has recurrent layers ({', '.join(layers)}), and shared-prompt samples, which "
            f"ChunkFlow's dependent chunks cannot carry (each answer continues from the prompt's state, and chunkflow "
            f"plans causal samples only); use another cp_balancer (auto, magi, dcp, ...)"
        )
    stateless = [name for name in layers if name not in STATE_PASSING_MIXERS]
    if balancer == "chunkflow" and stateless:
        raise SetupError(
            f"{who}: the model has recurrent layers ({', '.join(stateless)}), which ChunkFlow's dependent chunks would "
            f"restart from a zero state at every chunk (they carry only Gated DeltaNet layers' state); use another "
            f"cp_balancer (auto, dynamic_cp, ...)"
        )
