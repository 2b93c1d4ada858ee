"""Progress from what is verified on disk: samples, tokens and bytes done, and each shard's state.

Counts come from the scan, never from a counter the writer kept: a file that exists but fails its
check is not done (a sealed shard's file unchanged since sealing counts as checked: it was verified
before its manifest was written). Shards are summarised as sealed / partial / untouched with compact id ranges, so
the line stays short for thousands of shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hsx.assess.checks import Check, ranges
from hsx.store.scan import ShardScan
from hsx.units import size


@dataclass
class Tally:
    samples_total: int
    tokens_total: int
    samples_done: int = 0
    tokens_done: int | None = 0  # None when the plan is unreadable (lengths unknown)
    bytes_done: int = 0
    shards: dict[str, list[int]] = field(default_factory=lambda: {"sealed": [], "partial": [], "untouched": []})
    complete_unsealed: list[int] = field(default_factory=list)  # all files good, SEALED still to write
    consumed: int = 0  # done, then deleted once every consumer released them (counted in samples_done)

    @property
    def complete(self) -> bool:
        return self.samples_done == self.samples_total

    @property
    def samples_left(self) -> int:
        return self.samples_total - self.samples_done

    @property
    def tokens_left(self) -> int:
        return self.tokens_total - (self.tokens_done or 0)


def tally(scans: list[ShardScan], samples_total: int, tokens_total: int, lengths: np.ndarray | None) -> Tally:
    t = Tally(samples_total, tokens_total)
    done_ids: list[int] = []
    for s in scans:
        done_ids += list(s.accounted)
        t.consumed += len(s.accounted) - len(s.good)
        t.bytes_done += sum(r.size for r in s.good.values())
        state = s.state
        if state != "sealed" and s.complete:
            t.complete_unsealed.append(s.shard)
            state = "partial"
        t.shards[state].append(s.shard)
    t.samples_done = len(done_ids)
    if lengths is None:
        t.tokens_done = None
    else:
        t.tokens_done = int(lengths[np.asarray(done_ids, dtype=np.int64)].sum())
    return t


def check(t: Tally, command: str = "extract") -> Check:
    """The progress line. Incomplete is a fact, not a fault: the level stays ok."""
    tokens = f"{t.tokens_done:,}/{t.tokens_total:,} tokens" if t.tokens_done is not None else "tokens unknown"
    pct = 100 * t.samples_done / t.samples_total if t.samples_total else 100.0
    sh = t.shards
    figure = (
        f"{t.samples_done:,}/{t.samples_total:,} samples ({pct:.1f}%), {tokens}, {size(t.bytes_done)}; "
        f"shards {len(sh['sealed'])} sealed, {len(sh['partial'])} partial, {len(sh['untouched'])} untouched"
    )
    details = []
    if t.consumed:
        details.append(f"{t.consumed:,} of them consumed: deleted once every consumer released them, never redone")
    if sh["partial"]:
        details.append(f"partial shards: {ranges(sh['partial'])}")
    if t.complete_unsealed:
        details.append(f"complete but not sealed yet (hsx {command} seals them): {ranges(t.complete_unsealed)}")
    if sh["untouched"] and sh["sealed"]:
        details.append(f"untouched shards: {ranges(sh['untouched'])}")
    data = {
        "samples_done": t.samples_done,
        "samples_total": t.samples_total,
        "tokens_done": t.tokens_done,
        "tokens_total": t.tokens_total,
        "bytes_done": t.bytes_done,
        "consumed": t.consumed,
        "shards": {k: len(v) for k, v in sh.items()},
        "partial_shards": sh["partial"],
        "complete": t.complete,
    }
    return Check("progress", "ok", figure, details=details, data=data)
