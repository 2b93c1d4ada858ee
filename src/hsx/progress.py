"""Progress of an extraction: the live bar, the figures for metrics.json, and the session's totals.

Counts move when a sample's file has been written (from writer threads), so the bar shows what is
on disk, not what was computed.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

# text, never markup: a square bracket in a path or message prints as it is (hsx[ray], convs[v2].jsonl)
console = Console(stderr=True, soft_wrap=True, markup=False, highlight=False)


class Progress:
    def __init__(self, total_samples: int, total_tokens: int, bytes_per_token: int):
        self.total_samples, self.total_tokens = total_samples, total_tokens
        self.bytes_per_token = bytes_per_token
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
        with bar:
            self._task = bar.add_task("extract", total=self.total_samples, completed=self.base_samples, rate="")
            self._bar = bar
            try:
                yield
            finally:
                self._bar = None

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


class _Simple:
    def __init__(self, bar: RichProgress, task):
        self.bar, self.task = bar, task

    def advance(self, n: int = 1) -> None:
        self.bar.update(self.task, advance=n)
