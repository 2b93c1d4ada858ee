"""The GPU line of ``hsx status``: memory in use, and who holds a GPU that is not this run's.

Judging is tested on NVML readings given as plain data, so no GPU is needed. Naming a foreign
process is tested with a real one: NVML's answer is the only thing stood in for (``nvml_query``),
its pid is a real server-like process, and its command line, user and cgroup come from /proc.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from conftest import HANG_GUARD_S
from hsx.assess import gpus
from hsx.cli import app

GiB, MiB = 1 << 30, 1 << 20
H200 = "NVIDIA H200"
HELD = 43_500_000_000  # the story's foreign server: 43.5 GB on the card
CID = "4f1c9a7be2d35c6e8a0b1d2c3e4f5a6b7c8d9e0f1a2b3c4d5e6f708192a3b4c5"  # 64 hex, as runtimes name containers
POD_UID = "0a1b2c3d-4e5f-6789-abcd-ef0123456789"
SERVER_ARGS = ["vllm", "serve", "/models/x", "--port", "8000", "--api-key", "sk-not-a-real-key"]


def wait_for(condition, what: str, timeout: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.01)


def cmdline_of(pid: int) -> list[str] | None:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return None


@pytest.fixture
def server():
    """A real process whose command line reads like a vLLM server; it waits until killed."""
    argv = [sys.executable, "-c", "import signal; signal.pause()", *SERVER_ARGS]
    proc = subprocess.Popen(argv)
    try:
        wait_for(lambda: cmdline_of(proc.pid) == argv, "the server's command line after exec")
        yield proc, argv
    finally:
        proc.kill()
        proc.wait()


def on_gpu0(monkeypatch, *procs: gpus.GpuProcess) -> None:
    """NVML answers that these processes hold GPU0; everything after the query stays real."""
    reading = gpus.GpuReading(0, H200, 141 * GiB, used=HELD + 600 * MiB, reserved=615 * MiB, processes=list(procs))
    monkeypatch.setattr(gpus, "nvml_query", lambda: [reading])


def status(out: Path, *args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["status", str(out), *args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output
    return r.exit_code, r.output


def gpu_check(report: dict) -> dict:
    return next(c for c in report["checks"] if c["name"] == "gpus")


# ---------------------------------------------------------------- a real foreign process, named


def test_foreign_server_is_named_by_its_command_line_and_the_command_that_stops_it(finished_run, server, monkeypatch):
    proc, argv = server
    on_gpu0(monkeypatch, gpus.GpuProcess(proc.pid, sys.executable, HELD))  # NVML gives the program's path
    owner = gpus.cgroup_owner(Path(f"/proc/{proc.pid}/cgroup").read_text())
    action = gpus.stop_command(gpus.GpuProcess(proc.pid, "python", HELD, owner=owner, visible=True))
    if owner == gpus.Owner():  # started from a shell or a test runner, not by a unit or container
        assert action == f"kill {proc.pid}"
    shown = "python -c 'import signal; signal.pause()' vllm serve /models/x --port 8000 --api-key ***"
    user = psutil.Process(proc.pid).username()

    code, text = status(finished_run)
    assert code == 2, text  # a person must act before resuming
    assert f"pid {proc.pid} {psutil.Process(proc.pid).name()} 43.5 GB" in text
    assert f"pid {proc.pid} ({user}): {shown}" in text
    assert action in text and "sk-not-a-real-key" not in text
    if action.startswith("kill "):  # a bare pid says nothing: the action repeats what it kills
        assert f"{action} ({shown})" in text

    code, raw = status(finished_run, "--json")
    report = json.loads(raw)
    assert code == 2 and report["verdict"] == "act" and "sk-not-a-real-key" not in raw
    check = gpu_check(report)
    assert check["level"] == "fail" and check["figure"] == "1 of 1 GPUs held by foreign processes, 0 free"
    (row,) = check["data"]["devices"][0]["processes"]
    assert row["pid"] == proc.pid and row["foreign"] and row["visible"] and row["used"] == HELD
    assert row["cmdline"] == [*argv[:-1], "***"]
    assert row["command"] == shown and row["user"] == user
    assert (row["unit"], row["user_unit"], row["container"], row["runtime"], row["pod"]) == (
        owner.unit,
        owner.user_unit,
        owner.container,
        owner.runtime,
        owner.pod,
    )
    assert row["action"] == action
    assert check["data"]["actions"][0].startswith(action)
    assert any(line.startswith("fix first: gpus: before resuming: " + action) for line in report["next"])


def test_a_pid_that_is_not_the_process_nvml_means_is_not_named_or_killed(server, monkeypatch):
    proc, _ = server
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid is free, as a pid of another PID namespace would be here
    on_gpu0(
        monkeypatch,
        gpus.GpuProcess(proc.pid, "/usr/bin/tritonserver", 20 * GiB),  # this pid number, another program
        gpus.GpuProcess(gone.pid, "/usr/bin/python3", 20 * GiB),
    )
    readings = gpus.read_gpus()
    c = gpus.judge(readings, gpus.own_pids(None))
    assert c.level == "fail"
    rows = {r["pid"]: r for r in c.data["devices"][0]["processes"]}
    for pid, name in ((proc.pid, "tritonserver"), (gone.pid, "python3")):
        assert rows[pid]["visible"] is False and rows[pid]["cmdline"] is None and rows[pid]["name"] == name
        assert f"kill {pid}" not in c.action and f"pid {pid} {name}: not visible here" in "\n".join(c.details)
        assert rows[pid]["action"].startswith(f"stop pid {pid} from the host or container")
    assert "vllm serve" not in json.dumps(c.data) + "\n".join(c.details)


def test_nvml_name_unknown_still_names_the_local_process(server, monkeypatch):
    proc, argv = server
    on_gpu0(monkeypatch, gpus.GpuProcess(proc.pid, "?", None))  # NVML could not name it: trust the pid
    (reading,) = gpus.read_gpus()
    (p,) = reading.processes
    assert p.visible is True and p.cmdline == (*argv[:-1], "***") and p.used is None


def test_own_process_is_described_from_real_proc():
    me = psutil.Process()
    p = gpus.describe(gpus.GpuProcess(me.pid, me.exe(), 1 * GiB))
    assert p.visible is True and p.name == me.name() and p.cmdline == tuple(gpus.mask_secrets(me.cmdline()))
    assert isinstance(p.owner, gpus.Owner)


def test_this_machines_own_cgroup_parses_without_error():
    path = Path("/proc/self/cgroup")
    try:
        text = path.read_text()
    except OSError:
        pytest.skip("/proc/self/cgroup is not readable here")
    owner = gpus.cgroup_owner(text)
    assert isinstance(owner, gpus.Owner)
    assert owner.unit is None or owner.unit.endswith(".service")
    assert owner.container is None or len(owner.container) == 64


# ---------------------------------------------------------------- cgroup paths as /proc writes them


@pytest.mark.parametrize(
    ("cgroup", "owner", "action"),
    [
        pytest.param(
            "0::/system.slice/vllm.service\n",
            gpus.Owner(unit="vllm.service"),
            "systemctl disable --now vllm.service",
            id="system-unit-v2",
        ),
        pytest.param(
            "0::/system.slice/system-vllm.slice/vllm@0.service\n",
            gpus.Owner(unit="vllm@0.service"),
            "systemctl disable --now vllm@0.service",
            id="template-instance",
        ),
        pytest.param(
            "12:pids:/system.slice/vllm-openai.service\n"
            "11:memory:/system.slice/vllm-openai.service\n"
            "1:name=systemd:/system.slice/vllm-openai.service\n"
            "0::/system.slice/vllm-openai.service\n",
            gpus.Owner(unit="vllm-openai.service"),
            "systemctl disable --now vllm-openai.service",
            id="system-unit-hybrid",
        ),
        pytest.param(
            "0::/user.slice/user-1000.slice/user@1000.service/app.slice/sglang.service\n",
            gpus.Owner(unit="sglang.service", user_unit=True),
            "systemctl --user disable --now sglang.service",
            id="user-unit",
        ),
        pytest.param(
            "0::/system.slice/run-u42.service\n",
            gpus.Owner(unit="run-u42.service"),
            "systemctl stop run-u42.service",
            id="transient-systemd-run",
        ),
        pytest.param(
            f"0::/system.slice/docker-{CID}.scope\n",
            gpus.Owner(container=CID, runtime="docker"),
            f"docker stop {CID[:12]}",
            id="docker-systemd-driver",
        ),
        pytest.param(
            f"12:memory:/docker/{CID}\n11:pids:/docker/{CID}\n1:name=systemd:/docker/{CID}\n0::/\n",
            gpus.Owner(container=CID, runtime="docker"),
            f"docker stop {CID[:12]}",
            id="docker-cgroupfs-v1",
        ),
        pytest.param(
            f"0::/machine.slice/libpod-{CID}.scope/container\n",
            gpus.Owner(container=CID, runtime="podman"),
            f"podman stop {CID[:12]}",
            id="podman",
        ),
        pytest.param(
            "0::/kubepods.slice/kubepods-burstable.slice/"
            f"kubepods-burstable-pod{POD_UID.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",
            gpus.Owner(container=CID, runtime="kubernetes", pod=POD_UID),
            f"scale down or delete the Kubernetes workload of pod {POD_UID}",
            id="kubepods-systemd-driver",
        ),
        pytest.param(
            f"11:memory:/kubepods/besteffort/pod{POD_UID}/{CID}\n1:name=systemd:/kubepods/besteffort/pod{POD_UID}/{CID}\n",
            gpus.Owner(container=CID, runtime="kubernetes", pod=POD_UID),
            f"scale down or delete the Kubernetes workload of pod {POD_UID}",
            id="kubepods-cgroupfs-v1",
        ),
        pytest.param("0::/user.slice/user-1000.slice/session-3.scope\n", gpus.Owner(), "kill 4242", id="login-session"),
        pytest.param(
            "9:name=systemd:/\n4:memory:/process_api/7c15cb5fee9f01b4f00305bee0185daf\n0::/\n",
            gpus.Owner(),
            "kill 4242",
            id="no-unit-no-container",
        ),
        pytest.param("0::/\n", gpus.Owner(), "kill 4242", id="container-cgroup-namespace-root"),
    ],
)
def test_cgroup_names_the_unit_or_container_and_the_stop_command(cgroup, owner, action):
    assert gpus.cgroup_owner(cgroup) == owner
    stop = gpus.stop_command(gpus.GpuProcess(4242, "python3", HELD, owner=owner, visible=True))
    assert stop.startswith(action)


# ---------------------------------------------------------------- command lines


def test_command_line_is_the_program_and_its_telling_arguments_without_secrets():
    argv = [
        "/opt/venv/bin/python3", "-u", "/opt/venv/bin/vllm", "serve",
        "/mnt/nvme-new/checkpoints/moonshotai/Kimi-K2-Instruct-0905-bf16-final",
        "--tensor-parallel-size", "8", "--api-key=sk-secret", "--hf-token", "hf_secret", "--tokenizer", "tk",
    ]  # fmt: skip
    short = gpus.short_command(argv)
    assert short.startswith("vllm serve …")  # the console script, not the interpreter
    assert "Kimi-K2-Instruct-0905-bf16-final" in short and "--tensor-parallel-size 8" in short
    assert "--api-key=*** --hf-token *** --tokenizer tk" in short and "secret" not in short
    assert gpus.short_command(["python3", "-m", "sglang.launch_server", "--model-path", "m"]) == (
        "python3 -m sglang.launch_server --model-path m"
    )
    long = gpus.short_command(["/usr/bin/tritonserver", *[f"--model-repository=/m{i}" for i in range(40)]])
    assert len(long) <= gpus.COMMAND_CHARS and long.startswith("tritonserver --model-repository=/m0 ")
    assert long.endswith(" …")
    assert gpus.short_command(None) is None and gpus.short_command([]) is None


def test_one_step_per_unit_though_its_processes_hold_eight_gpus():
    unit = gpus.Owner(unit="vllm.service")
    workers = [
        gpus.GpuProcess(5000 + i, "python3", HELD, ("python3", "-m", "vllm"), "svc", unit, True) for i in range(8)
    ]
    loose = gpus.GpuProcess(6000, "python3", HELD, ("python3", "train.py", "--lr", "1e-4"), "bob", gpus.Owner(), True)
    in_docker = gpus.Owner(container=CID, runtime="docker")
    docker = gpus.GpuProcess(7000, "tritonserver", HELD, ("tritonserver",), "root", in_docker, True)
    readings = [gpus.GpuReading(i, H200, 141 * GiB, used=HELD, processes=[w]) for i, w in enumerate(workers)]
    readings.append(gpus.GpuReading(8, H200, 141 * GiB, used=2 * HELD, processes=[loose, docker]))
    c = gpus.judge(readings, own=set(), units=["vllm.service", "ollama.service"])
    assert c.level == "fail" and c.figure == "9 of 9 GPUs held by foreign processes, 0 free"
    assert c.data["actions"] == [
        "systemctl disable --now vllm.service",
        "kill 6000 (train.py --lr 1e-4)",
        f"docker stop {CID[:12]}",
        "systemctl disable --now ollama.service",  # enabled at boot, not holding a GPU now
    ]
    assert c.action == "before resuming: " + "; ".join(c.data["actions"])
    described = [d for d in c.details if d.startswith("pid ")]
    assert len(described) == 10  # each process once, after the GPU lines
    assert "pid 5000 (svc): python3 -m vllm; systemd unit vllm.service" in described
    assert "pid 6000 (bob): train.py --lr 1e-4; started by no unit or container" in described
    assert any(d.startswith(f"pid 7000 (root): tritonserver; docker container {CID[:12]}") for d in described)


# ---------------------------------------------------------------- judging on given readings


def test_no_gpu_machine_gets_a_clear_line_not_a_crash():
    readings = gpus.read_gpus()
    check = gpus.judge(readings, gpus.own_pids(None))
    if isinstance(readings, str):
        assert check.level == "warn" and check.figure.startswith("no GPU visible")
    else:
        assert check.level in ("ok", "warn", "fail") and "GPU" in check.figure


def test_idle_h200_is_free_by_v2_memory_though_v1_would_show_615_mib():
    idle = gpus.GpuReading(0, H200, 141 * GiB, used=2 * MiB, reserved=615 * MiB, v2=True)
    c = gpus.judge([idle], own={1})
    assert c.level == "ok" and c.figure == "1 GPU, 1 free" and c.exit_code == 0
    old_driver = gpus.GpuReading(0, H200, 141 * GiB, used=615 * MiB, v2=False)  # v1: reservation included
    assert gpus.judge([old_driver], own={1}).level == "ok"


def test_foreign_processes_fail_the_gpus_line_with_pid_name_and_memory():
    readings = [
        gpus.GpuReading(0, H200, 141 * GiB, used=130 * GiB, reserved=615 * MiB,
                        processes=[gpus.GpuProcess(4242, "vllm", 130 * GiB)]),
        gpus.GpuReading(1, H200, 141 * GiB, used=60 * GiB, processes=[gpus.GpuProcess(777, "python", 60 * GiB)]),
        gpus.GpuReading(2, H200, 141 * GiB, used=1 * MiB),
    ]  # fmt: skip
    c = gpus.judge(readings, own={777})
    assert c.level == "fail" and c.exit_code == 2
    assert c.figure == "1 of 3 GPUs held by foreign processes, 2 free"
    assert any("GPU0" in d and "pid 4242 vllm 139.6 GB" in d for d in c.details)
    assert any("GPU1" in d and "this run's extractor" in d for d in c.details)
    procs = c.data["devices"][0]["processes"]
    assert procs == [
        {
            "pid": 4242, "name": "vllm", "used": 130 * GiB, "foreign": True,
            "cmdline": None, "command": None, "user": None, "unit": None, "user_unit": False,
            "container": None, "runtime": None, "pod": None, "visible": None, "action": "kill 4242",
        }
    ]  # fmt: skip
    assert c.data["devices"][1]["processes"][0]["action"] is None  # this run's own: nothing to do


def test_memory_held_by_no_visible_process_warns():
    hidden = gpus.GpuReading(0, H200, 141 * GiB, used=40 * GiB, reserved=615 * MiB)
    c = gpus.judge([hidden], own=set())
    assert c.level == "warn" and "no visible process" in c.figure and c.exit_code == 0


def test_no_nvml_warns_and_boot_servers_are_named():
    listing = (
        "ssh.service                     enabled enabled\n"
        "vllm-server.service             enabled disabled\n"
        "ollama.service                  enabled enabled\n"
        "sglang@llama.service            enabled enabled\n"
        "systemd-resolved.service        enabled enabled\n"
    )
    units = gpus.enabled_server_units(listing)
    assert units == ["vllm-server.service", "ollama.service", "sglang@llama.service"]
    c = gpus.judge("NVML unavailable (NVML Shared Library Not Found)", set(), units)
    assert c.level == "warn" and c.figure.startswith("no GPU visible (NVML unavailable")
    assert "ollama.service" in c.details[0] and c.action.startswith("disable them: systemctl disable --now")
    idle = gpus.GpuReading(0, H200, 141 * GiB, used=0)
    assert gpus.judge([idle], set(), units).level == "warn"


def test_boot_services_never_hang_or_crash():
    units = gpus.boot_services(timeout=5)
    assert units is None or isinstance(units, list)
