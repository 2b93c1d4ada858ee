"""kill -9 of a real extractor at points defined by its progress, then resume: the output is
byte-identical to an uninterrupted run, and no file is rewritten once it has verified.

Each kill waits until the run has written k more sample files (k from a seeded RNG, the seed in
every message), so where the kills land depends on the seed, never on the machine's speed."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import TINY, conversations, hsx, run_files, verified_files, write_jsonl

SAMPLES = 120
KILLS = 6
MAX_STEP = 10  # at most KILLS * MAX_STEP = 60 of the 120 samples are written before the last kill
HANG_GUARD_S = 600  # a hang, not a pace: a healthy run on the slowest machine writes a file within this


def _args(data, out):
    return [
        "extract",
        "--model",
        TINY,
        "--data",
        data,
        "--out",
        out,
        "--shard-size",
        "10",
        "--batch-tokens",
        "256",
        "--writers",
        "2",
        "--device",
        "cpu",
    ]


def _sample_files(out: Path) -> set[Path]:
    shards = out / "shards"
    return set(shards.rglob("*.safetensors")) if shards.exists() else set()


def _kill_after(proc: subprocess.Popen, out: Path, k: int, seed: int) -> None:
    """SIGKILL ``proc`` as soon as k sample files have appeared that were not there when it started."""
    before = _sample_files(out)
    deadline = time.monotonic() + HANG_GUARD_S
    while len(_sample_files(out) - before) < k:
        assert proc.poll() is None, f"seed {seed}: the extractor ended (rc {proc.returncode}) before {k} new files"
        assert time.monotonic() < deadline, f"seed {seed}: no progress for {HANG_GUARD_S} s"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_sigkill_at_progress_points_then_resume_is_byte_identical(tmp_path):
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(SAMPLES, start=300))
    hsx(*_args(data, tmp_path / "reference"))
    reference = run_files(tmp_path / "reference")
    assert len(reference) == SAMPLES

    seed = int(os.environ.get("HSX_CRASH_SEED", time.time_ns() % 10_000))
    print(f"HSX_CRASH_SEED={seed}")
    rng = random.Random(seed)
    out = tmp_path / "crashed"
    verified: dict = {}
    for i in range(KILLS):
        proc = subprocess.Popen(
            [sys.executable, "-m", "hsx", *map(str, _args(data, out))],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _kill_after(proc, out, rng.randint(1, MAX_STEP), seed)
        assert proc.returncode == -signal.SIGKILL, f"seed {seed}: kill {i} did not land mid-run"
        assert len(run_files(out)) < SAMPLES, f"seed {seed}: kill {i} came after the run had finished"
        now = verified_files(out)
        for p, ident in verified.items():  # once verified, never rewritten
            assert now.get(p) == ident, f"seed {seed}: {p.name} changed after it had verified"
        verified = now
    hsx(*_args(data, out))
    final = verified_files(out)
    for p, ident in verified.items():
        assert final[p] == ident, f"seed {seed}: {p.name} rewritten by the final resume"
    assert run_files(out) == reference, f"seed {seed}"
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
