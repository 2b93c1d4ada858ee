"""Quantized weights kept as stored in device memory and computed on torch's own kernels at the layer
that needs them: one module for every format hsx runs without expanding the whole model at load.

- ``experts``: routed experts held in their stored form (packed values + scales) and expanded to the
  run's dtype just before their MoE layer runs, released after (peak: the stored model plus one
  layer's expanded experts). Formats plug in their expansion.
- ``int4``: compressed-tensors ``pack-quantized`` INT4 (symmetric, group-wise), as Kimi-K2.5 /
  Kimi-K2-Thinking release their routed experts.
- ``fp8``: fine-grained block FP8 (``quant_method: fp8``, 128x128 ``weight_scale_inv``), as DeepSeek-V3
  and Kimi-K2-Instruct are released: linear layers on torch's block-scaled FP8 GEMM, experts expanded
  just in time.
"""
