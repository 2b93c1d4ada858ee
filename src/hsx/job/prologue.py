"""The resume prologue, written once for every job (an extraction in one process, its scale-out
driver, a generate run): under the run's lock (``locked``: heartbeat and metrics through
telemetry), ``Prologue.open`` removes what a killed process left beside the run's files, records a
``--model`` that matched somewhere new, scans every shard's headers and judges the space the rest
needs (refused when it does not fit); ``verify`` then checks the digests beside the model load and
the work (``job.resume.Verifier``), and ``clean_stop`` turns a full disk into the clean stop that
says how much is done, how much space the rest needs, and the command that resumes (counted here
once, for every executor of every stage).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hsx.errors import CleanStop
from hsx.job.folder import record_model, remove_stray_temps
from hsx.job.options import JobOptions, resume_command
from hsx.job.resume import Summary, Verifier, scan_all
from hsx.job.space import Measured, Space, plan_space, projected_bytes, stored_ratio
from hsx.lock import RunLock
from hsx.spec import JobSpec, RunSpec
from hsx.store.scan import ShardScan, scan_run


@contextmanager
def locked(
    opts: JobOptions, metrics: Callable[[], dict], log: Callable[[str], None], command: str | None = None
) -> Iterator[RunLock]:
    """The run's lock (``command``: what its holder is doing, the job's own by default), its
    heartbeat writing the job's ``metrics`` (``telemetry``)."""
    telemetry = opts.telemetry(metrics)
    with telemetry, RunLock(opts.out, command=command or opts.COMMAND, on_beat=telemetry.beat, warn=log) as lock:
        yield lock


@dataclass
class Prologue:
    """What the prologue found: the job's tally (``summary``), every shard's header scan
    (``headers``: what the space counts, and which shards hold nothing good yet) and the space
    verdict (``space``: the reserve and the forecast the job's disk guard uses)."""

    opts: JobOptions
    spec: JobSpec
    lengths: np.ndarray  # the plan's tokens per sample
    summary: Summary
    headers: list[ShardScan]
    space: Space

    @classmethod
    def open(
        cls,
        opts: JobOptions,
        spec: JobSpec,
        lengths: np.ndarray,
        summary: Summary,
        log: Callable[[str], None],
        measure_first: bool = False,
    ) -> Prologue:
        """Under the run's lock; ``summary``: the job's tally, which verification settles into.
        ``measure_first``: the job's guard holds the forecast, so an unmeasured zstd run that does not
        fit at raw size starts (``job.space.plan_space``)."""
        run = opts.out
        remove_stray_temps(run)
        record_model(opts, spec, log)  # a --model that matched, somewhere new
        headers = scan_all(run, spec, deep=False)  # seconds: sealed shards are trusted by their listing
        space = plan_space(
            run, spec, lengths, headers, opts.allow_partial, opts.reserve_bytes, log, measure_first, opts.COMMAND
        )
        return cls(opts, spec, lengths, summary, headers, space)

    def verify(self, add_done: Callable[[int, int], None]) -> Verifier:
        """The digests (or, with ``--fast-verify``, the headers) checked on a thread of their own;
        ``add_done`` is told each shard's good files and their tokens (the progress count)."""
        lengths = self.lengths

        def done(scan: ShardScan) -> None:
            add_done(len(scan.good), int(lengths[list(scan.good)].sum()) if scan.good else 0)

        streamed = isinstance(self.spec, RunSpec) and self.spec.window is not None  # shards in a trainer's order
        return Verifier(
            self.opts.out, self.spec, self.headers, self.opts.deep_verify, self.summary, done, streamed
        ).start()

    def clean_stop(
        self, summary: object, path: Path, reason: str | None = None, advice: str = "Free space"
    ) -> CleanStop:
        """The clean stop of a full disk (the guard's reserve reached, or a real ENOSPC), wherever the
        work ran (this process, a tensor-parallel group's rank 0, a scale-out worker): ``summary`` the
        job's. The space the rest still needs is counted here alone, from the files on disk now (their
        headers: seconds), at the codec's ratio they measure."""
        spec, lengths = self.spec, self.lengths
        fp = spec.footprint()
        scans = scan_run(self.opts.out, spec.plan.num_samples, spec.shard_size, deep=False, want=fp.files)
        missing = np.asarray([i for s in scans for i in s.missing], dtype=np.int64)
        ratio = stored_ratio(spec, Measured.on_disk(spec, lengths, scans))
        needed = projected_bytes(int(lengths[missing].sum()), len(missing), fp.bytes_per_token, ratio)
        resume = resume_command(self.opts.out, None, self.opts.COMMAND)
        return CleanStop(summary, needed, path, reason, resume, self.opts.UNIT, advice)
