"""Benchmarks, side by side with what they measure: ``extract`` (forward pass against the whole
extraction, codecs, quantized variants), ``generate`` (regeneration against the bare engine),
``scale`` (status and verify at full size) and ``codec`` (each storage codec's rate and bytes).
Nothing in the stages imports this package; it sits above them. ``hsx bench`` is ``run``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated as A

from hsx.bounds import Bound, Bounds, Flag
from hsx.errors import OptionError
from hsx.extract.options import DEFAULTS, EXTRACT
from hsx.job.options import DEVICES, THREADS, TOKENS
from hsx.store.codec import Codec

BENCH = Bounds(
    samples=Bound(min=1, max=10**7),
    mean_len=TOKENS,
    min_len=TOKENS,
    max_len=TOKENS,
    batch_tokens=TOKENS,
    naive_samples=Bound(min=0, max=10**7),
    writers=THREADS,
    compile=EXTRACT.bounds["compile"],
    max_new_tokens=TOKENS,
    tensor_parallel_size=DEVICES,
    fidelity_stride=TOKENS,
    reference_every=Bound(min=1, max=10**9),
)
# the options that only one of the two benchmarks reads, by field name
GENERATE_ONLY = ("max_new_tokens", "tensor_parallel_size")
EXTRACT_ONLY = (
    "device", "mean_len", "min_len", "max_len", "batch_tokens", "naive_samples", "writers", "compile", "codecs",
    "fp8_model", "int4_experts", "fidelity_stride", "consumer", "reference_every",
)  # fmt: skip


def codecs(text: str) -> tuple[Codec, ...]:
    """``--codecs raw,zstd,fp8``."""
    try:
        return tuple(Codec(c.strip()) for c in text.split(",") if c.strip())
    except ValueError:
        raise OptionError(f"--codecs takes codecs of {', '.join(Codec)}, not {text!r}") from None


@dataclass
class BenchOptions:
    model: A[str | None, Flag("Model folder.", default="8B-shape random weights on CUDA, tiny on CPU")] = None
    device: A[str | None, Flag("cpu, cuda or cuda:N.", "DEVICE", "cuda if available")] = None
    samples: A[int, Flag("Number of samples.")] = 256
    mean_len: A[int, Flag("Mean sample length (lognormal).")] = 1275
    min_len: A[int, Flag("Shortest sample.")] = 64
    max_len: A[int, Flag("Longest sample.")] = 4096
    batch_tokens: A[int, Flag("Tokens per forward pass.")] = 16384
    naive_samples: A[int, Flag("Samples for the naive baseline (0: skip).")] = 64
    writers: A[int, Flag("Writer threads.")] = 8
    workdir: A[Path | None, Flag("Where to write (on the volume to measure).", default="a temp folder")] = None
    compile: A[str, Flag("Also measure packed with compiled layers (auto: on CUDA).")] = "auto"
    codecs: A[str, Flag("Storage codecs measured next to raw on the last layout (raw: none).")] = "raw,zstd,fp8"
    fp8_model: A[
        bool, Flag("Then build the model as a block-FP8 checkpoint (weights quantized 128x128) and measure it.")
    ] = False
    int4_experts: A[bool, Flag("MoE models: the last layout again with the routed experts INT4-packed.")] = False
    generate: A[bool, Flag("Instead: hsx generate (vLLM) against vLLM's bare LLM.generate, --samples prompts.")] = False
    max_new_tokens: A[int, Flag("--generate: new tokens per prompt at most.")] = 256
    tensor_parallel_size: A[int, Flag("--generate: vLLM's GPUs per model replica.")] = 1
    fidelity_stride: A[int, Flag("The fidelity check's sampling: 1 in N masked tokens.")] = 8
    consumer: A[
        bool, Flag("The last layout again with a live trainer reading and acknowledging every batch (its own process).")
    ] = False
    reference_every: A[int, Flag("The shadow's sampling: 1 in N samples recomputed through the plain path.")] = (
        DEFAULTS["reference_every"]
    )

    def __post_init__(self) -> None:
        BENCH.check(self)
        codecs(self.codecs)
        self.check_mode()

    def check_mode(self) -> None:
        """Refuse an option the chosen benchmark would not read (given other than its default): the
        extraction bench's with ``--generate``, the generate bench's without it."""
        foreign = EXTRACT_ONLY if self.generate else GENERATE_ONLY
        defaults = {f.name: f.default for f in fields(self)}
        stray = sorted(f"--{name.replace('_', '-')}" for name in foreign if getattr(self, name) != defaults[name])
        if stray:
            which = "the extraction bench (no --generate)" if self.generate else "the generate bench (--generate)"
            raise OptionError(f"{', '.join(stray)} {'apply' if len(stray) > 1 else 'applies'} to {which} only")


def run(opts: BenchOptions, log: Callable[[str], None]) -> str:
    """``hsx bench``: the table of what was measured."""
    if opts.generate:
        from hsx.bench.generate import generate_table, run_generate_bench
        from hsx.job.options import check_vllm

        check_vllm("hsx bench --generate")
        results, same = run_generate_bench(
            opts.model, opts.samples, opts.max_new_tokens, tensor_parallel_size=opts.tensor_parallel_size,
            workdir=opts.workdir, log=lambda m: None,  # its table says it all
        )  # fmt: skip
        return generate_table(results, same)
    from hsx.bench.extract import run_bench, table

    results = run_bench(
        opts.model, opts.device, opts.samples, opts.mean_len, opts.min_len, opts.max_len, opts.batch_tokens,
        opts.naive_samples, opts.writers, opts.workdir, compile=opts.compile, log=log, codecs=codecs(opts.codecs),
        fp8=opts.fp8_model, int4_experts=opts.int4_experts, fidelity_stride=opts.fidelity_stride,
        consumer=opts.consumer,
        reference_every=opts.reference_every,
    )  # fmt: skip
    return table(results)
