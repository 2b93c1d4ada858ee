"""The folder steps every job does, whatever its stage: remove what a killed process left beside the
run's own files, record a start that never became a run, refuse a new run's non-empty folder and a
resume that drifts from its spec (invariant 3), and record where a matched model now lives
(invariant 8).
"""

from __future__ import annotations

import os
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel, Field

from hsx import target
from hsx.errors import Crashed, HsxError, Locked, Refused
from hsx.job.options import JobOptions
from hsx.lock import Liveness, read_holder
from hsx.spec import JobSpec, now, record_location, who
from hsx.store import layout
from hsx.store.durable import temp_of, write_durable


def remove_stray_temps(run: Path) -> int:
    """Remove the temp files a killed process left beside the run's own files (spec, plan, rejects,
    lock, metrics); shard folders are tidied by the scan. Returns how many were removed."""
    removed = 0
    for folder in (run, run / layout.PLAN_DIR):
        if folder.is_dir():
            for p in folder.iterdir():
                of = temp_of(p.name)  # never this process's own (its heartbeat's)
                if of is not None and of[1] != os.getpid() and p.is_file():
                    p.unlink(missing_ok=True)
                    removed += 1
    return removed


LOG_TAIL = 20  # log lines a failure's record keeps


class Failure(BaseModel):
    """Why a job ended where it should not have, in its run folder: a start that never became a run
    (``FAILED_START``: no spec yet), or a session of a run that met an error hsx did not expect
    (``CRASH``: a bug or a model hsx cannot run, which a resume as it stands meets again). ``hsx
    status`` reports either until a start or a session completes."""

    reason: str  # one line: what failed
    command: str | None  # the command that was running (for a failed start: the one that starts it again)
    at: str
    by: str
    error: str | None = None  # the exception's type, where it was one hsx did not expect
    where: str | None = None  # the innermost frame that raised it: file:line in function
    traceback: list[str] = Field(default_factory=list)  # the whole traceback, for a bug report
    log: list[str] = Field(default_factory=list)  # the job's last log lines before it

    @classmethod
    def of(cls, error: BaseException, command: str | None, log: list[str] | None = None) -> Failure:
        if isinstance(error, KeyboardInterrupt):
            reason = "interrupted while planning, before the run spec was written"
            return cls(reason=reason, command=command, at=now(), by=who())
        if isinstance(error, HsxError):
            return cls(reason=str(error), command=command, at=now(), by=who(), log=list(log or []))
        frames = traceback.extract_tb(error.__traceback__)
        where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else None
        return cls(
            reason=f"{type(error).__name__}: {error}".strip().rstrip(":"),
            command=command,
            at=now(),
            by=who(),
            error=type(error).__name__,
            where=where,
            traceback="".join(traceback.format_exception(error)).splitlines(),
            log=list(log or []),
        )


class LogTail:
    """The job's log, its last ``LOG_TAIL`` lines kept for the record of a failure."""

    def __init__(self, log: Callable[[str], None]):
        self.log, self.lines = log, deque[str](maxlen=LOG_TAIL)

    def __call__(self, message: str) -> None:
        self.lines.extend(str(message).splitlines() or [""])
        self.log(message)


def record_failure(opts: JobOptions, error: BaseException, log: list[str] | None = None) -> Path:
    """Record why the job on ``opts.out`` failed, where ``hsx status`` and the next ``hsx COMMAND
    --out`` read it: before the spec exists, a start that never became a run (a start killed
    outright leaves no record: status tells that case by the missing spec beside an unfinished
    plan); after, the crash of a session. Returns the record's path."""
    name = layout.CRASH if (opts.out / layout.SPEC).is_file() else layout.FAILED_START
    write_durable(opts.out / name, Failure.of(error, opts.command(), log).model_dump_json(indent=1).encode())
    return opts.out / name


def crashed(opts: JobOptions, error: Exception, log: list[str]) -> Crashed:
    """An error hsx did not expect, recorded in the run folder (where one exists) and said in one
    message: what failed, where, and that a resume as it stands meets it again."""
    failure = Failure.of(error, opts.command(), log)
    where = f" at {failure.where}" if failure.where else ""
    recorded = ""
    if opts.out.is_dir():
        path = record_failure(opts, error, log)
        recorded = (
            f"; the traceback and the log's last lines are in {path} (hsx status {opts.out} reports it until "
            "a session completes)"
        )
    return Crashed(
        f"hsx {opts.COMMAND} failed unexpectedly: {failure.reason}{where}{recorded}. This is a bug in hsx or "
        "a model it cannot run: the same command as it stands is likely to fail the same way"
    )


@contextmanager
def setting_up(opts: JobOptions) -> Iterator[None]:
    """Around a new run's first writes (its folder made, its plan and rejects): a start that fails or is
    interrupted there leaves the record of why and of the command that starts it again."""
    opts.out.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException as e:  # the folder now holds a start that never became a run: say so in it
        record_failure(opts, e)
        raise


def read_failure(run: Path, name: str) -> Failure | None:
    """A failure's record in ``run`` (``layout.FAILED_START`` or ``layout.CRASH``), if any."""
    try:
        return Failure.model_validate_json((run / name).read_bytes())
    except (OSError, ValueError):
        return None


def failed_start(run: Path) -> Failure | None:
    """The record of a start in ``run`` that never became a run, if any."""
    return read_failure(run, layout.FAILED_START)


def refuse_foreign(out: Path) -> None:
    """A new run's folder holds nothing but what an interrupted set-up left (its files and temps, rebuilt
    from the data), or the run is refused before anything is written there. Only reads: a live set-up's
    temps are another start's, removed (``remove_stray_temps``) only under the run's lock."""
    if out.is_dir():
        foreign = sorted(
            p.name
            for p in out.iterdir()
            if p.name not in layout.SETUP_FILES and not (temp_of(p.name) is not None and p.is_file())
        )
        if foreign:
            raise Refused(
                f"{out} is not empty and holds no run spec ({', '.join(foreign[:5])}"
                f"{', ...' if len(foreign) > 5 else ''}): choose an empty or new folder"
            )


def _kind(opts: JobOptions) -> str:
    """What the job's run is called in a message: an extraction's plainly "a run"."""
    return "a run" if opts.COMMAND == "extract" else f"a {opts.COMMAND} run"


def require_start(opts: JobOptions) -> None:
    """A folder with no spec is a new run: it needs --model and --data, or is refused (naming the
    command an earlier start in it was given); one a live process is setting up is that process's."""
    if not opts.model or not opts.data:
        holder = read_holder(opts.out)
        if holder is not None and holder.state() == Liveness.ALIVE:
            raise Locked(holder)
        started = failed_start(opts.out)
        raise Refused(
            f"{opts.out} is not {_kind(opts)} yet: a new run needs --model and --data"
            + (f"; it was started with: {started.command}" if started else "")
        )


def refuse_drift(opts: JobOptions, diffs: list[str]) -> None:
    """Invariant 3: a resume that asks for anything other than the spec is refused, each difference named."""
    if diffs:
        raise Refused(
            f"{opts.out} belongs to {_kind(opts)} with other settings; refusing to resume:\n  - "
            + "\n  - ".join(diffs)
            + f"\nResume with the run's own settings: hsx {opts.COMMAND} --out {opts.out}"
        )


def record_model(opts: JobOptions, spec: JobSpec, log: Callable[[str], None]) -> None:
    """After the stage opened the run and matched ``--model`` against the fingerprint, and under the run's lock
    (a resume refused by a live extractor writes nothing): record it if the model moved."""
    if opts.model is None:
        return
    where = target.location(opts.model)
    if record_location(opts.out, spec, where):
        log(f"model: {where} matches the run's fingerprint; recorded in {layout.LOCATION} as its location")
