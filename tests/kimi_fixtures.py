"""Tiny checkpoints laid out as Kimi-K2.5 is released: the ``kimi_k25`` composite (a DeepSeek-V3
language model under ``language_model.``, a MoonViT vision tower, a projector, the repository's
code beside them), in bf16 / float32, or with its routed experts INT4 pack-quantized by the
compressed-tensors package's own compressor and the quantization config inside ``text_config`` only.

Every composite is built from a reference folder: transformers' native ``DeepseekV3ForCausalLM``
with the language model's weights (float32, values exact in bf16, so the bf16 and float32
composites hold the same numbers), the independent reference the tests compare with. The
repository's modeling files raise when imported: a test that loads one has run its code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from conftest import TINY, save_random

VOCAB = 2048  # the bundled tokenizer's, so that hsx extract runs on these folders
PREFIX = "language_model."
# Kimi-K2.5's quantization config, as its config.json has it inside text_config
INT4_CONFIG = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
REMOTE_CODE = {
    "configuration_kimi_k25.py": (
        "from transformers import PretrainedConfig\n\n\n"
        "class KimiK25Config(PretrainedConfig):\n    model_type = 'kimi_k25'\n"
    ),
    "configuration_deepseek.py": (
        "from transformers import DeepseekV3Config\n\n\n"
        "class DeepseekV3Config(DeepseekV3Config):\n    model_type = 'kimi_k2'\n"
    ),
    "modeling_kimi_k25.py": "raise RuntimeError('the repository modeling code ran')\n",
    "modeling_deepseek.py": "raise RuntimeError('the repository modeling code ran')\n",
}


def text_config():
    """A tiny DeepSeek-V3 with Kimi-K2's structure: MLA, a dense first layer, routed experts with
    sigmoid scoring and a shared expert; widths a multiple of the INT4 group (32)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
        tie_word_embeddings=False,
    )


def language_model_reference(path: Path, seed: int = 0) -> Path:
    """transformers' native DeepseekV3ForCausalLM, random, its float32 weights exact in bf16 (the
    router's correction bias too), with the bundled tokenizer."""
    save_random(text_config(), path, seed)
    file = path / "model.safetensors"
    tensors = {k: v.to(torch.bfloat16).float() for k, v in load_file(file).items()}
    save_file(tensors, file, metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY / name, path / name)
    return path


def vision_weights(hidden: int, vt: int = 32, blocks: int = 2, seed: int = 1) -> dict[str, torch.Tensor]:
    """MoonViT and its patch-merger projector, named as Kimi-K2.5 stores them (random, bf16)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"vision_tower.patch_embed.proj.weight": [vt, 3, 14, 14], "vision_tower.patch_embed.proj.bias": [vt]}
    shapes["vision_tower.patch_embed.pos_emb.weight"] = [4, 4, vt]
    for b in range(blocks):
        block = f"vision_tower.encoder.blocks.{b}."
        shapes |= {block + "wqkv.weight": [3 * vt, vt], block + "wqkv.bias": [3 * vt], block + "wo.weight": [vt, vt]}
        shapes |= {block + "mlp.fc0.weight": [2 * vt, vt], block + "mlp.fc1.weight": [vt, 2 * vt]}
        shapes |= {block + f"{n}.{p}": [vt] for n in ("norm0", "norm1") for p in ("weight", "bias")}
    shapes |= {f"vision_tower.encoder.final_layernorm.{p}": [vt] for p in ("weight", "bias")}
    shapes |= {f"mm_projector.pre_norm.{p}": [vt] for p in ("weight", "bias")}
    shapes |= {"mm_projector.proj.0.weight": [4 * vt, 4 * vt], "mm_projector.proj.0.bias": [4 * vt]}
    shapes |= {"mm_projector.proj.2.weight": [hidden, 4 * vt], "mm_projector.proj.2.bias": [hidden]}
    return {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()}


def composite_config(reference: Path, quantization: dict | None = None) -> dict:
    """Kimi-K2.5's raw config.json around the reference's config: kimi_k25 at the top, the text
    config as the release writes it (model type kimi_k2, its own auto_map, the quantization config
    there only), a MoonViT vision config."""
    text = json.loads((reference / "config.json").read_text())
    text.pop("transformers_version", None)
    text |= {
        "model_type": "kimi_k2",
        "architectures": ["DeepseekV3ForCausalLM"],
        "dtype": "bfloat16",
        "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        },
    }
    if quantization is not None:
        text["quantization_config"] = quantization
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "bos_token_id": text.get("bos_token_id"),
        "dtype": "bfloat16",
        "eos_token_id": text.get("eos_token_id"),
        "media_placeholder_token_id": VOCAB - 3,
        "model_type": "kimi_k25",
        "pad_token_id": text.get("pad_token_id"),
        "text_config": text,
        "tie_word_embeddings": False,
        "use_unified_vision_chunk": True,
        "vision_config": {
            "init_pos_emb_height": 4,
            "init_pos_emb_time": 4,
            "init_pos_emb_width": 4,
            "merge_kernel_size": [2, 2],
            "merge_type": "sd2_tpool",
            "mm_hidden_size": 32,
            "mm_projector_type": "patchmerger",
            "model_type": "",
            "patch_size": 14,
            "pos_emb_type": "divided_fixed",
            "projector_hidden_act": "gelu",
            "projector_ln_eps": 1e-05,
            "text_hidden_size": text["hidden_size"],
            "vt_hidden_size": 32,
            "vt_intermediate_size": 64,
            "vt_num_attention_heads": 2,
            "vt_num_hidden_layers": 2,
        },
    }


def _write(reference: Path, path: Path, tensors: dict[str, torch.Tensor], config: dict, shards: int = 2) -> Path:
    """The composite folder: config, tokenizer, the repository's code, weights in ``shards`` files
    with an index (as released: the vision tower's in the last shard, beside language-model ones)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(reference / name, path / name)
    for name, code in REMOTE_CODE.items():
        (path / name).write_text(code)
    names = sorted(tensors, key=lambda n: (not n.startswith(PREFIX), n))
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i * per : (i + 1) * per]}
        save_file(part, path / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path


def kimi_k25(reference: Path, path: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The composite with the reference's language model in ``dtype`` (the router's correction
    bias float32, as released) and a vision tower + projector that must never be loaded."""
    lm = {
        PREFIX + k: (v if k.endswith("e_score_correction_bias") else v.to(dtype))
        for k, v in _weights(reference).items()
    }
    hidden = json.loads((reference / "config.json").read_text())["hidden_size"]
    return _write(reference, path, lm | vision_weights(hidden), composite_config(reference))


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def routed_expert(name: str) -> bool:
    """A routed expert's projection weight: what Kimi-K2.5 stores in INT4."""
    return ".mlp.experts." in name and name.endswith("_proj.weight")


def pack_int4(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``weight`` quantized as Kimi-K2.5's experts are (int4, symmetric, groups of 32 along the input,
    bf16 scales) and packed by compressed-tensors' own compressor; returns the stored tensors
    (``weight_packed``, ``weight_scale``, ``weight_shape``) and, independently of any loader, the
    weight they stand for in float32 (the integers times their group's scale)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = QuantizationScheme(**INT4_CONFIG["config_groups"]["group_0"])
    out, cols = weight.shape
    groups = weight.float().reshape(out, cols // 32, 32)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    stored = PackedQuantizationCompressor.compress(
        {"weight": weight.float(), "weight_scale": scale.to(torch.bfloat16)}, scheme
    )
    ints = unpack_from_int32(stored["weight_packed"], 4, stored["weight_shape"]).float()
    dequantized = (ints.reshape(out, cols // 32, 32) * stored["weight_scale"].float()[..., None]).reshape(out, cols)
    stored = {k: stored[k].contiguous() for k in ("weight_packed", "weight_scale")}
    stored["weight_shape"] = torch.tensor(weight.shape, dtype=torch.int32)  # as released (the compressor's: int64)
    return stored, dequantized


def kimi_k25_int4(reference: Path, path: Path, dequantized: Path) -> Path:
    """The composite with its routed experts INT4 packed and everything else bf16 (the correction
    bias float32), the quantization config inside ``text_config`` only; ``dequantized`` is the
    reference folder again with those experts replaced by the weights their packed values and
    scales stand for (float32): the independent reference of this checkpoint."""
    lm, plain = {}, {}
    for name, t in _weights(reference).items():
        if routed_expert(name):
            stored, plain[name] = pack_int4(t)
            lm |= {PREFIX + name.removesuffix("weight") + k: v for k, v in stored.items()}
        else:
            lm[PREFIX + name] = t if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
            plain[name] = t
    shutil.copytree(reference, dequantized)
    save_file(plain, dequantized / "model.safetensors", metadata={"format": "pt"})
    hidden = json.loads((reference / "config.json").read_text())["hidden_size"]
    return _write(reference, path, lm | vision_weights(hidden), composite_config(reference, INT4_CONFIG))
