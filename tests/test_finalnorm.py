"""The final norm: found in checkpoints that hold other norm-like weights, refused when it cannot
be told, and applied exactly as transformers' own norm module computes it, for both families."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY
from hsx.errors import NormUnavailable
from hsx.finalnorm import locate

H = 64  # the bundled model's hidden size


def _weights(seed: int, offset: bool) -> torch.Tensor:
    """A final-norm weight far from the identity: mixed signs and scales (around 0 for 1 + w)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.empty(H).uniform_(0.2, 3.0, generator=g) * torch.where(torch.rand(H, generator=g) < 0.2, -1.0, 1.0)
    return w - 1.0 if offset else w


def _states(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return (torch.randn(3, 11, H, generator=g) * torch.logspace(-2, 2, 11)[:, None]).to(dtype)


def _checkpoint(path: Path, config: dict, shards: dict[str, dict[str, torch.Tensor]], index: bool = False) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"rms_norm_eps": 1e-6, "hidden_size": H} | config))
    for name, tensors in shards.items():
        save_file(tensors, path / name, metadata={"format": "pt"})
    if index:
        weight_map = {t: name for name, tensors in shards.items() for t in tensors}
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def test_bundled_model_norm_is_found_and_applied_as_its_own_module(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "tiny"
    shutil.copytree(TINY, model_dir)
    weights = load_file(model_dir / "model.safetensors")
    weights["model.norm.weight"] = _weights(1, offset=False)
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})

    norm = locate(model_dir)
    assert (norm.tensor, norm.eps, norm.offset) == ("model.norm.weight", 1e-5, False)
    assert norm.file == model_dir / "model.safetensors"
    assert locate(TINY).tensor == "model.norm.weight"
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        x = _states(dtype)
        with torch.no_grad():
            ref = model.model.norm(x)
        got = norm.apply(x)
        assert got.dtype == ref.dtype == dtype
        assert float((got.float() - ref.float()).abs().max()) <= 1e-6
        assert torch.equal(got, ref)  # bit for bit: the vLLM backend's files equal the transformers backend's


def test_gemma_checkpoint_norm_scales_by_one_plus_weight(tmp_path):
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(
        vocab_size=128,
        hidden_size=H,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    torch.manual_seed(0)
    model = GemmaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.norm.weight.copy_(_weights(2, offset=True))
    model.save_pretrained(tmp_path / "gemma")

    norm = locate(tmp_path / "gemma")
    assert (norm.tensor, norm.eps, norm.offset) == ("model.norm.weight", config.rms_norm_eps, True)
    assert torch.equal(norm.scale, 1.0 + model.model.norm.weight.detach())
    for dtype in (torch.float32, torch.bfloat16):
        x = _states(dtype)
        with torch.no_grad():
            ref = model.to(dtype).model.norm(x)
        got = norm.apply(x)
        assert got.dtype == dtype and float((got.float() - ref.float()).abs().max()) <= 1e-6
        assert torch.equal(got, ref)


@pytest.mark.parametrize(
    ("model_type", "module", "cls", "offset"),
    [
        ("llama", "llama", "LlamaRMSNorm", False),
        ("qwen3_next", "qwen3_next", "Qwen3NextRMSNorm", True),
        ("gemma3_text", "gemma3", "Gemma3RMSNorm", True),
        ("gemma3n_text", "gemma3n", "Gemma3nRMSNorm", False),  # a Gemma that scales by w itself
    ],
)
def test_each_family_is_applied_as_transformers_norm_class(tmp_path, model_type, module, cls, offset):
    w = _weights(3, offset)
    model_dir = _checkpoint(
        tmp_path / model_type, {"model_type": model_type}, {"model.safetensors": {"model.norm.weight": w}}
    )
    norm = locate(model_dir)
    assert norm.offset is offset
    ref_norm = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)(H, eps=1e-6)
    with torch.no_grad():
        ref_norm.weight.copy_(w)
        x = _states(torch.float32)
        assert float((norm.apply(x) - ref_norm(x)).abs().max()) <= 1e-6


def test_sharded_checkpoint_with_other_norm_like_weights(tmp_path):
    """Per-layer norms, a multi-token-prediction head's, a vision tower's (another width) and a file
    the index does not name are no candidates; the one final-norm-like [H] weight is the norm."""
    w = _weights(4, offset=False)
    shards = {
        "model-00001-of-00002.safetensors": {
            "model.layers.0.input_layernorm.weight": torch.ones(H),
            "model.layers.0.post_attention_layernorm.weight": torch.ones(H),
            "model.mtp_layers.0.final_layernorm.weight": torch.ones(H),
            "vision_tower.post_layernorm.weight": torch.ones(32),
        },
        "model-00002-of-00002.safetensors": {"model.final_layernorm.weight": w, "lm_head.weight": torch.ones(8, H)},
    }
    model_dir = _checkpoint(tmp_path / "sharded", {"model_type": "llama"}, shards, index=True)
    save_file({"norm.weight": torch.ones(H)}, model_dir / "consolidated.safetensors")  # not in the index
    norm = locate(model_dir)
    assert (norm.tensor, norm.file.name) == ("model.final_layernorm.weight", "model-00002-of-00002.safetensors")
    assert torch.equal(norm.weight, w)

    (model_dir / "model.safetensors.index.json").unlink()  # every file counts now: the conventional name wins
    assert locate(model_dir).tensor == "norm.weight"


def test_what_cannot_be_told_for_sure_is_refused(tmp_path):
    def refused(name: str, tensors: dict[str, torch.Tensor], config: dict | None = None) -> str:
        model_dir = _checkpoint(tmp_path / name, config or {}, {"model.safetensors": tensors})
        with pytest.raises(NormUnavailable) as e:
            locate(model_dir)
        return str(e.value)

    two = {"model.final_norm.weight": torch.ones(H), "model.other_norm.weight": torch.ones(H)}
    assert "cannot tell the final norm among ['model.final_norm.weight', 'model.other_norm.weight']" in refused(
        "two", two
    )
    assert "among no candidate" in refused("none", {"model.layers.0.norm.weight": torch.ones(H)})
    assert "has a bias: a LayerNorm" in refused(
        "bias", {"model.norm.weight": torch.ones(H), "model.norm.bias": torch.zeros(H)}
    )
    assert "has shape [32], expected [64]" in refused("shape", {"model.norm.weight": torch.ones(32)})
    assert "no rms_norm_eps" in refused("eps", {"model.norm.weight": torch.ones(H)}, {"rms_norm_eps": None})

    broken = _checkpoint(tmp_path / "broken", {}, {})
    (broken / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(NormUnavailable, match=r"cannot read the final norm from .*model\.safetensors"):
        locate(broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(NormUnavailable, match="has no safetensors weights"):
        locate(broken)
