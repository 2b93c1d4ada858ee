"""Fidelity: a run's states checked against the target's own next-token predictions as they are captured.

Real faults, injected into the running model of a real extraction (a final state from the wrong
layer, the final norm skipped, states shifted against their tokens, a corrupted attention output, a
perturbed expert), each stop the run before it writes a state; a correct run passes with the figure
transformers' own full forward (``logits``) gives. The data is each model's own temperature-0
output (``hsx generate``), where every token but near ties must agree.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TINY, hsx
from fidelity_refs import TOKENIZER_FILES, logits_reference, own_output, trained_norm
from hsx import fidelity
from hsx.assess.status import assess
from hsx.errors import Exit, FidelityFailed, Refused
from hsx.extract import ExtractOptions, extract, pipeline
from hsx.store import layout
from hsx.store.durable import write_parts
from hsx.store.format import Figure, SampleTensors, decode, encode, read_header
from hsx.store.writer import read_seal

NEAR_TIE_SHARE = 0.01  # of checked tokens, at most, on a MoE model (router near-ties): none on a dense one


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Every forward of this module on one thread (the machine's cores are shared); restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    return trained_norm(model, tmp_path_factory.mktemp("target") / "tiny")


@pytest.fixture(scope="module")
def own(target, tmp_path_factory) -> Path:
    return own_output(target, tmp_path_factory.mktemp("own") / "gen")


def run_extract(out: Path, model: Path, data: Path, log: list | None = None, **kw):
    """``hsx extract`` in this process: CPU, raw, every masked token checked, small batches."""
    opts = dict(model=str(model), data=[data], device="cpu", writers=1, codec="raw", batch_tokens=512)
    opts |= {"fidelity_stride": 1} | kw
    return extract(ExtractOptions(out=out, **opts), log=(log if log is not None else []).append)


def figures_of(out: Path) -> dict[int, Figure]:
    return {layout.parse_sample_name(p.name): read_header(p).fidelity for p in (out / "shards").rglob("*.safetensors")}


@pytest.fixture(scope="module")
def good_run(target, own, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("good") / "run"
    assert run_extract(out, target, own).complete
    return out


def test_a_correct_run_passes_with_the_figure_the_model_itself_gives(target, own, good_run):
    figs = figures_of(good_run)
    ref = logits_reference(target, good_run)
    assert figs.keys() == ref.keys() and len(figs) == 12
    for sid, f in figs.items():
        checked, agreed, logprob = ref[sid]
        assert f.checked == checked > 0  # stride 1: every masked next token
        assert abs(f.agreed - agreed) <= f.near_ties, (sid, f, ref[sid])  # a near tie may round either way
        assert f.logprob == pytest.approx(logprob, rel=1e-4)
        assert f.matched == f.checked, (sid, f)  # the model's own greedy tokens: every one but near ties
    total = sum(figs.values(), Figure(0, 0, 0, 0.0))
    assert total.near_ties <= NEAR_TIE_SHARE * total.checked
    sealed = {sid: r.fidelity for s in range(1) for sid, r in read_seal(good_run, s).items()}
    assert sealed == figs  # the manifest lists each file's figure
    line = assess(good_run).get("fidelity")
    assert line.level == "ok" and line.data["checked"] == total.checked and line.data["below"] == []
    assert line.data["spread_p10_p50_p90"] == [1.0, 1.0, 1.0]
    spec = json.loads((good_run / "hsx.json").read_text())
    assert spec["fidelity"] == {"mode": "floor", "stride": 1, "floor": 0.98, "drop": 0.5}
    with pytest.raises(Refused, match="fidelity stride: the run checks 1 in 1 masked tokens, asked for 4"):
        run_extract(good_run, target, own, fidelity_stride=4)


def _out(o):
    return o[0] if isinstance(o, tuple) else o


def wrong_layer(backend) -> None:
    """The final norm applied to the layer before the last (the off-by-one of engines' layer ids)."""
    kept = {}
    backend.parts.layers[-2].register_forward_hook(lambda m, i, o: kept.__setitem__("h", _out(o)))
    backend.parts.norm.register_forward_pre_hook(lambda m, args: (kept["h"], *args[1:]))


def skipped_norm(backend) -> None:
    """The last layer's output as the final state: the norm skipped."""
    backend.parts.norm.register_forward_hook(lambda m, i, o: i[0], prepend=True)


def shifted(backend) -> None:
    """Each token given the state of the token before it."""
    backend.parts.norm.register_forward_hook(lambda m, i, o: o.roll(1, dims=-2), prepend=True)


def corrupted_attention(backend, after: int = 0) -> None:
    """One layer's attention output overwritten with noise of its own scale (a kernel race), from its
    ``after``-th call on."""
    g = torch.Generator().manual_seed(0)
    calls = [0]

    def hook(m, i, o):
        calls[0] += 1
        if calls[0] <= after:
            return None
        a = o[0]
        return (torch.randn(a.shape, generator=g) * a.std() * 3, *o[1:])

    backend.parts.layers[len(backend.parts.layers) // 2].self_attn.register_forward_hook(hook)


def perturbed_expert(backend) -> None:
    """One routed expert's weights scaled and sign-flipped in every MoE layer (a bad load or memory fault)."""
    for layer in backend.parts.layers:
        with torch.no_grad():
            layer.mlp.experts.down_proj[3].mul_(-4.0)


@pytest.fixture
def faulty(monkeypatch):
    """Install a fault in the model the next extraction of this process loads."""

    def install(fault) -> None:
        opened = pipeline.open_backend

        def open_faulty(*a, **kw):
            backend = opened(*a, **kw)
            fault(backend)
            return backend

        monkeypatch.setattr(pipeline, "open_backend", open_faulty)

    return install


@pytest.mark.parametrize("fault", [wrong_layer, skipped_norm, shifted, corrupted_attention], ids=lambda f: f.__name__)
def test_a_fault_stops_the_run_before_it_writes_a_state(fault, target, own, good_run, faulty, monkeypatch, tmp_path):
    out = tmp_path / "run"
    faulty(fault)
    with pytest.raises(FidelityFailed) as stop:
        run_extract(out, target, own)
    said = str(stop.value)
    assert "predict the target's next token for" in said and "the floor 98.0%" in said and "Likely causes" in said
    first = said.split("samples ", 1)[1].split(" predict")[0]
    assert first and all(s.strip().isdigit() for s in first.split(","))  # named
    assert not list(out.rglob("*.safetensors")), "a batch that failed its check was written"
    assert not list(out.rglob(".*.tmp-*"))
    assert assess(out).exit_code == Exit.OK  # a clean stop: nothing to repair, the lock is free
    monkeypatch.undo()  # the fault found and fixed: the same command resumes and writes the good run
    assert run_extract(out, target, own).complete
    assert figures_of(out) == figures_of(good_run)


def test_on_other_data_a_fall_from_the_runs_baseline_stops_it(target, own, faulty, monkeypatch, tmp_path):
    """Data that is another model's output (the target's output, extracted with a sibling whose final
    norm differs a little): no floor; the first batches set the baseline, a fault that starts later
    stops the run, and the batches before it are kept."""
    from transformers import AutoModelForCausalLM

    sibling = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        sibling.model.norm.weight.mul_(1 + 0.05 * torch.randn(sibling.model.norm.weight.shape, generator=g))
    sibling.save_pretrained(tmp_path / "sibling")
    for name in TOKENIZER_FILES:
        shutil.copy(TINY / name, tmp_path / "sibling" / name)
    monkeypatch.setattr(fidelity, "BASELINE", 64)  # this test's scale: a GPU batch checks thousands
    faulty(lambda backend: corrupted_attention(backend, after=3))
    out = tmp_path / "run"
    lines: list[str] = []
    with pytest.raises(FidelityFailed, match=r"of the run's baseline") as stop:
        run_extract(out, tmp_path / "sibling", own, lines, batch_tokens=128)
    base = fidelity.read_baseline(out)
    assert base is not None and base.checked >= 64 and base.rate > 0.5
    assert any(line.startswith(f"fidelity: baseline {base.rate:.1%}") for line in lines)
    assert json.loads((out / "hsx.json").read_text())["fidelity"]["mode"] == "baseline"
    written = figures_of(out)
    assert written and all(not fidelity.unlikely(f, base.rate / 2) for f in written.values())
    assert not set(written) & {int(s) for s in str(stop.value).split("samples ", 1)[1].split(" predict")[0].split(",")}
    monkeypatch.undo()  # fixed: the resume keeps the written batches and the baseline, and writes the rest
    assert run_extract(out, tmp_path / "sibling", own, batch_tokens=128).complete
    assert fidelity.read_baseline(out) == base  # measured once, kept across sessions
    assert {sid: figures_of(out)[sid] for sid in written} == written


def test_a_moe_target_passes_but_for_near_ties_and_a_perturbed_expert_stops_it(faulty, tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        initializer_range=0.1,  # as the bundled model: layers that move the state as a trained one's do
    )  # fmt: skip
    torch.manual_seed(0)
    moe = trained_norm(AutoModelForCausalLM.from_config(config).float().eval(), tmp_path / "moe")
    gen = own_output(moe, tmp_path / "gen", n=8)
    assert run_extract(tmp_path / "good", moe, gen).complete
    total = sum(figures_of(tmp_path / "good").values(), Figure(0, 0, 0, 0.0))
    missed = total.checked - total.matched  # a router near-tie picks other experts: O(1) off, not rounding
    print(f"moe: {total.checked} checked, {total.near_ties} near ties, {missed} missed")
    assert total.checked > 200 and missed <= NEAR_TIE_SHARE * total.checked
    faulty(perturbed_expert)
    with pytest.raises(FidelityFailed, match=r"the floor 98\.0%"):
        run_extract(tmp_path / "bad", moe, gen)
    assert not list((tmp_path / "bad").rglob("*.safetensors"))


def test_status_and_verify_fidelity_find_states_that_are_intact_but_wrong(target, good_run, tmp_path):
    """A file whose final state is another layer's, written through the store with its own digest and
    an honest figure (as an hsx without the check would have): integrity passes it; status lists it
    under the floor from its figure, and verify --fidelity recomputes it from the checkpoint and fails."""
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    sid = 4
    path = layout.sample_path(run, sid, 1000)
    t = decode(path.read_bytes())
    wrong = t["aux_hidden_states"][:, -64:].contiguous()  # the last aux layer's state as the final one
    mask = t["loss_mask"].numpy()
    honest = reference_figure(target, t["input_ids"], mask, wrong)
    sample = SampleTensors(sid, t["input_ids"], t["loss_mask"], t["aux_hidden_states"], wrong, honest)
    parts, _ = encode(sample, json.loads(read_header(path).metadata["layers"]))
    path.unlink()
    write_parts(path, parts)
    (layout.shard_dir(run, 0) / layout.SEALED).unlink()  # as if sealed after: the next resume reseals it
    line = assess(run).get("fidelity")
    assert line.level == "warn" and line.data["below"] == [sid], line
    assert assess(run).get("integrity").level == "ok"
    proc = hsx("verify", run, "--fidelity", "--fidelity-files", "12", "--json", check=False)
    report = json.loads(proc.stdout)
    assert proc.returncode == Exit.ACT, proc.stdout + proc.stderr
    assert report["integrity"]["level"] == "ok" and report["fidelity"]["data"]["wrong"] == [sid]
    good = hsx("verify", good_run, "--fidelity", "--fidelity-files", "12")
    assert "recomputed from the checkpoint for 12 files, every masked token: 100.0%" in good.stdout


def reference_figure(model_dir: Path, ids: torch.Tensor, mask: np.ndarray, final: torch.Tensor) -> Figure:
    """The figure of ``final`` through transformers' own head (not hsx's), every masked next token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    on = torch.from_numpy(mask[1:].astype(bool))
    with torch.no_grad():
        logits = model.lm_head(final[:-1][on])
    nxt = ids[1:][on]
    agreed = int((logits.argmax(-1) == nxt).sum())
    logp = float(torch.log_softmax(logits, -1).gather(1, nxt[:, None]).sum())
    return Figure(int(on.sum()), agreed, 0, logp)
