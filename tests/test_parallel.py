"""Tensor- and expert-parallel extraction (hsx.extract.group), and pipelines of stages
(hsx.extract.stages), on CPU, two ranks over gloo.

The references are independent: transformers' own ``output_hidden_states`` of one-sample forwards
of the same checkpoint in one process. Dense models must match every token within 1e-5 (float32).
MoE models are discontinuous (a router near-tie picks other experts under another reduction
order, and that token differs by O(1) from there on), so their tests count the tokens beyond
1e-5 and bound their share; every other token must still match within 1e-5.

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
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig, Qwen3MoeConfig

from conftest import (
    HANG_GUARD_S,
    TINY,
    conversations,
    hsx,
    kill_after_new_files,
    load_states,
    remount,
    require,
    run_files,
    save_tiny,
    stopped_cleanly,
    verified_files,
    write_jsonl,
)
from hsx import registry
from hsx.errors import Exit
from hsx.store import layout

TOL = 1e-5
NEAR_TIE_SHARE = 0.01  # at most this share of a MoE model's tokens may differ (router near-ties)
HIDDEN = 64
LAYERS = (0, 1)  # of 3-4 layers; the final state is captured too

DENSE = LlamaConfig(
    vocab_size=2048,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA whose kv heads split over 2 ranks
    head_dim=16,
)
QWEN3_MOE = Qwen3MoeConfig(
    vocab_size=2048,
    hidden_size=HIDDEN,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
)
DEEPSEEK_V3 = DeepseekV3Config(  # MLA (q/k head dim 24, v head dim 16), routed + shared experts
    vocab_size=2048,
    hidden_size=HIDDEN,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parallel-models")
    configs = {"dense": DENSE, "qwen3_moe": QWEN3_MOE, "deepseek_v3": DEEPSEEK_V3}
    return {name: save_tiny(config, root / name) for name, config in configs.items()}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("parallel-data") / "convs.jsonl", conversations(60, start=200))


def _args(model: Path, data: Path, out: Path, *extra) -> list:
    return [
        "extract",
        "--model",
        model,
        "--data",
        data,
        "--out",
        out,
        "--layers",
        ",".join(map(str, LAYERS)),
        "--dtype",
        "float32",
        "--shard-size",
        "10",
        "--batch-tokens",
        "512",
        "--device",
        "cpu",
        *extra,
    ]


@pytest.fixture(scope="module")
def dense_tp(models, data, tmp_path_factory) -> tuple[Path, str]:
    """An uninterrupted TP=2 run of the dense model, and what it printed."""
    out = tmp_path_factory.mktemp("dense-tp") / "run"
    proc = hsx(*_args(models["dense"], data, out, "--tensor-parallel", "2"))
    return out, proc.stdout + proc.stderr


def off_tokens(out: Path, model_dir: Path) -> tuple[int, int, float]:
    """(tokens whose captured states differ from the reference by more than TOL at any captured
    layer, tokens in all, the largest difference of the other tokens)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    off = total = 0
    worst = 0.0
    for path in sorted((out / "shards").rglob("*.safetensors")):
        t = load_states(path)
        with torch.no_grad():
            ref = model(t["input_ids"][None].long(), output_hidden_states=True).hidden_states
        want = torch.cat([ref[k + 1][0] for k in LAYERS] + [ref[-1][0]], dim=-1)
        got = torch.cat([t["aux_hidden_states"], t["hidden_states"]], dim=-1)
        diff = (got - want).abs().amax(dim=-1)
        off += int((diff > TOL).sum())
        total += diff.numel()
        worst = max(worst, float(diff[diff <= TOL].max()))
    return off, total, worst


def test_tp2_dense_equals_the_single_process_reference_and_records_the_layout(dense_tp, models, data):
    out, printed = dense_tp
    assert "starting 2 ranks (tensor 2, expert 1) on cpu" in printed
    assert "ranks 0-1 captured the same states on the first batch" in printed  # the replication check ran
    files = run_files(out)
    assert len(files) == 60
    off, total, worst = off_tokens(out, models["dense"])
    assert off == 0, f"{off} of {total} tokens beyond {TOL} (a dense model has no near-ties)"
    assert worst <= TOL
    spec = json.loads((out / "hsx.json").read_text())
    assert spec["parallel"] == {"tensor": 2, "expert": 1, "pipeline": 1}
    assert not (out / layout.GROUP).exists()  # a group that ended cleanly leaves no record behind
    assert_figures(out, models["dense"], spec["fidelity"]["stride"])
    assert_certified(out, dense=True)


def test_tp2_stores_the_teacher_transformers_gives(models, tmp_path):
    """``--teacher topk:64`` on two tensor-parallel ranks, whose LM head is split over them: every
    masked position's top-64 is that of transformers' own log-softmax on one process."""
    from test_teacher import K, assert_topk_is_transformers_own

    data = write_jsonl(tmp_path / "convs.jsonl", conversations(6))
    hsx(*_args(models["dense"], data, tmp_path / "run", "--tensor-parallel", "2", "--teacher", f"topk:{K}"))
    assert_topk_is_transformers_own(tmp_path / "run", models["dense"])


def assert_certified(out: Path, dense: bool) -> None:
    """The shadow recomputed samples 0-3 (the first few; 1 in 1000 by id) through transformers' plain
    path on the run's own ranks: every tap within its bound (a MoE model: but for the near ties
    allowed; a dense one, none), and the run's certificate says so."""
    from hsx import certify
    from hsx.store.format import read_header

    for sid in range(60):
        taps = certify.Taps.parse(read_header(layout.sample_path(out, sid, 10)).metadata["taps"])
        assert (taps.shadow is not None) == (sid < 4), sid
        assert taps.zero == taps.nonfinite == [0] * (len(LAYERS) + 1)
        if taps.shadow is not None:
            assert not taps.shadow.failed and taps.shadow.allowed == (0 if dense else 1), (sid, taps.shadow)
            assert max(taps.shadow.diff) < 1e-4  # float32: rounding alone
    cert = certify.read_certificate(out)
    assert cert.verdict == "passed" and cert.shadow.samples == [0, 1, 2, 3], cert


def assert_figures(out: Path, model_dir: Path, stride: int) -> None:
    """Every file's fidelity figure, measured by the group's sharded head, is the reference's: the
    tokens it checks, and the argmax of transformers' own logits there (but for near ties)."""
    from hsx import fidelity
    from hsx.store.format import read_header

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for path in sorted((out / "shards").rglob("*.safetensors")):
        sid, t, figure = layout.parse_sample_name(path.name), load_states(path), read_header(path).fidelity
        at = fidelity.positions(sid, t["loss_mask"].numpy(), stride)
        with torch.no_grad():
            predicted = model(t["input_ids"][None].long()).logits[0, at].argmax(-1)
        agreed = int((predicted == t["input_ids"][at + 1]).sum())
        assert figure.checked == len(at) and abs(figure.agreed - agreed) <= figure.near_ties, (sid, figure)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_tp2_ep2_moe_equals_the_reference_but_for_a_counted_share_of_near_ties(name, models, data, tmp_path):
    out = tmp_path / "run"
    proc = hsx(*_args(models[name], data, out, "--tensor-parallel", "2", "--expert-parallel", "2"))
    assert "ranks 0-1 captured the same states on the first batch" in proc.stdout + proc.stderr
    assert json.loads((out / "hsx.json").read_text())["parallel"] == {"tensor": 2, "expert": 2, "pipeline": 1}
    off, total, worst = off_tokens(out, models[name])
    print(f"{name}: {off} of {total} tokens beyond {TOL} (router near-ties); the others within {worst:.2e}")
    assert total > 2000
    assert off <= NEAR_TIE_SHARE * total
    assert worst <= TOL
    assert_certified(out, dense=False)


def test_a_layout_the_run_was_not_made_with_or_the_model_cannot_take_is_refused_by_name(
    dense_tp, models, data, tmp_path
):
    out, _ = dense_tp
    proc = hsx("extract", "--out", out, "--tensor-parallel", "1", check=False)
    assert proc.returncode == Exit.ACT
    assert "parallel: run has tensor 2, expert 1, asked for tensor 1, expert 1" in proc.stderr + proc.stdout
    refusals = [
        (TINY, ("--tensor-parallel", "2"), "num_key_value_heads = 1 does not split over 2 ranks"),
        (models["dense"], ("--tensor-parallel", "2", "--expert-parallel", "2"), "has no routed experts to split"),
        (models["qwen3_moe"], ("--tensor-parallel", "2", "--expert-parallel", "4"), "must be 1 or the tensor"),
    ]
    for i, (model, flags, reason) in enumerate(refusals):
        proc = hsx(*_args(model, data, tmp_path / f"new{i}", *flags), check=False)
        assert proc.returncode != 0 and reason in proc.stderr + proc.stdout, proc.stderr
        assert not (tmp_path / f"new{i}" / "hsx.json").exists()


# ---------------------------------------------------------------- kill -9 of a real group


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


def test_threads_given_reach_every_rank_and_a_rank_without_them_takes_its_share_of_the_cores(tmp_path, monkeypatch):
    """``--threads`` crosses from the options to the launched ranks (what ``group.Group`` hands the
    elastic launcher) and is what each rank's set-up gives torch; without it, the cores shared out."""
    from types import SimpleNamespace

    import torch.distributed.launcher.api as launcher

    from hsx.errors import Refused
    from hsx.extract import group
    from hsx.extract.options import ExtractOptions
    from hsx.extract.outcome import Failure, Outcome
    from hsx.spec import Parallel

    handed: list[tuple] = []

    def launch(config, entry):
        assert entry is group.rank_main and config.nproc_per_node == 2
        launched = Outcome(failure=Failure(error="Refused", message="launched"))
        return lambda *args: handed.append(args) or {0: launched.dump()}

    monkeypatch.setattr(launcher, "elastic_launch", launch)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    spec = SimpleNamespace(parallel=Parallel(tensor=2), model_dump_json=lambda: "{}")
    before = torch.get_num_threads()
    try:
        for threads, want in ((before + 1, before + 1), (None, 8 // 2)):
            opts = ExtractOptions(out=tmp_path / "run", device="cpu", threads=threads)
            with pytest.raises(Refused, match="launched"):
                group.Group().run(opts, spec, log=lambda m: None)
            on = group.RESOURCES.validate_json(handed[-1][5])  # rank_main's ``resources``
            assert on.threads == threads
            torch.set_num_threads(before)
            assert group.rank_device(on, 1, 2) == "cpu" and torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)


def test_fp8_expert_parallel_is_refused_where_transformers_ep_plan_fails():
    """FP8 routed experts are split by transformers' own EP plan, which fails under inference mode on
    the lowest transformers the pin admits: there the layout is refused by name before anything loads
    (CI runs this file on both ends of the pin), and on a newer one it is taken."""
    import transformers
    from packaging.version import Version

    from hsx.capture.transformers import FP8_EP_TRANSFORMERS, parallel_refusal

    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    }
    refusal = parallel_refusal(config, 2, 2)
    if Version(transformers.__version__) < Version(FP8_EP_TRANSFORMERS):
        assert refusal is not None and f"fails on transformers {transformers.__version__}" in refusal, refusal
        assert "upgrade transformers, or run without --expert-parallel" in refusal
    else:
        assert refusal is None
    unquantized = {k: v for k, v in config.items() if k != "quantization_config"}
    assert parallel_refusal(unquantized, 2, 2) is None  # hsx splits unquantized experts itself, on every version


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
