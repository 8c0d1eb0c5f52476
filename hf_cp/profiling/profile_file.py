"""Write a measured profile as YAML that HardwareProfile.load reads, saying how each number was made."""

from __future__ import annotations

import datetime
import textwrap
from pathlib import Path
from typing import Union

import yaml

from hf_cp.profiling.engine_reduction import EngineReduction
from hf_cp.profiling.measure import ZERO2_RANKS, ProfileResult


def _dump(d: dict) -> str:
    return yaml.safe_dump(d, sort_keys=False, default_flow_style=False, width=110)


def _round_floats(x, digits=6):
    if isinstance(x, float):
        return float(f"{x:.{digits}g}")
    if isinstance(x, dict):
        return {k: _round_floats(v, digits) for k, v in x.items()}
    if isinstance(x, list):
        return [_round_floats(v, digits) for v in x]
    return x


def profile_yaml(result: ProfileResult, command: str) -> str:
    p = result.profile
    st = result.settings
    lf, af = result.layer_fit, result.attention_fit
    bpe = p["bytes_per_element"]
    dev = st.device.type
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        f"# Hardware profile measured by `hf-cp profile` ({result.wall_s:.0f} s).",
        f"# command: {command}",
        f"# date: {now}",
        f"# machine: {result.machine}; {str(st.dtype).replace('torch.', '')}, {st.threads} thread(s)",
        f"# {result.notes['load']}" if dev == "cpu" else "#",
        f"# layer: one {result.notes.get('layer_class', 'decoder layer')} with random weights, fwd+bwd; attention "
        f"through hf_cp.attention's block kernels ({result.notes.get('kernel', '?')}).",
        _dump({"name": p["name"], "description": p["description"]}).rstrip(),
        "# One layer fwd+bwd, t = c1*T + c2*sum over documents of pairs(l)/efficiency(l) + c0 with",
        "# pairs(l) = l(l+1)/2 (causal query-key pairs), fitted by non-negative least squares over",
        f"# {len(result.layer_rows)} runs ({st.tokens}-token compositions and token counts down to {st.tokens // 8}):",
        f"# R^2 {lf.r2:.4f}, max relative error {lf.max_rel_err:.3f}, median {lf.median_rel_err:.3f}.",
        f"# Times: {'median of' if dev == 'cuda' else 'fastest of'} {st.repeats} runs"
        + ("" if dev == "cuda" else f" ({result.notes.get('clock', 'wall time')})")
        + (
            ""
            if dev == "cuda"
            else f", round-robin; {result.notes.get('retimed', 0)} runs the fit disagreed with "
            f"most were re-timed and kept if faster (outside load only adds time)"
        )
        + ".",
        f"# Attention alone over the same compositions: R^2 {af.r2:.4f}, max relative error {af.max_rel_err:.3f}.",
        _dump({k: float(f"{p[k]:.8g}") for k in ("c1_ms_per_token", "c2_ms_per_pair", "c0_ms")}).rstrip(),
        *(
            [
                f"# The hybrid's {result.notes.get('linear_layer_class', 'linear-time')} layer fwd+bwd on one document "
                "(its state restarts at every document), t = linear_layer_ms_per_token*T + c0; the layer above is its",
                "# softmax attention layer. The cost model prices each kind of layer at its own rate.",
                _dump({"linear_layer_ms_per_token": float(f"{p['linear_layer_ms_per_token']:.8g}")}).rstrip(),
            ]
            if p.get("linear_layer_ms_per_token")
            else []
        ),
        "# The model dimensions c1 and c2 were measured with (CostModel scales them by FLOPs for others).",
        _dump({"fitted_dims": p["fitted_dims"]}).rstrip(),
        f"# Attention fwd+bwd, causal pairs per ms of query chunks of length q against {st.chunk_keys} keys, over",
        "# the best chunk length. The cost model needs a table that never decreases: where a longer chunk measured",
        "# slower (its causal diagonal is a larger share of its work, or noise) it keeps the shorter chunk's value.",
        "# Raw values under calibration.query_chunks.",
        _dump({"chunk_efficiency": p["chunk_efficiency"]}).rstrip(),
        "# Attention time on heads/w heads, times w, over all heads (Ulysses); at least 1.",
        _dump({"head_split_factor": p["head_split_factor"]}).rstrip(),
        "# Memory, whole model, with full activation checkpointing:",
        f"#   alpha = {p['fitted_dims']['num_hidden_layers']} layers x hidden {p['fitted_dims']['hidden_size']} x "
        f"{bpe} B (checkpointed layer inputs)",
        f"#         + one layer's recompute working set, {result.notes['layer_bytes_per_token']} B/token: "
        + (
            "the slope of the measured peak memory of one layer fwd+bwd over T"
            if dev == "cuda"
            else "the slope over T of the bytes autograd saves for backward in one layer (measured with "
            "saved_tensors_hooks; a CPU has no peak-memory counter, transient buffers are not included)"
        ),
        f"#   beta  = {result.notes['model_parameters']} parameters under ZeRO-2 on {ZERO2_RANKS} ranks (nominal): "
        f"{bpe} B params + {bpe} B grads + {12 if bpe == 2 else 8} B optimizer state / {ZERO2_RANKS}",
        _dump({k: p[k] for k in ("activation_bytes_per_token", "static_bytes", "bytes_per_element")}).rstrip(),
        "# nominal (not measured, one device cannot): ranks per node and link speeds"
        + (
            " (NVLink 4 derated to 350 GB/s, 400 Gb/s InfiniBand per GPU derated to 40 GB/s)"
            if dev == "cuda"
            else " (gloo over shared memory; 10 GbE between hosts)"
        ),
        _dump({"gpus_per_node": p["gpus_per_node"], "links": p["links"]}).rstrip(),
        *([engine_reduction_yaml(result.engine_reduction, command).rstrip()] if result.engine_reduction else []),
        "# What was measured (times in ms); HardwareProfile ignores this section.",
        _dump(
            {
                "calibration": _round_floats(
                    {
                        "settings": st.to_dict(),
                        "layer_fit": lf.to_dict(),
                        "attention_fit": af.to_dict() | {"model": result.notes["attention_fit"]},
                        "layer": result.layer_rows,
                        "attention": result.attention_rows,
                        "query_chunks": result.chunk_rows,
                        "head_split": result.head_split_rows,
                        "memory": result.memory_rows,
                    }
                )
            }
        ).rstrip(),
    ]
    return "\n".join(out) + "\n"


ENGINE_REDUCTION_KEY = "engine_reduction_ms_per_gb"
ENGINE_HEADER = "The training engine's own work per gradient reduction, per GB of gradients"


def engine_reduction_yaml(r: EngineReduction, command: str = "") -> str:
    """The profile's engine cost per GB of gradients, with what measured it, as YAML lines."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = (
        f"{ENGINE_HEADER} ({now}; {r.deepspeed_config}, {r.world} CPU ranks over gloo, a model of "
        f"{r.parameters / 1e6:.1f}M parameters; priced beside the bytes over the link, CostModel.reduction_fixed_ms; "
        f"it fits models near that size): {r.describe()}." + (f" Command: {command}" if command else "")
    )
    comment = textwrap.wrap(text, 100, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False)
    return "\n".join(comment + [_dump({ENGINE_REDUCTION_KEY: float(f"{r.ms_per_gb:.6g}")}).rstrip()]) + "\n"


def add_engine_reduction(path: Union[str, Path], r: EngineReduction, command: str = "") -> Path:
    """Put `r` into the profile at `path` in place (its other lines as they are; an earlier
    measurement's lines replaced), before its measured section."""
    path = Path(path)
    lines = path.read_text().splitlines(keepends=True)
    kept, in_block = [], False
    for line in lines:  # drop an earlier measurement: its comment block, up to and with its key
        in_block = in_block or line.startswith("# " + ENGINE_HEADER)
        if in_block or line.startswith(ENGINE_REDUCTION_KEY + ":"):
            in_block = in_block and not line.startswith(ENGINE_REDUCTION_KEY + ":")
            continue
        kept.append(line)
    block = engine_reduction_yaml(r, command)
    at = next((i for i, x in enumerate(kept) if x.startswith("# What was measured")), len(kept))
    path.write_text("".join(kept[:at]) + block + "".join(kept[at:]))
    return path


def write_profile(result: ProfileResult, path: Union[str, Path], command: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile_yaml(result, command))
    return path
