"""One extractor per run (invariant 4), with a heartbeat others can judge it by.

``OUT/lock.json`` records host, pid (and the pid's start time, so a recycled pid is not mistaken
for the holder), start time and a heartbeat rewritten every few seconds. A lock is
- alive: same host and the process exists, or another host and the heartbeat is fresh;
- dead: same host and the process is gone;
- stale: another host and the heartbeat is older than ``STALE_AFTER``.
A dead or stale lock is taken over (with a warning); an alive one refuses the second extractor.
Racing extractors take turns judging and taking the lock (an flock on a guard file, which the
kernel releases when its process dies), and the lock appears whole (a temp file hard-linked into
place, which fails if a lock is there), so no racer reads a half-written lock as an abandoned one.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path

import psutil
from pydantic import BaseModel

from hsx.errors import Locked, RecordDamaged
from hsx.store.durable import create_exclusive, flocked, write_durable
from hsx.store.layout import GUARD, LOCK

STALE_AFTER = 120.0
BEAT_EVERY = 5.0


class Liveness(StrEnum):
    """What a lock holder or a worker record says of its process."""

    ALIVE = "alive"  # its pid lives (same host) or its heartbeat is fresh (another host)
    DEAD = "dead"  # same host, the pid is gone (or reused by another process)
    STALE = "stale"  # another host, no heartbeat for STALE_AFTER
    EXITED = "exited"  # a worker that stopped by itself, and said why
    ENDED = "ended"  # a worker gone while idle: Ray let it go as the pool shrank


def process_alive(pid: int, started: float) -> bool:
    """Whether process ``pid`` of this host lives and is the one that started at ``started``
    (not a recycled pid, not a zombie)."""
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - started) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


class Holder(BaseModel):
    host: str
    pid: int
    pid_started: float
    started: float
    heartbeat: float
    command: str = "extract"

    def state(self, now: float | None = None, stale_after: float = STALE_AFTER) -> Liveness:
        if self.host == socket.gethostname():
            return Liveness.ALIVE if process_alive(self.pid, self.pid_started) else Liveness.DEAD
        age = (now or time.time()) - self.heartbeat
        return Liveness.ALIVE if age < stale_after else Liveness.STALE

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, heartbeat {time.time() - self.heartbeat:.0f}s ago"

    @property
    def noun(self) -> str:
        return writer_noun(self.command)


def writer_noun(command: str) -> str:
    """What messages call the process that writes a run: an extractor, or for a generate run an
    hsx generate process (its repairs and resumes are ``hsx generate``'s, not ``hsx extract``'s)."""
    return "hsx generate process" if command == "generate" else "extractor"


def read_holder(run: Path, path: Path | None = None, kind: type[Holder] = Holder) -> Holder | None:
    """The run lock's holder (or, with ``path``, the holder of another lock file, read as ``kind``)."""
    try:
        return kind.model_validate_json((path or run / LOCK).read_bytes())
    except (OSError, ValueError):
        return None


def this_process(command: str, kind: type[Holder] = Holder, **fields) -> Holder:
    """This process as a holder (``kind``: a record that extends ``Holder``, with its ``fields``)."""
    now = time.time()
    return kind(
        host=socket.gethostname(),
        pid=os.getpid(),
        pid_started=psutil.Process().create_time(),
        started=now,
        heartbeat=now,
        command=command,
        **fields,
    )


class RunLock:
    """Context manager: acquire, keep a heartbeat fresh, release. ``on_beat``: called after each
    heartbeat (``final`` on release), e.g. ``Telemetry.beat``.

    ``me`` and ``name``: another lock in ``run`` (a folder), held by a record that extends ``Holder``
    (a consumer's rank, ``hsx.consumer``), judged stale after ``stale_after``; the run lock by default."""

    def __init__(
        self,
        run: Path,
        command: str = "extract",
        on_beat: Callable[[bool], None] | None = None,
        warn: Callable[[str], None] = print,
        me: Holder | None = None,
        name: str = LOCK,
        stale_after: float = STALE_AFTER,
    ):
        self.run = run
        self.path = run / name
        self.guard = run / (GUARD if name == LOCK else f".{name}.guard")
        self.me = me or this_process(command)
        self.stale_after = stale_after
        self.on_beat = on_beat
        self.warn = warn
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Judge and take the lock under an flock on GUARD, so racing extractors take turns (the
        kernel drops an flock when its process dies: no stale guard); one turn decides."""
        what = "this run's lock" if self.path.name == LOCK else self.path.name

        def waiting() -> None:  # say so: a taker frozen mid-turn (e.g. ^Z) would be a silent hang
            self.warn(f"waiting for another process taking {what} (it holds {self.guard.name})")

        with flocked(self.guard, waiting):
            if self._create(self._body()):
                return
            try:
                holder, damage = self.holder(), None
            except RecordDamaged as e:  # no holder wrote it as it is: taken over, saying why
                holder, damage = None, e
            if holder is not None and holder.state(stale_after=self.stale_after) == "alive":
                raise Locked(holder)
            self.path.unlink(missing_ok=True)
            if damage is not None:
                self.warn(f"taking over {self.path.name}, which no {self.me.noun} holding it wrote ({damage.why})")
            else:
                left = f"{holder.describe()}, {holder.state(stale_after=self.stale_after)}" if holder else "unreadable"
                self.warn(f"taking over a lock left by a dead {self.me.noun} ({left})")
            if not self._create(self._body()):
                raise RuntimeError("could not acquire the run lock (another lock appeared during take-over)")

    def _create(self, body: bytes) -> bool:
        """Put this process's lock in place, whole, unless a lock is there (then False)."""
        return create_exclusive(self.path, body)

    def _body(self) -> bytes:
        """This holder's lock as written (a lock kept as a record of its run stamps it: ``hsx.consumer``)."""
        return self.me.model_dump_json().encode()

    def holder(self) -> Holder | None:
        """Who holds this lock now, as written (read as ``me``'s kind); a lock kept as a record of its
        run raises ``RecordDamaged`` where no holder wrote it as it is (``hsx.consumer``)."""
        return read_holder(self.run, self.path, type(self.me))

    def beat(self, final: bool = False) -> None:
        self.me.heartbeat = time.time()
        try:
            current = self.holder()
        except RecordDamaged as e:  # no holder wrote it as it is (another run's, copied in): ours to rewrite
            self.warn(f"{e}: rewritten by its holder, {self.me.describe()}")
            current = self.me
        if current is None or (current.pid, current.host) != (self.me.pid, self.me.host):
            return  # someone took it over: never overwrite another holder's lock
        write_durable(self.path, self._body())
        if self.on_beat is not None:
            self.on_beat(final)

    def _loop(self) -> None:
        while not self._stop.wait(BEAT_EVERY):
            try:
                self.beat()
            except OSError:
                pass  # a full disk must not kill the heartbeat thread; the writer reports it

    def keep(self) -> RunLock:
        """Keep the acquired lock's heartbeat fresh, on a thread of its own, until ``__exit__``."""
        self._thread = threading.Thread(target=self._loop, name="hsx-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __enter__(self) -> RunLock:
        self.acquire()
        return self.keep()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.beat(final=True)
        except OSError:
            pass
        holder = self.holder()
        if holder is not None and (holder.pid, holder.host) == (self.me.pid, self.me.host):
            self.path.unlink(missing_ok=True)
