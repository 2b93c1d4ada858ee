"""Certification (hsx.certify): every tap checked as it is captured, and recomputed samples compared
tap by tap with transformers' plain path.

Real faults, injected into a real extraction's capture (the bookkeeping between the model and the
file: which layer a tap hooks, the taps' order, the packed row's sequence bounds, the states'
alignment with their tokens, the final norm), each stop the run before it writes a state, naming
the sample and the tap; the fixed resume writes the good run. A correct run passes with its
figures in every file, and the shadow's differences are the independent reference's: transformers'
own ``output_hidden_states`` of the sample alone, in this test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import TINY, conversations, hsx, load_states, write_jsonl
from fidelity_refs import trained_norm
from hsx import certify
from hsx.assess.status import assess
from hsx.assess.verify import verify
from hsx.data import HsxDataset, SamplesUnavailableWarning, StreamDataset
from hsx.errors import CertifyFailed, Exit, RecordDamaged
from hsx.export import ExportOptions, run_export
from hsx.export.core import MANIFEST
from hsx.extract import ExtractOptions, extract, pipeline
from hsx.spec import load_spec
from hsx.store import layout
from hsx.store.durable import write_parts
from hsx.store.format import SampleTensors, decode, encode, read_header

LAYERS = (1, 3, 7)  # of the tiny Llama's 8: the last layer's raw output too


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """The tiny Llama with a final norm as trained (a norm of ones applied twice changes nothing)."""
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    return trained_norm(model, tmp_path_factory.mktemp("target") / "tiny")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("certify-data") / "convs.jsonl", conversations(12))


def run_extract(out: Path, model: Path, data: Path, **kw):
    """``hsx extract`` in this process: CPU, float32, packed rows, every sample recomputed."""
    opts = dict(model=str(model), data=[data], device="cpu", writers=1, codec="raw", batch_tokens=512)
    opts |= dict(dtype="float32", packing="on", layers=list(LAYERS), reference_every=1) | kw
    return extract(ExtractOptions(out=out, **opts), log=lambda _line: None)


def taps_of(out: Path) -> dict[int, certify.Taps]:
    return {
        layout.parse_sample_name(p.name): certify.Taps.parse(read_header(p).metadata["taps"])
        for p in (out / "shards").rglob("*.safetensors")
    }


@pytest.fixture(scope="module")
def good_run(target, data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("good") / "run"
    assert run_extract(out, target, data).complete
    return out


def test_a_correct_run_passes_with_each_taps_figures_and_the_shadows_differences(target, good_run):
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, attn_implementation="eager").eval()
    kept = {}
    model.model.norm.register_forward_pre_hook(lambda _m, args: kept.__setitem__("raw", args[0]))
    taps = taps_of(good_run)
    assert len(taps) == 12
    for path in sorted((good_run / "shards").rglob("*.safetensors")):
        t, figs = load_states(path), taps[layout.parse_sample_name(path.name)]
        with torch.no_grad():
            out = model.model(t["input_ids"][None].long(), output_hidden_states=True)
        want = [out.hidden_states[k + 1][0] for k in LAYERS[:-1]] + [kept["raw"][0], out.last_hidden_state[0]]
        got = [*t["aux_hidden_states"].split(64, dim=-1), t["hidden_states"]]
        n = len(t["input_ids"])
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            rms = float(w[1:].square().mean().sqrt()) if n > 1 else float(w.square().mean().sqrt())
            assert figs.rms[i] == pytest.approx(rms, rel=1e-4)
            rel = float(((g - w).norm(dim=-1) / w.norm(dim=-1)).max())
            assert figs.shadow.diff[i] == pytest.approx(rel, rel=0.5, abs=1e-7)  # the same order of rounding
            assert figs.shadow.diff[i] < figs.shadow.bound[i] / 4  # well within the bound
        assert figs.zero == [0] * 4 and figs.nonfinite == [0] * 4
        assert figs.shadow.beyond == [0] * 4 and figs.shadow.tokens == n and figs.shadow.allowed == 0
    bands = json.loads((good_run / layout.TAP_BANDS).read_text())
    assert bands["names"] == ["layer 1", "layer 3", "layer 7", "final"] and 8 <= bands["samples"] <= 12
    spec = json.loads((good_run / layout.SPEC).read_text())
    assert spec["certify"] == {"every": 1, "first": 4}


def test_the_certificate_says_what_each_tap_is_and_what_the_checks_found_and_travels_with_exports(good_run, tmp_path):
    cert = certify.read_certificate(good_run)
    assert cert.verdict == "passed" and cert.failures == [] and cert.stopped is None
    line = assess(good_run).get("certificate")
    assert line.level == "ok" and line.figure.startswith("passed; shadow: 12 samples, worst tap at 0.")
    assert [t.name for t in cert.taps] == ["layer 1", "layer 3", "layer 7", "final"]
    assert "hidden_states[2]" in cert.taps[0].what and "raw output, before the final norm" in cert.taps[2].what
    assert "last_hidden_state" in cert.taps[3].what and cert.final_norm == "post"
    shadows = {sid: t.shadow for sid, t in taps_of(good_run).items()}
    assert cert.shadow.samples == sorted(shadows) == list(range(12))
    assert cert.shadow.diff == [max(s.diff[i] for s in shadows.values()) for i in range(4)]
    assert cert.shadow.failed == [] and cert.shadow.beyond == [0] * 4
    assert cert.bands.names == [t.name for t in cert.taps]
    spec = load_spec(good_run)
    assert cert.plan == spec.plan.fingerprint
    assert cert.model["fingerprint"] == spec.model.fingerprint.model_dump(mode="json")
    assert cert.fidelity["figure"]["checked"] > 0 and cert.fidelity["check"]["mode"] == "baseline"
    exported = run_export(ExportOptions(run=good_run, dest=tmp_path / "export", to="specforge"), log=lambda _l: None)
    assert exported.samples == 12
    manifest = json.loads((tmp_path / "export" / MANIFEST).read_text())
    stamped = manifest["certificate"]  # the export carries it as the run has it, its stamp checking it
    assert stamped == json.loads((good_run / layout.CERTIFICATE).read_text())
    assert {k: v for k, v in stamped.items() if k not in ("run", "record_digest")} == cert.model_dump(mode="json")
    edited = tmp_path / "edited"
    shutil.copytree(good_run, edited)
    body = json.loads((edited / layout.CERTIFICATE).read_text())
    body["verdict"] = "passed" if body["verdict"] != "passed" else "failed"
    (edited / layout.CERTIFICATE).write_text(json.dumps(body))
    with pytest.raises(RecordDamaged, match="its digest does not match its content"):
        HsxDataset(edited)
    assert assess(edited).get("certificate").level == "fail"


def _out(o):
    return o[0] if isinstance(o, tuple) else o


def shifted_tap(backend) -> None:
    """The first tap hooked one decoder layer late (the engines' off-by-one)."""
    backend.parts.layers[LAYERS[0] + 1].register_forward_hook(backend._keep(LAYERS[0]))


def _edit_after_layers(backend, edit) -> None:
    """``edit`` the kept outputs once every layer ran (at the final norm): a capture's bookkeeping fault."""

    def hook(_m, _i, _o):
        if all(k in backend._outputs for k in (*LAYERS, "final")):
            edit(backend._outputs)

    backend.parts.norm.register_forward_hook(hook)


def swapped_taps(backend) -> None:
    """Two taps stored in each other's place."""

    def swap(kept):
        kept[LAYERS[0]], kept[LAYERS[1]] = kept[LAYERS[1]], kept[LAYERS[0]]

    _edit_after_layers(backend, swap)


def zeroed_tokens(backend) -> None:
    """One tap's stream zeroed for a few tokens (a kernel that skipped them)."""

    def zero(kept):
        kept[LAYERS[1]] = kept[LAYERS[1]].clone()
        kept[LAYERS[1]][:, 5:8] = 0

    _edit_after_layers(backend, zero)


def shifted_positions(backend) -> None:
    """Every state taken one position late against its tokens (a packed row's offsets off by one)."""

    def roll(kept):
        for k in (*LAYERS, "final"):
            kept[k] = kept[k].roll(1, dims=-2)

    _edit_after_layers(backend, roll)


def norm_twice(backend) -> None:
    """The final state put through the final norm a second time."""

    def again(kept):
        norm = backend.parts.norm
        kept["final"] = torch.nn.functional.rms_norm(kept["final"], (64,), norm.weight, norm.variance_epsilon)

    _edit_after_layers(backend, again)


def contaminated(backend) -> None:
    """The packed row's sequence bounds lost (a mask fault): each sample attends to the samples before
    it in its batch, as one long sequence would."""
    pack = backend.pack

    def merged(sequences):
        got = pack(sequences)
        cu = got["cu_seq_lens_q"][[0, -1]]
        total = int(cu[-1])
        return got | {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": total, "max_length_k": total}

    backend.pack = merged


@pytest.fixture
def faulty(monkeypatch):
    def install(fault) -> None:
        opened = pipeline.open_backend

        def open_faulty(*a, **kw):
            backend = opened(*a, **kw)
            fault(backend)
            return backend

        monkeypatch.setattr(pipeline, "open_backend", open_faulty)

    return install


FAULTS = {  # each fault and what its message names: the check that catches it
    shifted_tap: ("layer 1", "plain recomputation"),
    swapped_taps: ("layer 1", "plain recomputation"),
    zeroed_tokens: ("layer 3", "3 of its tokens are all zeros"),
    contaminated: ("layer 1", "plain recomputation"),
    shifted_positions: ("layer 1", "plain recomputation"),
    norm_twice: ("final", "plain recomputation"),
}


@pytest.mark.parametrize("fault", list(FAULTS), ids=lambda f: f.__name__)
def test_a_fault_in_the_taps_stops_the_run_before_it_writes_a_state(
    fault, target, data, good_run, faulty, monkeypatch, tmp_path
):
    out = tmp_path / "run"
    faulty(fault)
    with pytest.raises(CertifyFailed) as stop:  # the default shadow: ids 0-3 and the session's first batch
        run_extract(out, target, data, reference_every=None)
    said = str(stop.value)
    tap, check = FAULTS[fault]
    assert f", {tap}: " in said and check in said and "Likely causes" in said and "Nothing of this batch" in said
    assert said.startswith("taps: sample ") and said.split()[2].rstrip(",").isdigit()  # the sample named
    assert not list(out.rglob("*.safetensors")), "a batch that failed its check was written"
    assert not list(out.rglob(".*.tmp-*"))
    assert assess(out).exit_code == Exit.OK  # a clean stop: nothing to repair, the lock is free
    cert = certify.read_certificate(out)
    assert cert.verdict == "failed" and cert.stopped == said and cert.failures == []
    line = assess(out).get("certificate")
    assert line.level == "warn" and said in line.figure  # nothing wrong on disk: the resume is safe once fixed
    for opened in (lambda: HsxDataset(out), lambda: StreamDataset(out, "trainer")):
        with pytest.raises(CertifyFailed, match="its certificate records a failed check"):
            opened()
    with pytest.warns(SamplesUnavailableWarning):  # told otherwise: read (nothing was written)
        assert len(HsxDataset(out, allow_failed=True)) == 0
    monkeypatch.undo()  # found and fixed: the same command resumes and writes the good run
    assert run_extract(out, target, data, reference_every=None).complete
    got, want = taps_of(out), taps_of(good_run)  # the good run recomputed every sample
    assert {sid: (t.rms, t.zero, t.nonfinite) for sid, t in got.items()} == {
        sid: (t.rms, t.zero, t.nonfinite) for sid, t in want.items()
    }
    assert {sid: t.shadow for sid, t in got.items() if t.shadow} == {sid: want[sid].shadow for sid in range(4)}
    assert certify.read_certificate(out).verdict == "passed"
    assert assess(out).get("certificate").level == "ok"


def test_verify_reference_recomputes_files_after_the_fact_and_the_certificate_refuses_a_wrong_one(good_run, tmp_path):
    """A file whose two taps were swapped by what wrote it (as an engine without these checks would),
    with its own digest: integrity passes it; ``hsx verify --reference`` recomputes every file through
    the plain path, fails naming it, and records the failure in the certificate, which loaders then
    refuse. On the good run it passes and records its figures."""
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    sid = 5
    path = layout.sample_path(run, sid, 1000)
    header, t = read_header(path), decode(path.read_bytes())
    a, b, rest = t["aux_hidden_states"].split([64, 64, 64], dim=-1)
    sample = SampleTensors(sid, t["input_ids"], t["loss_mask"], torch.cat([b, a, rest], -1), t["hidden_states"])
    sample.fidelity, sample.taps = header.fidelity, header.metadata["taps"]
    parts, _ = encode(sample, list(LAYERS))
    path.unlink()
    write_parts(path, parts)
    (layout.shard_dir(run, 0) / layout.SEALED).unlink()  # as if sealed after: the next resume reseals it
    assert assess(run).get("integrity").level == "ok"
    proc = hsx("verify", run, "--reference", "12", "--device", "cpu", "--json", check=False)
    report = json.loads(proc.stdout)
    assert proc.returncode == Exit.ACT, proc.stdout + proc.stderr
    assert report["integrity"]["level"] == "ok" and report["reference"]["data"]["failed"] == [sid]
    assert "sample 5: layer 1, layer 3" in report["reference"]["details"][-1]
    cert = certify.read_certificate(run)
    assert cert.verdict == "failed" and cert.reference.samples == list(range(12)) and cert.reference.device == "cpu"
    assert assess(run).get("certificate").level == "fail"
    with pytest.raises(CertifyFailed, match="hsx verify --reference: samples \\[5\\] differ"):
        HsxDataset(run)

    good = tmp_path / "good"
    shutil.copytree(good_run, good)
    result = verify(good, reference_files=4, device="cpu")
    assert result.exit_code == Exit.OK and result.reference.level == "ok"
    cert = certify.read_certificate(good)
    assert cert.verdict == "passed" and cert.reference.samples == [0, 3, 6, 9] and cert.reference.failed == []
    assert max(d / b for d, b in zip(cert.reference.diff, cert.reference.bound, strict=True)) < 0.25


def test_per_tap_checks_find_a_nan_a_zeroed_token_and_a_stream_outside_the_runs_band(tmp_path):
    """``measure`` on real states (a packed row of two samples): a NaN and an all-zero token are
    counted where they are, the RMS leaves each sample's first token out; the gate stops on each, and
    on a stream 100x the band its first samples set."""
    g = torch.Generator().manual_seed(0)
    aux, final = torch.randn(1, 12, 2 * 8, generator=g), torch.randn(1, 12, 8, generator=g)
    aux[0, 3, 8:] = 0.0  # sample 0's token 3, tap 1: all zeros
    final[0, 9, 2] = float("nan")  # sample 1's token 4, the final state
    figs = certify.figures(
        torch.cat([certify.measure(aux, final, [0, 0], [0, 5], [5, 7]), torch.full((2, 3, 6), -1.0)], -1).numpy(),
        [5, 7],
        8,
    )
    assert [f.zero for f in figs] == [[0, 1, 0], [0, 0, 0]] and [f.nonfinite for f in figs] == [[0, 0, 0], [0, 0, 1]]
    want = float(aux[0, 6:12, :8].square().mean().sqrt())  # sample 1, tap 0: its tokens after the first
    assert figs[1].rms[0] == pytest.approx(want, rel=1e-6) and figs[0].shadow is None
    names = certify.tap_names([1, 3])
    gate = certify.Gate(tmp_path, names, log=lambda _l: None)
    with pytest.raises(CertifyFailed, match="sample 7, layer 3: 1 of its tokens are all zeros"):
        gate.judge([7, 8], figs)
    with pytest.raises(CertifyFailed, match="sample 8, final: 1 of its tokens are not finite"):
        gate.judge([8], figs[1:])
    good = certify.Taps([1.0, 2.0, 1.0], [0, 0, 0], [0, 0, 0])
    gate.judge(list(range(certify.BAND_SAMPLES)), [good] * certify.BAND_SAMPLES)  # they set the bands
    assert certify.read_bands(tmp_path).high == [16.0, 32.0, 16.0]
    loud = certify.Taps([1.0, 200.0 * certify.BAND, 1.0], [0, 0, 0], [0, 0, 0])
    with pytest.raises(CertifyFailed, match="sample 9, layer 3: its RMS 3200 is outside the run's band"):
        gate.judge([9], [loud])


def test_the_bound_of_e4m3_inputs_covers_what_they_make_of_another_kernels_rounding():
    """The fp8 route's shadow bound (``certify.bound(..., quantized=True)``): two kernels' bfloat16
    roundings of the same values (here 29% of them one step apart) move a product by less than
    bfloat16's per-step budget, and the same inputs quantized to e4m3 per 128-column group (hsx's
    ``quantize_activations``) move it ~5x more, beyond that budget and within the quantized one."""
    from hsx.capture.quantized import fp8

    torch.manual_seed(0)
    exact = torch.randn(256, 2048, dtype=torch.float64)
    one = exact.to(torch.bfloat16)
    other = (exact * (1 + 2**-9 * torch.randn_like(exact))).to(torch.bfloat16)
    assert 0.2 < (one != other).double().mean() < 0.4
    weight = torch.randn(2048, 1024, dtype=torch.float64) / 2048**0.5

    def e4m3(x):
        values, scales = fp8.quantize_activations(x)
        return (values.double().unflatten(-1, (-1, 128)) * scales.double()[..., None]).flatten(-2)

    def moved(a, b):
        return ((a @ weight - b @ weight).norm(dim=1) / (a @ weight).norm(dim=1)).median().item()

    plain, quantized = moved(one.double(), other.double()), moved(e4m3(one), e4m3(other))
    step = certify.bound("bfloat16", 1, 2048) / certify.PER_LAYER
    quantized_step = certify.bound("bfloat16", 1, 2048, quantized=True) / certify.PER_LAYER
    assert plain < step < quantized < quantized_step, (plain, step, quantized, quantized_step)
