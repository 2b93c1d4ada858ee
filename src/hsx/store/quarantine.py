"""Moving a bad file aside: never deleted, always with its reason, so a person can look later.

``OUT/quarantine/<its path>`` (suffixed .1, .2, ... if taken) plus ``<that>.reason`` (kind, detail,
sample id, time). Used by ``hsx verify --repair`` and by a resume for files that belong nowhere.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from hsx.store import layout
from hsx.store.durable import fsync_dir, write_durable
from hsx.store.scan import Problem


@dataclass
class Moved:
    path: str  # where it was, relative to the run
    to: str  # where it is now, relative to the run
    kind: str
    sample_id: int | None


def aside(run: Path, rel: str) -> Path:
    dest = run / layout.QUARANTINE / rel
    n = 1
    while dest.exists() or dest.with_name(dest.name + ".reason").exists():
        dest = run / layout.QUARANTINE / f"{rel}.{n}"
        n += 1
    return dest


def quarantine(run: Path, p: Problem) -> Moved | None:
    """Move one bad file aside with its reason; None when there is no file to move (``missing``)."""
    src = run / p.path
    if not src.exists():
        return None
    dest = aside(run, p.path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    reason = {"kind": p.kind, "detail": p.detail, "sample_id": p.sample_id, "from": p.path, "time": time.time()}
    write_durable(dest.with_name(dest.name + ".reason"), (json.dumps(reason) + "\n").encode())
    os.rename(src, dest)  # same volume: atomic, never a copy that could be cut short
    fsync_dir(dest.parent)
    fsync_dir(src.parent)
    return Moved(p.path, str(dest.relative_to(run)), p.kind, p.sample_id)
