"""Every architecture of docs/targets.md, tiny and random, laid out as released (the config class's
own defaults, which transformers sets to the released checkpoint's values, reduced in size; the
real layer types kept), captured by hsx in float32 and compared with transformers' own forward of
each sample alone (``output_hidden_states``): every tap and the final state, padded (the layout
``--packing auto`` picks on CPU) and packed where the table says packed (the one it picks on
CUDA), both forced. The table in docs/targets.md is read here: an architecture it lists as
supported that stops matching its reference fails, and one it lists as refused must be refused
by name. Then each defect the issue found, through the real command line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import conversations, hsx, load_states, save_tiny, write_jsonl
from hsx.capture.transformers import TransformersBackend
from hsx.store import layout

DOC = Path(__file__).parents[1] / "docs" / "targets.md"
VOCAB = 2048  # the bundled tokenizer's, so that the CLI tests run these models too
LENGTHS = (23, 9, 16)
RTOL = 1e-4
NEAR_TIE_SHARE = 0.2  # MoE: at most this share of tokens beyond tolerance (router near-ties)


def table() -> dict[str, dict[str, str]]:
    """docs/targets.md's table: model type -> its columns."""
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| `")]
    head = next(line for line in DOC.read_text().splitlines() if line.startswith("| model type"))
    names = [c.strip() for c in head.strip("|").split("|")]
    out = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        out[cells[0].strip("`")] = dict(zip(names, cells, strict=True))
    return out


SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    head_dim=16,
    max_position_embeddings=512,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_group=1,
    topk_group=1,
    # index_n_heads: the release's (64 or 32). With 2, most indexer scores are ReLU's exact zeros, and
    # transformers' top-k breaks those ties by the row's length: padding then changes a token's blocks.
    index_head_dim=16,
    index_topk=6,  # fewer than a sample's tokens: the sparse selection matters
    index_kpool=2,  # GLM-5-next: top-k picked in pools of this many
    sliding_window=6,  # so do windows
    first_k_dense_replace=1,
    num_experts_per_tok=2,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_heads=4,
    linear_head_dim=16,
    o_lora_rank=16,
    o_groups=2,
    shared_expert_intermediate_size=32,
)
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64)
EXPERTS = ("n_routed_experts", "num_experts", "num_local_experts")
LAYER_LISTS = ("layer_types", "mlp_layer_types")


def tiny_config(model_type: str, layers: int = 4):
    """The config class's defaults (its released values), sized down, its layer types the release's first ones."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    text = base.get_text_config()
    small = {k: v for k, v in SMALL.items() if getattr(text, k, 0) != 0}  # 0: a part the release has not
    if hasattr(text, "num_key_value_heads"):
        small["num_key_value_heads"] = min(int(text.num_key_value_heads or 4), 2)
    for k in EXPERTS:
        if getattr(text, k, None):
            small[k] = 4
    if (getattr(text, "pad_token_id", None) or 0) >= VOCAB:
        small["pad_token_id"] = 0
    kinds = getattr(text, "layer_types", None)
    if isinstance(kinds, list):  # enough layers for every kind of the release's to be among them
        layers = max(layers, next(n for n in range(1, len(kinds) + 1) if set(kinds[:n]) == set(kinds)))
    field = "num_layers" if model_type == "longcat_flash" else "num_hidden_layers"
    small[field] = layers
    for k in LAYER_LISTS:
        if isinstance(getattr(text, k, None), list):
            small[k] = list(getattr(text, k)[:layers])
    if hasattr(text, "qk_nope_head_dim"):  # multi-head latent attention: head_dim is the rotary part
        if "qk_rope_head_dim" in small:
            small["head_dim"] = small["qk_rope_head_dim"]
        small["num_key_value_heads"] = small["num_attention_heads"]  # no grouped kv heads
    if getattr(text, "full_attention_interval", None):
        small["full_attention_interval"] = 2
    if text is base:
        return AutoConfig.for_model(model_type, **small)
    vision = base.vision_config.to_dict() | VISION  # a vision tower of one small block, never run here
    return AutoConfig.for_model(model_type, text_config=text.to_dict() | small, vision_config=vision)


def reference(model, seqs) -> list[list[torch.Tensor]]:
    """transformers' own forward of each sample alone: every hidden state, and the LM head's input."""
    out = []
    for s in seqs:
        with torch.no_grad():
            got = model(torch.as_tensor(s)[None].long(), output_hidden_states=True)
        out.append([h[0] for h in got.hidden_states])
    return out


def compare(got: torch.Tensor, want: torch.Tensor, moe: bool, what: str) -> None:
    """float32: within RTOL of the reference's scale; MoE tokens beyond it bounded (near-ties)."""
    got, want = got.double(), want.double()
    bad = ((got - want).abs().amax(-1) > RTOL * want.abs().amax(-1).clamp_min(1e-6)).float()
    share = bad.mean().item()
    assert share <= (NEAR_TIE_SHARE if moe else 0.0), f"{what}: {share:.0%} of tokens beyond {RTOL}"
    if moe:
        keep = bad == 0
        assert torch.allclose(got[keep], want[keep], rtol=RTOL, atol=RTOL * want.abs().max().item()), what


TAPS = [0, 1, 2]  # of 4 or more decoder layers: hidden_states[k + 1] (the last layer's is after the final norm)


def supported() -> list[tuple[str, bool]]:
    """(model type, packed) for every architecture the table says hsx captures with a test here."""
    out = []
    for model_type, row in table().items():
        if "test_targets" not in row["test"] or row["layout"].startswith("refused"):
            continue
        out.append((model_type, False))
        if row["layout"].startswith("packed"):
            out.append((model_type, True))
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each architecture's tiny model, saved once: model type -> (folder, the model)."""
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}
    root = tmp_path_factory.mktemp("targets")

    def get(model_type: str):
        if model_type not in cache:
            from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            config = tiny_config(model_type)
            if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
                path = save_tiny(config, root / model_type)
                model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            else:  # a vision-language release (GLM-5-next): saved whole, its own class the reference
                path = save_tiny(config, root / model_type, whole=AutoModelForImageTextToText)
                model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
            cache[model_type] = (path, model)
        return cache[model_type]

    return get


@pytest.mark.parametrize("model_type,packed", supported())
def test_each_supported_architecture_equals_transformers_per_sample(model_type, packed, built):
    path, model = built(model_type)
    config = model.config.get_text_config()
    moe = any(getattr(config, k, None) for k in EXPERTS)
    seqs = [np.random.default_rng(n).integers(0, VOCAB, n) for n in LENGTHS]
    backend = TransformersBackend.load(path, TAPS, "float32", "cpu", packed=packed)
    batch = backend.capture(list(range(len(seqs))), seqs)
    hidden = int(config.hidden_size)
    divisor = float(getattr(config, "logits_mup_width_multiplier", None) or 1.0)
    for i, ref in enumerate(reference(model, seqs)):
        aux, final = batch.sample(i)
        for j, k in enumerate(TAPS):
            want = ref[k + 1]
            if want.dim() == 3:  # hyper-connection streams (DeepSeek-V4): the tap is their mean
                want = want.mean(dim=-2)
            compare(aux[:, j * hidden : (j + 1) * hidden], want, moe, f"{model_type} sample {i} tap {k}")
        compare(final, ref[-1] / divisor, moe, f"{model_type} sample {i} final state")


# ---------------------------------------------------------------- the defects found, through the real command line


def _extract(model: Path, out: Path, data: Path, *extra: str):
    return hsx("extract", "--model", model, "--data", data, "--out", out, "--device", "cpu", "--dtype", "float32",
               "--layers", "0,1,2", "--shard-size", "4", *extra, check=False)  # fmt: skip


def written(run: Path) -> list[str]:
    """What a start left in its folder besides the run lock it takes first (its guard file)."""
    return sorted(p.name for p in run.iterdir() if p.name != layout.GUARD) if run.exists() else []


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "convs.jsonl", conversations(3))


def _refusal(model: Path, out: Path, data: Path, **given) -> str:
    """What ``hsx extract`` refuses a new run with (in-process: the refusal is the point, not the CLI)."""
    from hsx.errors import Refused
    from hsx.extract import ExtractOptions, extract

    opts = ExtractOptions(out=out, model=str(model), data=[data], device="cpu", dtype="float32", **given)
    with pytest.raises(Refused) as refused:
        extract(opts, log=lambda _: None)
    return " ".join(str(refused.value).split())


def test_sparse_attention_models_refuse_packing_by_name_and_auto_pads_them(built, data, tmp_path):
    """DeepSeek-V3.2's indexer reads the attention mask, which packed rows have none of: --packing on
    crashed on the first batch after the spec was written; now refused before anything is written,
    and --packing auto picks padded rows for it on CUDA too."""
    from hsx.extract.options import resolve_packing
    from hsx.target import load_config

    path, _ = built("deepseek_v32")
    said = _extract(path, tmp_path / "on", data, "--packing", "on")  # the real command line: the defect's own way in
    text = " ".join(said.stderr.split())
    assert said.returncode == 2 and "sparse-attention indexer" in text and "--packing off" in text, said.stderr
    assert written(tmp_path / "on") == []
    notes: list[str] = []
    assert resolve_packing("auto", "cuda", load_config(path), "bfloat16", notes.append) is False
    assert "sparse-attention indexer" in notes[0], notes


@pytest.mark.parametrize("model_type", ["gpt_oss", "deepseek_v4", "longcat_flash", "inkling_text"])
def test_each_defect_found_runs_through_the_command_line(model_type, built, data, tmp_path):
    """gpt-oss and DeepSeek-V4 refused SDPA at load (they run eagerly now); V4's taps came out as its
    4 streams stacked (now their mean); LongCat-Flash's config has no num_hidden_layers (a KeyError;
    its ids count decoder layers); Inkling's final state was 24x its LM head's input. Every file the
    run writes holds transformers' own states of its sample."""
    path, model = built(model_type)
    done = _extract(path, tmp_path / "run", data)
    assert done.returncode == 0, done.stderr
    spec = json.loads((tmp_path / "run" / "hsx.json").read_text())
    layers = len(model.get_decoder().layers)  # LongCat-Flash: its decoder layers, not twice as many sub-layers
    assert spec["model"]["num_layers"] == layers, spec["model"]
    files = sorted((tmp_path / "run" / "shards").rglob("*.safetensors"))
    assert len(files) == 3
    config = model.config.get_text_config()
    hidden, moe = int(config.hidden_size), any(getattr(config, k, None) for k in EXPERTS)
    divisor = float(getattr(config, "logits_mup_width_multiplier", None) or 1.0)
    for f in files:
        states = load_states(f)
        ref = reference(model, [states["input_ids"].numpy()])[0]
        assert states["aux_hidden_states"].shape[-1] == len(TAPS) * hidden
        for j, k in enumerate(TAPS):
            want = ref[k + 1].mean(dim=-2) if ref[k + 1].dim() == 3 else ref[k + 1]
            compare(states["aux_hidden_states"][:, j * hidden : (j + 1) * hidden], want, moe, f"{f.name} tap {k}")
        compare(states["hidden_states"], ref[-1] / divisor, moe, f"{f.name} final state")


def test_a_model_hsx_cannot_load_is_refused_before_anything_is_written(tmp_path, data):
    """A checkpoint transformers has no causal-LM class for, nor a text model of a composite (a
    vision encoder): refused by name before anything is written (GLM-5-next's AutoModelForCausalLM
    failure came after the spec and plan were written)."""
    import shutil

    from transformers import AutoConfig

    from conftest import TINY

    model = tmp_path / "vit"
    AutoConfig.for_model("vit").save_pretrained(model)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY / name, model / name)
    said = _refusal(model, tmp_path / "run", data)
    assert "has no causal-LM class for model type 'vit'" in said, said
    assert written(tmp_path / "run") == []
    (model / "config.json").write_text('{"model_type": "llama", "hidden_size": ')  # cut short
    said = _refusal(model, tmp_path / "cut", data)
    assert f"{model}/config.json: transformers" in said and "cannot read it" in said, said
    assert written(tmp_path / "cut") == []


def test_glm5_next_runs_its_language_model_alone_through_the_command_line(built, data, tmp_path):
    """GLM-5-next: transformers has no causal-LM class for it (AutoModelForCausalLM failed after the
    spec was written); hsx runs its text model with its head, never loading the vision tower."""
    path, _ = built("glm5_next")
    done = _extract(path, tmp_path / "run", data)
    assert done.returncode == 0, done.stderr
    assert "UNEXPECTED" not in done.stderr, done.stderr  # the vision tower's weights are left unread, unreported
    assert len(list((tmp_path / "run" / "shards").rglob("*.safetensors"))) == 3


def test_the_spec_records_each_models_own_conventions(built):
    """DeepSeek-V4's taps (the mean over its streams), LongCat-Flash's ids (decoder layers) and
    Inkling's final state (the LM head's input) are recorded where a run's spec says what it holds."""
    from hsx.extract.pipeline import final_state
    from hsx.store.format import FINAL_STATE, LAYER_CONVENTION, final_norm_of
    from hsx.target import layer_convention, load_config

    v4 = layer_convention(load_config(built("deepseek_v4")[0]))
    assert v4.startswith(LAYER_CONVENTION) and "mean over the layer output's 4 hyper-connection streams" in v4
    longcat = layer_convention(load_config(built("longcat_flash")[0]))
    assert "k counts decoder layers (num_layers)" in longcat
    assert layer_convention(load_config(built("gpt_oss")[0])) == LAYER_CONVENTION
    label = final_state(built("inkling_text")[0], "post")
    assert label == f"{FINAL_STATE}, divided by logits_mup_width_multiplier 24: the LM head's input"
    assert final_norm_of({"final_state": label}) == "post"


def test_inklings_final_state_is_its_lm_heads_input_for_the_fidelity_check_and_exports(built):
    """Inkling divides the normed state by logits_mup_width_multiplier before its head: the state
    hsx stores, put through the head the fidelity check uses, gives the model's own logits, and the
    norm exports derive it with (read from the checkpoint) gives it from the pre-norm state."""
    from hsx.finalnorm import locate

    path, model = built("inkling_text")
    seqs = [np.random.default_rng(5).integers(0, VOCAB, 12)]
    post = TransformersBackend.load(path, [], "float32", "cpu")
    pre = TransformersBackend.load(path, [], "float32", "cpu", prenorm=True)
    final, prenorm = post.capture([0], seqs).sample(0)[1], pre.capture([0], seqs).sample(0)[1]
    with torch.inference_mode():
        logits = model(torch.as_tensor(seqs[0])[None].long()).logits[0]
        torch.testing.assert_close(post.head.lm_head(final), logits, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pre.head.lm_head(pre.head.norm(prenorm)), logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(locate(path).apply(prenorm), final, rtol=1e-5, atol=1e-6)
