"""Who holds the GPUs: NVML readings turned into a verdict, and inference servers enabled at boot.

Readings are plain data (``GpuReading``) so the judging can be tested without a GPU. Memory is judged
from NVML's v2 info, whose ``used`` excludes the driver's reservation: v1 ``used`` reports ~615 MiB
on an idle H200 (driver 580), which would make every idle card look busy. A process on a GPU that is
not this run's extractor (or its children) is foreign: after a reboot, an auto-started inference
server takes the cards back, and resuming would fail with out-of-memory far from the cause.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from hsx.assess.checks import Check, size

MiB = 1 << 20
IDLE_V2 = 256 * MiB  # v2 ``used`` (reservation excluded) on an idle card is a few MiB
IDLE_V1 = 1024 * MiB  # v1 ``used`` includes the reservation; only a coarse judgment is possible

# unit names of inference servers that grab GPUs when started at boot
SERVER_UNITS = re.compile(
    r"vllm|sglang|triton|text-generation|\btgi\b|ollama|lmdeploy|llama[-_.]?(cpp|server)|localai|xinference"
    r"|tensorrt|\bnim\b|aphrodite|koboldcpp|tabby|inference|infer-server|model-server|lorax",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used: int | None  # bytes; None where NVML cannot tell (e.g. some MIG or container setups)


@dataclass(frozen=True)
class GpuReading:
    index: int
    name: str
    total: int
    used: int  # v2 ``used`` when the driver has it, else v1 ``used``
    reserved: int = 0  # driver reservation (v2 only)
    v2: bool = True
    processes: list[GpuProcess] = field(default_factory=list)


def _process_name(pid: int, nvml) -> str:
    try:
        return psutil.Process(pid).name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass
    try:  # a pid from another namespace (container) is unknown to psutil
        name = nvml.nvmlSystemGetProcessName(pid)
        return Path(name.decode() if isinstance(name, bytes) else name).name
    except Exception:
        return "?"


def read_gpus() -> list[GpuReading] | str:
    """Every visible GPU's memory and processes, or why none can be seen."""
    try:
        import pynvml as nvml
    except ImportError:
        return "nvidia-ml-py is not installed"
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        return f"NVML unavailable ({e})"
    try:
        out = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            try:
                mem = nvml.nvmlDeviceGetMemoryInfo(h, version=nvml.nvmlMemory_v2)
                total, used, reserved, v2 = mem.total, mem.used, mem.reserved, True
            except nvml.NVMLError:
                mem = nvml.nvmlDeviceGetMemoryInfo(h)
                total, used, reserved, v2 = mem.total, mem.used, 0, False
            seen: dict[int, GpuProcess] = {}
            for query in (nvml.nvmlDeviceGetComputeRunningProcesses, nvml.nvmlDeviceGetGraphicsRunningProcesses):
                try:
                    procs = query(h)
                except nvml.NVMLError:
                    continue
                for p in procs:
                    mem_used = p.usedGpuMemory if isinstance(p.usedGpuMemory, int) else None
                    if mem_used is not None and mem_used >= (1 << 63):  # NVML_VALUE_NOT_AVAILABLE
                        mem_used = None
                    seen.setdefault(p.pid, GpuProcess(p.pid, _process_name(p.pid, nvml), mem_used))
            out.append(GpuReading(i, name, total, used, reserved, v2, list(seen.values())))
        return out
    except nvml.NVMLError as e:
        return f"NVML query failed ({e})"
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def own_pids(holder_pid: int | None) -> set[int]:
    """This run's extractor and its children (workers, compile helpers) are not foreign."""
    pids = {psutil.Process().pid}
    if holder_pid is None:
        return pids
    pids.add(holder_pid)
    try:
        pids |= {c.pid for c in psutil.Process(holder_pid).children(recursive=True)}
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass
    return pids


def enabled_server_units(listing: str) -> list[str]:
    """Unit names in ``systemctl list-unit-files --state=enabled`` output that look like inference servers."""
    units = []
    for line in listing.splitlines():
        parts = line.split()
        if parts and "." in parts[0] and SERVER_UNITS.search(parts[0]):
            units.append(parts[0])
    return units


def boot_services(timeout: float = 5.0) -> list[str] | None:
    """Inference servers systemd starts at boot; None where systemd is not running or does not answer."""
    if shutil.which("systemctl") is None:
        return None
    try:
        if Path("/proc/1/comm").read_text().strip() != "systemd":
            return None
        proc = subprocess.run(
            ["systemctl", "list-unit-files", "--state=enabled", "--no-legend", "--no-pager"],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return enabled_server_units(proc.stdout) if proc.returncode == 0 else None


def judge(readings: list[GpuReading] | str, own: set[int], units: list[str] | None = None) -> Check:
    """The GPUs line: fail when a foreign process holds a GPU, warn on unexplained memory or boot servers."""
    units = units or []
    unit_note = [f"enabled at boot, takes GPUs back after a reboot: {', '.join(units)}"] if units else []
    unit_action = f"disable them: systemctl disable --now {' '.join(units)}" if units else None
    if isinstance(readings, str) or not readings:
        why = readings if isinstance(readings, str) else "NVML lists no device"
        return Check(
            "gpus",
            "warn",
            f"no GPU visible ({why}); a CPU run needs none",
            details=unit_note,
            action=unit_action,
            data={"visible": 0, "reason": why, "boot_units": units},
        )
    details, busy, unexplained, rows = [], [], [], []
    for g in readings:
        foreign = [p for p in g.processes if p.pid not in own]
        held = sum(p.used or 0 for p in foreign)
        idle = IDLE_V2 if g.v2 else IDLE_V1
        line = f"GPU{g.index} {g.name}: {size(g.used)} of {size(g.total)} in use"
        if g.v2 and g.reserved:
            line += f" (+{size(g.reserved)} driver reserve)"
        if foreign:
            busy.append(g.index)
            procs = ", ".join(f"pid {p.pid} {p.name} {size(p.used) if p.used is not None else '?'}" for p in foreign)
            details.append(f"{line}; foreign: {procs}")
        elif g.used > idle and not any(p.pid in own for p in g.processes):
            unexplained.append(g.index)
            details.append(f"{line}; no process visible holds it (another container or PID namespace?)")
        elif g.processes:
            details.append(f"{line}; held by this run's extractor")
        rows.append(
            {
                "index": g.index,
                "name": g.name,
                "total": g.total,
                "used": g.used,
                "reserved": g.reserved,
                "memory_info": "v2" if g.v2 else "v1",
                "foreign_bytes": held,
                "processes": [
                    {"pid": p.pid, "name": p.name, "used": p.used, "foreign": p.pid not in own} for p in g.processes
                ],
            }
        )
    data = {"visible": len(readings), "devices": rows, "boot_units": units}
    n = len(readings)
    free = n - len(busy) - len(unexplained)
    if busy:
        return Check(
            "gpus",
            "fail",
            f"{len(busy)} of {n} GPUs held by foreign processes, {free} free",
            details=details + unit_note,
            action="stop the processes listed (and disable their services) before resuming",
            data=data,
        )
    level = "warn" if unexplained or units else "ok"
    figure = f"{n} GPU{'s' if n > 1 else ''}, {free} free"
    if unexplained:
        figure += f", {len(unexplained)} with memory in use by no visible process"
    return Check("gpus", level, figure, details=details + unit_note, action=unit_action, data=data)


def check(holder_pid: int | None = None) -> Check:
    return judge(read_gpus(), own_pids(holder_pid), boot_services())
