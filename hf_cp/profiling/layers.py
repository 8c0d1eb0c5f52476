"""Decoder layers of a transformers model, built from its config, run on one rank's shards.

The layers are the model's own classes (AutoModel.from_config with random weights, nothing
downloaded), so the measured linear work is what training runs. Attention goes through a
function registered with transformers' AttentionInterface that computes exactly the rank's
shard of attention (shard_attention.py); the communication that would bring remote keys is
left out (their keys are random placeholders), which is what replay and profiling measure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Tuple, Union

import torch

from hf_cp.cost.config_files import ConfigError, resolve_config
from hf_cp.profiling.shard_attention import SegmentLayout
from hf_cp.readers import load_json

ATTENTION_NAME = "hf_cp_shard_compute"


@dataclass(frozen=True)
class RankWork:
    """One rank's compute in one micro-batch.

    segments: (start, length) query runs attending causally to their document's keys
        0..start+length-1 with all heads (local documents, ring shards).
    head_split_docs / head_split_ways / head_split_tokens: Ulysses. After the all-to-all the
        rank attends the whole documents `head_split_docs` on heads/ways query heads; it holds
        `head_split_tokens` of their tokens for the linear layers.
    Token layout: the segments' tokens, then the head-split tokens (hf_cp.attention.context).
    """

    segments: Tuple[Tuple[int, int], ...] = ()
    head_split_docs: Tuple[int, ...] = ()
    head_split_ways: int = 1
    head_split_tokens: int = 0

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.segments) + self.head_split_tokens

    @property
    def is_empty(self) -> bool:
        return self.tokens == 0


def load_hf_config(model: Union[str, Path, dict]):
    """A transformers config from a config.json path, a model folder or a model name (the user's
    configs/models/ here, then the built-ins: hf_cp.resources)."""
    from transformers import AutoConfig

    if isinstance(model, dict):
        cfg, source = dict(model), "config"
    else:
        p = resolve_config(model, "models", (".json",))
        if p.is_dir():
            p = p / "config.json"
        try:
            cfg, source = load_json(p.read_text()), str(p)
        except (OSError, ValueError) as e:  # JSONDecodeError (nested too deep too), UnicodeDecodeError
            raise ConfigError(f"model config {p}: {e}") from None
    if "model_type" not in cfg:
        raise ConfigError(f"{source}: missing field 'model_type' (needed to build the decoder layer)")
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype", "dtype")}
    try:
        return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{source}: transformers cannot build this config: {e}") from None


def _shard_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    shard_plan: Optional[PreparedWork] = None,
    **kwargs,
):
    """transformers attention function: q [1, H, T, D], k/v [1, H_kv, T, D] -> [1, T, H, D]."""
    if shard_plan is None:
        raise ValueError(
            f"attention {ATTENTION_NAME!r} needs the shard_plan keyword (run the layers through DecoderStack)"
        )
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    n_seg = shard_plan.segment_layout.tokens if shard_plan.segment_layout else 0
    outs = []
    if n_seg:
        outs.append(
            shard_plan.segment_layout.attend(
                q[:n_seg], k[:n_seg], v[:n_seg], shard_plan.prefix_k, shard_plan.prefix_v, scaling
            )
        )
    if shard_plan.split_layout is not None:
        outs.append(shard_plan.head_split_attend(q[n_seg:], k[n_seg:], v[n_seg:], scaling))
    return torch.cat(outs).unsqueeze(0), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _shard_attention)


@dataclass
class PreparedWork:
    """Inputs of one micro-batch, made before timing: activations, rotary tables, layouts."""

    work: RankWork
    hidden: torch.Tensor
    grad_out: torch.Tensor
    position_embeddings: Tuple[torch.Tensor, torch.Tensor]
    segment_layout: Optional[SegmentLayout]
    prefix_k: Optional[torch.Tensor]
    prefix_v: Optional[torch.Tensor]
    split_layout: Optional[SegmentLayout] = None
    split_q_heads: int = 0
    split_kv_heads: int = 0
    split_placeholders: Tuple[torch.Tensor, ...] = field(default_factory=tuple)

    def head_split_attend(self, q, k, v, scale):
        """Ulysses: this rank's head share over all tokens of the documents; the other ranks' tokens
        (placeholders) stand in for what the all-to-all would deliver."""
        w = self.work
        pq, pk, pv = self.split_placeholders
        qh, kvh = self.split_q_heads, self.split_kv_heads
        q_all = torch.cat([q[:, :qh], pq])
        k_all = torch.cat([k[:, :kvh], pk])
        v_all = torch.cat([v[:, :kvh], pv])
        out = self.split_layout.attend(q_all, k_all, v_all, scale=scale)
        # the reverse all-to-all returns all heads of this rank's own tokens
        return out[: w.head_split_tokens].repeat(1, w.head_split_ways, 1)


class DecoderStack:
    """`num_layers` decoder layers of the model in `model_config`, on one device."""

    def __init__(
        self,
        model_config,
        num_layers: int = 1,
        device: Union[str, torch.device] = "cpu",
        dtype: Optional[torch.dtype] = None,
        seed: int = 0,
        layer_type: Optional[str] = None,
    ):
        """`layer_type`: every layer of this kind of the config's `layer_types` (a hybrid's
        "full_attention" or "linear_attention"; None: the config's first layers as they are)."""
        from transformers import AutoModel

        if num_layers < 1:
            raise ValueError(f"num_layers must be at least 1, got {num_layers}")
        _register_attention()
        self.device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        config = load_hf_config(model_config)
        config.num_hidden_layers = num_layers
        config.vocab_size = 8  # the embedding is not measured; keep it small
        config.use_cache = False
        if layer_type is not None:
            config.layer_types = [layer_type] * num_layers
        elif hasattr(config, "layer_types") and config.layer_types is not None:
            config.layer_types = list(config.layer_types)[:num_layers] or None
        config._attn_implementation = ATTENTION_NAME
        torch.manual_seed(seed)
        with torch.device(self.device):
            model = AutoModel.from_config(config, dtype=self.dtype, attn_implementation=ATTENTION_NAME)
        if not hasattr(model, "layers") or not hasattr(model, "rotary_emb"):
            raise ConfigError(
                f"{type(model).__name__} has no .layers / .rotary_emb; hf-cp profiles decoder-only "
                f"models of the Llama family (Llama, Qwen2, Mistral, ...)"
            )
        model.train()
        self.config = config
        self.layers = model.layers
        self.rotary = model.rotary_emb
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden_size // self.num_heads
        self.parameters_per_layer = sum(p.numel() for p in self.layers[0].parameters())

    def _rand(self, *shape, requires_grad=False) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=self.dtype, requires_grad=requires_grad)

    def prepare(self, work: RankWork) -> PreparedWork:
        if work.is_empty:
            raise ValueError("nothing to prepare: the rank holds no tokens in this micro-batch")
        T = work.tokens
        positions = [torch.arange(s, s + n) for s, n in work.segments]
        if work.head_split_tokens:
            positions.append(torch.arange(work.head_split_tokens))
        position_ids = torch.cat(positions).to(self.device).unsqueeze(0)
        hidden = self._rand(1, T, self.hidden_size, requires_grad=True)
        with torch.no_grad():
            pe = self.rotary(hidden, position_ids=position_ids)
        seg_layout = SegmentLayout(work.segments, self.device) if work.segments else None
        prefix_k = prefix_v = None
        if seg_layout is not None and seg_layout.max_start:
            prefix_k = self._rand(seg_layout.max_start, self.num_kv_heads, self.head_dim)
            prefix_v = self._rand(seg_layout.max_start, self.num_kv_heads, self.head_dim)
        prepared = PreparedWork(work, hidden, self._rand(1, T, self.hidden_size), pe, seg_layout, prefix_k, prefix_v)
        if work.head_split_docs:
            g = work.head_split_ways
            if self.num_heads % g:
                raise ValueError(f"Ulysses over {g} ranks needs num_heads ({self.num_heads}) divisible by {g}")
            kv_after_replication = self.num_kv_heads if self.num_kv_heads >= g else g
            qh, kvh = self.num_heads // g, kv_after_replication // g
            total = sum(work.head_split_docs)
            others = total - work.head_split_tokens
            if others < 0:
                raise ValueError(
                    f"head-split rank holds {work.head_split_tokens} tokens of documents totalling {total}"
                )
            prepared.split_layout = SegmentLayout([(0, n) for n in work.head_split_docs], self.device)
            prepared.split_q_heads, prepared.split_kv_heads = qh, kvh
            prepared.split_placeholders = (
                self._rand(others, qh, self.head_dim),
                self._rand(others, kvh, self.head_dim),
                self._rand(others, kvh, self.head_dim),
            )
        return prepared

    def forward_backward(self, prepared: PreparedWork) -> None:
        prepared.hidden.grad = None
        h = prepared.hidden
        for layer in self.layers:
            h = layer(h, position_embeddings=prepared.position_embeddings, shard_plan=prepared)
        h.backward(prepared.grad_out)

    def zero_grad(self) -> None:
        for p in self.layers.parameters():
            p.grad = None
