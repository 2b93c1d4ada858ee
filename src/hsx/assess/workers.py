"""Is an extractor working on this run now? From the lock (host, pid, heartbeat) and metrics.json.

alive: another writer owns the run; starting a second one is refused, so a person decides (exit 2).
dead / stale: the lock outlived its process; ``hsx extract`` takes it over with a warning.
The metrics file (rate, ETA, bytes) is shown whenever present: for a dead run it is the last known pace.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from hsx import registry
from hsx.assess.checks import Check, duration
from hsx.lock import LOCK, STALE_AFTER, Holder, read_holder, writer_noun
from hsx.store.layout import METRICS
from hsx.units import size


@dataclass
class Worker:
    state: str  # none | alive | dead | stale | unreadable
    holder: Holder | None
    metrics: dict | None
    fleet: list[registry.Seen] = field(default_factory=list)  # scale-out workers (OUT/workers/), alive or dead
    group: registry.GroupRecord | None = None  # the ranks of a tensor-parallel group (OUT/group.json)

    @property
    def alive(self) -> bool:
        return self.state == "alive"

    @property
    def pid(self) -> int | None:
        return self.holder.pid if self.holder is not None else None


def read_metrics(run: Path) -> dict | None:
    try:
        m = json.loads((run / METRICS).read_text())
        return m if isinstance(m, dict) else None
    except (OSError, ValueError):
        return None


def inspect(run: Path, stale_after: float = STALE_AFTER) -> Worker:
    w = _inspect_lock(run, stale_after)
    w.fleet = registry.inspect(run, stale_after)
    w.group = registry.read_group(run)
    return w


def _inspect_lock(run: Path, stale_after: float) -> Worker:
    metrics = read_metrics(run)
    if not (run / LOCK).exists():
        return Worker("none", None, metrics)
    holder = read_holder(run)
    if holder is None:
        return Worker("unreadable", None, metrics)
    return Worker(holder.state(stale_after=stale_after), holder, metrics)


def _pace(m: dict | None) -> str:
    if not m:
        return ""
    age = time.time() - m.get("time", time.time())
    rate = m.get("tokens_per_s") or 0
    return (
        f"; {rate:,.0f} tok/s, {size(m.get('bytes_per_s') or 0)}/s, ETA {duration(m.get('eta_s'))}, "
        f"{size(m.get('bytes_written') or 0)} this session (metrics {duration(age)} old)"
    )


def check(w: Worker, command: str = "extract") -> Check:
    """``command``: the run's (``generate`` for a generate run), which takes a dead lock over."""
    return add_group(add_fleet(_check_lock(w, command), w.fleet, w.alive), w.group)


def _check_lock(w: Worker, command: str) -> Check:
    data: dict = {"state": w.state, "metrics": w.metrics}
    h = w.holder
    if h is not None:
        data |= {"host": h.host, "pid": h.pid, "started": h.started, "heartbeat_age_s": time.time() - h.heartbeat}
    if w.state == "none":
        return Check("workers", "ok", f"no {writer_noun(command)} running", data=data)
    if w.state == "unreadable":
        return Check(
            "workers",
            "warn",
            f"{LOCK} is unreadable; hsx {command} replaces it",
            action=f"check no {writer_noun(command)} runs",
            data=data,
        )
    assert h is not None
    who = f"pid {h.pid} on {h.host} ({h.command}), heartbeat {duration(time.time() - h.heartbeat)} ago"
    if w.alive:
        return Check(
            "workers",
            "fail",
            f"alive: {who}, running {duration(time.time() - h.started)}{_pace(w.metrics)}",
            action=f"an {h.noun} is running: wait for it, or stop it (pid {h.pid} on {h.host}) before resuming",
            data=data,
        )
    why = "its process is gone" if w.state == "dead" else f"no heartbeat for over {duration(STALE_AFTER)}"
    return Check(
        "workers",
        "warn",
        f"{w.state} lock: {who}; {why}; hsx {h.command} takes it over{_pace(w.metrics)}",
        data=data,
    )


def add_fleet(c: Check, seen: list[registry.Seen], driver_alive: bool) -> Check:
    """The ``workers`` line of ``hsx status``, with one detail line per scale-out worker, alive or dead."""
    if not seen:
        return c
    c.figure += f"; {registry.summary(seen)}"
    c.details += [s.describe() for s in seen]
    c.data["ray_workers"] = [s.record.model_dump() | {"state": s.state} for s in seen]
    alive = [s for s in seen if s.state == "alive"]
    if alive and not driver_alive:
        c.level, c.redo = "fail", False
        c.action = (
            f"{len(alive)} worker(s) outlived their driver ({alive[0].record.where()}): they stop themselves "
            "within two heartbeats of losing it; if they do not, stop them before resuming"
        )
    return c


def add_group(c: Check, group: registry.GroupRecord | None) -> Check:
    """One detail line per rank of a tensor-parallel group, alive or dead. Ranks alive without
    their launcher would hold GPUs and block a resume: a person must stop them (they should not
    exist: each dies with its launcher)."""
    states = group.states() if group is not None else []
    if not states:
        return c
    alive = [r for r, s in states if s == "alive"]
    c.figure += f"; tensor-parallel group of {len(states)} ranks, {len(alive)} alive"
    c.details += [f"rank {r.rank}: pid {r.pid} on {r.device}, {s}" for r, s in states]
    c.data["ranks"] = [r.model_dump() | {"state": s} for r, s in states]
    if alive and not group.launcher_alive():
        c.level, c.redo = "fail", False
        c.action = f"stop the ranks that outlived their launcher: kill {' '.join(str(r.pid) for r in alive)}"
    return c
