"""Where a block-FP8 forward's time goes on the 8B shape (CUDA, compute capability 9.x), in one run:

- each linear layer's shape, 16,384 tokens: bf16's GEMM against the FP8 block GEMM alone, the
  activations' quantization alone (compiled from its torch definition, and hsx's Triton kernel),
  and the whole FP8 linear layer (compiled), as ``capture.quantized.fp8`` runs it;
- the whole model, each decoder layer compiled as hsx compiles it, one batch of 8 x 2,048 tokens:
  bf16's forward against the same model as a block-FP8 checkpoint loads, and the CUDA kernels that
  take the FP8 forward's time.

    python -m hsx.bench.fp8
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from hsx.capture.transformers import deterministic_compile

SHAPES = ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096))  # (K, N): q/o, k/v, gate/up, down
TOKENS = 16384
BATCH = (8, 2048)


def ms(fn, repeats: int = 20) -> float:
    """Mean milliseconds of ``fn`` on the device, after three warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeats * 1e3


def linears() -> None:
    from hsx.capture.quantized import fp8

    layer = torch.compile(fp8.fp8_linear, dynamic=True)
    compiled = torch.compile(lambda x: fp8.activation_operands(*fp8.quantize_activations(x)), dynamic=True)
    print(
        "K N | bf16 GEMM ms | FP8 GEMM alone ms | quantization compiled from torch ms | "
        "quantization kernel ms | FP8 linear ms | bf16 / FP8 linear"
    )
    for k, n in SHAPES:
        print(one_linear(k, n, layer, compiled))


def one_linear(k: int, n: int, layer, compiled) -> str:
    """One (K, N) linear layer's row of ``linears``."""
    from torch.nn.functional import ScalingType

    from hsx.capture.quantized import fp8, fp8_kernel

    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    w8, s8 = fp8.quantize_weight(w)
    x = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16)
    a, sa = fp8_kernel.activation_operands(x, fp8.TOKEN_MULTIPLE)
    b, sb = fp8.weight_operands(w8, s8)
    block = (ScalingType.BlockWise1x128, ScalingType.BlockWise128x128)
    gemm = ms(lambda: F.scaled_mm(a, b, sa, block[0], sb, block[1], output_dtype=torch.bfloat16))
    bf16, whole = ms(lambda: F.linear(x, w)), ms(lambda: layer(x, w8, s8))
    quant = ms(lambda: compiled(x)), ms(lambda: fp8_kernel.activation_operands(x, fp8.TOKEN_MULTIPLE))
    return f"{k} {n} | {bf16:.3f} | {gemm:.3f} | {quant[0]:.3f} | {quant[1]:.3f} | {whole:.3f} | {bf16 / whole:.2f}"


def model() -> None:
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hsx.bench.extract import LLAMA_8B, to_block_fp8

    torch.manual_seed(0)
    with torch.device("cuda"):
        net = AutoModelForCausalLM.from_config(
            LlamaConfig(**LLAMA_8B), dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    ids = torch.randint(0, LLAMA_8B["vocab_size"], BATCH, device="cuda")

    def forward() -> float:
        torch._dynamo.reset()
        for layer in net.model.layers:
            layer.__dict__.pop("forward", None)
            layer.forward = torch.compile(layer.forward, dynamic=True)
        with torch.inference_mode():
            return ms(lambda: net.model(input_ids=ids), repeats=5)

    bf16 = forward()
    to_block_fp8(net)
    fp8 = forward()
    print(f"forward, {BATCH[0]} x {BATCH[1]} tokens: bf16 {bf16:.1f} ms, block FP8 {fp8:.1f} ms: {bf16 / fp8:.3f}x")
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        net.model(input_ids=ids)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=80))


if __name__ == "__main__":
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("hsx.bench.fp8: needs a CUDA device of compute capability 9.x (the block-FP8 GEMM)")
    print(torch.__version__, torch.cuda.get_device_name())
    deterministic_compile()
    linears()
    model()
