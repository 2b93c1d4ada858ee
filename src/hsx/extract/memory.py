"""``hsx memory``: a parallel layout checked as an extraction checks it (heads, experts, layers, the
node's GPUs: ``extract.options``), then each GPU's memory of it from config.json and the safetensors
headers, no weight read (``capture.memory``); given no layout on a node of several GPUs, which layout
to run, from the node's measured (or stated) bandwidths, with the arithmetic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated as A

from hsx import target, teacher
from hsx.bounds import Bound, Bounds, Flag
from hsx.errors import OptionError
from hsx.extract.options import SLICE, check_gpus, resolve_parallel
from hsx.job.options import DEVICES, TOKENS

GBPS = Bound(min=0.0, max=100_000.0, min_open=True)
MEMORY = Bounds(
    tensor_parallel=DEVICES,
    expert_parallel=DEVICES,
    pipeline_parallel=DEVICES,
    allreduce_gbps=GBPS,
    p2p_gbps=GBPS,
    interconnect=Bound(choices=("nvlink", "pcie")),
    batch_tokens=TOKENS,
    max_length=TOKENS,
    gpus=DEVICES,
    gpu_memory=Bound(min=0.0, max=100_000.0, min_open=True),
    experts=Bound(choices=("auto", "packed", "dequantized")),
    quantized_compute=Bound(choices=("fp8", "int4", "dequantized")),
    expert_slice_gb=Bound(min=0.0, min_open=True, max=1e6),
    dtype=Bound(choices=("bfloat16", "float16", "float32")),
)
EXPERTS = "Quantized weights as stored (packed) or expanded (dequantized); auto: as loaded."
MEASURED = "measured on this node"


@dataclass
class MemoryOptions:
    model: A[str, Flag("Model folder (a shape folder with only config.json will do).", "PATH")]
    tensor_parallel: A[int | None, Flag("Ranks of one model replica (of each stage).", default="1")] = None
    expert_parallel: A[int | None, Flag("Ranks the routed experts are split over (1 or N).", default="1")] = None
    pipeline_parallel: A[
        int | None, Flag("N stages of contiguous layers, each over --tensor-parallel ranks.", default="1")
    ] = None
    experts: A[str, Flag(EXPERTS)] = "auto"
    expert_slice_gb: A[float | None, Flag(SLICE, "GB", "a whole MoE layer's")] = None
    quantized_compute: A[
        str | None,
        Flag("The run's --quantized-compute: int4 counts INT4-packed experts read packed, nothing expanded.", "MODE"),
    ] = None
    dtype: A[str, Flag("The run's dtype.")] = "bfloat16"
    batch_tokens: A[int, Flag("Tokens per forward pass.")] = 16384
    max_length: A[int, Flag("Longest sample.")] = 4096
    gpus: A[int | None, Flag("GPUs on the node.", default="this node's")] = None
    gpu_memory: A[
        float | None, Flag("GB (10^9 bytes) per GPU: an H200 is 150.7 (143,771 MiB).", default="this node's")
    ] = None
    allreduce_gbps: A[
        float | None, Flag("No layout given: the all-reduce bus bandwidth to judge layouts by, GB/s.", default=MEASURED)
    ] = None
    p2p_gbps: A[float | None, Flag("No layout given: one GPU's bandwidth to the next, GB/s.", default=MEASURED)] = None
    interconnect: A[str | None, Flag("With stated bandwidths: what joins the GPUs.")] = None
    teacher: A[
        str | None, Flag("The run's --teacher: topk:K, or draft-vocab:D (its size) or draft-vocab:FILE.", "KIND:ARG")
    ] = None

    def __post_init__(self) -> None:
        """Refuse a value out of its bound, or one the answer would not read."""
        MEMORY.check(self)
        if self.interconnect is not None and (self.allreduce_gbps is None or self.p2p_gbps is None):
            raise OptionError(
                f"--interconnect {self.interconnect} says what joins GPUs whose bandwidths are stated: give "
                "--allreduce-gbps and --p2p-gbps with it, or none of them to measure this node's"
            )
        if self.quantized_compute == "int4" and self.expert_slice_gb is not None:
            raise OptionError(
                "--expert-slice-gb slices the experts' expansion, and --quantized-compute int4 expands none: "
                "the GEMM reads them packed"
            )
        layout = [self.tensor_parallel, self.expert_parallel, self.pipeline_parallel]
        stated = ("allreduce_gbps", "p2p_gbps", "interconnect")
        judged = [MEMORY.flag(k) for k in stated if getattr(self, k) is not None]
        if judged and any(v is not None for v in layout):
            raise OptionError(
                f"{', '.join(judged)} judge which layout to run where none is given; this one names its layout: "
                "drop them, or the layout"
            )


def explain(opts: MemoryOptions) -> list[str]:
    """The layout's per-GPU memory, line by line, or (no layout given, several GPUs) the advice of one;
    refused (``OptionError``, ``LayoutTooLarge``) where an extraction would refuse it."""
    import torch

    from hsx.capture import memory as mem

    model_dir = target.resolve(opts.model)
    row = 0 if opts.teacher is None else teacher.planned(opts.teacher).row_bytes(mem.DTYPE_BYTES[opts.dtype])
    base = mem.Layout(
        experts=opts.experts, dtype=opts.dtype, batch_tokens=opts.batch_tokens, max_length=opts.max_length,
        slice_gb=opts.expert_slice_gb, teacher=row, expands=opts.quantized_compute != "int4",
    )  # fmt: skip
    layout = None
    asked = (opts.tensor_parallel, opts.expert_parallel, opts.pipeline_parallel)
    if any(v is not None for v in asked):
        parallel = resolve_parallel(*asked[:2], target.load_config(model_dir), "transformers", asked[2])
        if node := opts.gpus if opts.gpus is not None else torch.cuda.device_count():  # unknown without GPUs
            check_gpus(parallel, node)
        layout = mem.Layout(
            parallel.tensor, parallel.expert, opts.experts, opts.dtype, opts.batch_tokens, opts.max_length,
            pipeline=parallel.pipeline, slice_gb=opts.expert_slice_gb, teacher=row,
            expands=opts.quantized_compute != "int4",
        )  # fmt: skip
    device = None if opts.gpu_memory is None else int(opts.gpu_memory * mem.GB)
    nvlink = None if opts.interconnect is None else opts.interconnect == "nvlink"
    return mem.explain(model_dir, layout, device, opts.gpus, base, (opts.allreduce_gbps, opts.p2p_gbps, nvlink))
