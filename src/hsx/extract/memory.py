"""``hsx memory``: a parallel layout checked as an extraction checks it (heads, experts, the node's
GPUs: ``extract.options``), then each GPU's memory of it from config.json and the safetensors
headers, no weight read (``capture.memory``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated as A

from hsx import target
from hsx.bounds import Bound, Bounds, Flag
from hsx.extract.options import AT_LEAST_ONE, check_gpus, resolve_parallel

MEMORY = Bounds(
    tensor_parallel=AT_LEAST_ONE,
    expert_parallel=AT_LEAST_ONE,
    batch_tokens=AT_LEAST_ONE,
    max_length=AT_LEAST_ONE,
    gpus=AT_LEAST_ONE,
    gpu_memory=Bound(min=0.0, min_open=True),
    experts=Bound(choices=("auto", "packed", "dequantized")),
    dtype=Bound(choices=("bfloat16", "float16", "float32")),
)
EXPERTS = "Quantized weights as stored (packed) or expanded (dequantized); auto: as loaded."


@dataclass
class MemoryOptions:
    model: A[str, Flag("Model folder (a shape folder with only config.json will do).", "PATH")]
    tensor_parallel: A[int, Flag("Ranks of one model replica.")] = 1
    expert_parallel: A[int, Flag("Ranks the routed experts are split over (1 or N).")] = 1
    experts: A[str, Flag(EXPERTS)] = "auto"
    dtype: A[str, Flag("The run's dtype.")] = "bfloat16"
    batch_tokens: A[int, Flag("Tokens per forward pass.")] = 16384
    max_length: A[int, Flag("Longest sample.")] = 4096
    gpus: A[int | None, Flag("GPUs on the node.", default="this node's")] = None
    gpu_memory: A[
        float | None, Flag("GB (10^9 bytes) per GPU: an H200 is 150.7 (143,771 MiB).", default="this node's")
    ] = None

    def __post_init__(self) -> None:
        MEMORY.check(self)


def explain(opts: MemoryOptions) -> list[str]:
    """The layout's per-GPU memory, line by line; refused (``OptionError``, ``LayoutTooLarge``) where an
    extraction would refuse it."""
    import torch

    from hsx.capture import memory as mem

    model_dir = target.resolve(opts.model)
    parallel = resolve_parallel(
        opts.tensor_parallel, opts.expert_parallel, target.load_config(model_dir), "transformers"
    )
    if node := opts.gpus if opts.gpus is not None else torch.cuda.device_count():  # unknown without GPUs
        check_gpus(parallel, node)
    layout = mem.Layout(
        opts.tensor_parallel, opts.expert_parallel, opts.experts, opts.dtype, opts.batch_tokens, opts.max_length
    )
    device = None if opts.gpu_memory is None else int(opts.gpu_memory * mem.GB)
    return mem.explain(model_dir, layout, device, opts.gpus)
