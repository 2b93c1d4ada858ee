"""kill -9 of a real extractor at random points, then resume: the output is byte-identical to an
uninterrupted run, and no file is rewritten once it has verified."""

import os
import random
import signal
import subprocess
import sys
import time

from conftest import TINY, conversations, hsx, run_files, verified_files, write_jsonl

KILLS = 6


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


def test_sigkill_at_random_points_then_resume_is_byte_identical(tmp_path):
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(120, start=300))
    hsx(*_args(data, tmp_path / "reference"))
    reference = run_files(tmp_path / "reference")
    assert len(reference) == 120

    seed = int(os.environ.get("HSX_CRASH_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    out = tmp_path / "crashed"
    verified: dict = {}
    kills = 0
    for _ in range(KILLS):
        proc = subprocess.Popen(
            [sys.executable, "-m", "hsx", *map(str, _args(data, out))],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(rng.uniform(1.0, 9.0))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
        now = verified_files(out)
        for p, ident in verified.items():  # once verified, never rewritten
            assert now.get(p) == ident, f"seed {seed}: {p.name} changed after it had verified"
        verified = now
    assert kills >= 5, f"seed {seed}: only {kills} runs were killed mid-way"
    hsx(*_args(data, out))
    final = verified_files(out)
    for p, ident in verified.items():
        assert final[p] == ident, f"seed {seed}: {p.name} rewritten by the final resume"
    assert run_files(out) == reference, f"seed {seed}"
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
