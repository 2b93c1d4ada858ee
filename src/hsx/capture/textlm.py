"""The language model alone of a composite release that transformers implements without a causal LM.

GLM-5-next ships as a vision-language model (``Glm5NextForConditionalGeneration``: the text model
under ``model.language_model.``, a vision tower under ``model.visual.``, ``lm_head``), and
transformers has a class for its text model (``Glm5NextTextModel``) but none that puts a head on
it. hsx needs a causal LM: its decoder layers, final norm and LM head. ``TextLM.of`` finds the
text model's class and its weights' prefix in the checkpoint, and ``causal_lm`` builds the class
transformers would have written (the text model under ``model``, a linear head) on transformers'
own pretrained base of that text model, so loading reads the language model's weights only (the
vision tower's are never materialized) and every layer is transformers' own code.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from hsx import target

PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")  # where composites keep it


@dataclass(frozen=True)
class TextLM:
    """How to load a composite's language model alone: its config object, the class, and the
    checkpoint names mapped onto the class's (``key_mapping``)."""

    config: Any  # the text model's transformers config
    model_class: type
    key_mapping: dict[str, str]

    @classmethod
    def of(cls, model_dir: Path, trust_remote_code: bool = False) -> TextLM | None:
        """For a composite (a ``text_config``) whose model type and text model type have no causal-LM
        class in transformers but whose text model has a base class, with the text model's weights
        under one of ``PREFIXES``; None for any other checkpoint."""
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        text = config.get_text_config()
        if text is config or type(config) in MODEL_FOR_CAUSAL_LM_MAPPING or type(text) in MODEL_FOR_CAUSAL_LM_MAPPING:
            return None
        base = MODEL_MAPPING.get(type(text), None)
        if base is None:
            return None
        weights = target.weight_table(model_dir)
        prefix = next((p for p in PREFIXES if any(n.startswith(f"{p}layers.") for n in weights)), None)
        if weights and prefix is None:
            return None
        prefix = prefix or PREFIXES[0]
        others = sorted({".".join(n.split(".")[:2]) for n in weights if not n.startswith((prefix, "lm_head."))})
        model_class = causal_lm(base)
        if others:  # the composite's other parts (its vision tower): never loaded, so not reported missing
            ignored = [f"^{re.escape(o)}\\." for o in others]
            model_class = type(model_class.__name__, (model_class,), {"_keys_to_ignore_on_load_unexpected": ignored})
        return cls(text, model_class, {"^" + re.escape(prefix): "model."})

    def kwargs(self) -> dict:
        return {"config": self.config, "key_mapping": self.key_mapping}


@functools.cache
def causal_lm(base: type) -> type:
    """A causal LM over ``base`` (a transformers text model class): ``model`` and ``lm_head``, its
    forward the logits of every position (the head is tied to the embeddings where the config says)."""
    import torch
    from torch import nn
    from transformers import GenerationMixin
    from transformers.modeling_outputs import CausalLMOutputWithPast

    pretrained = next(k for k in base.__mro__[1:] if k.__name__.endswith("PreTrainedModel"))

    class CausalLM(pretrained, GenerationMixin):
        config_class = base.config_class
        base_model_prefix = "model"
        _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}
        _can_record_outputs = getattr(pretrained, "_can_record_outputs", None)

        def __init__(self, config):
            super().__init__(config)
            self.model = base(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

        def get_decoder(self):
            return self.model

        def forward(self, input_ids: torch.Tensor | None = None, **kwargs) -> CausalLMOutputWithPast:
            out = self.model(input_ids=input_ids, **kwargs)
            return CausalLMOutputWithPast(
                logits=self.lm_head(out.last_hidden_state), hidden_states=getattr(out, "hidden_states", None)
            )

    CausalLM.__name__ = CausalLM.__qualname__ = base.__name__.removesuffix("Model") + "ForCausalLM"
    return CausalLM
