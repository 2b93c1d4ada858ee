"""Integrity of the files on disk: the store's scan, plus what only the SEALED manifests reveal.

The cheap check parses every header, compares sizes and ids, except for the files of sealed shards
that the listing shows unchanged since sealing: those are good by their manifest, unopened.
``deep`` verifies every digest, reading files in parallel at the disk's rate, and says the rate.
On top of the store's kinds (truncated, corrupt, misplaced, stray, foreign) this adds ``missing``
(a sealed shard lost a file); a file that differs from its manifest is one of the store's corrupt.
While an extractor is alive its temp files are writes in flight, not strays, and are not counted.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hsx.assess.checks import Check
from hsx.errors import Damage
from hsx.lock import writer_noun
from hsx.progress import Progress
from hsx.spec import JobSpec
from hsx.store import layout
from hsx.store.scan import Problem, ShardScan, scan_run
from hsx.units import size

# what each kind means for the sample it concerns; all of them are redone by ``hsx extract``
MEANING = {
    Damage.TRUNCATED: "shorter than its header says (interrupted write or copy)",
    Damage.CORRUPT: "header unreadable, sizes inconsistent, digest mismatch or not the file sealed",
    Damage.MISPLACED: "a sample file under the wrong name or shard",
    Damage.STRAY: "temporary file left by an interrupted write",
    Damage.FOREIGN: "not a file hsx writes",
    Damage.MISSING: "listed in the shard's SEALED manifest but absent",
    Damage.RECORD: "the run's record of a shard (sealed/, consumed/) missing, truncated, garbled or another run's",
}
LOST = f"sealed once (the run's record: {layout.SEALS}/), now absent with its shard's SEALED manifest"


@dataclass
class Integrity:
    deep: bool
    scans: list[ShardScan]
    problems: list[Problem] = field(default_factory=list)
    in_flight: list[Problem] = field(default_factory=list)  # temp files of a live extractor
    seconds: float = 0.0  # the scan's wall time

    @property
    def files_good(self) -> int:
        return sum(len(s.good) for s in self.scans)

    @property
    def files_opened(self) -> int:
        return sum(s.opened for s in self.scans)

    @property
    def files_trusted(self) -> int:
        """Good by their SEALED manifest and the listing, never opened."""
        return sum(s.trusted for s in self.scans)

    @property
    def bytes_read(self) -> int:
        return sum(s.bytes_read for s in self.scans)

    @property
    def read_rate(self) -> float:
        """Bytes per second the scan read (the disk's rate when the check was deep)."""
        return self.bytes_read / self.seconds if self.seconds else 0.0

    def counts(self) -> dict[str, int]:
        return dict(sorted(Counter(p.kind for p in self.problems).items()))


def _seal_problems(run: Path, scan: ShardScan) -> list[Problem]:
    """What the scan's SEALED manifest says beyond the files: it is unreadable, or lists a file that is gone."""
    folder = layout.shard_dir(run, scan.shard)
    if scan.manifest_unreadable:
        return [
            Problem(
                str((folder / layout.SEALED).relative_to(run)),
                Damage.CORRUPT,
                "SEALED manifest unreadable or another run's",
            )
        ]
    why = MEANING[Damage.MISSING] if scan.manifest is not None else LOST
    return [
        Problem(str((folder / layout.sample_name(sid)).relative_to(run)), Damage.MISSING, why, sid) for sid in scan.gone
    ]


def inspect(run: Path, spec: JobSpec, deep: bool, writer_alive: bool, threads: int | None = None) -> Integrity:
    """``threads``: parallel readers (None: the store's default for this machine)."""
    num_samples, shard_size = spec.plan.num_samples, spec.shard_size
    n = layout.num_shards(num_samples, shard_size)
    what = "verifying digests" if deep else "checking headers"
    t0 = time.perf_counter()
    with Progress.simple(what, n) as bar:
        scans = scan_run(
            run,
            num_samples,
            shard_size,
            deep,
            threads=threads,
            on_shard=lambda _: bar.advance(),
            want=spec.footprint().files,
        )
    result = Integrity(deep, scans, seconds=time.perf_counter() - t0)
    for s in scans:
        for p in s.problems:
            (result.in_flight if writer_alive and p.kind == Damage.STRAY else result.problems).append(p)
        result.problems += _seal_problems(run, s)
    result.problems += _outside_shards(run, num_samples, shard_size)
    return result


def _outside_shards(run: Path, num_samples: int, shard_size: int) -> list[Problem]:
    """Shard folders past the plan's end (e.g. from a run with another plan copied in)."""
    root = run / layout.SHARDS
    if not root.is_dir():
        return []
    n = layout.num_shards(num_samples, shard_size)
    out = []
    for d in sorted(root.iterdir()):
        if d.name.isdigit() and len(d.name) == 6 and int(d.name) < n:
            continue
        for f in sorted(p for p in d.rglob("*") if p.is_file()) if d.is_dir() else [d]:
            out.append(Problem(str(f.relative_to(run)), Damage.FOREIGN, "outside the plan's shards"))
    return out


def check(result: Integrity, limit: int = 8, command: str = "extract") -> Check:
    """The integrity line; every problem is listed in --json, the first ``limit`` of each kind in text.
    ``command``: what redoes them (``generate`` for a generate run)."""
    if result.deep:
        mode = (
            f"digests verified: {size(result.bytes_read)} read in {result.seconds:.1f} s "
            f"({result.read_rate / 1e9:.2f} GB/s)"
        )
    else:
        mode = "headers and sizes checked (--deep verifies digests)"
        if result.files_trusted:
            mode = (
                f"headers and sizes checked, {result.files_trusted:,} unchanged since sealing (--deep verifies digests)"
            )
    counts = result.counts()
    data = {
        "deep": result.deep,
        "files_good": result.files_good,
        "files_opened": result.files_opened,
        "files_trusted": result.files_trusted,
        "bytes_read": result.bytes_read,
        "seconds": round(result.seconds, 3),
        "read_rate_gbps": round(result.read_rate / 1e9, 3),
        "problems": counts,
        "files": [
            {"path": p.path, "kind": p.kind, "detail": p.detail, "sample_id": p.sample_id} for p in result.problems
        ],
        "in_flight": [p.path for p in result.in_flight],
    }
    details = []
    if result.in_flight:
        details.append(f"{len(result.in_flight)} temp files are writes in flight of the live {writer_noun(command)}")
    if not counts:
        return Check("integrity", "ok", f"{result.files_good:,} files good, {mode}", details=details, data=data)
    for kind in counts:
        items = [p for p in result.problems if p.kind == kind]
        if kind == Damage.MISSING:  # data that existed, verified, now gone: lost, named by shard
            by_shard = Counter(Path(p.path).parent.name for p in items)
            details += [f"lost: shard {s}: {n} sealed samples are gone" for s, n in sorted(by_shard.items())]
        for p in items[:limit]:
            details.append(f"{kind}: {p.path} ({p.detail})")
        if len(items) > limit:
            details.append(f"{kind}: ... and {len(items) - limit} more (--json lists all)")
    summary = ", ".join(f"{n} {k}" for k, n in counts.items())
    return Check(
        "integrity",
        "fail",
        f"{summary}; {result.files_good:,} files good, {mode}",
        details=details,
        action=f"hsx {command} redoes these samples by itself (hsx verify --repair first moves bad files aside)",
        redo=True,
        data=data,
    )
