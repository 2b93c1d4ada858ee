"""What is on disk, per shard: good, missing, bad (truncated | corrupt | misplaced), stray, foreign.

The cheap check parses every header and compares sizes and ids; ``deep`` also verifies every
digest. Shards are scanned in parallel threads: file reads and hashing release the GIL.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from hsx.store import layout
from hsx.store.durable import is_temp
from hsx.store.format import BadFile, check
from hsx.store.writer import FileRecord, read_seal


@dataclass(frozen=True)
class Problem:
    path: str  # relative to the run folder
    kind: str  # truncated | corrupt | misplaced | stray | foreign
    detail: str
    sample_id: int | None = None  # the id whose slot it occupies, if any


@dataclass
class ShardScan:
    shard: int
    expected: range
    good: dict[int, FileRecord] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    sealed: bool = False  # a SEALED manifest exists and agrees with every file

    @property
    def missing(self) -> list[int]:
        """Ids with no good file (absent or bad): exactly what a resume redoes."""
        return [i for i in self.expected if i not in self.good]

    @property
    def complete(self) -> bool:
        return len(self.good) == len(self.expected)

    @property
    def state(self) -> str:
        if self.sealed:
            return "sealed"
        return "partial" if self.good else "untouched"


def scan_shard(run: Path, shard: int, expected: range, deep: bool) -> ShardScan:
    out = ShardScan(shard, expected)
    folder = layout.shard_dir(run, shard)
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return out
    for name in names:
        path = folder / name
        rel = str(path.relative_to(run))
        if name == layout.SEALED:
            continue
        if is_temp(name):
            out.problems.append(Problem(rel, "stray", "temporary file left by an interrupted write"))
            continue
        sid = layout.parse_sample_name(name)
        if sid is None:
            out.problems.append(Problem(rel, "foreign", "not a file hsx writes"))
            continue
        if sid not in expected:
            out.problems.append(Problem(rel, "misplaced", f"sample {sid} does not belong in shard {shard}"))
            continue
        try:
            header = check(path, sid, deep)
        except BadFile as e:
            out.problems.append(Problem(rel, e.kind, e.detail, sid))
            continue
        except OSError as e:
            out.problems.append(Problem(rel, "corrupt", f"unreadable: {e.strerror}", sid))
            continue
        out.good[sid] = FileRecord(sid, path.stat().st_size, header.digest)
    seal = read_seal(run, shard) if (folder / layout.SEALED).exists() else None
    for sid, rec in list(out.good.items()):  # a valid file that is not the one the seal recorded
        if seal is not None and sid in seal and seal[sid] != rec:
            del out.good[sid]
            rel = str((folder / layout.sample_name(sid)).relative_to(run))
            out.problems.append(Problem(rel, "corrupt", "differs from the shard's SEALED manifest", sid))
    out.sealed = seal is not None and out.complete and seal == out.good
    return out


def scan_run(
    run: Path,
    num_samples: int,
    shard_size: int,
    deep: bool,
    shards: Iterable[int] | None = None,
    threads: int = 8,
    on_shard: Callable[[ShardScan], None] | None = None,
) -> list[ShardScan]:
    """Scan the given shards (default: all of the plan's), in shard order."""
    todo = list(range(layout.num_shards(num_samples, shard_size)) if shards is None else shards)

    def one(shard: int) -> ShardScan:
        result = scan_shard(run, shard, layout.shard_ids(shard, shard_size, num_samples), deep)
        if on_shard is not None:
            on_shard(result)
        return result

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(one, todo))
