"""The run's record of its model's files (``target.check_files``, ``target.Digests``): what a
resume reads of a checkpoint, and what it refuses."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from types import SimpleNamespace

from conftest import HANG_GUARD_S, TINY
from hsx import fingerprint, target


def _run_of(model: Path, run: Path) -> SimpleNamespace:
    """A run folder whose spec records ``model`` (what ``check_files`` reads of a spec)."""
    run.mkdir()
    tokenizer = target.tokenizer_identity(target.load_tokenizer(model, False))
    return SimpleNamespace(
        model=target.identity(str(model), model), tokenizer=tokenizer, trust_remote_code=False, model_files=True
    )


def test_weights_are_hashed_in_the_background_and_a_changed_one_is_read_whole(tmp_path, monkeypatch):
    """Files at least ``SMALL_FILE`` large (a checkpoint's weight shards) are recorded by where they
    stand and hashed on the job's thread-side (``Digests``); once hashed, a change anywhere in them
    is found by reading the file whole, and a file that stands as recorded is never read."""
    monkeypatch.setattr(fingerprint, "SMALL_FILE", 1 << 20)  # the tiny model's 2.2 MB weights count as large
    model = Path(shutil.copytree(TINY, tmp_path / "model"))
    spec = _run_of(model, run := tmp_path / "run")
    target.record_files(run, model)
    weights = "model.safetensors"
    assert target.files_record(run, spec).files[weights].digest is None  # not yet: the job hashes it beside its work
    assert target.files_record(run, spec).files["tokenizer.json"].digest is not None
    with target.Digests(run, spec, model):
        deadline = time.monotonic() + HANG_GUARD_S
        while target.files_record(run, spec).files[weights].digest is None:  # progress, not a clock
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert target.files_record(run, spec).files[weights].digest == fingerprint.digest_file(model / weights)

    read = []
    monkeypatch.setattr(target, "digest_file", lambda p, *a: read.append(p.name) or fingerprint.digest_file(p, *a))
    assert target.check_files(run, spec, model) == [] and read == []  # every file as recorded: none read
    data = bytearray((model / weights).read_bytes())
    data[len(data) // 3] ^= 1  # one bit of one tensor, between the probes or not
    (model / weights).write_bytes(bytes(data))
    assert target.check_files(run, spec, model) == [f"{weights}: content differs (full digest)"]
    assert read == [weights]
