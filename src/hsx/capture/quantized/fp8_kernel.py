"""The activations' quantization for the block-scaled FP8 GEMM as one Triton kernel, on CUDA.

Compiled from torch code (``fp8.quantize_activations``), the quantization ran at an eighth of an
H100's memory bandwidth, a sixth of the FP8 forward's time (docs/benchmarks.md): each token's
128-column group reduced to its amax and divided by it again, in the reduction config that
hsx's deterministic compiler settings pick. This kernel reads each group once and writes the
GEMM's operand as cuBLAS reads it (tokens padded to a multiple of 16 with zero rows and unit
scales, the scales column-major), so nothing is copied between it and ``scaled_mm``.

Its numbers are ``fp8.activation_operands(*fp8.quantize_activations(x))`` bit for bit (tested on
CUDA): the amax is exact whatever the block shape, the scale is amax (at least 1e-12) times
float32(1/448), each value is divided by it with IEEE rounding (``div_rn``), clamped to +-448 and
rounded to e4m3 to nearest even. One launch config, no autotuning: nothing depends on timing.
A run's spec records this quantization (``spec.FP8_ACTIVATIONS``): a change of its numbers is a
new name there, and a run begun under another is not resumed under it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 128  # columns per scale: the GEMM's 1x128 activation blocks (fp8.BLOCK)
ROWS = 32  # tokens per program: 32 x 128 bf16 values (8 KiB) in, 4 KiB of e4m3 out


@triton.jit
def _quantize(x, values, scales, tokens, padded, columns, x_row, ROWS: tl.constexpr, GROUP: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    real = rows < tokens
    block = tl.load(x + rows[:, None].to(tl.int64) * x_row + cols[None, :], mask=real[:, None], other=0.0)
    block = block.to(tl.float32)
    amax = tl.max(tl.abs(block), axis=1)
    scale = tl.where(real, tl.maximum(amax, 1e-12) * (1.0 / 448.0), 1.0)
    quantized = tl.clamp(tl.div_rn(block, scale[:, None]), -448.0, 448.0).to(tl.float8e4nv)
    kept = rows < padded
    tl.store(values + rows[:, None].to(tl.int64) * columns + cols[None, :], quantized, mask=kept[:, None])
    tl.store(scales + group.to(tl.int64) * padded + rows, scale, mask=kept)


def activation_operands(x: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (CUDA, K a multiple of 128) as the GEMM's first operand and its scales: e4m3 values
    [M', K] (M' = M rounded up to ``multiple``, the extra rows zeros) and float32 scales
    [M', K/128] with strides (1, M') (the extra rows unit scales)."""
    tokens, columns = x.shape
    assert columns % GROUP == 0 and x.stride(1) == 1, (x.shape, x.stride())
    padded = tokens + -tokens % multiple
    values = torch.empty((padded, columns), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty_strided((padded, columns // GROUP), (1, padded), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(padded, ROWS), columns // GROUP)
    with torch.cuda.device(x.device):
        _quantize[grid](x, values, scales, tokens, padded, columns, x.stride(0), ROWS=ROWS, GROUP=GROUP, num_warps=4)
    return values, scales
