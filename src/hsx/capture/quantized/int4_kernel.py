"""The grouped GEMM of INT4-packed experts that dequantizes its weights as it loads them (Triton).

Expanded first (``int4.Int4Experts.expand``), a layer's packed experts are written out in bf16 and
read again by transformers' grouped GEMM: 4.5 bytes moved a weight where the checkpoint holds
about 0.56. On a Kimi-K2.5 stage that expansion was 2.26 s of the 6.12 the INT4 experts took
(docs/benchmarks.md). Here each program loads a tile of packed words and their scales, makes
the very bf16 weights the expansion makes (the 4-bit value times its scale, exact in float32,
rounded once to the states' dtype) and multiplies them into a float32 accumulator; nothing is
expanded in device memory.

The weights are the same bits; the sums are this kernel's (another GEMM, another order of
additions than cuBLAS's), so a run records which GEMM its experts ran (``describe``), as it
records expert parallelism. One block config, no autotuning: nothing depends on timing. On an
H100 it is slower than the expansion it replaces (a Kimi-K2.5 stage at 0.55x the bf16 experts,
the expansion at 0.63x: docs/benchmarks.md); what it saves is the expanded layer's memory.

The rows come sorted by expert, as transformers' grouped GEMM takes them (``offsets``: each
expert's end row). The tiles of ``BLOCK_M`` rows never span two experts: tile ``t`` belongs to the
expert whose cumulative tile count first exceeds ``t`` (``schedule``, computed on the device, so
no host sync); the tiles past the last are launched and return at once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hsx.capture.quantized.int4 import GEMM_STEPS
from hsx.target import INT4_BITS as BITS

PER_WORD = 32 // BITS  # 4-bit values in an int32 word, the first in the lowest bits
BLOCK_M, BLOCK_N = 128, 128  # rows and output columns a program computes, a step of K (GEMM_STEPS) at a time
NAME = "dequantizing grouped GEMM (Triton)"


@dataclass(frozen=True)
class Packed:
    """One fused projection of some experts as the checkpoint stores it: ``packed`` int32
    [E, N, K/8], ``scale`` [E, N, K/group]; what ``grouped_linear`` takes in a weight's place."""

    packed: torch.Tensor
    scale: torch.Tensor
    group_size: int

    @classmethod
    def of(cls, stored: dict[str, torch.Tensor], group_size: int) -> Packed:
        return cls(stored["weight_packed"], stored["weight_scale"], group_size)


@triton.jit
def _grouped(
    x, packed, scales, out, tile_expert, tile_row, ends, n, k, x_row,
    GROUP: tl.constexpr, PER_WORD: tl.constexpr, BITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    expert = tl.load(tile_expert + tile)
    if expert >= 0:
        rows = tl.load(tile_row + tile) + tl.arange(0, BLOCK_M)
        live = rows < tl.load(ends + expert)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        real = cols < n
        words = k // PER_WORD
        groups = k // GROUP
        w_rows = packed + expert.to(tl.int64) * n * words + cols[:, None].to(tl.int64) * words
        s_rows = scales + expert.to(tl.int64) * n * groups + cols[:, None].to(tl.int64) * groups
        x_rows = x + rows[:, None].to(tl.int64) * x_row
        shifts = tl.arange(0, PER_WORD) * BITS  # a word's values, the first in the lowest bits
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            a = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=live[:, None], other=0.0)
            # each word loaded once and unpacked in registers (a load per value, the same word 8
            # times, was 20x slower on an H100), then each group of values times its scale
            word_at = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
            word = tl.load(w_rows + word_at[None, :], mask=real[:, None], other=0)
            value = ((word[:, :, None] >> shifts[None, None, :]) & 0xF) - 8
            group_at = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            scale = tl.load(s_rows + group_at[None, :], mask=real[:, None], other=0.0)
            grouped = tl.reshape(value, (BLOCK_N, BLOCK_K // GROUP, GROUP)).to(tl.float32)
            weight = tl.reshape(grouped * scale.to(tl.float32)[:, :, None], (BLOCK_N, BLOCK_K))
            acc = tl.dot(a, tl.trans(weight.to(a.dtype)), acc)  # the expansion's bits, rounded once
        keep = live[:, None] & real[None, :]
        tl.store(out + rows[:, None].to(tl.int64) * n + cols[None, :], acc.to(out.dtype.element_ty), mask=keep)


def schedule(offsets: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tile's expert (-1: past the last tile) and first row, for ``rows`` rows sorted by expert
    with ends ``offsets`` [E]: at most cdiv(rows, BLOCK_M) + E tiles, a whole number per expert."""
    ends = offsets.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tiles.cumsum(0)
    t = torch.arange(triton.cdiv(rows, BLOCK_M) + len(ends), device=offsets.device)
    expert = torch.searchsorted(tile_ends, t, right=True)
    mine = expert.clamp(max=len(ends) - 1)
    first_row = (ends - counts)[mine] + (t - (tile_ends - tiles)[mine]) * BLOCK_M
    return torch.where(expert < len(ends), expert, -1).to(torch.int32), first_row.to(torch.int32)


def grouped_linear(x: torch.Tensor, weight: Packed, offsets: torch.Tensor, is_transposed: bool = False) -> torch.Tensor:
    """x [R, K] (bf16 or fp16, rows sorted by expert) times each expert's [N, K] weight transposed,
    for the rows up to its end in ``offsets`` (int32 [E], cumulative): [R, N] in x's dtype, as
    transformers' ``_grouped_linear`` computes it from the expanded weights (whose call this is). The
    rows past ``offsets[-1]`` are left unwritten, as transformers' grouped GEMM leaves them."""
    assert not is_transposed, "INT4-packed experts are stored [out, in]"
    experts, n, words = weight.packed.shape
    k = words * PER_WORD
    assert x.dtype in (torch.bfloat16, torch.float16) and x.shape[1] == k and x.stride(1) == 1, (x.dtype, x.shape)
    step = next((s for s in GEMM_STEPS if k % s == 0), None)  # the larger where K allows: one per shape
    assert step is not None and k % weight.group_size == 0, (k, weight.group_size)
    assert weight.scale.shape == (experts, n, k // weight.group_size) and len(offsets) == experts
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    tile_expert, tile_row = schedule(offsets, x.shape[0])
    grid = (len(tile_expert), triton.cdiv(n, BLOCK_N))
    # the launch's device is x's (a process may drive several: pipeline stages); on CPU the kernel
    # runs only in Triton's interpreter (TRITON_INTERPRET=1), as the tests run it
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _grouped[grid](
            x, weight.packed.contiguous(), weight.scale.contiguous(), out, tile_expert, tile_row, offsets, n, k,
            x.stride(0), GROUP=weight.group_size, PER_WORD=PER_WORD, BITS=BITS,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=step, num_warps=4, num_stages=4,
        )  # fmt: skip
    return out
