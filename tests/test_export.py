"""hsx export: each trainer's own loader reads the export, states and masks equal hsx's, the
pre-norm state reproduces transformers' reference, a killed export resumes, bad input is refused."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import HANG_GUARD_S, TINY, conversations, flip_byte, hsx, normed_model, require, write_jsonl
from hsx.data import HsxDataset
from hsx.errors import NormUnavailable
from hsx.export.core import JOB, LOG, MANIFEST
from hsx.export.norm import TOLERANCE, load_final_norm, measure
from hsx.export.trainer import DIRECTION_ONLY
from hsx.plan import Plan

warnings.filterwarnings("ignore", message=".*is not tested with current version of modelopt.*")
RUN_ARGS = ("--shard-size", "10", "--batch-tokens", "512", "--writers", "2", "--device", "cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return normed_model(tmp_path_factory.mktemp("model") / "normed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model) -> dict[str, Path]:
    """20 samples, 2 shards: default layers [1, 3, 4], and [1, 3, 7] (7 = the last layer's raw output),
    the latter also stored with each codec ("last-zstd", "last-fp8")."""
    root = tmp_path_factory.mktemp("runs")
    data = write_jsonl(root / "convs.jsonl", conversations(20))
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    base = [sys.executable, "-m", "hsx", "extract", "--model", str(model), "--data", str(data), *RUN_ARGS]
    last = ["--layers", "1,3,7"]
    variants = {"run": [], "last": last, "last-zstd": [*last, "--codec", "zstd"], "last-fp8": [*last, "--codec", "fp8"]}
    procs = [
        subprocess.Popen(
            [*base, "--out", str(root / name), *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for name, extra in variants.items()
    ]
    for p in procs:  # all at once: most of each is start-up
        output = p.communicate(timeout=HANG_GUARD_S)[0]
        assert p.returncode == 0, output.decode()
    return {name: root / name for name in variants}


@pytest.fixture(scope="module")
def reference(model):
    """transformers' own forward: the final norm's input (pre-norm) and output (post-norm) of a sample."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    seen: dict[str, torch.Tensor] = {}

    def hook(_mod, args, out):
        seen["pre"], seen["post"] = args[0][0].detach(), out[0].detach()

    m.model.norm.register_forward_hook(hook)

    @torch.no_grad()
    def forward(input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        states = m(input_ids=input_ids[None], output_hidden_states=True).hidden_states
        return dict(seen) | {"norm": m.model.norm, "head": m.lm_head, "states": [h[0] for h in states]}

    return forward


def export(*args, code: int = 0) -> str:
    """``hsx export`` through the real command line, in this process (the trainers import slowly)."""
    from typer.testing import CliRunner

    from hsx.cli import app

    result = CliRunner().invoke(app, ["export", *map(str, args)])
    assert result.exit_code == code, f"{result.output}\n{result.exception!r}"
    return result.output


def hsx_samples(run: Path) -> list[dict]:
    ds = HsxDataset(run, verify=True)
    return [ds[i] for i in range(len(ds))]


def manifest_ok(dest: Path, n: int) -> dict:
    """The manifest lists every file with its size and digest, and they hold."""
    import xxhash

    m = json.loads((dest / MANIFEST).read_text())
    assert len(m["samples"]) == n
    for f in m["files"]:
        data = (dest / f["path"]).read_bytes()
        assert len(data) == f["size"] and f"xxh3_128:{xxhash.xxh3_128(data).hexdigest()}" == f["digest"]
    assert not [p for p in dest.rglob("*") if ".tmp-" in p.name]
    return m


# ---------------------------------------------------------------- SpecForge


EAGLE3_KEYS = ("input_ids", "hidden_state", "target", "loss_mask")


def specforge_read(
    dest: Path, lengths: list[int], strategy: str = "eagle3", keys: tuple[str, ...] = EAGLE3_KEYS
) -> dict[int, dict[str, torch.Tensor]]:
    """Every sample of a SpecForge export through its own offline reader and loader for ``strategy``,
    by export index, cut to its length: its ``keys`` (EAGLE-3's: ``input_ids``, ``hidden_state``
    (aux), ``target``, ``loss_mask``)."""
    require("specforge")
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    prov = builtin_algorithm_registry().resolve(strategy).providers.offline_for("text")
    max_len = 4096
    refs = prov.build_reader(str(dest), run_id="t", ttt_length=7, max_len=max_len).read()
    loader = FeatureDataLoader(
        LocalFeatureStore(),
        refs=refs,
        batch_size=3,
        drop_last=False,
        collate_fn=prov.build_collator(),
        per_sample_transform=prov.build_normalizer(max_len),
        strategy=strategy,
    )
    out, n = {}, 0
    for batch in loader:
        t = batch.tensors
        for b in range(t["input_ids"].shape[0]):
            idx = int(refs[n + b].feature_store_uri.rsplit("data_", 1)[1].removesuffix(".ckpt"))
            out[idx] = {k: t[k][b, : lengths[idx]] for k in keys}
        n += t["input_ids"].shape[0]
    assert n == len(out) == len(lengths)
    return out


def test_specforge_reads_a_custom_layer_float32_export_and_its_bf16_head_computes_on_it(runs, model, tmp_path):
    """A float32 run with --layers 1,3,7: the states reach SpecForge's reader in bfloat16, the dtype
    its target head runs in (float32 fails there), and the export names the layers for its config."""
    require("specforge")
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    dest = tmp_path / "sf"
    out = export(runs["last"], dest, "--to", "specforge", "--draft-vocab", "64")
    assert "specforge train -c CONFIG.yaml" in out and '"aux_hidden_state_layer_ids": [1, 3, 7]' in out
    m = manifest_ok(dest, 20)
    assert m["source"]["dtype"] == "float32" and "bfloat16" in m["final_state"]
    assert m["final_state_norm"] == {"stored": "post", "exported": "post", "derived": None}
    src = hsx_samples(runs["last"])
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*.ckpt"))[:2] == [
        "rows_0-2000/data_0.ckpt",
        "rows_0-2000/data_1.ckpt",
    ]
    assert len(OfflineManifestReader(str(dest), run_id="t", validate_files=True).read()) == 20
    got = specforge_read(dest, [s["input_ids"].shape[0] for s in src])
    for idx, s in enumerate(src):
        t = got[idx]
        assert torch.equal(t["input_ids"], s["input_ids"])
        assert torch.equal(t["hidden_state"], s["aux_hidden_states"].to(torch.bfloat16))  # the draft's input
        assert torch.equal(t["target"], s["hidden_states"].to(torch.bfloat16))  # post-norm target
        mask = s["loss_mask"].clone()
        mask[-1] = 0  # SpecForge's normalizer drops the last position (no next token)
        assert torch.equal(t["loss_mask"], mask)
    mapping = torch.load(dest / "vocab_mapping-64.pt", weights_only=True)
    assert mapping["d2t"].shape == (64,) and mapping["t2d"].shape == (2048,) and mapping["t2d"].sum() == 64

    head_dir = tmp_path / "head"  # its loader wants an index file, which the tiny model has no need of
    head_dir.mkdir()
    for name in ("config.json", "model.safetensors"):
        (head_dir / name).symlink_to(model / name)
    index = {"weight_map": {"lm_head.weight": "model.safetensors"}}
    (head_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    head = TargetHead.from_pretrained(str(head_dir))
    with torch.no_grad():
        logits = head(got[0]["target"])
        with pytest.raises(RuntimeError, match="dtype"):
            head(src[0]["hidden_states"])  # what a float32 export would have given it
    full = torch.nn.functional.linear(src[0]["hidden_states"], load_file(model / "model.safetensors")["lm_head.weight"])
    assert float(((logits.float() - full).norm(dim=-1) / full.norm(dim=-1)).max()) < TOLERANCE["bfloat16"]


def test_specforge_refuses_a_run_without_three_aux_layers():
    from types import SimpleNamespace

    from hsx.errors import ExportRefused
    from hsx.export.specforge import SpecForge

    with pytest.raises(ExportRefused, match="exactly 3 aux layers"):
        SpecForge(SimpleNamespace(taps=[1, 3], opts=SimpleNamespace(draft="eagle3"))).check()


# ---------------------------------------------------------------- speculators


def check_speculators(dest: Path, run: Path, reference, exact: bool) -> None:
    require("speculators")
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn

    src = hsx_samples(run)
    ds = ArrowDataset(max_len=4096, datapath=str(dest), on_missing="raise")
    assert len(ds) == 20 and ds.approx_lengths == [s["input_ids"].shape[0] for s in src]
    limit = TOLERANCE["float32"]
    for i, s in enumerate(src):
        got = ds[i]
        assert isinstance(got, dict), f"sample {i} unavailable: {got}"
        assert torch.equal(got["input_ids"], s["input_ids"]) and torch.equal(got["loss_mask"], s["loss_mask"])
        assert torch.equal(got["hidden_states"], s["aux_hidden_states"])
        ref = reference(s["input_ids"])
        pre = got["verifier_last_hidden_states"]
        with torch.no_grad():
            normed = ref["norm"](pre)  # what the trainer's verifier_norm computes
            assert torch.allclose(ref["post"], s["hidden_states"], atol=1e-5)
            rel = ((normed - ref["post"]).norm(dim=-1) / ref["post"].norm(dim=-1)).max()
            assert rel < (1e-5 if exact else limit), rel
            if exact:  # the raw output of the last layer is transformers' pre-norm state
                assert torch.allclose(pre, ref["pre"], atol=1e-5, rtol=1e-5)
            p = ref["head"](ref["post"]).softmax(-1)
            q = ref["head"](normed).softmax(-1)
            assert (p - q).abs().max() < 1e-5 and torch.equal(p.argmax(-1), q.argmax(-1))
    coll = CollateFn(4096, 64, num_target_layers=3, dtype=torch.float32, preprocess=shift_batch)
    out = coll([ds[i] for i in range(4)])
    assert out["hidden_states"].shape == (1, 4096, 192) and out["error_records"] == 0
    lens = [src[i]["input_ids"].shape[0] - 1 for i in range(4)]
    assert int((out["document_ids"] >= 0).sum()) == sum(lens)
    assert torch.equal(out["loss_mask"][0, : lens[0]], src[0]["loss_mask"][1:])


def test_speculators_reads_the_export_and_its_norm_gives_back_the_reference(runs, reference, tmp_path):
    dest = tmp_path / "sp"
    out = export(runs["run"], dest, "--to", "speculators", "--draft-vocab", "64")
    assert "DERIVED from the post-norm state / model.norm.weight" in out
    assert "warning: the pre-norm final state is derived from this post-norm run: its direction exact" in out
    m = manifest_ok(dest, 20)
    assert m["final_state_norm"] == {"stored": "post", "exported": "pre", "derived": DIRECTION_ONLY}
    assert 0 < m["max_norm_error"] < TOLERANCE["float32"]
    assert json.loads((dest / "state.json").read_text())["_format_type"] == "torch"
    check_speculators(dest, runs["run"], reference, exact=False)
    import numpy as np
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    freq = torch.load(dest / "token_freq.pt", weights_only=True)
    d2t, t2d = build_vocab_mappings_from_distribution(freq, 64, 2048)
    assert np.array_equal(np.load(dest / "d2t-64.npy"), d2t.numpy())
    assert np.array_equal(np.load(dest / "t2d-64.npy"), t2d.numpy())


def test_speculators_exports_a_custom_layer_run_without_datasets_and_names_its_layers(
    runs, reference, tmp_path, monkeypatch
):
    """--layers 1,3,7 (7: the last layer's raw output, so the pre-norm state is exact), float32,
    exported with ``datasets`` not importable; its loader reads it, and the printed training command
    passes --target-layer-ids in its own ids: transformers' hidden_states[id] is each exported slot."""
    dest = tmp_path / "sp"
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    out = export(runs["last"], dest, "--to", "speculators")
    monkeypatch.undo()
    assert "exact" in out
    check_speculators(dest, runs["last"], reference, exact=True)
    (command,) = [line.split(None, 1)[1] for line in out.splitlines() if line.startswith("train ")]
    args = shlex.split(command)
    assert args[:2] == ["speculators", "train"] and args[args.index("--data-path") + 1] == str(dest.absolute())
    at = args.index("--target-layer-ids")
    ids = [int(a) for a in args[at + 1 : at + 4]]
    assert json.loads((dest / MANIFEST).read_text())["train"] == command
    s = hsx_samples(runs["last"])[0]
    exported = load_file(dest / "hidden_states" / "hs_0.safetensors")["hidden_states"]
    ref = reference(s["input_ids"])
    states = [*ref["states"][:-1], ref["pre"]]  # transformers' last entry is after the final norm
    assert ids == [2, 4, 8]
    for slot, k in enumerate(ids):
        assert torch.allclose(exported[:, slot], states[k], atol=1e-5), (slot, k)


def test_pre_norm_needs_the_runs_model_and_a_readable_norm(runs, model, tmp_path):
    out = export(runs["run"], tmp_path / "a", "--to", "speculators", "--model", TINY, code=2)
    assert "is not the run's model" in out
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    w = load_file(broken / "model.safetensors")
    w["model.final_norm.weight"] = w.pop("model.norm.weight")
    w["model.other_norm.weight"] = torch.ones(64)
    save_file(w, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NormUnavailable, match="cannot tell the final norm"):
        load_final_norm(broken, 64)
    w = load_file(model / "model.safetensors")
    w["model.norm.weight"][5] = 0.0
    save_file(w, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NormUnavailable, match="zero or non-finite"):
        load_final_norm(broken, 64)


def test_measured_target_distribution_error_of_post_over_weight(runs, model):
    stats = measure(runs["run"], model, samples=20)
    assert stats["samples"] == 20 and stats["top1_agree"] == 1.0
    # logits scale by 1 - O(eps) per token (eps 1e-5): relative logit error and KL stay negligible
    assert stats["max_dlogit_rel"] < 1e-5 and stats["max_abs_dprob"] < 1e-5 and stats["max_kl"] < 1e-5
    assert stats["max_state_err"] < 1e-5


# ---------------------------------------------------------------- Model-Optimizer


def test_modelopt_reads_post_and_pre_norm_exports_with_its_own_dataset(runs, reference, model, tmp_path):
    require("modelopt")
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
    from modelopt.torch.speculative.plugins.hf_eagle import HFEagleModel
    from modelopt.torch.speculative.plugins.modeling_final_norm import _maybe_apply_base_final_norm

    src = hsx_samples(runs["run"])
    for prenorm in (False, True):
        dest = tmp_path / f"mo-{prenorm}"
        out = export(runs["run"], dest, "--to", "modelopt", "--draft-vocab", "64", *(["--prenorm"] * prenorm))
        assert "eagle_aux_hidden_state_layer_ids: [1, 3, 4]" in out and "base model in float32" in out
        manifest_ok(dest, 20)
        files = sorted(str(p) for p in dest.rglob("*.pt"))  # what its example script globs
        assert len(files) == 20
        ds = OfflineSupervisedDataset(files, answer_only_loss=True)
        for i, s in enumerate(src):
            got = ds[i]
            assert torch.equal(got["input_ids"], s["input_ids"]) and torch.equal(got["loss_mask"], s["loss_mask"])
            assert torch.equal(got["aux_hidden_states"], s["aux_hidden_states"])
            assert got["base_hidden_prenorm"] is prenorm
            hidden = got["base_model_hidden_states"]
            if not prenorm:
                assert torch.equal(hidden, s["hidden_states"])
            else:
                ref = reference(s["input_ids"])
                with torch.no_grad():
                    normed = _maybe_apply_base_final_norm(hidden, {"base_hidden_prenorm": True}, ref["norm"])
                assert torch.allclose(normed, ref["post"], rtol=1e-4, atol=1e-5)
        batch = EagleOfflineDataCollator(train_len=256)([ds[i] for i in range(4)])
        assert batch["base_model_outputs"]["aux_hidden_states"].shape == (4, 256, 192)
        assert batch["base_model_outputs"]["base_hidden_prenorm"] is prenorm
        record = torch.load(files[0], weights_only=True)
        assert record["hidden_states"].dim() == 2 and isinstance(record["conversation_id"], str)
    from types import SimpleNamespace

    fake = SimpleNamespace(
        eagle_config=SimpleNamespace(draft_vocab_size=64, vocab_size=2048),
        eagle_module=SimpleNamespace(d2t=torch.zeros(64, dtype=torch.int64)),
    )
    HFEagleModel.load_draft_vocab_cache(fake, str(dest / "d2t-64.pth"))
    assert (fake.eagle_module.d2t >= 0).all()


# ---------------------------------------------------------------- resume, refusals


def test_a_killed_export_resumes_without_redoing_finished_files(runs, tmp_path):
    dest = tmp_path / "sp"
    env = os.environ | {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "hsx", "export", str(runs["run"]), str(dest), "--to", "speculators"]
    proc = subprocess.Popen([*cmd, "--pace", "0.3"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while time.monotonic() < deadline:
            log = dest / LOG
            if log.exists() and len(log.read_text().splitlines()) >= 5:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (dest / MANIFEST).exists() and not (dest / "state.json").exists()
    before = {p.name: p.stat().st_mtime_ns for p in (dest / "hidden_states").glob("*.safetensors")}
    assert 5 <= len(before) < 20
    out = export(runs["run"], dest, "--to", "speculators")
    done = int(out.split(" already done")[0].rsplit(" ", 1)[1])
    assert done >= 5 and f"{20 - done} written now" in out
    after = {p.name: p.stat().st_mtime_ns for p in (dest / "hidden_states").glob("*.safetensors")}
    assert len(after) == 20 and sum(after[n] == t for n, t in before.items()) >= done
    manifest_ok(dest, 20)
    full = tmp_path / "full"
    export(runs["run"], full, "--to", "speculators")
    for name in after:
        assert (full / "hidden_states" / name).read_bytes() == (dest / "hidden_states" / name).read_bytes()
    again = export(runs["run"], dest, "--to", "speculators")  # complete: nothing redone
    assert "0 written now, 20 already done" in again
    whole, rerun = (json.loads((d / MANIFEST).read_text()) for d in (full, dest))
    assert rerun["max_norm_error"] == whole["max_norm_error"] > 0  # a rerun wrote 0.0: it had converted nothing
    assert "holds another export" in export(runs["run"], dest, "--to", "modelopt", code=2)


def test_a_bad_source_file_stops_the_export_naming_it(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["run"], run)
    bad = run / "shards" / "000001" / "000000012.safetensors"
    flip_byte(bad, -7)
    out = export(run, tmp_path / "d", "--to", "modelopt", code=2)
    assert str(bad) in out and f"hsx extract --out {run}" in out
    assert not (tmp_path / "d" / MANIFEST).exists()
    (run / "shards" / "000001" / "000000013.safetensors").unlink()
    out = export(run, tmp_path / "e", "--to", "modelopt", code=2)
    assert "incomplete: 1 of 20" in out
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "notes.txt").write_text("mine")
    out = export(runs["run"], tmp_path / "f", "--to", "modelopt", code=2)
    assert "not empty" in out
    # killed while writing its job file: only a temp file is there, so the rerun starts over
    (tmp_path / "g").mkdir()
    torn = tmp_path / "g" / "..hsx-export-job.json.tmp-4242-1"  # write_durable's temp name for the job file
    torn.write_text('{"to": "mod')
    export(runs["run"], tmp_path / "g", "--to", "modelopt")
    assert not torn.exists() and manifest_ok(tmp_path / "g", 20)


def test_allow_incomplete_exports_the_finished_samples(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["run"], run)
    (run / "shards" / "000000" / "000000004.safetensors").unlink()
    export(run, tmp_path / "d", "--to", "modelopt", "--allow-incomplete")
    m = manifest_ok(tmp_path / "d", 19)
    assert [s["sample_id"] for s in m["samples"]] == [i for i in range(20) if i != 4]


def printed(text: str, after: str) -> list[str]:
    """The command hsx printed after ``after`` (to the end of its line), as arguments of ``hsx``."""
    line = text.split(after, 1)[1].splitlines()[0]
    args = shlex.split(line)
    assert args[0] == "hsx", line
    return args[1:]


def test_an_interrupted_export_says_so_and_its_printed_command_continues(runs, tmp_path):
    dest = tmp_path / "mo"
    env = os.environ | {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "hsx", "export", str(runs["run"]), "mo", "--to", "modelopt", "--pace", "0.3"]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while time.monotonic() < deadline and proc.poll() is None:
            log = dest / LOG
            if log.exists() and len(log.read_text().splitlines()) >= 3:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out + err
    assert "interrupted; every file exported so far is complete and kept; continue with: hsx export" in err
    assert "Traceback" not in err
    args = printed(err, "continue with: ")
    assert args[2] == str(dest)  # "mo" as typed, made absolute: the command works from any directory
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = hsx(*args, cwd=elsewhere).stdout
    assert "exported   20 samples" in done
    assert int(done.split(" already done")[0].rsplit(" ", 1)[1]) >= 3
    manifest_ok(dest, 20)


def test_an_incomplete_export_stopped_by_a_bad_file_continues_after_the_repair(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["run"], run)
    (run / "shards" / "000000" / "000000004.safetensors").unlink()
    flip_byte(run / "shards" / "000001" / "000000012.safetensors", -7)  # found when its digest is read
    dest = tmp_path / "d"
    out = export(run, dest, "--to", "modelopt", "--allow-incomplete", code=2)
    assert "sample 12" in out and "11 of 19 samples are exported" in out
    before = {p: p.stat().st_mtime_ns for p in dest.rglob("*.pt")}
    assert len(before) == 11
    # the job as the hsx of the report wrote it, with the samples it then had: a rerun still continues
    job = json.loads((dest / JOB).read_text())
    (dest / JOB).write_text(json.dumps(job | {"samples": 19, "ids_digest": "xxh3_128:0"}))
    hsx(*printed(out, "Redo it with: "))  # redoes 4 and 12
    again = hsx(*printed(out, "continue this export with: ")).stdout
    assert "exported   20 samples" in again and "9 written now, 11 already done" in again
    assert all(p.stat().st_mtime_ns == t for p, t in before.items())  # nothing exported is redone
    m = manifest_ok(dest, 20)
    order = [s["sample_id"] for s in m["samples"]]
    assert order == [0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 4, *range(12, 20)]  # the repaired take the next indices
    plan = Plan(run)
    for index, sid in enumerate(order):
        (pt,) = dest.rglob(f"{index:09d}.pt")
        got = torch.load(pt, weights_only=True)
        assert torch.equal(got["input_ids"], torch.tensor(plan.input_ids(sid), dtype=torch.int64))
    ds = HsxDataset(run, ids=[4, 12], verify=True)
    for index, s in zip((11, 12), ds, strict=True):
        (pt,) = dest.rglob(f"{index:09d}.pt")
        assert torch.equal(torch.load(pt, weights_only=True)["hidden_states"], s["hidden_states"])


def test_prenorm_is_refused_where_the_trainer_reads_the_post_norm_state(runs, tmp_path):
    out = export(runs["run"], tmp_path / "sf", "--to", "specforge", "--prenorm", code=2)
    assert "--prenorm does not apply to --to specforge" in out and "post-norm" in out
    assert not (tmp_path / "sf").exists()
    out = export(runs["run"], tmp_path / "sp", "--to", "speculators", "--prenorm", code=2)  # it was accepted, unread
    assert "--prenorm does not apply to --to speculators: its trainer reads the final state pre-norm, which" in out
    assert not (tmp_path / "sp").exists()


def test_a_draft_vocabulary_the_target_cannot_hold_is_refused_before_dest_is_touched(runs, tmp_path):
    """--draft-vocab 5000 on a vocabulary of 2,048 is refused before any sample is written (it wrote
    them all, then refused), so the corrected command exports into the same DEST."""
    dest = tmp_path / "sf"
    out = export(runs["run"], dest, "--to", "specforge", "--draft-vocab", "5000", code=2)
    assert "draft vocabulary size 5000 must be in 1..2048" in out and not dest.exists()
    out = export(runs["run"], dest, "--to", "specforge", "--draft-vocab", "64")
    assert "20 written now" in out and (dest / "vocab_mapping-64.pt").is_file()


SCRIPTS = Path(__file__).parent.parent / "scripts"
BLOCKED_RUN = """
import sys, json
blocked = set(json.loads(sys.argv[1]))
class Block:  # what the documented install does not hold cannot be imported
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the documented trainer install)")
        return None
sys.meta_path.insert(0, Block())
from importlib.metadata import entry_points
(ep,) = entry_points(group="console_scripts", name=sys.argv[2])
sys.argv = sys.argv[2:]
ep.load()()
"""


def documented_install() -> set[str]:
    """The distributions the README's install and trainer install make: hsx's own dependencies and
    ``scripts/extras-trainers-deps.txt``'s, each with what it requires, and the trainers of
    ``scripts/extras-trainers.txt`` (installed with --no-deps: those alone)."""
    import importlib.metadata as md
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    def listed(path: Path) -> list[str]:
        lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
        return [Requirement(line).name for line in lines if line]

    pyproject = tomllib.loads((SCRIPTS.parent / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r).name for r in pyproject["dependencies"]] + listed(SCRIPTS / "extras-trainers-deps.txt")
    seen: set[str] = set()
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            required = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [r.name for r in map(Requirement, required) if r.marker is None or r.marker.evaluate({"extra": ""})]
    return seen | {canonicalize_name(n) for n in listed(SCRIPTS / "extras-trainers.txt")} | {"hsx"}


def test_every_printed_train_command_starts_under_the_documented_trainer_install(runs, tmp_path):
    """The ``train`` line an export prints runs where the README's trainer install is all there is:
    each trainer command's ``--help``, in a process that can import no module of a distribution
    outside it (speculators' failed there: its CLI imports loguru, which the --no-deps install left
    out and this suite had only through another extra)."""
    import importlib.metadata as md

    from packaging.utils import canonicalize_name

    require("speculators")
    require("specforge")
    allowed = documented_install()
    owners = md.packages_distributions()
    blocked = sorted(m for m, ds in owners.items() if not any(canonicalize_name(d) in allowed for d in ds))
    for to in ("speculators", "specforge"):
        out = export(runs["run"], tmp_path / to, "--to", to)
        (train,) = [line.split(None, 1)[1] for line in out.splitlines() if line.startswith("train ")]
        prog, command = train.split()[:2]
        r = subprocess.run(
            [sys.executable, "-c", BLOCKED_RUN, json.dumps(blocked), prog, command, "--help"],
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
        )
        assert r.returncode == 0 and "usage" in r.stdout.lower(), f"{prog} {command} --help:\n{r.stderr[-2000:]}"


# ---------------------------------------------------------------- DeepSpec


def certificate_note(run: Path) -> dict:
    """What a trainer's own metadata says of the run's certificate: its verdict (a passed run here)
    and the digest of the certificate file, which ``hsx-export.json`` holds whole."""
    from hsx.certify import read_certificate
    from hsx.store import layout
    from hsx.store.format import digest

    cert = read_certificate(run)
    assert cert is not None and cert.verdict == "passed"
    raw = (run / layout.CERTIFICATE).read_bytes()
    return {"verdict": "passed", "certificate_digest": digest(raw), "hsx_version": cert.hsx_version}


def deepspec_read(dest: Path) -> tuple[dict, list[dict[str, np.ndarray]]]:
    """A DeepSpec target cache read from its documented layout (manifest.json; samples.idx of
    little-endian 56-byte records: sample id u64, shard id u32, length u32, five u64 byte offsets;
    each shard's arrays back to back: input_ids int32, attention_mask and loss_mask uint8, the taps
    and the final state bfloat16): the manifest and every sample's arrays, the states as float32."""
    m = json.loads((dest / "manifest.json").read_text())
    index = (dest / "samples.idx").read_bytes()
    assert m["index_record_size"] == 56 and len(index) == 56 * m["num_samples"]
    shards = {s["shard_id"]: (dest / s["file_name"]).read_bytes() for s in m["shards"]}
    assert sorted(shards) == list(range(m["num_shards"]))
    L, H = len(m["target_layer_ids"]), m["hidden_size"]
    out, ends = [], dict.fromkeys(shards, 0)
    for i in range(m["num_samples"]):
        sample_id, shard, T, *offs = struct.unpack_from("<QIIQQQQQ", index, 56 * i)
        assert sample_id == i
        data = shards[shard]
        arrays = {}
        for name, off, dtype, count in zip(
            ("input_ids", "attention_mask", "loss_mask", "aux", "final"),
            offs,
            (np.int32, np.uint8, np.uint8, np.uint16, np.uint16),
            (T, T, T, T * L * H, T * H),
            strict=True,
        ):
            arrays[name] = np.frombuffer(data, dtype=dtype, count=count, offset=off)
            ends[shard] = max(ends[shard], off + arrays[name].nbytes)
        for name in ("aux", "final"):  # bfloat16 is the top half of a float32
            arrays[name] = (arrays[name].astype(np.uint32) << 16).view(np.float32).reshape(T, -1)
        out.append(arrays)
    assert all(ends[k] == len(shards[k]) for k in shards), "bytes in a shard that no sample owns"
    return m, out


def test_deepspec_reads_the_taps_and_the_post_norm_final_state_in_bfloat16(runs, model, tmp_path):
    """Both DeepSpec draft types write the same target cache: every array equal to the run's
    sample (states rounded to bfloat16), the manifest naming the taps and the model, a train line in
    its own terms; what it cannot take is refused before anything is written."""
    src = hsx_samples(runs["run"])
    dest = tmp_path / "dspark"
    out = export(runs["run"], dest, "--to", "deepspec", "--draft", "dspark")
    assert "python train.py --config config/dspark/" in out and "model.target_layer_ids=[1, 3, 4]" in out
    manifest_ok(dest, len(src))
    m, got = deepspec_read(dest)
    assert m["version"] == 2 and m["target_layer_ids"] == [1, 3, 4] and m["hidden_size"] == 64
    assert (m["hidden_dtype"], m["token_dtype"], m["mask_dtype"]) == ("bfloat16", "int32", "uint8")
    assert m["target_model_name_or_path"] == str(model)  # its trainer compares it with its config's
    assert m["hsx_certificate"] == certificate_note(runs["run"])
    assert len(got) == len(src)
    for g, s in zip(got, src, strict=True):
        assert np.array_equal(g["input_ids"], s["input_ids"].numpy()) and g["attention_mask"].all()
        assert np.array_equal(g["loss_mask"], s["loss_mask"].numpy())
        assert torch.equal(torch.from_numpy(g["aux"]), s["aux_hidden_states"].to(torch.bfloat16).float())
        assert torch.equal(torch.from_numpy(g["final"]), s["hidden_states"].to(torch.bfloat16).float())  # post-norm
    out = export(runs["run"], tmp_path / "dflash", "--to", "deepspec", "--draft", "dflash")
    assert "config/dflash/" in out
    assert export_files(tmp_path / "dflash") | {".hsx-export-job.json": b""} == export_files(dest) | {
        ".hsx-export-job.json": b""
    }
    refused = {
        ("--draft", "eagle3"): "deepspec's trainer takes the draft types dflash, dspark, not eagle3",
        ("--draft", "dflash", "--taps", "4,1"): "ascending order",
        ("--draft", "dflash", "--draft-vocab", "64"): "read no draft-vocab map",
    }
    for i, (args, why) in enumerate(refused.items()):
        assert why in export(runs["run"], tmp_path / f"no{i}", "--to", "deepspec", *args, code=2)
        assert not (tmp_path / f"no{i}").exists()


# ---------------------------------------------------------------- NeMo-Automodel's DSpark cache


def automodel_dspark_read(dest: Path, model: Path) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    """A DSpark export through NeMo-Automodel's own cache code: its manifest as its reader loads it,
    every sample as ``CachedDSparkDataset`` gives it; checked first against what its recipe and its
    resume check compare (the target's shapes from transformers' config, the manifest its own
    ``build_cache_manifest`` writes for the same target and settings) and its weights against the
    checkpoint's."""
    require("nemo_automodel")
    from nemo_automodel.components.datasets.llm.dspark_cache import (
        CachedDSparkDataset,
        build_cache_manifest,
        manifest_mismatch_fields,
        read_manifest,
        read_target_weight_modules,
        tokenizer_chat_template_sha256,
    )
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    m = read_manifest(str(dest))  # refuses one marked incomplete or of another format version
    config = AutoConfig.from_pretrained(model)
    ds = CachedDSparkDataset(str(dest))
    theirs = build_cache_manifest(
        target_model=m["target_model"],
        target_model_type=config.model_type,
        target_text_config=config,
        seq_length=m["seq_length"],
        dtype="fp32",
        num_samples=len(ds),
        shard_size=1,
        target_layer_ids=m["target_layer_ids"],
        train_data_path=m["train_data_path"],
        train_split=None,
        shuffle_seed=0,
        mask_reasoning_content=False,
        chat_template_sha256=tokenizer_chat_template_sha256(AutoTokenizer.from_pretrained(model)),
        mask_generation_prompt=False,
    )
    assert manifest_mismatch_fields(m, theirs) == ["hsx_certificate"]  # nothing its own precompute writes
    target = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    embed, head = read_target_weight_modules(str(dest))
    assert torch.equal(embed.weight, target.get_input_embeddings().weight)
    assert torch.equal(head.weight, target.get_output_embeddings().weight)
    return m, [ds[i] for i in range(len(ds))]


def automodel_dspark_capture(model: Path, layer_ids: list[int]):
    """NeMo-Automodel's own DSpark target capture (``HFDSparkTargetModel``, forward hooks on the
    decoder layers and the final norm) on transformers' model: ``capture(input_ids)`` ->
    (``target_hidden_states`` [T, L*H], ``target_last_hidden_states`` [T, H])."""
    from nemo_automodel.components.speculative.dspark.target import HFDSparkTargetModel
    from transformers import AutoModelForCausalLM

    wrapper = HFDSparkTargetModel(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), layer_ids)

    def capture(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = input_ids.long()[None]
        got = wrapper.generate_batch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones_like(ids))
        return got.target_hidden_states[0], got.target_last_hidden_states[0]

    return capture


def assert_automodel_dspark(
    dest: Path, model: Path, src: list[dict], post: list[torch.Tensor], captured: int = 3
) -> dict:
    """Every sample of a DSpark export as Automodel reads it: hsx's tokens and loss mask unshifted,
    its taps, the final state after the norm (``post``: the run's own, or its post-norm twin's) as
    ``target_last_hidden_states`` and in the last layer's slot (Automodel's id N-1 is the post-norm
    state), zeros past the end; and, on the first ``captured`` samples, what Automodel's own capture
    computes from the target, within float32's rounding of another batch shape. Returns the manifest."""
    m, got = automodel_dspark_read(dest, model)
    taps, last = m["target_layer_ids"], m["num_hidden_layers"] - 1
    capture = automodel_dspark_capture(model, taps)
    assert len(got) == len(src) == len(post) and m["seq_length"] == max(len(s["input_ids"]) for s in src)
    for i, (g, s, p) in enumerate(zip(got, src, post, strict=True)):
        n, H = len(s["input_ids"]), p.shape[-1]
        want = s["aux_hidden_states"].view(n, -1, H).clone()
        if last in taps:
            want[:, taps.index(last)] = p
        assert g["input_ids"].dtype == g["loss_mask"].dtype == torch.int64
        assert torch.equal(g["input_ids"][:n], s["input_ids"].long()) and not g["input_ids"][n:].any()
        assert torch.equal(g["loss_mask"][:n], s["loss_mask"].long()) and not g["loss_mask"][n:].any()
        assert torch.equal(g["target_hidden_states"][:n], want.reshape(n, -1))
        assert torch.equal(g["target_last_hidden_states"][:n], p)
        assert not g["target_hidden_states"][n:].any() and not g["target_last_hidden_states"][n:].any()
        if i >= captured:
            continue
        states, final = capture(s["input_ids"])
        torch.testing.assert_close(g["target_hidden_states"][:n], states, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(g["target_last_hidden_states"][:n], final, rtol=1e-4, atol=1e-4)
    return m


def test_automodel_dspark_reads_the_last_layer_after_the_norm_as_its_own_capture(runs, model, tmp_path):
    """hsx export --to automodel --draft dspark, read by Automodel's own cache code, equals what its
    own capture of the target gives: on layers [1, 3, 7] its feature at 7 (the last layer) is the
    post-norm state, where hsx's tap 7 is that layer's raw output; the manifest is what its own
    precompute writes, and the printed train line parses with its own config parser into keys its
    train_dspark recipe reads."""
    require("nemo_automodel")
    from nemo_automodel.components.config._arg_parser import parse_args_and_load_config
    from nemo_automodel.components.speculative.dspark.common import validate_target_layer_ids
    from nemo_automodel.recipes.llm import __file__ as recipes

    src = hsx_samples(runs["last"])
    dest = tmp_path / "dspark"
    out = export(runs["last"], dest, "--to", "automodel", "--draft", "dspark")
    manifest_ok(dest, len(src))
    m = assert_automodel_dspark(dest, model, src, [s["hidden_states"] for s in src])
    assert m["target_layer_ids"] == [1, 3, 7] and m["hsx_certificate"] == certificate_note(runs["last"])
    assert not torch.equal(src[0]["aux_hidden_states"][:, -64:], src[0]["hidden_states"])  # the slot was replaced
    (train,) = [line.split(None, 1)[1] for line in out.splitlines() if line.startswith("train ")]
    (tmp_path / "c.yaml").write_text("recipe_args: {}\n")
    args = shlex.split(train.split("  (", 1)[0])
    assert args[:5] == ["python", "-m", "nemo_automodel.recipes.llm.train_dspark", "--config", "CONFIG.yaml"]
    recipe = parse_args_and_load_config(argv=["--config", str(tmp_path / "c.yaml"), *args[5:]]).recipe_args
    assert recipe.cached_target_path == str(dest.absolute()) and recipe.target_model_name_or_path == str(model)
    assert recipe.seq_length == m["seq_length"] and not recipe.mask_reasoning_content
    assert validate_target_layer_ids(recipe.target_layer_ids, 8) == [1, 3, 7]
    source = (Path(recipes).parent / "train_dspark.py").read_text()
    read = set(re.findall(r"recipe_cfg\.get\(\s*\"(\w+)\"", source)) | set(re.findall(r"recipe_cfg\.(\w+)\b", source))
    assert set(recipe.to_dict()) <= read, set(recipe.to_dict()) - read


# ---------------------------------------------------------------- storage codecs: every export decodes

EXPORTS = {
    "specforge": ("--to", "specforge", "--draft-vocab", "64"),
    "speculators": ("--to", "speculators", "--draft-vocab", "64"),
    "modelopt": ("--to", "modelopt", "--draft-vocab", "64"),
    "modelopt-prenorm": ("--to", "modelopt", "--prenorm"),
}
PRENORM = ("speculators", "modelopt-prenorm")


def trainer_read(kind: str, dest: Path, lengths: list[int]) -> list[dict[str, torch.Tensor]]:
    """Each sample of an export as its trainer's own loader gives it: ``input_ids``, ``loss_mask``,
    ``aux`` [T, L*H] and ``final`` [T, H] (post-norm, or pre-norm for the pre-norm formats)."""
    if kind == "specforge":
        got = specforge_read(dest, lengths)
        return [
            {"input_ids": t["input_ids"], "loss_mask": t["loss_mask"], "aux": t["hidden_state"], "final": t["target"]}
            for t in (got[i] for i in range(len(lengths)))
        ]
    if kind == "speculators":
        require("speculators")
        from speculators.train.data import ArrowDataset

        ds = ArrowDataset(max_len=4096, datapath=str(dest), on_missing="raise")
        rows = [ds[i] for i in range(len(ds))]
        return [
            {"input_ids": r["input_ids"], "loss_mask": r["loss_mask"], "aux": r["hidden_states"]}
            | {"final": r["verifier_last_hidden_states"]}
            for r in rows
        ]
    require("modelopt")
    from modelopt.torch.speculative.eagle.utils import OfflineSupervisedDataset

    ds = OfflineSupervisedDataset(sorted(str(p) for p in dest.rglob("*.pt")), answer_only_loss=True)
    rows = [ds[i] for i in range(len(ds))]
    return [
        {"input_ids": r["input_ids"], "loss_mask": r["loss_mask"], "aux": r["aux_hidden_states"]}
        | {"final": r["base_model_hidden_states"]}
        for r in rows
    ]


def rel_error(x: torch.Tensor, y: torch.Tensor, groups: int) -> float:
    """max |y - x| / amax of x's token-layer."""
    x = x.float().view(x.shape[0], groups, -1)
    err = (y.float().view(x.shape) - x).abs()
    return float((err / x.abs().amax(-1, keepdim=True).clamp_min(1e-30)).max())


def export_files(dest: Path) -> dict[str, bytes]:
    """Every file of an export but its manifest (which names the source run and the time)."""
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in sorted(dest.rglob("*")) if p.is_file()} | {
        MANIFEST: b""
    }


def test_every_codec_round_trips_through_every_export(runs, model, tmp_path):
    """The same run stored raw, zstd and fp8 (layers [1, 3, 7]: the pre-norm state is exact where
    lossless), through every trainer's export and its own loader: zstd's exports are raw's byte for
    byte; fp8's hold the fp8 run's decoded states, within fp8's bound of raw."""
    from hsx.export.norm import FP8_SCALE, tolerance
    from hsx.store.codec import Codec, fp8_bound

    raw, fp8 = hsx_samples(runs["last"]), hsx_samples(runs["last-fp8"])
    lengths = [s["input_ids"].shape[0] for s in raw]
    norm = load_final_norm(model, 64)
    bound = fp8_bound(torch.float32)
    for kind, args in EXPORTS.items():
        dests = {name: tmp_path / kind / name for name in ("last", "last-zstd", "last-fp8")}
        for name, dest in dests.items():
            export(runs[name], dest, *args)
            manifest_ok(dest, 20)
        zstd_files, raw_files = export_files(dests["last-zstd"]), export_files(dests["last"])
        assert zstd_files.keys() == raw_files.keys() and len(raw_files) >= 21
        for name in raw_files:
            assert zstd_files[name] == raw_files[name], (kind, name)
        manifests = [json.loads((dests[n] / MANIFEST).read_text()) for n in ("last", "last-zstd")]
        assert [m["files"] for m in manifests[1:]] == [manifests[0]["files"]]

        got, ref = trainer_read(kind, dests["last-fp8"], lengths), trainer_read(kind, dests["last"], lengths)
        assert len(got) == len(ref) == 20
        for g, r, s, a in zip(got, ref, fp8, raw, strict=True):
            assert torch.equal(g["input_ids"], r["input_ids"]) and torch.equal(g["loss_mask"], r["loss_mask"])
            if kind == "specforge":  # in bfloat16, its head's dtype: what the fp8 run decodes to, rounded
                assert torch.equal(g["aux"], s["aux_hidden_states"].to(torch.bfloat16))
                assert torch.equal(g["final"], s["hidden_states"].to(torch.bfloat16))
                continue
            assert torch.equal(g["aux"], s["aux_hidden_states"])  # what the fp8 run decodes to
            assert 0 < rel_error(r["aux"], g["aux"], 3) <= bound  # and within fp8's bound of raw
            if kind not in PRENORM:
                assert torch.equal(g["final"], s["hidden_states"])
                assert 0 < rel_error(a["hidden_states"], g["final"], 1) <= bound
                continue
            # pre-norm of an fp8 run: from its stored final state, so norm(pre) is that state times
            # a per-token scale within 1/15 of 1 (its direction exact)
            normed, post = norm.apply(g["final"].float()), s["hidden_states"]
            scale = (normed * post).sum(-1) / post.pow(2).sum(-1)
            assert float((scale - 1).abs().max()) <= FP8_SCALE
            assert torch.allclose(normed, scale[:, None] * post, rtol=1e-4, atol=1e-6)
            # raw's (and so zstd's) pre-norm is the last layer's raw output: exact
            assert torch.equal(r["final"], a["aux_hidden_states"][:, 2 * 64 :])
        m = json.loads((dests["last-fp8"] / MANIFEST).read_text())
        if kind in PRENORM:
            assert 0 < m["max_norm_error"] <= tolerance("float32", Codec.FP8) and "fp8 run" in m["final_state"]

    from typer.testing import CliRunner

    from hsx.cli import app

    vocab = {}  # hsx vocab reads only the plan: the same files whatever the codec
    for name in ("last", "last-zstd", "last-fp8"):
        r = CliRunner().invoke(app, ["vocab", str(runs[name]), "--size", "64", "--dest", str(tmp_path / "v" / name)])
        assert r.exit_code == 0, r.output
        vocab[name] = {p.name: p.read_bytes() for p in (tmp_path / "v" / name).iterdir()}
    assert vocab["last"] == vocab["last-zstd"] == vocab["last-fp8"] and len(vocab["last"]) == 6
