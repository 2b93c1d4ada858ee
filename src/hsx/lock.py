"""One extractor per run (invariant 4), with a heartbeat others can judge it by.

``OUT/lock.json`` records host, pid (and the pid's start time, so a recycled pid is not mistaken
for the holder), start time and a heartbeat rewritten every few seconds. A lock is
- alive: same host and the process exists, or another host and the heartbeat is fresh;
- dead: same host and the process is gone;
- stale: another host and the heartbeat is older than ``STALE_AFTER``.
A dead or stale lock is taken over (with a warning); an alive one refuses the second extractor.
Take-over renames the old lock aside first, so two racing extractors cannot both win.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
from pydantic import BaseModel

from hsx.store.durable import write_durable

LOCK = "lock.json"
METRICS = "metrics.json"
STALE_AFTER = 120.0
BEAT_EVERY = 5.0


class Holder(BaseModel):
    host: str
    pid: int
    pid_started: float
    started: float
    heartbeat: float
    command: str = "extract"

    def state(self, now: float | None = None, stale_after: float = STALE_AFTER) -> str:
        if self.host == socket.gethostname():
            try:
                proc = psutil.Process(self.pid)
                if abs(proc.create_time() - self.pid_started) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE:
                    return "alive"
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
            return "dead"
        age = (now or time.time()) - self.heartbeat
        return "alive" if age < stale_after else "stale"

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, heartbeat {time.time() - self.heartbeat:.0f}s ago"


class Locked(Exception):
    def __init__(self, holder: Holder):
        super().__init__(f"another extractor holds this run: {holder.describe()}")
        self.holder = holder


def read_holder(run: Path) -> Holder | None:
    try:
        return Holder.model_validate_json((run / LOCK).read_bytes())
    except (OSError, ValueError):
        return None


def _me(command: str) -> Holder:
    now = time.time()
    return Holder(
        host=socket.gethostname(),
        pid=os.getpid(),
        pid_started=psutil.Process().create_time(),
        started=now,
        heartbeat=now,
        command=command,
    )


class RunLock:
    """Context manager: acquire, keep a heartbeat (and optional metrics) fresh, release."""

    def __init__(
        self,
        run: Path,
        command: str = "extract",
        metrics: Callable[[], dict] | None = None,
        warn: Callable[[str], None] = print,
    ):
        self.run = run
        self.path = run / LOCK
        self.me = _me(command)
        self.metrics = metrics
        self.warn = warn
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = read_holder(self.run)
                if holder is not None and holder.state() == "alive":
                    raise Locked(holder) from None
                aside = self.path.with_name(f".{LOCK}.taken-{os.getpid()}")
                try:
                    os.rename(self.path, aside)  # only one racer can move the old lock
                except FileNotFoundError:
                    continue
                aside.unlink(missing_ok=True)
                what = f"{holder.describe()}, {holder.state()}" if holder else "unreadable"
                self.warn(f"taking over a lock left by a dead extractor ({what})")
                continue
            with os.fdopen(fd, "w") as f:
                f.write(self.me.model_dump_json())
                f.flush()
                os.fsync(f.fileno())
            return
        raise RuntimeError("could not acquire the run lock (it changed hands repeatedly)")

    def beat(self) -> None:
        self.me.heartbeat = time.time()
        current = read_holder(self.run)
        if current is None or (current.pid, current.host) != (self.me.pid, self.me.host):
            return  # someone took it over: never overwrite another holder's lock
        write_durable(self.path, self.me.model_dump_json().encode())
        if self.metrics is not None:
            write_durable(self.run / METRICS, json.dumps(self.metrics() | {"time": time.time()}).encode())

    def _loop(self) -> None:
        while not self._stop.wait(BEAT_EVERY):
            try:
                self.beat()
            except OSError:
                pass  # a full disk must not kill the heartbeat thread; the writer reports it

    def __enter__(self) -> RunLock:
        self.acquire()
        self._thread = threading.Thread(target=self._loop, name="hsx-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.beat()
        except OSError:
            pass
        holder = read_holder(self.run)
        if holder is not None and (holder.pid, holder.host) == (self.me.pid, self.me.host):
            self.path.unlink(missing_ok=True)
