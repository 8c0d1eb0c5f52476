"""Whether a checkpoint can be resumed by this run's engine and model, told before anything loads.

A checkpoint's files say which engine wrote it: DeepSpeed (`latest` naming a `global_stepN`
folder; ZeRO-3 when every rank saved its own model states), FSDP2 through accelerate
(`pytorch_model_fsdp_0/`, torch distributed checkpoint shards), or plain (`model.safetensors`
and `optimizer.pt`: one process or DDP). Each engine loads only its own layout: before, an
FSDP2 checkpoint resumed under ZeRO-2 (and back) passed the dry run ("fits this run") and failed
the launch inside the engine's load. A checkpoint of another model (its `config.json`) is refused
by the field that differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from hf_cp.readers import load_json  # nesting bounded (readers.py)
from hf_cp.train.checks.setup import SetupError

FSDP2_MODEL_FOLDER = "pytorch_model_fsdp_0"  # accelerate's sharded FSDP model state
# the fields of a model config that decide every parameter's shape
SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
ENGINE_NAMES = {
    "zero": "DeepSpeed ZeRO-1/2",
    "zero3": "DeepSpeed ZeRO-3",
    "fsdp2": "FSDP2",
    "plain": "no parameter sharding (one process or DDP)",
}


def checkpoint_engine(checkpoint) -> Optional[str]:
    """ "zero", "zero3", "fsdp2" or "plain" from the checkpoint's layout; None when it holds no
    optimizer state of any engine (a model-only folder)."""
    ckpt = Path(checkpoint)
    latest = ckpt / "latest"
    if latest.is_file():
        folder = ckpt / latest.read_text().strip()
        if any(folder.glob("zero_pp_rank_*_mp_rank_00_model_states.pt")):
            return "zero3"
        return "zero"
    if (ckpt / FSDP2_MODEL_FOLDER).is_dir():
        return "fsdp2"
    if (ckpt / "optimizer.pt").is_file():
        return "plain"
    return None


def run_engine(sharding: Optional[str], deepspeed_config: Optional[dict]) -> str:
    """This run's engine in checkpoint_engine's words: `sharding` ("fsdp2", "zero3", None) and
    the DeepSpeed config (None without DeepSpeed)."""
    if sharding == "fsdp2":
        return "fsdp2"
    if deepspeed_config is not None:
        zero = deepspeed_config.get("zero_optimization") or {}
        return "zero3" if isinstance(zero, dict) and zero.get("stage") == 3 else "zero"
    return "plain"


def check_checkpoint_fits(checkpoint, engine: str, model_config=None) -> None:
    """Raise SetupError when `checkpoint` was saved by another engine than `engine` (run_engine)
    or for a model whose shape fields differ from `model_config`'s."""
    saved = checkpoint_engine(checkpoint)
    if saved is not None and saved != engine:
        raise SetupError(
            f"checkpoint {checkpoint} was saved under {ENGINE_NAMES[saved]}, and this run trains under "
            f"{ENGINE_NAMES[engine]}: each engine loads only its own optimizer layout. Resume it under "
            f"{ENGINE_NAMES[saved]}, or start a fresh run from its weights (DeepSpeed: zero_to_fp32.py in the "
            f"checkpoint; FSDP2: accelerate merge-weights) with resume_from_checkpoint off"
        )
    config_file = Path(checkpoint) / "config.json"
    if model_config is None or not config_file.is_file():
        return
    try:
        theirs = load_json(config_file.read_text())
    except (OSError, ValueError):
        return  # a damaged file is check_checkpoint_files's to name
    ours = model_config.to_dict() if hasattr(model_config, "to_dict") else dict(model_config)
    for source in (theirs, ours):  # multimodal configs keep the language model's shape in text_config
        if isinstance(source.get("text_config"), dict):
            source.update({k: v for k, v in source["text_config"].items() if k in SHAPE_FIELDS and k not in source})
    differ = [f for f in SHAPE_FIELDS if f in theirs and f in ours and theirs[f] != ours[f]]
    if differ:
        shown = ", ".join(f"{f} {theirs[f]!r} there, {ours[f]!r} here" for f in differ)
        raise SetupError(
            f"checkpoint {checkpoint} holds another model than this run's ({shown}): its weights and optimizer "
            f"state cannot load into this model. Resume it with its own model config, or start afresh"
        )
