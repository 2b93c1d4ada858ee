"""The interconnect line: how fast the GPUs of a multi-GPU run's layout move data between them
(``hsx.interconnect``), measured afresh where no extractor of the run holds them, else as the run
last recorded it; a figure far below what the link gives warns, with the known fixes."""

from __future__ import annotations

from pathlib import Path

from hsx import interconnect
from hsx.assess.checks import Check
from hsx.errors import InterconnectHung


def check(run: Path, gpus: int, busy: bool) -> Check:
    """``gpus``: the GPUs one replica of the run spans; ``busy``: an extractor of the run holds them
    (measuring beside it would take their memory and bandwidth from it)."""
    if gpus < 2:
        return Check("interconnect", "ok", "one GPU a replica: nothing joins GPUs", data={"gpus": gpus})
    topology = None if busy else interconnect.read_topology(gpus)
    if topology is not None and len(topology.names) >= gpus:
        try:
            found = interconnect.measure(gpus, "cuda")
        except InterconnectHung as e:
            said, *fixes = str(e).split("\n")
            fixes = [f.strip().removeprefix("fix: ") for f in fixes]
            return Check("interconnect", "fail", f"{said} (measured now)", [f"fix: {f}" for f in fixes[1:]], fixes[0])
        if found is not None:
            verdict = interconnect.judge(found, topology)
            interconnect.record(run, verdict)
            return _check(verdict.to_json(), verdict.figure(), "measured now")
    kept = interconnect.recorded(run)
    if not kept:
        why = "its extractor holds the GPUs" if busy else f"this machine does not show {gpus} GPUs"
        return Check("interconnect", "ok", f"not measured ({why}), and none recorded", data={"gpus": gpus})
    last = kept[-1]
    if last.get("hung"):
        return _check(last, last["slow"][0], f"recorded {last['when']} on {last['host']}")
    m = last["measurement"]
    figure = (
        f"{m['ranks']} GPUs: all-reduce {m['allreduce_gbps']:,.1f} GB/s bus bandwidth, neighbour to neighbour "
        f"{min(m['p2p_gbps'], default=0.0):,.1f} GB/s at the slowest"
    )
    return _check(last, figure, f"recorded {last['when']} on {last['host']}")


def _check(verdict: dict, figure: str, when: str) -> Check:
    slow, fixes = verdict["slow"], verdict["fixes"]
    return Check(
        "interconnect",
        "fail" if verdict.get("hung") else "warn" if slow else "ok",
        f"{figure} ({when})",
        details=[f"far below what the link gives: {s}" for s in slow if not verdict.get("hung")]
        + [f"fix: {f}" for f in fixes[1:]],
        action=fixes[0] if fixes else None,
        data=verdict,
    )
