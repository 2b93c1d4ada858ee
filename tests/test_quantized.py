"""Routed experts kept INT4-packed (hsx.capture.quantized): the Kimi-K2-Thinking form (model type
kimi_k2, architecture DeepseekV3ForCausalLM, ``auto_map`` to the repository's code, compressed-tensors
pack-quantized INT4 group 32 on the routed experts only), a tiny DeepSeek-V3 the tests build and
pack with compressed-tensors' own compressor. The reference is transformers' native
DeepseekV3ForCausalLM on the same weights with the experts dequantized by compressed-tensors' own
unpack + dequantize, in float32.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY, save_random
from hsx.capture.quantized import int4
from hsx.capture.transformers import TransformersBackend

pytest.importorskip("compressed_tensors")

VOCAB = 2048  # the bundled tokenizer's
HIDDEN = 64
LAYERS = [0, 1]  # hidden_states[3] of 3 layers is after the final norm: the final state
EXPERT = re.compile(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def tiny_config(**over):
    from transformers import DeepseekV3Config

    kw = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1,
    )  # fmt: skip
    return DeepseekV3Config(**(kw | over))


def dequantized(stored: dict[str, torch.Tensor], dtype=torch.float32) -> torch.Tensor:
    """compressed-tensors' own unpacking and dequantization of one stored projection, in ``dtype``."""
    from compressed_tensors.compressors.pack_quantized import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    values = unpack_from_int32(stored["weight_packed"], 4, stored["weight_shape"])
    return dequantize(values, stored["weight_scale"].to(dtype), args=args, dtype=dtype)


def kimi_thinking(dense: Path, packed: Path, reference: Path) -> None:
    """From a float32 checkpoint: ``packed`` in the Kimi-K2-Thinking form (bf16 weights, routed experts
    INT4-packed by compressed-tensors), ``reference`` the same weights with the experts dequantized
    (float32, plain DeepSeek-V3)."""
    for path in (packed, reference):
        path.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(TINY / name, path / name)
    stored, ref = {}, {}
    for name, t in load_file(dense / "model.safetensors").items():
        t = t.to(torch.bfloat16) if "e_score_correction_bias" not in name else t
        if EXPERT.search(name):
            q = int4.quantize(t, 32)
            for key, value in q.items():
                stored[f"{name.removesuffix('.weight')}.{key}"] = value
            ref[name] = dequantized(q)
        else:
            stored[name], ref[name] = t, t.to(torch.float32)
    save_file(stored, packed / "model.safetensors", metadata={"format": "pt"})
    save_file(ref, reference / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    (reference / "config.json").write_text(json.dumps(config))
    config |= {
        "model_type": "kimi_k2",
        "auto_map": {
            "AutoConfig": "configuration_kimi_k2.KimiK2Config",
            "AutoModel": "modeling_kimi_k2.KimiK2Model",
            "AutoModelForCausalLM": "modeling_kimi_k2.KimiK2ForCausalLM",
        },
        "quantization_config": int4.quantization_config(32),
    }
    (packed / "config.json").write_text(json.dumps(config))
    (packed / "modeling_kimi_k2.py").write_text("raise RuntimeError('the repository modeling code ran')\n")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int4")
    save_random(tiny_config(), root / "dense")
    kimi_thinking(root / "dense", root / "packed", root / "reference")
    return {p.name: p for p in root.iterdir()}


SEQS = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).numpy() for n in (23, 9, 40)]


def reference_states(model_dir: Path, seqs) -> list[list[torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float32
    with torch.no_grad():
        return [
            [h[0] for h in model(torch.as_tensor(s)[None].long(), output_hidden_states=True).hidden_states]
            for s in seqs
        ]


def states(backend, seqs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batch = backend.capture(list(range(len(seqs))), seqs)
    return [tuple(t.clone() for t in batch.sample(i)) for i in range(len(seqs))]


# ---------------------------------------------------------------- the expansion


def test_expansion_is_compressed_tensors_dequantization_exactly():
    w = torch.randn(3, 96, 128, dtype=torch.bfloat16)
    q = int4.quantize(w, 32)
    assert q["weight_packed"].dtype == torch.int32 and q["weight_packed"].shape == (3, 96, 16)
    assert q["weight_scale"].shape == (3, 96, 4)
    fmt = int4.Int4Experts(32)
    for dtype in (torch.float32, torch.bfloat16):
        got = fmt.expand(q, dtype)
        ref = torch.stack([dequantized({k: v[e] for k, v in q.items()}, torch.float32) for e in range(3)]).to(dtype)
        assert got.dtype == dtype and torch.equal(got, ref)
    assert (fmt.expand(q, torch.float32) - w.float()).abs().max() <= q[
        "weight_scale"
    ].float().max()  # a real round trip


# ---------------------------------------------------------------- one process, float32


def test_packed_float32_run_equals_the_dequantized_model(models, caplog):
    with caplog.at_level(logging.WARNING, logger="hsx.checkpoint"):
        backend = TransformersBackend.load(models["packed"], LAYERS, "float32", "cpu")
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "stay packed" in said and "int4-packed, expanded per layer to float32" in said, said
    refs = reference_states(models["reference"], SEQS)
    for (aux, final), ref in zip(states(backend, SEQS), refs, strict=True):
        for j, k in enumerate(LAYERS):
            assert (aux[:, j * HIDDEN : (j + 1) * HIDDEN] - ref[k + 1]).abs().max() <= 1e-5
        assert (final - ref[-1]).abs().max() <= 1e-5
    # hsx on the dequantized checkpoint: the same bits
    plain = TransformersBackend.load(models["reference"], LAYERS, "float32", "cpu")
    for (a, f), (ra, rf) in zip(states(backend, SEQS), states(plain, SEQS), strict=True):
        assert torch.equal(a, ra) and torch.equal(f, rf)
