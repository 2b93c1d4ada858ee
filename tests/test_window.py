"""The window's count of what the named consumers have not released (``extract.window.held``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import HANG_GUARD_S, hsx
from hsx.extract.window import Sealed, delete_released, held
from hsx.spec import Window
from hsx.store import layout
from hsx.store.writer import read_consumed
from hsx.units import size

NAMES = ["draft"]


def _on_disk(run) -> dict[int, int]:
    return {
        layout.parse_sample_name(p.name): p.stat().st_size
        for p in (run / layout.SHARDS).rglob("*")
        if layout.parse_sample_name(p.name) is not None
    }


def test_held_counts_every_unreleased_file_sealed_or_not_and_its_manifest_sizes_are_read_once(finished_run, tmp_path):
    """Sealed shards' sizes come from their manifests, kept between calls; a shard being written (no
    manifest yet) is looked at again each time. The bytes equal the files' own sizes either way, and
    a file deleted after the manifest was read is no longer counted."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (layout.shard_dir(run, 3) / layout.SEALED).unlink()  # shard 3 as one still being written
    window, sealed = Window(bytes=1, consumers=NAMES), Sealed(run)
    files = _on_disk(run)
    assert held(run, window, 10, [], sealed) == (sum(files.values()), NAMES)
    assert sorted(sealed.known) == ["000000", "000001", "000002"]  # the unsealed shard is not kept
    gone = layout.sample_path(run, 12, 10)
    gone.unlink()
    assert held(run, window, 10, [], sealed) == (sum(files.values()) - files[12], NAMES)
    assert held(run, window, 10, []) == held(run, window, 10, [], sealed)  # a fresh look agrees


def _waiters(guard) -> int:
    """How many processes or threads wait for an flock on ``guard`` (``/proc/locks``: a blocked
    request is listed with ``->`` before its kind)."""
    dev, ino = guard.stat().st_dev, guard.stat().st_ino
    tag = f"{os.major(dev):02x}:{os.minor(dev):02x}:{ino} "
    return sum(" -> FLOCK" in line and tag in line for line in Path("/proc/locks").read_text().splitlines())


def test_deleters_of_one_run_take_turns_so_neither_drops_what_the_other_recorded_consumed(finished_run, tmp_path):
    """Workers of one run delete at their own gates. Each adds to a shard's consumed record what it
    read there: two at once could each write the record without the other's files, and files deleted
    but not recorded are counted lost. Another process (a real one) holds the turn and deletes some of
    shard 1's files; this one waits for it, then adds its own, and the record holds both."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / layout.CONSUMED).mkdir()
    guard = layout.consumed_guard(run)
    other = subprocess.Popen(
        [sys.executable, "-c", OTHER_DELETER, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout.readline().strip() == "holding"  # it holds the turn, its files not yet recorded
        done: list[int] = []
        mine = threading.Thread(target=lambda: done.append(delete_released(run, {13, 14, 15}, 10)))
        mine.start()
        deadline = time.monotonic() + HANG_GUARD_S
        while _waiters(guard) == 0:  # progress: this deleter is queued behind the other
            assert time.monotonic() < deadline and mine.is_alive(), "the deleter did not wait for its turn"
            time.sleep(0.01)
        assert all(layout.sample_path(run, i, 10).exists() for i in range(10, 20))
        other.stdin.write("go\n")
        other.stdin.flush()
        assert other.wait(timeout=HANG_GUARD_S) == 0
        mine.join(timeout=HANG_GUARD_S)
    finally:
        other.kill()
    assert done == [3]
    assert sorted(read_consumed(run, 1)) == [11, 12, 13, 14, 15]
    assert [i for i in range(10, 20) if layout.sample_path(run, i, 10).exists()] == [10, 16, 17, 18, 19]
    assert "missing" not in hsx("verify", run).stdout  # exit 0: every deleted file is counted consumed


OTHER_DELETER = """
import sys
from pathlib import Path
from hsx.store import layout
from hsx.store.durable import flocked
from hsx.store.writer import read_seal, record_consumed
run = Path(sys.argv[1])
with flocked(layout.consumed_guard(run)):  # a deleter in its turn: what delete_released does there
    print("holding", flush=True)
    sys.stdin.readline()
    record_consumed(run, 1, [read_seal(run, 1)[i] for i in (11, 12)])
    for i in (11, 12):
        layout.sample_path(run, i, 10).unlink()
"""


def test_a_damaged_or_another_runs_window_record_is_named_by_status(finished_run, tmp_path):
    """window.json truncated or swapped in from another run was read as none: status's consumers
    line now names it (fail), as the producer writes it (``store.records``)."""
    import json

    from hsx.assess import consumers
    from hsx.extract.window import RECORD, WindowState, read_state
    from hsx.store.records import write_record
    from hsx.store.scan import scan_run

    run, other = tmp_path / "run", tmp_path / "other"
    shutil.copytree(finished_run, run)
    shutil.copytree(finished_run, other)
    spec = json.loads((other / layout.SPEC).read_text())
    (other / layout.SPEC).write_text(json.dumps(spec | {"created": "2020-01-01T00:00:00+00:00"}))
    state = WindowState(window=1, held=5, paused_since=1.0, waiting_for=NAMES)
    for r in (run, other):
        write_record(r, r / RECORD, state.model_dump(mode="json"), indent=None)
    assert read_state(run) == state
    window, scans = Window(bytes=1 << 30, consumers=NAMES), scan_run(run, 40, 10, deep=False)
    kept = (run / RECORD).read_bytes()
    for damaged, why in ((kept[:20], "truncated or garbled"), ((other / RECORD).read_bytes(), "another run's")):
        (run / RECORD).write_bytes(damaged)
        c = consumers.check(run, scans, 40, 10, window)
        assert c.level == "fail" and f"{RECORD}: {why}" in c.figure, c


def test_the_gate_says_once_that_the_run_is_past_its_window_and_once_that_it_is_back_within(finished_run, tmp_path):
    """--window-limit: the gate lets a batch through past the window and up to the limit; it logs
    going past once (not at every batch), records it in window.json, and logs and records the return
    within the window once the files held fall under it. Without a limit it pauses at the window and
    says nothing of the kind."""
    from hsx.extract.window import Pause, read_state

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    files = _on_disk(run)
    total = sum(files.values())
    said: list[str] = []
    limited = Window(bytes=total // 2, consumers=NAMES, limit=total + 1000)
    gate = Pause(run, limited, 10, said.append, lambda: (4, set()), poll=0.01)
    gate(1000)
    gate(1000)  # still past: not said again
    past = [s for s in said if s.startswith("window: past its window, ")]
    assert len(past) == 1 and f"(window {size(total // 2)}); going on while they lag, up to " in past[0], said
    state = read_state(run)
    assert state.past_since is not None and state.limit == total + 1000 and state.held == total
    assert state.paused_since is None and "paused" not in " ".join(said)
    for sid in sorted(files)[: len(files) * 3 // 4]:  # as a deleting window does once they are released
        layout.sample_path(run, sid, 10).unlink()
    gate(1000)
    assert said[-1].startswith("window: back within its window (") and read_state(run).past_since is None, said
    gate(1000)
    assert sum(s.startswith("window: back within") for s in said) == 1
    # without the limit, the same files hold the gate at the window: it would wait (nothing releases)
    unlimited = Pause(run, Window(bytes=1, consumers=NAMES), 10, said.append, lambda: (4, set()), poll=0.01)
    fits, state = unlimited._fits(1000)
    assert not fits and state.past_since is None and state.limit is None
