"""hsx extract --teacher: the target's own distribution at every loss-masked position, stored in the
sample file under its digest, checked against transformers' own forward, resumed, verified, damaged
and read back by the datasets."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TINY, conversations, extract_args, flip_byte, hsx, require, unwrite, write_jsonl
from hsx.data import HsxDataset, StreamDataset, collate_packed, collate_padded, describe
from hsx.errors import OptionError
from hsx.export.vocab import write_vocab
from hsx.spec import load_spec
from hsx.store import layout
from hsx.store.format import decode, read_header
from hsx.teacher import parse
from test_export import certificate_note

K = 64
TOL = 1e-5  # float32: the head on a gathered row against the forward's own logits


@functools.cache
def _model(model_dir: Path = TINY):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference(input_ids: torch.Tensor, model_dir: Path = TINY) -> torch.Tensor:
    """transformers' own log_softmax(lm_head(final state)) over the full vocabulary, [T, V] float32."""
    with torch.no_grad():
        logits = _model(model_dir)(input_ids[None].long()).logits[0]
    return logits.float().log_softmax(-1)


def files(run: Path) -> list[Path]:
    return sorted((run / "shards").rglob("*.safetensors"))


@pytest.fixture(scope="module")
def topk_run(tmp_path_factory) -> Path:
    """A complete run of 14 conversations storing the top-64 (2 shards of 10)."""
    root = tmp_path_factory.mktemp("teacher")
    data = write_jsonl(root / "convs.jsonl", conversations(14))
    hsx(*extract_args(data, root / "run", "--teacher", f"topk:{K}"))
    return root / "run"


def test_topk_is_transformers_own(topk_run):
    """Every masked position's ids and log-probabilities are the top-64 of transformers' own
    log_softmax(lm_head(final state)): the stored values equal the reference at the stored ids, they
    fall in order, and none is below the reference's 64th largest (the set is a top-64)."""
    assert_topk_is_transformers_own(topk_run, TINY)


def assert_topk_is_transformers_own(topk_run: Path, model_dir: Path) -> None:
    spec = load_spec(topk_run)
    assert spec.teacher is not None and spec.teacher.kind == "topk" and spec.teacher.k == K
    rows = 0
    for path in files(topk_run):
        t = decode(path.read_bytes())
        assert json.loads(read_header(path).metadata["teacher"]) == {"kind": "topk", "k": K}
        mask = t["loss_mask"].bool()
        ids, lp = t["teacher_ids"], t["teacher_logprobs"]
        assert ids.dtype == torch.int32 and lp.dtype == torch.float32
        assert ids.shape == lp.shape == (int(mask.sum()), K)
        ref = reference(t["input_ids"], model_dir)[mask]
        torch.testing.assert_close(lp, ref.gather(1, ids.long()), rtol=0, atol=TOL)
        assert bool((lp[:, :-1] >= lp[:, 1:]).all())
        assert all(len(set(r.tolist())) == K for r in ids)
        kth = ref.topk(K, dim=-1).values[:, -1]
        assert bool((lp[:, -1] >= kth - TOL).all())
        rows += len(ids)
    assert rows == sum(int(decode(p.read_bytes())["loss_mask"].sum()) for p in files(topk_run)) > 100


@pytest.fixture(scope="module")
def vocab_run(topk_run, tmp_path_factory) -> Path:
    """A pre-norm run of 4 conversations storing the probabilities over an hsx vocab map of 256 ids."""
    root = tmp_path_factory.mktemp("teacher-vocab")
    vocab = write_vocab(topk_run, 256, dest=root / "vocab")
    data = write_jsonl(root / "convs.jsonl", conversations(4))
    d2t = vocab.dest / "d2t-256.npy"
    hsx(*extract_args(data, root / "run", "--teacher", f"draft-vocab:{d2t}", "--final-state", "pre"))
    return root / "run"


def test_draft_vocab_prenorm_is_transformers_own(vocab_run):
    """--teacher draft-vocab with an hsx vocab map, on a pre-norm run (the head's norm applied as the
    fidelity check applies it): softmax over the draft ids' logits and the full argmax, as transformers
    gives them; the run keeps its vocabulary."""
    d2t = vocab_run.parent / "vocab" / "d2t-256.npy"
    selected = torch.from_numpy(np.arange(256) + np.load(d2t))
    spec = load_spec(vocab_run)
    assert spec.teacher.kind == "draft-vocab" and spec.teacher.vocab_size == 256
    assert np.array_equal(np.load(vocab_run / "teacher-vocab.npy"), selected.numpy())
    for path in files(vocab_run):
        t = decode(path.read_bytes())
        mask = t["loss_mask"].bool()
        full = reference(t["input_ids"])[mask]
        probs = full[:, selected].softmax(-1)
        assert t["teacher_probs"].shape == (int(mask.sum()), 256)
        torch.testing.assert_close(t["teacher_probs"], probs, rtol=0, atol=TOL)
        assert torch.equal(t["teacher_argmax"].long(), full.argmax(-1))


def test_resume_redoes_damage_bit_for_bit(topk_run, tmp_path):
    """A truncated file, a file with one flipped bit in its teacher rows and a shard never written:
    verify names the first two, the resume redoes all three, and the run's bytes are the
    uninterrupted run's. A resume asking for another teacher is refused by name, before anything."""
    run = tmp_path / "run"
    shutil.copytree(topk_run, run)
    before = {p.relative_to(run): p.read_bytes() for p in files(run)}
    first, second = files(run)[:2]
    with open(first, "r+b") as f:
        f.truncate(first.stat().st_size - 100)
    header = read_header(second)
    start = header.data_start + header.tensors["teacher_logprobs"]["data_offsets"][0]
    flip_byte(second, start + 5)
    unwrite(run, 1)

    verify = hsx("verify", run, "--deep", check=False)
    assert verify.returncode != 0
    assert first.name in verify.stdout + verify.stderr and second.name in verify.stdout + verify.stderr

    other = hsx("extract", "--out", run, "--teacher", "topk:16", "--device", "cpu", check=False)
    assert other.returncode == 2 and "teacher: the run stores top-64" in other.stderr and "top-16" in other.stderr

    hsx("extract", "--out", run, "--teacher", f"topk:{K}", "--device", "cpu")
    assert {p.relative_to(run): p.read_bytes() for p in files(run)} == before
    assert hsx("verify", run, "--deep").returncode == 0


def test_datasets_yield_the_teacher(topk_run, tmp_path):
    """HsxDataset and StreamDataset hand out the rows as stored; the collates place each at its
    masked position (zeros elsewhere), padded and packed."""
    assert describe(topk_run)["teacher"] == {"kind": "topk", "k": K}
    ds = HsxDataset(topk_run)
    samples = [ds[i] for i in range(3)]
    for s in samples:
        stored = decode(ds.path(s["sample_id"]).read_bytes())
        assert torch.equal(s["teacher_ids"], stored["teacher_ids"])
        assert torch.equal(s["teacher_logprobs"], stored["teacher_logprobs"])
    padded, packed = collate_padded(samples), collate_packed(samples)
    assert padded["teacher_ids"].shape == (3, int(padded["lengths"].max()), K)
    flat = packed["teacher_logprobs"][0]
    at = 0
    for b, s in enumerate(samples):
        n, mask = len(s["input_ids"]), s["loss_mask"].bool()
        assert torch.equal(padded["teacher_logprobs"][b, :n][mask], s["teacher_logprobs"])
        assert not padded["teacher_logprobs"][b, :n][~mask].any()
        assert torch.equal(flat[at : at + n][mask], s["teacher_logprobs"])
        at += n

    run = tmp_path / "run"
    shutil.copytree(topk_run, run)
    seen = 0
    with StreamDataset(run, "kd", max_tokens=512, seed=3, poll=0.01, log=lambda _: None) as stream:
        for step, batch in enumerate(stream, 1):
            for b, sid in enumerate(batch["sample_ids"].tolist()):
                stored = decode(layout.sample_path(run, sid, 10).read_bytes())
                mask = batch["loss_mask"][b].bool()
                assert torch.equal(batch["teacher_ids"][b][mask], stored["teacher_ids"])
                assert torch.equal(batch["teacher_logprobs"][b][mask], stored["teacher_logprobs"])
                seen += 1
            stream.ack(step)
    assert seen == len(files(run))


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("topk:0", "K is a positive number"),
        ("topk:x", "K is a positive number"),
        ("logits:all", "give topk:K"),
        ("draft-vocab:missing.npy", "not a readable .npy file"),
    ],
)
def test_bad_choice_is_refused_by_name(value, says):
    with pytest.raises(OptionError, match=says):
        parse(value)


def test_bad_map_is_refused(tmp_path):
    np.save(tmp_path / "float.npy", np.zeros(4, np.float32))
    np.save(tmp_path / "dup.npy", np.array([0, 0, -1], np.int64))  # d2t: ids 0, 1, 1
    for name, says in (("float", "neither d2t"), ("dup", "not distinct")):
        with pytest.raises(OptionError, match=says):
            parse(f"draft-vocab:{tmp_path / name}.npy")


def test_choice_past_the_vocabulary_makes_no_run(tmp_path):
    from typer.testing import CliRunner

    from hsx.cli import app

    data = write_jsonl(tmp_path / "convs.jsonl", conversations(2))
    args = [str(a) for a in extract_args(data, tmp_path / "run", "--teacher", "topk:4096")]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and "the target's vocabulary has 2048 ids" in r.output
    assert not (tmp_path / "run" / "hsx.json").exists()


def test_forecast_and_memory_count_the_teacher(topk_run):
    """The spec's bytes per token, which the forecast and the disk guard project with, holds the
    teacher's rows at the plan's masked share: the run's data is what it projects (to the rounding
    up of a byte a token); hsx memory adds the head's work and the rows to a GPU's total, and a row's
    bytes a masked token to the storage lines."""
    from hsx.capture.memory import DTYPE_BYTES, Inventory, Layout
    from hsx.drafts import bytes_per_token
    from hsx.extract.memory import MemoryOptions, explain

    spec = load_spec(topk_run)
    tokens = spec.plan.num_tokens
    data = sum(read_header(p).data_size for p in files(topk_run))
    assert spec.bytes_per_token > bytes_per_token(len(spec.layers), spec.model.hidden_size, 4)
    assert tokens * (spec.bytes_per_token - 1) < data <= tokens * spec.bytes_per_token

    def lines(teacher):
        return explain(MemoryOptions(model=str(TINY), dtype="bfloat16", batch_tokens=512, teacher=teacher))

    plain, taught = lines(None), lines(f"topk:{K}")
    row = K * (4 + DTYPE_BYTES["bfloat16"])
    assert f"  --teacher: {row:,} bytes per loss-masked token" in "\n".join(taught)
    assert any(x.startswith("  --teacher: the head's logits and the batch's rows") for x in taught)
    assert not any("--teacher" in x for x in plain)
    inventory = Inventory.of(TINY)
    base = inventory.estimate(Layout(dtype="bfloat16", batch_tokens=512))
    est = inventory.estimate(Layout(dtype="bfloat16", batch_tokens=512, teacher=row))
    assert est.teacher > 512 * row and est.total == base.total + est.teacher  # rows, and the head's logits


@pytest.mark.parametrize(("to", "draft"), [("speculators", "eagle3"), ("modelopt", "eagle3"), ("automodel", "dspark")])
def test_exports_say_where_the_teacher_has_no_place(topk_run, tmp_path, to, draft):
    """A trainer whose data has no place for the target's distribution gets the states as before,
    and the export says, in its summary and manifest, that the teacher was not exported and why
    (Automodel's DSpark cache: its losses go through the LM head it holds)."""
    from hsx.export.core import run_export
    from hsx.export.trainer import ExportOptions

    options = ExportOptions(run=topk_run, dest=tmp_path / to, to=to, draft=draft)
    summary = run_export(options, log=lambda _: None)
    said = next(line for line in summary.lines() if line.startswith("teacher "))
    assert f"top-{K} log-probabilities" in said and "is not exported" in said
    assert draft != "dspark" or "through the lm_head it holds" in said
    manifest = json.loads((tmp_path / to / "hsx-export.json").read_text())
    assert manifest["teacher"] == summary.teacher and summary.samples == len(files(topk_run))


@pytest.mark.parametrize("which", ["topk", "vocab"])
def test_automodel_reads_the_teacher_with_its_own_dataset(topk_run, vocab_run, tmp_path, which):
    """hsx export --to automodel, read by NeMo-Automodel's own CachedEagle3Dataset: each row t holds
    the taps of position t and the tokens, loss mask and distribution of t + 1, as its target wrapper
    shifts them; target_probs is the run's teacher (draft-vocab: exactly; topk: its top-k layout over
    the full vocabulary, renormalized as its compress_target_probs does), position_mask the shifted
    loss mask where the target's argmax is in the draft vocabulary; its embeddings are the target's."""
    require("nemo_automodel")
    from nemo_automodel.components.datasets.llm.eagle3_cache import (
        CachedEagle3Dataset,
        read_manifest,
        read_target_embeddings,
    )

    from hsx.export.core import run_export
    from hsx.export.trainer import ExportOptions

    run = topk_run if which == "topk" else vocab_run
    dest = tmp_path / "am"
    summary = run_export(ExportOptions(run=run, dest=dest, to="automodel"), log=lambda _: None)
    assert "as target_probs" in summary.teacher and "cached_target_path" in summary.train
    ds = CachedEagle3Dataset(str(dest))
    manifest = read_manifest(str(dest))
    vocab = (np.arange(2048) if which == "topk" else np.load(run / "teacher-vocab.npy")).tolist()
    assert manifest["selected_token_ids"] == vocab and manifest["aux_layer_ids"] == [1, 3, 4]
    assert manifest["target_probs_topk"] == (K if which == "topk" else 0)
    assert manifest["hsx_certificate"] == certificate_note(run)  # read by its own loader beside the rest
    assert torch.equal(read_target_embeddings(str(dest)), _model().get_input_embeddings().weight.float())
    assert len(ds) == len(files(run))
    for sid in range(len(ds)):
        item, t = ds[sid], decode(layout.sample_path(run, sid, 10).read_bytes())
        n, mask = len(t["input_ids"]), t["loss_mask"].bool()
        assert (
            torch.equal(item["input_ids"][: n - 1], t["input_ids"][1:].long()) and not item["input_ids"][n - 1 :].any()
        )
        assert torch.equal(item["loss_mask"][: n - 1], t["loss_mask"][1:].long())
        assert torch.equal(item["aux_hidden_states"][:n], t["aux_hidden_states"])
        assert item["attention_mask"].sum() == n
        rows = torch.nonzero(mask).flatten()
        at = rows[rows > 0] - 1
        probs = item["target_probs"][at]
        if which == "topk":
            want = torch.zeros(len(at), 2048)
            kept = t["teacher_logprobs"][rows > 0].exp()
            want.scatter_(1, t["teacher_ids"][rows > 0].long(), kept / kept.sum(-1, keepdim=True))
            torch.testing.assert_close(probs, want)
            assert bool(item["position_mask"][at].all())
        else:
            assert torch.equal(probs, t["teacher_probs"][rows > 0])
            inside = torch.from_numpy(np.isin(t["teacher_argmax"][rows > 0].numpy(), vocab))
            assert torch.equal(item["position_mask"][at, 0], inside)
        assert int(item["position_mask"].sum()) == int(item["position_mask"][at].sum())  # nowhere else


def test_a_file_without_the_runs_teacher_is_another_runs(topk_run, tmp_path):
    """The run's files say which teacher they store; a valid file of the same sample that stores none
    (a shard copied from a run without --teacher) is foreign to this run, never served as its sample."""
    from hsx.errors import Damage
    from hsx.store.format import BadFile, SampleTensors, encode

    expected = load_spec(topk_run).expected()
    path = files(topk_run)[0]
    expected.judge(read_header(path))
    t = decode(path.read_bytes())
    sid = layout.parse_sample_name(path.name)
    plain = SampleTensors(sid, t["input_ids"], t["loss_mask"], t["aux_hidden_states"], t["hidden_states"])
    parts, _ = encode(plain, [1, 3, 4])
    copied = tmp_path / path.name
    copied.write_bytes(b"".join(bytes(p) for p in parts))
    with pytest.raises(BadFile) as e:
        expected.judge(read_header(copied))
    assert e.value.kind == Damage.FOREIGN and "its teacher None" in str(e.value)
