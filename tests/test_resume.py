"""The overlapped resume (job.resume.Verifier): the model loads and extraction runs while digests
are verified; a shard is written only after its own scan is settled; the result is byte for byte
the uninterrupted run's, and the summary says what verification read and how long extraction
waited for it."""

import json
import shutil
import time
from pathlib import Path

import pytest

from conftest import HANG_GUARD_S, flip_byte, run_files, unwrite
from hsx.extract import Crashed, ExtractOptions, extract
from hsx.store import layout, scan


def _files(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"*{layout.SUFFIX}")) if folder.exists() else []


def test_extraction_runs_while_verification_reads_and_never_writes_an_unsettled_shard(
    finished_run, tmp_path, monkeypatch
):
    """Shard 3 is gone, shard 1 lost two files, a bit flipped in shard 0 (only a digest finds it),
    shard 2 is whole. Reading shard 2's digests is held until a sample file of shard 3 exists:
    without the overlap the resume could never get there."""
    import hsx.extract.pipeline as pipeline
    import hsx.job.resume as resume

    run = shutil.copytree(finished_run, tmp_path / "run")
    expected = run_files(finished_run)
    unwrite(run, 3)  # never written (a shard sealed and then deleted would be data lost)
    for sid in (12, 17):
        layout.sample_path(run, sid, 10).unlink()
    flip_byte(layout.sample_path(run, 4, 10), -50)

    events: list[tuple[str, int]] = []
    held = {"waited": False, "timed_out": False}
    real_hash, real_settle, real_shard = scan._hash, resume.settle, pipeline.Extractor.batches_of

    def slow_hash(path, start, end):
        if path.parent.name == f"{2:06d}":
            deadline = time.monotonic() + HANG_GUARD_S  # breaks a deadlock if extraction never overlaps
            while not _files(layout.shard_dir(run, 3)):
                if time.monotonic() > deadline:
                    held["timed_out"] = True
                    break
                time.sleep(0.01)
            held["waited"] = True
        return real_hash(path, start, end)

    def settle(run_, s, summary):
        events.append(("settled", s.shard))
        return real_settle(run_, s, summary)

    def shard(self, s):  # where a shard's extraction begins
        events.append(("extract", s.shard))
        return real_shard(self, s)

    monkeypatch.setattr(scan, "_hash", slow_hash)
    monkeypatch.setattr(resume, "settle", settle)
    monkeypatch.setattr(pipeline.Extractor, "batches_of", shard)
    logged: list[str] = []
    summary = extract(ExtractOptions(out=run), log=logged.append)

    assert held["waited"] and not held["timed_out"], "extraction did not start while digests were read"
    extracted = [s for kind, s in events if kind == "extract"]
    assert sorted(extracted) == [0, 1, 3]
    for s in extracted:  # each shard written only after its own scan was settled
        assert events.index(("settled", s)) < events.index(("extract", s)), events
    assert events.index(("extract", 3)) < events.index(("settled", 2)), events  # the overlap itself
    assert summary.complete and summary.written == 13 and summary.redone == {"corrupt": 1, "missing": 2}  # 12, 17: gone
    assert run_files(run) == expected

    v = summary.verified
    assert v.files == 28 and v.bytes == sum(  # every file that was there was opened and read whole
        p.stat().st_size for s in (0, 1, 2) for p in _files(layout.shard_dir(finished_run, s))
    ) - sum(layout.sample_path(finished_run, sid, 10).stat().st_size for sid in (12, 17))
    assert v.seconds > 0 and v.waited >= 0
    assert any(line.startswith("verified 28 files") and "extraction waited" in line for line in logged), logged
    metrics = json.loads((run / layout.METRICS).read_text())  # the session's last beat
    assert (metrics["verify_files"], metrics["verify_bytes"]) == (v.files, v.bytes)
    assert metrics["verify_seconds"] == v.seconds and metrics["verify_waited_s"] == v.waited


def test_a_resume_with_every_file_in_place_loads_no_model_unless_a_digest_is_bad(finished_run, tmp_path, monkeypatch):
    import hsx.extract.pipeline as pipeline

    run = shutil.copytree(finished_run, tmp_path / "run")
    loads: list[str] = []
    real = pipeline.open_backend
    monkeypatch.setattr(pipeline, "open_backend", lambda *a, **k: loads.append("load") or real(*a, **k))
    summary = extract(ExtractOptions(out=run), log=lambda m: None)
    assert summary.complete and summary.written == 0 and loads == [] and summary.verified.files == 40

    flip_byte(layout.sample_path(run, 33, 10), -50)  # headers fine: only the digest tells
    summary = extract(ExtractOptions(out=run), log=lambda m: None)
    assert loads == ["load"] and summary.written == 1 and summary.redone == {"corrupt": 1}
    assert run_files(run) == run_files(finished_run)


def test_a_failure_during_extraction_stops_the_verification_before_the_job_leaves(finished_run, tmp_path, monkeypatch):
    """A crash of the extraction (here: the model fails to load) leaves no thread behind that
    could still tidy or seal shards once the lock is released."""
    import threading

    import hsx.extract.pipeline as pipeline

    run = shutil.copytree(finished_run, tmp_path / "run")
    shutil.rmtree(layout.shard_dir(run, 0))

    def broken(*a, **k):
        raise RuntimeError("model load failed")

    monkeypatch.setattr(pipeline, "open_backend", broken)
    with pytest.raises(Crashed, match="RuntimeError: model load failed") as crash:
        extract(ExtractOptions(out=run), log=lambda m: None)
    assert isinstance(crash.value.__cause__, RuntimeError) and str(crash.value.__cause__) == "model load failed"
    assert "model load failed" in json.loads((run / layout.CRASH).read_text())["reason"]
    assert not [t for t in threading.enumerate() if t.name == "hsx-verify"]
    assert not (run / layout.LOCK).exists()
