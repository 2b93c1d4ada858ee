# ruff: noqa: F811
"""The process faults of tensor-parallel groups and pipelines (hsx.extract.group, hsx.extract.stages),
on CPU, two ranks over gloo: kill -9 of a launcher, a rank or a stage; a full volume; a file size
limit; SIGTERM; Ray workers made of TP groups; a rank blocked on a peer. Each resume is compared
byte for byte with an uninterrupted run. Apart from test_parallel (the layouts' numbers) so that the
two run on two test processes.

Kills are placed by progress (k new sample files, k from a seeded RNG, the seed printed), never by
time; every wait has a hang guard far beyond any healthy pace.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import (
    HANG_GUARD_S,
    hsx,
    kill_after_new_files,
    remount,
    require,
    run_files,
    stopped_cleanly,
    verified_files,
)
from hsx import registry
from hsx.errors import Exit
from hsx.store import layout

# test_parallel's module fixtures (data, dense_tp, models) too, built once here: the tests' parameters name them
from test_parallel import LAYERS, _args, assert_certified, data, dense_tp, models  # noqa: F401


def _sample_files(out: Path) -> set[Path]:
    shards = out / "shards"
    return set(shards.rglob("*.safetensors")) if shards.exists() else set()


def _wait(what: str, done, seed: int) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not done():
        assert time.monotonic() < deadline, f"seed {seed}: {what} did not happen in {HANG_GUARD_S} s"
        time.sleep(0.005)


def _gone(pids: list[int]) -> bool:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return not alive


def _group(out: Path, launcher: int) -> registry.GroupRecord | None:
    g = registry.read_group(out)
    return g if g is not None and g.launcher == launcher else None


@pytest.mark.faults
def test_kill9_of_the_launcher_or_of_a_rank_then_resume_is_byte_identical(dense_tp, models, data, tmp_path):
    """A kill of the launcher and one of rank 1, each after k new files: every rank is gone
    soon after (none outlives its group), every file on disk verifies, status names the dead
    ranks, and the resume equals the uninterrupted TP run byte for byte."""
    reference = run_files(dense_tp[0])
    seed = int(os.environ.get("HSX_CRASH_SEED", time.time_ns() % 10_000))
    print(f"HSX_CRASH_SEED={seed}")
    rng = random.Random(seed)
    out = tmp_path / "crashed"
    args = [sys.executable, "-m", "hsx", *map(str, _args(models["dense"], data, out, "--tensor-parallel", "2"))]
    for victim in ("launcher", "rank 1"):
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        before = _sample_files(out)
        k = rng.randint(1, 8)
        _wait("the group record", lambda p=proc: _group(out, p.pid) is not None or p.poll() is not None, seed)
        group = _group(out, proc.pid)
        assert group is not None, f"seed {seed}: the run ended (rc {proc.poll()}) before its ranks registered"
        pids = [r.pid for r in group.ranks]
        _wait(
            f"{k} new files",
            lambda p=proc, k=k, b=before: len(_sample_files(out) - b) >= k or p.poll() is not None,
            seed,
        )
        assert proc.poll() is None, f"seed {seed}: the run ended before {k} new files"
        assert len(run_files(out)) < 60, f"seed {seed}: the kill came after the run had finished"
        if victim == "launcher":
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        else:
            os.kill(pids[1], signal.SIGKILL)
            _, err = proc.communicate(timeout=HANG_GUARD_S)
            assert proc.returncode == Exit.ACT, err
            assert f"rank 1 (pid {pids[1]}) killed by SIGKILL" in err
            assert f"samples are done and durable; once the cause is fixed, resume with: hsx extract --out {out}" in err
        _wait("every rank's exit", lambda p=pids: _gone(p), seed)  # no rank outlives its launcher
        on_disk = _sample_files(out)
        assert set(verified_files(out)) == on_disk, f"seed {seed}: a partial file has a sample's name"
        if victim == "launcher":
            status = hsx("status", out, "--json", check=False)
            workers = next(c for c in json.loads(status.stdout)["checks"] if c["name"] == "workers")
            assert [r["state"] for r in workers["data"]["ranks"]] == ["dead", "dead"], workers
            assert any(f"rank 1: pid {pids[1]} on cpu, dead" in d for d in workers["details"])
    hsx("extract", "--out", out)
    assert run_files(out) == reference
    assert not (out / layout.GROUP).exists()


# ---------------------------------------------------------------- a pipeline of stages


@pytest.fixture(scope="module")
def dense_one(models, data, tmp_path_factory) -> Path:
    """An uninterrupted run of the dense model in one process: the bytes a pipeline must write."""
    from hsx.extract import ExtractOptions, extract

    out = tmp_path_factory.mktemp("dense-one") / "run"
    given = dict(layers=list(LAYERS), dtype="float32", shard_size=10, batch_tokens=512, device="cpu")
    extract(ExtractOptions(out=out, model=str(models["dense"]), data=[data], **given), log=lambda m: None)
    return out


@pytest.mark.faults
def test_a_pipeline_writes_one_process_bytes_through_a_killed_stage_and_a_full_disk(dense_one, models, data, tmpfs):
    """``--pipeline-parallel 2`` on a real 3 MB tmpfs. The first stage's rank is SIGKILLed after k new
    files: the group goes down (exit 2, the rank named), no rank outlives it, every file on disk
    verifies. The resume (the same pipeline) goes on until the volume fills and stops cleanly
    (exit 3, the resume line). Once the volume grows the resume finishes, and every file is byte
    for byte what one process wrote: a pipeline changes no bit."""
    reference = run_files(dense_one)
    seed = int(os.environ.get("HSX_CRASH_SEED", time.time_ns() % 10_000))
    print(f"HSX_CRASH_SEED={seed}")
    k = random.Random(seed).randint(1, 8)
    d = tmpfs("pp2", size="3m")
    out = d / "run"
    args = _args(models["dense"], data, out, "--pipeline-parallel", "2", "--allow-partial")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hsx", *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    _wait("the group record", lambda: _group(out, proc.pid) is not None or proc.poll() is not None, seed)
    group = _group(out, proc.pid)
    assert group is not None, f"seed {seed}: the run ended (rc {proc.poll()}) before its ranks registered"
    pids = [r.pid for r in group.ranks]
    _wait(f"{k} new files", lambda: len(_sample_files(out)) >= k or proc.poll() is not None, seed)
    assert proc.poll() is None, f"seed {seed}: the run ended before {k} new files"
    os.kill(pids[0], signal.SIGKILL)  # rank 0: the first stage (the last stage's rank writes)
    said, err = proc.communicate(timeout=HANG_GUARD_S)
    assert "starting 2 ranks (tensor 1, expert 1, pipeline 2) on cpu" in said + err
    assert "pipeline stages: 0: layers 0-1; 1: layers 2-3" in said + err
    assert proc.returncode == Exit.ACT and f"rank 0 (pid {pids[0]}) killed by SIGKILL" in err, err
    _wait("every rank's exit", lambda: _gone(pids), seed)
    on_disk = _sample_files(out)
    assert 0 < len(on_disk) < 60 and set(verified_files(out)) == on_disk, (
        f"seed {seed}: a partial file has a sample's name"
    )

    done, resume = stopped_cleanly(hsx("extract", "--out", out, "--allow-partial", check=False), out, 60)
    assert resume == f"hsx extract --out {out}" and done > len(on_disk)
    remount(d, size="64m")
    resumed = hsx(*resume.split()[1:])
    assert f"{60 - done} written now, {done} were already verified" in resumed.stdout
    assert run_files(out) == reference  # the shadow's figures too: its samples went through the stages
    assert_certified(out, dense=True)
    assert json.loads((out / "hsx.json").read_text())["parallel"] == {"tensor": 1, "expert": 1, "pipeline": 2}
    assert not (out / layout.GROUP).exists() and not (out / "lock.json").exists()
    refused = hsx("extract", "--out", out, "--pipeline-parallel", "4", check=False)
    said = refused.stdout + refused.stderr
    assert refused.returncode == Exit.ACT and "parallel: run has tensor 1, expert 1, pipeline 2, asked for" in said


@pytest.mark.faults
def test_a_pipeline_whose_stage_meets_a_file_size_limit_stops_cleanly_and_resumes_identical(
    dense_one, models, data, tmp_path
):
    """``--pipeline-parallel 2`` under a real ``ulimit -f`` (RLIMIT_FSIZE, which every rank inherits)
    that the largest samples outgrow: EFBIG in the writing stage was a traceback. The launcher says
    the stop in its own words (exit 3, the limit named, the remedy, the resume), no traceback, every
    file left verifies, and the resume without the limit writes what one process wrote."""
    import resource

    reference = run_files(dense_one)
    sizes = sorted(len(b) for b in reference.values())
    limit = (sizes[-1] + sizes[len(sizes) * 3 // 4]) // 2  # the largest quarter's top does not fit

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = tmp_path / "run"
    args = _args(models["dense"], data, out, "--pipeline-parallel", "2")
    stopped = hsx(*args, check=False, preexec_fn=small_files, env={"PYTHONDONTWRITEBYTECODE": "1"})
    err = " ".join(stopped.stderr.split())
    assert stopped.returncode == Exit.DISK_FULL and "Traceback" not in stopped.stderr, stopped.stderr
    assert "a file reached the size limit (ulimit -f" in err, err
    assert f"Raise the file-size limit (ulimit -f), then resume: hsx extract --out {out}" in err, err
    left = _sample_files(out)
    assert len(left) < 60 and set(verified_files(out)) == left  # whole or absent (the longest go first)
    hsx("extract", "--out", out)
    assert run_files(out) == reference


# ---------------------------------------------------------------- scale-out: Ray workers of tensor-parallel groups


@pytest.mark.faults
def test_a_tp2_group_whose_volume_fills_stops_cleanly_and_resumes_bit_identical(dense_tp, models, data, tmpfs):
    """The story's scenario at the story's layout: a TP2 group on a real 2 MB tmpfs that fills. Rank
    0's clean stop crosses to the launcher as its outcome: exit 3, the words a process of its own
    says and the command that resumes, no traceback, every file left verifies, no group record or
    lock left. A resume while another process holds the run is refused by rank 0 by name (exit 2,
    nothing written); once the volume grows, the resume printed finishes the run bit-identical to
    the uninterrupted TP2 run."""
    from hsx.lock import RunLock

    d = tmpfs("tp2", size="2m")
    out = d / "run"
    stopped = hsx(*_args(models["dense"], data, out, "--tensor-parallel", "2", "--allow-partial"), check=False)
    assert "ranks 0-1 captured the same states" in stopped.stdout + stopped.stderr
    done, resume = stopped_cleanly(stopped, out, 60)
    assert resume == f"hsx extract --out {out}"
    assert not (out / "group.json").exists() and not (out / "lock.json").exists()

    remount(d, size="64m")
    files = run_files(out)
    with RunLock(out, command="extract", warn=lambda m: None):  # another extractor holds the run
        refused = hsx(*resume.split()[1:], check=False)
    assert refused.returncode == Exit.ACT and "Traceback" not in refused.stderr, refused.stderr
    assert f"another extractor holds this run: pid {os.getpid()}" in refused.stderr
    assert run_files(out) == files

    resumed = hsx(*resume.split()[1:])
    assert f"{60 - done} written now, {done} were already verified" in resumed.stdout
    assert run_files(out) == run_files(dense_tp[0])


@pytest.mark.faults
def test_a_sigterm_to_a_tp2_launcher_stops_every_rank_cleanly_and_the_resume_is_bit_identical(
    dense_tp, models, data, tmp_path
):
    """What a scheduler sends before a kill, to the launcher of a TP2 group: the agent passes it to
    its ranks, rank 0 stops as one process does (writes in flight end whole), and the launcher says
    what one process says: exit 143, how many samples are durable, the command that resumes; no
    traceback, no partial file, no rank, group record or lock left. (It was the elastic agent's
    SignalException traceback.) The resume finishes bit-identical to the uninterrupted TP2 run."""
    seed = int(os.environ.get("HSX_CRASH_SEED", time.time_ns() % 10_000))
    out, log = tmp_path / "run", tmp_path / "stderr.txt"
    args = _args(models["dense"], data, out, "--tensor-parallel", "2", "--log-every", "0.05")
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "hsx", *map(str, args)], stdout=subprocess.DEVNULL, stderr=err)
        _wait("the group record", lambda: _group(out, proc.pid) is not None or proc.poll() is not None, seed)
        group = _group(out, proc.pid)
        assert group is not None, f"seed {seed}: the run ended (rc {proc.poll()}) before its ranks registered"
        kill_after_new_files(proc, out, random.Random(seed).randint(1, 8), seed, signal.SIGTERM, log)
    said = log.read_text()
    assert proc.returncode == 143 and "Traceback" not in said, said
    done = re.search(r"terminated \(SIGTERM\); (\d+)/60 samples are done and durable; resume with: (.+)$", said, re.M)
    assert done and int(done[1]) == len(verified_files(out)) == len(_sample_files(out)) < 60, said
    _wait("every rank's exit", lambda: _gone([r.pid for r in group.ranks]), seed)
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name], "a SIGTERM left a partial file"
    assert not (out / layout.GROUP).exists() and not (out / "lock.json").exists()
    resumed = hsx(*shlex.split(done[2])[1:])
    assert f"{60 - int(done[1])} written now, {done[1]} were already verified" in resumed.stdout
    assert run_files(out) == run_files(dense_tp[0])


@pytest.mark.faults
def test_ray_workers_of_tp_groups_survive_a_killed_rank_and_equal_one_group(dense_tp, models, data, tmp_path):
    """``--workers 2 --tensor-parallel 2``: two Ray workers, each launching its own group of two
    ranks. Rank 1 of a worker holding an unsealed shard is SIGKILLed (its rank 0 frozen meanwhile,
    so the shard cannot be sealed while the test looks): the group goes down with its actor, Ray
    restarts the actor on a fresh group, and the run still equals the one-group run byte for byte,
    with no rank of any group left behind."""
    from test_scaleout import Driver, records, until

    require("ray")
    reference = run_files(dense_tp[0])
    out = tmp_path / "run"
    args = _args(models["dense"], data, out, "--tensor-parallel", "2", "--workers", "2")
    driver = Driver(args, tmp_path / "driver.log")
    try:
        victim, groups = None, {}
        while victim is None:
            rec = until(lambda: next((r for r in records(out) if r["phase"] == "working"), None), driver)
            os.kill(rec["pid"], signal.SIGSTOP)
            now = next((r for r in records(out) if r["pid"] == rec["pid"]), None)
            groups |= {r["pid"]: [rank["pid"] for rank in r["ranks"]] for r in records(out)}
            if now and now["phase"] == "working" and not (out / "shards" / f"{now['shard']:06d}" / "SEALED").exists():
                assert [r["rank"] for r in now["ranks"]] == [0, 1] and now["ranks"][0]["pid"] == now["pid"], now
                os.kill(now["ranks"][1]["pid"], signal.SIGKILL)
                victim = now
            os.kill(rec["pid"], signal.SIGCONT)
        assert len(list((out / "shards").glob("*/SEALED"))) < 6, "the kill came after the run had finished"
        log = driver.wait(timeout=HANG_GUARD_S)
        assert driver.proc.returncode == 0, log
        assert "extracting 6 shards with 2 CPU workers, each a group of 2 ranks (tensor 2, expert 1)" in log
        pids = ", ".join(str(r["pid"]) for r in victim["ranks"])
        assert f"worker pid {victim['pid']} (rank 0 of 2: pids {pids}) on" in log and "died" in log, log
        assert run_files(out) == reference
        assert_certified(out, dense=True)
        assert not (out / "workers").exists()
        every = [pid for ranks in groups.values() for pid in ranks]
        assert len(every) >= 4 and _gone(every), groups  # both workers' groups were seen, and are gone
    finally:
        driver.kill_all()


@pytest.mark.faults
def test_a_tp_worker_whose_driver_lost_the_run_stops_with_all_its_ranks(models, data, tmp_path):
    """Invariant 4 for a worker of several ranks: once another extractor holds the run lock, rank
    0's heartbeat fences its worker. Rank 1 is frozen meanwhile (the shard cannot finish, and rank 0
    waits on it in a collective), so the fence, not the end of the run, is what stops the group:
    rank 0 exits, rank 1 goes with it, and no sample file appears after that. The driver stops
    too, saying who holds the run (else Ray would restart its fenced worker without end)."""
    from hsx.lock import LOCK, this_process
    from hsx.store.durable import write_durable
    from test_scaleout import Driver, records, until

    require("ray")
    out = tmp_path / "run"
    driver = Driver(_args(models["dense"], data, out, "--tensor-parallel", "2", "--workers", "1"), tmp_path / "d.log")
    try:
        rec = until(lambda: next((r for r in records(out) if r["phase"] == "working"), None), driver)
        ranks = [r["pid"] for r in rec["ranks"]]
        os.kill(ranks[1], signal.SIGSTOP)
        write_durable(out / LOCK, this_process("extract").model_dump_json().encode())  # another extractor took it over
        until(lambda: _gone(ranks))
        fenced = run_files(out)
        assert len(list((out / "shards").glob("*/SEALED"))) < 6, "the run ended before the fence"
        log = driver.wait(timeout=HANG_GUARD_S)
        assert driver.proc.returncode == 2 and "another extractor holds this run: pid" in log, log
        assert run_files(out) == fenced, "a sample was written after the worker was fenced"
    finally:
        driver.kill_all()


@pytest.mark.faults
def test_a_tp_worker_refused_at_load_stops_the_driver_with_that_refusal(models, data, tmp_path):
    """A refusal that only a worker can meet (its node loads the model: here the repository's own
    code, whose loaded modules keep the final norm under a name hsx does not know; the driver never
    builds the model) is the driver's error, naming the worker's ranks, not "Ray gave up" after
    retries; no rank of the group is left, and no sample was written."""
    from test_scaleout import Driver

    require("ray")
    model = tmp_path / "remote"
    shutil.copytree(models["dense"], model)
    config = json.loads((model / "config.json").read_text())
    auto = {"AutoConfig": "odd.OddConfig", "AutoModelForCausalLM": "odd.OddForCausalLM"}
    (model / "config.json").write_text(
        json.dumps(config | {"model_type": "odd", "architectures": ["OddForCausalLM"], "auto_map": auto})
    )
    (model / "odd.py").write_text(
        "from transformers import LlamaConfig, LlamaForCausalLM\n\n\n"
        "class OddConfig(LlamaConfig):\n"
        "    model_type = 'odd'\n\n\n"
        "class OddForCausalLM(LlamaForCausalLM):\n"
        "    config_class = OddConfig\n\n"
        "    def __init__(self, config):\n"
        "        super().__init__(config)\n"
        "        self.model.last = self.model.norm\n"
        "        del self.model.norm\n"
    )
    out = tmp_path / "run"
    args = _args(model, data, out, "--tensor-parallel", "2", "--workers", "1", "--trust-remote-code")
    driver = Driver(args, tmp_path / "d.log")
    try:
        log = driver.wait(timeout=HANG_GUARD_S)
        assert driver.proc.returncode == 2, log
        said = re.search(r"error: worker pid (\d+) \(rank 0 of 2: pids (\d+), (\d+)\) on .* refused at load: (.*)", log)
        assert said and said[1] == said[2] and "but no final norm" in said[4], log
        assert "Ray gave up" not in log
        assert _gone([int(said[2]), int(said[3])])
        assert not list(out.rglob("*.safetensors")) and not (out / "workers").exists()
    finally:
        driver.kill_all()


RANK = """
import signal, sys, torch, torch.distributed as dist
from hsx.extract.group import stop_on_sigterm
rank = int(sys.argv[1])
stop_on_sigterm()
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
print("receiving" if rank else "silent", flush=True)
if rank:
    dist.recv(torch.zeros(1), src=0)  # the stage before never sends: stopped, or gone quiet
while True:
    signal.pause()
"""


@pytest.mark.faults
def test_a_rank_blocked_on_a_peer_that_never_sends_stops_after_sigterm(tmp_path):
    """Stopping a pipeline was not prompt: a stage waiting in a receive from a stage that never sends
    ignored the SIGTERM the agent passed on (Python runs its handler only back in Python) until the
    agent's SIGKILL. Two real gloo ranks; rank 1 waits on rank 0, which never sends; SIGTERM to rank
    1 ends it (``group.STUCK_EXIT``, or its clean stop had the signal come before the receive),
    and rank 0 is untouched."""
    from hsx.extract.group import STUCK_EXIT

    store = tmp_path / "store"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), str(store)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]
    try:
        assert [p.stdout.readline().strip() for p in ranks] == ["silent", "receiving"]
        ranks[1].send_signal(signal.SIGTERM)
        _, err = ranks[1].communicate(timeout=HANG_GUARD_S)
        assert ranks[1].returncode == STUCK_EXIT or "Terminated" in err, (ranks[1].returncode, err)
        assert ranks[0].poll() is None
    finally:
        for p in ranks:
            p.kill()
            p.communicate()
