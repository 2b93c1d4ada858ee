"""hsx.plane: a run streamed to a trainer through a Mooncake store, for nodes that share no sample
files. The store is real: its master, its HTTP metadata server and a store process holding the pool
(``mooncake_client``), started on 127.0.0.1 over TCP from the environment's own executables
(scripts/test-mooncake.sh; where the client is not installed these tests skip, unless HSX_REQUIRE
names mooncake)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import HANG_GUARD_S, conversations, extract_args, flip_byte, hsx, require, write_jsonl
from hsx.assess.status import assess
from hsx.consumer import folder, read_acks
from hsx.data import HsxDataset, StreamDataset, load_sample, stream_batches
from hsx.errors import ConsumerRefused, SampleUnavailable
from hsx.plan import Plan
from hsx.plane import Plane, Publisher, sample_bound
from hsx.spec import load_spec
from hsx.store import layout
from hsx.store.records import identity
from test_consumer import BUDGET, DiskPoll, Trainer, extractor, free_port, kill_on_progress

WINDOW = ("--window", "0.0003", "--consumer", "draft", "--delete-released")  # about 4 samples of 40


class Pool:
    """A Mooncake store on 127.0.0.1: master (its own eviction off), metadata server, and the store
    process whose memory is the pool; ``url`` is what ``--plane`` takes."""

    def __init__(self, root: Path):
        bin_dir = Path(sys.executable).parent
        rpc, meta, metrics, client = (free_port() for _ in range(4))
        metadata = f"http://127.0.0.1:{meta}/metadata"
        self.metrics = f"http://127.0.0.1:{metrics}/metrics"
        self.url = f"mooncake://127.0.0.1:{rpc}?metadata={metadata}"
        self.procs: list[subprocess.Popen] = []
        self._start(root / "metadata.log", "HTTP Metadata Server started", bin_dir / "mooncake_http_metadata_server",
                    f"--port={meta}", "--host=127.0.0.1")  # fmt: skip
        # eviction never starts (its watermark is the whole pool); a put a killed producer began frees its key
        # in 2 s and its space in 3 s
        self._start(root / "master.log", "Task cleanup thread started", bin_dir / "mooncake_master",
                    f"--rpc_port={rpc}", f"--metrics_port={metrics}", "--eviction_high_watermark_ratio=1.0",
                    "--put_start_discard_timeout_sec=2", "--put_start_release_timeout_sec=3")  # fmt: skip
        self._start(root / "client.log", "Starting real client service", bin_dir / "mooncake_client",
                    "--global_segment_size=64MB", "--host=127.0.0.1", f"--port={client}", "--protocol=tcp",
                    f"--master_server_address=127.0.0.1:{rpc}", f"--metadata_server={metadata}")  # fmt: skip

    def _start(self, log: Path, ready: str, *cmd) -> None:
        """Start one of the store's processes and wait for its line saying it serves (a progress point);
        where it does not come, the ones started are stopped."""
        with open(log, "wb") as out:
            self.procs.append(subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + HANG_GUARD_S
        while ready not in log.read_text(errors="replace"):
            if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"{cmd[0]} did not start: {log.read_text(errors='replace')}")
            time.sleep(0.05)

    def metric(self, name: str) -> int:
        with urllib.request.urlopen(self.metrics, timeout=10) as r:
            text = r.read().decode()
        return int(float(re.search(rf"^{name} (\S+)$", text, re.M).group(1)))

    def allocated(self) -> int:
        """Bytes the master counts in the pool (every key's value, and the space of a put begun)."""
        return self.metric("master_allocated_bytes")

    def emptied(self) -> None:
        """Wait until the pool holds no key and no space (a put a killed producer began is let go)."""
        deadline = time.monotonic() + HANG_GUARD_S
        while self.metric("master_key_count") or self.allocated():
            assert time.monotonic() < deadline, (self.metric("master_key_count"), self.allocated())
            time.sleep(0.1)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.kill()
            p.wait(timeout=HANG_GUARD_S)


@pytest.fixture(scope="module")
def samples(pool, tmp_path_factory) -> tuple[Path, Path]:
    """80 conversations and their run, extracted uninterrupted without a window: the files the
    plane's tests put, and the reference of the kill test (whose producer extracts the same)."""
    root = tmp_path_factory.mktemp("samples")
    data = write_jsonl(root / "convs.jsonl", conversations(80))
    hsx(*extract_args(data, root / "run"))
    return data, root / "run"


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    require("mooncake.store")
    pool = Pool(tmp_path_factory.mktemp("pool"))
    yield pool
    pool.stop()


def test_plane_refused_by_name_without_a_window_or_a_client_that_imports(tmp_path):
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(2))
    url = "mooncake://127.0.0.1:1"
    r = hsx(*extract_args(data, tmp_path / "a", "--plane", url), check=False)
    assert r.returncode == 2 and "--plane needs --window" in r.stderr
    r = hsx(*extract_args(data, tmp_path / "b", *WINDOW, "--plane", "redis://127.0.0.1:1"), check=False)
    assert r.returncode == 2 and "give the store's master as mooncake://HOST:PORT" in r.stderr
    # the client's library cannot load (here: its rdma-core libraries off the loader's path)
    r = hsx(*extract_args(data, tmp_path / "c", *WINDOW, "--plane", url), check=False, env={"LD_LIBRARY_PATH": ""})
    assert r.returncode == 2 and "pip install mooncake-transfer-engine-non-cuda" in r.stderr
    assert not any(tmp_path.glob("[abc]"))  # nothing written


def test_a_samples_bytes_round_trip_checked_as_its_file_and_never_served_wrong(pool, samples):
    run = samples[1]
    with pytest.raises(ConsumerRefused, match="extracted without --plane"):
        StreamDataset(run, "draft", plane=pool.url)
    spec = load_spec(run)
    plane = Plane(pool.url, run, sample_bound(spec))
    files = spec.footprint().files
    path = {sid: layout.sample_path(run, sid, spec.shard_size) for sid in (0, 1)}
    try:
        assert plane.key(0) == f"hsx/{identity(run)}/000000000"  # the run's own keys
        assert plane.get(0) is None and not plane.existing({0})
        plane.put(0, path[0].read_bytes())
        assert pool.allocated() == path[0].stat().st_size
        assert plane.read(0, files) == path[0].read_bytes()
        got = load_sample(run, Path("nowhere"), 0, files, plane=plane)
        want = HsxDataset(run, verify=True)[0]
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want if k != "sample_id")
        plane.remove(0)
        plane.remove(0)  # gone already: fine
        with pytest.raises(SampleUnavailable, match=r"sample 0: its key .* is missing"):
            load_sample(run, Path("nowhere"), 0, files, plane=plane)
        # bytes that are not the sample's, or not whole, are never served
        damaged = bytearray(path[0].read_bytes())
        damaged[-3] ^= 0xFF
        for value, why in ((bytes(damaged), "corrupt: digest mismatch"), (path[1].read_bytes(), "misplaced")):
            plane.put(0, value)
            with pytest.raises(SampleUnavailable, match=why):
                load_sample(run, Path("nowhere"), 0, files, plane=plane)
            plane.remove(0)
        assert pool.allocated() == 0
    finally:
        plane.close()


def test_the_producer_puts_each_unreleased_file_removes_each_released_key_and_names_a_damaged_file(
    pool, tmp_path, samples
):
    run = tmp_path / "run"
    shutil.copytree(samples[1], run)
    spec = load_spec(run)
    lines: list[str] = []
    publisher = Publisher(run, spec, pool.url, lines.append)
    plane = publisher.plane
    size = {sid: layout.sample_path(run, sid, spec.shard_size).stat().st_size for sid in range(4)}
    flip_byte(layout.sample_path(run, 3, spec.shard_size), -3)
    try:
        publisher.sync({0, 1, 2, 3}, set())
        assert plane.existing({0, 1, 2, 3}) == {0, 1, 2}
        assert pool.allocated() == size[0] + size[1] + size[2]
        assert len(lines) == 1 and "000000003.safetensors is corrupt: digest mismatch, not put" in lines[0]
        publisher.sync({1, 2, 3}, {0})  # 0 released
        assert plane.existing({0, 1, 2, 3}) == {1, 2} and len(lines) == 1  # said once
        # a new session (the producer killed -9 and restarted) finds what the last one left
        publisher.close()
        publisher = Publisher(run, spec, pool.url, lines.append)
        plane = publisher.plane
        plane.put(0, layout.sample_path(run, 0, spec.shard_size).read_bytes())  # put, then killed before its removal
        publisher.sync({2}, {0, 1})
        assert plane.existing({0, 1, 2, 3}) == {2}
        assert pool.allocated() == size[2]
        publisher.sync(set(), {0, 1, 2})
        assert pool.allocated() == 0
    finally:
        publisher.close()


def test_two_producers_of_a_run_put_each_file_once(pool, tmp_path, samples):
    """Ray workers each keep the whole run's pool at their gates: a file another producer put is
    found by one batched query and neither read nor put again, and each removes what is released
    (a key gone already is fine)."""
    run = tmp_path / "run"
    shutil.copytree(samples[1], run)
    spec = load_spec(run)
    producers = [Publisher(run, spec, pool.url, print) for _ in range(2)]
    puts: list[tuple[int, int]] = []
    for n, producer in enumerate(producers):
        put = producer.plane.put
        producer.plane.put = lambda sid, data, n=n, put=put: puts.append((n, sid)) or put(sid, data)
    a, b = producers
    try:
        a.sync({0, 1}, set())  # each producer's first look: what the pool holds
        b.sync({0, 1}, set())
        a.sync({0, 1, 2, 3}, set())  # files 2 and 3 written since: a puts them
        b.sync({0, 1, 2, 3, 4}, set())  # b finds them there, and puts 4 alone
        a.sync({0, 1, 2, 3, 4}, set())
        assert sorted(puts) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 4)]
        a.sync({2, 3, 4}, {0, 1})
        b.sync({2, 3, 4}, {0, 1})
        assert a.plane.existing({0, 1, 2, 3, 4}) == {2, 3, 4}
        b.sync(set(), {0, 1, 2, 3, 4})
        a.sync(set(), {0, 1, 2, 3, 4})
        assert pool.allocated() == 0
    finally:
        for producer in producers:
            producer.close()


def trainer_folder(out: Path, root: Path) -> Path:
    """What a trainer on another node holds: a copy of the run's spec and plan, and its records in
    ``consumers/``, the small folder both sides share; no sample file."""
    run = root / "run"
    run.mkdir(parents=True)
    shutil.copy2(out / layout.SPEC, run / layout.SPEC)
    shutil.copytree(out / "plan", run / "plan")
    (out / "consumers").mkdir(exist_ok=True)
    (run / "consumers").symlink_to(out / "consumers")
    return run


class PoolPoll:
    """The bytes in the pool, looked at every 50 ms on a thread of its own; ``peak`` the largest."""

    def __init__(self, pool: Pool):
        self.pool, self.peak = pool, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.pool.allocated())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def test_producer_and_trainer_without_shared_files_killed_9_train_exactly_what_an_uninterrupted_stream_does(
    pool, tmp_path, samples
):
    """A producer putting into the plane and a trainer reading from it, each in its own folder (the
    trainer's holds no sample file), killed -9 in turn and together, then resumed: the trainer's own
    log is the uninterrupted sequence, once each, and its weights those an uninterrupted trainer
    gets from the same samples' files; the pool never holds more than the window's bound (half the
    run's 80 samples: a pool that kept its keys would exceed it), every key leaves once released
    (and every producer's file, deleted), and a consumer the window does not name is refused the
    plane."""
    data, reference = samples
    out, ckpt = tmp_path / "producer" / "run", tmp_path / "ckpt"
    ckpt.mkdir()
    plane = ("--plane", pool.url)

    producer = extractor(*extract_args(data, out, *WINDOW, *plane))
    deadline = time.monotonic() + HANG_GUARD_S
    while not (out / layout.SPEC).exists():
        assert producer.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    run = trainer_folder(out, tmp_path / "trainer")
    disk, held = DiskPoll(out, ["draft"]).start(), PoolPoll(pool)
    trainer = Trainer(run, ckpt, "draft", *plane)
    trainer.kill_after(1)  # the trainer first, mid-stream
    kill_on_progress(out, producer, 2)  # then the producer
    producer, trainer = extractor("extract", "--out", out), Trainer(run, ckpt, "draft", *plane)
    kill_on_progress(out, producer, 2)  # the producer first
    producer = extractor("extract", "--out", out)
    trainer.kill_after(1)  # then the trainer
    producer.kill()  # and both at once
    producer.wait(timeout=HANG_GUARD_S)
    trainer = Trainer(run, ckpt, "draft", *plane)
    producer = extractor("extract", "--out", out)
    assert producer.wait(timeout=HANG_GUARD_S) == 0
    trainer.finish()
    hsx("extract", "--out", out)  # what the trainer released after the extraction ended leaves the plane
    other = ("--window", "0.0003", "--consumer", "draft", "--plane", "mooncake://127.0.0.1:1")
    r = hsx("extract", "--out", out, *other, check=False)  # the plane is the run's: another is refused
    assert r.returncode == 2 and f"through {pool.url}, asked for" in r.stderr, r.stderr
    bound, peak = disk.stop(), held.stop()
    assert 0 < disk.peak <= bound, (disk.peak, bound)
    whole = sum(f.stat().st_size for f in (reference / "shards").rglob("*.safetensors"))
    assert 0 < peak <= bound < whole / 2, (peak, bound, whole)
    pool.emptied()
    assert not (run / "shards").exists()
    report = assess(out)
    line = report.get("consumers")
    assert f"for draft, also in {pool.url}" in line.figure and line.data["window"]["plane"] == pool.url
    assert report.get("progress").data["consumed"] == 80  # the producer's files deleted once released, too
    with pytest.raises(ConsumerRefused, match="this one would wait for samples gone"):  # its keys left once released
        StreamDataset(run, "other", plane=pool.url)
    sequence = [i for b in stream_batches(Plan(out).lengths, 10, BUDGET, False, seed=7) for i in b]
    final = load_file(ckpt / "final.safetensors")
    assert final["trained0"].tolist() == sequence
    acks = read_acks(run, folder(run, "draft") / "acks-000000.jsonl").acks
    assert [i for a in acks for i in a.ids] == sequence and [a.step for a in acks] == list(range(1, len(acks) + 1))
    # the reference: the same trainer, uninterrupted, on the same samples' files
    ref_ckpt = tmp_path / "ref-ckpt"
    ref_ckpt.mkdir()
    Trainer(reference, ref_ckpt, "draft").finish()
    want = load_file(ref_ckpt / "final.safetensors")
    assert want.keys() == final.keys() and all(torch.equal(want[k], final[k]) for k in want)
