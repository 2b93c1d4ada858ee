"""hsx.consumer's records as the run's records (store.records): consumer.json and each rank's
checkpoint are stamped with the run's identity and a digest; a truncated, garbled, deleted or
another run's record is named by status (non-zero, with its repair), refused by StreamDataset,
and never releases samples to the extractor's window; records written before the stamp still read."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from conftest import HANG_GUARD_S
from hsx.assess.status import assess
from hsx.consumer import checkpoint_name, folder, inspect, rank_name, read_checkpoint
from hsx.errors import RecordDamaged
from hsx.extract.window import Pause, released
from hsx.spec import Window
from hsx.store import layout, records
from test_consumer import consume, stream

WINDOW = Window(bytes=1, consumers=["draft"])


@pytest.fixture
def run(finished_run, tmp_path) -> Path:
    """A copy of the finished run read whole by consumer draft (one rank, 13 steps), its checkpoint
    declared at the last step: every sample released."""
    shutil.copytree(finished_run, tmp_path / "run", ignore=shutil.ignore_patterns("consumers"))
    run = tmp_path / "run"
    ds = stream(run)
    consume(ds)
    ds.checkpointed(len(ds.batches))
    ds.close()
    return run


def another_runs(run: Path, path: Path, tmp_path: Path) -> None:
    """``path``'s record as another run (its spec made at another time) writes it: copied in."""
    other = tmp_path / "other"
    other.mkdir()
    spec = json.loads((run / layout.SPEC).read_bytes())
    (other / layout.SPEC).write_text(json.dumps(spec | {"created": "another time"}))
    body = records.read_record(run, path)
    records.write_record(other, other / path.name, body)
    shutil.copyfile(other / path.name, path)


def damage(run: Path, path: Path, how: str, tmp_path: Path) -> None:
    if how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "garbage":
        path.write_bytes(b"\x00\xff garbage \x13" * 7)
    elif how == "deleted":
        path.unlink()
    else:
        another_runs(run, path, tmp_path)


DAMAGE = [
    ("consumer.json", "truncated", "truncated or garbled"),
    ("consumer.json", "garbage", "truncated or garbled"),
    ("consumer.json", "another", "another run's record"),
    ("consumer.json", "deleted", "missing"),
    (checkpoint_name(0), "truncated", "truncated or garbled"),
    (checkpoint_name(0), "garbage", "truncated or garbled"),
    (checkpoint_name(0), "another", "another run's record"),
    (rank_name(0), "garbage", "truncated or garbled (not a lease)"),  # left by a killed holder,
]


@pytest.mark.parametrize(("record", "how", "why"), DAMAGE, ids=[f"{r}-{h}" for r, h, _ in DAMAGE])
def test_status_names_a_damaged_consumer_record_with_its_repair_and_it_releases_nothing(
    run, tmp_path, record, how, why
):
    """Each damage fails status's consumers line (exit 2) naming the file, what is wrong and its
    repair; a damaged consumer.json or checkpoint releases nothing. Before, they were read as
    absent (the consumer or its checkpoint silently gone: 'nothing wrong') or, another run's,
    trusted: its checkpoint released this run's samples."""
    assert released(WINDOW, inspect(run)) and assess(run).exit_code == 0
    path = folder(run, "draft") / record
    damage(run, path, how, tmp_path)
    report = assess(run)
    line = report.get("consumers")
    assert report.exit_code == 2 and line.level == "fail", line.figure
    assert f"draft: {record} {why}" in line.figure, line.figure
    repair = {"consumer.json": "cannot be rebuilt", "checkpoint": "declares it again", "rank": "rewrites its lease"}
    assert next(v for k, v in repair.items() if record.startswith(k)) in line.action, line.action
    if not record.startswith("rank"):
        assert released(WINDOW, inspect(run)) == set()


@pytest.mark.parametrize("how", ["truncated", "another"])
def test_a_stream_refuses_a_damaged_consumer_spec_by_name(run, tmp_path, how):
    """consumer.json fixes the consumer's sequence: a damaged one is refused naming the file and its
    repair (another run's was trusted, its sequence taken for this run's)."""
    damage(run, folder(run, "draft") / "consumer.json", how, tmp_path)
    with pytest.raises(RecordDamaged, match=r"consumer\.json: .*; consumer\.json fixes the consumer's sequence"):
        stream(run, resume_step=13)


def test_the_window_pauses_on_a_damaged_checkpoint_names_it_and_goes_on_once_the_resume_declares_it(run, tmp_path):
    """Another run's checkpoint copied in would release (and a deleting window delete) samples this
    trainer never saved: the pause holds, its log names the record and the repair; the rank's
    resume from its checkpoint declares it again and the pause lifts."""
    path = folder(run, "draft") / checkpoint_name(0)
    another_runs(run, path, tmp_path)
    said: list[str] = []
    paused = threading.Event()

    def log(line: str) -> None:
        said.append(line)
        paused.set()

    gate = threading.Thread(target=Pause(run, WINDOW, 10, log, lambda: (4, set()), poll=0.01), args=(1,))
    gate.start()
    deadline = time.monotonic() + HANG_GUARD_S
    while not paused.wait(0.01):  # the gate's log says it paused, or the gate let the batch through
        assert gate.is_alive() and time.monotonic() < deadline, f"the window released: {said}"
    assert any(f"window: {path} another run's record" in s and "declares it again" in s for s in said), said
    resumed: list[str] = []
    ds = stream(run, resume_step=13, log=resumed.append)
    assert any("declared again at step 13" in s for s in resumed), resumed
    ds.close()
    gate.join(HANG_GUARD_S)
    assert not gate.is_alive() and said[-1].startswith("window: goes on after"), said
    assert read_checkpoint(run, "draft", 0).step == 13 and assess(run).exit_code == 0


def test_records_written_before_the_stamp_still_read(run):
    """A consumer.json and a checkpoint as hsx wrote them before stamping (plain JSON) are read as
    they are: the consumer resumes and its checkpoint releases."""
    d = folder(run, "draft")
    for name in ("consumer.json", checkpoint_name(0)):
        body = json.loads((d / name).read_bytes())
        (d / name).write_text(json.dumps({k: v for k, v in body.items() if k not in ("run", "record_digest")}))
    assert len(released(WINDOW, inspect(run))) == 40 and assess(run).exit_code == 0
    stream(run, resume_step=13).close()
