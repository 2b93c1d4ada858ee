"""Writes sample files from host buffers on a pool of threads, and seals finished shards.

``submit`` returns a future at once; bytes in flight are bounded (backpressure) so host memory
stays fixed while the producer runs ahead of the disk. A sample is durable once ``wait`` has
fsynced the folders its renames touched; only then is it reported done. The first write error
stops the writer and is raised from the next ``submit`` or ``wait`` (``DiskFull`` for a full volume).

States the codec encodes on the host (zstd; fp8 where the device did not) are encoded by a pool of
encoder threads, one per core, apart from the writer threads: each state is queued there at
``submit``, so every sample in flight is being encoded while the writers hash, write and fsync
others, and encoding uses the machine's cores whatever the number of writers. Each state is one
task on one thread (Blosc2 releases the GIL), so its bytes never depend on the number of threads;
the host buffers are released once their states are encoded, before the file is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hsx.errors import RecordDamaged
from hsx.store import layout
from hsx.store.codec import Codec, Encoded, encode_early, prepare
from hsx.store.durable import fsync_dir, write_parts
from hsx.store.format import Figure, FinalStateNorm, SampleTensors, encode
from hsx.store.records import parse_record, read_record, record_folder, write_record

if TYPE_CHECKING:
    import torch

SEAL_FORMAT = "hsx-seal/1"


@dataclass(frozen=True)
class FileRecord:
    sample_id: int
    size: int
    digest: str
    # as sealed, where it proves the file unchanged since (see ``read_seal``); not part of identity
    mtime_ns: int | None = field(default=None, compare=False)
    fidelity: Figure | None = field(default=None, compare=False)  # its header's, where its run checks it


class SampleWriter:
    def __init__(
        self,
        run: Path,
        shard_size: int,
        layers: list[int],
        threads: int = 8,
        max_inflight_bytes: int = 1 << 30,
        codec: Codec = Codec.RAW,
        encoders: int | None = None,
        final: FinalStateNorm = "post",
    ):
        """``encoders``: threads that encode states on the host [one per core this process may use];
        ``final``: the norm of the final state, as each file labels it."""
        self.run = run
        self.shard_size = shard_size
        self.layers = list(layers)
        self.final = final
        self.codec = Codec(codec)
        self.threads = threads
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hsx-write")
        self.encoders = None
        if self.codec is not Codec.RAW:
            n = encoders or len(os.sched_getaffinity(0))
            self.encoders = ThreadPoolExecutor(max_workers=n, thread_name_prefix="hsx-encode")
            prepare(self.codec)
        self.max_inflight = max_inflight_bytes
        self.inflight = 0
        self.cond = threading.Condition()
        self.dirty: set[Path] = set()
        self.error: BaseException | None = None
        self.bytes_written = 0
        self.waited = 0.0  # seconds ``submit`` blocked on the in-flight budget (the disk was behind)

    def submit(
        self, sample: SampleTensors, release: Callable[[], None] | None = None, ready: Callable[[], None] | None = None
    ) -> Future:
        """Queue one sample. ``ready`` blocks until its buffers are filled (a device copy's fence);
        ``release`` is called once they are no longer read."""
        n = sample.nbytes
        self._admit(n)
        encoding = None
        if self.encoders is not None and not isinstance(sample.aux, Encoded):  # else encoded on the device
            encoding = [
                self.encoders.submit(self._encode, t, groups, ready)
                for t, groups in ((sample.aux, len(self.layers)), (sample.final, 1))
            ]
        return self.pool.submit(self._write, sample, n, release, ready, encoding)

    def start_threads(self) -> None:
        """Start every writer thread now, which the pool otherwise does one per submit: so that none is
        started while finished work waits to be written (a batch that finished in one step)."""
        started = threading.Barrier(self.threads + 1)
        for _ in range(self.threads):  # each holds its thread until all are up, so none is reused
            self.pool.submit(started.wait)
        started.wait()

    def submit_encoded(self, sample_id: int, parts: list[memoryview | bytes], digest: str) -> Future:
        """Queue one file its caller has encoded already (``parts``, whose digest is ``digest``): written,
        bounded and made durable by ``wait`` as the others are."""
        n = sum(memoryview(p).nbytes for p in parts)
        self._admit(n)
        return self.pool.submit(self._write_encoded, sample_id, parts, digest, n)

    def _admit(self, n: int) -> None:
        """Wait until ``n`` more bytes fit in the in-flight budget; raise the writer's first error."""
        with self.cond:
            t0 = time.perf_counter()
            while self.inflight and self.inflight + n > self.max_inflight and self.error is None:
                self.cond.wait()
            self.waited += time.perf_counter() - t0
            if self.error is not None:
                raise self.error
            self.inflight += n

    def _write_encoded(self, sample_id: int, parts: list[memoryview | bytes], digest: str, n: int) -> FileRecord:
        try:
            if self.error is not None:
                raise self.error
            return self._store(sample_id, parts, digest)
        except BaseException as e:
            self._fail(e)
            raise
        finally:
            self._release(n)

    def _store(
        self, sample_id: int, parts: list[memoryview | bytes], digest: str, fidelity: Figure | None = None
    ) -> FileRecord:
        """Write one file under its final name (its folder is fsynced by ``sync``)."""
        path = layout.sample_path(self.run, sample_id, self.shard_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        size = write_parts(path, parts, sync_dir=False)
        with self.cond:
            self.dirty.add(path.parent)
            self.bytes_written += size
        return FileRecord(sample_id, size, digest, fidelity=fidelity)

    def _fail(self, e: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = e

    def _release(self, n: int) -> None:
        with self.cond:
            self.inflight -= n
            self.cond.notify_all()

    def _encode(self, t: torch.Tensor, groups: int, ready: Callable[[], None] | None) -> Encoded | torch.Tensor:
        """State ``t`` encoded; the empty aux state of a run without taps as it is (never stored)."""
        if ready is not None:
            ready()
        if self.error is not None:
            raise self.error
        return encode_early(self.codec, t, groups) if groups else t

    def _write(
        self,
        sample: SampleTensors,
        n: int,
        release: Callable[[], None] | None,
        ready: Callable[[], None] | None,
        encoding: list[Future] | None,
    ) -> FileRecord:
        try:
            if ready is not None:
                ready()
            if encoding is not None:
                aux, final = (f.result() for f in encoding)
                sample = dataclasses.replace(sample, aux=aux, final=final)
                if release is not None:  # the encoded states are new buffers: the staging slot is free
                    release, free = None, release
                    free()
            if self.error is not None:
                raise self.error
            parts, digest = encode(sample, self.layers, self.codec, self.final)
            return self._store(sample.sample_id, parts, digest, sample.fidelity)
        except BaseException as e:
            self._fail(e)
            raise
        finally:
            if release is not None:
                release()
            self._release(n)

    def wait(self, futures: list[Future]) -> list[FileRecord]:
        """Wait for these writes, fsync the folders touched; return the now-durable records."""
        done = []
        for f in futures:
            try:
                done.append(f.result())
            except BaseException:  # the first error is kept in self.error and raised below
                pass
        if self.error is not None:
            raise self.error
        self.sync()
        return done

    def sync(self) -> None:
        """fsync every folder a rename touched since the last sync."""
        with self.cond:
            dirty, self.dirty = self.dirty, set()
        for d in sorted(dirty):
            fsync_dir(d)

    def close(self) -> None:
        """Let queued writes finish (or fail and remove their temp files), then stop the threads."""
        self.pool.shutdown(wait=True)
        if self.encoders is not None:
            self.encoders.shutdown(wait=True)


def seal(run: Path, shard: int, records: list[FileRecord]) -> None:
    """Write the shard's SEALED manifest, last and atomically, once all its ids are done; then the
    run's record that it did (``sealed_ids``), outside the shard's folder.

    Each file's mtime (ns) is recorded as it is now, so that a fast check can trust a file the
    listing shows unchanged (size and mtime) without opening it. A file whose size on disk is not
    its record's gets no mtime: it is never trusted, always checked. Manifests without mtimes
    (older ones) read as before; readers that predate mtimes ignore them. A file's fidelity figure,
    where its run checks it, is listed too, so status sums a sealed shard's without opening a file."""
    folder = layout.shard_dir(run, shard)
    files = []
    for r in sorted(records, key=lambda r: r.sample_id):
        entry: dict = {"name": layout.sample_name(r.sample_id), "size": r.size, "digest": r.digest}
        if r.fidelity is not None:
            entry["fidelity"] = json.loads(r.fidelity.text())
        try:
            st = os.stat(folder / entry["name"])
            if st.st_size == r.size:
                entry["mtime_ns"] = st.st_mtime_ns
        except FileNotFoundError:
            pass
        files.append(entry)
    write_record(run, folder / layout.SEALED, {"format": SEAL_FORMAT, "shard": shard, "files": files})
    ids = [r.sample_id for r in records]
    record = {"shard": shard, "ids": [min(ids), max(ids) + 1], "bytes": sum(r.size for r in records)}
    record_folder(run / layout.SEALS)
    write_record(run, layout.seal_record(run, shard), record | {"sealed": _now()}, indent=None)


def sealed_ids(run: Path, shard: int) -> range:
    """The ids the run recorded as sealed in ``shard`` (``seal``'s record, kept outside the shard's
    folder): what existed, verified, whatever the folder holds now; empty where it never sealed it.
    A damaged record raises ``RecordDamaged``: read as none, a lost shard would pass for one not written."""
    path = layout.seal_record(run, shard)
    body = read_record(run, path)
    if body is None:
        return range(0)
    try:
        lo, hi = body["ids"]
        return range(int(lo), int(hi))
    except (KeyError, TypeError, ValueError):
        raise RecordDamaged(path, "garbled (no range of ids)") from None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


CONSUMED_FORMAT = "hsx-consumed/1"


def record_consumed(run: Path, shard: int, records: list[FileRecord]) -> None:
    """Record, before they are deleted, the files of a sealed shard that every consumer released:
    the run's record (outside the shard's folder) of what is done and gone on purpose, added to
    what the shard's record held, replaced whole. The caller made ``consumed/`` and holds its guard
    (``extract.window.delete_released``)."""
    files = read_consumed(run, shard) | {r.sample_id: r for r in records}
    body = {
        "format": CONSUMED_FORMAT,
        "shard": shard,
        "files": [
            {"name": layout.sample_name(r.sample_id), "size": r.size, "digest": r.digest}
            for r in sorted(files.values(), key=lambda r: r.sample_id)
        ],
    }
    write_record(run, layout.consumed_record(run, shard), body)


def any_consumed(run: Path) -> bool:
    """Whether the run deleted any file as consumed."""
    try:
        return any(p.suffix == ".json" for p in (run / layout.CONSUMED).iterdir())
    except FileNotFoundError:
        return False


def read_consumed(run: Path, shard: int) -> dict[int, FileRecord]:
    """The shard's files recorded consumed (deleted on purpose), by id; empty where none was.
    A damaged record raises ``RecordDamaged``: read as none, consumed samples would count as lost,
    trusted, another run's record would count lost ones as consumed."""
    path = layout.consumed_record(run, shard)
    body = read_record(run, path, CONSUMED_FORMAT)
    if body is None:
        return {}
    try:
        out = {}
        for e in body["files"]:
            sid = layout.parse_sample_name(e["name"])
            if sid is None:
                raise ValueError(e["name"])
            out[sid] = FileRecord(sid, int(e["size"]), e["digest"])
        return out
    except (KeyError, TypeError, ValueError):
        raise RecordDamaged(path, "garbled (a file entry does not parse)") from None


def read_seal(run: Path, shard: int) -> dict[int, FileRecord] | None:
    """The manifest of a sealed shard, or None when the shard is not sealed (or its seal is unreadable).

    A recorded mtime is kept only when it is older than the manifest's own: any change after the
    manifest was written gives the file a newer mtime (same clock, the file system's), while one
    within the clock tick of the file's own write might not, so such a file is always checked."""
    path = layout.shard_dir(run, shard) / layout.SEALED
    try:
        with open(path, "rb") as f:  # one open: the mtime and the text are of the same manifest
            sealed_ns = os.fstat(f.fileno()).st_mtime_ns
            body = parse_record(run, path, f.read(), SEAL_FORMAT)  # another run's is none of this shard's
        out = {}
        for e in body["files"]:
            sid = layout.parse_sample_name(e["name"])
            mtime = e.get("mtime_ns")
            mtime = int(mtime) if mtime is not None and int(mtime) < sealed_ns else None
            out[sid] = FileRecord(sid, int(e["size"]), e["digest"], mtime, Figure.parse(e.get("fidelity")))
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecordDamaged):
        return None
