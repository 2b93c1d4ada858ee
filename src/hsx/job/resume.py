"""Verify what is on disk, tidy what a crash left, settle finished shards: the resume of every job.

Used the same way by the extraction (its local job, the scale-out driver and its workers, the vLLM
path) and the generate job, so "done" means the same everywhere: a sample is done only when its file
verified (invariant 2); stray temp files are removed, misplaced or foreign files are moved aside
(never deleted), and a shard whose every id verified is sealed. Nothing is written into a shard
before its own scan.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hsx.errors import Damage
from hsx.progress import Progress
from hsx.spec import JobSpec
from hsx.store import layout
from hsx.store.quarantine import quarantine
from hsx.store.scan import Problem, ShardScan, scan_run, scan_shard
from hsx.store.writer import seal


@dataclass
class Summary:
    """What a job did, whatever its stage: the run's size, what was already verified, what this
    session wrote and repaired. Each stage extends it with its own figures (``extract.summary``,
    ``generate.job``) and says it in its own words (``lines``); the prologue and the resume's
    settling fill in what every job shares."""

    run: Path
    total_samples: int
    already_done: int = 0
    written: int = 0
    seconds: float = 0.0
    redone: dict[str, int] = field(default_factory=dict)
    stray_removed: int = 0
    quarantined: int = 0
    verified: Verified | None = None  # what the resume's verification read, and whether the work waited for it

    @property
    def done(self) -> int:
        return self.already_done + self.written

    @property
    def complete(self) -> bool:
        return self.done == self.total_samples

    def lines(self) -> list[str]:
        """What the job did: the stage's own lines between the run's and the repairs'."""
        head = f"run        {self.run}  ({'complete' if self.complete else 'incomplete'})"
        tail = []
        if self.redone:
            tail.append("redone     " + ", ".join(f"{n} {k}" for k, n in sorted(self.redone.items())))
        if self.stray_removed or self.quarantined:
            tail.append(
                f"cleaned    {self.stray_removed} stray temp files removed, {self.quarantined} files quarantined"
            )
        return [head, *self.own_lines(), *tail]

    def own_lines(self) -> list[str]:
        """The stage's figures, in its words."""
        return []

    def add(self, other: Summary) -> None:
        """Fold the tally of another process's part of the job (a worker's shard) into this one."""
        self.already_done += other.already_done
        self.written += other.written
        self.stray_removed += other.stray_removed
        self.quarantined += other.quarantined
        for kind, n in other.redone.items():
            self.redone[kind] = self.redone.get(kind, 0) + n


def tidy(run: Path, problems: list[Problem], summary: Summary) -> None:
    """Remove stray temp files; move files that are not where they belong aside (another run's
    file in a sample's place too), never delete them."""
    for p in problems:
        if p.kind == Damage.STRAY:
            (run / p.path).unlink(missing_ok=True)
            summary.stray_removed += 1
        elif p.kind == Damage.FOREIGN or (p.kind == Damage.MISPLACED and p.sample_id is None):
            quarantine(run, p)
            summary.quarantined += 1
        if p.sample_id is not None and p.kind != Damage.STRAY:
            summary.redone[p.kind] = summary.redone.get(p.kind, 0) + 1


def settle(run: Path, scan: ShardScan, summary: Summary) -> ShardScan:
    """After a shard's scan: tidy it, count its good files as done (and as redone those its seal
    lists that are gone), seal it if every id verified. A damaged record of the shard is rebuilt
    from its files: sealed again (the SEALED manifest and the run's record); a damaged record of
    files consumed, whose samples count as missing (redone), is moved aside."""
    tidy(run, scan.problems, summary)
    if scan.gone:
        summary.redone[Damage.MISSING] = summary.redone.get(Damage.MISSING, 0) + len(scan.gone)
    summary.already_done += len(scan.accounted)  # consumed samples are done, gone on purpose
    damaged = [p for p in scan.problems if p.kind == Damage.RECORD]
    for p in damaged:  # its samples count as missing, redone now: the record is moved aside, kept
        if Path(p.path).parent.name == layout.CONSUMED:
            quarantine(run, p)
    if scan.complete and (not scan.sealed or damaged):
        seal(run, scan.shard, list(scan.accounted.values()))  # consumed files as their record has them
    return scan


def verify_shard(run: Path, spec: JobSpec, shard: int, deep: bool, summary: Summary) -> ShardScan:
    """Scan and settle one shard (a scale-out worker's first step on each shard it is handed)."""
    ids = layout.shard_ids(shard, spec.shard_size, spec.plan.num_samples)
    scan = scan_shard(run, shard, ids, deep, want=spec.footprint().files)
    return settle(run, scan, summary)


def scan_all(run: Path, spec: JobSpec, deep: bool) -> list[ShardScan]:
    """Every shard's scan (with a progress bar); an empty run costs no reads at all."""
    n = layout.num_shards(spec.plan.num_samples, spec.shard_size)
    shards_dir = run / layout.SHARDS
    if not shards_dir.exists() or not any(shards_dir.iterdir()):
        return [ShardScan(s, layout.shard_ids(s, spec.shard_size, spec.plan.num_samples)) for s in range(n)]
    with Progress.simple(f"verifying ({'digests' if deep else 'headers'})", n) as bar:
        return scan_run(
            run,
            spec.plan.num_samples,
            spec.shard_size,
            deep,
            on_shard=lambda _: bar.advance(),
            want=spec.footprint().files,
        )


@dataclass
class Verified:
    """What the resume's verification did: for the summary and the log."""

    files: int = 0  # files opened (the others were trusted by their shard's seal)
    bytes: int = 0  # bytes read
    seconds: float = 0.0  # from its start to its last shard
    waited: float = 0.0  # seconds the extractor, model loaded, stood waiting for a shard's scan

    @property
    def rate(self) -> float:
        return self.bytes / self.seconds if self.seconds else 0.0

    def metrics(self) -> dict:
        """Its figures under metrics.json's names."""
        return {
            "verify_files": self.files,
            "verify_bytes": self.bytes,
            "verify_seconds": self.seconds,
            "verify_waited_s": self.waited,
        }


class _Stopped(Exception):
    pass


class Verifier:
    """The resume's verification, beside the model load and the extraction (invariants 2 and 7 hold:
    a shard is handed out only once its own scan is done and settled, and only once).

    ``first`` is the header-only scan every resume starts with (``scan_all(deep=False)``): it is what
    the space projection counts, and it tells which shards hold nothing good yet. With ``deep``, a
    thread re-reads every file's digest, those shards first (their scans are cheap: nothing to hash),
    then the rest in shard order; without, ``first`` is settled as it is. ``in_order``: every shard in
    shard order, as a trainer streams them (a run with a ``--window``: the shard a consumer waits on
    is finished first, never after shards no one reads yet). ``todo`` yields the settled scans that
    still miss samples, as they come, and ``done`` is called with each shard's good files (the
    progress count)."""

    def __init__(
        self,
        run: Path,
        spec: JobSpec,
        first: list[ShardScan],
        deep: bool,
        summary: Summary,
        done: Callable[[ShardScan], None] = lambda scan: None,
        in_order: bool = False,
    ):
        self.run, self.spec, self.first, self.deep, self.summary, self.done = run, spec, first, deep, summary, done
        self.in_order = in_order
        self.stats = Verified()
        self._queue: queue.Queue = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._verify, name="hsx-verify", daemon=True)

    def start(self) -> Verifier:
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def _settled(self, scan: ShardScan) -> None:
        if self._stopping.is_set():
            raise _Stopped
        settle(self.run, scan, self.summary)
        self.stats.files += scan.opened
        self.stats.bytes += scan.bytes_read
        self.stats.seconds = time.perf_counter() - self._t0
        self.done(scan)
        if not scan.complete:
            self._queue.put(scan)

    def _verify(self) -> None:
        try:
            if not self.deep:
                for scan in self.first:
                    self._settled(scan)
                return
            # nothing good yet first (no digests to read), then partial shards, then complete ones
            first = (lambda s: s.shard) if self.in_order else (lambda s: (bool(s.good), s.complete, s.shard))
            order = sorted(self.first, key=first)
            scan_run(
                self.run,
                self.spec.plan.num_samples,
                self.spec.shard_size,
                deep=True,
                shards=[s.shard for s in order],
                on_shard=self._settled,
                want=self.spec.footprint().files,
            )
        except _Stopped:
            pass
        except BaseException as e:  # handed to whoever waits on ``todo``
            self._queue.put(e)
        finally:
            self._queue.put(None)

    def stop(self) -> None:
        """Settle no further shard and wait for the thread: nothing is written once the job leaves."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()

    def todo(self, extracting: bool = True) -> Iterator[ShardScan]:
        """The shards that miss samples, each once its scan is settled; raises what verification
        raised. ``extracting``: the caller is the extraction (its waits are counted)."""
        while True:
            t0 = time.perf_counter()
            item = self._queue.get()
            if extracting:
                self.stats.waited += time.perf_counter() - t0
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def rest(self) -> list[ShardScan]:
        """Wait for the whole verification (no model loaded: nothing waits for it); the shards that miss samples."""
        return list(self.todo(extracting=False))
