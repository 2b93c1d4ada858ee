"""The commands that read a run: ``status``, ``verify``, ``export``, ``vocab``, ``generate-export``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from hsx.cli.options import (
    RUN,
    TO,
    AllowIncomplete,
    Deep,
    Device,
    Json,
    MovedModel,
    RunFolder,
    TargetVocab,
    Threads,
)
from hsx.cli.output import checklist, failures, log, print_summary
from hsx.errors import OptionError
from hsx.extract.options import layer_ids

FIDELITY_FILES = 32  # files verify --fidelity recomputes by default


def status(
    out: RunFolder, deep: Deep = False, json_out: Json = False, threads: Threads = 8, model: MovedModel = None
) -> None:
    """Is it safe to resume? One line per item: GPUs, volume, progress, pace, integrity, fidelity, model, capture,
    spec, workers.

    Exit 0: nothing to repair (warnings named); 1: damage that hsx extract redoes by itself; 2: a person must act
    first.
    """
    from hsx.assess.status import assess, render

    with failures():
        report = assess(out, deep=deep, threads=threads, given_model=model)
    if json_out:
        print(json.dumps(report.to_json(), indent=1))
    else:
        render(report, checklist)
    raise typer.Exit(report.exit_code)


def verify(
    out: RunFolder,
    deep: Deep = False,
    repair: Annotated[
        bool, typer.Option("--repair", help="Move bad files to OUT/quarantine/ (with a reason) for a redo.")
    ] = False,
    json_out: Json = False,
    threads: Threads = 8,
    fidelity: Annotated[
        bool,
        typer.Option(
            "--fidelity", help="Also recompute the fidelity of a sample of files from the checkpoint (slow, exact)."
        ),
    ] = False,
    fidelity_files: Annotated[
        int | None, RUN.option("fidelity_files", help="--fidelity: files recomputed.", show_default=str(FIDELITY_FILES))
    ] = None,
    reference: Annotated[
        int,
        RUN.option(
            "reference",
            metavar="N",
            help="Also recompute N files through transformers' plain path and compare every tap (certificate.json).",
        ),
    ] = 0,
    device: Device = None,
    model: MovedModel = None,
) -> None:
    """Check every sample file of a run. Exit 0: all good; 1: problems (hsx extract redoes them); 2: refused,
    or (--fidelity, --reference) states that are intact but not the target's numbers."""
    from hsx.assess.status import render_check
    from hsx.assess.verify import verify as run_verify

    if fidelity_files is not None and not fidelity:
        raise typer.BadParameter(
            "sizes the sample --fidelity recomputes: give --fidelity too", param_hint="--fidelity-files"
        )
    with failures():
        files = (fidelity_files or FIDELITY_FILES) if fidelity else 0
        result = run_verify(out, deep, repair, threads, files, device, model, reference)
    if json_out:
        print(json.dumps(result.to_json(), indent=1))
    else:
        render_check(result.check, checklist)
        for check in (result.fidelity, result.reference):
            if check is not None:
                render_check(check, checklist)
        for line in result.lines():
            print(line)
    raise typer.Exit(result.exit_code)


def export(
    out: RunFolder,
    dest: Annotated[Path, typer.Argument(help="Export folder (created; rerun the same command to resume).")],
    to: Annotated[str, TO.option("to", "--to", help="The trainer's format.")],
    draft: Annotated[str, TO.option("draft", "--draft", help="The draft type its trainer trains.")] = "eagle3",
    taps: Annotated[
        str | None,
        typer.Option(
            metavar="IDS", help="The run's taps to export, hsx ids, e.g. 1,9,17.", show_default="the draft type's"
        ),
    ] = None,
    model: MovedModel = None,
    prenorm: Annotated[
        bool, typer.Option("--prenorm", help="modelopt: export the pre-norm final state (flagged).")
    ] = False,
    draft_vocab: Annotated[
        int | None, TO.option("draft_vocab", help="Also write a draft-vocab map of this size.")
    ] = None,
    target_vocab: TargetVocab = None,
    allow_incomplete: AllowIncomplete = False,
    pace: Annotated[float, TO.option("pace", hidden=True, help="Seconds to sleep after each sample.")] = 0.0,
) -> None:
    """Write OUT's samples in a trainer's own format, verifying each source file; resumable."""
    from hsx.export import ExportOptions, run_export

    try:
        ids = layer_ids(taps)
    except OptionError:  # its refusal names --layers, whose presets --taps does not take
        said = f"takes comma-separated hsx layer ids, e.g. 1,9,17, not {taps!r}"
        raise typer.BadParameter(said, param_hint="--taps") from None
    if isinstance(ids, str):
        raise typer.BadParameter(f"takes hsx layer ids, not the preset {ids!r}", param_hint="--taps")
    with failures():
        opts = ExportOptions(
            out, dest, to, model, prenorm, allow_incomplete, draft_vocab, target_vocab, pace, draft, ids
        )
    with failures(lambda: f"every file exported so far is complete and kept; continue with: {opts.command()}"):
        print_summary(run_export(opts, log=log))


def vocab(
    out: RunFolder,
    size: Annotated[int, RUN.option("size", help="Draft vocabulary size.")] = 32000,
    dest: Annotated[Path | None, typer.Option(help="Where to write.", show_default="OUT/vocab")] = None,
    model: MovedModel = None,
    target_vocab: TargetVocab = None,
) -> None:
    """Draft-vocab map (d2t/t2d) from loss-masked token counts of the plan; no hidden states read."""
    from hsx.export.vocab import write_vocab

    with failures():
        print_summary(write_vocab(out, size, dest, model, target_vocab))


def generate_export(
    run: Annotated[Path, typer.Argument(metavar="GEN", help="Generate run folder.", show_default=False)],
    dest: Annotated[
        Path,
        typer.Argument(
            metavar="DEST", help="JSONL file to write: messages and token ids per conversation.", show_default=False
        ),
    ],
    allow_incomplete: AllowIncomplete = False,
) -> None:
    """Write a generate run's conversations as JSONL (messages plus the exact token ids) for other trainers."""
    from hsx.generate.export import export_jsonl

    with failures():
        print_summary(export_jsonl(run, dest, allow_incomplete))
