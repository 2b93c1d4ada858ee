"""Capture with Hugging Face transformers: forward hooks on the chosen decoder layers and the final norm.

Never ``output_hidden_states=True`` (it keeps every layer alive) and never the lm_head (a
[tokens, vocab] logits tensor we do not need): the base model runs with hooks and its outputs are
discarded. Batches are right-padded with an attention mask; causal attention means a real token
never sees padding, so padded rows change nothing for the real ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hsx.capture import CapturedBatch, check_layers
from hsx.capture.locate import locate

NAME = "transformers"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of auto, {', '.join(DTYPES)}")
    return dtype


class TransformersBackend:
    name = NAME

    def __init__(
        self,
        model_dir: Path,
        layers: list[int],
        dtype: str,
        device: str,
        trust_remote_code: bool = False,
        attn_implementation: str = "sdpa",
    ):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir,
            dtype=self.dtype,
            trust_remote_code=trust_remote_code,
            attn_implementation=attn_implementation,
        ).to(self.device)
        self.model.eval()
        config = self.model.config.get_text_config()
        self.num_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        check_layers(layers, self.num_layers)
        self.layers = list(layers)
        self.parts = locate(self.model, self.num_layers)
        self._outputs: dict[object, torch.Tensor] = {}
        for k in self.layers:
            self.parts.layers[k].register_forward_hook(self._keep(k))
        self.parts.norm.register_forward_hook(self._keep("final"))

    def _keep(self, key):
        def hook(_module, _inputs, output):
            self._outputs[key] = output[0] if isinstance(output, tuple) else output

        return hook

    def pad(self, sequences: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pad to the longest; returns (input_ids, attention_mask) on the device."""
        longest = max(len(s) for s in sequences)
        ids = torch.zeros((len(sequences), longest), dtype=torch.long)
        mask = torch.zeros((len(sequences), longest), dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.from_numpy(seq.astype(np.int64))
            mask[row, : len(seq)] = 1
        return ids.to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def capture(self, sample_ids: list[int], sequences: list[np.ndarray]) -> CapturedBatch:
        ids, mask = self.pad(sequences)
        self._outputs.clear()
        self.parts.body(input_ids=ids, attention_mask=mask, use_cache=False)
        aux = torch.cat([self._outputs[k] for k in self.layers], dim=-1)
        final = self._outputs["final"]
        self._outputs.clear()
        return CapturedBatch(list(sample_ids), [len(s) for s in sequences], aux, final)
