"""Fine-grained block FP8 (``quant_method: fp8``, float8_e4m3fn weights, a float32 ``weight_scale_inv``
per 128x128 block), as DeepSeek-V3 and Kimi-K2-Instruct are released, kept FP8 in device memory and
computed on torch's own kernels: nothing is fetched, no kernel of transformers' Hub path runs.

Two numerics, chosen per run (``--quantized-compute``, recorded in the spec):

- ``fp8``, as serving engines compute (DeepSeek-V3's recipe): every block-scaled linear layer keeps
  its FP8 weights and scales as stored and runs on torch's block-scaled FP8 GEMM (cuBLAS, compute
  capability 9.x), its input quantized on the fly per token and 128-column group (scale = amax /
  448, e4m3) by one Triton kernel (``fp8_kernel``) that writes the GEMM's operand. The result
  is the product of those quantized operands, accumulated by the tensor cores (fp32, promoted at
  every 128-column block) and rounded to bfloat16. Routed experts stay
  FP8 (1 byte per weight) and are expanded to the run's dtype just before their MoE layer runs
  (``expand_experts``), then computed as transformers computes unquantized experts: torch 2.11 has
  no grouped GEMM with block scales (``scaled_grouped_mm`` finds no implementation for 1x128 /
  128x128 on an H200, ``_scaled_grouped_mm`` takes row-wise scales only), so their activations are
  not quantized.
- ``dequantized``: every weight is its stored values times its block's scale, in the run's dtype,
  at load (``checkpoint``), and the model runs unquantized: the only route on CPU and on GPUs
  without block-scaled FP8 GEMMs, and selectable everywhere.

Shapes the GEMM cannot take as they are, handled exactly: a weight whose rows are not whole blocks
(DeepSeek-V3's 576-row ``kv_a_proj_with_mqa``) runs as it is, the GEMM applying the last block's
scale to the rows that exist; a weight whose columns are not whole blocks is padded with zero
columns once at install (and its input with zero columns per call), which adds exact zeros;
cuBLAS wants a multiple of 4 tokens and of 4 column blocks in the weight's scale layout, so the
operands are padded (zero rows, unit scales) inside the GEMM and the padding is cut off again.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK = 128  # the only block size the GEMM takes (1x128 activations, 128x128 weights)
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
TOKEN_MULTIPLE = 16  # the GEMM's activations padded to whole 16s of tokens (cuBLAS wants 4s)
FP8 = torch.float8_e4m3fn
_EXPAND_CHUNK = 1 << 28  # float32 values expanded at once (1 GiB): bounds the transient of an expansion


def gemm_blocker(device: str, dtype: str, block: list[int] | None, activation_scheme: str = "dynamic") -> str | None:
    """Why the ``fp8`` route cannot run here (one line), or None where it can."""
    if block is None or list(block) != [BLOCK, BLOCK]:
        return f"torch's block-scaled FP8 GEMM takes {BLOCK}x{BLOCK} weight blocks, the checkpoint has {block}"
    if activation_scheme != "dynamic":
        return f"activation_scheme {activation_scheme!r}: only dynamic (per-token) activation scales are computed"
    if not device.startswith("cuda"):
        return f"torch has no block-scaled FP8 GEMM on {device}"
    if dtype != "bfloat16":
        return f"the block-scaled FP8 GEMM writes bfloat16, the run's dtype is {dtype}"
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    if not torch.cuda.is_available():
        return "this machine has no CUDA device"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (it runs the activations' quantization)"
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    if major != 9:
        return f"torch's block-scaled FP8 GEMM runs on compute capability 9.x (cuBLAS), this GPU is {major}.{minor}"
    return None


def parallel_refusal(config: dict, tensor: int) -> str | None:
    """Why FP8 weights cannot be split over ``tensor`` ranks with their scales (one line), or None.
    transformers' TP plans split the MLPs' (and shared and routed experts') intermediate dimension;
    each rank's share must be whole blocks, or a rank would hold a scale for rows it lacks."""
    if tensor <= 1:
        return None
    for key in ("intermediate_size", "moe_intermediate_size"):
        size = config.get(key)
        if isinstance(size, int) and size % (BLOCK * tensor):
            return f"{key} {size} over {tensor} ranks is not whole {BLOCK}-row blocks per rank"
    return None


# ---------------------------------------------------------------- the arithmetic


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 128) as float8_e4m3fn values [M, K] and float32 scales [M, K/128]:
    each token's 128-column group divided by its own scale, amax times float32(1/448) (one
    expression that every device rounds alike; a group of zeros: tiny). The definition the CUDA
    kernel (``fp8_kernel``) equals bit for bit."""
    groups = x.float().unflatten(-1, (-1, BLOCK))
    scale = groups.abs().amax(-1).clamp(min=1e-12) * (1 / E4M3_MAX)
    values = (groups / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return values.flatten(-2), scale


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype) -> torch.Tensor:
    """Block-scaled FP8 weights [..., N, K] times their scales [..., ceil(N/bn), ceil(K/bk)] (each
    scale covers a bn x bk block, the last row and column of blocks partial), in ``dtype``: each
    value computed in float32, then rounded once to ``dtype``."""
    rows, cols = weight.shape[-2:]
    scale = scale_inv.to(torch.float32)
    scale = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.to(torch.float32) * scale).to(dtype)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [..., N, K] as a block-FP8 checkpoint stores them: float8_e4m3fn values and a float32
    scale per 128x128 block (amax / 448; the last blocks partial), [..., ceil(N/128), ceil(K/128)]."""
    rows, cols = weight.shape[-2:]
    padded = F.pad(weight.float(), (0, -cols % BLOCK, 0, -rows % BLOCK))
    blocks = padded.unflatten(-1, (-1, BLOCK)).unflatten(-3, (-1, BLOCK))  # [..., Nb, 128, Kb, 128]
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / E4M3_MAX
    values = (blocks / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return values.flatten(-4, -3).flatten(-2)[..., :rows, :cols].contiguous(), scale


def expand_experts(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype) -> torch.Tensor:
    """Stored experts [E, N, K] (FP8) with their block scales [E, ceil(N/bn), ceil(K/bk)] as
    ``dtype`` weights, the same values as ``dequantize_blocks``, a few experts at a time so that the
    float32 transient stays near 1 GiB whatever the layer's size."""
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    step = max(1, _EXPAND_CHUNK // max(1, weight[0].numel()))
    for start in range(0, weight.shape[0], step):
        part = slice(start, start + step)
        out[part] = dequantize_blocks(weight[part], scale_inv[part], block, dtype)
    return out


def activation_operands(values: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantized activations ``values`` [M, K] (e4m3) with ``scales`` [M, K/128] in the layout the
    block-scaled GEMM reads (H200, torch 2.11): padded to a multiple of 16 tokens (cuBLAS refuses
    a count that is not a multiple of 4) with zero rows and unit scales, the scales column-major,
    [M', K/128] with strides (1, M'). The reference of ``fp8_kernel.activation_operands``."""
    pad = -values.shape[0] % TOKEN_MULTIPLE
    if pad:
        values = F.pad(values.view(torch.uint8), (0, 0, 0, pad)).view(FP8)
        scales = F.pad(scales, (0, 0, 0, pad), value=1.0)
    scale_a = torch.empty_strided(scales.shape, (1, scales.shape[0]), dtype=scales.dtype, device=scales.device)
    scale_a.copy_(scales)  # strides (1, M') even for one column block, where .contiguous() would give (1, 1)
    return values, scale_a


def weight_operands(weight: torch.Tensor, weight_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] (e4m3) with its block scales [ceil(N/128), K/128] as the GEMM's second
    operand: transposed, [K, N] column-major; its scales transposed to [K/128 rounded up to 4,
    ceil(N/128)] with strides (1, that row count), the rows past K/128 unit scales of nothing."""
    k_blocks = weight_scale.shape[1]
    if k_blocks % 4:
        weight_scale = F.pad(weight_scale, (0, -k_blocks % 4), value=1.0)
    return weight.t(), weight_scale.contiguous().t()


@torch.library.custom_op("hsx::fp8_block_mm", mutates_args=(), device_types="cuda")
def block_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (K a multiple of 128) quantized per token and 128-column group, times the [N, K] e4m3
    weight with its [ceil(N/128), K/128] block scales, transposed: [M, N] bfloat16, on the
    quantization kernel (``fp8_kernel``) and torch's block-scaled GEMM. An opaque op to the
    compiler (dynamo cannot trace ``scaled_mm``)."""
    from torch.nn.functional import ScalingType

    from hsx.capture.quantized import fp8_kernel

    a, scale_a = fp8_kernel.activation_operands(x.contiguous(), TOKEN_MULTIPLE)
    b, scale_b = weight_operands(weight, weight_scale)
    out = F.scaled_mm(
        a, b, scale_a, ScalingType.BlockWise1x128, scale_b, ScalingType.BlockWise128x128, output_dtype=torch.bfloat16
    )
    return out[: x.shape[0]]


@block_mm.register_fake
def _(x, weight, weight_scale):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None):
    """The ``fp8`` route's linear layer: x [..., K] through a block-FP8 weight [N, K'] (K' >= K, the
    weight's zero-padded columns) to [..., N] in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    if weight.shape[1] != k:
        flat = F.pad(flat, (0, weight.shape[1] - k))
    out = torch.ops.hsx.fp8_block_mm(flat, weight, scale_inv).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


# ---------------------------------------------------------------- in the model


@dataclass(frozen=True)
class Installed:
    """What ``install`` put on torch's kernels, for the log."""

    linear: int  # FP8 linear layers on the block GEMM
    experts: int  # MoE layers whose FP8 experts expand just in time
    padded: tuple[str, ...]  # linear layers whose columns were padded to whole blocks

    def __str__(self) -> str:
        text = f"{self.linear} FP8 linear layers on torch's block-scaled FP8 GEMM"
        if self.experts:
            text += f", {self.experts} MoE layers' FP8 experts expanded just in time"
        if self.padded:
            text += f" ({len(self.padded)} padded to whole column blocks, e.g. {self.padded[0]})"
        return text


def install(model: torch.nn.Module) -> Installed:
    """Run the FP8 modules transformers loaded (FP8 weights kept, ``dequantize`` off) on torch's
    kernels instead of transformers' Hub kernels: linear layers through ``fp8_linear``, experts
    through ``expand_experts`` and transformers' own unquantized experts computation. Raises
    ``UnsupportedModel`` for an FP8 module of another kind, which only the Hub kernel runs."""
    from transformers.integrations import finegrained_fp8 as hf

    from hsx.errors import UnsupportedModel

    linear, experts, padded, other = 0, 0, [], []
    for name, module in model.named_modules():
        if type(module) is hf.FP8Linear:
            if module.weight.shape[1] % BLOCK:
                _pad_columns(module)
                padded.append(name)
            _swap(module, _linear_forward)
            linear += 1
        elif isinstance(module, hf.FP8Experts):
            other += _misaligned(name, module)
            _swap(module, _experts_forward)
            module.slice_bytes = None  # the whole layer expanded at once; ``experts.set_slice`` sets a budget
            experts += 1
        elif type(module).__module__ == hf.__name__ and type(module).__name__ != "FP8Embedding":
            other.append(f"{name} ({type(module).__name__})")
    if other:
        raise UnsupportedModel(
            f"FP8 modules hsx cannot run on torch's kernels: {', '.join(other[:3])}; "
            "use --quantized-compute dequantized"
        )
    return Installed(linear, experts, tuple(padded))


def installed(model: torch.nn.Module) -> bool:
    """Whether ``install`` put any of the model's modules on the ``fp8`` route."""
    return any(type(m).__module__ == __name__ for m in model.modules())


_SUBCLASSES: dict = {}


def _swap(module, forward) -> None:
    """Give ``module`` a subclass of its class whose forward is ``forward``: the module stays what
    transformers' TP code and isinstance checks know, and the compiler inlines it as any module."""
    cls = type(module)
    sub = _SUBCLASSES.get((cls, forward))
    if sub is None:
        sub = type(f"Torch{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})
        _SUBCLASSES[(cls, forward)] = sub
    module.__class__ = sub


def _expert_weights(module) -> tuple[str, str]:
    return ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")


def _misaligned(name: str, module) -> list[str]:
    """Expert weights whose scales are not one per 128x128 block (a fused gate and up projection
    of a partial block each), which no block expansion would read right."""
    out = []
    for weight in _expert_weights(module):
        shape = getattr(module, weight).shape
        grid = (math.ceil(shape[-2] / BLOCK), math.ceil(shape[-1] / BLOCK))
        if tuple(getattr(module, f"{weight}_scale_inv").shape[-2:]) != grid:
            out.append(f"{name}.{weight} (scales not one per {BLOCK}x{BLOCK} block)")
    return out


def _pad_columns(module) -> None:
    """Zero columns up to whole blocks (the scales already have a column for the partial block)."""
    w = module.weight
    pad = -w.shape[1] % BLOCK
    values = F.pad(w.data.view(torch.uint8), (0, pad)).view(FP8)
    module.weight = torch.nn.Parameter(values, requires_grad=False)


def _linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias)


def _experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """Traceable: in a compiled layer the expansion, routing and weighting are in its graph. With a
    ``slice_bytes`` budget under the layer's expansion, a slice of experts at a time
    (``experts.sliced``: the same numbers, one graph break)."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    from hsx.capture.quantized.experts import Expanded, implementation, per_slice, sliced

    block = tuple(self.block_size)
    names = _expert_weights(self)
    dtype = hidden_states.dtype

    def expand(experts: slice) -> dict[str, torch.Tensor]:
        return {
            n: expand_experts(getattr(self, n)[experts], getattr(self, f"{n}_scale_inv")[experts], block, dtype)
            for n in names
        }

    step = per_slice(self, self.slice_bytes, dtype)
    routing = (hidden_states, top_k_index, top_k_weights)
    if step < self.num_experts:
        return sliced(self, grouped_mm_experts_forward, implementation(self), expand, step, *routing)
    return grouped_mm_experts_forward(Expanded(self, **expand(slice(None))), *routing)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers as they sit in memory (FP8 weights 1 byte each)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)
