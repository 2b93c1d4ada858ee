"""The ``hsx`` command line: parse, call a stage, print. No logic lives here."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from hsx.bounds import Bound, Bounds
from hsx.errors import CleanStop, DiskFull, Exit, HsxError
from hsx.generate.options import DEFAULTS as GEN
from hsx.generate.options import GENERATE, SAMPLING
from hsx.progress import console
from hsx.run.options import AT_LEAST_ONE, DEFAULTS, EXTRACT
from hsx.store.layout import SPEC

# the bounds of the other commands' options (extract's: hsx.run.options.EXTRACT, shared with its Python API)
TO = Bounds(to=Bound(choices=("specforge", "speculators", "modelopt")))
BENCH = Bounds(
    samples=AT_LEAST_ONE,
    mean_len=AT_LEAST_ONE,
    min_len=AT_LEAST_ONE,
    max_len=AT_LEAST_ONE,
    batch_tokens=AT_LEAST_ONE,
    naive_samples=Bound(min=0),
    writers=AT_LEAST_ONE,
    compile=EXTRACT.bounds["compile"],
    max_new_tokens=AT_LEAST_ONE,
    tensor_parallel_size=AT_LEAST_ONE,
)
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

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Verified, crash-safe extraction of an LLM's hidden states for draft training.",
)


def _version(asked: bool) -> None:
    if asked:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"hsx {version('hsx')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            from hsx import __version__

            print(f"hsx {__version__} (not installed)")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print hsx's version and exit.")
    ] = False,
) -> None:
    pass


def _fail(message: str, code: int) -> typer.Exit:
    console.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code)


@contextmanager
def failures(interrupted: Callable[[], str] | None = None) -> Iterator[None]:
    """The one place errors become exit codes: hsx's own errors print their message and exit with
    their code (``hsx.errors``); anything else is a bug and surfaces as a traceback (exit 1).
    ``interrupted``: what to do after a Ctrl-C, asked when it comes (what exists by then)."""
    try:
        yield
    except CleanStop as e:
        from hsx.assess.checks import size

        s = e.summary
        raise _fail(
            f"{e}.\nStopped cleanly: {s.done}/{s.total_samples} {e.unit} are done and verified; "
            f"about {size(e.needed_bytes)} more are needed to finish.\n"
            f"Free space, then resume: {resume_command(s.run, command=e.command)}",
            e.exit_code,
        ) from None
    except DiskFull as e:
        raise _fail(f"{e}; free space and rerun the same command: it continues", e.exit_code) from None
    except HsxError as e:
        raise _fail(str(e), e.exit_code) from None
    except KeyboardInterrupt:
        if interrupted is None:
            raise
        raise _fail(f"interrupted; {interrupted()}", Exit.INTERRUPTED) from None


def _layers(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"--layers takes comma-separated integers, got {value!r}") from None


# the disk-pace advice only where acting on it changes a run's time materially
DISK_ADVICE_RUN_S, DISK_ADVICE_SHARE = 60.0, 0.05


def _print_summary(s) -> None:
    """What the run did, on stdout (progress and warnings go to stderr)."""
    from rich.console import Console

    from hsx.store import layout

    stdout = Console(highlight=False, soft_wrap=True)

    state = "[green]complete[/]" if s.complete else "[yellow]incomplete[/]"
    lines = [
        f"run        {s.run}  ({state})",
        f"samples    {s.done}/{s.total_samples} done, {s.written} written now, {s.already_done} were already verified",
        f"written    {s.tokens_written:,} tokens, {s.bytes_written / 1e6:,.1f} MB in {s.seconds:.1f}s"
        + (f" ({s.tokens_written / s.seconds:,.0f} tok/s)" if s.seconds > 0 and s.tokens_written else ""),
        f"rejected   {s.rejected} input rows (see {s.run / layout.REJECTS})",
    ]
    if s.seconds > DISK_ADVICE_RUN_S and s.waited_for_disk > DISK_ADVICE_SHARE * s.seconds:
        lines.append(
            f"disk       the model waited {s.waited_for_disk:.1f}s ({s.waited_for_disk / s.seconds:.0%}) for writes "
            "to finish: writing, not the forward pass, set the pace (a faster volume or more --writers)"
        )
    v = s.verified
    if v is not None and v.files:
        lines.append(
            f"verified   {v.files:,} files, {v.bytes / 1e9:,.2f} GB in {v.seconds:.1f}s ({v.rate / 1e9:.2f} GB/s)"
            + (f"; extraction waited {v.waited:.1f}s for it" if s.written else "; nothing to extract: no model loaded")
        )
    if s.redone:
        lines.append("redone     " + ", ".join(f"{n} {k}" for k, n in sorted(s.redone.items())))
    if s.stray_removed or s.quarantined:
        lines.append(f"cleaned    {s.stray_removed} stray temp files removed, {s.quarantined} files quarantined")
    stdout.print("\n".join(lines), highlight=False)


@app.command()
def extract(
    out: Annotated[
        Path, typer.Option("--out", metavar="DIR", help="Run folder (created, or resumed if it holds hsx.json).")
    ],
    model: Annotated[
        str | None, typer.Option(metavar="PATH", help="Model folder or hub id (new run; or its new path on resume).")
    ] = None,
    data: Annotated[
        list[Path] | None,
        typer.Option(metavar="FILE", help="Conversations: .jsonl, .json or .parquet; repeatable, each file once."),
    ] = None,
    layers: Annotated[
        str | None,
        typer.Option(metavar="IDS", help="hsx layer ids, e.g. 1,15,28.", show_default="EAGLE-3's: 1, N/2-1, N-4"),
    ] = None,
    max_length: Annotated[
        int | None,
        EXTRACT.option(
            "max_length", help="Truncate samples to this many tokens.", show_default=str(DEFAULTS["max_length"])
        ),
    ] = None,
    batch_tokens: Annotated[
        int | None,
        EXTRACT.option(
            "batch_tokens", help="Padded tokens per forward pass.", show_default=str(DEFAULTS["batch_tokens"])
        ),
    ] = None,
    dtype: Annotated[str | None, EXTRACT.option("dtype", help="Model dtype.", show_default=DEFAULTS["dtype"])] = None,
    device: Annotated[
        str | None, typer.Option(metavar="DEVICE", help="cpu, cuda or cuda:N.", show_default="cuda if available")
    ] = None,
    shard_size: Annotated[
        int | None,
        EXTRACT.option("shard_size", help="Samples per shard folder.", show_default=str(DEFAULTS["shard_size"])),
    ] = None,
    trust_remote_code: Annotated[
        bool, typer.Option("--trust-remote-code", help="Allow the model's own Python code.")
    ] = False,
    packing: Annotated[
        str,
        EXTRACT.option("packing", help="Pack each batch into one row with no padding (auto: on for CUDA)."),
    ] = "auto",
    compile: Annotated[
        str, EXTRACT.option("compile", help="torch.compile the decoder layers (auto: on for CUDA).")
    ] = "auto",
    codec: Annotated[
        str | None, EXTRACT.option("codec", help="How states are stored (new run).", show_default=DEFAULTS["codec"])
    ] = None,
    writers: Annotated[int, EXTRACT.option("writers", help="Writer threads.")] = 8,
    fast_verify: Annotated[
        bool, typer.Option("--fast-verify", help="On resume, check headers and sizes only, not digests.")
    ] = False,
    allow_partial: Annotated[
        bool,
        typer.Option(
            "--allow-partial", help="Start even if the volume cannot hold the whole run; stop cleanly when it fills."
        ),
    ] = False,
    allow_incomplete: Annotated[
        bool,
        typer.Option(
            "--allow-incomplete", help="--data is an unfinished generate run: extract the conversations it holds."
        ),
    ] = False,
    backend: Annotated[
        str | None,
        EXTRACT.option("backend", help="What runs the model (new run).", show_default="transformers"),
    ] = None,
    tensor_parallel: Annotated[
        int | None,
        EXTRACT.option(
            "tensor_parallel", help="One model replica over N devices of this node (new run).", show_default="1"
        ),
    ] = None,
    expert_parallel: Annotated[
        int | None,
        EXTRACT.option(
            "expert_parallel",
            help="Split the routed experts over the tensor-parallel ranks (1 or N).",
            show_default="1",
        ),
    ] = None,
    tensor_parallel_size: Annotated[
        int | None,
        EXTRACT.option("tensor_parallel_size", help="vllm backend: GPUs per model replica.", show_default="1"),
    ] = None,
    data_parallel_size: Annotated[
        int | None, EXTRACT.option("data_parallel_size", help="vllm backend: model replicas.", show_default="1")
    ] = None,
    workers: Annotated[
        int,
        EXTRACT.option(
            "workers",
            help="Scale out: this many Ray workers, on 1 GPU or --tensor-parallel N each; 0: this process alone "
            "(needs the hsx[ray] extra).",
        ),
    ] = 0,
    ray_address: Annotated[
        str | None,
        typer.Option(
            metavar="ADDRESS", help="With --workers: join this Ray cluster.", show_default="a local Ray for this run"
        ),
    ] = None,
    metrics_port: Annotated[
        int | None,
        EXTRACT.option("metrics_port", help="Serve the run's metrics in Prometheus' text format on this port."),
    ] = None,
    metrics_textfile: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="Keep this file in Prometheus' text format (node_exporter's textfile)."),
    ] = None,
    quantized_compute: Annotated[
        str | None,
        typer.Option(
            help="FP8 checkpoints: fp8 (FP8 GEMMs, inputs quantized) | dequantized (weights expanded to the dtype) "
            "(new run; part of the spec) [fp8 where the GPU can]."
        ),
    ] = None,
) -> None:
    """Extract hidden states into OUT, or resume the run in OUT."""
    from hsx.extract import ExtractOptions
    from hsx.extract import extract as run_extract

    opts = None

    def interrupted() -> str:  # a command that works as printed: a resume needs the spec, a start its options
        if (out / SPEC).is_file():
            return f"resume with: {resume_command(out, model)}"
        if opts is None:
            return "nothing was started"
        return f"no run was made; start it again with: {opts.command()}"

    with failures(interrupted=interrupted):
        opts = ExtractOptions(
            out=out,
            model=model,
            data=list(data or []),
            layers=_layers(layers),
            max_length=max_length,
            batch_tokens=batch_tokens,
            dtype=dtype,
            device=device,
            shard_size=shard_size,
            trust_remote_code=trust_remote_code,
            packing=packing,
            compile=compile,
            codec=codec,
            writers=writers,
            deep_verify=not fast_verify,
            allow_partial=allow_partial,
            allow_incomplete=allow_incomplete,
            backend=backend,
            tensor_parallel=tensor_parallel,
            expert_parallel=expert_parallel,
            tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size,
            workers=workers,
            ray_address=ray_address,
            metrics_port=metrics_port,
            metrics_textfile=metrics_textfile,
            quantized_compute=quantized_compute,
        )
        summary = run_extract(opts, log=lambda m: console.print(m, highlight=False))
    _print_summary(summary)


def resume_command(out: Path, model: str | None = None, command: str = "extract") -> str:
    """``hsx extract --out OUT`` (or ``hsx generate``), with ``--model`` where one was given (a moved
    model: the resume needs it until it has recorded the new place)."""
    from hsx.assess.status import resume_command

    return resume_command(out, model, command)


RUN = Bounds(threads=AT_LEAST_ONE, size=AT_LEAST_ONE, draft_vocab=AT_LEAST_ONE, target_vocab=AT_LEAST_ONE)
RUN_FOLDER = typer.Argument(metavar="OUT", help="Run folder.", file_okay=False, show_default=False)


@app.command()
def status(
    out: Annotated[Path, RUN_FOLDER],
    deep: Annotated[
        bool, typer.Option("--deep", help="Verify every file's digest (reads all data), not only headers.")
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Machine-readable report on stdout.")] = False,
    threads: Annotated[int, RUN.option("threads", help="Parallel readers for the integrity check.")] = 8,
    model: Annotated[
        str | None, typer.Option(help="Check this model folder against the run's fingerprint (where it moved).")
    ] = None,
) -> None:
    """Is it safe to resume? One line per item: GPUs, volume, progress, pace, integrity, model, capture, spec, workers.

    Exit 0: nothing wrong; 1: damage that hsx extract redoes by itself; 2: a person must act first.
    """
    import json

    from rich.console import Console

    from hsx.assess.status import assess, render

    with failures():
        report = assess(out, deep=deep, threads=threads, given_model=model)
    if json_out:
        print(json.dumps(report.to_json(), indent=1))
    else:
        render(report, Console(highlight=False, soft_wrap=True))
    raise typer.Exit(report.exit_code)


@app.command()
def verify(
    out: Annotated[Path, RUN_FOLDER],
    deep: Annotated[
        bool, typer.Option("--deep", help="Verify every file's digest, not only headers and sizes.")
    ] = False,
    repair: Annotated[
        bool, typer.Option("--repair", help="Move bad files to OUT/quarantine/ (with a reason) for a redo.")
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Machine-readable report on stdout.")] = False,
    threads: Annotated[int, RUN.option("threads", help="Parallel readers.")] = 8,
) -> None:
    """Check every sample file of a run. Exit 0: all good; 1: problems (hsx extract redoes them); 2: refused."""
    import json

    from rich.console import Console

    from hsx.assess.status import render_check
    from hsx.assess.verify import verify as run_verify

    with failures():
        result = run_verify(out, deep=deep, repair=repair, threads=threads)
    if json_out:
        print(json.dumps(result.to_json(), indent=1))
    else:
        stdout = Console(highlight=False, soft_wrap=True)
        render_check(result.check, stdout)
        if result.moved:
            n = len(result.redo_ids())
            stdout.print(f"next: {resume_command(out, command=result.command)}  # redoes {n} samples", highlight=False)
    raise typer.Exit(result.exit_code)


@app.command("export")
def export_cmd(
    out: Annotated[Path, RUN_FOLDER],
    dest: Annotated[Path, typer.Argument(help="Export folder (created; rerun the same command to resume).")],
    to: Annotated[str, TO.option("to", "--to", help="The trainer's format.")],
    model: Annotated[
        str | None, typer.Option(help="The run's model, if it moved (final norm, vocabulary size).")
    ] = None,
    prenorm: Annotated[
        bool, typer.Option("--prenorm", help="modelopt: export the pre-norm final state (flagged).")
    ] = False,
    draft_vocab: Annotated[
        int | None, RUN.option("draft_vocab", help="Also write a draft-vocab map of this size.")
    ] = None,
    target_vocab: Annotated[
        int | None, RUN.option("target_vocab", help="Target vocabulary size.", show_default="the model's config")
    ] = None,
    allow_incomplete: Annotated[
        bool, typer.Option("--allow-incomplete", help="Export the finished samples of an unfinished run.")
    ] = False,
    pace: Annotated[float, typer.Option(hidden=True, min=0.0, help="Seconds to sleep after each sample.")] = 0.0,
) -> None:
    """Write OUT's samples in a trainer's own format, verifying each source file; resumable."""
    from hsx.export import ExportOptions, run_export

    opts = ExportOptions(out, dest, to, model, prenorm, allow_incomplete, draft_vocab, target_vocab, pace)
    with failures(lambda: f"every file exported so far is complete and kept; continue with: {opts.command()}"):
        s = run_export(opts, log=lambda m: console.print(m, highlight=False))
    err = "" if s.max_norm_error is None else f", max norm error {s.max_norm_error:.1e}"
    console.print(
        f"exported   {s.samples} samples to {s.dest} ({s.to}): {s.written} written now, {s.already_done} already done\n"
        f"files      {s.files}, {s.bytes / 1e6:,.1f} MB in {s.seconds:.1f}s; manifest hsx-export.json\n"
        f"final      {s.final_state}{err}",
        highlight=False,
    )


@app.command()
def vocab(
    out: Annotated[Path, RUN_FOLDER],
    size: Annotated[int, RUN.option("size", help="Draft vocabulary size.")] = 32000,
    dest: Annotated[Path | None, typer.Option(help="Where to write.", show_default="OUT/vocab")] = None,
    model: Annotated[str | None, typer.Option(help="The run's model, if it moved (for its vocabulary size).")] = None,
    target_vocab: Annotated[
        int | None, RUN.option("target_vocab", help="Target vocabulary size.", show_default="the model's config")
    ] = None,
) -> None:
    """Draft-vocab map (d2t/t2d) from loss-masked token counts of the plan; no hidden states read."""
    from hsx.export.vocab import write_vocab

    with failures():
        r = write_vocab(out, size, dest, model, target_vocab)
    console.print(
        f"vocab      {r.size} of {r.vocab_size} tokens ({r.distinct} seen), covering {r.coverage:.2%} of "
        f"loss-masked tokens\nwrote      {', '.join(p.name for p in r.files)} in {r.dest}",
        highlight=False,
    )


def _bench_generate(model: str | None, prompts: int, max_new_tokens: int, tp: int, workdir: Path | None) -> None:
    from hsx.bench_generate import generate_table, run_generate_bench

    with failures():
        results, same = run_generate_bench(
            model, prompts, max_new_tokens, tensor_parallel_size=tp, workdir=workdir, log=lambda m: None
        )
    print(generate_table(results, same))


@app.command()
def bench(
    model: Annotated[
        str | None,
        typer.Option(help="Model folder.", show_default="8B-shape random weights on CUDA, tiny on CPU"),
    ] = None,
    device: Annotated[str | None, typer.Option(help="cpu, cuda or cuda:N.", show_default="cuda if available")] = None,
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
) -> None:
    """Time forward-only, the naive baseline and hsx's extraction on the same batches, in one run."""
    from hsx.bench import run_bench, table
    from hsx.run.options import check_device, default_device

    if generate:
        return _bench_generate(model, samples, max_new_tokens, tensor_parallel_size, workdir)
    with failures():
        if device is not None:
            check_device(device)
    results = run_bench(
        model,
        device or default_device(),
        samples,
        mean_len,
        min_len,
        max_len,
        batch_tokens,
        naive_samples,
        writers,
        workdir,
        compile={"auto": None, "on": True, "off": False}[compile],
        log=lambda m: console.print(m, highlight=False),
        codecs=_codecs(codecs),
        fp8=fp8_model,
        int4_experts=int4_experts,
    )
    print(table(results))


def _codecs(text: str) -> tuple:
    from hsx.store.codec import Codec

    try:
        return tuple(Codec(c.strip()) for c in text.split(",") if c.strip())
    except ValueError:
        raise typer.BadParameter(f"takes codecs of {', '.join(Codec)}, not {text!r}", param_hint="--codecs") from None


@app.command()
def quickstart(
    out: Annotated[Path, typer.Option(help="Run folder.")] = Path("hsx-quickstart"),
    codec: Annotated[
        str | None, EXTRACT.option("codec", help="How states are stored (new run).", show_default=DEFAULTS["codec"])
    ] = None,
) -> None:
    """Extract the bundled conversations with the bundled tiny model, offline, on CPU."""
    from hsx.tinymodel import bundled_path

    extract(
        out=out,
        model=str(bundled_path("tiny-llama")),
        data=[bundled_path("data/sharegpt_dummy_conversation.json")],
        device="cpu",
        shard_size=100,
        codec=codec,
    )


@app.command()
def generate(
    out: Annotated[
        Path,
        typer.Option("--out", metavar="DIR", help="Generate run folder (created, or resumed if it holds hsx.json)."),
    ],
    model: Annotated[
        str | None, typer.Option(metavar="PATH", help="Model folder or hub id (new run; or its new path).")
    ] = None,
    data: Annotated[
        list[Path] | None,
        typer.Option(metavar="FILE", help="Conversations: .jsonl, .json or .parquet; repeatable (new run)."),
    ] = None,
    backend: Annotated[
        str | None, GENERATE.option("backend", help="What generates (new run).", show_default=GEN["backend"])
    ] = None,
    turns: Annotated[
        str | None,
        GENERATE.option(
            "turns",
            help="all: every assistant turn, on the target's own answers; last: the last only.",
            show_default=GEN["turns"],
        ),
    ] = None,
    temperature: Annotated[
        float | None,
        GENERATE.option("temperature", help="0: greedy.", show_default=str(SAMPLING.temperature)),
    ] = None,
    top_p: Annotated[
        float | None, GENERATE.option("top_p", help="Nucleus sampling (1: off).", show_default=str(SAMPLING.top_p))
    ] = None,
    top_k: Annotated[
        int | None, GENERATE.option("top_k", help="Top-k sampling (0: off).", show_default=str(SAMPLING.top_k))
    ] = None,
    max_new_tokens: Annotated[
        int | None,
        GENERATE.option(
            "max_new_tokens", help="New tokens per turn at most.", show_default=str(SAMPLING.max_new_tokens)
        ),
    ] = None,
    samples_per_prompt: Annotated[
        int | None,
        GENERATE.option(
            "samples_per_prompt",
            help="Conversations generated per input row.",
            show_default=str(GEN["samples_per_prompt"]),
        ),
    ] = None,
    seed: Annotated[
        int | None,
        GENERATE.option("seed", help="The run's seed; each request's derives from it.", show_default=str(GEN["seed"])),
    ] = None,
    template_kwargs: Annotated[
        str | None,
        typer.Option(
            metavar="JSON",
            help="JSON for the chat template, e.g. '{\"enable_thinking\": false}'.",
            show_default="none",
        ),
    ] = None,
    tool_parser: Annotated[
        str | None,
        GENERATE.option("tool_parser", help="How the target's calls are read.", show_default="response template"),
    ] = None,
    max_length: Annotated[
        int | None,
        GENERATE.option(
            "max_length", help="Prompt + completion of a turn at most.", show_default=str(GEN["max_length"])
        ),
    ] = None,
    shard_size: Annotated[
        int | None,
        GENERATE.option("shard_size", help="Conversations per shard folder.", show_default=str(GEN["shard_size"])),
    ] = None,
    dtype: Annotated[str | None, GENERATE.option("dtype", help="Model dtype.", show_default=GEN["dtype"])] = None,
    device: Annotated[
        str | None,
        typer.Option(
            metavar="DEVICE", help="transformers backend: cpu, cuda or cuda:N.", show_default="cuda if available"
        ),
    ] = None,
    trust_remote_code: Annotated[
        bool, typer.Option("--trust-remote-code", help="Allow the model's own Python code.")
    ] = False,
    tensor_parallel_size: Annotated[
        int | None,
        GENERATE.option("tensor_parallel_size", help="vllm backend: GPUs per model replica.", show_default="1"),
    ] = None,
    server: Annotated[
        list[str] | None,
        typer.Option(
            metavar="URL", help="server backend: an OpenAI-compatible base URL; repeatable.", show_default="none"
        ),
    ] = None,
    concurrency: Annotated[
        int | None,
        GENERATE.option("concurrency", help="server backend: requests in flight per server.", show_default="64"),
    ] = None,
    server_api: Annotated[
        str | None,
        GENERATE.option(
            "server_api",
            help="server backend: openai (/v1/completions), openai-chat (/v1/chat/completions) or sglang (/generate).",
            show_default="found out per server",
        ),
    ] = None,
    server_model: Annotated[
        str | None,
        typer.Option(metavar="NAME", help="server backend: the served model's name.", show_default="its only one"),
    ] = None,
    max_pending: Annotated[
        int | None,
        GENERATE.option(
            "max_pending", help="Requests kept submitted to the engine.", show_default="the engine's own choice"
        ),
    ] = None,
    fast_verify: Annotated[
        bool, typer.Option("--fast-verify", help="On resume, check headers and sizes only, not digests.")
    ] = False,
    allow_partial: Annotated[
        bool, typer.Option("--allow-partial", help="Start even if the volume cannot hold the whole run.")
    ] = False,
    metrics_port: Annotated[
        int | None,
        GENERATE.option("metrics_port", help="Serve the run's metrics in Prometheus' text format on this port."),
    ] = None,
    metrics_textfile: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="Keep this file in Prometheus' text format (node_exporter's textfile)."),
    ] = None,
) -> None:
    """Regenerate the assistant turns of conversations with the target into OUT, or resume the run in OUT."""
    from hsx.generate.job import generate as run_generate
    from hsx.generate.options import GenerateOptions
    from hsx.generate.options import template_kwargs as parse_kwargs

    opts = None

    def interrupted() -> str:  # a command that works as printed: a resume needs the spec, a start its options
        if (out / SPEC).is_file():
            return f"resume with: {resume_command(out, model, 'generate')}"
        if opts is None:
            return "nothing was started"
        return f"no run was made; start it again with: {opts.command()}"

    with failures(interrupted=interrupted):
        opts = GenerateOptions(
            out=out,
            model=model,
            data=list(data or []),
            backend=backend,
            turns=turns,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=max_new_tokens,
            samples_per_prompt=samples_per_prompt,
            seed=seed,
            template_kwargs=parse_kwargs(template_kwargs),
            tool_parser=tool_parser,
            max_length=max_length,
            shard_size=shard_size,
            dtype=dtype,
            device=device,
            trust_remote_code=trust_remote_code,
            tensor_parallel_size=tensor_parallel_size,
            servers=list(server or []),
            concurrency=concurrency,
            server_api=server_api,
            server_model=server_model,
            max_pending=max_pending,
            deep_verify=not fast_verify,
            allow_partial=allow_partial,
            metrics_port=metrics_port,
            metrics_textfile=metrics_textfile,
        )
        summary = run_generate(opts, log=lambda m: console.print(m, highlight=False))
    print("\n".join(summary.lines()))  # the summary on stdout, as extract's (progress goes to stderr)


@app.command("generate-export")
def generate_export(
    run: Annotated[Path, typer.Argument(metavar="GEN", help="Generate run folder.", show_default=False)],
    dest: Annotated[
        Path,
        typer.Argument(
            metavar="DEST", help="JSONL file to write: messages and token ids per conversation.", show_default=False
        ),
    ],
    allow_incomplete: Annotated[
        bool, typer.Option("--allow-incomplete", help="Export an unfinished run's conversations.")
    ] = False,
) -> None:
    """Write a generate run's conversations as JSONL (messages plus the exact token ids) for other trainers."""
    from hsx.generate.export import export_jsonl

    with failures():
        done = export_jsonl(run, dest, allow_incomplete)
    console.print(
        f"{done.conversations} conversations to {done.path} ({done.bytes / 1e6:,.1f} MB); "
        f"{done.rejected} rejected and {done.missing} not generated left out",
        highlight=False,
    )


@app.command()
def memory(
    model: Annotated[
        str, typer.Option(metavar="PATH", help="Model folder (a shape folder with only config.json will do).")
    ],
    tensor_parallel: Annotated[int, MEMORY.option("tensor_parallel", help="Ranks of one model replica.")] = 1,
    expert_parallel: Annotated[
        int, MEMORY.option("expert_parallel", help="Ranks the routed experts are split over (1 or N).")
    ] = 1,
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
        float | None, MEMORY.option("gpu_memory", help="GB of memory per GPU.", show_default="this node's")
    ] = None,
) -> None:
    """Per-GPU memory of a parallel layout, from config.json and the safetensors headers (no weight read)."""
    from hsx import target
    from hsx.capture import memory as mem

    with failures():
        model_dir = target.resolve(model)
        form = experts if experts != "auto" else mem.expert_form(model_dir, "cuda", dtype)
        layout = mem.Layout(tensor_parallel, expert_parallel, form, dtype, batch_tokens, max_length)
        device = None if gpu_memory is None else int(gpu_memory * mem.GB)
        for line in mem.explain(model_dir, layout, device, gpus):
            console.print(line, highlight=False)


def main() -> None:
    app(prog_name="hsx")
