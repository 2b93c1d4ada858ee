"""The volume line of ``hsx status``: the job's projection (``job.space``) as a verdict."""

from __future__ import annotations

from pathlib import Path

from hsx.assess.checks import Check
from hsx.job.space import Projection
from hsx.units import size


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
        "ratio_basis": p.basis,
    }
    figure = (
        f"{v.fstype} {v.mount}: {size(v.free)} free of {size(v.total)}; rest of run needs "
        f"{size(p.needed_bytes)} + {size(p.reserve)} reserve; margin {size(p.margin)}"
        + (f" ({p.basis})" if p.basis else "")
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
