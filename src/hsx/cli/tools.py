"""The commands that need no run: ``bench`` and ``memory``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hsx.cli.options import BENCH, MEMORY, Device
from hsx.cli.output import failures, log


def bench(
    ctx: typer.Context,
    model: Annotated[
        str | None,
        typer.Option(help="Model folder.", show_default="8B-shape random weights on CUDA, tiny on CPU"),
    ] = None,
    device: Device = None,
    samples: Annotated[int, BENCH.option("samples", help="Number of samples.")] = 256,
    mean_len: Annotated[int, BENCH.option("mean_len", help="Mean sample length (lognormal).")] = 1275,
    min_len: Annotated[int, BENCH.option("min_len", help="Shortest sample.")] = 64,
    max_len: Annotated[int, BENCH.option("max_len", help="Longest sample.")] = 4096,
    batch_tokens: Annotated[int, BENCH.option("batch_tokens", help="Tokens per forward pass.")] = 16384,
    naive_samples: Annotated[int, BENCH.option("naive_samples", help="Samples for the naive baseline (0: skip).")] = 64,
    writers: Annotated[int, BENCH.option("writers", help="Writer threads.")] = 8,
    workdir: Annotated[
        Path | None, typer.Option(help="Where to write (on the volume to measure).", show_default="a temp folder")
    ] = None,
    compile: Annotated[
        str, BENCH.option("compile", help="Also measure packed with compiled layers (auto: on CUDA).")
    ] = "auto",
    codecs: Annotated[
        str, typer.Option(help="Storage codecs measured next to raw on the last layout (raw: none).")
    ] = "raw,zstd,fp8",
    fp8_model: Annotated[
        bool,
        typer.Option(
            "--fp8-model",
            help="Then build the model as a block-FP8 checkpoint (weights quantized 128x128) and measure it.",
        ),
    ] = False,
    int4_experts: Annotated[
        bool,
        typer.Option("--int4-experts", help="MoE models: the last layout again with the routed experts INT4-packed."),
    ] = False,
    generate: Annotated[
        bool,
        typer.Option(
            "--generate", help="Instead: hsx generate (vLLM) against vLLM's bare LLM.generate, --samples prompts."
        ),
    ] = False,
    max_new_tokens: Annotated[
        int, BENCH.option("max_new_tokens", help="--generate: new tokens per prompt at most.")
    ] = 256,
    tensor_parallel_size: Annotated[
        int, BENCH.option("tensor_parallel_size", help="--generate: vLLM's GPUs per model replica.")
    ] = 1,
    fidelity_stride: Annotated[
        int, BENCH.option("fidelity_stride", help="The fidelity check's sampling: 1 in N masked tokens.")
    ] = 8,
) -> None:
    """Time forward-only, the naive baseline and hsx's extraction on the same batches, in one run."""
    from hsx.bench import check_mode

    with failures():  # typer's own click: its ParameterSource, by name
        check_mode([p for p in ctx.params if ctx.get_parameter_source(p).name == "COMMANDLINE"], generate)
    if generate:
        from hsx.bench.generate import generate_table, run_generate_bench
        from hsx.job.options import check_vllm

        with failures():
            check_vllm("hsx bench --generate")
            results, same = run_generate_bench(
                model, samples, max_new_tokens, tensor_parallel_size=tensor_parallel_size, workdir=workdir, log=noop
            )
        print(generate_table(results, same))
        return
    from hsx.bench.extract import run_bench, table

    with failures():
        results = run_bench(
            model, device, samples, mean_len, min_len, max_len, batch_tokens, naive_samples, writers, workdir,
            compile=compile, log=log, codecs=_codecs(codecs), fp8=fp8_model, int4_experts=int4_experts,
            fidelity_stride=fidelity_stride,
        )  # fmt: skip
    print(table(results))


def noop(message: str) -> None:
    """The generate bench's log: its table says it all."""


def _codecs(text: str) -> tuple:
    from hsx.store.codec import Codec

    try:
        return tuple(Codec(c.strip()) for c in text.split(",") if c.strip())
    except ValueError:
        raise typer.BadParameter(f"takes codecs of {', '.join(Codec)}, not {text!r}", param_hint="--codecs") from None


def memory(
    model: Annotated[
        str, typer.Option(metavar="PATH", help="Model folder (a shape folder with only config.json will do).")
    ],
    tensor_parallel: Annotated[
        int | None, MEMORY.option("tensor_parallel", help="Ranks of one model replica (of each stage).")
    ] = None,
    expert_parallel: Annotated[
        int | None, MEMORY.option("expert_parallel", help="Ranks the routed experts are split over (1 or N).")
    ] = None,
    pipeline_parallel: Annotated[
        int | None,
        MEMORY.option("pipeline_parallel", help="N stages of contiguous layers, each over --tensor-parallel ranks."),
    ] = None,
    experts: Annotated[
        str,
        MEMORY.option(
            "experts", help="Quantized weights as stored (packed) or expanded (dequantized); auto: as loaded."
        ),
    ] = "auto",
    dtype: Annotated[str, MEMORY.option("dtype", help="The run's dtype.")] = "bfloat16",
    batch_tokens: Annotated[int, MEMORY.option("batch_tokens", help="Tokens per forward pass.")] = 16384,
    max_length: Annotated[int, MEMORY.option("max_length", help="Longest sample.")] = 4096,
    gpus: Annotated[int | None, MEMORY.option("gpus", help="GPUs on the node.", show_default="this node's")] = None,
    gpu_memory: Annotated[
        float | None,
        MEMORY.option(
            "gpu_memory", help="GB (10^9 bytes) per GPU: an H200 is 150.7 (143,771 MiB).", show_default="this node's"
        ),
    ] = None,
    allreduce_gbps: Annotated[
        float | None,
        MEMORY.option(
            "allreduce_gbps",
            help="No layout given: the all-reduce bus bandwidth to judge layouts by, GB/s.",
            show_default="measured on this node",
        ),
    ] = None,
    p2p_gbps: Annotated[
        float | None,
        MEMORY.option(
            "p2p_gbps",
            help="No layout given: one GPU's bandwidth to the next, GB/s.",
            show_default="measured on this node",
        ),
    ] = None,
    interconnect: Annotated[
        str | None, MEMORY.option("interconnect", help="With stated bandwidths: what joins the GPUs.")
    ] = None,
) -> None:
    """Per-GPU memory of a parallel layout, from config.json and the safetensors headers (no weight
    read); given no layout on a node of several GPUs, which layout to run, with the arithmetic."""
    import torch

    from hsx import target
    from hsx.capture import memory as mem
    from hsx.extract.options import check_gpus, resolve_parallel

    with failures():
        model_dir = target.resolve(model)
        base = mem.Layout(experts=experts, dtype=dtype, batch_tokens=batch_tokens, max_length=max_length)
        layout = None
        if any(v is not None for v in (tensor_parallel, expert_parallel, pipeline_parallel)):
            # the layout checks an extraction makes (heads, experts, layers, GPUs of the node), before any arithmetic
            config = target.load_config(model_dir)
            parallel = resolve_parallel(tensor_parallel, expert_parallel, config, "transformers", pipeline_parallel)
            if node := gpus if gpus is not None else torch.cuda.device_count():  # unknown on a machine without GPUs
                check_gpus(parallel, node)
            layout = mem.Layout(parallel.tensor, parallel.expert, pipeline=parallel.pipeline)
        device = None if gpu_memory is None else int(gpu_memory * mem.GB)
        nvlink = None if interconnect is None else interconnect == "nvlink"
        print(*mem.explain(model_dir, layout, device, gpus, base, (allreduce_gbps, p2p_gbps, nvlink)), sep="\n")
