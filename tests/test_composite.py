"""Composite checkpoints as released (Kimi-K2.5: ``kimi_k25``, a DeepSeek-V3 language model under
``language_model.``, a vision tower and a projector, the repository's code): hsx runs the language
model alone on transformers' own ``DeepseekV3ForCausalLM``, never the repository's code, and never
reads the vision tower's or the projector's weights. References: transformers' native
``DeepseekV3ForCausalLM`` on the language model's weights (``kimi_fixtures``), float32,
``output_hidden_states``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from conftest import conversations, load_states, write_jsonl
from hsx import finalnorm, target
from hsx.capture import checkpoint, default_layers
from hsx.capture.transformers import TransformersBackend
from hsx.extract import ExtractOptions, extract
from hsx.store import layout
from kimi_fixtures import PREFIX, VOCAB, kimi_k25, kimi_k25_int4, language_model_reference
from test_checkpoint import hidden_states  # transformers' own output_hidden_states, float32: the reference

LAYERS = [0, 1]  # of 3 decoder layers; hidden_states[3] is after the final norm
SEQS = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).numpy() for n in (21, 8)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("composite")
    reference = language_model_reference(root / "reference")
    kimi_k25(reference, root / "kimi-bf16", torch.bfloat16)
    kimi_k25(reference, root / "kimi-float32", torch.float32)
    kimi_k25_int4(reference, root / "kimi-int4", root / "int4-reference")
    kimi_k25(root / "int4-reference", root / "kimi-int4-float32", torch.float32)  # the same, dequantized
    return {p.name: p for p in root.iterdir()}


def assert_states(batch, refs, atol=1e-5):
    for i, ref in enumerate(refs):
        aux, final = batch.sample(i)
        for j, k in enumerate(LAYERS):
            assert (aux[:, j * 64 : (j + 1) * 64] - ref[k + 1]).abs().max().item() <= atol, (i, k)
        assert (final - ref[-1]).abs().max().item() <= atol, i


class ReadSpy:
    """Records which safetensors keys transformers materializes: it opens every file and takes a
    lazy slice of every key; the bytes are read only when a slice is indexed."""

    def __init__(self, monkeypatch):
        import transformers.modeling_utils as mu

        self.read: set[str] = set()
        self.sliced: set[str] = set()
        original = mu.safe_open
        spy = self

        class Slice:
            def __init__(self, key, inner):
                self.key, self.inner = key, inner

            def __getitem__(self, item):
                spy.read.add(self.key)
                return self.inner[item]

            def __getattr__(self, name):
                return getattr(self.inner, name)

        class File:
            def __init__(self, *a, **kw):
                self.inner = original(*a, **kw)

            def get_slice(self, key):
                spy.sliced.add(key)
                return Slice(key, self.inner.get_slice(key))

            def __getattr__(self, name):
                return getattr(self.inner, name)

        monkeypatch.setattr(mu, "safe_open", File)


@pytest.mark.parametrize("stored", ["kimi-bf16", "kimi-float32"])
def test_kimi_k25_runs_its_language_model_only_on_transformers_deepseek_v3(models, stored, monkeypatch, caplog):
    from transformers import AutoModelForCausalLM, DeepseekV3ForCausalLM

    with pytest.raises(RuntimeError, match="repository modeling code ran"):  # the trap is armed
        AutoModelForCausalLM.from_pretrained(models[stored], trust_remote_code=True)
    native = DeepseekV3ForCausalLM.from_pretrained(models["reference"], dtype=torch.float32)
    refs = hidden_states(models["reference"], SEQS)
    spy = ReadSpy(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="hsx.checkpoint"):
        backend = TransformersBackend.load(models[stored], LAYERS, "float32", "cpu", trust_remote_code=True)
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "language model of kimi_k25 on transformers' DeepseekV3ForCausalLM" in said, said
    assert "mm_projector, vision_tower not loaded" in said and "modeling_kimi_k25.py" in said
    assert type(backend.model) is DeepseekV3ForCausalLM
    # the model is the language model alone: the native model's parameters, nothing more
    assert dict(backend.model.state_dict()).keys() == dict(native.state_dict()).keys()
    assert not any(("vision" in n or "mm_projector" in n) for n, _ in backend.model.named_parameters())
    # every key of the checkpoint was seen, only the language model's were read
    index = json.loads((models[stored] / "model.safetensors.index.json").read_text())["weight_map"]
    assert spy.sliced == set(index)
    assert spy.read == {k for k in index if k.startswith(PREFIX)}
    assert_states(backend.capture([0, 1], SEQS), refs)


def test_language_model_of_the_composite_its_config_layers_and_final_norm(models):
    lm = target.LanguageModel.of(models["kimi-int4"])
    assert (lm.composite, lm.prefix, lm.architecture) == ("kimi_k25", PREFIX, "DeepseekV3ForCausalLM")
    assert lm.other_parts == ["mm_projector", "vision_tower"]
    assert lm.quantization["format"] == "pack-quantized"  # found inside text_config
    assert "quantization_config" not in json.loads((models["kimi-int4"] / "config.json").read_text())
    identity = target.identity("kimi", models["kimi-int4"])
    assert (identity.architecture, identity.num_layers, identity.hidden_size) == ("DeepseekV3ForCausalLM", 3, 64)
    assert identity.quantization.method == "compressed-tensors"
    assert identity.quantization.config["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert default_layers(identity.num_layers) == default_layers(3)
    norm = finalnorm.locate(models["kimi-bf16"])
    assert norm.tensor == "language_model.model.norm.weight"
    reference = finalnorm.locate(models["reference"]).weight
    assert torch.equal(norm.weight, reference)
    # a plain checkpoint is its own language model
    plain = target.LanguageModel.of(models["reference"])
    assert (plain.composite, plain.prefix, plain.quantization) == (None, "", None)


def test_fingerprint_covers_the_packed_experts_and_their_scales(models, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from hsx.fingerprint import model_fingerprint

    path = tmp_path / "int4"
    shutil.copytree(models["kimi-int4"], path)
    before = model_fingerprint(path)
    shard = next(w for w in before.weights if w.scales is not None)
    file = path / shard.name
    tensors = load_file(file)
    name = next(k for k in tensors if k.endswith("mlp.experts.1.down_proj.weight_scale"))
    tensors[name] = tensors[name] * 2  # one expert's weights doubled
    save_file(tensors, file, metadata={"format": "pt"})
    assert f"{shard.name}: quantization scales differ" in before.differences(model_fingerprint(path))


def states(backend, seqs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batch = backend.capture(list(range(len(seqs))), seqs)
    return [tuple(t.clone() for t in batch.sample(i)) for i in range(len(seqs))]


def test_kimi_k25_int4_runs_with_its_experts_packed_as_its_dequantized_model(models, monkeypatch, caplog):
    """The INT4 composite as released (quantization config inside text_config only, vision weights
    beside the language model) runs on transformers' DeepseekV3ForCausalLM with its routed experts
    held as stored (int32 packed values + bf16 scales, expanded per layer); the vision tower is never
    read. Float32 states: transformers' native model on the dequantized weights within 1e-5, and
    hsx's run of the same composite fully dequantized in float32 bit for bit."""
    from safetensors.torch import load_file
    from transformers import DeepseekV3ForCausalLM

    from hsx.capture.quantized import experts as jit

    spy = ReadSpy(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="hsx.checkpoint"):
        backend = TransformersBackend.load(models["kimi-int4"], LAYERS, "float32", "cpu", trust_remote_code=True)
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "language model of kimi_k25 on transformers' DeepseekV3ForCausalLM" in said, said
    assert "mm_projector, vision_tower not loaded" in said
    assert "routed experts held as int4-packed, expanded per layer to float32" in said, said
    assert type(backend.model) is DeepseekV3ForCausalLM
    # transformers read the language model's other weights only: no expert, no vision tower, no projector
    assert spy.read and all(k.startswith(PREFIX) and ".mlp.experts." not in k for k in spy.read)
    assert not any(("vision" in n or "mm_projector" in n) for n, _ in backend.model.named_parameters())
    assert not any(("vision" in n or "mm_projector" in n) for n, _ in backend.model.named_buffers())
    # the routed experts are held as stored: the checkpoint's packed values and scales, no dense weights
    held = dict(jit.stored_modules(backend.model))
    assert sorted(held) == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    stored = {}
    for shard in sorted(models["kimi-int4"].glob("*.safetensors")):
        stored |= load_file(shard)
    for name, m in held.items():
        assert not list(m.parameters(recurse=False)), "no dense expert parameters"
        assert m.gate_up_proj__weight_packed.dtype == torch.int32 and m.down_proj__weight_scale.dtype == torch.bfloat16
        for e in range(4):
            key = f"{PREFIX}{name}.{e}"
            gate_up = torch.cat([stored[f"{key}.gate_proj.weight_packed"], stored[f"{key}.up_proj.weight_packed"]])
            assert torch.equal(m.gate_up_proj__weight_packed[e], gate_up)
            assert torch.equal(m.down_proj__weight_packed[e], stored[f"{key}.down_proj.weight_packed"])
            assert torch.equal(m.down_proj__weight_scale[e], stored[f"{key}.down_proj.weight_scale"])
    got = states(backend, SEQS)
    refs = hidden_states(models["int4-reference"], SEQS)
    for (aux, final), ref in zip(got, refs, strict=True):
        for j, k in enumerate(LAYERS):
            assert (aux[:, j * 64 : (j + 1) * 64] - ref[k + 1]).abs().max().item() <= 1e-5, k
        assert (final - ref[-1]).abs().max().item() <= 1e-5
    plain = TransformersBackend.load(models["kimi-int4-float32"], LAYERS, "float32", "cpu", trust_remote_code=True)
    assert not dict(jit.stored_modules(plain.model))
    for (a, f), (ra, rf) in zip(got, states(plain, SEQS), strict=True):
        assert torch.equal(a, ra) and torch.equal(f, rf)
    # the spec: the quantization found in text_config, the experts as hsx holds them
    quantization = target.identity("kimi", models["kimi-int4"]).quantization
    assert quantization.method == "compressed-tensors" and quantization.experts == "int4-packed group 32"


def test_kimi_k25_extracts_end_to_end_text_rows_only(models, tmp_path, caplog):
    """hsx extract on the composite as downloaded, with --trust-remote-code (the tokenizer's
    opt-in): the spec names what ran, rows with image content are rejected with their reason, and
    the files hold the reference's states."""
    rows = conversations(3)
    image_url = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    rows.append(
        {"id": "pic", "messages": [{"role": "user", "content": [image_url]}, {"role": "assistant", "content": "a cat"}]}
    )
    rows.append(
        {
            "id": "llava",
            "image": "cat.jpg",
            "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "a cat"}],
        }
    )
    data = write_jsonl(tmp_path / "convs.jsonl", rows)
    out, logged = tmp_path / "run", []
    opts = ExtractOptions(
        out=out,
        model=str(models["kimi-bf16"]),
        data=[data],
        device="cpu",
        shard_size=4,
        trust_remote_code=True,
        writers=1,
    )
    with caplog.at_level(logging.WARNING, logger="hsx.checkpoint"):
        assert extract(opts, log=logged.append).complete
    assert "language model of kimi_k25 on transformers' DeepseekV3ForCausalLM" in caplog.text
    # the memory of the layout was worked out (from the language model's headers) before loading
    assert "memory per GPU for TP1, float32 (safetensors headers):" in logged, logged
    spec = json.loads((out / layout.SPEC).read_text())
    assert spec["model"]["architecture"] == "DeepseekV3ForCausalLM" and spec["model"]["num_layers"] == 3
    assert spec["layers"] == default_layers(3) and spec["model"]["quantization"] is None
    rejects = [json.loads(line) for line in (out / layout.REJECTS).read_text().splitlines()]
    assert {r["id"]: r["reason"] for r in rejects} == {
        "pic": "turn 0: non-text content part (image_url): image content; hsx extracts text conversations only "
        "(multimodal extraction is not supported yet)",
        "llava": "image content ('image' field); hsx extracts text conversations only "
        "(multimodal extraction is not supported yet)",
    }
    # hsx status checks the capture against the language model's architecture, which transformers has
    from hsx.assess.model import check_capture
    from hsx.spec import load_spec

    check = check_capture(load_spec(out), models["kimi-bf16"])
    assert (check.level, check.data["num_layers"]) == ("ok", 3), check
    assert "(DeepseekV3ForCausalLM)" in check.figure

    files = [load_states(layout.sample_path(out, i, 4)) for i in range(3)]
    refs = hidden_states(models["reference"], [f["input_ids"] for f in files])
    layers = spec["layers"]
    for f, ref in zip(files, refs, strict=True):
        for j, k in enumerate(layers):
            assert (f["aux_hidden_states"][:, j * 64 : (j + 1) * 64] - ref[k + 1]).abs().max() <= 1e-5
        assert (f["hidden_states"] - ref[-1]).abs().max() <= 1e-5


def test_load_plan_maps_the_language_model_prefix(models):
    p = checkpoint.plan(models["kimi-bf16"], "cpu", "float32")
    assert p.key_mapping == {"^language_model\\.": ""}
    assert type(p.config).__name__ == "DeepseekV3Config" and not hasattr(p.config, "auto_map")
    assert checkpoint.plan(models["reference"], "cpu").kwargs() == {}
