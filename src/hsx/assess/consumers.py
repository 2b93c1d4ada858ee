"""The consumers line of ``hsx status``: per trainer reading the run (``hsx.consumer``), what it
acknowledged and holds leased, how far it lags behind what is written (samples, bytes, time), its
last durable checkpoint, and a rank whose heartbeat stopped."""

from __future__ import annotations

import os
import time

from hsx.assess.checks import Check, duration
from hsx.consumer import ConsumerView, inspect
from hsx.extract.window import held, read_state
from hsx.lock import Liveness
from hsx.spec import Window
from hsx.store import layout
from hsx.store.scan import ShardScan
from hsx.units import size


def check(
    run,
    scans: list[ShardScan],
    num_samples: int,
    shard_size: int,
    window: Window | None = None,
    producing: bool = False,
) -> Check | None:
    """None for a run no consumer ever read and no window waits for. ``producing``: an extractor
    holds the run now (its window's pause is current)."""
    views = inspect(run)
    if not views and window is None:
        return None
    written = {sid: rec.size for s in scans for sid, rec in s.good.items()}
    details, stopped, data = [], [], {}
    now = time.time()
    for v in views:
        line, figures, dead = _describe(run, v, written, num_samples, shard_size, now)
        details.append(line)
        data[v.name] = figures
        stopped += dead
    figure = f"{len(views)} consumer{'s' if len(views) != 1 else ''}"
    if window is not None:
        used, behind = held(run, window, shard_size, views)
        state = read_state(run)
        paused = producing and state is not None and state.paused_since is not None
        data["window"] = {"bytes": window.bytes, "held": used, "paused_since": state.paused_since if paused else None}
        figure += f"; window {size(used)} held of {size(window.bytes)} for {', '.join(window.consumers)}"
        if paused:
            figure += f"; the extractor waits since {duration(now - state.paused_since)} for {', '.join(behind)}"
        absent = [n for n in window.consumers if n not in {v.name for v in views}]
        if absent:
            details.append(f"{', '.join(absent)}: never started; the window waits for them")
    if stopped:
        return Check(
            "consumers",
            "warn",
            f"{figure}; {len(stopped)} rank{'s' if len(stopped) != 1 else ''} stopped: {', '.join(stopped)}",
            details,
            action="restart the trainer from its last checkpoint: what it leased returns to its stream",
            data=data,
        )
    return Check("consumers", "ok", figure, details, data=data)


def _describe(
    run, v: ConsumerView, written: dict[int, int], num_samples: int, shard_size: int, now: float
) -> tuple[str, dict, list[str]]:
    acked, leased = v.acknowledged, v.leased
    behind = [sid for sid in written if sid not in acked]
    lag_bytes = sum(written[sid] for sid in behind)
    oldest = None
    for sid in behind:
        try:
            t = os.stat(layout.sample_path(run, sid, shard_size)).st_mtime
        except OSError:
            continue
        oldest = t if oldest is None else min(oldest, t)
    lag_s = None if oldest is None else max(0.0, now - oldest)
    finished = len(acked) == num_samples
    dead, ranks = [], []
    for r in v.ranks:
        rec = r.record
        if rec is None:
            ranks.append(f"rank {r.rank} not started" if not r.acks else f"rank {r.rank} closed")
            continue
        if r.state != Liveness.ALIVE:
            age = duration(now - rec.heartbeat)
            ranks.append(f"rank {r.rank} {r.state} (pid {rec.pid} on {rec.host}, heartbeat {age} ago)")
            if not finished:
                dead.append(f"{v.name} rank {r.rank}")
            continue
        doing = f"rank {r.rank} alive at step {rec.step}"
        if rec.waiting_for is not None:
            waited = duration(now - rec.waiting_since) if rec.waiting_since else "?"
            doing += f", waiting {waited} for sample {rec.waiting_for} ({rec.waiting_why})"
        ranks.append(doing)
    ckpt = f"checkpoint at step {v.checkpoint.step}" if v.checkpoint else "no checkpoint declared"
    lag = f"lag {len(behind):,} samples, {size(lag_bytes)}, {duration(lag_s) if lag_s is not None else '0s'}"
    line = (
        f"{v.name}: {'finished, ' if finished else ''}{len(acked):,}/{num_samples:,} acknowledged through step "
        f"{v.step}, {len(leased):,} leased, {lag}; {ckpt}; {'; '.join(ranks)}"
    )
    figures = {
        "acknowledged": len(acked),
        "leased": len(leased),
        "released": len(v.released),
        "step": v.step,
        "checkpoint_step": v.checkpoint.step if v.checkpoint else None,
        "lag_samples": len(behind),
        "lag_bytes": lag_bytes,
        "lag_seconds": lag_s,
        "stopped_ranks": [int(d.rsplit(" ", 1)[1]) for d in dead],
    }
    return line, figures, dead
