"""compressed-tensors ``pack-quantized`` INT4 experts (symmetric, group-wise), as Kimi-K2-Thinking and
Kimi-K2.5 release their routed experts: each projection is stored as ``weight_packed`` (int32
[out, in/8]: eight 4-bit values a word, the first in the lowest bits, each offset by +8),
``weight_scale`` (one scale per group of ``group_size`` inputs, [out, in/group]) and ``weight_shape``.

The expansion reads that format with plain torch ops (shift, mask, one multiply), so that
``torch.compile`` fuses a layer's expansion into one pass over the packed bytes; the product of a
4-bit integer and a bf16 scale is exact in float32, so the expanded weight is the exact value rounded
once to the run's dtype, the same bits however it is computed (tests hold it to compressed-tensors'
own ``unpack_from_int32`` + ``dequantize`` in float32). ``quantize`` packs with compressed-tensors'
own compressor (fixtures and the benchmark build checkpoints with it).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from hsx.target import INT4_BITS as BITS

NAME = "int4-packed"
# inputs the dequantizing GEMM (int4_kernel) takes a step, of a projection whose K is a multiple of
# the first (Kimi-K2.5's 7,168 and 2,048), else of the second: K is a multiple of one of them
GEMM_STEPS = (64, 32)


@dataclass(frozen=True)
class Int4Experts:
    """The ``ExpertFormat`` of pack-quantized INT4 (see ``hsx.capture.quantized.experts``)."""

    group_size: int = 32
    name: str = NAME
    stored: tuple[str, ...] = ("weight_packed", "weight_scale")
    compile: bool = True
    cast: bool = False

    def expand(self, stored: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """[..., out, in] in ``dtype`` from ``weight_packed`` [..., out, in/8] and ``weight_scale``
        [..., out, in/group]. Written over the flat words (each word's eight values, each word's
        scale at word // (group / 8)): compiled, one pass at the GPU's memory bandwidth (a
        Moonlight layer's experts: 0.35 ms on an H200, against 1.0 ms for the same ops on the
        [..., groups, group] view)."""
        packed, scale = stored["weight_packed"], stored["weight_scale"]
        per_word = 32 // BITS
        shifts = torch.arange(0, 32, BITS, dtype=torch.int32, device=packed.device)
        values = ((packed.reshape(-1, 1) >> shifts) & 0xF) - 8  # [words, 8], the first value in the low bits
        scales = scale.reshape(-1, 1, 1).expand(-1, self.group_size // per_word, 1).reshape(-1, 1)
        out = (values.to(torch.float32) * scales.to(torch.float32)).to(dtype)
        return out.reshape(*packed.shape[:-1], packed.shape[-1] * per_word)


def gemm_blocker(device: str, dtype: str, config: dict) -> str | None:
    """Why the dequantizing grouped GEMM (``int4_kernel``: ``--quantized-compute int4``) cannot run
    the routed experts of a model with text config ``config`` on ``device`` in ``dtype``; None where
    it can. On CPU it runs only in Triton's interpreter (TRITON_INTERPRET=1), which the tests use."""
    if dtype not in ("bfloat16", "float16"):
        return f"the dequantizing GEMM multiplies bfloat16 or float16, and the run's dtype is {dtype}"
    sizes = {k: config.get(k) for k in ("hidden_size", "moe_intermediate_size")}
    odd = [f"{k} {v}" for k, v in sizes.items() if not isinstance(v, int) or v % GEMM_STEPS[-1]]
    if odd:
        step = GEMM_STEPS[-1]
        return f"the dequantizing GEMM takes inputs in steps of {step}, and the experts' {', '.join(odd)} is not"
    if not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the dequantizing GEMM is a Triton kernel for CUDA, and the device is {device}"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (it runs the dequantizing GEMM)"
    return None


def quantization_config(group_size: int = 32, ignore: list[str] | None = None) -> dict:
    """The ``quantization_config`` Kimi-K2-Thinking / Kimi-K2.5 carry: one group on ``Linear``,
    INT4 symmetric group-wise, pack-quantized, everything but the routed experts ignored."""
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=BITS, type="int", symmetric=True, strategy="group", group_size=group_size),
    )
    ignore = ignore or [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    ]
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=CompressionFormat.pack_quantized.value,
        quantization_status="compressed",
        ignore=ignore,
    )
    return config.model_dump(exclude_none=True) | {"quant_method": "compressed-tensors"}


def quantize(weight: torch.Tensor, group_size: int = 32) -> dict[str, torch.Tensor]:
    """One projection [out, in] (or a stack [E, out, in]) quantized to INT4 symmetric, one scale per
    group of ``group_size`` inputs (max-abs, compressed-tensors' qparams) in the weight's dtype, packed
    by compressed-tensors' own pack-quantized compressor: ``weight_packed``, ``weight_scale``,
    ``weight_shape``, as a checkpoint stores them."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=BITS, type="int", symmetric=True, strategy="group", group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    if weight.dim() == 3:
        parts = [quantize(w, group_size) for w in weight]
        return {k: torch.stack([p[k] for p in parts]) for k in parts[0]}
    grouped = weight.reshape(weight.shape[0], -1, group_size)
    scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    out = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale.to(weight.dtype)}, scheme)
    return {k: out[k] for k in ("weight_packed", "weight_scale", "weight_shape")}
