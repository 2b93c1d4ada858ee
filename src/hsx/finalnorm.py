"""The target's final RMSNorm, read from its checkpoint: which tensor it is, and the norm itself.

hsx's final state is the last decoder layer's output after this norm (divided where the model
divides it before its LM head: Inkling, ``head_divisor``), and it is computed outside
the model twice: the vLLM backend applies it to vLLM's pre-norm state, and exports invert it for
trainers that want the state before it. Both must find the same tensor and compute what
transformers computes, so both use this module.

Locating, from ``config.json`` and the safetensors headers alone (no weight is read):
- ``rms_norm_eps`` must be in the config: without it the norm is not an RMSNorm.
- the checkpoint is the files its index names, else every ``*.safetensors`` of the folder.
- candidates are weights named like a norm (``...norm....weight``, ``ln_f.weight``) outside the
  decoder layers and any multi-token-prediction head; a conventional name (``NAMES``) wins,
  otherwise exactly one candidate of shape [hidden] must remain. A bias beside it means a
  LayerNorm. Anything else is refused: a guessed norm would give wrong states silently.

Two families of RMSNorm exist: ``w * x / rms(x)`` (Llama and most others) and ``(1 + w) * x /
rms(x)`` (``OFFSET_TYPES``: the checkpoint stores ``w`` around 0). Both take float32
statistics and differ in where they cast back to the model's dtype; ``apply`` follows each.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from hsx.errors import BadFile, NormUnavailable
from hsx.target import load_config, weight_table

NAMES = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight", "norm.weight")
NORM_LIKE = re.compile(r"(^|\.)([^.]*norm[^.]*|ln_f)\.weight$")
PER_LAYER = re.compile(r"(^|\.)(layers|h|blocks|decoder_layers)\.\d+\.")
# Model types (top level or text config) whose final RMSNorm scales by (1 + weight) in transformers.
OFFSET_TYPES = frozenset(
    {
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "paligemma",
        "recurrent_gemma",
        "shieldgemma2",
        "vaultgemma",
        "qwen3_next",
        "qwen3_5",
        "qwen3_5_text",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
    }
)


@dataclass(frozen=True)
class FinalNorm:
    """The checkpoint's final RMSNorm: its weight tensor, where it is stored, eps, and its family."""

    file: Path  # the weight file holding ``tensor``
    tensor: str
    eps: float
    offset: bool = False  # scales by (1 + weight), Gemma-style
    divisor: float = 1.0  # the LM head's input is the norm's output over this (Inkling's logits_mup_width_multiplier)

    @functools.cached_property
    def weight(self) -> torch.Tensor:
        """The stored weight as float32 [H] (``w`` itself for offset norms); read on first use."""
        with safe_open(str(self.file), framework="pt") as f:
            return f.get_tensor(self.tensor).float()

    @property
    def scale(self) -> torch.Tensor:
        """The per-channel factor the normalized state is multiplied by, float32: 1 + w or w (over
        ``divisor``: hsx's final state is the LM head's input)."""
        return (1.0 + self.weight if self.offset else self.weight) / self.divisor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The norm as transformers computes it for ``x``'s dtype, bit for bit: float32 statistics,
        then the weight in ``x``'s dtype times the normalized state cast back (Llama's order), or
        the product in float32 cast back (offset norms). The odd plain norm that multiplies in
        float32 (Gemma 3n) differs from this by one rounding in half precision."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.to(x.device, x.dtype)
        out = (h * (1.0 + w.float())).to(x.dtype) if self.offset else w * h.to(x.dtype)
        return out if self.divisor == 1.0 else out / self.divisor


def _tensors(model_dir: Path) -> dict[str, tuple[Path, dict]]:
    """Tensor name -> (weight file, header entry) over the checkpoint's safetensors files."""
    try:
        return weight_table(model_dir)
    except (BadFile, OSError) as e:
        raise NormUnavailable(f"cannot read the final norm from {model_dir}: {e}") from e


def locate(model_dir: Path, hidden_size: int | None = None) -> FinalNorm:
    """Find the final norm of the checkpoint in ``model_dir`` (policy above); raise
    ``NormUnavailable`` when it cannot be told for sure. ``hidden_size`` defaults to the config's."""
    config = load_config(model_dir)
    eps = config.get("rms_norm_eps")
    if eps is None:
        raise NormUnavailable(
            f"{model_dir}/config.json has no rms_norm_eps: the final norm is not an RMSNorm hsx knows"
        )
    hidden = hidden_size or int(config["hidden_size"])
    tensors = _tensors(model_dir)
    if not tensors:
        raise NormUnavailable(f"{model_dir} has no safetensors weights to read the final norm from")
    found = [n for n in sorted(tensors) if NORM_LIKE.search(n) and not PER_LAYER.search(n) and "mtp" not in n]
    name = next((n for n in NAMES if n in found), None)
    if name is None:
        shaped = [n for n in found if tensors[n][1].get("shape") == [hidden]]
        if len(shaped) != 1:
            raise NormUnavailable(
                f"cannot tell the final norm among {shaped or 'no'} candidate weights in {model_dir}; "
                "this model's final norm is not one hsx can read"
            )
        name = shaped[0]
    path, entry = tensors[name]
    if name.removesuffix("weight") + "bias" in tensors:
        raise NormUnavailable(f"{name} has a bias: a LayerNorm, not an RMSNorm")
    if entry.get("shape") != [hidden]:
        raise NormUnavailable(f"{name} in {path.name} has shape {entry.get('shape')}, expected [{hidden}]")
    top = json.loads((model_dir / "config.json").read_text())
    offset = bool({str(top.get("model_type", "")), str(config.get("model_type", ""))} & OFFSET_TYPES)
    return FinalNorm(path, name, float(eps), offset, head_divisor(config))


def head_divisor(config: dict) -> float:
    """What the model divides its normed final state by before the LM head (Inkling: its
    ``logits_mup_width_multiplier``), 1 for the others: hsx's final state is the head's input."""
    return float(config.get("logits_mup_width_multiplier") or 1.0)
