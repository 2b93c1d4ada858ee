"""``--window``: the extraction pauses while the bytes of its samples that the named consumers have
not all released exceed the window, and goes on as they release them (docs/streaming.md).

A sample is released by a consumer once its checkpoint covers the step that acknowledged it
(``hsx.consumer``; a damaged checkpoint or consumer spec releases nothing, and the pause names
it); the window counts every sample file on disk that some named consumer has not released. The
pause is one of ``Extractor.gates``, called before each batch is captured: it blocks there, logs
when it starts and ends, and keeps ``OUT/window.json`` (since when it waits, the bytes held, for
whom) for ``hsx status``. With ``--window-limit`` (``Window.limit``) the same gate lets the run go
on past the window while its consumers lag, says so once in the log and in ``window.json``, and
pauses at the limit instead. A batch larger than the window is written once nothing is held (no
release could make room for it). It lets through the batches of the shard a named consumer waits
on (a sample not written yet: that consumer can release nothing until the producer writes it), so
the disk may exceed the window by that shard; a wait on another shard, or on a file being read,
lifts nothing (a resume writes the shard a consumer waits on first:
``job.resume``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from hsx.consumer import LEASE_TIMEOUT, NOT_WRITTEN, ConsumerView, inspect, repair
from hsx.errors import RecordDamaged
from hsx.lock import Liveness
from hsx.plane import Publisher
from hsx.spec import RunSpec, Window, load_spec
from hsx.store import layout
from hsx.store.durable import flocked, fsync_dir
from hsx.store.records import read_record, record_folder, write_record
from hsx.store.writer import read_seal, record_consumed
from hsx.units import size

RECORD = "window.json"


class WindowState(BaseModel):
    """``OUT/window.json``: the producer's last look at its window."""

    window: int
    limit: int | None = None  # --window-limit: where it pauses, past the window
    held: int  # bytes of samples on disk not released by every named consumer
    paused_since: float | None = None
    past_since: float | None = None  # since when it holds more than the window (up to its limit)
    waiting_for: list[str] = []  # the consumers whose releases it waits for
    pid: int = 0
    t: float = 0.0


def read_state(run: Path) -> WindowState | None:
    """The producer's last look (None: it never paused). ``RecordDamaged`` where the record is
    damaged or another run's (``store.records``): never read as none."""
    path = run / RECORD
    body = read_record(run, path)
    try:
        return None if body is None else WindowState.model_validate(body)
    except ValueError:
        raise RecordDamaged(path, "garbled (not a window state)") from None


def vllm_in_flight(batch_tokens: int, longest: int) -> int:
    """Tokens the vLLM feed keeps enqueued and not finished, at most (four batches, or the longest sample)."""
    return max(4 * batch_tokens, longest)


def in_flight(spec: RunSpec) -> int:
    """Bytes an extraction may hold past the window's gate, not yet written (the window's bound
    counts them): the transformers backend's two batches (the one the fidelity check holds back
    and the next), the vLLM feed's tokens enqueued."""
    if spec.backend == "vllm":
        return vllm_in_flight(spec.batch_tokens, spec.max_length) * spec.bytes_per_token
    return 2 * spec.batch_tokens * spec.bytes_per_token


def released(window: Window, views: list[ConsumerView]) -> set[int]:
    """Ids every named consumer released (acknowledged at a step its declared checkpoint covers)."""
    by_name = {v.name: v.released for v in views}
    return set.intersection(*(by_name.get(name, set()) for name in window.consumers))


def held(
    run: Path, window: Window, shard_size: int, views: list[ConsumerView] | None = None, sealed: Sealed | None = None
) -> tuple[int, list[str]]:
    """Bytes of sample files on disk that some named consumer has not released, and those consumers."""
    views = inspect(run) if views is None else views
    return summed(window, views, unreleased(run, released(window, views), Sealed(run) if sealed is None else sealed))


def unreleased(run: Path, done: set[int], sealed: Sealed) -> dict[int, int]:
    """Each sample file on disk whose id is not in ``done``: id -> bytes. A sealed shard's sizes come
    from its manifest (``sealed`` keeps them between calls), so only the files of shards still being
    written are stat'ed: one stat a file a batch is what a shared file system cannot afford at a
    run's tens of thousands of files."""
    files: dict[int, int] = {}
    try:
        folders = list(os.scandir(run / layout.SHARDS))
    except FileNotFoundError:
        folders = []
    for folder in folders:
        sizes = sealed.sizes(folder.name)
        with os.scandir(folder.path) as it:
            for e in it:
                sid = layout.parse_sample_name(e.name)
                if sid is not None and sid not in done:
                    files[sid] = sizes[sid] if sid in sizes else e.stat().st_size
    return files


def summed(window: Window, views: list[ConsumerView], files: dict[int, int]) -> tuple[int, list[str]]:
    """The bytes of ``files`` (``unreleased``) and the named consumers that hold some of them."""
    by_name = {v.name: v.released for v in views}
    return sum(files.values()), [n for n in window.consumers if not files.keys() <= by_name.get(n, set())]


class Sealed:
    """The file sizes of a run's sealed shards, read from their manifests once (a manifest is
    written once, when its shard is sealed); an unsealed shard is looked up again next time."""

    def __init__(self, run: Path):
        self.run, self.known = run, {}

    def sizes(self, folder: str) -> dict[int, int]:
        if folder not in self.known and folder.isdigit():
            manifest = read_seal(self.run, int(folder))
            if manifest is None:
                return {}
            self.known[folder] = {sid: rec.size for sid, rec in manifest.items()}
        return self.known.get(folder, {})


def waited_on(
    run: Path, views: list[ConsumerView], names: list[str], shard_size: int, shard: int, unwritten: set[int]
) -> bool:
    """Whether a live rank of a named consumer waits for a sample not written yet (its file is not
    there) that is of ``shard`` (the next batch's) or ``unwritten`` (captured past the gate, held
    back until the next batch is: the fidelity check judges one behind): that consumer can release
    nothing until it is written. A sample of another shard lifts no pause (the bound counts one
    shard), nor one whose file is there (a read in progress)."""
    return any(
        r.record.waiting_why == NOT_WRITTEN
        and (layout.shard_of(r.record.waiting_for, shard_size) == shard or r.record.waiting_for in unwritten)
        and not layout.sample_path(run, r.record.waiting_for, shard_size).exists()
        for v in views
        if v.name in names
        for r in v.ranks
        if r.record is not None and r.state == Liveness.ALIVE and r.record.waiting_for is not None
    )


def delete_released(run: Path, ids: set[int], shard_size: int) -> int:
    """Delete the released files of sealed shards, each shard's recorded consumed first (so status,
    verify and resume count them done, never missing); returns how many. A shard still being
    written keeps its released files until it is sealed (its manifest is what the record copies).
    Processes that delete (the workers of one run, each at its gate) take turns under an flock:
    each adds to a shard's record what it read there, so two at once could drop each other's."""
    if not ids:
        return 0
    gone = 0
    record_folder(run / layout.CONSUMED)  # a file in its place is named, never written through
    with flocked(layout.consumed_guard(run)):
        for shard in sorted({layout.shard_of(i, shard_size) for i in ids}):
            manifest = read_seal(run, shard)
            if manifest is None:
                continue
            doomed = [
                manifest[i] for i in sorted(ids) if i in manifest and layout.sample_path(run, i, shard_size).exists()
            ]
            if not doomed:
                continue
            record_consumed(run, shard, doomed)
            for r in doomed:
                layout.sample_path(run, r.sample_id, shard_size).unlink(missing_ok=True)
            fsync_dir(layout.shard_dir(run, shard))
            gone += len(doomed)
    return gone


def sweep(run: Path, window: Window | None, shard_size: int, log: Callable[[str], None]) -> None:
    """At the end of an extraction's session (in one process or its Ray workers' driver), and on a
    resume of a finished run: where the run deletes released files, delete what the consumers
    released since the gate last looked (the gate runs only before a batch, so what a trainer
    releases after the last one would stay on disk); where it has a data plane (``hsx.plane``), put
    the files written since and remove the keys released since."""
    if window is None or not (window.delete or window.plane):
        return
    views = inspect(run, LEASE_TIMEOUT)
    done = released(window, views)
    if window.plane is not None:
        publisher = Publisher(run, load_spec(run), window.plane, log)
        try:
            publisher.sync(set(unreleased(run, done, Sealed(run))), done)
        finally:
            publisher.close()
    if not window.delete:
        return
    gone = delete_released(run, done, shard_size)
    if gone:
        log(f"window: deleted {gone} released file{'s' if gone != 1 else ''}, recorded consumed")


class Pause:
    """The window's gate (``Extractor.gates``): returns once the next ``nbytes`` fit. ``ahead``: the
    shard of the batch the gate is asked about, and the ids past the gate not yet written."""

    def __init__(
        self,
        run: Path,
        window: Window,
        shard_size: int,
        log: Callable[[str], None],
        ahead: Callable[[], tuple[int, set[int]]],
        poll: float = 0.5,
    ):
        self.run, self.window, self.shard_size, self.log, self.poll = run, window, shard_size, log, poll
        self.ahead = ahead
        self.sealed = Sealed(run)
        self.oversized = False  # whether the log said that a batch exceeds the window
        self.past_since: float | None = None  # since when it holds more than the window (--window-limit)
        self.views: list[ConsumerView] = []  # the consumers at the last look
        self.publisher = None if window.plane is None else Publisher(run, load_spec(run), window.plane, log)

    def _fits(self, nbytes: int) -> tuple[bool, WindowState]:
        views = self.views = inspect(self.run, LEASE_TIMEOUT)
        done = released(self.window, views)
        if self.window.delete:
            delete_released(self.run, done, self.shard_size)
        files = unreleased(self.run, done, self.sealed)
        used, behind = summed(self.window, views, files)
        if self.publisher is not None:  # the plane holds what the disk holds unreleased
            self.publisher.sync(set(files), done)
        state = WindowState(
            window=self.window.bytes,
            limit=self.window.limit,
            held=used,
            waiting_for=behind,
            pid=os.getpid(),
            t=time.time(),
        )
        self._past(state)
        # with nothing held, a batch larger than the window goes alone: no release could ever make room for it
        fits = used + nbytes <= self.window.pause_at or not used
        return fits or waited_on(self.run, views, self.window.consumers, self.shard_size, *self.ahead()), state

    def _past(self, state: WindowState) -> None:
        """With ``--window-limit``: say once, with the numbers, when the run holds more than its
        window (and once when it is back within it), recorded in ``window.json`` for ``hsx status``."""
        if self.window.limit is None or (state.held > self.window.bytes) == (self.past_since is not None):
            state.past_since = self.past_since
            return
        if self.past_since is None:
            self.past_since = time.time()
            self.log(
                f"window: past its window, {size(state.held)} of samples not released by "
                f"{', '.join(state.waiting_for)} (window {size(self.window.bytes)}); going on while they lag, up "
                f"to {size(self.window.limit)} (--window-limit)"
            )
        else:
            self.past_since = None
            self.log(f"window: back within its window ({size(state.held)} held of {size(self.window.bytes)})")
        state.past_since = self.past_since
        write_record(self.run, self.run / RECORD, state.model_dump(mode="json"), indent=None)

    def __call__(self, nbytes: int) -> None:
        fits, state = self._fits(nbytes)
        if nbytes > self.window.pause_at and not self.oversized:
            self.oversized = True
            bound = "the window" if self.window.limit is None else "--window-limit"
            self.log(
                f"window: a batch of {size(nbytes)} is larger than {bound} ({size(self.window.pause_at)}); "
                "each such batch is written alone, once the consumers released everything before it"
            )
        if fits:
            return
        since = state.paused_since = time.time()
        who = ", ".join(state.waiting_for)
        limit = "" if self.window.limit is None else f", up to {size(self.window.limit)} by --window-limit"
        self.log(
            f"window: paused, {size(state.held)} of samples not released by {who} "
            f"(window {size(self.window.bytes)}{limit}); waiting for them to release"
        )
        for e in (e for v in self.views if v.name in state.waiting_for for e in v.damaged):
            self.log(f"window: {e.path} {e.why}, so it releases nothing: {repair(e.path)}")
        write_record(self.run, self.run / RECORD, state.model_dump(mode="json"), indent=None)
        while not fits:
            time.sleep(self.poll)
            fits, state = self._fits(nbytes)
            state.paused_since = since
            if fits:
                state.paused_since = None
            write_record(self.run, self.run / RECORD, state.model_dump(mode="json"), indent=None)
        self.log(f"window: goes on after {time.time() - since:.0f}s ({size(state.held)} held)")
