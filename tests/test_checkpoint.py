"""Released checkpoints as users download them (hsx.capture.checkpoint): a fine-grained FP8
checkpoint (block-quantized float8_e4m3fn weights and a float32 ``weight_scale_inv`` per 128x128
block, as DeepSeek-V3 and Kimi-K2 are released) and a Kimi-K2-style config (model type kimi_k2,
architecture DeepseekV3ForCausalLM, ``auto_map`` to the repository's own code).

Every fixture is a tiny DeepSeek-V3 (MLA, routed + shared experts) the tests build and quantize
themselves. Hidden size 256, so the 128x128 blocks are real, and the q/kv LoRA ranks give weights
of 1.5 blocks (as DeepSeek-V3's ``kv_a_proj_with_mqa``, 576 rows, is 4.5): the references are the
same model with the weights dequantized here, block by block, and run by transformers unquantized.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import TINY, conversations, load_states, save_random, write_jsonl
from hsx import target
from hsx.capture import checkpoint
from hsx.capture.quantized import fp8
from hsx.capture.transformers import TransformersBackend
from hsx.errors import UnsupportedModel
from hsx.extract import ExtractOptions, extract
from hsx.fingerprint import WeightFile, model_fingerprint
from hsx.spec import ModelIdentity, differences
from hsx.store import layout

BLOCK = 128
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
VOCAB = 2048  # the bundled tokenizer's, so that hsx extract can run on these folders
LAYERS = [0, 1]  # hidden_states[3] of 3 layers is after the final norm: the final state


def tiny_deepseek(path: Path) -> Path:
    """A random tiny DeepSeek-V3 in float32, saved as transformers saves it (per-expert weights)."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=384,
        moe_intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=128,
        q_lora_rank=192,  # q_a_proj: 192 rows, q_b_proj: 192 columns (1.5 blocks)
        qk_rope_head_dim=64,  # kv_a_proj_with_mqa: 128 + 64 = 192 rows
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_group=1,
        topk_group=1,
    )
    return save_random(config, path)


def _quantized(name: str, t: torch.Tensor) -> bool:
    """The weights DeepSeek's release stores in FP8: every linear layer's, but the router's."""
    return t.ndim == 2 and (".self_attn." in name or ".mlp." in name) and not name.endswith("mlp.gate.weight")


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn values and the float32 scale of each 128x128 block (the last ones partial)."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            part = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK].float()
            s[i, j] = part.abs().max().clamp(min=1e-12) / 448.0
            q[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = (part / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def dequantize_reference(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The weight a block-quantized checkpoint stands for, one block at a time."""
    w = torch.empty(q.shape, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            w[rows, cols] = q[rows, cols].float() * s[i, j]
    return w


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config, indent=2))


def fp8_checkpoint(source: Path, fp8: Path, reference: Path) -> None:
    """``fp8``: ``source`` as DeepSeek releases it (FP8 weights + scales, the rest bfloat16);
    ``reference``: the same weights dequantized here, unquantized in float32."""
    tensors = load_file(source / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        if _quantized(name, t):
            q, s = quantize_blocks(t)
            quantized[name], quantized[name.removesuffix("weight") + "weight_scale_inv"] = q, s
            dequantized[name] = dequantize_reference(q, s)
        else:
            quantized[name] = t.to(torch.bfloat16)
            dequantized[name] = quantized[name].float()
    for folder, weights in ((fp8, quantized), (reference, dequantized)):
        shutil.copytree(source, folder)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    _edit_config(fp8, quantization_config=FP8_CONFIG, dtype="bfloat16")


def kimi_style(path: Path) -> None:
    """Edit a saved DeepSeek-V3 folder into Kimi-K2's shape: a model type transformers does not
    know, and an auto_map to the repository's code, whose modeling file raises if it is imported."""
    _edit_config(
        path,
        model_type="kimi_k2",
        architectures=["DeepseekV3ForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_kimi_k2.KimiK2Config",
            "AutoModel": "modeling_kimi_k2.KimiK2Model",
            "AutoModelForCausalLM": "modeling_kimi_k2.KimiK2ForCausalLM",
        },
    )
    (path / "configuration_kimi_k2.py").write_text(
        "from transformers import DeepseekV3Config\n\n\n"
        "class KimiK2Config(DeepseekV3Config):\n    model_type = 'kimi_k2'\n"
    )
    (path / "modeling_kimi_k2.py").write_text("raise RuntimeError('the repository modeling code ran')\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY / name, path / name)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    plain = tiny_deepseek(root / "plain")
    fp8_checkpoint(plain, root / "fp8", root / "reference")
    shutil.copytree(plain, root / "kimi")
    kimi_style(root / "kimi")
    shutil.copytree(root / "fp8", root / "kimi-fp8")
    kimi_style(root / "kimi-fp8")
    return {p.name: p for p in root.iterdir()}


def hidden_states(model_dir: Path, seqs, **kw) -> list[list[torch.Tensor]]:
    """transformers' own output_hidden_states of each sequence, one at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw).eval()
    with torch.no_grad():
        return [
            [h[0] for h in model(torch.as_tensor(s)[None].long(), output_hidden_states=True).hidden_states]
            for s in seqs
        ]


def assert_states(batch, refs, atol=1e-5):
    for i, ref in enumerate(refs):
        aux, final = batch.sample(i)
        for j, k in enumerate(LAYERS):
            got = aux[:, j * 256 : (j + 1) * 256]
            assert (got - ref[k + 1]).abs().max().item() <= atol, (i, k)
        assert (final - ref[-1]).abs().max().item() <= atol, i


SEQS = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).numpy() for n in (23, 9)]


# ---------------------------------------------------------------- fine-grained FP8


def test_fp8_checkpoint_on_cpu_is_dequantized_exactly_and_captured_as_transformers_computes(models, caplog):
    with caplog.at_level(logging.WARNING, logger="hsx.checkpoint"):
        backend = TransformersBackend.load(models["fp8"], LAYERS, "float32", "cpu")
    notes = " | ".join(r.getMessage() for r in caplog.records)
    assert "dequantize=True" in notes and "not whole 128x128 blocks" in notes, notes
    model = backend.model
    assert all(p.dtype == torch.float32 for p in model.parameters())  # no FP8 layer left for the CPU
    # the weights are the checkpoint's values times their own block's scale, partial blocks included
    with safe_open(models["fp8"] / "model.safetensors", "pt") as f:
        for name in ("self_attn.kv_a_proj_with_mqa", "self_attn.q_b_proj", "mlp.down_proj"):
            key = f"model.layers.0.{name}.weight"
            want = dequantize_reference(f.get_tensor(key), f.get_tensor(key + "_scale_inv"))
            assert torch.equal(model.get_parameter(key), want), name
    batch = backend.capture([0, 1], SEQS)
    # hsx's capture = the same loaded model's own output_hidden_states
    with torch.no_grad():
        same = [
            [h[0] for h in model(torch.as_tensor(s)[None].long(), output_hidden_states=True).hidden_states]
            for s in SEQS
        ]
    assert_states(batch, same)
    # = the model with the weights dequantized here, run unquantized (an independent reference)
    assert_states(batch, hidden_states(models["reference"], SEQS))
    # and FP8 is really what ran: the original float32 weights give other states
    original = hidden_states(models["plain"], SEQS)
    assert (batch.sample(0)[1] - original[0][-1]).abs().max().item() > 1e-3


def test_fp8_plan_dequantizes_off_cuda_only_as_asked(models):
    p = checkpoint.plan(models["fp8"], "cpu", "float32")
    assert p.dequantize and p.exact_blocks and p.config is None
    assert p.quantization_config.dequantize is True
    assert p.quantization_config.weight_block_size == [128, 128]  # the checkpoint's settings kept
    assert set(p.kwargs()) == {"quantization_config"}
    assert checkpoint.plan(models["plain"], "cpu").kwargs() == {}  # an ordinary checkpoint: nothing added
    assert "no block-scaled FP8 GEMM on cpu" in fp8.gemm_blocker("cpu", "bfloat16", [128, 128])


def test_block_dequantization_matches_the_per_block_reference():
    torch.manual_seed(1)
    w = torch.randn(3, 200, 300)  # leading expert dim, partial blocks both ways
    q, s = zip(*(quantize_blocks(e) for e in w), strict=True)
    got = fp8.dequantize_blocks(torch.stack(q), torch.stack(s), (BLOCK, BLOCK), torch.float32)
    for e in range(3):
        assert torch.equal(got[e], dequantize_reference(q[e], s[e]))


def test_unknown_or_unavailable_quantization_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "quantization_config": {"quant_method": "int3-magic"}})
    )
    with pytest.raises(UnsupportedModel, match="int3-magic"):
        checkpoint.plan(tmp_path, "cpu")
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized"}
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qc}))
        with pytest.raises(UnsupportedModel, match="install the compressed-tensors package"):
            checkpoint.plan(tmp_path, "cpu")


# ---------------------------------------------------------------- the spec and the fingerprint


def test_spec_records_the_quantization_and_its_drift_and_old_specs_still_load(models, tmp_path):
    fp8 = target.identity("fp8", models["fp8"])
    assert fp8.quantization.method == "fp8" and fp8.quantization.config["weight_block_size"] == [128, 128]
    plain = target.identity("plain", models["plain"])
    assert plain.quantization is None

    class Stored:  # differences() reads only the model of the stored spec here
        def __init__(self, model):
            self.model = model

    drift = differences(Stored(ModelIdentity.model_validate_json(plain.model_dump_json())), {"model": fp8})
    assert "model: quantization: run has none, asked for fp8 (activation_scheme dynamic" in " ".join(drift)
    assert differences(Stored(ModelIdentity.model_validate_json(fp8.model_dump_json())), {"model": fp8}) == []
    # a spec written before hsx recorded quantization (no key) loads, and that field is not compared
    old = json.loads(plain.model_dump_json())
    del old["quantization"]
    for w in old["fingerprint"]["weights"]:
        del w["scales"]
    loaded = ModelIdentity.model_validate(old)
    assert loaded.quantization is None
    assert not any("quantization" in d for d in differences(Stored(loaded), {"model": fp8}))


def test_fingerprint_hashes_every_scale_tensor_whole(models, tmp_path):
    """The probes sample a few KiB of the data; a changed block scale outside them would pass
    unseen, and changes every weight of its block. Each scale tensor is hashed whole."""
    path = tmp_path / "fp8"
    shutil.copytree(models["fp8"], path)
    file = path / "model.safetensors"
    # as in a released shard, megabytes of data before the scales (safetensors puts float32 first,
    # by name: here the float32 embeddings and head, 4 MiB, then every scale tensor)
    tensors = load_file(file)
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        tensors[name] = tensors[name].float()
    save_file(tensors, file, metadata={"format": "pt"})
    before = model_fingerprint(path)
    assert before.weights[0].scales is not None
    with safe_open(file, "pt") as f:
        names = sorted(n for n in f.keys() if n.endswith("weight_scale_inv"))  # noqa: SIM118
    original = file.read_bytes()
    header_len = int.from_bytes(original[:8], "little")
    header = json.loads(original[8 : 8 + header_len])
    missed = None
    for name in names:  # the first scale the probes miss (most of them)
        start = 8 + header_len + header[name]["data_offsets"][0]
        data = bytearray(original)
        scale = torch.frombuffer(data[start : start + 4], dtype=torch.float32)
        data[start : start + 4] = (2 * scale).numpy().tobytes()  # one block's weights doubled
        file.write_bytes(bytes(data))
        after = model_fingerprint(path)
        if after.weights[0].header == before.weights[0].header:
            missed = name
            break
        file.write_bytes(original)
    assert missed is not None, "every scale fell under a probe"
    assert after.weights[0].scales != before.weights[0].scales
    assert before.differences(after) == ["model.safetensors: quantization scales differ"]
    # fingerprints made before scales were hashed (None) still match
    older = before.model_copy(deep=True)
    older.weights = [WeightFile(name=w.name, size=w.size, header=w.header) for w in older.weights]
    assert older.differences(after) == []
    file.write_bytes(original)
    assert before.differences(model_fingerprint(path)) == []
    assert model_fingerprint(models["plain"]).weights[0].scales is None


# ---------------------------------------------------------------- Kimi-K2-style remote code


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_kimi_k2_config_runs_on_transformers_deepseek_v3_not_the_repository_code(models, trust_remote_code, caplog):
    from transformers import AutoModelForCausalLM

    if trust_remote_code:  # the trap is armed: transformers itself would import the repository's code
        with pytest.raises(RuntimeError, match="repository modeling code ran"):
            AutoModelForCausalLM.from_pretrained(models["kimi"], trust_remote_code=True)
    with caplog.at_level(logging.WARNING, logger="hsx.checkpoint"):
        backend = TransformersBackend.load(
            models["kimi"], LAYERS, "float32", "cpu", trust_remote_code=trust_remote_code
        )
    notes = " | ".join(r.getMessage() for r in caplog.records)
    assert "runs on transformers' own DeepseekV3ForCausalLM (deepseek_v3)" in notes, notes
    assert "modeling_kimi_k2.py" in notes and "is not run" in notes
    assert type(backend.model).__module__ == "transformers.models.deepseek_v3.modeling_deepseek_v3"
    # every weight loaded (the experts too: their key conversion is keyed by the native model type)
    assert_states(backend.capture([0, 1], SEQS), hidden_states(models["plain"], SEQS))


def test_a_known_architecture_with_its_own_auto_map_still_runs_natively(models, tmp_path):
    path = tmp_path / "ds"
    shutil.copytree(models["kimi"], path)
    _edit_config(path, model_type="deepseek_v3")  # DeepSeek-V3's own release: a known type, and auto_map
    config, notes = checkpoint._native_config(checkpoint.read_config(path))
    assert type(config).__name__ == "DeepseekV3Config" and not hasattr(config, "auto_map")
    assert "is not run" in notes[0]
    assert checkpoint._native_config(checkpoint.read_config(models["plain"])) == (None, ())


def test_kimi_k2_fp8_checkpoint_extracts_end_to_end(models, tmp_path, caplog):
    """The shape Kimi-K2 is released in (kimi_k2 + auto_map + FP8 blocks), extracted with
    trust_remote_code (its tokenizer needs it): both decisions logged, the spec records the
    quantization, and the files hold the states of the independently dequantized model."""
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(4))
    out = tmp_path / "run"
    opts = ExtractOptions(
        out=out, model=str(models["kimi-fp8"]), data=[data], device="cpu", layers=LAYERS, shard_size=4,
        trust_remote_code=True, writers=1,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="hsx.checkpoint"):
        assert extract(opts, log=lambda m: None).complete
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "the repository's code (configuration_kimi_k2.py, modeling_kimi_k2.py) is not run" in said, said
    assert "dequantize=True" in said
    spec = json.loads((out / layout.SPEC).read_text())
    assert spec["model"]["quantization"]["method"] == "fp8"
    assert spec["model"]["fingerprint"]["weights"][0]["scales"]
    files = [load_states(layout.sample_path(out, i, 4)) for i in range(4)]
    refs = hidden_states(models["reference"], [f["input_ids"] for f in files])
    for f, ref in zip(files, refs, strict=True):
        for j, k in enumerate(LAYERS):
            assert (f["aux_hidden_states"][:, j * 256 : (j + 1) * 256] - ref[k + 1]).abs().max() <= 1e-5
        assert (f["hidden_states"] - ref[-1]).abs().max() <= 1e-5
