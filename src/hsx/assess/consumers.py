"""The consumers line of ``hsx status``: per trainer reading the run (``hsx.consumer``), what it
acknowledged and holds leased, how far it lags behind what is written (samples, bytes, time), its
ranks' last durable checkpoints, and what keeps it or the producer's window from going on: a dead
rank, a sample it waits for that is corrupt (``hsx extract`` redoes it) or was deleted, a trainer
whose checkpoints the window cannot wait for, a window exceeded, a damaged record of a consumer
(``consumer.repair``). Each of those fails the line. A run its ``--window-limit`` lets hold more than
its window warns (the line says by how much)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from hsx.assess.checks import Check, duration
from hsx.consumer import DELETED, NOT_WRITTEN, READING, ConsumerView, inspect, repair
from hsx.errors import RecordDamaged
from hsx.extract.window import RECORD, WindowState, held, read_state
from hsx.lock import Liveness
from hsx.spec import Window
from hsx.store import layout
from hsx.store.scan import ShardScan
from hsx.units import size

STALLED_AFTER = 5.0  # seconds a paused window and a consumer waiting on it must last to be judged stuck


@dataclass
class Trouble:
    """What stops a consumer or the window from going on, and what to do about it."""

    what: str
    action: str
    redo: bool = False  # ``hsx extract`` repairs it (a corrupt sample redone)


def check(
    run,
    scans: list[ShardScan],
    num_samples: int,
    shard_size: int,
    window: Window | None = None,
    producing: bool = False,
    in_flight: int = 0,
) -> Check | None:
    """None for a run no consumer ever read and no window waits for. ``producing``: an extractor
    holds the run now (its window's pause is current). ``in_flight``: the bytes of the batches an
    extraction may have in flight at a pause (the window's bound counts them)."""
    views = inspect(run)
    if not views and window is None:
        return None
    written = {sid: rec.size for s in scans for sid, rec in s.good.items()}
    consumed = {sid for s in scans for sid in s.consumed}
    details, troubles, data = [], [], {}
    now = time.time()
    try:
        state = read_state(run) if window is not None else None
    except RecordDamaged as e:  # named, never read as none; the producer's next look rewrites it
        state = None
        troubles.append(Trouble(f"{RECORD}: {e.why}", f"the extractor rewrites {RECORD} at its next pause"))
    paused = producing and state is not None and state.paused_since is not None
    past = None
    for v in views:
        troubles += [Trouble(f"{v.name}: {e.path.name} {e.why}", f"{e.path}: {repair(e.path)}") for e in v.damaged]
        line, figures, trouble = _describe(run, v, written, num_samples, shard_size, now)
        details.append(line)
        data[v.name] = figures
        if len(v.acknowledged) < num_samples:
            trouble += _unnamed(run, v, window, consumed)
            if window is not None and paused and v.name in state.waiting_for:
                trouble += _stuck(v, state, now)
        troubles += trouble
    figure = f"{len(views)} consumer{'s' if len(views) != 1 else ''}"
    if window is not None:
        used, behind = held(run, window, shard_size, views)
        data["window"] = {"bytes": window.bytes, "held": used, "paused_since": state.paused_since if paused else None}
        figure += f"; window {size(used)} held of {size(window.bytes)} for {', '.join(window.consumers)}"
        if window.plane is not None:  # the same samples' keys, in the data plane (hsx.plane)
            data["window"]["plane"] = window.plane
            figure += f", also in {window.plane}"
        if paused:
            figure += f"; the extractor waits since {duration(now - state.paused_since)} for {', '.join(behind)}"
        absent = [n for n in window.consumers if n not in {v.name for v in views}]
        if absent:
            details.append(f"{', '.join(absent)}: never started; the window waits for them")
        past = _past(window, used, state if producing else None, now)
        if past is not None:
            data["window"] |= {"limit": window.limit, "past_by": used - window.bytes}
            figure += f"; {past}"
        shard = max((sum(r.size for r in {**s.good, **s.consumed}.values()) for s in scans), default=0)
        bound = window.pause_at + shard + in_flight
        if used > bound:
            limit = "the window" if window.limit is None else "the --window-limit"
            troubles.append(
                Trouble(
                    f"the window is exceeded: {size(used)} not released on disk, over its bound of {size(bound)} "
                    f"({limit}, a shard of {size(shard)} and the batches in flight)",
                    "find which consumer holds them in the lines above; a trainer that declares checkpoints "
                    "(checkpointed) releases them",
                )
            )
    if troubles:
        return Check(
            "consumers",
            "fail",
            f"{figure}; {'; '.join(t.what for t in troubles)}",
            details,
            action="; ".join(dict.fromkeys(t.action for t in troubles)),
            redo=all(t.redo for t in troubles),
            data=data,
        )
    if past is not None:
        return Check("consumers", "warn", figure, details, action=LAGGING, data=data)
    return Check("consumers", "ok", figure, details, data=data)


LAGGING = (
    "the consumers lag: the extraction pauses at the --window-limit; a trainer that acknowledges and declares "
    "checkpoints (checkpointed) releases what it trained"
)


def _past(window: Window, used: int, state: WindowState | None, now: float) -> str | None:
    """A run whose ``--window-limit`` let it hold more than its window (a warning): by how much, and
    since when where the producer running now recorded it. None within the window, or without a limit."""
    if window.limit is None or used <= window.bytes:
        return None
    since = f" since {duration(now - state.past_since)}" if state is not None and state.past_since else ""
    return (
        f"past its window by {size(used - window.bytes)}{since} (allowed up to {size(window.limit)} by --window-limit)"
    )


def _describe(
    run, v: ConsumerView, written: dict[int, int], num_samples: int, shard_size: int, now: float
) -> tuple[str, dict, list[Trouble]]:
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
    trouble, ranks, dead = [], [], []
    for r in v.ranks:
        rec = r.record
        ckpt = f"checkpoint at step {r.checkpoint.step}" if r.checkpoint else "no checkpoint declared"
        if rec is None:
            ranks.append(f"rank {r.rank} not started" if not r.acks else f"rank {r.rank} closed, {ckpt}")
            continue
        if r.state != Liveness.ALIVE:
            age = duration(now - rec.heartbeat)
            ranks.append(f"rank {r.rank} {r.state} (pid {rec.pid} on {rec.host}, heartbeat {age} ago), {ckpt}")
            if not finished:
                dead.append(r.rank)
                trouble.append(
                    Trouble(
                        f"{v.name} rank {r.rank} {r.state}",
                        "restart the trainer from its last checkpoint: what it leased returns to its stream "
                        "(a window waits for its releases)",
                    )
                )
            continue
        doing = f"rank {r.rank} alive at step {rec.step}, {ckpt}"
        if rec.waiting_for is not None:
            waited = duration(now - rec.waiting_since) if rec.waiting_since else "?"
            doing += f", waiting {waited} for sample {rec.waiting_for} ({rec.waiting_why})"
            why = rec.waiting_why
            if why.startswith(DELETED):
                trouble.append(
                    Trouble(
                        f"{v.name} rank {r.rank} waits for sample {rec.waiting_for}, {why}",
                        f"consumer {v.name} cannot finish on this run: read a run that deletes nothing, or name "
                        "the consumer in the --window of a new run",
                    )
                )
            elif why not in (NOT_WRITTEN, READING):
                trouble.append(
                    Trouble(
                        f"{v.name} rank {r.rank} waits for sample {rec.waiting_for}, which does not verify",
                        f"hsx extract --out {run} redoes it (the trainer goes on once it verifies)",
                        redo=True,
                    )
                )
        ranks.append(doing)
    lag = f"lag {len(behind):,} samples, {size(lag_bytes)}, {duration(lag_s) if lag_s is not None else '0s'}"
    line = (
        f"{v.name}: {'finished, ' if finished else ''}{len(acked):,}/{num_samples:,} acknowledged through step "
        f"{v.step}, {len(leased):,} leased, {lag}; {'; '.join(ranks)}"
    )
    figures = {
        "acknowledged": len(acked),
        "leased": len(leased),
        "released": len(v.released),
        "step": v.step,
        "checkpoint_step": v.checkpoint.step if v.checkpoint else None,
        "checkpoint_steps": [r.checkpoint.step if r.checkpoint else None for r in v.ranks],
        "lag_samples": len(behind),
        "lag_bytes": lag_bytes,
        "lag_seconds": lag_s,
        "stopped_ranks": dead,
    }
    return line, figures, trouble


def _unnamed(run, v: ConsumerView, window: Window | None, consumed: set[int]) -> list[Trouble]:
    """A consumer the deleting window does not wait for, some of whose samples were deleted."""
    if window is None or not window.delete or v.name in window.consumers:
        return []
    lost = consumed - v.acknowledged
    if not lost:
        return []
    return [
        Trouble(
            f"{v.name} is not among the window's consumers and {len(lost):,} samples it has not trained were "
            "deleted as consumed",
            f"consumer {v.name} cannot finish on this run: read a run that deletes nothing, or name the consumer "
            "in the --window of a new run",
        )
    ]


def _stuck(v: ConsumerView, state: WindowState, now: float) -> list[Trouble]:
    """A named consumer the paused window waits for that cannot release anything: a rank without a
    declared checkpoint, or every live rank waiting for a sample the window holds back (its
    checkpoints are further apart than the window holds)."""
    if now - state.paused_since < STALLED_AFTER:
        return []
    unsaved = [r.rank for r in v.ranks if r.acks and r.checkpoint is None]
    if unsaved:
        return [
            Trouble(
                f"{v.name} acknowledges steps but rank{'s' if len(unsaved) > 1 else ''} "
                f"{', '.join(map(str, unsaved))} declared no checkpoint: it releases nothing, and the window waits",
                "call checkpointed(step) on every rank once each checkpoint is durable (docs/streaming.md)",
            )
        ]
    live = [r for r in v.ranks if r.record is not None and r.state == Liveness.ALIVE]
    waiting = [
        r
        for r in live
        if r.record.waiting_for is not None
        and r.record.waiting_why == NOT_WRITTEN
        and now - (r.record.waiting_since or now) >= STALLED_AFTER
    ]
    if not live or len(waiting) < len(live):
        return []
    last = max(a.step for r in v.ranks for a in r.acks) if any(r.acks for r in v.ranks) else 0
    points = ", ".join(str(r.checkpoint.step) if r.checkpoint else "none" for r in v.ranks)
    return [
        Trouble(
            f"{v.name} waits for samples the paused window holds back and releases nothing before its next "
            f"checkpoint (acknowledged through step {last}, checkpoints at step {points}): its checkpoints are "
            "further apart than the window holds",
            "declare checkpoints more often (the window must hold the steps between two of them and a shard), "
            "or extract into a new run with a larger --window (or a --window-limit past it)",
        )
    ]
