"""The verdict vocabulary shared by every check: ok / warn / fail, and who must act on a fail.

Exit codes follow from it (``errors.Exit``): 0 when nothing is wrong (warnings allowed), 1 when
``hsx extract`` redoes the damage by itself, 2 when a person must act before resuming.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from hsx.errors import Exit

Level = Literal["ok", "warn", "fail"]


@dataclass
class Check:
    name: str
    level: Level
    figure: str  # the one-line verdict, with the numbers behind it
    details: list[str] = field(default_factory=list)
    action: str | None = None  # what to do about a warn or fail
    redo: bool = False  # a fail that ``hsx extract`` repairs by itself (exit 1, not 2)
    data: dict = field(default_factory=dict)  # the figures, for --json

    @property
    def exit_code(self) -> int:
        if self.level != "fail":
            return Exit.OK
        return Exit.REDO if self.redo else Exit.ACT

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "level": self.level,
            "figure": self.figure,
            "details": self.details,
            "action": self.action,
            "redo_by_extract": self.redo,
            "exit_code": self.exit_code,
            "data": self.data,
        }


def exit_code(checks: Iterable[Check]) -> int:
    return max((c.exit_code for c in checks), default=Exit.OK)


def skipped(name: str, why: str) -> Check:
    """A check that cannot run because something it needs failed; the cause is reported elsewhere."""
    return Check(name, "warn", f"not checked: {why}")


def ranges(ids: Iterable[int], limit: int = 6) -> str:
    """Compact id list: ``3, 7-9, 12-3999 (+2 more ranges)``, readable for thousands of shards."""
    spans: list[list[int]] = []
    for i in sorted(ids):
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans[:limit])
    if len(spans) > limit:
        text += f" (+{len(spans) - limit} more ranges)"
    return text


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
