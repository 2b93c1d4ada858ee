"""The job commands: ``hsx extract``, ``hsx generate`` and ``hsx quickstart``; each starts or resumes
a run, and a Ctrl-C prints the command that goes on from what exists by then."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer

from hsx.cli.options import command, field_option
from hsx.cli.output import failures, log, print_summary
from hsx.extract.options import DEFAULTS, EXTRACT, ExtractOptions, quickstart_options
from hsx.generate.options import DEFAULTS as GENERATE_DEFAULTS
from hsx.generate.options import GENERATE, SAMPLING, GenerateOptions
from hsx.job.options import interrupted


def run_job(verb: str, stage: Callable[..., Any], out: Path, model: str | None, build: Callable[[], Any]) -> None:
    """Build the options and run ``stage`` on them; print its summary."""
    opts = None
    with failures(lambda: interrupted(verb, out, model, opts)):
        opts = build()
        summary = stage(opts, log=log)
    print_summary(summary)


def _extract(build: Callable[[], ExtractOptions], given: dict) -> None:
    """Extract hidden states into OUT, or resume the run in OUT."""
    from hsx.extract import extract

    run_job("extract", extract, given["out"], given["model"], build)


def _generate(build: Callable[[], GenerateOptions], given: dict) -> None:
    """Regenerate the assistant turns of conversations with the target into OUT, or resume the run in OUT."""
    from hsx.generate.job import generate

    run_job("generate", generate, given["out"], given["model"], build)


def quickstart(
    out: Annotated[Path, typer.Option(help="Run folder.")] = Path("hsx-quickstart"),
    codec: Annotated[str | None, field_option(ExtractOptions, "codec", EXTRACT, DEFAULTS)] = None,
) -> None:
    """Extract the bundled conversations with the bundled tiny model, offline, on CPU."""
    from hsx.extract import extract

    run_job("extract", extract, out, None, lambda: quickstart_options(out, codec))  # refusals inside failures()


extract = command(ExtractOptions, EXTRACT, _extract, DEFAULTS)
generate = command(GenerateOptions, GENERATE, _generate, GENERATE_DEFAULTS | asdict(SAMPLING))
