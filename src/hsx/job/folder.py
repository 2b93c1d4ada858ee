"""The folder steps every job does, whatever its stage: remove what a killed process left beside the
run's own files, record a start that never became a run, refuse a new run's non-empty folder and a
resume that drifts from its spec (invariant 3), and record where a matched model now lives
(invariant 8).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hsx import target
from hsx.errors import HsxError, Refused
from hsx.job.options import JobOptions
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


def record_failed_start(opts: JobOptions, error: BaseException) -> None:
    """Why this start did not become a run, and the command that starts it again, for ``hsx status``
    and the next ``hsx COMMAND --out`` to tell (a start killed outright leaves no record: status
    tells that case by the missing spec beside an unfinished plan)."""
    reason = str(error) if isinstance(error, HsxError) else f"{type(error).__name__} {error}".strip()
    if isinstance(error, KeyboardInterrupt):
        reason = "interrupted while planning, before the run spec was written"
    record = {"reason": reason, "command": opts.command(), "at": now(), "by": who()}
    write_durable(opts.out / layout.FAILED_START, json.dumps(record, indent=1).encode())


@contextmanager
def setting_up(opts: JobOptions) -> Iterator[None]:
    """Around a new run's first writes (its folder made, its plan and rejects): a start that fails or is
    interrupted there leaves the record of why and of the command that starts it again."""
    opts.out.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException as e:  # the folder now holds a start that never became a run: say so in it
        record_failed_start(opts, e)
        raise


def failed_start(run: Path) -> dict | None:
    """The record of a start in ``run`` that never became a run (``record_failed_start``), if any."""
    try:
        return json.loads((run / layout.FAILED_START).read_text())
    except (OSError, ValueError):
        return None


def refuse_foreign(out: Path) -> None:
    """A new run's folder holds nothing but what an interrupted set-up left (removed here, rebuilt
    from the data), or the run is refused before anything is written there."""
    if out.is_dir():
        remove_stray_temps(out)
        foreign = sorted(p.name for p in out.iterdir() if p.name not in layout.SETUP_FILES)
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
    command an earlier start in it was given)."""
    if not opts.model or not opts.data:
        started = failed_start(opts.out)
        raise Refused(
            f"{opts.out} is not {_kind(opts)} yet: a new run needs --model and --data"
            + (f"; it was started with: {started['command']}" if started else "")
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
