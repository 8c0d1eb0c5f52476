"""Every causal-LM family of the installed transformers, built tiny and classified under hf_cp.

A family is
- "exact": one document spread over a CP group of 2 (gloo) in two shard modes, plus one local
  document per rank, gives the loss and every parameter gradient of each document run alone
  through the same weights (eager attention, position_ids from 0), within REL_TOL relative (or
  within FLOOR_FACTOR x the family's own float32 noise: the eager reference against an sdpa one);
- "refused": hf_cp.train.checks.model.check_model_supported raised SetupError at set-up (after
  the recurrent layers were attached, as CPTrainer does), so it never runs;
- "MISMATCH": it ran and some gradient (or the loss) differs;
- "crash": the reference ran but the hf_cp forward/backward raised (a refusal must come at set-up);
- "not built": this harness could not build or run the family tiny (the config does not
  construct, the model needs more than input_ids, the reference forward fails): not a verdict.

One spawned world-2 gloo job runs all families (run_families: each rank loops over them, the
ranks agree on every stage's outcome with a small all_reduce so they stay in step); rank 0
appends one JSON line per family to a progress file, so a hang still names its family.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import time
import traceback
import warnings
from typing import Dict, List, Optional

import torch

REL_TOL = 2e-5
FLOOR_FACTOR = 4  # above REL_TOL, still exact within this many times the family's float32 noise
VANISHING = 1e-3  # see _worst
FLOOR_MAX = 1e-4  # ... when that noise is float32 rounding, not a difference between eager and sdpa
MAX_PARAMS = 20_000_000  # a tiny config that stays larger ignores the overrides: "not built"
DISTRIBUTED = [24]  # the document spread over the group
LOCALS = [[7], [9]]  # each member's local document
SEED = 1234

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
    tie_word_embeddings=False,
    # MoE
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    top_k=2,
    moe_topk=2,
    moe_k=2,
    num_selected_experts=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    expert_intermediate_size=32,
    n_group=1,
    topk_group=1,
    # hybrids: with 2 layers keep one of each kind
    attn_layer_period=2,
    attn_layer_offset=1,
    expert_layer_period=2,
    expert_layer_offset=1,
    full_attention_interval=2,
    # MLA
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    rotary_dim=8,
    # encoder-decoder families' decoders (their ...ForCausalLM)
    decoder_layers=2,
    encoder_layers=2,
    decoder_attention_heads=4,
    encoder_attention_heads=4,
    decoder_ffn_dim=64,
    encoder_ffn_dim=64,
    num_encoder_layers=2,
    num_decoder_layers=2,
    # Mamba2 mixers in hybrids: heads x head dim = expand x hidden
    mamba_n_heads=8,
    mamba_d_head=8,
    mamba_n_groups=1,
    mamba_d_ssm=64,
    mamba_d_state=16,
    num_kv_shared_layers=0,
    # per-layer input embeddings (Gemma 3n / 4)
    vocab_size_per_layer_input=96,
    hidden_size_per_layer_input=8,
)

# Per family: what TINY cannot say (its own field names, constraints between fields).
FAMILY_OVERRIDES = {
    "bamba": dict(attn_layer_indices=[1]),
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "mamba2": dict(num_heads=8, n_groups=1),
    "zaya": dict(num_experts_per_tok=1),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "gemma4_assistant": dict(hidden_size_per_layer_input=0),
    # a cap the tiny model's scores reach (Gemma 2 ships 50, beyond a random tiny model's scores):
    # a kernel that dropped the cap would then not be exact
    "gemma2": dict(attn_logit_softcapping=0.1),
    "vaultgemma": dict(attn_logit_softcapping=0.1),
    "dbrx": dict(
        d_model=32,
        n_heads=4,
        n_layers=2,
        max_seq_len=256,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, attn_pdrop=0.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
    ),
}
TOKENS = 60  # token ids drawn below this (special ids of a config are moved below vocab_size)


def families() -> List[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _has(text, k: str) -> bool:
    try:
        return hasattr(text, k)
    except Exception:  # a per-layer attribute of a heterogeneous config: not set globally
        return False


def _settable(text, k: str) -> bool:
    k = getattr(type(text), "attribute_map", {}).get(k, k)
    attr = getattr(type(text), k, None)
    return not (isinstance(attr, property) and attr.fset is None)


def _overrides(text) -> Dict[str, object]:
    over = {k: v for k, v in TINY.items() if _has(text, k) and _settable(text, k)}
    for k in list(vars(text)):
        try:
            v = getattr(text, k, None)
        except Exception:
            continue
        if _is_number(v) and ("drop" in k or "jitter" in k) and not isinstance(v, int):  # dropout, layerdrop, ...
            over[k] = 0.0
        elif _is_number(v) and ("dropout" in k or k.endswith("_pdrop")):
            over[k] = 0.0
        elif k.endswith("token_id") and isinstance(v, int) and not isinstance(v, bool) and v >= TINY["vocab_size"]:
            over[k] = TINY["vocab_size"] - 1 - (len([o for o in over if o.endswith("token_id")]) % 4)
    lt = getattr(text, "layer_types", None)
    if isinstance(lt, (list, tuple)) and lt and _settable(text, "layer_types"):
        kinds = list(dict.fromkeys(lt))
        over["layer_types"] = kinds[:2] if len(kinds) > 1 else [kinds[0]] * 2
    if getattr(text, "kv_lora_rank", None):  # MLA: every head has its own latent key / value
        over["num_key_value_heads"] = TINY["num_attention_heads"]
    for name in ("layers_block_type", "block_types"):
        bt = getattr(text, name, None)
        if _settable(text, name) and isinstance(bt, (list, tuple)) and bt and all(isinstance(b, str) for b in bt):
            kinds = list(dict.fromkeys(bt))
            over[name] = kinds[:2] if len(kinds) > 1 else [kinds[0]] * 2
    pattern = getattr(text, "hybrid_override_pattern", None)
    if isinstance(pattern, str) and pattern:
        kinds = "".join(dict.fromkeys(pattern))
        over["hybrid_override_pattern"] = kinds[:2] if len(kinds) > 1 else kinds * 2
    return over


def _is_family_override(keys, model_type: str) -> bool:
    """Whether one of `keys` is a family override (those are not dropped)."""
    return any(k in FAMILY_OVERRIDES.get(model_type, {}) for k in keys)


def tiny_config(model_type: str):
    """The family's config class defaults with TINY's overrides where the config has the field,
    every dropout 0, special token ids inside the vocabulary, both layer kinds of a hybrid kept."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    text = base.get_text_config() if hasattr(base, "get_text_config") else base
    over = dict(_overrides(text), **FAMILY_OVERRIDES.get(model_type, {}))
    for _ in range(8):  # an override the config refuses by name is dropped, then retried
        try:
            if text is base:
                cfg = AutoConfig.for_model(model_type, **over)
            else:  # a composite config: shrink the text part in place
                cfg = copy.deepcopy(base)
                sub = cfg.get_text_config()
                for k, v in over.items():
                    setattr(sub, k, v)
            break
        except Exception as e:
            named = [k for k in over if f"'{k}'" in str(e) or f"`{k}`" in str(e)]
            if not named or _is_family_override(named, model_type):
                raise
            for k in named:
                over.pop(k)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for k in ("use_cache",):
        if hasattr(text, k):
            setattr(text, k, False)
    return cfg


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def second_mode(config):
    """ULYSSES where the tiny config's heads split over 2 ranks, else ring zigzag."""
    from hf_cp.modes.segments import ShardMode

    text = _text_config(config)
    h = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or h
    if isinstance(h, int) and isinstance(kv, int) and h % 2 == 0 and h % kv == 0 and (kv % 2 == 0 or 2 % kv == 0):
        return ShardMode.ULYSSES
    return ShardMode.RING_ZIGZAG


def _first_line(e: BaseException, limit: int = 200) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {line}"[:limit]


def refusal_line(message: str, limit: int = 240) -> str:
    """The refusal's first line; when that is only a header ("...:"), its first reason instead."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    out = lines[0]
    if out.endswith(":") and len(lines) > 1:
        out = lines[1].lstrip("- ")
    return out if len(out) <= limit else out[: limit - 3] + "..."


def _checker():
    """check_model_supported and SetupError when hf_cp.train.checks.model exists, else None."""
    if importlib.util.find_spec("hf_cp.train.checks.model") is None:
        return None
    checks = importlib.import_module("hf_cp.train.checks.model")
    from hf_cp.train.checks.setup import SetupError

    return checks.check_model_supported, SetupError


def _batch(vocab: int):
    from helpers.attention_models import packed_batch
    from helpers.cp_layout import group_documents

    lengths = group_documents(DISTRIBUTED, LOCALS)
    ids, pos, labels = packed_batch(lengths, min(vocab, TOKENS), seed=17)
    return lengths, ids, pos, labels


def _ce_sum(logits, labels):
    return torch.nn.functional.cross_entropy(
        logits.to(torch.promote_types(logits.dtype, torch.float32)), labels, ignore_index=-100, reduction="sum"
    )


def _grad_vector(model) -> torch.Tensor:
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).double()
            for p in model.parameters()
        ]
    )


def _stage(err: Optional[str], group=None) -> Optional[str]:
    """Every rank's outcome of a stage, agreed: None when all went well, else the first failing
    rank's message (the same collectives run on every rank, so the ranks stay in step)."""
    import torch.distributed as dist

    flag = torch.tensor([0 if err is None else 1])
    dist.all_reduce(flag, group=group)
    if int(flag.item()) == 0:
        return None
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, err, group=group)
    return next(t for t in out if t)


def _worst(model, ref_grads: Dict[str, torch.Tensor], cp_vector: torch.Tensor):
    """(max relative error, its parameter) over the parameters: norm(diff) / norm(reference), the
    denominator at least VANISHING x the whole reference gradient's norm (a parameter whose gradient
    is mathematically zero, like a key bias under softmax, holds only rounding noise; one that gets
    no gradient in the reference must get none, or only such noise, from hf_cp)."""
    scale = torch.sqrt(sum((r.double() ** 2).sum() for r in ref_grads.values())).item()
    worst, name, o = -1.0, "", 0
    for n, p in model.named_parameters():
        g = cp_vector[o : o + p.numel()].view_as(p)
        o += p.numel()
        r = ref_grads[n]
        rn, dn = r.norm().item(), (g - r).norm().item()
        floor = max(rn, VANISHING * scale)
        e = dn / floor if floor > 0 else (0.0 if dn == 0.0 else float("inf"))
        if e > worst:
            worst, name = e, n
    return max(worst, 0.0), name


def _one_family(rank: int, world: int, model_type: str, use_checks: bool, group, dtype=torch.float32) -> dict:
    """One family's row; every rank runs the same collectives (dtype: hf_cp's kernels take float32,
    not float64, today)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_cp.attention.interface  # noqa: F401  (registers "hf_cp")
    from hf_cp.attention import CPContext, cp_context
    from hf_cp.attention.recurrent import attach_recurrent_layers
    from hf_cp.modes.segments import ShardMode

    from helpers.cp_layout import member_rows

    row = dict(family=model_type)
    # -- build (deterministic: both ranks reach the same outcome; agreed anyway)
    err = None
    try:
        config = tiny_config(model_type)
        with torch.device("meta"):
            n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if n_params > MAX_PARAMS:
            raise ValueError(f"tiny config still has {n_params / 1e6:.1f}M parameters")
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="hf_cp", dtype=dtype).train()
        ref = copy.deepcopy(model)
        ref.set_attn_implementation("eager")
        ref.train()
        attach_recurrent_layers(model)  # as CPTrainer does
    except Exception as e:
        err = f"build: {_first_line(e)}"
    err = _stage(err, group)
    if err:
        return dict(row, result="not built", detail=err)
    # same weights on every rank
    with torch.no_grad():
        flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
        dist.broadcast(flat, src=0, group=group)
        torch.nn.utils.vector_to_parameters(flat, model.parameters())
        torch.nn.utils.vector_to_parameters(flat.clone(), ref.parameters())

    # -- set-up refusal
    checker = _checker() if use_checks else None
    if checker is not None:
        check, setup_error = checker
        refused = None
        try:
            check(model)
        except setup_error as e:
            refused = refusal_line(str(e))
        refused = _stage(refused, group)
        if refused:
            return dict(row, result="refused", detail=refused)

    # -- reference: each document alone, eager, positions from 0; rank r runs documents r, r+world, ...
    text = _text_config(model.config)
    vocab = getattr(text, "vocab_size", None) or TINY["vocab_size"]
    lengths, ids, pos, labels = _batch(vocab)
    n_valid = int((labels != -100).sum())
    err = None
    try:
        ref_vec, ref_loss = _reference(ref, rank, world, lengths, ids, labels, n_valid)
    except Exception as e:
        err = f"reference forward: {_first_line(e)}"
    err = _stage(err, group)
    if err:
        return dict(row, result="not built", detail=err)
    dist.all_reduce(ref_vec, group=group)
    dist.all_reduce(ref_loss, group=group)
    ref_grads = _by_name(ref, ref_vec)

    # -- hf_cp: this rank's rows under its CP context, in two modes
    modes = [ShardMode.RING_PER_DOC, second_mode(model.config)]
    errors, worst_all = {}, []
    for mode in modes:
        model.zero_grad(set_to_none=True)
        rows = member_rows(mode, DISTRIBUTED, LOCALS, rank)
        ctx = CPContext(
            group=group,
            group_ranks=tuple(range(world)),
            member=rank,
            mode=mode,
            distributed_lengths=tuple(DISTRIBUTED),
            local_lengths=tuple(LOCALS[rank]),
        )
        err = None
        loss_val = torch.zeros((), dtype=torch.float64)
        try:
            with cp_context(ctx):
                out = model(input_ids=ids[rows][None], position_ids=pos[rows][None], use_cache=False)
                loss = _ce_sum(out.logits[0], labels[rows]) / n_valid
                loss.backward()
            loss_val = loss.detach().double()
        except Exception as e:
            err = f"{mode.value}: {_first_line(e)}"
        err = _stage(err, group)
        if err:
            errors[mode.value] = err
            continue
        cp_vec = _grad_vector(model)
        dist.all_reduce(cp_vec, group=group)
        dist.all_reduce(loss_val, group=group)
        worst, name = _worst(model, ref_grads, cp_vec)
        loss_err = abs(loss_val.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-12)
        worst_all.append((max(worst, loss_err), mode.value, name if worst >= loss_err else "loss"))
    row["modes"] = [m.value for m in modes]
    row["grad_scale"] = ref_vec.abs().max().item()
    if errors:
        return dict(row, result="crash", detail="; ".join(errors.values()))
    err, mode_name, where = max(worst_all)
    row.update(max_rel_err=err, worst=f"{mode_name}: {where}")
    if err <= REL_TOL and row["grad_scale"] > 0:
        return dict(row, result="exact", detail=f"{err:.1e}")
    # above REL_TOL: is that the family's own float32 noise? The same per-document reference with
    # sdpa instead of eager (the same mathematics, another summation order) measures it.
    floor = _noise_floor(ref, ref_grads, rank, world, lengths, ids, labels, n_valid, group)
    row["noise_floor"] = floor
    if floor is not None and floor <= FLOOR_MAX and err <= FLOOR_FACTOR * floor and row["grad_scale"] > 0:
        return dict(row, result="exact", detail=f"{err:.1e} (float32 floor, eager vs sdpa: {floor:.1e})")
    fl = f", float32 floor {floor:.1e}" if floor is not None else ""
    return dict(row, result="MISMATCH", detail=f"{err:.1e} ({mode_name}: {where}{fl})")


def _reference(ref, rank, world, lengths, ids, labels, n_valid):
    """Each document alone through `ref`, positions from 0, loss summed / n_valid; rank r runs
    documents r, r + world, ...: (this rank's gradient vector, its loss) to be summed over ranks."""
    ref.zero_grad(set_to_none=True)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    ref_loss = torch.zeros((), dtype=torch.float64)
    for d in range(rank, len(lengths), world):
        a, b = starts[d], starts[d + 1]
        out = ref(input_ids=ids[a:b][None], position_ids=torch.arange(b - a)[None], use_cache=False)
        loss = _ce_sum(out.logits[0], labels[a:b]) / n_valid
        loss.backward()
        ref_loss += loss.detach().double()
    return _grad_vector(ref), ref_loss


def _by_name(model, vec):
    out, o = {}, 0
    for n, p in model.named_parameters():
        out[n] = vec[o : o + p.numel()].view_as(p)
        o += p.numel()
    return out


def _noise_floor(ref, ref_grads, rank, world, lengths, ids, labels, n_valid, group) -> Optional[float]:
    """Max relative gradient difference of the eager reference against the same reference with
    sdpa; None where the family has no sdpa."""
    import torch.distributed as dist

    err = None
    try:
        other = copy.deepcopy(ref)
        other.set_attn_implementation("sdpa")
        other.train()
        vec, _ = _reference(other, rank, world, lengths, ids, labels, n_valid)
    except Exception as e:
        err = _first_line(e)
    if _stage(err, group):
        return None
    dist.all_reduce(vec, group=group)
    return _worst(other, ref_grads, vec)[0]


def run_families(
    rank: int,
    world: int,
    names: List[str],
    use_checks: bool = True,
    progress: Optional[str] = None,
    dtype=torch.float32,
):
    """fn for dist_utils.run_distributed: every family of `names`, one row each (same on all ranks)."""
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))  # the CP group: the whole world
    rows = []
    for name in names:
        t = time.monotonic()
        if progress and rank == 0:
            with open(progress, "a") as f:
                f.write(json.dumps(dict(family=name, result="started")) + "\n")
        try:
            row = _one_family(rank, world, name, use_checks, group, dtype)
        except Exception as e:  # a harness fault between agreed stages: ranks may be out of step now
            row = dict(family=name, result="crash", detail=f"harness: {_first_line(e)}", tb=traceback.format_exc())
            rows.append(row)
            break
        row["seconds"] = round(time.monotonic() - t, 2)
        rows.append(row)
        if progress and rank == 0:
            with open(progress, "a") as f:
                f.write(json.dumps(row) + "\n")
    return rows


def format_table(rows: List[dict]) -> str:
    lines = ["| family | result | max grad rel error / reason |", "|---|---|---|"]
    for r in rows:
        detail = str(r.get("detail", "")).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['family']} | {r['result']} | {detail} |")
    return "\n".join(lines)


def run_all(
    names: Optional[List[str]] = None,
    use_checks: bool = True,
    timeout_s: float = 600,
    progress=None,
    dtype=torch.float32,
):
    """All families in one spawned world-2 gloo job; returns rank 0's rows."""
    from helpers.dist_utils import run_distributed

    names = families() if names is None else list(names)
    out = run_distributed(
        run_families, 2, names, use_checks, progress, dtype, timeout_s=timeout_s, collective_timeout_s=60
    )
    status, value = out[0]
    if status != "ok":
        raise RuntimeError(f"rank 0 failed: {value}")
    if out[1][0] != "ok":
        raise RuntimeError(f"rank 1 failed: {out[1][1]}")
    return value
