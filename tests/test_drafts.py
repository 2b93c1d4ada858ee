"""Draft types end to end: the presets' taps against the trainers' own formulas, a run made for a
DFlash draft with its final state before the norm (and one of the final state alone), every
(trainer, draft type) export read by that trainer's own reader, pre-norm states recovered exactly,
and an EAGLE-3 run's EAGLE-3 exports byte for byte what the hsx this work started from wrote."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import HANG_GUARD_S, TINY, conversations, hsx, normed_model, require, write_jsonl
from context_target import CONTEXT_TARGET
from context_target import conversations as rule_conversations
from hsx import drafts
from hsx.data import HsxDataset
from hsx.errors import OptionError
from hsx.export.norm import TOLERANCE, diagnose, load_final_norm, prenorm_from_post
from hsx.spec import differences, load_spec
from hsx.store.format import FINAL_STATE_PRENORM, final_norm_of
from test_export import MANIFEST, assert_automodel_dspark, deepspec_read, export, manifest_ok, specforge_read

N = 8  # the tiny Llama's decoder layers
TAPS = drafts.dflash_taps(5, N)  # [1, 2, 3, 4, 5]
RUN_ARGS = ("--shard-size", "10", "--batch-tokens", "512", "--writers", "2", "--device", "cpu", "--threads", "1")
BASE = "9286cbde55925d3bc72a4591d8ecce7bc7e56102"  # hsx before draft types: its EAGLE-3 exports are the reference


def quiet_model(dest: Path) -> Path:
    """The tiny Llama with its residual stream scaled by 0.02 (embeddings and every projection into the
    stream), so its final states have a mean square near 1e-3: eps (1e-5) is no longer negligible."""
    shutil.copytree(TINY, dest)
    w = load_file(dest / "model.safetensors")
    for k in w:
        if k.endswith(("embed_tokens.weight", "o_proj.weight", "down_proj.weight")):
            w[k] = w[k] * 0.02
    save_file(w, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"normed": normed_model(root / "normed"), "quiet": quiet_model(root / "quiet")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, models) -> dict[str, Path]:
    """One DFlash run (5 taps, final state before the norm) with its post-norm twin, a run of the final
    state alone, and EAGLE-3 runs of the quiet model and the normed one; all at once (most of each is
    start-up)."""
    root = tmp_path_factory.mktemp("runs")
    data = write_jsonl(root / "convs.jsonl", conversations(48))
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    variants = {
        "dflash": ("normed", "--layers", "dflash:5", "--final-state", "pre", "--codec", "raw"),
        "post": ("normed", "--layers", "dflash:5", "--codec", "raw"),
        "mtp": ("normed", "--layers", "mtp"),
        "quiet": ("quiet", "--codec", "raw"),
        "eagle3": ("normed", "--codec", "raw"),
    }
    base = [sys.executable, "-m", "hsx", "extract", "--data", data, *RUN_ARGS]
    procs = {
        name: subprocess.Popen(
            [*base, "--model", models[m], "--out", root / name, *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for name, (m, *extra) in variants.items()
    }
    for p in procs.values():
        output = p.communicate(timeout=HANG_GUARD_S)[0]
        assert p.returncode == 0, output.decode()
    return {name: root / name for name in variants}


@pytest.fixture(scope="module")
def forward(models):
    """transformers' own forward of a model: every ``hidden_states`` entry and the final norm's input."""
    from transformers import AutoModelForCausalLM

    loaded = {}

    @torch.no_grad()
    def run(name: str, input_ids: torch.Tensor) -> dict:
        if name not in loaded:
            loaded[name] = AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float32).eval()
        m, seen = loaded[name], {}

        def keep(_module, args) -> None:  # a pre-hook that returns nothing leaves the input as it is
            seen["pre"] = args[0][0]

        hook = m.model.norm.register_forward_pre_hook(keep)
        try:
            states = m(input_ids=input_ids[None], output_hidden_states=True).hidden_states
        finally:
            hook.remove()
        return {"states": [h[0] for h in states], "pre": seen["pre"], "norm": m.model.norm}

    return run


def samples(run: Path) -> list[dict]:
    ds = HsxDataset(run, verify=True)
    return [ds[i] for i in range(len(ds))]


# ---------------------------------------------------------------- presets


def test_presets_give_the_taps_the_trainers_compute():
    """DFlash's formula against SpecForge's and Model-Optimizer's own (both count as hsx does), and
    EAGLE-3's default against speculators' (vLLM ids: one higher)."""
    require("specforge")
    require("modelopt")
    from modelopt.torch.speculative.plugins.modeling_dflash import build_target_layer_ids as modelopt_ids
    from specforge.modeling.draft.dflash import build_target_layer_ids as specforge_ids

    assert drafts.dflash_taps(5, 36) == [1, 9, 17, 25, 33]
    assert drafts.dflash_taps(2, 3) == specforge_ids(3, 2) == [1, 0]  # a small model: the formula as it is
    assert drafts.dflash_taps(5, 11) == specforge_ids(11, 5)  # round half to even, as theirs
    for layers in (8, 28, 36, 61, 94):
        for n in (1, 2, 3, 5, 8):
            theirs = specforge_ids(layers, n)
            assert theirs == modelopt_ids(layers, n)
            if len(set(theirs)) < n:  # a draft layer would read a tap twice: refused, naming them
                with pytest.raises(OptionError, match="repeated layers"):
                    drafts.dflash_taps(n, layers)
            else:
                assert drafts.dflash_taps(n, layers) == theirs, (layers, n)
        assert [k + 1 for k in drafts.eagle3_taps(layers)] == [2, layers // 2, layers - 3]
    assert drafts.resolve("mtp", 36).ids == [] and drafts.resolve(None, 36).ids == [1, 17, 32]
    assert drafts.resolve("dflash", 36).formula == "dflash:5: round(1 + i*(N-4)/(n-1)), i = 0..4, N = 36"
    for bad in ("dflash:0", "eagle3:2", "mtp:1", "dflash5", "medusa"):
        with pytest.raises(OptionError, match=r"preset|at least 1 tap"):
            drafts.check_preset(bad)
    with pytest.raises(OptionError, match="1 to 8 taps"):
        drafts.resolve("dflash:9", 8)


def test_small_models_presets_follow_the_documented_formulas_and_say_where_they_cannot():
    """dflash:2 on 3 layers is the formula's [1, 0], SpecForge's too (hsx clamped the last tap and
    refused [1, 1]); ``round`` is half to even; EAGLE-3 on 2 layers stores [0, 1] sorted, the
    formula recorded with what was clipped (it stored [1, 0] under the bare formula)."""
    assert drafts.resolve("dflash:2", 3).ids == [1, 0]
    assert drafts.dflash_taps(5, 11) == [1, 3, 4, 6, 8]  # 1 + 1.75 i: 2.75, 4.5 (half to even: 4), 6.25
    with pytest.raises(OptionError, match=r"layers outside 0..N-1 \[1, -1\] on this 2-layer model"):
        drafts.dflash_taps(2, 2)
    small = drafts.resolve("eagle3", 2)
    assert small.ids == [0, 1]
    assert (
        small.formula
        == "eagle3: [1, N//2-1, N-4], N = 2 gives [1, 0, -2]: clipped to layers 0..1, de-duplicated, [0, 1]"
    )
    assert drafts.resolve("eagle3", 7).formula == "eagle3: [1, N//2-1, N-4], N = 7"


def test_layers_takes_a_preset_on_the_command_line_and_refuses_a_bad_one(tmp_path):
    data = write_jsonl(tmp_path / "c.jsonl", conversations(2))
    out = hsx("extract", "--model", TINY, "--data", data, "--out", tmp_path / "r", "--layers", "dflash:x", check=False)
    assert out.returncode == 2 and "draft preset" in out.stderr and not (tmp_path / "r").exists()
    out = hsx("memory", "--model", TINY, "--dtype", "float32").stdout
    assert "--layers dflash:5: 5 taps [1, 2, 3, 4, 5] + the final state: 1,545 bytes" in out
    assert "(1.50x eagle3)" in out and "--layers mtp: the final state alone: 265 bytes" in out


# ---------------------------------------------------------------- capture for a draft type


def test_a_dflash_run_stores_its_taps_and_the_final_state_before_the_norm(runs, forward):
    """The spec and every file say what they hold; the taps are transformers' hidden_states[k + 1] and
    the final state is the final norm's input (its forward pre-hook); the norm of it is, bit for bit,
    what the post-norm twin stored."""
    spec = load_spec(runs["dflash"])
    assert spec.layers == TAPS and spec.final_norm == "pre" and spec.layers_formula.startswith("dflash:5: round(")
    assert spec.final_state == FINAL_STATE_PRENORM and load_spec(runs["post"]).final_norm == "post"
    assert "final_norm" not in json.loads((runs["post"] / "hsx.json").read_text())  # written where asked only
    asked = {"final_norm": "post", "layers": drafts.resolve("dflash:3", N).ids}  # a resume asking otherwise
    assert differences(spec, asked) == [
        f"layers: run has {TAPS}, asked for [1, 3, 5]",
        "final norm: run has pre, asked for post",
    ]
    first = next((runs["dflash"] / "shards").rglob("*.safetensors"))
    with safe_open(str(first), framework="pt") as f:
        assert final_norm_of(f.metadata()) == "pre" and json.loads(f.metadata()["layers"]) == TAPS
    norm = load_final_norm(Path(spec.model.path), 64)
    for n, (s, twin) in enumerate(zip(samples(runs["dflash"]), samples(runs["post"]), strict=True)):
        if n < 12:  # against transformers' forward, a sample at a time (the CPU time of the test)
            ref = forward("normed", s["input_ids"])
            aux = s["aux_hidden_states"].view(-1, len(TAPS), 64)
            for i, k in enumerate(TAPS):
                assert torch.allclose(aux[:, i], ref["states"][k + 1], atol=1e-5)
            assert torch.allclose(s["hidden_states"], ref["pre"], atol=1e-5)
        assert torch.equal(twin["aux_hidden_states"], s["aux_hidden_states"])
        assert torch.equal(norm.apply(s["hidden_states"]), twin["hidden_states"])
    # the fidelity check puts the pre-norm state through the final norm first: the twin's figures
    pre, post = (sorted((runs[r] / "shards").rglob("*.safetensors")) for r in ("dflash", "post"))
    for a, b in zip(pre, post, strict=True):
        with safe_open(str(a), framework="pt") as fa, safe_open(str(b), framework="pt") as fb:
            got, want = (json.loads(f.metadata()["fidelity"]) for f in (fa, fb))
        assert want["checked"] > 0 and {k: got[k] for k in ("checked", "agreed", "near_ties")} == {
            k: want[k] for k in ("checked", "agreed", "near_ties")
        }
        assert got["logprob"] == pytest.approx(want["logprob"], rel=1e-4, abs=1e-4)
    recomputed = hsx("verify", runs["dflash"], "--fidelity", "--fidelity-files", "4", "--json")
    assert json.loads(recomputed.stdout)["fidelity"]["level"] == "ok", recomputed.stdout


def test_a_run_of_the_final_state_alone_stores_no_taps(runs):
    spec = load_spec(runs["mtp"])
    assert spec.layers == [] and spec.bytes_per_token == 64 * 4 + 9
    files = sorted((runs["mtp"] / "shards").rglob("*.safetensors"))
    assert len(files) == 48
    with safe_open(str(files[0]), framework="pt") as f:  # zstd, the default codec: the final state alone
        assert sorted(f.keys()) == ["hidden_states.zstd", "input_ids", "loss_mask"]
    assert "48 files good" in hsx("verify", runs["mtp"], "--deep").stdout
    post = samples(runs["post"])
    for s, twin in zip(samples(runs["mtp"]), post, strict=True):
        assert "aux_hidden_states" not in s and torch.equal(s["hidden_states"], twin["hidden_states"])


# ---------------------------------------------------------------- exports per (trainer, draft type)


def test_specforge_dflash_and_dspark_read_the_dflash_run_with_its_own_reader(runs, tmp_path):
    require("specforge")
    import numpy as np
    from specforge.data.loss_mask import has_consecutive_supervised_tokens

    from hsx.export.specforge import has_consecutive_loss

    for mask in ([0, 1, 0, 1, 0], [1, 1], [0, 0, 0], [1], [0, 1, 1, 0]):  # what its reader raises on, ours leaves out
        theirs = bool(has_consecutive_supervised_tokens(torch.tensor(mask)))
        assert has_consecutive_loss(np.array(mask, dtype=np.uint8)) == theirs, mask
    src, twin = samples(runs["dflash"]), samples(runs["post"])
    lengths = [s["input_ids"].shape[0] for s in src]
    for kind, keys in (("dflash", ()), ("dspark", ("target_last_hidden_states",))):
        dest = tmp_path / kind
        # its DFlash reads no final state, so it reads no model either (it asked for one, "pass --model")
        gone = ("--model", tmp_path / "moved-away") if kind == "dflash" else ()
        out = export(runs["dflash"], dest, "--to", "specforge", "--draft", kind, *gone)
        assert "specforge train -c CONFIG.yaml" in out
        if kind == "dflash":  # the formula gives the taps: the draft's layer count names them
            assert '"draft_num_hidden_layers": 5' in out and "final      none (a DFlash draft reads the taps" in out
            assert json.loads((dest / MANIFEST).read_text())["final_state_norm"]["exported"] is None
        else:  # no DSpark draft config is made by SpecForge: the line says what it must name
            assert "exact" in out
            assert f"a dspark draft config with num_hidden_layers 5 and dflash_config.target_layer_ids {TAPS}" in out
        manifest_ok(dest, 48)
        got = specforge_read(dest, lengths, kind, ("input_ids", "hidden_states", *keys))
        for i, s in enumerate(src):
            assert torch.equal(got[i]["input_ids"], s["input_ids"])
            assert torch.equal(got[i]["hidden_states"], s["aux_hidden_states"].to(torch.bfloat16))
            if keys:  # post-norm: the norm of the stored pre-norm state, what the twin stored
                want = twin[i]["hidden_states"].to(torch.bfloat16)
                assert torch.equal(got[i]["target_last_hidden_states"], want)


def test_deepspec_reads_the_final_state_of_a_pre_norm_run_after_the_norm(runs, tmp_path):
    """DeepSpec's cache of the DFlash run stored pre-norm: its final state is the norm of it, what the
    post-norm twin stored, in bfloat16, and its taps are all five."""
    out = export(runs["dflash"], tmp_path / "ds", "--to", "deepspec", "--draft", "dspark")
    assert f"model.target_layer_ids={TAPS}" in out and "exact" in out
    m, got = deepspec_read(tmp_path / "ds")
    assert m["target_layer_ids"] == TAPS
    for g, s, twin in zip(got, samples(runs["dflash"]), samples(runs["post"]), strict=True):
        assert torch.equal(torch.from_numpy(g["aux"]), s["aux_hidden_states"].to(torch.bfloat16).float())
        assert torch.equal(torch.from_numpy(g["final"]), twin["hidden_states"].to(torch.bfloat16).float())


def test_automodel_dspark_reads_a_pre_norm_run_after_the_norm_and_refusals_name_what_it_cannot(runs, models, tmp_path):
    """Automodel's DSpark cache of the DFlash run stored pre-norm, read by its own cache code: the
    final state after the norm (the post-norm twin's, exactly), the five taps as stored, equal to its
    own capture of the target; a draft type it trains from no cache, a run without taps, --prenorm,
    a draft-vocab map and taps out of order are refused by name, nothing written."""
    dest = tmp_path / "am"
    out = export(runs["dflash"], dest, "--to", "automodel", "--draft", "dspark")
    assert f"--recipe_args.target_layer_ids=[{','.join(map(str, TAPS))}]" in out and "exact" in out
    m = assert_automodel_dspark(
        dest, models["normed"], samples(runs["dflash"]), [s["hidden_states"] for s in samples(runs["post"])]
    )
    assert m["target_layer_ids"] == TAPS
    refused = {
        ("--draft", "dflash"): "not dflash (Automodel 0.7 trains DFlash online only: its train_dflash recipe reads "
        "no cache); dflash is trained by specforge",
        ("--draft", "dspark", "--prenorm"): "--prenorm does not apply to --to automodel: its trainer reads the final "
        "state post-norm",
        ("--draft", "dspark", "--draft-vocab", "64"): "read no draft-vocab map",
        ("--draft", "dspark", "--taps", "3,1"): "target_layer_ids strictly increasing; --taps [3, 1] are not",
    }
    for i, (args, why) in enumerate(refused.items()):
        assert why in export(runs["dflash"], tmp_path / f"no{i}", "--to", "automodel", *args, code=2)
    assert "this run has none" in export(
        runs["mtp"], tmp_path / "mtp", "--to", "automodel", "--draft", "dspark", code=2
    )
    assert not any((tmp_path / name).exists() for name in ("no0", "no1", "no2", "no3", "mtp"))


def test_speculators_reads_every_draft_type_with_vllm_ids_and_the_exact_pre_norm_state(runs, tmp_path):
    require("speculators")
    from speculators.train.data import ArrowDataset

    src = samples(runs["dflash"])
    for kind in drafts.DRAFT_TYPES:
        dest = tmp_path / kind
        if kind == "mtp":  # a Llama has no MTP head for speculators to fine-tune: refused by name (it exported)
            out = export(runs["dflash"], dest, "--to", "speculators", "--draft", kind, code=2)
            assert "MTP draft fine-tunes the target's own MTP head, for Qwen3-family targets alone" in out
            assert "this run's target is LlamaForCausalLM" in out and not dest.exists()
            continue
        out = export(runs["dflash"], dest, "--to", "speculators", "--draft", kind)
        (train,) = [line.split(None, 1)[1] for line in out.splitlines() if line.startswith("train ")]
        taps = {"eagle3": [1, 3, 4], "peagle": [1, 3, 4]}.get(kind, TAPS)
        assert f"--speculator-type {kind} " in train
        assert train.endswith(" ".join(["--target-layer-ids", *(str(k + 1) for k in taps)]))
        ds = ArrowDataset(max_len=4096, datapath=str(dest), on_missing="raise")
        for i, s in enumerate(src):
            got = ds[i]
            want = (
                s["aux_hidden_states"]
                .view(-1, 5, 64)[:, [TAPS.index(k) for k in taps]]
                .reshape(len(s["input_ids"]), -1)
            )
            assert torch.equal(got["hidden_states"], want) and torch.equal(got["input_ids"], s["input_ids"])
            assert torch.equal(got["verifier_last_hidden_states"], s["hidden_states"])  # stored pre-norm: as is
        assert json.loads((dest / MANIFEST).read_text())["max_norm_error"] is None


def test_modelopt_dflash_reads_the_taps_and_refusals_name_what_cannot_be_fed(runs, tmp_path):
    require("modelopt")
    from modelopt.torch.speculative.eagle.utils import OfflineSupervisedDataset

    dest = tmp_path / "mo"
    out = export(runs["dflash"], dest, "--to", "modelopt", "--draft", "dflash", "--prenorm")
    assert f"dflash_architecture_config: num_hidden_layers: 5, target_layer_ids: {TAPS}" in out
    ds = OfflineSupervisedDataset(sorted(str(p) for p in dest.rglob("*.pt")), answer_only_loss=True)
    for i, s in enumerate(samples(runs["dflash"])):
        got = ds[i]
        assert torch.equal(got["aux_hidden_states"], s["aux_hidden_states"]) and got["base_hidden_prenorm"]
        assert torch.equal(got["base_model_hidden_states"], s["hidden_states"])
    # without --prenorm: the final state after the norm, derived from the pre-norm run, is the post-norm twin's
    export(runs["dflash"], tmp_path / "post", "--to", "modelopt", "--draft", "dflash")
    ds = OfflineSupervisedDataset(sorted(str(p) for p in (tmp_path / "post").rglob("*.pt")), answer_only_loss=True)
    for i, s in enumerate(samples(runs["post"])):
        got = ds[i]
        assert torch.equal(got["aux_hidden_states"], s["aux_hidden_states"]) and not got["base_hidden_prenorm"]
        assert torch.equal(got["base_model_hidden_states"], s["hidden_states"])
    refused = {
        ("specforge", "mtp"): "specforge's trainer takes the draft types eagle3, dflash, dspark, not mtp; mtp is "
        "trained by speculators",
        ("modelopt", "xpress"): "not xpress; xpress is trained by speculators",
    }
    for (to, kind), why in refused.items():
        assert why in export(runs["dflash"], tmp_path / f"{to}-{kind}", "--to", to, "--draft", kind, code=2)
    assert "this run has none" in export(runs["mtp"], tmp_path / "e", "--to", "modelopt", code=2)
    out = export(runs["dflash"], tmp_path / "t", "--to", "speculators", "--draft", "dflash", "--taps", "1,7", code=2)
    assert f"--taps [1, 7]: the run holds taps {TAPS}" in out
    assert not any((tmp_path / name).exists() for name in ("specforge-mtp", "modelopt-xpress", "e", "t"))


# ---------------------------------------------------------------- pre-norm states, exactly


def test_pre_norm_states_are_recovered_exactly_where_eps_is_not_negligible(runs, forward, tmp_path):
    """A float32 run of the quiet model (final states of mean square ~1e-3): the pre-norm state of
    the speculators export and of modelopt --prenorm gives back the stored state to rounding, and has
    transformers' own pre-norm state's length (dividing by the weight alone was off by 3e-3, refused)."""
    require("speculators")
    for to in (("speculators",), ("modelopt", "--prenorm")):
        dest = tmp_path / to[0]
        export(runs["quiet"], dest, "--to", *to)
        assert json.loads((dest / MANIFEST).read_text())["max_norm_error"] < 1e-6
    for i, s in enumerate(samples(runs["quiet"])[:6]):
        ref = forward("quiet", s["input_ids"])
        assert float(ref["pre"].pow(2).mean()) < 3e-3  # where the old conversion was off by eps / (2m)
        pre = load_file(tmp_path / "speculators" / "hidden_states" / f"hs_{i}.safetensors")["hidden_states"][:, -1]
        assert torch.allclose(pre, ref["pre"], rtol=1e-3, atol=1e-6)


def test_a_failed_norm_check_says_what_it_measured_and_the_likely_causes_in_order(runs, models):
    norm = load_final_norm(models["normed"], 64)
    post = samples(runs["post"])[0]["hidden_states"]
    pre = prenorm_from_post(norm, post)
    limit = TOLERANCE["float32"]
    other = type(norm)(norm.file, norm.tensor, norm.eps)  # the same tensor, another weight below
    object.__setattr__(other, "weight", norm.weight.roll(1))  # channels differ: the direction does too
    said = diagnose(other, pre, post, limit, "/m")
    assert said.startswith("measured: token ") and "cosine" in said and "0 tokens hold NaN or inf" in said
    assert said.index("(1) the final norm read from /m") < said.index("its weights differ")
    scaled = type(norm)(norm.file, norm.tensor, 10.0)  # the direction holds, the length does not
    said = diagnose(scaled, pre, post, limit, "/m")
    assert "(1) the model's final norm computes otherwise than the final norm read from /m" in said
    broken = post.clone()
    broken[3, 5] = float("nan")
    said = diagnose(norm, pre, broken, limit, "/m")
    assert "1 tokens hold NaN or inf" in said and "(1) the stored state overflowed" in said


# ---------------------------------------------------------------- EAGLE-3 exports as before


def base_source(tmp: Path) -> Path | None:
    """The hsx this work started from (``BASE``), unpacked from git, or None where history lacks it."""
    repo = Path(__file__).resolve().parents[1]
    have = subprocess.run(["git", "-C", repo, "cat-file", "-e", f"{BASE}^{{commit}}"], capture_output=True)
    if have.returncode:
        return None
    archive = subprocess.run(["git", "-C", repo, "archive", BASE, "src"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
    return tmp / "src"


def test_an_eagle3_run_exports_for_eagle3_as_the_hsx_before_draft_types_did(runs, tmp_path):
    """A default (EAGLE-3) run made now, exported by this hsx and by the one before draft types, for
    each trainer: every file the same bytes, but the pre-norm final state speculators reads, now
    recovered with its length (it differs from the old one by the eps term only), and the progress
    log that records those files' digests."""
    old = base_source(tmp_path)
    if old is None:
        pytest.skip(f"this checkout's history does not hold {BASE}")
    run = runs["eagle3"]
    trainers = ("specforge", "speculators", "modelopt")
    script = "; ".join(
        ["from pathlib import Path", "from hsx.export import ExportOptions, run_export"]
        + [
            f"run_export(ExportOptions(Path({str(run)!r}), Path({str(tmp_path / 'old' / t)!r}), {t!r}))"
            for t in trainers
        ]
    )
    env = os.environ | {"PYTHONPATH": str(old), "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True)
    for t in trainers:
        export(run, tmp_path / "new" / t, "--to", t)
        new, before = (
            {
                p.relative_to(d).as_posix(): p.read_bytes()
                for p in sorted(d.rglob("*"))
                if p.is_file() and p.name != MANIFEST
            }
            for d in (tmp_path / "new" / t, tmp_path / "old" / t)
        )
        assert new.keys() == before.keys() and len(new) > 24
        for name in new:
            if name == ".hsx-export-progress.jsonl":
                if t == "speculators":
                    continue  # it lists the digests of the files below
                # each entry now also keeps the export's norm error so far (a rerun reports it): the
                # same entries, files and digests besides it
                entries = [[json.loads(line) for line in d[name].splitlines()] for d in (new, before)]
                assert [e.pop("norm_error") for e in entries[0]] and entries[0] == entries[1], (t, name)
                continue
            if t == "speculators" and name.startswith("hidden_states/"):
                a, b = load_file(tmp_path / "new" / t / name), load_file(tmp_path / "old" / t / name)
                assert torch.equal(a["token_ids"], b["token_ids"])
                assert torch.equal(a["hidden_states"][:, :-1], b["hidden_states"][:, :-1])  # the taps
                cos = torch.nn.functional.cosine_similarity(
                    a["hidden_states"][:, -1], b["hidden_states"][:, -1], dim=-1
                )
                assert float(cos.min()) > 1 - 1e-6  # the same direction, another length
            else:
                assert new[name] == before[name], (t, name)


# ---------------------------------------------------------------- training in the trainers' own loops


def speculators_train(command: str, save: Path, *extra: str) -> tuple[list[dict], dict]:
    """Run ``speculators train`` as the export printed it, in this process, through speculators' own
    ``main`` (its config, draft builder, data loader and Trainer), for a few steps on CPU; return the
    metrics its Trainer logged (each training step's, and the held-out validation's).

    Thin shims for a machine without an accelerator, device placement only: its Trainer puts the model
    and batches on its local rank (a CUDA index: here "cpu"), its loader pins memory (nothing to pin
    for: left as it is), its step timer synchronizes the accelerator (nothing to wait for). Its own
    options do the rest: sdpa attention (FlexAttention has no backward on CPU; MTP's draft is on sdpa
    whatever the flag), eager losses (the fused ones need Triton), float32 states."""
    import logging
    from contextlib import ExitStack
    from unittest import mock

    import speculators.train.cli as cli
    import speculators.train.trainer as trainer
    from speculators.models.eagle3.rotary_partial import uninstall_partial_neox_rotary
    from speculators.train.config import TrainConfig

    args = command.split()[2:]  # after "speculators train"
    args += ["--epochs", "1", "--max-steps", "3", "--total-seq-len", "128", "--save-path", str(save)]
    args += ["--num-workers", "0", "--hidden-states-dtype", "float32", "--train-data-ratio", "0.9", "--seed", "0"]
    args += ["--loss-implementation", "eager", "--no-resume-from-checkpoint"]
    # MTP's draft is built on sdpa by speculators itself, which refuses the flag for it
    args += [] if "--speculator-type mtp" in command else ["--draft-attn-impl", "sdpa"]
    args += extra
    steps, val = [], {}

    class Metrics(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if isinstance(record.msg, dict) and "train" in record.msg:
                steps.append(record.msg)
            elif isinstance(record.msg, dict) and "val" in record.msg:
                val.update(record.msg["val"])

    def setup_metric_logger(*a, **kw):  # its own set-up, then our handler beside its backends
        original(*a, **kw)
        logging.getLogger("speculators.metrics").addHandler(Metrics())

    original = cli.setup_metric_logger
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)  # its root logger set-up is undone after it
    try:
        with ExitStack() as stack:
            for shim in (
                mock.patch.object(trainer, "get_local_rank", lambda: "cpu"),
                mock.patch("torch.utils.data._utils.pin_memory.pin_memory", lambda data, device=None: data),
                mock.patch("torch.accelerator.synchronize", lambda *a, **kw: None),
                mock.patch.object(cli, "setup_metric_logger", setup_metric_logger),
            ):
                stack.enter_context(shim)
            cli.main(TrainConfig.resolve(args))
    finally:
        root.setLevel(level)
        root.handlers[:] = handlers
        uninstall_partial_neox_rotary()  # were it installed, transformers' Llama would compute otherwise
    return steps, val


DFLASH_SMALL = ("--block-size", "4", "--max-anchors", "16")  # its block and anchors, cut for CPU time


def test_speculators_trains_every_draft_type_but_mtp_from_one_dflash_run(runs, tmp_path):
    """Each type's printed training command, run by speculators' own trainer: three logged steps each,
    finite losses, and a held-out validation."""
    require("speculators")
    for kind in ("eagle3", "peagle", "dflash", "dflash2", "dspark", "xpress"):
        dest = tmp_path / kind
        out = export(runs["dflash"], dest, "--to", "speculators", "--draft", kind)
        (train,) = [line.split(None, 1)[1] for line in out.splitlines() if line.startswith("train ")]
        extra = () if kind in ("eagle3", "peagle") else DFLASH_SMALL
        steps, val = speculators_train(train, tmp_path / f"save-{kind}", *extra)
        assert [s["global_step"] for s in steps] == [0, 1, 2], kind
        assert all(torch.isfinite(torch.tensor(s["train"]["loss"])) for s in steps), kind
        assert val and torch.isfinite(torch.tensor(val["loss_epoch"])), kind


def test_speculators_fine_tunes_the_targets_own_mtp_head_from_a_run_of_the_final_state_alone(tmp_path):
    """speculators' MTP fine-tunes a target's native MTP head (its ``mtp.*`` weights; Qwen3-family
    targets only): the context target is a Qwen3 with one. A ``--layers mtp`` run's printed command
    trains three logged steps in speculators' own loop, and the draft it saves is the target's head,
    moved by the training. Its draft attends through sdpa (speculators builds it so and refuses
    ``--draft-attn-impl`` for it): the FlexAttention it names as that flag's default, which has no
    backward on CPU, is not used."""
    require("speculators")
    data = write_jsonl(tmp_path / "convs.jsonl", rule_conversations(16, seed=1))
    run = tmp_path / "run"
    hsx("extract", "--model", CONTEXT_TARGET, "--data", data, "--out", run, "--layers", "mtp", *RUN_ARGS)
    out = export(run, tmp_path / "export", "--to", "speculators", "--draft", "mtp")
    (train,) = [line.split(None, 1)[1] for line in out.splitlines() if line.startswith("train ")]
    assert "--target-layer-ids" not in train  # it reads the final state alone
    steps, val = speculators_train(train, tmp_path / "save")
    assert [s["global_step"] for s in steps] == [0, 1, 2]
    losses = torch.tensor([[s["train"][f"loss_step_{k}"] for k in range(3)] for s in steps])  # its 3 steps ahead
    assert torch.isfinite(losses).all() and torch.isfinite(torch.tensor(val["loss_step_0_epoch"]))
    head = {k.removeprefix("mtp.layers.0."): v for k, v in load_file(CONTEXT_TARGET / "model.safetensors").items()}
    head["input_proj.weight"] = head["mtp.fc.weight"]  # its input projection; the decoder layer keeps its names
    saved = {
        k.removeprefix("mtp_layers.0."): v for k, v in load_file(tmp_path / "save" / "0" / "model.safetensors").items()
    }
    layer = [k for k in saved if k in head]
    # saved in bfloat16: the untrained head would be the target's rounded to it
    assert len(layer) == 12 and any(not torch.equal(saved[k], head[k].to(saved[k].dtype)) for k in layer)
    for k in layer:
        torch.testing.assert_close(saved[k].float(), head[k], atol=0.01, rtol=0)


def specforge_train(line: str, out: Path, monkeypatch, capsys, draft: dict | None = None) -> list[dict]:
    """``specforge train -c CONFIG`` as the export printed it, in this process, through SpecForge's own
    command (its config, launch plan, model assembly, DDP backend over gloo and trainer) on CPU, for
    three steps; the steps it printed. No shim: SpecForge runs on CPU where told (SPECFORGE_DEVICE),
    with its own replicated (NO_SHARD: DDP) recipe and sdpa attention (FlexAttention has no backward
    on CPU). ``draft``: the draft config a DSpark draft needs (SpecForge makes none for it)."""
    import ast
    import socket

    import specforge.cli

    config = json.loads(line.split(" holding ", 1)[1].split("; DRAFT.json", 1)[0])
    if draft is not None:
        (out.parent / "draft.json").write_text(json.dumps(draft))
        config["model"]["draft_model_config"] = str(out.parent / "draft.json")
    config["training"] |= {"fsdp_sharding": "NO_SHARD", "attention_backend": "sdpa", "max_steps": 3}
    config["training"] |= {"log_interval": 1, "num_anchors": 16, "learning_rate": 1e-3, "seed": 0}
    config |= {"output_dir": str(out), "run_id": "t"}
    (out.parent / "config.yaml").write_text(json.dumps(config))
    with socket.socket() as s:  # its one-process rendezvous, set here so that the test's environment is restored
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for key, value in (env | {"SPECFORGE_DEVICE": "cpu", "FSDP_SHARDING": ""}).items():
        monkeypatch.setenv(key, value)
    capsys.readouterr()
    assert specforge.cli.main(["train", "-c", str(out.parent / "config.yaml")]) == 0
    printed = capsys.readouterr().out.splitlines()
    return [ast.literal_eval(line.split(": ", 1)[1]) for line in printed if line.startswith("step ")]


def test_specforge_trains_dflash_and_dspark_from_the_dflash_run(runs, models, tmp_path, monkeypatch, capsys):
    """SpecForge's own ``specforge train`` on the exports, as their train lines say: three logged steps
    with finite losses. (Its EAGLE-3 objective imports Triton, which a CPU machine has not: that pair
    is checked by its reader, test_export.)"""
    require("specforge")
    base = json.loads((models["normed"] / "config.json").read_text())
    dspark = base | {"architectures": ["DSparkDraftModel"], "num_hidden_layers": 5, "num_target_layers": N}
    dspark |= {"block_size": 4, "layer_types": ["full_attention"] * 5, "sliding_window": None}
    dspark |= {"use_sliding_window": False, "dflash_config": {"target_layer_ids": TAPS}}
    dspark |= {"dspark_config": {"markov_rank": 16}}
    for kind, draft in (("dflash", None), ("dspark", dspark)):
        (tmp_path / kind).mkdir()
        out = export(runs["dflash"], tmp_path / kind / "export", "--to", "specforge", "--draft", kind)
        (line,) = [x.split(None, 1)[1] for x in out.splitlines() if x.startswith("train ")]
        assert (kind == "dspark") == ("DRAFT.json: a dspark draft config" in line)
        steps = specforge_train(line, tmp_path / kind / "out", monkeypatch, capsys, draft)
        assert len(steps) == 3 and all(torch.isfinite(torch.tensor(s["loss"])) for s in steps), (kind, steps)


def modelopt_train(export: Path, base: Path, hint: str, out: Path) -> tuple[list[dict], list[int]]:
    """Model-Optimizer's offline training path, in this process, on CPU, for three steps: the base model
    loaded as its offline training loads it (no decoder layers), converted to the draft the export's
    printed config names (``mtsp.convert``), its ``OfflineSupervisedDataset`` over the export's files
    with its answer-only loss mask, its ``EagleOfflineDataCollator``, and the HF ``Trainer`` its example
    trains with. Returns the Trainer's logged training steps and the taps the draft reads.

    One thin shim, device placement only: its drafts build their rotary embedding with
    ``device=...``, an argument transformers' rotary embeddings no longer take (Model-Optimizer 0.47.0
    declares transformers<5.15); the shim builds it without the argument and moves it to that device.
    Its own options do the rest: a draft of the base's width with a small MLP, torch.compile off
    (CPU), a mask token id (its example takes the tokenizer's; no tokenizer is loaded here)."""
    import re
    from contextlib import ExitStack
    from unittest import mock

    import modelopt.torch.speculative as mtsp
    import modelopt.torch.speculative.plugins.modeling_dflash as dflash_draft
    import modelopt.torch.speculative.plugins.modeling_eagle as eagle_draft
    from modelopt.torch.speculative.config import eagle3_default_config
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
    from modelopt.torch.speculative.utils import load_vlm_or_llm
    from transformers import Trainer, TrainingArguments

    taps = json.loads(re.search(r"(?:eagle_aux_hidden_state_layer_ids|target_layer_ids): (\[[\d, ]*\])", hint)[1])
    small = {"intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
    model = load_vlm_or_llm(str(base), use_offline_training=True, dtype=torch.float32)
    if "eagle config" in hint:
        arch = eagle3_default_config | small | {"eagle_aux_hidden_state_layer_ids": taps, "torch_dtype": "float32"}
        mode = "eagle", {"eagle_offline": True, "eagle_architecture_config": arch, "eagle_use_torch_compile": False}
    else:
        arch = small | {
            "num_hidden_layers": int(re.search(r"num_hidden_layers: (\d+)", hint)[1]),
            "target_layer_ids": taps,
        }
        if "projector_type: dspark, markov_rank: R" in hint:  # the rank the line asks for, chosen here
            arch |= {"projector_type": "dspark", "markov_rank": 16}
        config = {"dflash_offline": True, "dflash_block_size": 4, "dflash_num_anchors": 8, "dflash_mask_token_id": 0}
        mode = "dflash", config | {"dflash_architecture_config": arch}
    mtsp.convert(model, [mode])
    read = getattr(model, "target_layer_ids", None) or model.eagle_config.eagle_aux_hidden_state_layer_ids
    args = TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        max_steps=3,
        logging_steps=1,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        seed=0,
        report_to=[],
        save_strategy="no",
        remove_unused_columns=False,  # its collator's keys are not the model's arguments
        disable_tqdm=True,
    )
    files = sorted(str(p) for p in export.rglob("*.pt"))
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=OfflineSupervisedDataset(files, answer_only_loss=True),
        data_collator=EagleOfflineDataCollator(train_len=64),
    )

    def placed(cls):
        return lambda config, device=None: cls(config=config).to(device)

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(dflash_draft, "_ROTARY_CLS", placed(dflash_draft._ROTARY_CLS)))
        stack.enter_context(
            mock.patch.object(eagle_draft, "LlamaRotaryEmbedding", placed(eagle_draft.LlamaRotaryEmbedding))
        )
        trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h], list(read)


def test_modelopt_trains_eagle3_dflash_and_dspark_from_the_dflash_run(runs, models, tmp_path):
    """Each type's export, trained as its printed config says by Model-Optimizer's own offline
    training path: three logged steps with finite losses, the draft reading the export's taps."""
    require("modelopt")
    for kind, extra in (("eagle3", ()), ("dflash", ("--prenorm",)), ("dspark", ())):
        dest = tmp_path / kind
        out = export(runs["dflash"], dest, "--to", "modelopt", "--draft", kind, *extra)
        (hint,) = [line.split(None, 1)[1] for line in out.splitlines() if line.startswith("train ")]
        steps, read = modelopt_train(dest, models["normed"], hint, tmp_path / f"out-{kind}")
        assert read == ([1, 3, 4] if kind == "eagle3" else TAPS), kind
        assert [s["step"] for s in steps] == [1, 2, 3], (kind, steps)
        assert all(torch.isfinite(torch.tensor(s["loss"])) for s in steps), (kind, steps)
