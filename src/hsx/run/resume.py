"""The one resume prologue: verify what is on disk, tidy what a crash left, settle finished shards.

Used the same way by the local job, the scale-out driver and its workers, and the vLLM path, so
"done" means the same everywhere: a sample is done only when its file verified (invariant 2);
stray temp files are removed, misplaced or foreign files are moved aside (never deleted), and a
shard whose every id verified is sealed. Nothing is written into a shard before its own scan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hsx.errors import Damage
from hsx.progress import Progress
from hsx.spec import RunSpec
from hsx.store import layout
from hsx.store.quarantine import quarantine
from hsx.store.scan import Problem, ShardScan, scan_run, scan_shard
from hsx.store.writer import seal


@dataclass
class Summary:
    """What a job did: the run's totals, what was already verified, what this session wrote."""

    run: Path
    total_samples: int
    total_tokens: int
    already_done: int
    written: int = 0
    tokens_written: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    rejected: int = 0
    redone: dict[str, int] = field(default_factory=dict)
    stray_removed: int = 0
    quarantined: int = 0
    waited_for_disk: float = 0.0  # seconds the forward pass waited for writes: > a few % means the disk is the limit

    @classmethod
    def of(cls, run: Path, spec: RunSpec) -> Summary:
        return cls(run, spec.plan.num_samples, spec.plan.num_tokens, 0, rejected=spec.plan.num_rejected)

    @property
    def done(self) -> int:
        return self.already_done + self.written

    @property
    def complete(self) -> bool:
        return self.done == self.total_samples

    def add(self, other: Summary) -> None:
        """Fold a worker's tally of its shards into the job's."""
        self.already_done += other.already_done
        self.written += other.written
        self.tokens_written += other.tokens_written
        self.bytes_written += other.bytes_written
        self.stray_removed += other.stray_removed
        self.quarantined += other.quarantined
        for kind, n in other.redone.items():
            self.redone[kind] = self.redone.get(kind, 0) + n


def tidy(run: Path, problems: list[Problem], summary: Summary) -> None:
    """Remove stray temp files; move files that are not where they belong aside, never delete them."""
    for p in problems:
        if p.kind == Damage.STRAY:
            (run / p.path).unlink(missing_ok=True)
            summary.stray_removed += 1
        elif p.kind in (Damage.MISPLACED, Damage.FOREIGN) and p.sample_id is None:
            quarantine(run, p)
            summary.quarantined += 1
        elif p.sample_id is not None:
            summary.redone[p.kind] = summary.redone.get(p.kind, 0) + 1


def settle(run: Path, scan: ShardScan, summary: Summary) -> ShardScan:
    """After a shard's scan: tidy it, count its good files as done, seal it if every id verified."""
    tidy(run, scan.problems, summary)
    summary.already_done += len(scan.good)
    if scan.complete and not scan.sealed:
        seal(run, scan.shard, list(scan.good.values()))
    return scan


def verify_shard(run: Path, spec: RunSpec, shard: int, deep: bool, summary: Summary) -> ShardScan:
    """Scan and settle one shard (a scale-out worker's first step on each shard it is handed)."""
    ids = layout.shard_ids(shard, spec.shard_size, spec.plan.num_samples)
    scan = scan_shard(run, shard, ids, deep, codec=spec.codec)
    return settle(run, scan, summary)


def scan_all(run: Path, spec: RunSpec, deep: bool) -> list[ShardScan]:
    """Every shard's scan (with a progress bar); an empty run costs no reads at all."""
    n = layout.num_shards(spec.plan.num_samples, spec.shard_size)
    shards_dir = run / layout.SHARDS
    if not shards_dir.exists() or not any(shards_dir.iterdir()):
        return [ShardScan(s, layout.shard_ids(s, spec.shard_size, spec.plan.num_samples)) for s in range(n)]
    with Progress.simple(f"verifying ({'digests' if deep else 'headers'})", n) as bar:
        return scan_run(
            run, spec.plan.num_samples, spec.shard_size, deep, on_shard=lambda _: bar.advance(), codec=spec.codec
        )


def verify_all(run: Path, spec: RunSpec, deep: bool, summary: Summary) -> list[ShardScan]:
    """Scan and settle every shard; returns the scans, sealed and not."""
    return [settle(run, s, summary) for s in scan_all(run, spec, deep)]
