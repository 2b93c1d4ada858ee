"""What a running extraction tells the operator between two ``hsx status`` calls.

Every heartbeat (``lock.BEAT_EVERY``) the run lock calls ``Telemetry.beat``, which writes

- ``OUT/metrics.json``: the last figures (rate, ETA, bytes, free space, waits), replaced whole;
- ``OUT/metrics-history.jsonl``: one line a minute (and one at the end of a session), so a run of
  days keeps its pace. Bounded: past ``HISTORY_MAX`` lines the older half is thinned to every other
  line, so recent minutes stay exact and old days stay coarsely. Appended, so a kill can leave a
  torn last line: readers skip lines that do not parse;
- optionally Prometheus' text format: a textfile for node_exporter's textfile collector (replaced
  atomically), and/or an HTTP endpoint (``--metrics-port``) served by prometheus-client.

Status reads the history back (``read_history``) for the recent rate, the projected finish and the
free-space trend (``assess.pace``).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pydantic import BaseModel, ValidationError

from hsx.store.durable import write_durable
from hsx.store.layout import HISTORY, METRICS

HISTORY_EVERY = 60.0  # seconds between history lines
HISTORY_MAX = 20_000  # lines kept before the older half is thinned (~2 weeks at one a minute)

# metrics.json key -> (Prometheus name, help)
GAUGES = {
    "samples_done": ("hsx_samples_done", "Sample files written and verified, all sessions"),
    "samples_total": ("hsx_samples_total", "Samples in the run's plan"),
    "tokens_done": ("hsx_tokens_done", "Tokens whose states are on disk, all sessions"),
    "tokens_total": ("hsx_tokens_total", "Tokens in the run's plan"),
    "bytes_written": ("hsx_session_bytes_written", "Bytes of sample files this session wrote"),
    "tokens_per_s": ("hsx_tokens_per_second", "This session's mean extraction rate"),
    "bytes_per_s": ("hsx_bytes_per_second", "This session's mean write rate"),
    "eta_s": ("hsx_eta_seconds", "Projected seconds to the run's end at this session's rate"),
    "free_bytes": ("hsx_volume_free_bytes", "Free bytes on the output volume"),
    "waited_for_disk_s": ("hsx_waited_for_disk_seconds", "Seconds the forward pass waited for writes"),
    "verify_bytes": ("hsx_verify_bytes_read", "Bytes this session's resume verification read"),
    "verify_seconds": ("hsx_verify_seconds", "Seconds this session's resume verification took so far"),
    "verify_waited_s": ("hsx_verify_waited_seconds", "Seconds the loaded model waited for verification"),
    "fidelity_checked": ("hsx_fidelity_checked_tokens", "Tokens this session checked against the target's head"),
    "fidelity_agreement": ("hsx_fidelity_agreement", "Share of them whose next token the final state predicts"),
    "fidelity_near_ties": ("hsx_fidelity_near_ties", "Share of them missed by a near tie only"),
    "fidelity_logprob": ("hsx_fidelity_logprob_mean", "Mean log-probability of their actual next tokens"),
    "conversations_per_s": ("hsx_generate_conversations_per_second", "This generate session's conversations a second"),
    "new_tokens": ("hsx_generate_new_tokens", "New tokens this generate session's conversations hold"),
    "new_tokens_per_s": ("hsx_generate_new_tokens_per_second", "This generate session's new tokens a second"),
}


class Point(BaseModel):
    """One line of the history."""

    time: float
    samples_done: int
    tokens_done: int
    tokens_total: int
    free_bytes: int
    tokens_per_s: float = 0.0
    waited_for_disk_s: float = 0.0


class Telemetry:
    """``metrics``: the extractor's figures (``Progress.metrics``). ``textfile``: a path to keep
    in Prometheus' text format; ``port``: serve the same on http://0.0.0.0:port/metrics."""

    def __init__(
        self,
        run: Path,
        metrics: Callable[[], dict],
        port: int | None = None,
        textfile: Path | None = None,
        history_every: float = HISTORY_EVERY,
        history_max: int = HISTORY_MAX,
    ):
        self.run, self.metrics, self.port, self.textfile = run, metrics, port, textfile
        self.history_every, self.history_max = history_every, history_max
        self.last_point = 0.0
        self.lines: int | None = None  # the history's length, counted once, then kept
        self.lock = threading.Lock()  # the heartbeat thread and the final beat
        self.server = None

    def snapshot(self) -> dict:
        return self.metrics() | {"time": time.time(), "free_bytes": shutil.disk_usage(self.run).free}

    def beat(self, final: bool = False) -> None:
        """Write metrics.json, a history line when one is due (always when ``final``), the textfile."""
        with self.lock:
            m = self.snapshot()
            write_durable(self.run / METRICS, json.dumps(m).encode())
            if final or m["time"] - self.last_point >= self.history_every:
                self.last_point = m["time"]
                self.add_point(Point.model_validate(m, strict=False))
            if self.textfile is not None:
                write_durable(self.textfile, exposition(self.registry_for(m)))

    def add_point(self, point: Point) -> None:
        if self.lines is None:
            self.lines = len(read_history(self.run))
        append_history(self.run, point)
        self.lines += 1
        if self.lines > self.history_max:
            self.lines = thin_history(self.run)

    def registry_for(self, m: dict | None = None):
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self, m))
        return registry

    def __enter__(self) -> Telemetry:
        if self.port is not None:
            from prometheus_client import start_http_server

            self.server, _ = start_http_server(self.port, registry=self.registry_for())
        return self

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    @property
    def bound_port(self) -> int | None:
        """The port the endpoint listens on (``port`` 0 picks a free one)."""
        return None if self.server is None else self.server.server_address[1]


class _Collector:
    """prometheus-client's collector protocol over a snapshot (``m``) or a fresh one per scrape."""

    def __init__(self, telemetry: Telemetry, m: dict | None):
        self.telemetry, self.m = telemetry, m

    def collect(self) -> Iterator:
        from prometheus_client.core import GaugeMetricFamily

        m = self.m if self.m is not None else self.telemetry.snapshot()
        run = str(self.telemetry.run.resolve())
        for key, (name, doc) in GAUGES.items():
            if m.get(key) is not None:
                g = GaugeMetricFamily(name, doc, labels=["run"])
                g.add_metric([run], float(m[key]))
                yield g


def exposition(registry) -> bytes:
    from prometheus_client import generate_latest

    return generate_latest(registry)


def append_history(run: Path, point: Point) -> None:
    with open(run / HISTORY, "a+b") as f:
        end = f.seek(0, os.SEEK_END)
        torn = end > 0 and os.pread(f.fileno(), 1, end - 1) != b"\n"  # a kill cut the last line short
        f.write((b"\n" if torn else b"") + point.model_dump_json().encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())


def thin_history(run: Path) -> int:
    """Keep every other line of the older half (replaced whole); returns the lines kept."""
    points = read_history(run)
    half = len(points) // 2
    kept = points[:half:2] + points[half:]
    write_durable(run / HISTORY, "".join(p.model_dump_json() + "\n" for p in kept).encode())
    return len(kept)


def read_history(run: Path) -> list[Point]:
    """The history's points in time order; lines that do not parse (a torn last line) are skipped."""
    try:
        lines = (run / HISTORY).read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(Point.model_validate_json(line))
        except (ValidationError, ValueError):
            continue
    return out
