"""``hsx status``: the whole recovery assessment as one checklist, and the one command that resumes.

Each line is ok / warn / fail with the figure behind it. The exit code says who acts next: 0 nothing
to repair (the lines that warn named beside it), 1 ``hsx extract`` repairs what is wrong by itself, 2 a
person must act first.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from hsx.assess import (
    certificate,
    consumers,
    fidelity,
    gpus,
    integrity,
    links,
    model,
    pace,
    runspec,
    tally,
    volume,
    workers,
)
from hsx.assess.checks import Check, exit_code, skipped
from hsx.errors import Exit, RecordDamaged, SpecError
from hsx.extract.window import in_flight as window_in_flight
from hsx.genrun.spec import GenerateSpec
from hsx.job import space
from hsx.job.options import resume_command
from hsx.spec import EXTRACT, GENERATE, RunSpec, model_location, same_place
from hsx.store import layout
from hsx.target import files_record
from hsx.telemetry import read_history

ORDER = (
    "gpus",
    "interconnect",
    "volume",
    "progress",
    "pace",
    "integrity",
    "fidelity",
    "certificate",
    "model",
    "capture",
    "spec",
    "workers",
)  # then consumers, if any
VERDICTS = {Exit.OK: "ok", Exit.REDO: "redo", Exit.ACT: "act"}
STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red"}


@dataclass
class Report:
    run: Path
    checks: list[Check]
    next: list[str] = field(default_factory=list)  # what to do, in order
    resume: str | None = None  # the command that resumes, once the steps above are done
    command: str = "extract"  # what resumes it: the run's kind (``hsx generate`` for a generate run)

    @property
    def exit_code(self) -> int:
        return exit_code(self.checks)

    def get(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def to_json(self) -> dict:
        return {
            "run": str(self.run),
            "exit_code": self.exit_code,
            "verdict": VERDICTS[self.exit_code],
            "checks": [c.to_json() for c in self.checks],
            "next": self.next,
            "resume_command": self.resume,
        }


def _projection(run: Path, spec: RunSpec | GenerateSpec, plan, t: tally.Tally, left_tokens: int) -> space.Projection:
    """What the rest of the run needs on the volume: its tokens at what its files take
    (``spec.footprint``: an extraction's states at its codec's ratio as the files on disk measure it,
    a generate run's token ids and texts by its plan's estimate)."""
    fp = spec.footprint()
    measured = space.Measured()  # without a readable plan: unmeasured
    if t.tokens_done is not None:
        measured = space.Measured(t.samples_done, t.tokens_done * fp.bytes_per_token, t.bytes_done)
    longest = int(plan.lengths.max()) if plan else spec.max_length
    return space.project(
        run,
        fp.bytes_per_token,
        spec.plan.num_tokens,
        spec.plan.num_samples,
        left_tokens,
        t.samples_left,
        t.bytes_done,
        space.largest_batch_bytes(fp.batch_tokens, longest, fp.bytes_per_token),
        new_dirs=len(t.shards["untouched"]),
        ratio=space.stored_ratio(spec, measured),
        basis=space.ratio_basis(spec, measured),
    )


def assess(run: Path, deep: bool = False, threads: int = 8, given_model: str | None = None) -> Report:
    """``given_model``: ``hsx status --model PATH``, checked against the fingerprint instead of
    where the run looks for its model."""
    files = runspec.inspect(run)
    worker = workers.inspect(run)
    spec, plan = files.spec, files.plan
    command = spec.kind if spec is not None else EXTRACT
    checks = {"spec": files.check, "workers": workers.check(worker, command)}
    local = worker.alive and worker.holder is not None and worker.holder.host == socket.gethostname()
    launcher = worker.group.launcher if worker.group is not None and worker.group.launcher_alive() else None
    checks["gpus"] = gpus.check(worker.pid if local else None, launcher)  # its own GPU use is not foreign
    parallel = getattr(spec, "parallel", None)  # an extraction's layout (a generate run's engine lays out its own)
    checks["interconnect"] = links.check(run, parallel.ranks if parallel else 1, worker.alive)
    t = None
    readers = None  # the consumers line: only for a run a trainer reads
    if spec is None:
        for name in ("volume", "progress", "pace", "integrity", "fidelity", "certificate", "model", "capture"):
            checks[name] = skipped(name, "no readable run spec")
    else:
        result = integrity.inspect(run, spec, deep, worker.alive, threads)
        t = tally.tally(result.scans, spec.plan.num_samples, spec.plan.num_tokens, plan.lengths if plan else None)
        checks["integrity"] = integrity.check(result, command=command)
        checks["fidelity"] = fidelity.line(run, spec, result.scans)
        checks["certificate"] = certificate.line(run, spec)
        window = getattr(spec, "window", None)  # an extraction's (a generate run has none)
        in_flight = window_in_flight(spec) if window is not None else 0  # the window's bound counts them
        readers = consumers.check(
            run, result.scans, spec.plan.num_samples, spec.shard_size, window, worker.alive, in_flight
        )
        checks["progress"] = tally.check(t, command)
        if spec.kind == GENERATE:
            _outcomes(checks["progress"], run, spec)
        elif spec.generate_spec is not None:
            _waiting(checks["progress"], run, Path(spec.data[0].name))
        _rejects(checks["progress"], run, spec)
        checks["pace"] = pace.check(pace.pace(read_history(run)), t.complete)
        left_tokens = t.tokens_left
        if t.tokens_done is None:  # plan unreadable: assume average-length samples are left
            left_tokens = spec.plan.num_tokens * t.samples_left // max(t.samples_total, 1)
        checks["volume"] = volume.check(_projection(run, spec, plan, t, left_tokens), run)
        try:
            recorded = model_location(run, spec)
        except SpecError as e:
            recorded = spec.model.path
            checks["model"] = Check("model", "fail", str(e), action=f"remove {layout.LOCATION} and resume with --model")
        where = given_model or recorded
        model_dir = model.locate(where)
        if "model" not in checks:
            try:
                files = files_record(run, spec)
                checks["model"] = model.check_model(spec, model_dir, where, same_place(where, recorded), files)
            except RecordDamaged as e:  # never trusted, nor read as none: the resume refuses it too
                checks["model"] = Check("model", "fail", f"{layout.MODEL_FILES}: {e.why.split('; ')[0]}",
                                        action=e.why.split("; ", 1)[1])  # fmt: skip
        generated = spec.kind == GENERATE
        checks["capture"] = model.check_engine(spec) if generated else model.check_capture(spec, model_dir, deep)
    crashed = runspec.crash(run)  # listed only where the last session crashed
    listed = [checks[n] for n in ORDER] + [c for c in (crashed, readers) if c is not None]
    report = Report(run, listed, command=command)
    _next_steps(report, t, given_model)
    return report


def _outcomes(progress: Check, run: Path, spec: GenerateSpec) -> None:
    """A generate run's conversations by outcome (their headers): whole, ended early (kept up to the
    last turn that fit), rejected."""
    from collections import Counter

    from hsx.genrun.record import statuses

    n = Counter(statuses(run, spec.plan.num_samples, spec.shard_size).values())
    progress.data["conversations"] = {k: n[k] for k in ("ok", "ended", "rejected")}
    if n["ended"] or n["rejected"]:
        progress.details.append(
            f"conversations: {n['ok']:,} whole, {n['ended']:,} ended early (the turns before kept: a later prompt "
            f"reached --max-length, or a tool call had no result to pair), {n['rejected']:,} rejected while "
            "generating"
        )


def _rejects(progress: Check, run: Path, spec) -> None:
    """Every row the run rejected, planning's included (a generate run's are in its outcomes too)."""
    later = progress.data.get("conversations", {}).get("rejected", 0)
    planned = spec.plan.num_rejected
    progress.data["rejected_at_planning"] = planned
    if planned or later:
        while_generating = f", {later:,} conversations while generating" if later else ""
        progress.details.append(
            f"rejected: {planned:,} input rows at planning{while_generating}; "
            f"each with its reason in {run / layout.REJECTS}"
        )


def _waiting(progress: Check, run: Path, gen: Path) -> None:
    """An extraction of an unfinished generate run: the conversations it found not generated, and
    how many the generate run holds by now (an extraction takes the generate run as it was)."""
    from hsx.genrun.samples import waiting

    missing, since = waiting(run, gen)
    progress.data["not_generated"], progress.data["generated_since"] = missing, since
    if missing:
        progress.details.append(
            f"{missing:,} conversations of {gen} were not generated when this run was planned, "
            f"{missing - since:,} still wait for generation; {since:,} generated since, which the next resume "
            "plans as new samples"
        )


def _next_steps(report: Report, t: tally.Tally | None, given_model: str | None = None) -> None:
    act = [c for c in report.checks if c.exit_code == Exit.ACT]
    start = report.get("spec").data.get("start_command")
    if start is not None:  # a start that never became a run: nothing to resume, only to start again
        report.next = [f"nothing to resume; once the reason above is fixed, start it again: {start}"]
        return
    if report.get("spec").level == "fail":
        report.next = [f"{c.name}: {c.action or c.figure}" for c in act]
        report.next.append("this folder cannot be resumed until its spec and plan are restored")
        return
    model = report.get("model")
    given = given_model if model.level != "fail" else None  # it matched: the resume records it
    cmd = resume_command(report.run, given, report.command)
    if model.level == "fail" and model.data.get("found") is False:
        cmd += " --model NEW_PATH"
    report.next = [f"fix first: {c.name}: {c.action or c.figure}" for c in act]
    redo = report.exit_code == Exit.REDO
    finished = t is not None and t.complete and not t.complete_unsealed
    since = report.get("progress").data.get("generated_since", 0)  # an extraction following its generate run
    if finished and not redo and not since:
        report.next.append(f"nothing to resume: all {t.samples_total:,} samples are done and verified")
        return
    if since:
        report.next.append(f"{since:,} conversations its generate run finished since wait: a resume plans them")
    report.resume = cmd
    if not act and redo:
        report.next.append(f"hsx {report.command} redoes the damaged samples by itself (or first: hsx verify --repair)")


def render(report: Report, console: Console) -> None:
    console.print(f"[bold]hsx status[/] {escape(str(report.run))}", highlight=False)
    for c in report.checks:
        render_check(c, console)
    for line in report.next:
        console.print(escape(line), highlight=False)
    if report.resume:
        label = "then resume" if report.exit_code == Exit.ACT else "resume"
        console.print(f"[bold]{label}:[/] {escape(report.resume)}", highlight=False)
    warned = [c.name for c in report.checks if c.level == "warn"]
    ok = f"[yellow]nothing to repair; warnings: {', '.join(warned)}[/]" if warned else "[green]nothing wrong[/]"
    verdict = {0: ok, 1: f"[yellow]hsx {report.command} repairs this[/]", 2: "[red]act first[/]"}
    console.print(f"exit {report.exit_code}: {verdict[report.exit_code]}", highlight=False)


def render_check(c: Check, console: Console) -> None:
    """One checklist line, its details and, unless ok, what to do."""
    console.print(f"  [{STYLE[c.level]}]{c.level:<4}[/] {c.name:<10} {escape(c.figure)}", highlight=False)
    for d in c.details:
        console.print(f"{'':18}{escape(d)}", highlight=False)
    if c.action and c.level != "ok":
        console.print(f"{'':18}[dim]-> {escape(c.action)}[/]", highlight=False)
