"""Progress of an extraction: the live bar, the figures for metrics.json, and the session's totals.

Counts move when a sample's file has been written (from writer threads), so the bar shows what is
on disk, not what was computed. Off a terminal (nohup, a batch scheduler's log) the bar is off and
a line is logged every ``log_every`` seconds instead, one line each, ``key=value`` fields:

    progress done=120/500 rate=35.2/s eta=11s free=81.2GB last_error=-

``rate`` counts samples (conversations for a generate run) a second this session, ``eta`` the
seconds to the end (``-`` while unknown), ``free`` the output volume's free space, and
``last_error`` the last trouble noted (``note_error``), the rest of the line.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

# text, never markup: a square bracket in a path or message prints as it is (hsx[ray], convs[v2].jsonl)
console = Console(stderr=True, soft_wrap=True, markup=False, highlight=False)
LOG_EVERY = 60.0  # seconds between progress lines off a terminal


class Progress:
    """``where``: the run folder, whose volume's free space the progress lines give."""

    def __init__(
        self,
        total_samples: int,
        total_tokens: int,
        bytes_per_token: int,
        where: Path | None = None,
        log_every: float = LOG_EVERY,
    ):
        self.total_samples, self.total_tokens = total_samples, total_tokens
        self.bytes_per_token = bytes_per_token
        self.where, self.log_every = where, log_every
        self.last_error: str | None = None
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.base_samples = self.base_tokens = 0
        self.samples = self.tokens = self.bytes = 0
        self._bar: RichProgress | None = None
        self._task = None
        # seconds the forward pass stood still because writes were behind; set by this process's
        # extractor (not by a scale-out driver or the vLLM path, which do not measure it)
        self.waited_for_disk: Callable[[], float] | None = None
        # a resume's verification so far (files, bytes, seconds, extraction's wait): job.resume.Verified
        self.verified: Callable[[], dict] | None = None
        # this session's fidelity so far (hsx.fidelity.Gate.metrics), where the run checks it
        self.fidelity: Callable[[], dict] | None = None

    def start(self, done_samples: int, done_tokens: int) -> None:
        self.base_samples, self.base_tokens = done_samples, done_tokens
        self.t0 = time.monotonic()

    def add_done(self, samples: int, tokens: int) -> None:
        """Samples found verified on disk (a resume's verification, shard by shard)."""
        with self.lock:
            self.base_samples += samples
            self.base_tokens += tokens

    def on_written(self, tokens: int) -> Callable[[Future], None]:
        def done(f: Future) -> None:
            if f.cancelled() or f.exception() is not None:
                return
            self.add_written(tokens, f.result().size)

        return done

    def add_written(self, tokens: int, nbytes: int) -> None:
        """One file this session wrote, durable now."""
        with self.lock:
            self.samples += 1
            self.tokens += tokens
            self.bytes += nbytes
        if self._bar is not None:
            self._bar.update(self._task, advance=1, rate=self.rates())

    def note_error(self, message: str) -> None:
        """Trouble the run goes on through (a retried request, a rejected conversation): the next
        progress line names it."""
        self.last_error = " ".join(message.split())

    def counts(self) -> tuple[int, int, float]:
        """(done, total, per second this session) in the unit the progress line counts."""
        with self.lock:
            written = self.samples
            done = self.base_samples + written
        return done, self.total_samples, written / max(self.elapsed(), 1e-9)

    def line(self) -> str:
        """The progress line (module docstring)."""
        done, total, rate = self.counts()
        eta = self.metrics().get("eta_s")
        free = f"{shutil.disk_usage(self.where).free / 1e9:.1f}GB" if self.where is not None else "-"
        return (
            f"progress done={done}/{total} rate={rate:.2f}/s eta={'-' if eta is None else f'{eta:.0f}s'} "
            f"free={free} last_error={self.last_error or '-'}"
        )

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def tokens_done(self) -> int:
        return self.base_tokens + self.tokens

    def session(self) -> tuple[int, int, int]:
        return self.samples, self.tokens, self.bytes

    def rates(self) -> str:
        dt = max(self.elapsed(), 1e-9)
        return f"{self.tokens / dt:,.0f} tok/s {self.bytes / dt / 1e6:,.1f} MB/s"

    def metrics(self) -> dict:
        dt = max(self.elapsed(), 1e-9)
        tok_rate = self.tokens / dt
        left = self.total_tokens - self.tokens_done()
        return (
            {
                "samples_done": self.base_samples + self.samples,
                "samples_total": self.total_samples,
                "tokens_done": self.tokens_done(),
                "tokens_total": self.total_tokens,
                "bytes_written": self.bytes,
                "tokens_per_s": tok_rate,
                "bytes_per_s": self.bytes / dt,
                "eta_s": left / tok_rate if tok_rate > 0 else None,
            }
            | ({"waited_for_disk_s": self.waited_for_disk()} if self.waited_for_disk else {})
            | (self.verified() if self.verified else {})
            | (self.fidelity() if self.fidelity else {})
        )

    @contextmanager
    def live(self, what: str = "extracting") -> Iterator[None]:
        bar = RichProgress(
            TextColumn(what),
            BarColumn(),
            MofNCompleteColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
            console=console,
            disable=not sys.stderr.isatty(),
        )
        ticker = None if sys.stderr.isatty() else _Ticker(self)
        with bar:
            self._task = bar.add_task("extract", total=self.total_samples, completed=self.base_samples, rate="")
            self._bar = bar
            try:
                yield
            finally:
                self._bar = None
                if ticker is not None:
                    ticker.stop()

    @staticmethod
    @contextmanager
    def simple(description: str, total: int) -> Iterator[_Simple]:
        bar = RichProgress(
            TextColumn(description),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=console,
            disable=not sys.stderr.isatty(),
        )
        with bar:
            yield _Simple(bar, bar.add_task(description, total=total))


class _Ticker:
    """Off a terminal: ``progress.line()`` on stderr every ``progress.log_every`` seconds, and once
    more when the work stops (finished, stopped or failed), so a log ends with where it stood."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hsx-progress-log", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.progress.log_every):
            print(self.progress.line(), file=sys.stderr, flush=True)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        print(self.progress.line(), file=sys.stderr, flush=True)


class _Simple:
    def __init__(self, bar: RichProgress, task):
        self.bar, self.task = bar, task

    def advance(self, n: int = 1) -> None:
        self.bar.update(self.task, advance=n)
