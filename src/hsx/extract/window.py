"""``--window``: the extraction pauses while the bytes of its samples that the named consumers have
not all released exceed the window, and goes on as they release them (docs/streaming.md).

A sample is released by a consumer once its checkpoint covers the step that acknowledged it
(``hsx.consumer``); the window counts every sample file on disk that some named consumer has not
released. The pause is one of ``Extractor.gates``, called before each batch is captured: it
blocks there, logs when it starts and ends, and keeps ``OUT/window.json`` (since when it waits,
the bytes held, for whom) for ``hsx status``. It never pauses while a named consumer waits for a
sample not written yet: that consumer can release nothing until the producer writes it, so the
disk may exceed the window by what is written for a waiting consumer (at most the shard it reads).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from hsx.consumer import LEASE_TIMEOUT, NOT_WRITTEN, ConsumerView, inspect
from hsx.lock import Liveness
from hsx.spec import Window
from hsx.store import layout
from hsx.store.durable import write_durable
from hsx.units import size

RECORD = "window.json"


class WindowState(BaseModel):
    """``OUT/window.json``: the producer's last look at its window."""

    window: int
    held: int  # bytes of samples on disk not released by every named consumer
    paused_since: float | None = None
    waiting_for: list[str] = []  # the consumers whose releases it waits for
    pid: int = 0
    t: float = 0.0


def read_state(run: Path) -> WindowState | None:
    try:
        return WindowState.model_validate_json((run / RECORD).read_bytes())
    except (OSError, ValueError):
        return None


def held(run: Path, window: Window, shard_size: int, views: list[ConsumerView] | None = None) -> tuple[int, list[str]]:
    """Bytes of sample files on disk that some named consumer has not released, and those consumers."""
    views = {v.name: v for v in (inspect(run) if views is None else views)}
    released: set[int] | None = None
    for name in window.consumers:
        mine = views[name].released if name in views else set()
        released = mine if released is None else released & mine
    released = released or set()
    total, unreleased = 0, set()
    try:
        folders = list(os.scandir(run / layout.SHARDS))
    except FileNotFoundError:
        folders = []
    for folder in folders:
        with os.scandir(folder.path) as it:
            for e in it:
                sid = layout.parse_sample_name(e.name)
                if sid is not None and sid not in released:
                    total += e.stat().st_size
                    unreleased.add(sid)
    behind = [n for n in window.consumers if n not in views or not unreleased <= views[n].released]
    return total, behind


def waited_on(views: list[ConsumerView], names: list[str]) -> bool:
    """Whether a live rank of a named consumer waits for a sample not written yet."""
    return any(
        r.state == Liveness.ALIVE and r.record.waiting_for is not None and r.record.waiting_why == NOT_WRITTEN
        for v in views
        if v.name in names
        for r in v.ranks
        if r.record is not None
    )


class Pause:
    """The window's gate (``Extractor.gates``): returns once the next ``nbytes`` fit."""

    def __init__(self, run: Path, window: Window, shard_size: int, log: Callable[[str], None], poll: float = 0.5):
        self.run, self.window, self.shard_size, self.log, self.poll = run, window, shard_size, log, poll

    def _fits(self, nbytes: int) -> tuple[bool, WindowState]:
        views = inspect(self.run, LEASE_TIMEOUT)
        used, behind = held(self.run, self.window, self.shard_size, views)
        state = WindowState(window=self.window.bytes, held=used, waiting_for=behind, pid=os.getpid(), t=time.time())
        return used + nbytes <= self.window.bytes or waited_on(views, self.window.consumers), state

    def __call__(self, nbytes: int) -> None:
        fits, state = self._fits(nbytes)
        if fits:
            return
        since = state.paused_since = time.time()
        who = ", ".join(state.waiting_for)
        self.log(
            f"window: paused, {size(state.held)} of samples not released by {who} "
            f"(window {size(self.window.bytes)}); waiting for them to release"
        )
        write_durable(self.run / RECORD, state.model_dump_json().encode())
        while not fits:
            time.sleep(self.poll)
            fits, state = self._fits(nbytes)
            state.paused_since = since
            if fits:
                state.paused_since = None
            write_durable(self.run / RECORD, state.model_dump_json().encode())
        self.log(f"window: goes on after {time.time() - since:.0f}s ({size(state.held)} held)")
