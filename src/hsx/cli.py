"""The ``hsx`` command line: parse, call a stage, print. No logic lives here."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hsx.progress import console

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Verified, crash-safe extraction of an LLM's hidden states for draft training.",
)

EXIT_REFUSED, EXIT_DISK_FULL, EXIT_INTERRUPTED = 2, 3, 130


def _fail(message: str, code: int) -> typer.Exit:
    console.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code)


def _layers(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"--layers takes comma-separated integers, got {value!r}") from None


def _print_summary(s) -> None:
    from hsx.store import layout

    state = "[green]complete[/]" if s.complete else "[yellow]incomplete[/]"
    lines = [
        f"run        {s.run}  ({state})",
        f"samples    {s.done}/{s.total_samples} done, {s.written} written now, {s.already_done} were already verified",
        f"written    {s.tokens_written:,} tokens, {s.bytes_written / 1e6:,.1f} MB in {s.seconds:.1f}s"
        + (f" ({s.tokens_written / s.seconds:,.0f} tok/s)" if s.seconds > 0 and s.tokens_written else ""),
        f"rejected   {s.rejected} input rows (see {s.run / layout.REJECTS})",
    ]
    if s.redone:
        lines.append("redone     " + ", ".join(f"{n} {k}" for k, n in sorted(s.redone.items())))
    if s.stray_removed or s.quarantined:
        lines.append(f"cleaned    {s.stray_removed} stray temp files removed, {s.quarantined} files quarantined")
    console.print("\n".join(lines), highlight=False)


@app.command()
def extract(
    out: Annotated[Path, typer.Option("--out", help="Run folder (created, or resumed if it holds hsx.json).")],
    model: Annotated[
        str | None, typer.Option(help="Model folder or hub id (new run; or its new path on resume).")
    ] = None,
    data: Annotated[
        list[Path] | None, typer.Option(help="Conversations: .jsonl, .json or .parquet; repeatable.")
    ] = None,
    layers: Annotated[str | None, typer.Option(help="hsx layer ids, e.g. 1,15,28 (default EAGLE-3's).")] = None,
    max_length: Annotated[int | None, typer.Option(help="Truncate samples to this many tokens [4096].")] = None,
    batch_tokens: Annotated[int | None, typer.Option(help="Padded tokens per forward pass [16384].")] = None,
    dtype: Annotated[str | None, typer.Option(help="auto | bfloat16 | float16 | float32 [auto].")] = None,
    device: Annotated[str | None, typer.Option(help="cuda, cuda:1, cpu [cuda if available].")] = None,
    shard_size: Annotated[int | None, typer.Option(help="Samples per shard folder [1000].")] = None,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow the model's own Python code.")] = False,
    writers: Annotated[int, typer.Option(help="Writer threads.")] = 8,
    fast_verify: Annotated[bool, typer.Option(help="On resume, check headers and sizes only, not digests.")] = False,
) -> None:
    """Extract hidden states into OUT, or resume the run in OUT."""
    from hsx.extract import DiskFullStop, ExtractOptions, Refused
    from hsx.extract import extract as run_extract
    from hsx.input import InputError
    from hsx.lock import Locked
    from hsx.spec import SpecError
    from hsx.target import ModelNotFound

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
        writers=writers,
        deep_verify=not fast_verify,
    )
    try:
        summary = run_extract(opts, log=lambda m: console.print(m, highlight=False))
    except (Refused, Locked, SpecError, ModelNotFound, InputError) as e:
        raise _fail(str(e), EXIT_REFUSED) from None
    except ValueError as e:
        raise _fail(str(e), EXIT_REFUSED) from None
    except DiskFullStop as e:
        s = e.summary
        raise _fail(
            f"{e}.\nStopped cleanly: {s.done}/{s.total_samples} samples are done and verified; "
            f"about {e.needed_bytes / 1e9:,.2f} GB more are needed to finish.\n"
            f"Free space, then resume: hsx extract --out {out}",
            EXIT_DISK_FULL,
        ) from None
    except KeyboardInterrupt:
        raise _fail(f"interrupted; resume with: hsx extract --out {out}", EXIT_INTERRUPTED) from None
    _print_summary(summary)


@app.command()
def quickstart(
    out: Annotated[Path, typer.Option(help="Run folder.")] = Path("hsx-quickstart"),
) -> None:
    """Extract the bundled conversations with the bundled tiny model, offline, on CPU."""
    from hsx.tinymodel import bundled_path

    extract(
        out=out,
        model=str(bundled_path("tiny-llama")),
        data=[bundled_path("data/sharegpt_dummy_conversation.json")],
        device="cpu",
        shard_size=100,
    )


def main() -> None:
    app()
