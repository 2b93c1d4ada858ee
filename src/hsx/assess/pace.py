"""The run's pace over days, from its metrics history (``hsx.telemetry``): the recent rate, the
projected finish, and whether the free space, falling as it has lately, lasts until then.

The volume check projects the run's own writes against free space; this one watches the trend,
which also counts what else writes to the volume (another job, logs, a checkpoint copy). A run
that wrote nothing in the window has no finish to race: the trend is then told as others' writes,
never as this run running out of space (the volume check still weighs what the run needs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from hsx.assess.checks import Check, duration
from hsx.telemetry import Point
from hsx.units import size

WINDOW = 30 * 60.0  # the recent rate spans (at least) the last half hour of the history


@dataclass(frozen=True)
class Pace:
    first: Point  # the window's first point
    last: Point  # the history's last point

    @property
    def seconds(self) -> float:
        return self.last.time - self.first.time

    @property
    def rate(self) -> float:
        """Tokens a second over the window (all sessions: the wall clock includes any downtime)."""
        return (self.last.tokens_done - self.first.tokens_done) / self.seconds

    @property
    def eta(self) -> float | None:
        left = self.last.tokens_total - self.last.tokens_done
        return left / self.rate if self.rate > 0 else None

    @property
    def free_fall(self) -> float:
        """Bytes a second the free space fell over the window (negative: it grew)."""
        return (self.first.free_bytes - self.last.free_bytes) / self.seconds

    @property
    def runs_out(self) -> float | None:
        """Seconds from the last point until the free space is gone at ``free_fall``."""
        return self.last.free_bytes / self.free_fall if self.free_fall > 0 else None


def pace(points: list[Point], window: float = WINDOW) -> Pace | None:
    """Over the last ``window`` seconds of the history (from the last point before it, so a
    window always spans two points); None with fewer than two points, or none apart in time."""
    if len(points) < 2:
        return None
    last = points[-1]
    first = next((p for p in reversed(points[:-1]) if last.time - p.time >= window), points[0])
    if last.time <= first.time:
        return None
    return Pace(first, last)


def check(p: Pace | None, complete: bool, now: float | None = None) -> Check:
    if p is None:
        return Check("pace", "ok", "no metrics history yet (a running job adds a line a minute)")
    now = time.time() if now is None else now
    age = duration(now - p.last.time)
    data = {
        "tokens_per_s": p.rate,
        "window_s": p.seconds,
        "eta_s": p.eta,
        "free_bytes": p.last.free_bytes,
        "free_fall_bytes_per_s": p.free_fall,
        "runs_out_s": p.runs_out,
        "as_of": p.last.time,
    }
    recent = f"{p.rate:,.0f} tok/s over the {duration(p.seconds)} to {age} ago"
    if complete:
        return Check("pace", "ok", f"finished; {recent}", data=data)
    if p.eta is None:  # the run wrote nothing: a falling free space is others' writes, not this run's pace
        others = f"; free space fell {size(p.free_fall * 3600)}/h from other writers" if p.free_fall > 0 else ""
        return Check("pace", "ok", f"{recent}; no progress in that window{others}", data=data)
    figure = f"{recent}; finish in {duration(p.eta)} at that rate"
    if p.runs_out is not None and p.runs_out < p.eta:
        return Check(
            "pace",
            "warn",
            f"{figure}; free space ({size(p.last.free_bytes)}) falls {size(p.free_fall * 3600)}/h "
            f"and runs out in {duration(p.runs_out)}, before the run ends",
            action="free space on the output volume, or find what else writes to it",
            data=data,
        )
    return Check("pace", "ok", figure, data=data)
