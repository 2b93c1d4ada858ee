"""Scale-out on a local Ray with CPU workers: the same bytes as one process, through a SIGKILLed
worker and a SIGKILLed driver, with the run folder telling who works on it."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from conftest import HANG_GUARD_S, TINY, conversations, hsx, require, run_files, write_jsonl
from hsx.assess.status import assess, render
from hsx.extract import ExtractOptions, extract
from hsx.lock import Locked

RUN = ("--shard-size", "6", "--batch-tokens", "64", "--writers", "2", "--device", "cpu")


def new_run(data: Path, out: Path, *extra: str) -> list:
    return ["extract", "--model", TINY, "--data", data, "--out", out, *RUN, *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    """60 conversations (10 shards) extracted by one plain process: what every scale-out run must equal."""
    require("ray")
    root = tmp_path_factory.mktemp("ref")
    data = write_jsonl(root / "convs.jsonl", conversations(60, start=100))
    hsx(*new_run(data, root / "run"))
    files = run_files(root / "run")
    assert len(files) == 60
    return data, files


class Driver:
    """``hsx extract --workers 2`` in its own session, so the test can kill it and everything it started."""

    def __init__(self, args: list, log: Path):
        self.tmp = tempfile.mkdtemp(prefix="hsxt-")  # its local Ray's files, which a killed driver cannot remove
        env = os.environ | {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TMPDIR": self.tmp}
        self.log = log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hsx", *map(str, args)],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def session(self) -> list[psutil.Process]:
        """Every live process of its session (the local Ray's daemons and workers included)."""
        out = []
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == self.proc.pid:
                    out.append(p)
            except (ProcessLookupError, PermissionError, psutil.Error):
                pass
        return out

    def wait(self, timeout: float = HANG_GUARD_S) -> str:
        self.proc.wait(timeout=timeout)
        return self.log.read_text()

    def kill_all(self) -> None:
        procs = self.session()
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=20)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture
def drivers(tmp_path):
    started: list[Driver] = []
    yield lambda args: started.append(Driver(args, tmp_path / f"driver{len(started)}.log")) or started[-1]
    for d in started:
        d.kill_all()


def records(out: Path) -> list[dict]:
    rows = []
    for p in sorted((out / "workers").glob("*.json")):
        try:
            rows.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            pass  # being replaced right now
    return rows


def sealed(out: Path) -> int:
    return len(list((out / "shards").glob("*/SEALED"))) if (out / "shards").exists() else 0


def status_json(out: Path) -> tuple[int, dict]:
    """``hsx status --json``, in-process (the command line adds only printing, and costs seconds)."""
    report = assess(out).to_json()
    return report["exit_code"], report


def _ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def until(what, driver: Driver | None = None, every: float = 0.002):
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        if driver is not None and driver.proc.poll() is not None:
            raise AssertionError(f"the driver ended first:\n{driver.wait()}")
        time.sleep(every)
    raise AssertionError("timed out")


def test_a_record_write_cut_off_by_kill9_leaves_nothing_once_the_session_ends(tmp_path):
    """Ray ends a worker at any instant, also between its heartbeat record's temp file and the
    rename: the driver's end (and the next driver's start) removes such a file, of a writer seen
    dead on this host or of a record it clears (a worker on another node), so the run folder is
    left as clean as after an uninterrupted run."""
    from hsx import registry
    from hsx.lock import this_process

    run = tmp_path / "run"
    registry.folder(run).mkdir(parents=True)
    code = (
        "import os, socket, sys, time\n"
        "from pathlib import Path\n"
        "from hsx import registry\n"
        "from hsx.store.durable import write_parts\n"
        "def parts():\n"
        "    yield b'{\"host\": '\n"
        "    print('half written', flush=True)\n"
        "    time.sleep(3600)\n"
        "    yield b'}'\n"
        "write_parts(registry.record_path(Path(sys.argv[1]), socket.gethostname(), os.getpid()), parts())\n"
    )
    me = this_process("extract --workers 2")
    ends = {  # (the end, the driver of the remote worker's record it clears)
        "a driver's end": (lambda: registry.clear_session(run, registry.driver_id(me)), registry.driver_id(me)),
        "the next driver's start": (lambda: registry.settle(run, me, log=lambda _: None), "an earlier driver"),
    }
    for when, (end, driver) in ends.items():
        writer = subprocess.Popen([sys.executable, "-c", code, str(run)], stdout=subprocess.PIPE, text=True)
        assert writer.stdout.readline() == "half written\n"
        temps = [p.name for p in registry.folder(run).iterdir()]
        assert len(temps) == 1 and temps[0].startswith(f".{socket.gethostname()}-{writer.pid}.json.tmp-"), temps
        writer.kill()
        writer.wait()
        # and a worker on another node (whose process this host cannot see), cut off in its next write
        remote = registry.record_path(run, "other-node", writer.pid)
        fields = this_process("worker").model_dump() | {"host": "other-node", "pid": writer.pid, "heartbeat": 0.0}
        remote.write_text(registry.WorkerRecord(**fields, driver=driver).model_dump_json())
        remote.with_name(f".{remote.name}.tmp-{writer.pid}-1").write_bytes(b'{"host": ')
        end()
        assert not registry.folder(run).exists(), f"{when} left {list(registry.folder(run).iterdir())}"
        registry.folder(run).mkdir()


def test_importing_hsx_does_not_import_ray():
    code = "import sys, hsx.extract, hsx.cli, hsx.assess.status; assert 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_workers_without_ray_installed_say_what_to_install(monkeypatch):
    from hsx.extract import Refused
    from hsx.extract.workers.driver import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # what an environment without Ray sees
    with pytest.raises(Refused, match=r"pip install 'hsx\[ray\]'"):
        import_ray()


def test_two_workers_write_what_one_process_writes(reference, tmp_path):
    data, expected = reference
    out = tmp_path / "run"
    done = hsx(*new_run(data, out, "--workers", "2"))
    assert "with 2 CPU workers" in done.stdout + done.stderr
    assert run_files(out) == expected
    assert not (out / "workers").exists() and not (out / "lock.json").exists()
    code, report = status_json(out)
    assert code == 0, report
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["samples_done"] == metrics["samples_total"] and metrics["tokens_done"] == metrics["tokens_total"]


def test_worker_sigkilled_mid_shard_is_retried_and_status_names_it_dead(reference, tmp_path, drivers):
    """Starts from a plain run killed part-way, so Ray also finishes what a plain extractor began
    (its workers verify the files there before they count them: the resume of a scaled-out run)."""
    data, expected = reference
    out = tmp_path / "run"
    plain = subprocess.Popen([sys.executable, "-m", "hsx", *map(str, new_run(data, out))], stdout=subprocess.DEVNULL)
    until(lambda: sealed(out) >= 2)
    plain.send_signal(signal.SIGKILL)
    plain.wait()
    assert sealed(out) < 10

    driver = drivers(["extract", "--out", out, "--workers", "2"])
    victim = None
    while victim is None:  # freeze a worker mid-shard, make sure it is mid-shard, then kill it
        rec = until(lambda: next((r for r in records(out) if r["phase"] == "working"), None), driver)
        os.kill(rec["pid"], signal.SIGSTOP)
        now = next((r for r in records(out) if r["pid"] == rec["pid"]), None)
        if now and now["phase"] == "working" and not (out / "shards" / f"{now['shard']:06d}" / "SEALED").exists():
            os.kill(rec["pid"], signal.SIGKILL)
            victim = now
        else:
            os.kill(rec["pid"], signal.SIGCONT)

    gone = victim["pid"]  # SIGKILL is asynchronous: wait until the kernel has ended the process
    until(lambda: _ended(gone))
    _, report = status_json(out)  # in-process: it surely runs while Ray still restarts the dead worker
    workers = next(c for c in report["checks"] if c["name"] == "workers")
    dead = [w for w in workers["data"]["ray_workers"] if w["pid"] == victim["pid"]]
    assert dead and dead[0]["state"] == "dead" and dead[0]["shard"] == victim["shard"], workers
    assert any(d.startswith("dead") and f"pid {victim['pid']} " in d for d in workers["details"]), workers
    assert workers["level"] == "fail" and report["exit_code"] == 2  # the driver is alive: nobody else may resume
    text = io.StringIO()
    render(assess(out), Console(file=text, width=250))
    assert re.search(rf"dead +pid {victim['pid']} on .*: died holding shard {victim['shard']}", text.getvalue())

    # a second driver, and a plain extractor, are refused while it runs
    for workers_asked in (2, 0):
        with pytest.raises(Locked):
            extract(ExtractOptions(out=out, workers=workers_asked), log=lambda _: None)
    assert driver.proc.poll() is None, "the run ended before the checks above: they proved nothing"

    log = driver.wait()
    assert driver.proc.returncode == 0, log
    assert f"worker pid {victim['pid']} on" in log and "died" in log
    assert re.search(r"\b[1-9]\d* were already verified", log), log  # the plain run's sealed shards, not redone
    assert run_files(out) == expected
    assert not (out / "workers").exists()
    assert status_json(out)[0] == 0


def test_driver_sigkilled_then_a_plain_extract_finishes_the_run(reference, tmp_path, drivers):
    data, expected = reference
    out = tmp_path / "run"
    driver = drivers(new_run(data, out, "--workers", "2"))
    until(lambda: sealed(out) >= 2, driver)
    pids = {r["pid"] for r in records(out)}
    assert pids
    os.killpg(driver.proc.pid, signal.SIGKILL)  # the driver, its local Ray, and with them the workers
    driver.proc.wait()
    until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids))
    assert sealed(out) < 10

    _, report = status_json(out)
    workers = next(c for c in report["checks"] if c["name"] == "workers")
    assert workers["data"]["state"] == "dead" and report["resume_command"] == f"hsx extract --out {out}"
    assert {w["pid"] for w in workers["data"]["ray_workers"]} == pids
    assert {w["state"] for w in workers["data"]["ray_workers"]} <= {"dead", "ended"}  # ended: held no shard

    resumed = hsx("extract", "--out", out)
    text = resumed.stdout + resumed.stderr
    assert "taking over a lock left by a dead extractor" in text and "worker record(s) of an earlier driver" in text
    assert run_files(out) == expected
    assert not (out / "workers").exists()
    assert status_json(out)[0] == 0


def test_the_driver_watch_wakes_a_main_thread_blocked_without_timeout(tmp_path):
    """Once the run is taken over, the watch stops the main thread even where it waits with no
    timeout (a flag-only interrupt is never seen there: a CI hang of the TP fence test)."""
    import threading

    from hsx.extract.workers.driver import _Watch
    from hsx.lock import LOCK, this_process
    from hsx.store.durable import write_durable

    write_durable(tmp_path / LOCK, this_process("extract").model_dump_json().encode())  # held by another session
    watch = _Watch(tmp_path, "elsewhere:1:0.0", lambda m: None)
    blocked = threading.Event()
    hang = threading.Timer(600, blocked.set)  # a hang, not a pace: then the wait ends and the test fails
    hang.start()
    watch.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            blocked.wait()
        watch.heard.set()
    finally:
        hang.cancel()
        watch.stop()
    assert watch.lost is not None and watch.lost.pid == os.getpid()


def test_a_worker_runs_the_model_on_the_threads_given(finished_run, tmp_path, monkeypatch):
    """``--threads`` reaches a scale-out worker: its task carries the options' resources (as the
    driver makes it), and the worker's set-up gives torch those threads."""
    import torch

    from hsx import registry
    from hsx.extract.workers.worker import ShardRunner, Where, WorkerTask
    from hsx.lock import RunLock

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    monkeypatch.setattr(
        registry.Heartbeat, "start", registry.Heartbeat.update
    )  # no beat thread: it would outlive the lock
    before = torch.get_num_threads()
    opts = ExtractOptions(out=run, device="cpu", threads=before + 1, writers=1)
    try:
        with RunLock(run, warn=lambda m: None) as lock:
            driver = lock.me.model_dump()
            task = WorkerTask(str(run), None, opts.resources(), deep_verify=False, driver=driver, reserve=0)
            runner = ShardRunner(task, Where(node="node", gpus=[], restarted=False))
            try:
                assert torch.get_num_threads() == before + 1
            finally:
                runner.extractor.close()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "argv0,command",
    [
        ("/opt/venv/bin/hsx", True),  # the console script
        ("/opt/venv/lib/python3.12/site-packages/hsx/__main__.py", True),  # python -m hsx
        ("/home/me/train.py", False),  # a program calling extract(): its process is never ended
        ("/opt/venv/bin/pytest", False),
        ("/srv/hsx/__main__.py.bak", False),
    ],
)
def test_only_the_hsx_command_lets_the_watch_end_its_process(argv0, command, monkeypatch):
    """The watch may end the driver's process (``_Watch(ends_process=...)``) only where that process is
    the hsx command, which the driver tells from ``sys.argv[0]``."""
    from hsx.extract.workers import driver

    monkeypatch.setattr(sys, "argv", [argv0, "extract"])
    assert driver._the_command() is command


def test_a_driver_whose_main_thread_never_hears_the_interrupt_ends_itself_saying_who_holds_the_run(tmp_path):
    """Once another extractor holds the run, the driver's watch interrupts its main thread; a main
    thread that stays inside Ray's own code (waiting on actors Ray restarts without end, each fenced
    at its start) never acts on it, and the driver ran on until killed. Here a main thread with
    SIGINT blocked stands for it: the watch ends the process itself, with the refusal's words and
    code (in the hsx command's own process only: never a program calling the API)."""
    from hsx.lock import LOCK, this_process
    from hsx.store.durable import write_durable

    run = tmp_path / "run"
    run.mkdir()
    write_durable(run / LOCK, this_process("extract").model_dump_json().encode())  # not the driver's lock
    script = (
        "import signal, time\n"
        "from pathlib import Path\n"
        "from hsx.extract.workers import driver\n"
        "driver.UNHEARD_S = 0.5\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])  # a main thread that never hears it\n"
        f"driver._Watch(Path({str(run)!r}), 'another-host:1:1.0', print, ends_process=True).start()\n"
        "time.sleep(3600)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"another extractor holds this run: pid {os.getpid()}" in proc.stdout, proc.stdout
    assert "did not come back from Ray within 0 s: it exits" in proc.stdout, proc.stdout
