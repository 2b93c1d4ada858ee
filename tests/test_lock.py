"""One writer per run: a second ``hsx extract`` is refused while the first lives; dead and stale
locks are reported and taken over; status shows who holds the run and its live metrics."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from conftest import HANG_GUARD_S, conversations, extract_args, hsx, write_jsonl
from hsx.assess import workers
from hsx.assess.status import assess
from hsx.cli import app
from hsx.lock import LOCK, Holder, Locked, RunLock, read_holder
from hsx.store.layout import GUARD, METRICS, SPEC


def write_lock(run: Path, **kw) -> Holder:
    now = time.time()
    fields = {"host": socket.gethostname(), "pid": os.getpid(), "started": now, "heartbeat": now} | kw
    if "pid_started" not in fields:
        fields["pid_started"] = psutil.Process(fields["pid"]).create_time()
    holder = Holder(**fields)
    (run / LOCK).write_text(holder.model_dump_json())
    return holder


def dead_pid() -> tuple[int, float]:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(p.pid).create_time()
    p.wait()
    return p.pid, started


def guard_free(run: Path) -> bool:
    """Whether no process holds the flock on the run's guard (taken only while a lock is judged)."""
    try:
        fd = os.open(run / GUARD, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def spec_saved(run: Path) -> bool:
    return (run / SPEC).exists()


@pytest.fixture
def run(finished_run, tmp_path) -> Path:
    return Path(shutil.copytree(finished_run, tmp_path / "run"))


def test_second_extractor_is_refused_while_the_first_runs(tmp_path, convs):
    out = tmp_path / "run"
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    first = subprocess.Popen(
        [sys.executable, "-m", "hsx", *map(str, extract_args(convs, out))],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        # The lock file appears before its taker lets go of the guard's flock: frozen in between, the
        # first would hold the guard, and the second would wait on it instead of being refused.
        # Its spec saved too: the set-up's lock is let go and taken again for the session.
        while (h := read_holder(out)) is None or h.pid != first.pid or not guard_free(out) or not spec_saved(out):
            assert first.poll() is None and time.monotonic() < deadline, "the first extractor never took the lock"
            time.sleep(0.01)
        first.send_signal(signal.SIGSTOP)  # alive and holding the lock for as long as the test needs

        second = hsx("extract", "--out", out, check=False)
        assert second.returncode == 2
        assert f"another extractor holds this run: pid {first.pid} on {socket.gethostname()}" in second.stderr

        report = assess(out)
        w = report.get("workers")
        assert w.level == "fail" and w.data["state"] == "alive" and w.data["pid"] == first.pid
        assert report.exit_code == 2 and any("an extractor is running" in n for n in report.next)
        assert not report.get("integrity").data["files"]  # its temp files are writes in flight, not strays

        repair = CliRunner().invoke(app, ["verify", str(out), "--repair"])
        assert repair.exit_code == 2 and "an extractor is running on this run" in repair.output
    finally:
        first.send_signal(signal.SIGCONT)
        _, err = first.communicate(timeout=HANG_GUARD_S)
    assert first.returncode == 0, err
    assert not (out / LOCK).exists()  # released on exit
    assert assess(out).exit_code == 0


def test_an_extractor_waiting_on_a_held_guard_says_so_then_goes_on(tmp_path, convs):
    """A process frozen while it judges the lock (it holds the guard's flock) makes the next
    extractor wait: it says whom it waits for instead of hanging silently, and goes on once freed."""
    out = tmp_path / "run"
    out.mkdir()
    fd = os.open(out / GUARD, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hsx", *map(str, extract_args(convs, out))],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ | {"HF_HUB_OFFLINE": "1"},
    )
    hang = threading.Timer(HANG_GUARD_S, proc.kill)  # no word ever: the loop below ends, and fails
    hang.start()
    try:
        seen = []
        for line in proc.stdout:  # waits for the line, however long the start takes
            seen.append(line)
            if "waiting for another process taking this run's lock" in line:
                break
        else:
            pytest.fail(f"no word of the wait before the extractor ended: {''.join(seen)}")
        assert read_holder(out) is None  # it waits: it has taken nothing
    finally:
        hang.cancel()
        os.close(fd)  # the frozen taker's turn ends
    rest, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, "".join(seen) + rest
    assert assess(out).exit_code == 0


def test_dead_lock_on_this_host_is_reported_and_taken_over(run):
    pid, started = dead_pid()
    write_lock(run, pid=pid, pid_started=started, heartbeat=time.time() - 30)
    w = workers.inspect(run)
    assert w.state == "dead"
    report = assess(run)
    assert report.exit_code == 0 and report.get("workers").level == "warn"
    assert f"dead lock: pid {pid} on {socket.gethostname()}" in report.get("workers").figure

    warnings: list[str] = []
    with RunLock(run, warn=warnings.append):
        assert read_holder(run).pid == os.getpid()
    assert warnings and warnings[0].startswith("taking over a lock left by a dead extractor")


def test_recycled_pid_is_not_mistaken_for_the_holder(run):
    write_lock(run, pid=os.getpid(), pid_started=psutil.Process().create_time() - 1000)
    assert workers.inspect(run).state == "dead"


def test_other_host_is_judged_by_heartbeat_age(run):
    write_lock(run, host="gpu-node-7", pid=1, pid_started=0.0, heartbeat=time.time() - 5)
    report = assess(run)
    assert report.get("workers").data["state"] == "alive" and report.exit_code == 2
    with pytest.raises(Locked, match="pid 1 on gpu-node-7"):
        RunLock(run).acquire()

    write_lock(run, host="gpu-node-7", pid=1, pid_started=0.0, heartbeat=time.time() - 3600)
    report = assess(run)
    assert report.get("workers").data["state"] == "stale" and report.exit_code == 0
    assert "no heartbeat for over" in report.get("workers").figure
    warnings: list[str] = []
    lock = RunLock(run, warn=warnings.append)
    lock.acquire()
    assert "stale" in warnings[0] and read_holder(run).host == socket.gethostname()


def test_unreadable_lock_warns(run):
    (run / LOCK).write_text("{garbage")
    w = workers.check(workers.inspect(run))
    assert w.level == "warn" and "unreadable" in w.figure


def test_status_shows_the_live_extractors_metrics(run):
    metrics = json.loads((run / METRICS).read_text())  # written by the real extractor's heartbeat
    assert metrics["samples_done"] == metrics["samples_total"] == 40 and metrics["tokens_done"] > 0
    assert {"tokens_per_s", "bytes_per_s", "eta_s", "bytes_written", "time"} <= set(metrics)

    write_lock(run, started=time.time() - 4000)  # this very process holds the run
    metrics |= {"tokens_per_s": 31234.0, "bytes_per_s": 1.2e9, "eta_s": 3600.0, "time": time.time() - 2}
    (run / METRICS).write_text(json.dumps(metrics))
    r = CliRunner().invoke(app, ["status", str(run)])
    line = next(x for x in r.output.splitlines() if "workers" in x)
    assert r.exit_code == 2 and "fail" in line
    assert f"alive: pid {os.getpid()}" in line and "running 1h06m" in line
    assert "31,234 tok/s, 1.2 GB/s, ETA 1h00m" in line


def _race(run: Path, ready, done, won) -> None:
    ready.wait()  # every contender has started: they ask together, however slowly they forked
    try:
        RunLock(run, warn=lambda m: None).acquire()
        won.put(os.getpid())
    except Locked:
        pass
    done.wait()  # the winner stays alive (holding the lock) until every contender has asked


@pytest.mark.parametrize("before", ["fresh", "dead"])
def test_racing_extractors_never_both_take_the_lock(tmp_path, before):
    """Six processes ask for the lock at the same instant, ten times: exactly one wins each time,
    on a new run and on a run whose lock a dead extractor left."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    for trial in range(10):
        run = tmp_path / str(trial)
        run.mkdir()
        if before == "dead":
            pid, started = dead_pid()
            write_lock(run, pid=pid, pid_started=started)
        won, ready, done = ctx.Queue(), ctx.Barrier(6), ctx.Barrier(6)
        procs = [ctx.Process(target=_race, args=(run, ready, done, won)) for _ in range(6)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(HANG_GUARD_S)
        winners = []
        while not won.empty():
            winners.append(won.get())
        assert len(winners) == 1, (trial, winners)
        assert read_holder(run).pid == winners[0]


def test_two_new_runs_started_at_once_never_corrupt_the_one_that_finishes(tmp_path):
    """Two starts of a new run in one folder (a retry, a second terminal, a requeued job), with other
    layers: the first is frozen at its first write, the second runs meanwhile, then the first goes on.
    Whichever finishes, the run is whole: the spec's layers are those of every file, and status is
    clean. Neither start writes its spec or plan over the other's (the lock is taken first)."""
    out, convs = tmp_path / "run", write_jsonl(tmp_path / "convs.jsonl", conversations(12))
    first = subprocess.Popen(
        [sys.executable, "-m", "hsx", *map(str, extract_args(convs, out, "--layers", "1,3,4"))],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"HF_HUB_OFFLINE": "1"},
    )
    second = None
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while not out.exists():  # its first write: the run folder
            assert first.poll() is None and time.monotonic() < deadline, "the first start wrote nothing"
            time.sleep(0.001)
        first.send_signal(signal.SIGSTOP)
        second = subprocess.Popen(
            [sys.executable, "-m", "hsx", *map(str, extract_args(convs, out, "--layers", "2,5"))],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=os.environ | {"HF_HUB_OFFLINE": "1"},
        )
        waited = []
        for line in second.stderr:  # to its end, or until it waits on the frozen first's turn at the lock
            waited.append(line)
            if "waiting for another process taking this run's lock" in line:
                break
    finally:
        first.send_signal(signal.SIGCONT)
    _, err1 = first.communicate(timeout=HANG_GUARD_S)
    _, err2 = second.communicate(timeout=HANG_GUARD_S)
    err2 = "".join(waited) + (err2 or "")
    codes = sorted([first.returncode, second.returncode])
    assert codes == [0, 2], (err1, err2)  # one made the run; the other was refused, writing nothing
    loser = err1 if first.returncode == 2 else err2
    assert "Traceback" not in err1 + err2
    assert "another extractor holds this run" in loser or "refusing to resume" in loser, loser
    from hsx.spec import load_spec
    from hsx.store.format import read_header

    spec = load_spec(out)
    files = sorted((out / "shards").rglob("*.safetensors"))
    assert len(files) == spec.plan.num_samples
    assert {read_header(p).metadata["layers"] for p in files} == {json.dumps(spec.layers)}
    report = assess(out)
    assert report.exit_code == 0, report
