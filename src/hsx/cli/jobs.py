"""The job commands: ``hsx extract``, ``hsx generate`` and ``hsx quickstart``; each starts or
resumes a run, and a Ctrl-C prints the command that goes on from what exists by then."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer

from hsx.bounds import Bounds
from hsx.cli.options import Codec, Flag, parameters
from hsx.cli.output import failures, log, print_summary
from hsx.extract.options import DEFAULTS, EXTRACT, ExtractOptions
from hsx.generate.options import DEFAULTS as GENERATE_DEFAULTS
from hsx.generate.options import GENERATE, SAMPLING, GenerateOptions
from hsx.store.layout import SPEC

Stage = Callable[..., Any]  # (options, log=) -> a summary with lines()


def run_job(verb: str, stage: Stage, out: Path, model: str | None, build: Callable[[], Any]) -> None:
    """Build the options and run ``stage`` on them; print its summary. A Ctrl-C prints a command
    that works as printed: a resume needs the spec, a start its options."""
    from hsx.job.options import resume_command

    opts = None

    def interrupted() -> str:
        if (out / SPEC).is_file():
            return f"resume with: {resume_command(out, model, verb)}"
        if opts is None:
            return "nothing was started"
        return f"no run was made; start it again with: {opts.command()}"

    with failures(interrupted):
        opts = build()
        summary = stage(opts, log=log)
    print_summary(summary)


def job(verb: str, cls: type, bounds: Bounds, defaults: Mapping[str, Any], **flags: Flag):
    """``hsx VERB``, whose options are the fields of ``cls``, running the decorated stage."""

    def command(stage: Stage) -> Callable[..., None]:
        signature, build = parameters(cls, bounds, defaults, **flags)

        def parsed(**given: Any) -> None:
            run_job(verb, stage, given["out"], given["model"], lambda: build(given))

        parsed.__signature__, parsed.__name__, parsed.__doc__ = signature, stage.__name__, stage.__doc__
        return parsed

    return command


@job("extract", ExtractOptions, EXTRACT, DEFAULTS)
def extract(opts: ExtractOptions, log: Callable[[str], None]):
    """Extract hidden states into OUT, or resume the run in OUT."""
    from hsx.extract import extract as stage

    return stage(opts, log)


@job(
    "generate",
    GenerateOptions,
    GENERATE,
    GENERATE_DEFAULTS | asdict(SAMPLING),
    backend=Flag("What generates (new run)."),
    max_length=Flag("Prompt + completion of a turn at most."),
    shard_size=Flag("Conversations per shard folder."),
)
def generate(opts: GenerateOptions, log: Callable[[str], None]):
    """Regenerate the assistant turns of conversations with the target into OUT, or resume the run in OUT."""
    from hsx.generate.job import generate as stage

    return stage(opts, log)


def quickstart(
    out: Annotated[Path, typer.Option(help="Run folder.")] = Path("hsx-quickstart"), codec: Codec = None
) -> None:
    """Extract the bundled conversations with the bundled tiny model, offline, on CPU."""
    from hsx.extract import extract
    from hsx.tinymodel import bundled_path

    model = str(bundled_path("tiny-llama"))
    data = [bundled_path("data/sharegpt_dummy_conversation.json")]
    run_job(
        "extract",
        extract,
        out,
        model,
        lambda: ExtractOptions(out=out, model=model, data=data, device="cpu", shard_size=100, codec=codec),
    )
