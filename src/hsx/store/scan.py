"""What is on disk, per shard: good, missing, bad (truncated | corrupt | misplaced), stray, foreign.

The cheap check parses every header and compares sizes and ids; ``deep`` also verifies every
digest. On a sealed shard the cheap check trusts the SEALED manifest for every file the directory
listing shows unchanged since sealing (same size and mtime), without opening it, so status on a
finished run costs a listing, not a read per file; any other file is checked as above. The deep
check opens and hashes every file, always.

Files, not shards, are what runs in parallel (``Readers``): a pool of reader threads hashes the
large files of several shards at once, each reading large sequential chunks into a buffer of its
own (memory stays at threads x CHUNK); reads and xxh3 release the GIL, so a deep check keeps the
disk busy even on a single shard of large files. Small files go in batches to two threads: their
cost is Python's per-file work under the GIL, which more threads only slow down by contending.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from hsx.errors import Damage, RecordDamaged
from hsx.store import layout
from hsx.store.durable import is_temp
from hsx.store.format import BadFile, Expected, check, digest_text
from hsx.store.writer import FileRecord, read_consumed, read_seal, sealed_ids

CHUNK = 1 << 20  # one read: big sequential requests, yet hashed while still in the CPU's cache
BATCH_FILES = 64  # files smaller than CHUNK are checked in batches of up to this many (and CHUNK bytes)
SMALL_THREADS = 2


def default_threads() -> int:
    """Readers: enough reads in flight to fill an NVMe queue, more where there are cores to hash."""
    return max(8, min(32, 2 * (os.cpu_count() or 4)))


class Readers:
    """The scan's thread pools: ``threads`` readers for files of CHUNK bytes or more (the disk's
    work), ``SMALL_THREADS`` for batches of smaller files and for header-only checks."""

    def __init__(self, threads: int | None = None):
        self.large = ThreadPoolExecutor(threads or default_threads(), thread_name_prefix="hsx-read")
        self.small = ThreadPoolExecutor(SMALL_THREADS, thread_name_prefix="hsx-check")

    def submit(self, batch: list[tuple[Path, int, str]], deep: bool, nbytes: int, want: Expected | None) -> Future:
        pool = self.large if deep and nbytes >= CHUNK else self.small
        return pool.submit(_check_batch, batch, deep, want)

    def __enter__(self) -> Readers:
        return self

    def __exit__(self, *exc) -> None:
        cancel = exc[0] is not None  # an abandoned scan: reads not started are dropped
        self.large.shutdown(cancel_futures=cancel)
        self.small.shutdown(cancel_futures=cancel)


@dataclass(frozen=True)
class Problem:
    path: str  # relative to the run folder
    kind: Damage
    detail: str
    sample_id: int | None = None  # the id whose slot it occupies, if any


@dataclass
class ShardScan:
    shard: int
    expected: range
    good: dict[int, FileRecord] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    sealed: bool = False  # a SEALED manifest exists and agrees with every file
    manifest: dict[int, FileRecord] | None = None  # the SEALED manifest as read, if readable
    manifest_unreadable: bool = False  # a SEALED file is there but does not parse
    consumed: dict[int, FileRecord] = field(default_factory=dict)  # deleted once released (writer.read_consumed)
    recorded: range = range(0)  # the ids the run's own record says it sealed here (``writer.sealed_ids``)
    opened: int = 0  # sample files opened and checked
    trusted: int = 0  # good by the manifest and the listing alone, unopened
    bytes_read: int = 0

    @property
    def missing(self) -> list[int]:
        """Ids with no good file (absent or bad) that were not consumed: exactly what a resume redoes."""
        return [i for i in self.expected if i not in self.good and i not in self.consumed]

    @property
    def gone(self) -> list[int]:
        """Ids that were sealed whose file is absent (not bad, not consumed: gone): data lost, where
        the ids not yet written are only missing. The SEALED manifest lists them, or, where it is gone
        with them (the folder deleted whole), the run's own record of the seal."""
        flagged = {p.sample_id for p in self.problems if p.sample_id is not None}
        listed = sorted(self.manifest or {}) if self.manifest is not None else self.recorded
        return [sid for sid in listed if sid not in self.good and sid not in flagged and sid not in self.consumed]

    @property
    def accounted(self) -> dict[int, FileRecord]:
        """Every id done: a good file, or one consumed (deleted once released)."""
        return {i: r for i, r in self.consumed.items() if i in self.expected} | self.good

    @property
    def complete(self) -> bool:
        return len(self.accounted) == len(self.expected)

    @property
    def state(self) -> str:
        if self.sealed:
            return "sealed"
        return "partial" if self.good else "untouched"


_local = threading.local()


def _buffer() -> memoryview:
    """This thread's read buffer, made once: no allocation per chunk."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = memoryview(bytearray(CHUNK))
    return buf


def _hash(path: Path, start: int, end: int) -> str:
    """The digest of bytes [start, end); raises ``BadFile`` when the file is not ``end`` bytes long any more."""
    buf, h, pos = _buffer(), xxhash.xxh3_128(), start
    fd = os.open(path, os.O_RDONLY)  # plain fd reads: few syscalls, each one releases the GIL
    try:
        if end - start > CHUNK:  # a larger read-ahead window for the one pass over it
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while pos <= end:
            want = min(CHUNK, end + 1 - pos)  # one byte past the end: a short read proves the end
            n = os.preadv(fd, [buf[:want]], pos)
            h.update(buf[:n])
            pos += n
            if n < want:
                break
    finally:
        os.close(fd)
    if pos != end:
        raise BadFile(Damage.TRUNCATED if pos < end else Damage.CORRUPT, "changed size while being read")
    return digest_text(h)


def _check_batch(
    batch: list[tuple[Path, int, str]], deep: bool, want: Expected | None
) -> list[tuple[str, FileRecord | Problem, int]]:
    """Check (path, id, relative path) in turn: each one's record, or its problem, and the bytes read.
    ``want``: what the run's files hold (codec, layers, final state, dtype: ``format.Expected``);
    a valid file that holds other is not this run's sample (a run never mixes them)."""
    out: list[tuple[str, FileRecord | Problem, int]] = []
    for path, sid, rel in batch:
        read = 0
        try:
            header = check(path, sid, deep=False, expected=want)
            read = size = header.data_start + header.data_size
            if not deep:
                read = header.data_start
            elif _hash(path, header.data_start, size) != header.digest:
                raise BadFile(Damage.CORRUPT, "digest mismatch")
            out.append((rel, FileRecord(sid, size, header.digest, fidelity=header.fidelity), read))
        except BadFile as e:
            out.append((rel, Problem(rel, e.kind, e.detail, sid), read))
        except OSError as e:
            out.append((rel, Problem(rel, Damage.CORRUPT, f"unreadable: {e.strerror}", sid), read))
    return out


def _unchanged(entry: os.DirEntry, rec: FileRecord) -> bool:
    """The listing shows the file exactly as sealed: a regular file of its size and mtime."""
    if rec.mtime_ns is None:
        return False
    try:
        st = entry.stat()
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == rec.size and st.st_mtime_ns == rec.mtime_ns


def _size(entry: os.DirEntry) -> int:
    try:
        return entry.stat().st_size
    except OSError:
        return 0


def scan_shard(
    run: Path, shard: int, expected: range, deep: bool, readers: Readers | None = None, want: Expected | None = None
) -> ShardScan:
    """One shard; its files are checked on ``readers`` (pools of its own when None). ``want``:
    the run's (None: any)."""
    if readers is None:
        with Readers() as own:
            return scan_shard(run, shard, expected, deep, own, want)
    return _collect(*_list(run, shard, expected, deep, readers, want))


def _list(
    run: Path, shard: int, expected: range, deep: bool, readers: Readers, want: Expected | None
) -> tuple[ShardScan, list[Future]]:
    """Classify the shard's listing; files that need opening are queued to ``readers``, in batches."""
    out = ShardScan(shard, expected)
    folder = layout.shard_dir(run, shard)
    try:
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
    except FileNotFoundError:
        entries = []
    if any(e.name == layout.SEALED for e in entries):
        out.manifest = read_seal(run, shard)
        out.manifest_unreadable = out.manifest is None
    _records(run, out)
    if not entries:
        return out, []
    seal = out.manifest or {}
    prefix = str(folder.relative_to(run))
    batches: list[Future] = []
    batch: list[tuple[Path, int, str]] = []
    batch_bytes = 0
    for e in entries:
        if e.name == layout.SEALED:
            continue
        sid = layout.parse_sample_name(e.name)
        if sid is not None and sid in expected:
            rec = seal.get(sid)
            if not deep and rec is not None and _unchanged(e, rec):
                out.good[sid] = rec
                out.trusted += 1
                continue
        rel = os.path.join(prefix, e.name)
        if is_temp(e.name):
            out.problems.append(Problem(rel, Damage.STRAY, "temporary file left by an interrupted write"))
            continue
        if sid is None:
            out.problems.append(Problem(rel, Damage.FOREIGN, "not a file hsx writes"))
            continue
        if sid not in expected:
            out.problems.append(Problem(rel, Damage.MISPLACED, f"sample {sid} does not belong in shard {shard}"))
            continue
        batch.append((Path(e.path), sid, rel))
        batch_bytes += _size(e) if deep else 0
        if len(batch) >= BATCH_FILES or batch_bytes >= CHUNK:
            batches.append(readers.submit(batch, deep, batch_bytes, want))
            batch, batch_bytes = [], 0
    if batch:
        batches.append(readers.submit(batch, deep, batch_bytes, want))
    return out, batches


def _records(run: Path, out: ShardScan) -> None:
    """The run's own records of the shard (``store.records``): the files consumed, and that it sealed
    the shard. A damaged one is a problem named (``Damage.RECORD``), never trusted nor read as none:
    a damaged record of files consumed counts them missing (redone), never lost nor done."""
    shard = out.shard
    try:
        out.consumed = read_consumed(run, shard)
    except RecordDamaged as e:
        out.problems.append(Problem(_rel(run, e.path), Damage.RECORD, f"{e.why}; its samples count as missing"))
    try:
        out.recorded = sealed_ids(run, shard)
    except RecordDamaged as e:
        out.problems.append(Problem(_rel(run, e.path), Damage.RECORD, e.why))
        return
    record = _rel(run, layout.seal_record(run, shard))
    if out.manifest is not None and not out.recorded:
        out.problems.append(Problem(record, Damage.RECORD, "missing, though the shard's SEALED manifest is there"))
    elif out.manifest is not None and list(out.recorded) != sorted(out.manifest):
        out.problems.append(Problem(record, Damage.RECORD, "disagrees with the shard's SEALED manifest"))


def _rel(run: Path, path: Path) -> str:
    return str(path.relative_to(run))


def _collect(out: ShardScan, batches: list[Future]) -> ShardScan:
    """Wait for the shard's checks and judge it against its manifest."""
    seal = out.manifest or {}
    for future in batches:
        for rel, rec, nread in future.result():
            out.opened += 1
            out.bytes_read += nread
            if isinstance(rec, Problem):
                out.problems.append(rec)
                continue
            sid = rec.sample_id
            if sid in seal and seal[sid] != rec:  # a valid file, but not the one the seal recorded
                out.problems.append(Problem(rel, Damage.CORRUPT, "differs from the shard's SEALED manifest", sid))
                continue
            out.good[sid] = rec
    out.problems.sort(key=lambda p: p.path)  # name order, as listed
    out.sealed = out.manifest is not None and out.complete and out.manifest == out.accounted
    return out


def scan_run(
    run: Path,
    num_samples: int,
    shard_size: int,
    deep: bool,
    shards: Iterable[int] | None = None,
    threads: int | None = None,
    on_shard: Callable[[ShardScan], None] | None = None,
    want: Expected | None = None,
) -> list[ShardScan]:
    """Scan the given shards (default: all of the plan's) with ``threads`` readers; results in shard
    order, ``on_shard`` called (in this thread) as each one is done, so a resume can start on the
    first shards while later ones are still read. A few threads list shards ahead and queue their
    files in shard order, so the readers never wait at a shard's end; listing is mostly Python work
    under the GIL, where more threads would only contend. ``want``: what the run's files hold (None:
    any file hsx writes)."""
    todo = list(range(layout.num_shards(num_samples, shard_size)) if shards is None else shards)
    n = threads or default_threads()
    listers = ThreadPoolExecutor(min(n, max(2, (os.cpu_count() or 2) // 4)), thread_name_prefix="hsx-list")
    with Readers(n) as readers:
        try:
            out = []
            listed = listers.map(
                lambda s: _list(run, s, layout.shard_ids(s, shard_size, num_samples), deep, readers, want), todo
            )
            for scan, batches in listed:
                out.append(_collect(scan, batches))
                if on_shard is not None:
                    on_shard(out[-1])  # may raise to abandon the scan
            return out
        finally:
            listers.shutdown(cancel_futures=True)
