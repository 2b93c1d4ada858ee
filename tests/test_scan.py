"""The scan at scale: a sealed shard's files are trusted by their listing (no file opened) until one
changes; the deep check reads every file in parallel and finds a single flipped bit; manifests
written before mtimes were recorded still verify. Opens are counted at the OS boundary (``open``,
``io.open``, ``os.open``) while the real code runs on real files."""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import flip_byte
from hsx.cli import app
from hsx.errors import Damage
from hsx.store import layout
from hsx.store.format import SampleTensors
from hsx.store.scan import CHUNK, scan_run, scan_shard
from hsx.store.writer import SampleWriter, read_seal, seal

SEC = 1_000_000_000


@pytest.fixture
def opens(monkeypatch):
    """Every path opened while the test runs (absolute), counted at the OS boundary."""
    seen: list[str] = []
    real_open, real_os_open = builtins.open, os.open

    def note(file) -> None:
        if isinstance(file, str | os.PathLike):
            seen.append(os.path.abspath(os.fspath(file)))

    def counted_open(file, *args, **kwargs):
        note(file)
        return real_open(file, *args, **kwargs)

    def counted_os_open(path, *args, **kwargs):
        note(path)
        return real_os_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counted_open)
    monkeypatch.setattr(io, "open", counted_open)
    monkeypatch.setattr(os, "open", counted_os_open)
    return seen


def sample_opens(seen: list[str], run: Path) -> set[str]:
    """The run's sample files among the paths opened, relative to the run."""
    root = os.path.abspath(run) + os.sep
    return {p[len(root) :] for p in seen if p.startswith(root) and p.endswith(layout.SUFFIX)}


def _sample(sid: int, t: int = 11, h: int = 8) -> SampleTensors:
    g = torch.Generator().manual_seed(sid)
    return SampleTensors(
        sid,
        torch.randint(0, 1000, (t,), generator=g),
        torch.ones(t, dtype=torch.uint8),
        torch.randn(t, 3 * h, generator=g).to(torch.bfloat16),
        torch.randn(t, h, generator=g).to(torch.bfloat16),
    )


def age(run: Path) -> None:
    """Date every sample file a second back: written, then sealed a clock tick later or more (as a
    shard is, after its fsyncs), whatever the clock's granularity."""
    for p in run.glob(f"{layout.SHARDS}/*/*{layout.SUFFIX}"):
        st = p.stat()
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns - SEC))


def reseal_aged(run: Path) -> None:
    age(run)
    for folder in sorted((run / layout.SHARDS).iterdir()):
        seal(run, int(folder.name), list(read_seal(run, int(folder.name)).values()))


def sealed_run(root: Path, n: int, shard_size: int, tokens=lambda sid: 11) -> Path:
    """A run folder of ``n`` real sample files written by the store's writer, every shard sealed."""
    run = root / "run"
    writer = SampleWriter(run, shard_size, layers=[1, 3, 4], threads=4)
    records = writer.wait([writer.submit(_sample(i, tokens(i))) for i in range(n)])
    writer.close()
    age(run)
    for s in range(layout.num_shards(n, shard_size)):
        seal(run, s, [r for r in records if layout.shard_of(r.sample_id, shard_size) == s])
    return run


def cli(*args) -> tuple[int, str]:
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output
    return r.exit_code, r.output


def test_status_and_verify_on_sealed_shards_open_no_sample_file(finished_run, tmp_path, opens):
    run = Path(shutil.copytree(finished_run, tmp_path / "run"))
    reseal_aged(run)
    opens.clear()
    code, text = cli("status", run, "--json")
    integrity = next(c for c in json.loads(text)["checks"] if c["name"] == "integrity")["data"]
    assert code == 0 and integrity["files_good"] == 40 and integrity["files_trusted"] == 40
    code, text = cli("verify", run)
    assert code == 0 and "40 files good, headers and sizes checked, 40 unchanged since sealing" in text
    assert sample_opens(opens, run) == set()

    code, text = cli("verify", run, "--deep")  # the counter sees what the deep check reads: every file
    assert code == 0 and "GB/s" in text
    assert len(sample_opens(opens, run)) == 40


def test_a_file_changed_after_sealing_is_opened_and_caught(tmp_path, opens):
    run = sealed_run(tmp_path, 30, 10)
    folder = layout.shard_dir(run, 1)
    same_size = folder / layout.sample_name(12)
    with open(same_size, "r+b") as f:  # the header's length field zeroed: same size, newer mtime
        f.write(bytes(8))
    shorter = folder / layout.sample_name(15)
    before = shorter.stat()
    os.truncate(shorter, before.st_size - 1)
    os.utime(shorter, ns=(before.st_atime_ns, before.st_mtime_ns))  # size alone gives it away

    opens.clear()
    scans = scan_run(run, 30, 10, deep=False, threads=4)
    assert sample_opens(opens, run) == {"shards/000001/000000012.safetensors", "shards/000001/000000015.safetensors"}
    assert [(s.opened, s.trusted) for s in scans] == [(0, 10), (2, 8), (0, 10)]
    found = {(p.path, p.kind) for p in scans[1].problems}
    assert found == {
        ("shards/000001/000000012.safetensors", Damage.CORRUPT),
        ("shards/000001/000000015.safetensors", Damage.TRUNCATED),
    }
    assert all(isinstance(p.kind, Damage) for p in scans[1].problems)
    assert scans[1].missing == [12, 15] and not scans[1].sealed and scans[0].sealed and scans[2].sealed


def test_a_change_that_keeps_size_and_mtime_is_left_to_the_deep_check(tmp_path, opens):
    run = sealed_run(tmp_path, 10, 10)
    path = layout.sample_path(run, 4, 10)
    st = path.stat()
    flip_byte(path, -3)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the listing cannot tell: the fast check trusts it
    opens.clear()
    assert scan_shard(run, 0, range(10), deep=False).sealed and sample_opens(opens, run) == set()
    deep = scan_shard(run, 0, range(10), deep=True)  # the deep check never trusts the manifest
    assert deep.missing == [4] and [p.detail for p in deep.problems] == ["digest mismatch"]


def test_a_file_as_new_as_its_manifest_is_always_opened(tmp_path, opens):
    """Within one clock tick a change can keep a file's mtime: a file not older than its SEALED is
    never trusted by mtime."""
    run = sealed_run(tmp_path, 10, 10)
    late = max(p.stat().st_mtime_ns for p in run.glob(f"shards/*/*{layout.SUFFIX}")) + 1000
    os.utime(layout.sample_path(run, 7, 10), ns=(late, late))  # the newest file, sealed as it is
    seal(run, 0, list(read_seal(run, 0).values()))
    os.utime(layout.shard_dir(run, 0) / layout.SEALED, ns=(late, late))  # ... within the same tick
    assert [r.sample_id for r in read_seal(run, 0).values() if r.mtime_ns is None] == [7]
    opens.clear()
    scan = scan_shard(run, 0, range(10), deep=False)
    assert sample_opens(opens, run) == {"shards/000000/000000007.safetensors"}
    assert scan.sealed and (scan.opened, scan.trusted) == (1, 9)


def test_parallel_deep_verification_finds_a_bit_flip_among_many_files(tmp_path):
    big = set(range(100, 106))  # files of several read chunks, among many small ones
    run = sealed_run(tmp_path, 250, 50, tokens=lambda sid: 24000 if sid in big else 11)
    files = sorted(run.glob(f"shards/*/*{layout.SUFFIX}"))
    assert min(layout.sample_path(run, i, 50).stat().st_size for i in big) > CHUNK
    flip_byte(layout.sample_path(run, 103, 50), CHUNK + 12345)  # past the first chunk
    flip_byte(layout.sample_path(run, 201, 50), -3)

    scans = scan_run(run, 250, 50, deep=True, threads=8)
    problems = [(p.sample_id, p.kind, p.detail) for s in scans for p in s.problems]
    assert problems == [(103, Damage.CORRUPT, "digest mismatch"), (201, Damage.CORRUPT, "digest mismatch")]
    assert sum(len(s.good) for s in scans) == 248
    assert sum(s.bytes_read for s in scans) == sum(p.stat().st_size for p in files)
    assert [s.sealed for s in scans] == [True, True, False, True, False]

    fast = scan_run(run, 250, 50, deep=False, threads=8)  # changed after sealing: opened, header fine
    assert sum(s.opened for s in fast) == 2 and sum(s.trusted for s in fast) == 248


def test_a_manifest_without_mtimes_still_verifies_every_file(tmp_path, opens):
    run = sealed_run(tmp_path, 20, 10)
    for shard in (0, 1):  # as hsx wrote them before mtimes were recorded
        path = layout.shard_dir(run, shard) / layout.SEALED
        body = json.loads(path.read_text())
        body["files"] = [{k: v for k, v in f.items() if k != "mtime_ns"} for f in body["files"]]
        path.write_text(json.dumps({k: v for k, v in body.items() if k not in ("run", "record_digest")}))
    assert all(r.mtime_ns is None for r in read_seal(run, 0).values())

    opens.clear()
    scans = scan_run(run, 20, 10, deep=False, threads=4)
    assert len(sample_opens(opens, run)) == 20 and all(s.sealed and s.opened == 10 for s in scans)
    assert all(s.sealed for s in scan_run(run, 20, 10, deep=True, threads=4))

    path = layout.sample_path(run, 3, 10)
    os.truncate(path, path.stat().st_size - 5)
    scan = scan_shard(run, 0, range(10), deep=False)
    assert scan.missing == [3] and [p.kind for p in scan.problems] == [Damage.TRUNCATED] and not scan.sealed
