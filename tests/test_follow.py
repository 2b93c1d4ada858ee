"""An extraction of an unfinished generate run follows it: each resume plans the conversations
generated since as new samples, keeps every sample and file it had, and rewrites its rejects.
References: transformers' own output_hidden_states for the new samples' states, the generate run's
conversation files for their token ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import TINY, conversations, hsx, write_jsonl
from hsx.assess.status import assess
from hsx.data import HsxDataset
from hsx.errors import Refused
from hsx.extract import ExtractOptions, extract
from hsx.extract.local import InProcess
from hsx.generate.job import generate
from hsx.generate.options import GenerateOptions
from hsx.genrun.record import read_record
from hsx.genrun.samples import NOT_GENERATED
from hsx.plan import load_plan
from hsx.spec import load_spec
from hsx.store import layout
from test_export import export, manifest_ok

GEN_SHARD = 2  # conversation files per shard of the generate run
SHARD = 3  # samples per shard of the extraction: the first growth lands in a sealed, partial shard
TOL = 1e-5


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished generate run of 6 conversations, made in this process."""
    root = tmp_path_factory.mktemp("gen")
    data = write_jsonl(root / "convs.jsonl", conversations(6))
    opts = GenerateOptions(
        out=root / "gen", model=str(TINY), data=[data], device="cpu", max_new_tokens=4, shard_size=GEN_SHARD, threads=1
    )
    generate(opts, log=lambda m: None)
    return root / "gen"


def _hide(gen: Path, cid: int) -> Path:
    """Take conversation ``cid`` out of the generate run (as if not generated yet); returns where it was."""
    path = layout.sample_path(gen, cid, GEN_SHARD)
    path.unlink()
    (path.parent / layout.SEALED).unlink(missing_ok=True)
    return path


def _files(out: Path) -> dict[Path, tuple[int, int, bytes]]:
    files = (out / layout.SHARDS).rglob("*.safetensors")
    return {p: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in files}


def _rejects(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / layout.REJECTS).read_text().splitlines()]


def _resume(out: Path, **kw):
    logged: list[str] = []
    summary = extract(ExtractOptions(out=out, threads=1, **kw), log=logged.append)
    return summary, logged


def test_a_resume_plans_what_the_generate_run_finished_since(finished, tmp_path):
    gen = tmp_path / "gen"
    shutil.copytree(finished, gen)
    _hide(gen, 2), _hide(gen, 5)
    out = tmp_path / "x"
    opts = ExtractOptions(out=out, model=str(TINY), data=[gen], device="cpu", shard_size=SHARD, allow_incomplete=True)
    assert extract(opts, log=lambda m: None).complete
    assert load_spec(out).plan.num_samples == 4  # conversations 0, 1, 3, 4
    assert (layout.shard_dir(out, 1) / layout.SEALED).exists()  # sample 3 alone, sealed
    assert sorted(r["row"] for r in _rejects(out)) == [2, 5]
    spec_bytes, before = (out / layout.SPEC).read_bytes(), _files(out)
    dest = tmp_path / "mo"  # an export of what there is; the grown run continues it below
    export(out, dest, "--to", "modelopt")
    assert len(manifest_ok(dest, 4)["samples"]) == 4

    # conversation 2 is generated since: the next resume (no option given) plans it as sample 4
    shutil.copy2(layout.sample_path(finished, 2, GEN_SHARD), layout.sample_path(gen, 2, GEN_SHARD))
    summary, logged = _resume(out)
    assert summary.complete and summary.written == 1, logged
    assert any("plan grew: 1 conversations" in line and "1 still wait" in line for line in logged), logged
    spec = load_spec(out)
    assert (spec.plan.num_samples, spec.plan.parts) == (5, ["part-000001.parquet"])
    assert (out / layout.SPEC).read_bytes() == spec_bytes  # the spec is written once
    assert {p: v for p, v in _files(out).items() if p in before} == before  # no file planned before rewritten
    assert [(r["row"], r["reason"]) for r in _rejects(out)] == [(5, NOT_GENERATED)]
    plan = load_plan(out, spec)
    rec = read_record(layout.sample_path(finished, 2, GEN_SHARD), 2)
    want = np.concatenate([rec.turns[-1].prompt_ids, rec.turns[-1].completion_ids])
    assert plan.input_ids(4).tolist() == want.tolist()
    assert plan.loss_mask(4)[len(rec.turns[-1].prompt_ids) :].all()
    assert all(set(b.ids) <= {3} or set(b.ids) <= {4} for b in plan.batches(range(3, 5), 1 << 20, False))
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.from_numpy(want.astype("int64"))[None], output_hidden_states=True).hidden_states
    got = HsxDataset(out)[4]  # the training loader sees the grown plan, and the new sample is sealed
    h = ref[0].shape[-1]
    for j, k in enumerate(spec.layers[:-1]):  # the last layer id is stored before the final norm
        assert (got["aux_hidden_states"][:, j * h : (j + 1) * h] - ref[k + 1][0]).abs().max() <= TOL
    assert (got["hidden_states"] - ref[-1][0]).abs().max() <= TOL
    progress = assess(out).get("progress")
    assert (progress.data["not_generated"], progress.data["generated_since"]) == (1, 0)
    assert progress.level == "ok" and (layout.shard_dir(out, 1) / layout.SEALED).exists()

    # a conversation this run planned is gone from the generate run: it is not followed, and a resume
    # that names the generate run is refused by name
    moved = tmp_path / "conv0"
    shutil.move(layout.sample_path(gen, 0, GEN_SHARD), moved)
    shutil.copy2(layout.sample_path(finished, 5, GEN_SHARD), layout.sample_path(gen, 5, GEN_SHARD))
    summary, logged = _resume(out)
    assert load_spec(out).plan.num_samples == 5 and any("not following" in line for line in logged), logged
    with pytest.raises(Refused, match="that this run planned changed since"):
        _resume(out, data=[gen])
    shutil.move(moved, layout.sample_path(gen, 0, GEN_SHARD))

    # back as it was, and named on the real command line: conversation 5 becomes sample 5, no reject is left
    stale = (out / layout.REJECTS).read_bytes()
    proc = hsx("extract", "--out", out, "--data", gen, "--threads", 1)
    assert "plan grew: 1 conversations" in proc.stderr and "0 still wait" in proc.stderr, proc.stderr
    assert load_spec(out).plan.num_samples == 6 and _rejects(out) == []
    assert len(HsxDataset(out)) == 6
    assert assess(out).get("progress").data["not_generated"] == 0
    export(out, dest, "--to", "modelopt")  # the same export, continued: the samples it had keep their index
    assert [m["sample_id"] for m in manifest_ok(dest, 6)["samples"]] == list(range(6))

    # a crash after the growth was recorded, before the rejects were rewritten: the next resume
    # rewrites them, and plans nothing twice
    (out / layout.REJECTS).write_bytes(stale)
    summary, logged = _resume(out)
    assert _rejects(out) == [] and load_spec(out).plan.num_samples == 6 and summary.written == 0, logged


def test_an_unrecorded_part_is_written_again(finished, tmp_path):
    """A resume killed after writing a part, before recording it: the part counts for nothing (no
    reader opens it) and the next resume writes it again. A job holding the spec as it was before
    the growth refuses to go on."""
    gen = tmp_path / "gen"
    shutil.copytree(finished, gen)
    _hide(gen, 1)
    out = tmp_path / "x"
    opts = ExtractOptions(out=out, model=str(TINY), data=[gen], device="cpu", shard_size=SHARD, allow_incomplete=True)
    extract(opts, log=lambda m: None)
    (out / layout.PLAN_DIR / layout.part_name(1)).write_bytes(b"half a part")
    assert load_spec(out).plan.num_samples == 5 and load_plan(out, load_spec(out))  # not read
    stale = load_spec(out)  # as a process that read the spec before another grew the plan holds it
    shutil.copy2(layout.sample_path(finished, 1, GEN_SHARD), layout.sample_path(gen, 1, GEN_SHARD))
    summary, _ = _resume(out)
    assert summary.complete and load_spec(out).plan.num_samples == 6
    assert load_plan(out, load_spec(out)).input_ids(5).size > 0
    files = _files(out)
    with pytest.raises(Refused, match="grew while this process started"):  # it would seal shards of the old plan
        InProcess().run(ExtractOptions(out=out, threads=1), stale, log=lambda m: None)
    assert _files(out) == files
