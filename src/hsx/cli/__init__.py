"""The ``hsx`` command line: parse, call a stage, print. No logic lives here: a command's options are
its stage's options dataclass where it has one (``options``), errors become exit codes in one place
(``output.failures``), and what a command did prints itself (``lines()``)."""

from __future__ import annotations

from typing import Annotated

import typer

from hsx.cli import jobs, runs, tools

__all__ = ["app", "main"]

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


# the commands, in the order the help lists them
for command in (
    jobs.extract,
    runs.status,
    runs.verify,
    runs.export,
    runs.vocab,
    tools.bench,
    jobs.quickstart,
    jobs.generate,
    runs.generate_export,
    tools.memory,
):
    app.command(command.__name__.replace("_", "-"))(command)


def main() -> None:
    app(prog_name="hsx")
