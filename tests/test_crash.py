"""kill -9 of a real extractor at points defined by its progress, then resume: the output is
byte-identical to an uninterrupted run, and no file is rewritten once it has verified. The last
stop is a SIGTERM (what a scheduler sends), off a terminal: the run logs progress lines, stops
cleanly (exit 143, no partial file) and prints the command that resumes it.

Each kill waits until the run has written k more sample files (k from a seeded RNG, the seed in
every message), so where the kills land depends on the seed, never on the machine's speed."""

import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time

from conftest import TINY, conversations, hsx, kill_after_new_files, run_files, verified_files, write_jsonl

SAMPLES = 120
KILLS = 6
MAX_STEP = 10  # at most KILLS * MAX_STEP = 60 of the 120 samples are written before the last kill


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
    log = tmp_path / "stderr.txt"
    for i in range(KILLS):
        term = i == KILLS - 1  # the last stop: SIGTERM, once a progress line is logged
        with open(log, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "hsx", *map(str, _args(data, out)), *(["--log-every", "0.01"] if term else [])],
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=os.environ | {"PYTHONUNBUFFERED": "1"},
            )
            sig = signal.SIGTERM if term else signal.SIGKILL
            kill_after_new_files(proc, out, rng.randint(1, MAX_STEP), seed, sig, log if term else None)
        assert proc.returncode == (143 if term else -signal.SIGKILL), f"seed {seed}: kill {i} did not land mid-run"
        assert len(run_files(out)) < SAMPLES, f"seed {seed}: kill {i} came after the run had finished"
        now = verified_files(out)
        for p, ident in verified.items():  # once verified, never rewritten
            assert now.get(p) == ident, f"seed {seed}: {p.name} changed after it had verified"
        verified = now
    err = log.read_text()
    assert re.search(r"^progress done=\d+/120 rate=[\d.]+/s eta=(\d+s|-) free=[\d.]+GB last_error=-$", err, re.M), err
    said = re.search(rf"terminated \(SIGTERM\); (\d+)/{SAMPLES} samples are done and durable; resume with: ", err)
    assert said and 0 < int(said[1]) <= len(verified), err  # each one it counts verified (a resume may find more)
    last = [line for line in err.splitlines() if line.startswith("progress done=")][-1]
    assert last.startswith(f"progress done={said[1]}/{SAMPLES} "), f"seed {seed}: the last line is not the count: {err}"
    assert f"durable; resume with: hsx extract --out {out} --model {TINY}" in err, err
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name], "a SIGTERM left a partial file"
    hsx(*shlex.split(err.split("resume with: ")[1].splitlines()[0])[1:])  # the resume, as printed
    final = verified_files(out)
    for p, ident in verified.items():
        assert final[p] == ident, f"seed {seed}: {p.name} rewritten by the final resume"
    assert run_files(out) == reference, f"seed {seed}"
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]


# an extraction whose capture fails, as a bug would, on its second batch: after the spec, a shard or more written
FAULTY = """
import sys
from hsx.capture.transformers import TransformersBackend

real, calls = TransformersBackend.capture, []

def capture(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        {}["injected fault"]
    return real(self, *args, **kwargs)

TransformersBackend.capture = capture
from hsx.cli import main
sys.argv[0] = "hsx"
main()
"""


def test_an_unexpected_error_is_recorded_reported_by_status_until_a_session_completes(tmp_path):
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(12))
    out = tmp_path / "run"
    args = [*_args(data, out), "--batch-tokens", "64", "--writers", "1"]
    env = os.environ | {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", FAULTY, *map(str, args)], capture_output=True, text=True, env=env)
    said = " ".join(proc.stderr.split())
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "hsx extract failed unexpectedly: KeyError: 'injected fault' at " in said, said
    assert f"the traceback and the log's last lines are in {out / 'crash.json'}" in said, said
    record = json.loads((out / "crash.json").read_text())
    assert record["error"] == "KeyError" and record["where"].endswith("in capture"), record
    assert record["command"].startswith("hsx extract --out") and record["at"]
    assert any("injected fault" in line for line in record["traceback"]), record["traceback"]
    assert record["log"] and any(line.startswith("model:") or "samples" in line for line in record["log"]), record
    # status: crashed, non-zero, naming what failed; the resume it prints comes after acting
    status = hsx("status", out, "--json", check=False)
    assert status.returncode == 2, status.stdout
    report = json.loads(status.stdout)
    crash = next(c for c in report["checks"] if c["name"] == "crash")
    assert crash["level"] == "fail" and "KeyError: 'injected fault'" in crash["figure"], crash
    # a session that completes clears it: status says nothing is wrong again
    done = hsx(*args)
    assert "the last session failed unexpectedly" in done.stderr, done.stderr
    assert not (out / "crash.json").exists()
    assert hsx("status", out, check=False).returncode == 0
