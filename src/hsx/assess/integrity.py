"""Integrity of the files on disk: the store's scan, plus what only the SEALED manifests reveal.

The cheap check parses every header, compares sizes and ids; ``deep`` verifies every digest, in
parallel threads (reads and hashing release the GIL), so it runs at disk speed. On top of the
store's kinds (truncated, corrupt, misplaced, stray, foreign) this adds ``missing`` (a sealed shard
lost a file) and ``unsealed`` (a file differs from its shard's manifest: replaced after sealing).
While an extractor is alive its temp files are writes in flight, not strays, and are not counted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hsx.assess.checks import Check
from hsx.progress import Progress
from hsx.store import layout
from hsx.store.scan import Problem, ShardScan, scan_run
from hsx.store.writer import read_seal

# what each kind means for the sample it concerns; all of them are redone by ``hsx extract``
MEANING = {
    "truncated": "shorter than its header says (interrupted write or copy)",
    "corrupt": "header unreadable, sizes inconsistent or digest mismatch",
    "misplaced": "a sample file under the wrong name or shard",
    "stray": "temporary file left by an interrupted write",
    "foreign": "not a file hsx writes",
    "missing": "listed in the shard's SEALED manifest but absent",
    "unsealed": "differs from the shard's SEALED manifest (replaced after sealing)",
}


@dataclass
class Integrity:
    deep: bool
    scans: list[ShardScan]
    problems: list[Problem] = field(default_factory=list)
    in_flight: list[Problem] = field(default_factory=list)  # temp files of a live extractor

    @property
    def files_good(self) -> int:
        return sum(len(s.good) for s in self.scans)

    def counts(self) -> dict[str, int]:
        return dict(sorted(Counter(p.kind for p in self.problems).items()))


def _seal_problems(run: Path, scan: ShardScan) -> list[Problem]:
    folder = layout.shard_dir(run, scan.shard)
    seal_path = folder / layout.SEALED
    if not seal_path.exists():
        return []
    rel = str(seal_path.relative_to(run))
    seal = read_seal(run, scan.shard)
    if seal is None:
        return [Problem(rel, "corrupt", "SEALED manifest unreadable")]
    flagged = {p.sample_id for p in scan.problems if p.sample_id is not None}
    out = []
    for sid, rec in sorted(seal.items()):
        path = str((folder / layout.sample_name(sid)).relative_to(run))
        if sid not in scan.good:
            if sid not in flagged:
                out.append(Problem(path, "missing", MEANING["missing"], sid))
        elif scan.good[sid] != rec:
            out.append(Problem(path, "unsealed", MEANING["unsealed"], sid))
    return out


def inspect(
    run: Path, num_samples: int, shard_size: int, deep: bool, writer_alive: bool, threads: int = 8
) -> Integrity:
    n = layout.num_shards(num_samples, shard_size)
    what = "verifying digests" if deep else "checking headers"
    with Progress.simple(what, n) as bar:
        scans = scan_run(run, num_samples, shard_size, deep, threads=threads, on_shard=lambda _: bar.advance())
    result = Integrity(deep, scans)
    for s in scans:
        for p in s.problems:
            (result.in_flight if writer_alive and p.kind == "stray" else result.problems).append(p)
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
            out.append(Problem(str(f.relative_to(run)), "foreign", "outside the plan's shards"))
    return out


def check(result: Integrity, limit: int = 8) -> Check:
    """The integrity line; every problem is listed in --json, the first ``limit`` of each kind in text."""
    mode = "digests verified" if result.deep else "headers and sizes checked (--deep verifies digests)"
    counts = result.counts()
    data = {
        "deep": result.deep,
        "files_good": result.files_good,
        "problems": counts,
        "files": [
            {"path": p.path, "kind": p.kind, "detail": p.detail, "sample_id": p.sample_id} for p in result.problems
        ],
        "in_flight": [p.path for p in result.in_flight],
    }
    details = []
    if result.in_flight:
        details.append(f"{len(result.in_flight)} temp files are writes in flight of the live extractor")
    if not counts:
        return Check("integrity", "ok", f"{result.files_good:,} files good, {mode}", details=details, data=data)
    for kind in counts:
        items = [p for p in result.problems if p.kind == kind]
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
        action="hsx extract redoes these samples by itself (hsx verify --repair first moves bad files aside)",
        redo=True,
        data=data,
    )
