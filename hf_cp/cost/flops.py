"""Model FLOPs of a training step and the model FLOPs utilisation (MFU): the one definition behind
the run summary, the per-step logs (`cp/tflops`, `cp/mfu`) and the GPU throughput benchmark
(scripts/gpu_throughput.py).

Per token, the forward and backward pass of a matmul cost 6 FLOPs per matmul parameter (2 in
forward, 4 in backward): the decoder layers' q, k, v, o, gate, up and down projections, and the
LM head, tied to the embedding or not (a tied head still runs its matmul). The embedding is a
lookup, not a matmul, and is left out; norms and biases are negligible.

Attention adds, per layer and attended query-key pair, 4 FLOPs per head and head dimension in
forward (Q K^T and P V, 2 each), and 3.5 times that for forward and backward (flash attention's
backward is 2.5 times its forward). The attended pairs of a sample are its masked area
(modes/segments.masked_doc_pairs: n(n+1)/2 for a causal sample), the number the planner prices.

Recomputation is not counted (activation checkpointing, ChunkFlow's recomputed chunks): MFU
counts the FLOPs the model needs, not the FLOPs the hardware ran.

    MFU = step FLOPs / step time / (GPUs x dense bf16 peak of one GPU)

Torch-free, like the rest of cost/: the device's name comes in as a string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple

from hf_cp.cost.config_files import ConfigError
from hf_cp.cost.dims import ATTENTION_FWD_BWD, MATMUL_FWD_BWD, GridTHW, ModelDims, VisionDims
from hf_cp.modes.segments import masked_doc_pairs
from hf_cp.samples.masks import SampleMask

# FLOPs per matmul parameter and token: 2 forward (multiply and add), 4 backward (the input's
# gradient and the weight's)
MATMUL_FLOPS_PER_PARAMETER = 6.0

# Dense bf16 tensor-core peaks per GPU (no structured sparsity), TFLOP/s, from the vendors'
# datasheets: (text matched in the device's name, the GPU it means, peak). Most specific first:
# "H200 NVL" before "H200", "GH200" before "H200", "H100 PCIe" before "H100". torch names an
# H100 SXM "NVIDIA H100 80GB HBM3", an H200 SXM "NVIDIA H200", an A100 "NVIDIA A100-SXM4-80GB".
PEAK_BF16_TFLOPS: Tuple[Tuple[str, str, float], ...] = (
    ("GH200", "NVIDIA GH200", 989.0),
    ("H200 NVL", "NVIDIA H200 NVL", 835.0),
    ("H200", "NVIDIA H200 SXM", 989.0),
    ("H100 NVL", "NVIDIA H100 NVL", 835.0),
    ("H100 PCIe", "NVIDIA H100 PCIe", 756.0),
    ("H100", "NVIDIA H100 SXM", 989.0),
    ("H800", "NVIDIA H800 SXM", 989.0),
    ("B200", "NVIDIA B200", 2250.0),
    ("A100", "NVIDIA A100", 312.0),
    ("A800", "NVIDIA A800", 312.0),
    ("L40S", "NVIDIA L40S", 362.0),
    ("MI300X", "AMD Instinct MI300X", 1307.0),
)


@dataclass(frozen=True)
class DevicePeak:
    """The dense bf16 peak MFU is measured against: `gpu` and `tflops` are None for a device
    without a known peak (a CPU, a GPU not in PEAK_BF16_TFLOPS), where MFU is not reported."""

    device: str  # the device's own name (torch.cuda.get_device_name, or "cpu")
    gpu: Optional[str] = None  # the GPU of PEAK_BF16_TFLOPS the name matched
    tflops: Optional[float] = None

    def describe(self) -> str:
        if self.tflops is None:
            return f"no dense bf16 peak known for {self.device}"
        return f"{self.gpu} dense bf16 peak {self.tflops:g} TFLOP/s"


def device_peak(device_name: str) -> DevicePeak:
    """The peak of the device called `device_name` (None for a CPU or an unknown GPU)."""
    folded = device_name.lower()
    for pattern, gpu, tflops in PEAK_BF16_TFLOPS:
        if pattern.lower() in folded:
            return DevicePeak(device_name, gpu, tflops)
    return DevicePeak(device_name)


@dataclass(frozen=True)
class ModelFlops:
    """The FLOPs of one forward and backward pass, per token and per attended pair."""

    matmul_per_token: float  # every layer's matmuls and the LM head
    attention_per_pair: float  # every layer's attention, per attended query-key pair

    @classmethod
    def from_dims(cls, dims: ModelDims) -> ModelFlops:
        if dims.vocab_size <= 0:
            raise ConfigError(
                "model FLOPs need the vocabulary size (the LM head's matmul): the model config has no vocab_size"
            )
        # ModelDims holds the cost model's per-layer numbers: 6 x the layer's matmul parameters per
        # token, and 3.5 x 4 x heads x head_dim per attended pair (fwd + bwd)
        head = MATMUL_FLOPS_PER_PARAMETER * dims.vocab_size * dims.hidden
        return cls(
            matmul_per_token=dims.num_layers * dims.linear_flops_per_token + head,
            attention_per_pair=dims.num_layers * dims.attention_flops_per_pair,
        )

    @classmethod
    def from_config(cls, config: Mapping, source: str = "model config") -> ModelFlops:
        """From a transformers config as a dict (`model.config.to_dict()`, a config.json)."""
        return cls.from_dims(ModelDims.from_hf_config(config, source=source))

    def samples(self, lengths: Sequence[int], masks: Sequence[Optional[SampleMask]]) -> float:
        """FLOPs of training on samples of `lengths` tokens under `masks` (None: causal)."""
        if len(lengths) != len(masks):
            raise ValueError(f"{len(lengths)} sample lengths but {len(masks)} masks")
        tokens = sum(lengths)
        pairs = sum(masked_doc_pairs(n, m) for n, m in zip(lengths, masks))
        return tokens * self.matmul_per_token + pairs * self.attention_per_pair


def vision_item_flops(vision: VisionDims, grid: GridTHW) -> Tuple[float, float]:
    """(matmul, attention) FLOPs of one forward and backward pass of the vision tower over one
    image or clip of patch grid `grid` (t, h, w): its patches through every block, the patch
    embedding and the mergers (DeepStack's too, with their rows' addition into the language
    model's hidden states, counted with the matmuls), and its windows' and frames' attended
    pairs (VisionDims)."""
    t, h, w = grid
    patches = t * h * w
    matmul = (MATMUL_FWD_BWD * vision.forward_flops_per_patch + vision.deepstack_add_flops_per_patch) * patches
    return matmul, ATTENTION_FWD_BWD * vision.forward_flops_per_pair * vision.attention_pairs(grid)


def achieved_tflops(flops: float, seconds: float, gpus: int = 1) -> float:
    """Model TFLOP/s per GPU: `flops` done by `gpus` GPUs together in `seconds`."""
    if seconds <= 0 or gpus <= 0:
        raise ValueError(f"achieved_tflops needs a positive time and GPU count, got {seconds} s on {gpus} GPU(s)")
    return flops / seconds / gpus / 1e12


def mfu(flops: float, seconds: float, gpus: int, peak: DevicePeak) -> Optional[float]:
    """Model FLOPs utilisation, a fraction of `peak` (None where the device has no known peak)."""
    if peak.tflops is None:
        return None
    return achieved_tflops(flops, seconds, gpus) / peak.tflops
