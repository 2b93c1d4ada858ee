"""Who holds the GPUs: NVML readings turned into a verdict, and inference servers enabled at boot.

Readings are plain data (``GpuReading``) so the judging can be tested without a GPU. Memory is judged
from NVML's v2 info, whose ``used`` excludes the driver's reservation: v1 ``used`` reports ~615 MiB
on an idle H200 (driver 580), which would make every idle card look busy. A process on a GPU that is
not this run's extractor (or its children) is foreign: after a reboot, an auto-started inference
server takes the cards back, and resuming would fail with out-of-memory far from the cause. A pid and
a name are not enough to act on, so each foreign process is named by its command line and by what
started it (a systemd unit, a container), and the action is the command that stops it for good.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil

from hsx.assess.checks import Check
from hsx.units import size

MiB = 1 << 20
IDLE_V2 = 256 * MiB  # v2 ``used`` (reservation excluded) on an idle card is a few MiB
IDLE_V1 = 1024 * MiB  # v1 ``used`` includes the reservation; only a coarse judgment is possible
COMMAND_CHARS = 160  # a shortened command line fits one terminal line beside its pid
ARG_CHARS = 48  # one argument longer than this (inline JSON, a long path) is cut
SHORT_ID = 12  # container ids as ``docker ps`` prints them

# unit names of inference servers that grab GPUs when started at boot
SERVER_UNITS = re.compile(
    r"vllm|sglang|triton|text-generation|\btgi\b|ollama|lmdeploy|llama[-_.]?(cpp|server)|localai|xinference"
    r"|tensorrt|\bnim\b|aphrodite|koboldcpp|tabby|inference|infer-server|model-server|lorax",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Owner:
    """What started a process, as its cgroup path tells: a systemd unit, or a container of a runtime."""

    unit: str | None = None  # e.g. ``vllm.service``
    user_unit: bool = False  # a unit of a user's systemd (``systemctl --user``), not the system's
    container: str | None = None  # full container id
    runtime: str | None = None  # docker, podman, nerdctl, containerd, cri-o, kubernetes
    pod: str | None = None  # Kubernetes pod uid


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used: int | None  # bytes; None where NVML cannot tell (e.g. some MIG or container setups)
    cmdline: tuple[str, ...] | None = None  # argv, secrets masked; None where /proc does not tell
    user: str | None = None
    owner: Owner = Owner()
    visible: bool | None = None  # False: the pid is not this PID namespace's (or it exited); None: not looked up


@dataclass(frozen=True)
class GpuReading:
    index: int
    name: str
    total: int
    used: int  # v2 ``used`` when the driver has it, else v1 ``used``
    reserved: int = 0  # driver reservation (v2 only)
    v2: bool = True
    processes: list[GpuProcess] = field(default_factory=list)


# ---------------------------------------------------------------- NVML: the boundary with the driver


def _nvml_name(pid: int, nvml) -> str:
    """The driver's name for a pid: the only one there is when the pid is another namespace's."""
    try:
        name = nvml.nvmlSystemGetProcessName(pid)
        return name.decode() if isinstance(name, bytes) else name
    except Exception:
        return "?"


def nvml_query() -> list[GpuReading] | str:
    """Every visible GPU's memory and processes as the driver reports them, or why none can be seen.

    Processes carry NVML's pid, name and memory only; what /proc tells about them is added by
    ``read_gpus``, so a test can stand in for this one function and keep the rest real.
    """
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
                    seen.setdefault(p.pid, GpuProcess(p.pid, _nvml_name(p.pid, nvml), mem_used))
            out.append(GpuReading(i, name, total, used, reserved, v2, list(seen.values())))
        return out
    except nvml.NVMLError as e:
        return f"NVML query failed ({e})"
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def read_gpus() -> list[GpuReading] | str:
    """NVML's readings, each process named from /proc: command line, user, unit or container."""
    readings = nvml_query()
    if isinstance(readings, str):
        return readings
    known: dict[int, GpuProcess] = {}
    for g in readings:
        for p in g.processes:
            if p.pid not in known:
                known[p.pid] = describe(p)
    return [replace(g, processes=[replace(known[p.pid], used=p.used) for p in g.processes]) for g in readings]


# ---------------------------------------------------------------- /proc: what the process is, who started it


def describe(p: GpuProcess) -> GpuProcess:
    """``p`` with what /proc tells about its pid, unless that pid is not the process NVML means."""
    try:
        proc = psutil.Process(p.pid)
        with proc.oneshot():
            name = proc.name()
            argv = _ask(proc.cmdline)
            exe = _ask(proc.exe)
            user = _ask(proc.username)
    except psutil.NoSuchProcess:  # exited since, or a pid of another PID namespace (NVML in a container)
        return replace(p, name=_base(p.name), visible=False)
    except psutil.AccessDenied:
        return replace(p, name=_base(p.name), visible=True)
    if not _same_program(p.name, name, exe, argv):  # this namespace's pid of the same number is another process
        return replace(p, name=_base(p.name), visible=False)
    try:
        owner = cgroup_owner(Path(f"/proc/{p.pid}/cgroup").read_text())
    except OSError:
        owner = Owner()
    cmdline = tuple(mask_secrets(argv)) if argv else None
    return replace(p, name=name, cmdline=cmdline, user=user, owner=owner, visible=True)


def _ask(getter):
    try:
        return getter()
    except (psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return None


def _base(name: str) -> str:
    return Path(name).name or name


def _same_program(nvml_name: str, name: str, exe: str | None, argv: list[str] | None) -> bool:
    """Whether NVML's process name fits the local process of that pid (``comm`` is cut to 15 chars).

    Without the executable (another user's, unreadable) a renamed process (setproctitle) cannot be
    told from a stranger, so it is trusted.
    """
    want = _base(nvml_name)
    if want in ("", "?") or exe is None:
        return True
    names = {name, _base(exe or ""), _base(argv[0]) if argv else ""} - {""}
    return any(n == want or (len(n) == 15 and want.startswith(n)) for n in names)


SECRET_OPTION = re.compile(r"(?:^|[-_])(?:key|token|secret|password|passwd)$", re.IGNORECASE)


def mask_secrets(argv: list[str]) -> list[str]:
    """argv with the values of ``--api-key``-like options masked: status output gets pasted into tickets."""
    out, mask_next = [], False
    for a in argv:
        if mask_next:
            out.append("***")
            mask_next = False
            continue
        if a.startswith("-") and SECRET_OPTION.search(a.lstrip("-").partition("=")[0]):
            name, eq, _ = a.partition("=")
            a, mask_next = (f"{name}=***", False) if eq else (a, True)
        out.append(a)
    return out


PYTHON = re.compile(r"^(python|pypy)[\d.]*$")


def short_command(argv: tuple[str, ...] | list[str] | None, limit: int = COMMAND_CHARS) -> str | None:
    """The program and its first arguments, each cut to a readable length, in ``limit`` characters.

    For Python the interpreter says nothing: a script (a console script such as ``vllm``) is shown by
    its name, a module with ``-m``; the arguments that follow (subcommand, model, port) come first
    on a server's command line, so the cap drops the tail.
    """
    if not argv:
        return None
    argv = mask_secrets(list(argv))
    prog, rest = _base(argv[0]), argv[1:]
    head = [prog]
    if PYTHON.match(prog):
        i = 0
        while i < len(rest):
            a = rest[i]
            if a in ("-m", "-c") and i + 1 < len(rest):
                head += [a, rest[i + 1]]
                i += 2
                break
            if a in ("-X", "-W"):
                i += 2
            elif a.startswith("-") and a != "-":
                i += 1  # interpreter flags (-u, -O, -B) say nothing about what runs
            else:
                head = [_base(a)]
                i += 1
                break
        rest = rest[i:]
    text = " ".join(_quote(_cut(a)) for a in head + rest)
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit - 1)
    return text[: cut if cut > len(prog) else limit - 1] + " …"


def _cut(arg: str, n: int = ARG_CHARS) -> str:
    if len(arg) <= n:
        return arg
    if "/" in arg and not arg.lstrip().startswith(("{", "[")):  # a path: its end names the thing
        return "…" + arg[-(n - 1) :]
    return arg[: n - 1] + "…"


def _quote(arg: str) -> str:
    return shlex.quote(arg) if not arg or any(c.isspace() or c in "'\"\\$`;&|" for c in arg) else arg


HEX64 = r"[0-9a-f]{64}"
CONTAINER_PARTS = (  # one cgroup path component -> (runtime, id), systemd and cgroupfs drivers
    (re.compile(rf"^docker-({HEX64})\.scope$"), "docker"),
    (re.compile(rf"^libpod-({HEX64})(?:\.scope)?$"), "podman"),
    (re.compile(rf"^nerdctl-({HEX64})\.scope$"), "nerdctl"),
    (re.compile(rf"^cri-containerd-({HEX64})\.scope$"), "containerd"),
    (re.compile(rf"^crio-({HEX64})\.scope$"), "cri-o"),
)
POD = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32})")
USER_MANAGER = re.compile(r"^user@\d+\.service$")


def cgroup_owner(text: str) -> Owner:
    """The unit or container a ``/proc/PID/cgroup`` names; ``Owner()`` where it names neither.

    The unified (v2) line is read first, then v1's ``name=systemd``, then the other v1 controllers:
    on hybrid hosts the unified path is ``/`` while the controllers still show the container.
    """
    unified, systemd, others = [], [], []
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not path:
            continue
        if hierarchy == "0" and not controllers:
            unified.append(path)
        elif controllers == "name=systemd":
            systemd.append(path)
        else:
            others.append(path)
    for path in unified + systemd + others:
        owner = _path_owner([p for p in path.split("/") if p and p != ".."])
        if owner != Owner():
            return owner
    return Owner()


def _path_owner(parts: list[str]) -> Owner:
    if not parts:
        return Owner()
    if parts[0].startswith("kubepods"):
        pod = next((m.group(1).replace("_", "-") for p in parts if (m := POD.search(p))), None)
        ids = [_container_id(p) for p in parts]
        return Owner(container=next((i for i in reversed(ids) if i), None), runtime="kubernetes", pod=pod)
    for i, part in enumerate(parts):
        for pattern, runtime in CONTAINER_PARTS:
            if m := pattern.match(part):
                return Owner(container=m.group(1), runtime=runtime)
        if part == "docker" and i + 1 < len(parts) and re.fullmatch(HEX64, parts[i + 1]):
            return Owner(container=parts[i + 1], runtime="docker")
    if parts[0] not in ("system.slice", "user.slice"):
        return Owner()
    managers = [i for i, p in enumerate(parts) if USER_MANAGER.match(p)]
    scope = parts[managers[-1] + 1 :] if managers else parts
    units = [p for p in scope if p.endswith(".service")]
    return Owner(unit=units[-1], user_unit=bool(managers)) if units else Owner()


def _container_id(part: str) -> str | None:
    for pattern, _ in CONTAINER_PARTS:
        if m := pattern.match(part):
            return m.group(1)
    return part if re.fullmatch(HEX64, part) else None


def stop_command(p: GpuProcess) -> str:
    """The command that frees the GPU for good: a unit disabled (it would restart), a container stopped."""
    o = p.owner
    if o.runtime == "kubernetes":
        where = f"pod {o.pod}" if o.pod else "its pod"
        return f"scale down or delete the Kubernetes workload of {where} (kubelet restarts a container stopped by hand)"
    if o.container:
        tool = {"docker": "docker", "podman": "podman", "nerdctl": "nerdctl"}.get(o.runtime or "", "crictl")
        return f"{tool} stop {o.container[:SHORT_ID]}"
    if o.unit:
        systemctl = "systemctl --user" if o.user_unit else "systemctl"
        if re.match(r"^run-[a-z0-9]+\.service$", o.unit):  # transient (systemd-run): no unit file to disable
            return f"{systemctl} stop {o.unit}"
        return f"{systemctl} disable --now {o.unit}"
    if p.visible is False:
        return f"stop pid {p.pid} from the host or container that runs it: it is not a process of this PID namespace"
    return f"kill {p.pid}"


def owner_text(p: GpuProcess) -> str:
    o = p.owner
    if o.runtime == "kubernetes":
        return f"Kubernetes pod {o.pod or '?'}" + (f", container {o.container[:SHORT_ID]}" if o.container else "")
    if o.container:
        return f"{o.runtime} container {o.container[:SHORT_ID]}"
    if o.unit:
        return f"user unit {o.unit} of {p.user or '?'}" if o.user_unit else f"systemd unit {o.unit}"
    return "started by no unit or container"


def process_line(p: GpuProcess) -> str:
    """One foreign process, as the operator needs it to decide: what it is, whose, started by what."""
    if p.visible is False:
        return f"pid {p.pid} {p.name}: not visible here (another PID namespace, or it exited)"
    who = f" ({p.user})" if p.user else ""
    command = short_command(p.cmdline) or f"{p.name} (command line not readable)"
    line = f"pid {p.pid}{who}: {command}; {owner_text(p)}"
    if p.owner.runtime == "docker":
        line += f" (if it has a restart policy: docker update --restart=no {p.owner.container[:SHORT_ID]})"
    return line


# ---------------------------------------------------------------- whose pids, boot services, the verdict


def own_pids(*roots: int | None) -> set[int]:
    """This run's extractor (the lock holder, a tensor-parallel group's launcher) and its children
    (ranks, workers, compile helpers) are not foreign."""
    pids = {psutil.Process().pid}
    for root in roots:
        if root is None:
            continue
        pids.add(root)
        try:
            pids |= {c.pid for c in psutil.Process(root).children(recursive=True)}
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


def _process_row(p: GpuProcess, foreign: bool) -> dict:
    o = p.owner
    return {
        "pid": p.pid,
        "name": p.name,
        "used": p.used,
        "foreign": foreign,
        "cmdline": list(p.cmdline) if p.cmdline is not None else None,
        "command": short_command(p.cmdline),
        "user": p.user,
        "unit": o.unit,
        "user_unit": o.user_unit,
        "container": o.container,
        "runtime": o.runtime,
        "pod": o.pod,
        "visible": p.visible,
        "action": stop_command(p) if foreign else None,
    }


def _stop_steps(foreign: list[GpuProcess], units: list[str]) -> list[str]:
    """One step per thing to stop: the processes of one unit or container share it; a kill names its command."""
    steps: list[str] = []
    for p in foreign:
        step = stop_command(p)
        if step.startswith("kill ") and (command := short_command(p.cmdline)):
            step += f" ({command})"
        if step not in steps:
            steps.append(step)
    covered = {p.owner.unit for p in foreign if p.owner.unit and not p.owner.user_unit}
    if rest := [u for u in units if u not in covered]:
        steps.append(f"systemctl disable --now {' '.join(rest)}")
    return steps


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
    strangers: dict[int, GpuProcess] = {}  # each foreign process once, though it may hold several GPUs
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
            for p in foreign:
                strangers.setdefault(p.pid, p)
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
                "processes": [_process_row(p, p.pid not in own) for p in g.processes],
            }
        )
    data = {"visible": len(readings), "devices": rows, "boot_units": units}
    n = len(readings)
    free = n - len(busy) - len(unexplained)
    if busy:
        steps = _stop_steps(list(strangers.values()), units)
        data["actions"] = steps
        return Check(
            "gpus",
            "fail",
            f"{len(busy)} of {n} GPUs held by foreign processes, {free} free",
            details=details + [process_line(p) for p in strangers.values()] + unit_note,
            action="before resuming: " + "; ".join(steps),
            data=data,
        )
    level = "warn" if unexplained or units else "ok"
    figure = f"{n} GPU{'s' if n > 1 else ''}, {free} free"
    if unexplained:
        figure += f", {len(unexplained)} with memory in use by no visible process"
    return Check("gpus", level, figure, details=details + unit_note, action=unit_action, data=data)


def check(*own: int | None) -> Check:
    """``own``: the pids whose process trees are this run's."""
    return judge(read_gpus(), own_pids(*own), boot_services())
