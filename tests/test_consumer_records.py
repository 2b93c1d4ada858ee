"""hsx.consumer's records as the run's records (store.records): consumer.json, each rank's
checkpoint, lease and acknowledgement line are stamped with the run's identity and a digest; a
truncated, garbled, deleted or another run's record (a lease of another rank copied over) is named
by status (non-zero, with its repair), refused by StreamDataset, and never releases samples to the
extractor's window nor lifts its pause; records written before the stamp still read."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest

from conftest import HANG_GUARD_S
from hsx.assess.status import assess
from hsx.consumer import (
    NOT_WRITTEN,
    ConsumerSpec,
    RankLease,
    RankRecord,
    acks_name,
    checkpoint_name,
    folder,
    inspect,
    rank_name,
    read_acks,
    read_checkpoint,
    read_lease,
)
from hsx.errors import RecordDamaged
from hsx.extract.window import Pause, released, waited_on
from hsx.spec import Window
from hsx.store import layout, records
from test_consumer import BUDGET, consume, stream

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


def another_run(run: Path, tmp_path: Path) -> Path:
    """A run folder whose spec is ``run``'s made at another time: another run of the same data."""
    other = tmp_path / "other"
    other.mkdir()
    spec = json.loads((run / layout.SPEC).read_bytes())
    (other / layout.SPEC).write_text(json.dumps(spec | {"created": "another time"}))
    return other


def another_runs(run: Path, path: Path, tmp_path: Path) -> None:
    """``path``'s record as another run writes it: copied in."""
    other = another_run(run, tmp_path)
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
    (rank_name(0), "garbage", "truncated or garbled"),  # left by a killed holder,
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


def unstamped(body: bytes) -> bytes:
    return json.dumps({k: v for k, v in json.loads(body).items() if k not in ("run", "record_digest")}).encode()


def test_records_written_before_the_stamp_still_read(run):
    """A consumer.json, a checkpoint, an acks log and a lease as hsx wrote them before stamping
    (plain JSON) are read as they are: the consumer resumes, its checkpoint releases, its lease
    holds its rank."""
    d = folder(run, "draft")
    for name in ("consumer.json", checkpoint_name(0)):
        (d / name).write_bytes(unstamped((d / name).read_bytes()))
    lines = (d / acks_name(0)).read_bytes().splitlines()
    (d / acks_name(0)).write_bytes(b"".join(unstamped(line) + b"\n" for line in lines))
    now = time.time()
    old = RankRecord(host=socket.gethostname(), pid=os.getpid(), pid_started=psutil.Process().create_time(),
                     started=now, heartbeat=now, consumer="draft", leased=[3])  # fmt: skip
    (d / rank_name(0)).write_text(old.model_dump_json())
    views = inspect(run)
    assert len(released(WINDOW, views)) == 40 and views[0].leased == {3} and assess(run).exit_code == 0
    (d / rank_name(0)).unlink()
    stream(run, resume_step=13).close()


def draft(ranks: int = 1, name: str = "draft") -> ConsumerSpec:
    """The parameters ``stream`` starts a consumer with."""
    return ConsumerSpec(name=name, ranks=ranks, seed=7, max_tokens=BUDGET, packed=False)


def lease_waiting(run: Path, spec: ConsumerSpec, rank: int = 0, resume_step: int | None = None) -> RankLease:
    """A rank of ``spec`` on ``run`` held by this process, waiting for sample 45 (of shard 4, not
    written): a wait that lifts a window's pause for shard 4's batches."""
    lease = RankLease(run, spec, rank, resume_step, log=lambda _: None)
    lease.waiting(45, NOT_WRITTEN)
    return lease


def failed(run: Path, needle: str, action: str) -> None:
    report = assess(run)
    line = report.get("consumers")
    assert report.exit_code == 2 and line.level == "fail" and needle in line.figure, line.figure
    assert action in line.action, line.action


def test_another_runs_lease_is_named_lifts_no_pause_and_the_ranks_start_rewrites_it(run, tmp_path):
    """Another run's lease copied in (its holder alive: this process), waiting for a sample of the
    next shard: status names it with its repair, the window's gate does not take its wait for this
    consumer's (which would let batches past a full window), and the rank's start takes it over.
    Before, it was trusted: status said nothing, the wait lifted the pause, and the start was
    refused ('stop that process first') for another run's process."""
    own = lease_waiting(run, draft(), resume_step=13)
    assert waited_on(run, inspect(run), ["draft"], 10, 4, set())  # this run's own wait lifts it
    own.close()
    other = another_run(run, tmp_path)
    theirs = lease_waiting(other, draft())
    path = folder(run, "draft") / rank_name(0)
    shutil.copyfile(folder(other, "draft") / rank_name(0), path)
    theirs.close()
    failed(run, f"draft: {rank_name(0)} another run's record", "rewrites its lease at its next heartbeat or start")
    assert not waited_on(run, inspect(run), ["draft"], 10, 4, set())
    said: list[str] = []
    ds = stream(run, resume_step=13, log=said.append)
    took = f"taking over {rank_name(0)}, which no trainer holding it wrote (another run's record"
    assert any(took in s for s in said), said
    assert read_lease(run, "draft", 0).pid == os.getpid() and assess(run).exit_code == 0
    ds.close()


def test_a_ranks_lease_copied_over_anothers_is_named_and_its_holders_heartbeat_rewrites_it(run):
    """Rank 0's lease copied over rank 1's while both run: status names rank 1's as rank 0's (before:
    read as rank 1's, 'nothing wrong'); rank 1's next heartbeat (a batch handed out) rewrites it,
    saying so, and status is clean again."""
    said: list[str] = []
    ranks = [stream(run, "pair", rank=r, ranks=2, log=said.append) for r in (0, 1)]
    d = folder(run, "pair")
    shutil.copyfile(d / rank_name(0), d / rank_name(1))
    failed(run, f"pair: {rank_name(1)} the lease of rank 0 of consumer pair (copied over it)", "rewrites its lease")
    consume(ranks[1], 1)
    assert any(f"{rank_name(1)}: the lease of rank 0" in s and "rewritten by its holder" in s for s in said), said
    assert read_lease(run, "pair", 1).rank == 1 and assess(run).exit_code == 0
    for ds in ranks:
        ds.close()


def garble(path: Path, line: int, how: str) -> list[bytes]:
    """Line ``line`` (1-based) of the log at ``path`` garbled in place, its newline kept: the lines before."""
    lines = path.read_bytes().split(b"\n")
    if how == "garbage":
        lines[line - 1] = b"\x00\xff garbage \x13\r" * (len(lines[line - 1]) // 13)
    else:  # one digit of its ids changed: still an acknowledgement, of another sample
        body = json.loads(lines[line - 1])
        body["ids"][0] = body["ids"][0] + 1
        lines[line - 1] = json.dumps(body).encode()
    path.write_bytes(b"\n".join(lines))
    return lines[: line - 1]


@pytest.mark.parametrize("how", ["garbage", "another-id"])
def test_a_garbled_middle_line_of_a_journal_is_named_releases_nothing_after_it_and_refuses_the_ranks_start(run, how):
    """Line 5 of a real journal (13 steps) garbled, the lines after it good: not a crash's torn end
    but damage. Status names the file and the line with the repair; the window releases what lines
    1-4 acknowledged and nothing after; the rank's resume from its checkpoint (step 13) is refused
    naming them. The repair, a resume from step 4, cuts the damage off and hands every later batch
    again: each sample acknowledged once. Before, the log silently ended at the line (status clean,
    steps 5-13's samples never released, and a resume from step 4 dropped them unsaid) or, a
    changed id still JSON, released a sample never trained and kept one trained from release."""
    path = folder(run, "draft") / acks_name(0)
    before = read_acks(run, path).acks  # read whole: this process's next reads judge only what changed
    garble(path, 5, how)
    failed(run, f"draft: {acks_name(0)} line 5 ", "cuts the damaged line and every line after it off")
    kept = {i for a in before[:4] for i in a.ids}
    assert released(WINDOW, inspect(run)) == kept and len(kept) < 40
    with pytest.raises(RecordDamaged, match=rf"{acks_name(0)}: line 5 .*garbled .*\(the last acknowledged before it: "
                       r"step 4\); resume the trainer"):  # fmt: skip
        stream(run, resume_step=13)
    said: list[str] = []
    ds = stream(run, resume_step=4, log=said.append)
    assert any(f"{acks_name(0)}: line 5 " in s and "cut off at the resume from step 4" in s for s in said)
    rest = consume(ds, first=5)
    ds.checkpointed(13)
    ds.close()
    assert [a.ids for a in before[:4]] + rest == ds.batches  # every sample handed once after the repair
    assert [a.ids for a in read_acks(run, path).acks] == ds.batches
    assert len(released(WINDOW, inspect(run))) == 40 and assess(run).exit_code == 0


@pytest.mark.parametrize("how", ["garbage", "another-id"])
def test_a_damaged_journal_is_rebuilt_from_the_sequence_to_resume_from_the_checkpoint_past_it(run, how):
    """The repair that keeps the trainer's last checkpoint (step 13, past the damaged line 5): asked
    for (``rebuild_acks``), the resume rebuilds the log from the consumer's sequence of batches
    (line 6 acknowledges the batches of steps 5 and 6, whose count it holds), so every sample is
    acknowledged once and released by that checkpoint, and nothing is handed again."""
    path = folder(run, "draft") / acks_name(0)
    trained = [i for a in read_acks(run, path).acks for i in a.ids]  # what the trainer acknowledged
    garble(path, 5, how)
    with pytest.raises(RecordDamaged, match=r"line 5 .*rebuild_acks=True"):  # only where asked
        stream(run, resume_step=13)
    said: list[str] = []
    ds = stream(run, resume_step=13, rebuild_acks=True, log=said.append)
    assert any(f"{acks_name(0)}: line 5 " in s and "rebuilt from the consumer's sequence" in s for s in said), said
    assert ds.position == len(ds.batches) == 13 and list(ds) == []
    ds.close()
    acks = read_acks(run, path).acks
    assert [a.step for a in acks] == [1, 2, 3, 4, *range(6, 14)]
    assert acks[4].ids == ds.batches[4] + ds.batches[5] and [i for a in acks for i in a.ids] == trained
    assert len(released(WINDOW, inspect(run))) == 40 and assess(run).exit_code == 0
