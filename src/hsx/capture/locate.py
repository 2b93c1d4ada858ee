"""Find the decoder-layer list and the final norm inside a Hugging Face causal LM.

Layouts differ (Llama/Qwen/Mistral/DeepSeek-V3: ``model.layers`` + ``model.norm``; GPT-2 style:
``transformer.h`` + ``ln_f``; ...). We look for the ModuleList whose length is the config's
number of hidden layers, and a norm beside it, and fail with a clear message when either is absent.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from hsx.errors import UnsupportedModel

LAYER_LIST_NAMES = ("layers", "h", "blocks", "decoder_layers")
NORM_NAMES = ("norm", "final_layernorm", "ln_f", "norm_f", "final_norm")


@dataclass
class Parts:
    body: nn.Module  # the base model: runs embeddings -> layers -> final norm, no lm_head
    layers: nn.ModuleList
    norm: nn.Module


def locate(model: nn.Module, num_layers: int) -> Parts:
    candidates = []
    getter = getattr(model, "get_decoder", None)
    if callable(getter):
        try:
            candidates.append(getter())
        except Exception:  # some remote-code models raise here; fall back to attributes
            pass
    for name in ("model", "transformer", "language_model", "decoder"):
        sub = getattr(model, name, None)
        if isinstance(sub, nn.Module):
            candidates.append(sub)
            inner = getattr(sub, "language_model", None)
            if isinstance(inner, nn.Module):
                candidates.append(inner)
    for body in candidates:
        for lname in LAYER_LIST_NAMES:
            layers = getattr(body, lname, None)
            if isinstance(layers, nn.ModuleList) and len(layers) == num_layers:
                for nname in NORM_NAMES:
                    norm = getattr(body, nname, None)
                    if isinstance(norm, nn.Module):
                        return Parts(body, layers, norm)
                raise UnsupportedModel(
                    f"{type(model).__name__}: found {num_layers} decoder layers at '{lname}' but no final "
                    f"norm named one of {', '.join(NORM_NAMES)}"
                )
    raise UnsupportedModel(
        f"{type(model).__name__}: cannot find a list of {num_layers} decoder layers "
        f"(looked for {', '.join(LAYER_LIST_NAMES)} under the base model)"
    )
