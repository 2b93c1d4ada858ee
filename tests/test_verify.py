"""``hsx verify``: the integrity check for scripts, and ``--repair`` that quarantines bad files so
the next ``hsx extract`` redoes exactly those samples, byte-identical to an undamaged run."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from typer.testing import CliRunner

from conftest import damage, hsx, run_files
from hsx.cli import app
from hsx.store import layout
from hsx.store.durable import is_temp
from hsx.store.format import check
from hsx.store.layout import parse_sample_name


def verify(out: Path, *args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["verify", str(out), *args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output
    return r.exit_code, r.output


def test_clean_run_verifies_deep_and_cheap(finished_run):
    code, text = verify(finished_run)
    assert code == 0 and "40 files good, headers and sizes checked" in text
    code, text = verify(finished_run, "--deep")
    assert code == 0 and re.search(
        r"40 files good, digests verified: [\d.]+ [kM]B read in [\d.]+ s \([\d.]+ GB/s\)", text
    )
    code, text = verify(finished_run, "--deep", "--json")
    report = json.loads(text)
    assert code == 0 and report["exit_code"] == 0 and report["redo_sample_ids"] == []
    data = report["integrity"]["data"]
    assert report["integrity"]["level"] == "ok" and data["deep"] is True
    size = sum(p.stat().st_size for p in finished_run.rglob("*.safetensors"))
    assert data["bytes_read"] == size and data["files_opened"] == 40 and data["read_rate_gbps"] > 0


def test_not_a_run_is_refused(tmp_path):
    code, text = verify(tmp_path)
    assert code == 2 and "not an hsx run folder" in text


def test_repair_quarantines_with_reasons_then_extract_redoes_exactly_those(finished_run, tmp_path):
    run = Path(shutil.copytree(finished_run, tmp_path / "run"))
    injected = damage(run)
    before = {p: p.stat().st_ino for p in (run / "shards").rglob("*.safetensors")}

    code, text = verify(run)  # cheap: the flipped bit in sample 2 goes unseen
    assert code == 1 and "000000002" not in text and "truncated: shards/000000/000000001.safetensors" in text

    code, text = verify(run, "--deep", "--repair", "--json")
    report = json.loads(text)
    assert code == 1
    assert report["redo_sample_ids"] == [1, 2, 3, 5, 15]
    moved = {m["path"]: m for m in report["quarantined"]}
    assert set(moved) == {p for p, kind in injected.items() if kind != "missing"}  # nothing to move for a gap
    for path, m in moved.items():
        assert not (run / path).exists()
        dest = run / m["to"]
        assert dest.is_file() and dest.parent.is_relative_to(run / layout.QUARANTINE)
        reason = json.loads(dest.with_name(dest.name + ".reason").read_text())
        assert reason["kind"] == injected[path] and reason["from"] == path and reason["detail"]
    # the stray temp file was kept (moved), never deleted
    assert (run / layout.QUARANTINE / "shards/000000/.000000006.safetensors.tmp-4242-1").read_bytes() == b"half a write"
    assert not [p for p in (run / "shards").rglob("*") if is_temp(p.name)]

    again = verify(run, "--deep", "--repair", "--json")
    assert json.loads(again[1])["quarantined"] == []  # idempotent: only the gaps remain

    out = hsx("extract", "--out", run).stdout
    assert re.search(r"40/40 done, 5 written now, 35 were already verified", out), out
    assert verify(run, "--deep")[0] == 0
    assert run_files(run) == run_files(finished_run)
    untouched = [p for p, ino in before.items() if p.exists() and parse_sample_name(p.name) not in (1, 2, 3, 5, 15)]
    assert untouched and all(p.stat().st_ino == before[p] for p in untouched)  # nothing else was rewritten
    for p in (run / "shards").rglob("*.safetensors"):
        check(p, parse_sample_name(p.name), deep=True)


def test_a_sealed_shard_deleted_whole_is_data_lost_named_by_shard(finished_run, tmp_path):
    """A shard folder deleted whole (its SEALED manifest with it) was "40 files good", exit 0, and
    status said nothing was wrong: the run's own record of what it sealed tells it from a shard not
    written yet. Verify and status exit 1, name the shard and the resume; the resume redoes it
    exactly, after which nothing is lost."""
    run = Path(shutil.copytree(finished_run, tmp_path / "run"))
    reference = run_files(run)
    shutil.rmtree(run / "shards" / "000002")
    code, text = verify(run)
    assert code == 1 and "10 missing; 30 files good" in text, text
    assert "lost: shard 000002: 10 sealed samples are gone" in text and "hsx extract redoes these samples" in text
    r = CliRunner().invoke(app, ["status", str(run)])
    assert r.exit_code == 1 and "lost: shard 000002: 10 sealed samples are gone" in r.output, r.output
    assert f"resume: hsx extract --out {run}" in r.output and "nothing to resume" not in r.output
    (run / "shards" / "000003" / layout.SEALED).unlink()  # the manifest alone gone: nothing lost, resealed
    r = CliRunner().invoke(app, ["extract", "--out", str(run)])
    assert r.exit_code == 0 and "redone     10 missing" in r.output, r.output
    assert run_files(run) == reference and verify(run, "--deep")[0] == 0


def test_a_shard_copied_from_another_run_is_foreign_everywhere_and_redone(finished_run, tmp_path):
    """A shard copied whole (mtimes kept, its SEALED with it) from a ``--layers dflash:3 --final-state
    pre`` run of the same data into this EAGLE-3 post-norm run: its files parse, their digests hold and
    their shapes fit, but their headers name other layers and the other side of the norm. Status,
    verify --deep and the dataset name them foreign; the resume moves them aside and redoes them."""
    import warnings

    from conftest import conversations, extract_args, write_jsonl
    from hsx.assess.status import assess
    from hsx.data import HsxDataset, SampleUnavailable

    other = tmp_path / "other"
    hsx(*extract_args(write_jsonl(tmp_path / "ten.jsonl", conversations(10)), other, "--layers", "dflash:3",
                      "--final-state", "pre"))  # fmt: skip
    run = Path(shutil.copytree(finished_run, tmp_path / "run"))
    reference = run_files(run)
    shutil.rmtree(run / "shards" / "000000")
    shutil.copytree(other / "shards" / "000000", run / "shards" / "000000")  # copy2: mtimes as they were

    for args in ((), ("--deep",)):
        code, text = verify(run, *args)
        assert code == 1 and "1 corrupt, 10 foreign; 30 files good" in text, text
        assert "another run's file: its layers [1, 3, 5], this run's [1, 3, 4]" in text, text
        assert "corrupt: shards/000000/SEALED (SEALED manifest unreadable or another run's)" in text, text
    assert assess(run).exit_code == 1
    with warnings.catch_warnings(record=True):
        sealed, listed = HsxDataset(run), HsxDataset(run, sealed_only=False)
    assert len(sealed) == len(listed) == 30 and all("foreign: " in listed.unavailable[i] for i in range(10))
    try:
        HsxDataset(run, ids=[0], verify=True)[0]
        raise AssertionError("another run's file was served")
    except SampleUnavailable as e:
        assert "another run's file" in str(e)

    r = CliRunner().invoke(app, ["extract", "--out", str(run)])
    assert r.exit_code == 0 and "redone     10 foreign" in r.output, r.output
    assert run_files(run) == reference and verify(run, "--deep")[0] == 0
    moved = sorted(p.name for p in (run / layout.QUARANTINE).rglob("*.safetensors"))
    assert len(moved) == 10  # moved aside, never deleted
