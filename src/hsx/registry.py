"""Who works on a run, recorded in the run folder: one heartbeat file per scale-out worker process.

``OUT/workers/<host>-<pid>.json`` holds host, pid (and its start time), Ray node, GPUs, the shard
held now, what the process wrote and its rate, rewritten every few seconds. Records are judged like
the run lock: same host, alive while the pid lives; another host, alive while the heartbeat is
fresh, stale after ``STALE_AFTER``. The run folder is on a filesystem every node shares, so
``hsx status`` on any node sees every worker, alive or dead, without asking Ray.

Fencing: a worker stops itself when its driver no longer holds the run lock (driver dead, or the
lock taken over), so an extractor started after a driver crash never shares a shard with an
orphaned worker; ``settle`` makes the next extractor wait until such workers are gone.
Records stay while their driver runs (history for ``hsx status``); the driver removes its own when
it ends, and the next extractor removes any a crashed driver left once they are no longer alive.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil
from pydantic import BaseModel, Field

from hsx import errors
from hsx.lock import BEAT_EVERY, STALE_AFTER, Holder, Liveness, Locked, process_alive, read_holder
from hsx.store.durable import temp_of, write_durable
from hsx.store.layout import GROUP, STOP, WORKERS

Phase = Literal["loading", "idle", "working", "stopped"]
FENCED_EXIT = 75  # exit status of a worker that stopped itself because its driver lost the run


def driver_id(holder: Holder) -> str:
    """A driver session: the run lock holder's identity (a recycled pid gets a new start time)."""
    return f"{holder.host}:{holder.pid}:{holder.started:.3f}"


class Rank(BaseModel):
    """One process of a tensor-parallel group (extract.group): rank 0 writes, the others compute."""

    rank: int
    pid: int
    pid_started: float
    device: str


class Refusal(BaseModel):
    """A refusal a worker met while loading (the model on its node, its checkpoint format): no
    retry can help, so the driver raises it as its own instead of letting Ray retry."""

    name: str  # the errors.Refused subclass
    message: str


class WorkerRecord(Holder):
    command: str = "worker"
    driver: str
    node: str = ""  # Ray node id
    device: str = "cpu"
    gpus: list[str] = Field(default_factory=list)  # Ray's GPU ids on its node
    restarted: bool = False  # Ray restarted this actor after its process died
    ranks: list[Rank] = Field(default_factory=list)  # a tensor-parallel worker's group; this pid is rank 0
    phase: Phase = "loading"
    shard: int | None = None
    shard_since: float | None = None
    shards_done: int = 0
    samples: int = 0  # written by this process
    tokens: int = 0
    bytes: int = 0
    tokens_per_s: float = 0.0
    exited: str | None = None  # why it stopped by itself, if it did
    refused: Refusal | None = None  # what it refused at load (then exited says so too)

    def liveness(self, stale_after: float = STALE_AFTER) -> Liveness:
        """The holder's state, or EXITED (stopped by itself) or ENDED (gone while idle)."""
        if self.exited:
            return Liveness.EXITED
        state = self.state(stale_after=stale_after)
        return Liveness.ENDED if state != Liveness.ALIVE and self.phase == "idle" else state

    def where(self) -> str:
        gpu = f", GPU {','.join(self.gpus)}" if self.gpus else f", {self.device}"
        group = (
            f" (rank 0 of {len(self.ranks)}: pids {', '.join(str(r.pid) for r in self.ranks)})" if self.ranks else ""
        )
        return f"pid {self.pid}{group} on {self.host}{gpu}"


def folder(run: Path) -> Path:
    return run / WORKERS


def record_path(run: Path, host: str, pid: int) -> Path:
    return folder(run) / f"{host}-{pid}.json"


@dataclass
class Seen:
    path: Path
    record: WorkerRecord
    state: Liveness

    def describe(self, now: float | None = None) -> str:
        r, now = self.record, now or time.time()
        if self.state == "alive":
            if r.shard is not None:
                doing = f"shard {r.shard} for {now - (r.shard_since or now):.0f}s"
            else:
                doing = {"loading": "loading the model", "idle": "waiting for a shard"}.get(r.phase, r.phase)
        elif r.shard is not None:
            doing = f"died holding shard {r.shard} (Ray retries it while the driver runs)"
        elif self.state == "ended":
            doing = "ended between shards"
        else:
            doing = r.exited or f"died while {r.phase}"
        if r.restarted:
            doing += " [a restart by Ray]"
        rate = f", {r.tokens_per_s:,.0f} tok/s" if r.tokens_per_s else ""
        return (
            f"{self.state:<6} {r.where()}: {doing}; {r.shards_done} shards, {r.samples:,} samples{rate}; "
            f"heartbeat {now - r.heartbeat:.0f}s ago"
        )


def inspect(run: Path, stale_after: float = STALE_AFTER) -> list[Seen]:
    """Every worker record of the run, with its state; unreadable files are skipped."""
    out = []
    try:
        paths = sorted(p for p in folder(run).iterdir() if p.suffix == ".json" and not p.name.startswith("."))
    except OSError:
        return []
    for p in paths:
        try:
            rec = WorkerRecord.model_validate_json(p.read_bytes())
        except (OSError, ValueError):
            continue
        out.append(Seen(p, rec, rec.liveness(stale_after)))
    return out


def counts(seen: list[Seen]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in seen:
        out[s.state] = out.get(s.state, 0) + 1
    return out


def summary(seen: list[Seen]) -> str:
    c = counts(seen)
    parts = ", ".join(f"{n} {state}" for state, n in sorted(c.items()))
    return f"{len(seen)} Ray worker{'s' if len(seen) != 1 else ''} ({parts})"


def totals(run: Path, driver: str) -> tuple[int, int, int]:
    """Samples, tokens, bytes written by one driver session's workers, dead ones included."""
    s = t = b = 0
    for seen in inspect(run):
        if seen.record.driver == driver:
            s, t, b = s + seen.record.samples, t + seen.record.tokens, b + seen.record.bytes
    return s, t, b


def refusal(seen: list[Seen], driver: str) -> errors.Refused | None:
    """The first refusal at load among one driver session's workers (of ``inspect``), rebuilt with
    who met it."""
    for s in seen:
        r = s.record
        if r.driver == driver and r.refused is not None:
            return errors.refusal(r.refused.name, f"worker {r.where()} refused at load: {r.refused.message}")
    return None


def driver_holds(run: Path, driver: str) -> bool:
    """Whether driver session ``driver`` still holds the run lock (the fence)."""
    holder = read_holder(run)
    return holder is not None and driver_id(holder) == driver and holder.state() == "alive"


def stop_requested(run: Path) -> str | None:
    try:
        return (folder(run) / STOP).read_text().strip() or "stop"
    except OSError:
        return None


def request_stop(run: Path, reason: str) -> None:
    folder(run).mkdir(exist_ok=True)
    write_durable(folder(run) / STOP, reason.encode())


def settle(run: Path, me: Holder, log: Callable[[str], None], timeout: float = STALE_AFTER + 2 * BEAT_EVERY) -> None:
    """Called by a new lock holder: wait until workers of earlier drivers are gone, then drop their records.

    Such workers fence themselves within two heartbeats of the lock changing hands; a worker on
    another host that was killed cannot say so, and counts as gone once its heartbeat is stale.
    """
    mine = driver_id(me)
    (folder(run) / STOP).unlink(missing_ok=True)
    deadline = time.monotonic() + timeout
    waited = False
    while True:
        others = [s for s in inspect(run) if s.record.driver != mine]
        alive = [s for s in others if s.state == "alive"]
        if not alive:
            break
        if time.monotonic() > deadline:
            raise Locked(alive[0].record)
        if not waited:
            log(f"waiting for {len(alive)} worker(s) of an earlier driver to stop ({alive[0].record.where()})")
            waited = True
        time.sleep(0.5)
    for s in others:
        s.path.unlink(missing_ok=True)
    _remove_cut_writes(run, {s.path.name for s in others})
    with contextlib.suppress(OSError):
        folder(run).rmdir()  # only when empty: a live session's records stay
    if others:
        dead = [s for s in others if s.state in ("dead", "stale")]
        log(f"cleared {len(others)} worker record(s) of an earlier driver ({len(dead)} had died)")


def clear_session(run: Path, driver: str) -> list[Seen]:
    """At a driver's end: remove its workers' records (and the stop flag); returns what they said."""
    seen = [s for s in inspect(run) if s.record.driver == driver]
    for s in seen:
        s.path.unlink(missing_ok=True)
    _remove_cut_writes(run, {s.path.name for s in seen})
    (folder(run) / STOP).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder(run).rmdir()
    return seen


def _remove_cut_writes(run: Path, ended: set[str]) -> None:
    """Remove what heartbeat writes cut off by a kill left (Ray ends a worker at any instant, also
    between a record's temp file and its rename): the temp files of the records ``ended`` (workers
    known to be over, on any host), and those whose writer on this host is gone."""
    try:
        names = [p.name for p in folder(run).iterdir()]
    except OSError:
        return
    host = socket.gethostname()
    for name in names:
        if (of := temp_of(name)) is None:
            continue
        record, pid = of
        gone_here = pid is not None and record == record_path(run, host, pid).name and not psutil.pid_exists(pid)
        if record in ended or gone_here:
            (folder(run) / name).unlink(missing_ok=True)


class Heartbeat:
    """A worker's record, rewritten every ``every`` seconds by a thread that also checks the fence."""

    def __init__(self, run: Path, driver: Holder, every: float = BEAT_EVERY, **fields):
        now = time.time()
        self.run, self.every = run, every
        self.driver = driver
        self.record = WorkerRecord(
            host=socket.gethostname(),
            pid=os.getpid(),
            pid_started=psutil.Process().create_time(),
            started=now,
            heartbeat=now,
            driver=driver_id(driver),
            **fields,
        )
        self.path = record_path(run, self.record.host, self.record.pid)
        self.counters: Callable[[], tuple[int, int, int]] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._misses = 0
        self._t_first_shard: float | None = None
        self.path.parent.mkdir(exist_ok=True)

    def driver_holds_run(self) -> bool:
        return driver_holds(self.run, self.record.driver)

    def update(self, **changes) -> None:
        with self._lock:
            for k, v in changes.items():
                setattr(self.record, k, v)
            if changes.get("phase") == "working" and self._t_first_shard is None:
                self._t_first_shard = time.time()
            self._write()

    def _write(self) -> None:
        r = self.record
        r.heartbeat = time.time()
        if self.counters is not None:
            r.samples, r.tokens, r.bytes = self.counters()
            if self._t_first_shard is not None:
                r.tokens_per_s = r.tokens / max(r.heartbeat - self._t_first_shard, 1e-9)
        write_durable(self.path, r.model_dump_json().encode())

    def fence(self) -> None:
        """Exit at once when the driver has lost the run (two checks in a row, to ride out a slow read)."""
        self._misses = 0 if self.driver_holds_run() else self._misses + 1
        if self._misses >= 2:
            self.update(exited="stopped itself: its driver no longer holds the run lock", phase="stopped")
            os._exit(FENCED_EXIT)

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            try:
                with self._lock:
                    self._write()
                self.fence()
            except OSError:
                pass  # a full or flaky volume must not kill the heartbeat; the writer reports it

    def refused(self, e: errors.Refused) -> None:
        """Record a refusal at load (this process is about to end) for the driver to raise."""
        refusal = Refusal(name=type(e).__name__, message=str(e))
        self.update(phase="stopped", exited=f"refused at load: {e}", refused=refusal)

    def start(self) -> None:
        self.update()
        threading.Thread(target=self._loop, name="hsx-worker-heartbeat", daemon=True).start()


class GroupRecord(BaseModel):
    """``OUT/group.json``: the ranks of the group extracting now, written by rank 0 once they all
    started; removed when the group ends cleanly, left behind by a crash (status names the dead)."""

    host: str
    launcher: int  # the ``hsx extract`` process the ranks belong to (they die with it)
    launcher_started: float
    started: float
    ranks: list[Rank]

    def launcher_alive(self) -> bool:
        return self.host == socket.gethostname() and process_alive(self.launcher, self.launcher_started)

    def states(self) -> list[tuple[Rank, Liveness]]:
        """Each rank alive or dead; a group on another host is judged by the run lock instead."""
        if self.host != socket.gethostname():
            return []
        return [(r, Liveness.ALIVE if process_alive(r.pid, r.pid_started) else Liveness.DEAD) for r in self.ranks]


def write_group(run: Path, record: GroupRecord) -> None:
    write_durable(run / GROUP, record.model_dump_json(indent=2).encode())


def read_group(run: Path) -> GroupRecord | None:
    try:
        return GroupRecord.model_validate_json((run / GROUP).read_bytes())
    except (OSError, ValueError):
        return None


def clear_group(run: Path) -> None:
    (run / GROUP).unlink(missing_ok=True)
