"""The output volume: free space against what the rest of a run needs, and the disk guard, for every
job (an extraction's states, a generate run's conversations: ``spec.Footprint`` says what a token costs).

Projection: every remaining token costs the run's ``bytes_per_token`` (its layers, hidden size and
dtype) times the storage codec's ratio (``stored_ratio``: stored bytes per raw byte), every
remaining file a header plus allocation rounding. The reserve kept free while running is max(1% of
the volume, 2x the largest batch, raw): the guard stops before each batch whose bytes, plus what
the writer still holds in flight, would cut into it, both at the codec's ratio. A real ENOSPC is
still handled by the store (``DiskFull``); the guard only makes the common case a clean stop before
the volume is full.

The codec's ratio: raw is 1 and fp8's is known in advance (``codec.prior_ratio``). zstd's depends
on the states, so it is measured: on a resume from the files on disk, on a new run from its own
first ``MIN_FILES`` files; until then its prior is 1.0 (lossless compression promises nothing),
and a measured one gets ``MARGIN`` on top (the rest of a run may compress a little worse than its
start). A new zstd run that does not fit at raw size starts anyway, and the guard decides once the
ratio is measured: it stops with ``NotEnoughSpace`` if the rest still does not fit (the files
written so far are kept), exactly as the start would have refused it (``Forecast``).
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

from hsx.errors import LowSpace, NotEnoughSpace
from hsx.spec import JobSpec
from hsx.store.codec import Codec, prior_ratio
from hsx.store.scan import ShardScan
from hsx.units import size

FILE_OVERHEAD = 3 << 10  # header (~0.6 KiB) + half a 4 KiB block of allocation rounding, on average
INODE_HEADROOM = 16  # temp files of writes in flight, lock and metrics rewrites
MIN_FILES = 8  # files measured before a codec's measured ratio replaces its prior
MARGIN = 0.05  # added to a measured ratio (relative): later samples may compress a little worse


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


def projected_bytes(tokens: int, samples: int, bytes_per_token: int, ratio: float = 1.0) -> int:
    """What ``samples`` files of ``tokens`` tokens take, their states stored at ``ratio`` of raw."""
    raw = tokens * bytes_per_token
    return (raw if ratio == 1.0 else math.ceil(raw * ratio)) + samples * FILE_OVERHEAD


@dataclass(frozen=True)
class Measured:
    """Sample files written: how many, what their tokens take raw (tokens x bytes per token) and
    what the files take on disk."""

    files: int = 0
    raw: int = 0
    stored: int = 0

    def __add__(self, other: Measured) -> Measured:
        return Measured(self.files + other.files, self.raw + other.raw, self.stored + other.stored)

    @classmethod
    def on_disk(cls, spec: JobSpec, lengths: np.ndarray, scans: list[ShardScan]) -> Measured:
        """The good files of a scan."""
        good = [r for s in scans for r in s.good.values()]
        tokens = int(lengths[[r.sample_id for r in good]].sum()) if good else 0
        return cls(len(good), tokens * spec.footprint().bytes_per_token, sum(r.size for r in good))


def stored_ratio(spec: JobSpec, measured: Measured = Measured()) -> float:
    """Stored bytes per raw byte to project a run's states with, erring high: 1 for raw (and for
    files without states), fp8's exact ratio; for zstd 1.0 until ``MIN_FILES`` files are measured,
    then their ratio plus ``MARGIN``, never above max(1, the ratio measured)."""
    fp = spec.footprint()
    if fp.codec is None:
        return 1.0
    prior = prior_ratio(fp.codec, fp.itemsize, fp.hidden_size)
    if fp.codec is not Codec.ZSTD or measured.files < MIN_FILES or measured.raw <= 0:
        return prior
    r = measured.stored / measured.raw
    return min(r * (1 + MARGIN), max(1.0, r))


def ratio_basis(spec: JobSpec, measured: Measured) -> str:
    """How ``stored_ratio`` was reached, for the projection's line."""
    fp = spec.footprint()
    if fp.codec in (None, Codec.RAW):
        return ""
    ratio = stored_ratio(spec, measured)
    if fp.codec is not Codec.ZSTD:
        return f"{fp.codec} stores {ratio:.3f} of raw"
    if measured.files < MIN_FILES:
        return f"zstd at raw size until its ratio is measured on {MIN_FILES} files"
    return (
        f"zstd at {ratio:.3f} of raw: {measured.stored / measured.raw:.3f} measured on {measured.files} files "
        f"+ {MARGIN:.0%}"
    )


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
    basis: str = ""  # how the codec's ratio was reached (``ratio_basis``); empty for raw

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
        basis = f", {self.basis}" if self.basis else ""
        return (
            f"projected size {size(self.total_bytes)} ({size(self.written_bytes)} on disk, "
            f"{size(self.needed_bytes)} still to write{basis}); {size(v.free)} free on {v.mount} ({v.fstype}), "
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

    def refusal(self, out: Path, command: str = "extract") -> str:
        """``command``: the job's (``hsx COMMAND --out OUT --allow-partial`` runs what fits)."""
        return (
            f"not enough space on {self.volume.mount} ({self.volume.fstype}) for this run: {self.shortfall()}.\n"
            f"Free space or move {out} to a larger volume; or run what fits now and resume later: "
            f"hsx {command} --out {out} --allow-partial"
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
    ratio: float = 1.0,
    basis: str = "",
) -> Projection:
    """``ratio``: stored / raw bytes of the states still to write (``stored_ratio``)."""
    vol = volume_of(out)
    return Projection(
        volume=vol,
        total_bytes=written_bytes + projected_bytes(left_tokens, left_samples, bytes_per_token, ratio)
        if ratio != 1.0
        else projected_bytes(total_tokens, total_samples, bytes_per_token),
        written_bytes=written_bytes,
        needed_bytes=projected_bytes(left_tokens, left_samples, bytes_per_token, ratio),
        reserve=default_reserve(vol.total, batch_bytes) if reserve is None else reserve,
        needed_inodes=left_samples + new_dirs,
        basis=basis,
    )


def _nothing_yet() -> tuple[int, int, int]:
    return 0, 0, 0


@dataclass(frozen=True)
class Start:
    """What the start found, as a guard in another process needs it (plain data: it crosses to the
    scale-out workers as JSON). ``on_disk``: the files on disk. ``undecided``: the start could not
    tell whether the run fits (zstd, nothing measured, the raw size too large). ``left_tokens``,
    ``left_files``: what was still to write."""

    on_disk: Measured = Measured()
    undecided: bool = False
    left_tokens: int = 0
    left_files: int = 0


@dataclass
class Forecast:
    """What a run's writes will take, re-judged while it runs: the ratio its guard scales raw
    bytes by, from the files on disk at the start and those this session has written since.

    ``session``: this process's (files, tokens, bytes) written so far (``Progress.session``). An
    undecided start is decided by the guard: it projects the rest once ``MIN_FILES`` are measured,
    and refuses then."""

    spec: JobSpec
    start: Start = Start()
    session: Callable[[], tuple[int, int, int]] = _nothing_yet
    decided: bool = field(default=False, init=False)

    def measured(self, session: tuple[int, int, int] | None = None) -> Measured:
        files, tokens, stored = session or self.session()
        return self.start.on_disk + Measured(files, tokens * self.spec.footprint().bytes_per_token, stored)

    def ratio(self) -> float:
        return stored_ratio(self.spec, self.measured())

    def needed(self, left_tokens: int, left_files: int = 0) -> int:
        """What ``left_files`` files of ``left_tokens`` tokens still take, at the ratio measured so far."""
        return projected_bytes(left_tokens, left_files, self.spec.footprint().bytes_per_token, self.ratio())

    def decide(self, out: Path, reserve: int) -> None:
        """Once measured, project the rest of an undecided run: refuse (``NotEnoughSpace``) if it
        does not fit; otherwise it is decided and the guard only checks batches from then on."""
        if not self.start.undecided or self.decided:
            return
        files, tokens, _ = session = self.session()
        m = self.measured(session)
        if m.files < MIN_FILES:
            return
        left_tokens = max(self.start.left_tokens - tokens, 0)
        left_files = max(self.start.left_files - files, 0)
        fp = self.spec.footprint()
        proj = project(
            out,
            fp.bytes_per_token,
            self.spec.plan.num_tokens,
            self.spec.plan.num_samples,
            left_tokens,
            left_files,
            m.stored,
            0,
            reserve,
            ratio=stored_ratio(self.spec, m),
            basis=ratio_basis(self.spec, m),
        )
        self.decided = True
        if proj.margin < 0:
            raise NotEnoughSpace(
                f"measured on its first {m.files} files: {proj.refusal(out)}\n"
                "The samples written so far are kept; a resume verifies them and writes only the rest."
            )


class DiskGuard:
    """Called before each batch is captured; raises ``LowSpace`` when the batch would eat the reserve.

    ``batch_bytes`` and ``in_flight`` are raw bytes (tokens x bytes per token); ``forecast`` scales
    them by the codec's current ratio and decides a run its start left undecided."""

    def __init__(
        self,
        out: Path,
        reserve: int,
        in_flight: Callable[[], int] = lambda: 0,
        forecast: Forecast | None = None,
    ):
        self.out, self.reserve, self.in_flight, self.forecast = out, reserve, in_flight, forecast

    def __call__(self, batch_bytes: int) -> None:
        free = shutil.disk_usage(self.out).free
        pending = self.in_flight() + batch_bytes
        if self.forecast is not None:
            self.forecast.decide(self.out, self.reserve)
            pending = math.ceil(pending * self.forecast.ratio())
        if free - pending < self.reserve:
            raise LowSpace(
                self.out,
                free,
                pending,
                self.reserve,
                f"free space on the output volume ({size(free)}, {size(pending)} of it promised to writes "
                f"in flight) is under the reserve of {size(self.reserve)}",
            )


@dataclass(frozen=True)
class Space:
    """The start's verdict on a run's space: the bytes to keep free, and the forecast its guard uses."""

    reserve: int
    forecast: Forecast


def plan_space(
    run: Path,
    spec: JobSpec,
    lengths: np.ndarray,
    scans: list[ShardScan],
    allow_partial: bool,
    reserve: int | None,
    log: Callable[[str], None],
    measure_first: bool = False,
    command: str = "extract",
) -> Space:
    """At start: print the projection, refuse when it does not fit. ``measure_first``: the caller
    hands the forecast to its guard, so a run whose ratio is still unmeasured (zstd) and whose raw
    size does not fit starts and is judged on its first files (``Forecast.decide``). ``command``:
    the job's, in what the refusal tells to run."""
    fp = spec.footprint()
    missing = np.asarray([i for s in scans for i in s.missing], dtype=np.int64)
    on_disk = Measured.on_disk(spec, lengths, scans)
    proj = project(
        run,
        fp.bytes_per_token,
        spec.plan.num_tokens,
        spec.plan.num_samples,
        int(lengths[missing].sum()),
        len(missing),
        on_disk.stored,
        largest_batch_bytes(fp.batch_tokens, int(lengths.max()), fp.bytes_per_token),
        reserve,
        new_dirs=sum(1 for s in scans if not s.good and not s.problems),
        ratio=stored_ratio(spec, on_disk),
        basis=ratio_basis(spec, on_disk),
    )
    log(f"space: {proj.describe()}")
    unmeasured = fp.codec is Codec.ZSTD and on_disk.files < MIN_FILES
    undecided = False
    if proj.needed_bytes and not proj.fits:
        if unmeasured and measure_first and not allow_partial and not proj.inodes_short:
            undecided = True
            log(
                f"space: {proj.shortfall()} at raw size; zstd stores less, so the run starts and is "
                f"judged again on its first {MIN_FILES} files"
            )
        elif not allow_partial:
            raise NotEnoughSpace(proj.refusal(run, command))
        else:
            log(
                f"warning: {proj.shortfall()}; --allow-partial: hsx {command} writes until the volume is too full "
                "to go on, then stops cleanly"
            )
    start = Start(on_disk, undecided, int(lengths[missing].sum()), len(missing))
    return Space(proj.reserve, Forecast(spec, start))
