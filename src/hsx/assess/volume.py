"""The output volume: free space against what the rest of the run needs, and the disk guard.

Projection: every remaining token costs the run's ``bytes_per_token`` (its layers, hidden size and
dtype), every remaining file a header plus allocation rounding. The reserve kept free while running
is max(1% of the volume, 2x the largest batch): the guard stops before each batch whose bytes, plus
what the writer still holds in flight, would cut into it. A real ENOSPC is still handled by the
store (``DiskFull``); the guard only makes the common case a clean stop before the volume is full.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from hsx.assess.checks import Check, size
from hsx.errors import LowSpace, NotEnoughSpace
from hsx.spec import RunSpec
from hsx.store.scan import ShardScan

FILE_OVERHEAD = 3 << 10  # header (~0.6 KiB) + half a 4 KiB block of allocation rounding, on average
INODE_HEADROOM = 16  # temp files of writes in flight, lock and metrics rewrites


@dataclass(frozen=True)
class Volume:
    path: Path
    mount: str
    fstype: str
    device: str
    total: int
    free: int  # available to this process, as ENOSPC will judge it
    inodes_free: int | None = None  # None where the filesystem has no fixed inode table (btrfs, ...)


def volume_of(path: Path) -> Volume:
    """The filesystem holding ``path`` (or its nearest existing parent)."""
    path = Path(path).absolute()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    st = os.statvfs(probe)
    real = os.path.realpath(probe)
    best = None
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (real == mp or real.startswith(mp.rstrip("/") + "/")) and (best is None or len(mp) > len(best.mountpoint)):
            best = part
    return Volume(
        path=path,
        mount=best.mountpoint if best else "?",
        fstype=best.fstype if best else "?",
        device=best.device if best else "?",
        total=usage.total,
        free=usage.free,
        inodes_free=st.f_favail if st.f_files else None,
    )


def projected_bytes(tokens: int, samples: int, bytes_per_token: int) -> int:
    return tokens * bytes_per_token + samples * FILE_OVERHEAD


def largest_batch_bytes(batch_tokens: int, longest: int, bytes_per_token: int) -> int:
    """A batch holds at most ``batch_tokens`` real tokens, or the one sample longer than that."""
    return max(batch_tokens, longest) * bytes_per_token


def default_reserve(volume_total: int, batch_bytes: int) -> int:
    return max(volume_total // 100, 2 * batch_bytes)


@dataclass(frozen=True)
class Projection:
    """What the rest of a run needs against what the volume has."""

    volume: Volume
    total_bytes: int  # the whole run's projected size
    written_bytes: int  # verified files already on disk
    needed_bytes: int  # still to write
    reserve: int
    needed_inodes: int = 0  # one per file still to write, one per shard folder still to create

    @property
    def margin(self) -> int:
        return self.volume.free - self.needed_bytes - self.reserve

    @property
    def inodes_short(self) -> int:
        free = self.volume.inodes_free
        return 0 if free is None else max(self.needed_inodes + INODE_HEADROOM - free, 0)

    @property
    def fits(self) -> bool:
        return self.margin >= 0 and not self.inodes_short

    def describe(self) -> str:
        v = self.volume
        return (
            f"projected size {size(self.total_bytes)} ({size(self.written_bytes)} on disk, "
            f"{size(self.needed_bytes)} still to write); {size(v.free)} free on {v.mount} ({v.fstype}), "
            f"reserve {size(self.reserve)}, margin {size(self.margin)}"
        )

    def shortfall(self) -> str:
        parts = []
        if self.margin < 0:
            parts.append(
                f"{size(self.needed_bytes)} still to write + {size(self.reserve)} reserve, but only "
                f"{size(self.volume.free)} free (short by {size(-self.margin)})"
            )
        if self.inodes_short:
            parts.append(
                f"{self.needed_inodes:,} files still to create, but only {self.volume.inodes_free:,} inodes free "
                f"(short by {self.inodes_short:,})"
            )
        return "; ".join(parts)

    def refusal(self, out: Path) -> str:
        return (
            f"not enough space on {self.volume.mount} ({self.volume.fstype}) for this run: {self.shortfall()}.\n"
            f"Free space or move {out} to a larger volume; or run what fits now and resume later: "
            f"hsx extract --out {out} --allow-partial"
        )


def project(
    out: Path,
    bytes_per_token: int,
    total_tokens: int,
    total_samples: int,
    left_tokens: int,
    left_samples: int,
    written_bytes: int,
    batch_bytes: int,
    reserve: int | None = None,
    new_dirs: int = 0,
) -> Projection:
    vol = volume_of(out)
    return Projection(
        volume=vol,
        total_bytes=projected_bytes(total_tokens, total_samples, bytes_per_token),
        written_bytes=written_bytes,
        needed_bytes=projected_bytes(left_tokens, left_samples, bytes_per_token),
        reserve=default_reserve(vol.total, batch_bytes) if reserve is None else reserve,
        needed_inodes=left_samples + new_dirs,
    )


def check(p: Projection, out: Path) -> Check:
    """The volume line of ``hsx status``."""
    v = p.volume
    data = {
        "mount": v.mount,
        "fstype": v.fstype,
        "device": v.device,
        "total": v.total,
        "free": v.free,
        "projected_total": p.total_bytes,
        "written": p.written_bytes,
        "needed": p.needed_bytes,
        "reserve": p.reserve,
        "margin": p.margin,
        "inodes_free": v.inodes_free,
        "inodes_needed": p.needed_inodes,
    }
    figure = (
        f"{v.fstype} {v.mount}: {size(v.free)} free of {size(v.total)}; rest of run needs "
        f"{size(p.needed_bytes)} + {size(p.reserve)} reserve; margin {size(p.margin)}"
    )
    if p.needed_bytes == 0:
        return Check("volume", "ok", f"{v.fstype} {v.mount}: {size(v.free)} free; nothing left to write", data=data)
    if not p.fits:
        return Check(
            "volume",
            "fail",
            figure if not p.inodes_short else f"{v.fstype} {v.mount}: {p.shortfall()}",
            action=f"free space on {v.mount} ({p.shortfall()}), or resume what fits with --allow-partial",
            data=data,
        )
    if p.margin < p.needed_bytes // 10:
        return Check("volume", "warn", figure + " (under 10% headroom)", data=data)
    return Check("volume", "ok", figure, data=data)


class DiskGuard:
    """Called before each batch is captured; raises ``LowSpace`` when the batch would eat the reserve."""

    def __init__(self, out: Path, reserve: int, in_flight: Callable[[], int] = lambda: 0):
        self.out, self.reserve, self.in_flight = out, reserve, in_flight

    def __call__(self, batch_bytes: int) -> None:
        free = shutil.disk_usage(self.out).free
        pending = self.in_flight() + batch_bytes
        if free - pending < self.reserve:
            raise LowSpace(
                self.out,
                free,
                pending,
                self.reserve,
                f"free space on the output volume ({size(free)}, {size(pending)} of it promised to writes "
                f"in flight) is under the reserve of {size(self.reserve)}",
            )


def check_space(
    run: Path,
    spec: RunSpec,
    lengths: np.ndarray,
    scans: list[ShardScan],
    allow_partial: bool,
    reserve: int | None,
    log: Callable[[str], None],
) -> int:
    """At start: print the projection, refuse when it does not fit; returns the bytes to keep free."""
    missing = np.asarray([i for s in scans for i in s.missing], dtype=np.int64)
    proj = project(
        run,
        spec.bytes_per_token,
        spec.plan.num_tokens,
        spec.plan.num_samples,
        int(lengths[missing].sum()),
        len(missing),
        sum(r.size for s in scans for r in s.good.values()),
        largest_batch_bytes(spec.batch_tokens, int(lengths.max()), spec.bytes_per_token),
        reserve,
        new_dirs=sum(1 for s in scans if not s.good and not s.problems),
    )
    log(f"space: {proj.describe()}")
    if proj.needed_bytes and not proj.fits:
        if not allow_partial:
            raise NotEnoughSpace(proj.refusal(run))
        log(
            f"warning: {proj.shortfall()}; --allow-partial: extracting until the volume is too full "
            "to go on, then stopping cleanly"
        )
    return proj.reserve
