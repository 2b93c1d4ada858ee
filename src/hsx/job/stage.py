"""A job, whatever its stage: the one sequence every job runs (``run``, ``session``) and the parts a
stage fills in (``Stage``: extract, generate, and every later stage).

    run(stage, opts, log)
      model       resolved once (``job.model.Model``), handed to every step below
      open        a new run: --model and --data given, its folder empty, the stage's ``create``
                  refusing what cannot start, all before its folder or lock is made; then under the
                  run's lock (let go for the session to take again): the folder checked again, the
                  set-up ``create`` returned (a start that fails in it leaves failed-start.json),
                  the spec saved last;
                  a resume: the stage's spec (by the kind it records), the drift check (``asked``
                  against the spec: refused by name), the stage's ``opened``
      launch      where the rest runs: here, or where ``run``'s ``launch`` puts it (an extraction's executors)
    session(stage, opts, spec, model, log)
      lock        the run's lock, its heartbeat writing the stage's progress (``job.prologue``)
      prologue    stray temps, the model's new location, header scan, the space
      work        the stage's ``work``, verification beside it (``Job.verify``)
      clean stop  a full disk: ``CleanStop`` (exit 3), its words and the space still needed said once
      crash       an error hsx did not expect: recorded in OUT/crash.json, said in one line (``Crashed``),
                  reported by ``hsx status`` until a session completes
      summary     the stage's (``job.resume.Summary`` extended), returned; refusals raise (exit 2)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from hsx import target
from hsx.errors import CertifyFailed, DiskFull, FidelityFailed, HsxError
from hsx.job.folder import (
    LogTail,
    crashed,
    read_failure,
    refuse_drift,
    refuse_foreign,
    remove_stray_temps,
    require_start,
)
from hsx.job.model import Model
from hsx.job.options import JobOptions
from hsx.job.prologue import Prologue, locked
from hsx.job.resume import Summary, Verifier
from hsx.lock import RunLock
from hsx.plan import named_templates, refuse_broken_template
from hsx.progress import Progress
from hsx.spec import JobSpec
from hsx.store import layout

Opts = TypeVar("Opts", bound=JobOptions)
S = TypeVar("S", bound=JobSpec)
R = TypeVar("R", bound=Summary)
Log = Callable[[str], None]
Open = Callable[[Opts], S]  # the run opened with these options (a new one created): its spec
Launch = Callable[[Opts, Open, Model, Log], R]  # where a job runs once opened (``run``'s ``launch``)


@dataclass
class Job(Generic[Opts, S, R]):
    """What a stage's work has, under the run's lock: its options, spec, model, lock, progress,
    plan (anything with ``lengths``) and what the prologue found (``begun``: headers, space, summary)."""

    opts: Opts
    spec: S
    model: Model
    log: Log
    lock: RunLock
    progress: Progress
    plan: Any
    begun: Prologue

    @property
    def run(self) -> Path:
        return self.opts.out

    @property
    def summary(self) -> R:
        return self.begun.summary

    def verify(self) -> Verifier:
        """The digests checked on a thread of their own, beside the work (``job.resume.Verifier``)."""
        return self.begun.verify(self.progress.add_done)


class Stage(ABC, Generic[Opts, S, R]):
    """A stage's own parts of a job; ``run`` and ``session`` call them in the one order every job has."""

    measure_first = False  # its work's disk guard holds the forecast: an unmeasured zstd run may start

    @abstractmethod
    def create(self, opts: Opts, model: Model, log: Log) -> Callable[[], S]:
        """A new run: refuse what cannot start (judged from its options, the model and the data) before its
        folder or lock exists; return the step that, under the lock, writes its plan and rejects (inside
        ``job.folder.setting_up``) and returns its spec, which ``open_run`` saves last."""

    @abstractmethod
    def load(self, run: Path) -> S:
        """The run's spec, refused where it is of another kind."""

    @abstractmethod
    def asked(self, opts: Opts, model: Model, spec: S) -> dict:
        """What a resume of the run of ``spec`` asks for, in its spec's terms (only what the operator gave)."""

    @abstractmethod
    def differences(self, spec: S, asked: dict) -> list[str]:
        """One line per setting asked for that the run does not have."""

    def refuse_model(self, opts: Opts, model: Model) -> None:
        """A new run's model that the stage cannot run, refused by name before anything is written
        (its tokenizer is read next)."""

    def opened(self, opts: Opts, spec: S, log: Log) -> S:
        """After the drift check, before the lock: the spec the job goes on with."""
        return spec

    def lock_command(self, opts: Opts) -> str:
        """What the run's lock says its holder is doing."""
        return opts.COMMAND

    @abstractmethod
    def progress(self, opts: Opts, spec: S) -> Progress:
        """The job's counters; the lock's heartbeat writes their ``metrics``."""

    def locked(self, opts: Opts, spec: S, lock: RunLock, log: Log) -> None:
        """First thing under the lock: what only the lock's holder may check or clear."""

    @abstractmethod
    def plan(self, run: Path, spec: S) -> Any:
        """The run's frozen plan (``lengths``: each sample's tokens)."""

    @abstractmethod
    def summary(self, run: Path, spec: S) -> R:
        """The job's tally, empty."""

    @abstractmethod
    def work(self, job: Job[Opts, S, R]) -> None:
        """The stage's own work, under the lock, after the prologue; a full disk raises ``DiskFull``."""

    def close(self) -> None:
        """Release what the job held (an engine), however it ended."""

    def ended(self, run: Path, spec: S, failure: str | None) -> None:
        """The session's work ended, under the lock: to its end (``failure`` None) or stopped by a
        check of its numbers (``failure``: why). An extraction writes its certificate here."""


def run(stage: Stage[Opts, S, R], opts: Opts, log: Log, launch: Launch | None = None) -> R:
    """The job of ``stage`` on ``opts.out``, a new run or the resume of one, to its end or a clean
    stop: opened, then its session here, or where ``launch`` runs it (an extraction's executors:
    ``launch(opts, open, model, log)`` opens the run when it is ready to). An error hsx did not
    expect is recorded in the run folder and raised as ``Crashed`` (``job.folder.crashed``)."""
    model = Model(opts.model, opts.trust_remote_code)
    log = tail = LogTail(log)

    def opened(o: Opts) -> S:
        return open_run(stage, o, model, log)

    try:
        if launch is None:
            return session(stage, opts, opened(opts), model, log)
        return launch(opts, opened, model, log)
    except HsxError:
        raise
    except Exception as e:
        raise crashed(opts, e, list(tail.lines)) from e
    finally:
        stage.close()


def open_run(stage: Stage[Opts, S, R], opts: Opts, model: Model, log: Log) -> S:
    """The run's spec: created for a new run (saved last: from then on the folder is a run), checked
    against the options for an existing one (invariant 3). Under the run's lock, taken before anything
    is written: two starts in one folder at once take turns (the second finds the first's spec, or its
    lock), so neither overwrites the other's spec or plan (invariant 4). The session takes it again.
    A new run's refusals come before its folder or the lock's guard is made: a refused start writes nothing."""
    setup: Callable[[], S] | None = None
    if not (opts.out / layout.SPEC).exists():
        require_start(opts)
        stage.refuse_model(opts, model)
        # the tokenizer loaded and the template asked for found, or refused by name, before anything is written
        named_templates(model.tokenizer, opts.chat_template)
        refuse_broken_template(model.tokenizer, opts.chat_template)
        refuse_foreign(opts.out)
        setup = stage.create(opts, model, log)
        opts.out.mkdir(parents=True, exist_ok=True)  # where the lock lives; an empty folder is no run
    with RunLock(opts.out, command=stage.lock_command(opts), warn=log):
        if setup is not None and not (opts.out / layout.SPEC).exists():
            remove_stray_temps(opts.out)  # an interrupted set-up's, never a live one's: under the lock
            refuse_foreign(opts.out)  # what another start wrote while this one was judged
            spec = setup()
            spec.save(opts.out)  # last: its presence means the run exists
            target.record_files(opts.out, model.dir)  # the model's files as they stand (model-files.json)
            (opts.out / layout.FAILED_START).unlink(missing_ok=True)  # an earlier start's, in this folder
            return spec
        spec = stage.load(opts.out)
        model.resumes(opts.out, spec)
        refuse_drift(opts, stage.differences(spec, stage.asked(opts, model, spec)))
        return stage.opened(opts, spec, log)


def session(stage: Stage[Opts, S, R], opts: Opts, spec: S, model: Model, log: Log) -> R:
    """Under the run's lock: the prologue, the stage's work (verification beside it), the clean stop
    of a full disk; the stage's summary."""
    progress = stage.progress(opts, spec)
    with locked(opts, progress.metrics, log, stage.lock_command(opts)) as lock:
        stage.locked(opts, spec, lock, log)
        if (crash := read_failure(opts.out, layout.CRASH)) is not None:
            log(f"the last session failed unexpectedly at {crash.at}: {crash.reason}; trying again")
        plan = stage.plan(opts.out, spec)
        summary = stage.summary(opts.out, spec)
        begun = Prologue.open(opts, spec, plan.lengths, summary, log, stage.measure_first)
        try:
            stage.work(Job(opts, spec, model, log, lock, progress, plan, begun))
        except DiskFull as e:  # the guard's reserve reached, or a real ENOSPC: every file whole or absent
            raise begun.clean_stop(summary, e.path, e.reason, e.advice) from e
        except (CertifyFailed, FidelityFailed) as e:  # a check stopped the run: recorded, then said
            stage.ended(opts.out, spec, str(e))
            raise
        stage.ended(opts.out, spec, None)
        (opts.out / layout.CRASH).unlink(missing_ok=True)  # a session completed: an earlier crash is past
        return summary
