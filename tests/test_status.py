"""``hsx status`` on real runs: finished, killed mid-way, damaged, model changed, copied elsewhere.

The command line runs in-process (typer's runner) where a run only needs reading, and as a real
subprocess where a real extractor is involved. The GPU line has its own tests (test_gpus.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import (
    HANG_GUARD_S,
    SMALL_RUN,
    TINY,
    conversations,
    damage,
    extract_args,
    flip_byte,
    hsx,
    run_files,
    unwrite,
    write_jsonl,
)
from hsx.assess.checks import ranges
from hsx.cli import app
from hsx.store import layout
from hsx.store.durable import is_temp

LINE = re.compile(r"^\s+(ok|warn|fail)\s+(\w+)\s", re.MULTILINE)


def status(out: Path, *args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["status", str(out), *args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output
    return r.exit_code, r.output


def status_json(out: Path, *args: str) -> tuple[int, dict]:
    code, text = status(out, "--json", *args)
    return code, json.loads(text)


def levels(text: str) -> dict[str, str]:
    return {name: level for level, name in LINE.findall(text)}


def json_levels(report: dict) -> dict[str, str]:
    return {c["name"]: c["level"] for c in report["checks"]}


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------- real runs


def test_finished_run_is_ok_and_json_agrees(finished_run):
    code, text = status(finished_run)
    assert code == 0, text
    lv = levels(text)
    assert list(lv) == [
        "gpus", "interconnect", "volume", "progress", "pace", "integrity", "fidelity", "certificate", "model",
        "capture", "spec", "workers",
    ]  # fmt: skip
    assert all(lv[k] == "ok" for k in lv if k != "gpus")  # a machine without GPUs warns, never fails
    assert lv["gpus"] in ("ok", "warn")
    assert "40/40 samples" in text and "4 sealed, 0 partial, 0 untouched" in text
    assert "nothing to resume" in text
    code_j, report = status_json(finished_run)
    assert code_j == 0 and report["exit_code"] == 0 and report["verdict"] == "ok"
    assert json_levels(report) == lv
    progress = next(c for c in report["checks"] if c["name"] == "progress")["data"]
    assert progress["samples_done"] == progress["samples_total"] == 40 and progress["complete"]
    assert report["resume_command"] is None


def test_copied_run_is_still_ok_and_holds_no_absolute_path_of_its_own(finished_run, tmp_path):
    moved = copy_run(finished_run, tmp_path / "elsewhere" / "run-copy")
    code, report = status_json(moved, "--deep")
    assert code == 0, report
    assert report["run"] == str(moved)
    assert {k: v for k, v in json_levels(report).items() if k != "gpus"} == dict.fromkeys(
        [
            "interconnect",
            "volume",
            "progress",
            "pace",
            "integrity",
            "fidelity",
            "certificate",
            "model",
            "capture",
            "spec",
            "workers",
        ],
        "ok",
    )
    for path in moved.rglob("*"):  # only the spec may name outside paths (the model, the source data)
        if path.is_file() and path.name != layout.SPEC:
            assert str(finished_run).encode() not in path.read_bytes(), path


def test_damaged_files_are_each_listed_and_deep_finds_the_bit_flip(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path / "run")
    injected = damage(run)
    code, text = status(run)
    assert code == 1, text  # hsx extract redoes all of these by itself
    assert levels(text)["integrity"] == "fail"
    for path, kind in injected.items():
        if path.endswith("000000002.safetensors"):
            assert path not in text  # a flipped data bit keeps header and size intact
        else:
            assert f"{kind}: {path}" in text, (path, text)
    assert "resume: hsx extract --out " + str(run) in text
    assert "partial shards: 0-1" in text

    code, report = status_json(run, "--deep")
    assert code == 1 and report["verdict"] == "redo"
    integrity = next(c for c in report["checks"] if c["name"] == "integrity")
    found = {f["path"]: f["kind"] for f in integrity["data"]["files"]}
    assert found == injected
    assert integrity["data"]["problems"] == {"corrupt": 2, "misplaced": 2, "missing": 1, "stray": 1, "truncated": 1}
    flipped = next(f for f in integrity["data"]["files"] if f["path"].endswith("000000002.safetensors"))
    assert "digest" in flipped["detail"]
    assert report["resume_command"] == f"hsx extract --out {run}"


def test_changed_model_fails_the_model_line(finished_run, tmp_path):
    model = Path(shutil.copytree(TINY, tmp_path / "model"))
    run = copy_run(finished_run, tmp_path / "run")
    unwrite(run, 3)  # an unfinished run: there is something to resume
    spec = json.loads((run / layout.SPEC).read_text())
    spec["model"]["path"] = str(model)  # as if the run had been started from this copy
    (run / layout.SPEC).write_text(json.dumps(spec))
    assert status(run)[0] == 0

    weights = model / "model.safetensors"
    header_len = int.from_bytes(weights.read_bytes()[:8], "little")
    flip_byte(weights, 8 + header_len + 1)  # first byte of the first tensor: a probed region
    code, report = status_json(run)
    assert code == 2 and report["verdict"] == "act"
    m = next(c for c in report["checks"] if c["name"] == "model")
    assert m["level"] == "fail" and m["data"]["differences"] == ["model.safetensors: content differs"]
    assert any(line.startswith("fix first: model") for line in report["next"])

    shutil.rmtree(model)  # moved away: resume needs --model
    code, text = status(run)
    assert code == 2 and levels(text)["model"] == "fail" and "not found" in text
    assert f"hsx extract --out {run} --model NEW_PATH" in text
    assert levels(text)["capture"] == "warn"


def test_a_moved_model_is_checked_with_model_and_recorded_by_the_resume(finished_run, tmp_path):
    """The story: the model moved after the run started. ``status --model NEW`` checks NEW against
    the fingerprint; the resume with ``--model NEW`` records it beside the spec, and from then on
    status, the loader and export find it without being told."""
    from hsx.errors import Refused
    from hsx.extract import ExtractOptions, extract
    from hsx.spec import ModelLocation, load_spec
    from hsx.target import model_dir_for

    old = Path(shutil.copytree(TINY, tmp_path / "old"))
    run = copy_run(finished_run, tmp_path / "run")
    unwrite(run, 3)  # something left to resume
    spec = json.loads((run / layout.SPEC).read_text())
    spec["model"]["path"] = str(old)  # as if the run had been started from this copy
    (run / layout.SPEC).write_text(json.dumps(spec))
    spec_bytes = (run / layout.SPEC).read_bytes()
    new = old.rename(tmp_path / "new")

    code, text = status(run)
    assert code == 2 and levels(text)["model"] == "fail" and f"{old}: not found" in text
    code, report = status_json(run, "--model", str(new))
    m = next(c for c in report["checks"] if c["name"] == "model")
    assert code == 0 and m["level"] == "warn" and m["data"]["path"] == str(new), m
    assert f"resume with --model {new}" in m["action"]
    other = Path(shutil.copytree(TINY, tmp_path / "other"))
    flip_byte(other / "model.safetensors", -1)
    code, report = status_json(run, "--model", str(other))
    assert code == 2 and next(c for c in report["checks"] if c["name"] == "model")["level"] == "fail"
    with pytest.raises(Refused, match="content differs"):
        extract(ExtractOptions(out=run, model=str(other)), log=lambda m: None)
    assert not (run / layout.LOCATION).exists()

    from hsx.errors import Locked
    from hsx.lock import RunLock

    with RunLock(run, warn=lambda m: None), pytest.raises(Locked):  # another extractor is alive
        extract(ExtractOptions(out=run, model=str(new)), log=lambda m: None)
    assert not (run / layout.LOCATION).exists()  # a refused resume writes nothing

    said: list[str] = []
    extract(ExtractOptions(out=run, model=str(new)), log=said.append)
    assert f"model: {new} matches the run's fingerprint; recorded in {layout.LOCATION} as its location" in said
    record = ModelLocation.model_validate_json((run / layout.LOCATION).read_bytes())
    assert record.path == str(new) and record.previous == str(old) and "@" in record.by and record.recorded
    assert (run / layout.SPEC).read_bytes() == spec_bytes  # the spec stays written once
    code, text = status(run)
    assert code == 0 and levels(text)["model"] == "ok" and str(new) in text, text
    assert model_dir_for(run, load_spec(run)) == new
    said.clear()
    extract(ExtractOptions(out=run, model=str(new)), log=said.append)  # the same place: nothing rewritten
    assert not [line for line in said if "recorded in" in line]
    assert ModelLocation.model_validate_json((run / layout.LOCATION).read_bytes()) == record


def test_a_model_class_the_backend_lacks_fails_capture_fast_and_deep(finished_run, tmp_path):
    model = Path(shutil.copytree(TINY, tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    run = copy_run(finished_run, tmp_path / "run")
    for args in ((), ("--deep",)):  # found in the installed source / imported
        code, report = status_json(run, "--model", str(model), *args)
        capture = next(c for c in report["checks"] if c["name"] == "capture")
        assert code == 2 and capture["level"] == "fail", capture
        assert "has no NoSuchModelForCausalLM" in capture["figure"]


def test_unreadable_spec_or_plan_needs_a_person(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path / "run")
    plan = run / "plan" / "plan.parquet"
    plan.write_bytes(plan.read_bytes()[:100])
    code, report = status_json(run)
    assert code == 2 and json_levels(report)["spec"] == "fail"
    assert "unreadable" in next(c for c in report["checks"] if c["name"] == "spec")["figure"]

    (run / layout.SPEC).write_text("{not json")
    code, text = status(run)
    assert code == 2 and levels(text)["spec"] == "fail" and "cannot be resumed" in text
    assert levels(text)["integrity"] == "warn" and "not checked" in text


def test_run_killed_midway_lists_partial_shards_and_the_resume_command(finished_run, tmp_path, convs):
    out = tmp_path / "run"
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    args = [sys.executable, "-m", "hsx", *map(str, extract_args(convs, out))]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while time.monotonic() < deadline and proc.poll() is None:
            if len(list((out / "shards").rglob("*.safetensors")) if (out / "shards").exists() else []) >= 5:
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the extractor finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()

    code, report = status_json(out)
    lv = json_levels(report)
    stray = [p for p in (out / "shards").rglob("*") if is_temp(p.name)]
    assert code == (1 if stray else 0), report
    progress = next(c for c in report["checks"] if c["name"] == "progress")
    assert 5 <= progress["data"]["samples_done"] < 40
    shards = progress["data"]["shards"]
    assert shards["partial"] >= 1 or shards["sealed"] >= 1
    assert sum(shards.values()) == 4
    workers = next(c for c in report["checks"] if c["name"] == "workers")
    assert lv["workers"] == "warn" and workers["data"]["state"] == "dead" and workers["data"]["pid"] == proc.pid
    assert report["resume_command"] == f"hsx extract --out {out}"
    code, text = status(out)
    assert "resume: hsx extract --out" in text and "dead lock" in text
    if progress["data"]["partial_shards"]:
        assert "partial shards: " + ranges(progress["data"]["partial_shards"]) in text

    resumed = hsx("extract", "--out", out)
    assert "taking over a lock left by a dead extractor" in resumed.stderr + resumed.stdout
    assert status(out)[0] == 0
    assert run_files(out) == run_files(finished_run)


# ---------------------------------------------------------------- a run made with relative paths


@pytest.fixture(scope="module")
def relative_run(tmp_path_factory) -> Path:
    """A finished run of 12 conversations made from its folder with relative paths:
    ``hsx extract --model tinyR --data convs.jsonl --out run`` (2 shards)."""
    home = tmp_path_factory.mktemp("made-here")
    shutil.copytree(TINY, home / "tinyR")
    write_jsonl(home / "convs.jsonl", conversations(12))
    hsx("extract", "--model", "tinyR", "--data", "convs.jsonl", "--out", "run", *SMALL_RUN, cwd=home)
    return home / "run"


def relative_copy(run: Path, name: str) -> Path:
    """A copy beside it (so the relative paths hold from the same folder), its last shard to redo."""
    copy = copy_run(run, run.parent / name)
    unwrite(copy, 1)
    return copy


def test_a_relative_model_path_is_stored_absolute_and_works_from_any_directory(relative_run, tmp_path, monkeypatch):
    home = relative_run.parent
    spec = json.loads((relative_run / layout.SPEC).read_text())
    assert spec["model"]["path"] == str((home / "tinyR").resolve())
    assert [d["name"] for d in spec["data"]] == [str((home / "convs.jsonl").resolve())]
    run = relative_copy(relative_run, "run-a")
    monkeypatch.chdir(tmp_path)  # another directory, as after a reboot
    code, text = status(run)
    assert code == 0 and levels(text)["model"] == "ok", text
    assert "resume: hsx extract --out" in text
    hsx("extract", "--out", run, cwd=tmp_path)
    assert run_files(run) == run_files(relative_run)
    for args in (
        ["export", run, "sp", "--to", "speculators"],  # reads the model's final norm
        ["vocab", run, "--size", "64", "--dest", "vocab"],  # the model's vocabulary size
    ):
        done = CliRunner().invoke(app, list(map(str, args)))
        assert done.exit_code == 0, done.output
    assert (tmp_path / "sp" / "hsx-export.json").is_file() and any((tmp_path / "vocab").iterdir())


def test_an_older_runs_relative_model_path_resumes_from_its_directory_or_with_model(
    relative_run, tmp_path, monkeypatch
):
    home = relative_run.parent
    run = relative_copy(relative_run, "run-old")
    spec = json.loads((run / layout.SPEC).read_text())
    spec["model"]["path"] = "tinyR"  # as an older hsx wrote it: the --model as typed
    (run / layout.SPEC).write_text(json.dumps(spec, indent=2))
    told = "the run's model path tinyR is relative (an older hsx stored a folder as typed): run from the directory"

    monkeypatch.chdir(tmp_path)  # elsewhere: each command says what to do
    code, text = status(run)
    assert code == 2 and levels(text)["model"] == "fail", text
    assert "tinyR: not found from this directory" in text and told in text
    assert f"resume: hsx extract --out {run} --model NEW_PATH" in text
    for args in (
        ["export", run, "sp", "--to", "speculators", "--allow-incomplete"],  # reads the model's final norm
        ["vocab", run, "--size", "64", "--dest", "v"],  # the model's vocabulary size
    ):
        refused = CliRunner().invoke(app, list(map(str, args)))
        assert refused.exit_code == 2 and told in refused.output, refused.output
    refused = hsx("extract", "--out", run, cwd=tmp_path, check=False)
    assert refused.returncode == 2 and told in refused.stderr, refused.stderr

    hsx("extract", "--out", "run-old", cwd=home)  # from where it was made, as before
    assert run_files(run) == run_files(relative_run)
    unwrite(run, 1)
    hsx("extract", "--out", run, "--model", home / "tinyR", cwd=tmp_path)  # or from anywhere with --model
    assert run_files(run) == run_files(relative_run)
    code, text = status(run)  # the resume recorded where the model is: found from here from now on
    assert code == 0 and levels(text)["model"] == "ok", text


# ---------------------------------------------------------------- compact id lists


@pytest.mark.parametrize(
    ("ids", "text"),
    [
        ([], ""),
        ([3], "3"),
        ([1, 2, 3, 7, 9, 10], "1-3, 7, 9-10"),
        (range(0, 4000, 2), "0, 2, 4, 6, 8, 10 (+1994 more ranges)"),
    ],
)
def test_shard_ranges_stay_compact(ids, text):
    assert ranges(ids) == text


def scale_a_tensor_the_probes_miss(weights: Path) -> None:
    """Scale by 1.5 the first tensor the fingerprint's probes miss (a retrained layer they cannot see)."""
    from safetensors.torch import load_file, save_file

    from hsx.fingerprint import probe_digest

    tensors, probed = load_file(weights), probe_digest(weights)
    for name in sorted(tensors, key=lambda n: tensors[n].numel()):
        save_file(tensors | {name: tensors[name] * 1.5}, weights, metadata={"format": "pt"})
        if probe_digest(weights) == probed:
            return
    raise AssertionError("no tensor the probes miss")


def test_a_resume_without_model_refuses_a_tensor_the_probes_miss_and_a_changed_template(tmp_path):
    """One run, two models, no more: a tensor scaled by 1.5 between the fingerprint's probes, and a
    chat template edited, each went unnoticed by ``hsx extract --out`` alone, which wrote samples
    with the changed model. The run's record of its model's files (size, mtime, inode, full digest)
    refuses both by name, and nothing is written; the model restored as a copy (every file moved)
    is read whole once, proved the same, and the run goes on."""
    from hsx.extract import ExtractOptions, extract

    model = Path(shutil.copytree(TINY, tmp_path / "model"))
    pristine = Path(shutil.copytree(TINY, tmp_path / "pristine"))
    run = tmp_path / "run"
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(20))
    opts = dict(device="cpu", shard_size=10, batch_tokens=512, writers=2, codec="raw")
    extract(ExtractOptions(out=run, model=str(model), data=[data], **opts), log=lambda m: None)
    unwrite(run, 1)  # something left to resume

    weights = model / "model.safetensors"
    scale_a_tensor_the_probes_miss(weights)
    code, report = status_json(run)  # status reads no weights: it names the file the resume will read
    m = next(c for c in report["checks"] if c["name"] == "model")
    assert m["level"] == "ok" and m["data"]["moved"] == ["model.safetensors"], m
    assert "the next resume reads them whole" in m["figure"], m
    r = CliRunner().invoke(app, ["extract", "--out", str(run)])
    assert r.exit_code == 2 and "model.safetensors: content differs (full digest)" in r.output, r.output
    assert not (run / "shards" / "000001").exists()

    shutil.copy(pristine / "model.safetensors", weights)
    (model / "chat_template.jinja").write_text((pristine / "chat_template.jinja").read_text() + "{{ '' }}\n")
    r = CliRunner().invoke(app, ["extract", "--out", str(run)])
    assert r.exit_code == 2 and "chat template differs" in r.output, r.output
    assert not (run / "shards" / "000001").exists()

    shutil.rmtree(model)
    shutil.copytree(pristine, model)  # the same files, each in a new place
    code, report = status_json(run)
    assert next(c for c in report["checks"] if c["name"] == "model")["data"]["moved"] == sorted(
        p.name for p in model.iterdir()
    )
    r = CliRunner().invoke(app, ["extract", "--out", str(run)])
    assert r.exit_code == 0 and "samples    20/20 done, 10 written now" in r.output, r.output
    code, report = status_json(run)  # the resume proved them the same and recorded where they stand
    assert code == 0 and "moved" not in next(c for c in report["checks"] if c["name"] == "model")["data"]


# ---------------------------------------------------------------- the run's own records, damaged


def another_runs_records(finished_run: Path, tmp_path: Path) -> Path:
    """A run of its own (another spec: its identity), whose shard 1 hsx sealed and whose shard 2's
    files hsx deleted as consumed: records as hsx writes them, of another run."""
    from hsx.extract.window import delete_released
    from hsx.store.scan import scan_shard
    from hsx.store.writer import seal

    other = copy_run(finished_run, tmp_path / "other")
    spec = json.loads((other / layout.SPEC).read_text())
    (other / layout.SPEC).write_text(json.dumps(spec | {"created": "2020-01-01T00:00:00+00:00"}))
    for shard in (1, 2):
        seal(other, shard, list(scan_shard(other, shard, range(shard * 10, shard * 10 + 10), deep=False).good.values()))
    assert delete_released(other, set(range(20, 30)), 10) == 10
    return other


def integrity_files(out: Path) -> dict[str, str]:
    _, report = status_json(out)
    files = next(c for c in report["checks"] if c["name"] == "integrity")["data"]["files"]
    return {f["path"]: f"{f['kind']}: {f['detail']}" for f in files}


def test_every_damage_to_the_seal_records_is_named_and_the_resume_rebuilds_them(finished_run, tmp_path):
    """sealed/ records truncated, garbled, deleted, and another run's swapped in (its shard deleted
    too: the lost-shard protection holds); each is named by status (exit 1), none trusted nor read
    as none, and the resume rebuilds each from the data."""
    other = another_runs_records(finished_run, tmp_path)
    run = copy_run(finished_run, tmp_path / "run")
    reference = run_files(run)
    record = lambda s: layout.seal_record(run, s)  # noqa: E731
    record(0).write_bytes(record(0).read_bytes()[:20])  # truncated
    record(1).write_bytes(bytes(range(64)))  # garbage
    shutil.copy(layout.seal_record(other, 2), record(2))  # another run's, with this run's shard 2 gone
    shutil.rmtree(layout.shard_dir(run, 2))
    record(3).unlink()  # deleted, its shard whole
    found = integrity_files(run)
    assert found["sealed/000000.json"] == "damaged record: truncated or garbled (not JSON)", found
    assert found["sealed/000001.json"] == "damaged record: truncated or garbled (not JSON)", found
    assert found["sealed/000002.json"].startswith("damaged record: another run's record"), found
    assert found["sealed/000003.json"] == "damaged record: missing, though the shard's SEALED manifest is there"
    code, text = status(run)
    assert code == 1 and "4 damaged record" in text, text

    r = hsx("extract", "--out", run)
    assert "40/40 done, 10 written now" in r.stdout, r.stdout
    assert run_files(run) == reference and status(run)[0] == 0
    assert [json.loads(record(s).read_text())["ids"] for s in range(4)] == [[s * 10, s * 10 + 10] for s in range(4)]
    (run / layout.SEALS).rename(tmp_path / "sealed-aside")
    (run / layout.SEALS).write_text("not a folder")  # a file where the folder should be
    found = integrity_files(run)
    aside = "sealed is a file where the folder of records should be: move it aside, then resume"
    assert all(found[f"sealed/{s:06d}.json"].endswith(aside) for s in range(4)), found
    r = hsx("extract", "--out", run, check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert aside in " ".join(r.stderr.split()), r.stderr
    (run / layout.SEALS).unlink()
    (tmp_path / "sealed-aside").rename(run / layout.SEALS)
    assert status(run)[0] == 0


def test_every_damage_to_a_consumed_record_is_named_and_its_samples_are_redone(finished_run, tmp_path):
    """consumed/ records truncated, garbled and another run's swapped in (with its shard's files
    deleted): status crashed on the first (JSONDecodeError) and read the last as "consumed, nothing
    wrong". Each is named now (exit 1), its samples counted missing, never consumed nor lost; the
    resume redoes them and moves the record aside."""
    from hsx.extract.window import delete_released

    other = another_runs_records(finished_run, tmp_path)
    run = copy_run(finished_run, tmp_path / "run")
    reference = run_files(run)
    assert delete_released(run, set(range(0, 20)), 10) == 20
    layout.consumed_record(run, 0).write_bytes(layout.consumed_record(run, 0).read_bytes()[:30])
    layout.consumed_record(run, 1).write_bytes(b"\x00garbage" * 8)
    shutil.copy(layout.consumed_record(other, 2), layout.consumed_record(run, 2))
    for i in range(20, 30):
        layout.sample_path(run, i, 10).unlink()
    found = integrity_files(run)
    why = "damaged record: truncated or garbled (not JSON); its samples count as missing"
    assert found["consumed/000000.json"] == found["consumed/000001.json"] == why, found
    assert found["consumed/000002.json"].startswith("damaged record: another run's record"), found
    assert sum(k.startswith("missing") for k in found.values()) == 30, found  # lost or redone, never consumed
    code, text = status(run)
    assert code == 1 and "3 damaged record" in text, text

    r = hsx("extract", "--out", run)
    assert "redone     30 missing" in r.stdout, r.stdout
    assert run_files(run) == reference and status(run)[0] == 0, status(run)[1]
    assert not list((run / layout.CONSUMED).glob("*.json"))
    assert len(list((run / layout.QUARANTINE / layout.CONSUMED).glob("*.json"))) == 3  # moved aside, kept


def test_a_damaged_or_missing_model_record_is_named_refused_and_rebuilt_only_by_a_person(tmp_path):
    """model-files.json deleted (the issue's case: a tensor the probes miss scaled by 1.5, and the
    resume wrote with it, status exit 0), truncated, or another run's swapped in: status fails the
    model line naming it, the resume refuses it with the repair and writes nothing;
    ``hsx verify --repair --model`` rebuilds it from a model whose fingerprint matches. An edit in
    place that keeps the size, mtime and inode is caught by the ctime."""
    from hsx.extract import ExtractOptions, extract

    model = Path(shutil.copytree(TINY, tmp_path / "model"))
    run, other = tmp_path / "run", tmp_path / "other"
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(20))
    opts = dict(device="cpu", shard_size=10, batch_tokens=512, writers=2, codec="raw")
    for out, n in ((run, 20), (other, 10)):
        extract(ExtractOptions(out=out, model=str(model), data=[data], limit=n, **opts), log=lambda m: None)
    unwrite(run, 1)  # something left to resume
    record = run / layout.MODEL_FILES
    kept = record.read_bytes()
    scale_a_tensor_the_probes_miss(model / "model.safetensors")
    for harm, why in (
        (lambda: record.unlink(), "missing"),
        (lambda: record.write_bytes(kept[: len(kept) // 2]), "truncated or garbled (not JSON)"),
        (lambda: shutil.copy(other / layout.MODEL_FILES, record), "another run's record"),
    ):
        harm()
        code, report = status_json(run)
        m = next(c for c in report["checks"] if c["name"] == "model")
        assert code == 2 and m["level"] == "fail" and m["figure"].startswith(f"{layout.MODEL_FILES}: {why}"), m
        assert f"hsx verify {run} --repair --model PATH" in m["action"], m
        r = CliRunner().invoke(app, ["extract", "--out", str(run)])
        assert r.exit_code == 2 and why in r.output and "--repair --model PATH" in r.output, r.output
        assert not (run / "shards" / "000001").exists()

    shutil.copy(TINY / "model.safetensors", model / "model.safetensors")  # the run's model again
    r = CliRunner().invoke(app, ["verify", str(run), "--repair", "--model", str(model)])
    assert r.exit_code == 0 and f"{layout.MODEL_FILES} rebuilt from {model}" in r.output, r.output
    assert status(run)[0] == 0

    weights = model / "model.safetensors"
    st = weights.stat()
    with open(weights, "r+b") as f:  # one byte between the probes, in place: size and inode kept
        f.seek(st.st_size // 2 + 12345)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # and its mtime put back
    assert (weights.stat().st_size, weights.stat().st_mtime_ns, weights.stat().st_ino) == (
        st.st_size, st.st_mtime_ns, st.st_ino)  # fmt: skip
    r = CliRunner().invoke(app, ["extract", "--out", str(run)])
    assert r.exit_code == 2 and "model.safetensors: content differs (full digest)" in r.output, r.output


def test_records_beside_the_spec_that_are_damaged_or_another_runs_are_named(finished_run, tmp_path):
    """fidelity.json and model-location.json, written by hsx, then truncated or swapped in from
    another run: status names each (it accepted another run's baseline), exit non-zero."""
    from hsx.fidelity import record_baseline
    from hsx.spec import load_spec, record_location
    from hsx.store.format import Figure

    other = another_runs_records(finished_run, tmp_path)
    run = copy_run(finished_run, tmp_path / "run")
    model = Path(shutil.copytree(TINY, tmp_path / "model"))
    for r in (run, other):
        record_baseline(r, Figure(checked=100, agreed=90, near_ties=2, logprob=-1.0))
        assert record_location(r, load_spec(r), str(model))
    assert status(run)[0] == 0
    for name, line in ((layout.FIDELITY, "fidelity"), (layout.LOCATION, "model")):
        kept = (run / name).read_bytes()
        for damaged in (kept[: len(kept) // 2], (other / name).read_bytes()):
            (run / name).write_bytes(damaged)
            code, text = status(run)
            assert code != 0 and levels(text)[line] == "fail" and f"{name} is unreadable or damaged" in text, text
        (run / name).write_bytes(kept)
    assert status(run)[0] == 0
