"""How to load a checkpoint as its publisher released it: the one place that reads a model folder's
config.json for what ``from_pretrained`` needs beyond the weights, and says what it decided.

Two kinds of released checkpoint need more than ``AutoModelForCausalLM.from_pretrained(folder)``:

- Quantized weights (config.json carries a ``quantization_config``): they load through transformers'
  own quantizer, and its TP/EP plans, as the checkpoint asks. Fine-grained FP8 with block scales
  (``quant_method: fp8``, ``weight_block_size: [128, 128]``: float8_e4m3fn weights and a float32
  ``weight_scale_inv`` per block, as DeepSeek-V3 and Kimi-K2 are released) computes as the run's
  ``quantized_compute`` says (``hsx.capture.quantized.fp8``): ``fp8`` keeps the weights FP8 (transformers
  loads them with ``dequantize`` off) and runs them on torch's block-scaled FP8 GEMM, no kernel of
  transformers' Hub path; ``dequantized`` (CPU, GPUs without the GEMM, or asked for) passes
  ``dequantize=True``: each weight is multiplied out to the run's dtype at load.
  transformers derives the block from the number of scales, which is wrong for a weight whose shape
  is not a whole number of blocks (DeepSeek-V3's ``kv_a_proj_with_mqa`` has 576 rows: 4.5 blocks);
  where a checkpoint has such weights, hsx applies their scales by the configured block instead
  (``exact_block_dequantization``). compressed-tensors loads where its package is installed
  (decompressed on CPU); another method transformers implements loads through its quantizer as it
  is; a method transformers does not know is refused (it would read the stored integers as weights).
- Repositories with their own modeling code (``auto_map``) for an architecture transformers has:
  a Kimi-K2 checkpoint says ``model_type: kimi_k2`` (a type transformers does not know),
  ``architectures: [DeepseekV3ForCausalLM]`` and an ``auto_map`` to the repository's Python. hsx
  reads the config as that architecture's native config, without the ``auto_map`` and under the
  native model type (transformers' checkpoint-key conversions, which fuse the experts, are keyed by
  it), so the model runs on transformers' implementation, with its TP/EP plans and grouped experts,
  whatever ``--trust-remote-code`` says; that option stays the opt-in for a tokenizer's code or for
  an architecture transformers lacks.
- Composite checkpoints whose language model transformers implements: Kimi-K2.5 says ``model_type:
  kimi_k25`` (filed by transformers under image-text-to-text, not causal LM), keeps a vision tower
  and a projector beside the language model, and a ``text_config`` that is Kimi-K2's (above), its
  quantization config inside it. hsx captures the language model only, so it loads just that:
  the text config's native causal LM, its weights read from the checkpoint's names under the
  language model's prefix (``language_model.``, mapped away with transformers' ``key_mapping``).
  Checkpoint keys that match no parameter are never read (transformers opens the files lazily,
  key by key), so the vision tower and projector are not materialized anywhere.
  ``hsx.target.LanguageModel`` is the one place that tells the language model (config, prefix,
  quantization config) from the rest.

``hsx.target.quantization_of`` is what the run spec records (``ModelIdentity.quantization``);
``compute_choice`` the run's ``quantized_compute``; ``plan`` is the decision for one device,
``prepared`` carries it out (notes logged) for ``from_pretrained``, and ``fp8.install`` after it
where the plan says ``fp8``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx.errors import UnsupportedModel
from hsx.target import LanguageModel, bnb_method, held_experts, int4_group

log = logging.getLogger("hsx.checkpoint")

FP8_METHODS = ("fp8", "mxfp8")  # transformers' FineGrainedFP8Config reads both
COMPUTES = ("fp8", "int4", "dequantized")  # --quantized-compute: how a quantized checkpoint computes


def read_config(model_dir: Path) -> dict:
    """config.json as it is."""
    return json.loads((Path(model_dir) / "config.json").read_text())


@dataclass(frozen=True)
class LoadPlan:
    """What ``from_pretrained`` needs beyond the folder for one checkpoint on one device."""

    config: Any = None  # a native transformers config read from config.json, replacing transformers' own reading
    key_mapping: dict | None = None  # checkpoint name pattern -> model name (a composite's language-model prefix)
    quantization_config: Any = None  # the checkpoint's quantization config with hsx's loading attributes
    dequantize: bool = False  # quantized weights expanded to the run's dtype at load (no quantized kernels)
    exact_blocks: bool = False  # some block-scaled weights are not whole blocks: hsx applies their scales
    fp8: bool = False  # FP8 weights kept as stored: ``fp8.install`` puts them on torch's kernels after the load
    experts: Any = None  # an ExpertFormat: routed experts kept as stored, expanded per layer (capture.quantized)
    notes: tuple[str, ...] = field(default_factory=tuple)  # one line per decision, for the log

    def kwargs(self) -> dict:
        out: dict = {}
        if self.config is not None:
            out["config"] = self.config
        if self.key_mapping is not None:
            out["key_mapping"] = self.key_mapping
        if self.quantization_config is not None:
            out["quantization_config"] = self.quantization_config
        return out


def plan(model_dir: Path, device: str, dtype: str = "float32", compute: str | None = None) -> LoadPlan:
    """How to load the checkpoint in ``model_dir`` onto ``device`` in ``dtype`` (a --dtype name),
    FP8 weights computed as ``compute`` says (None: ``compute_choice``'s default). Raises
    ``UnsupportedModel`` for a quantization transformers cannot load here."""
    lm = LanguageModel.of(model_dir)
    native, notes = _native_config(lm.config, lm if lm.composite else None)
    mapping = {"^" + re.escape(lm.prefix): ""} if lm.composite and native is not None else None
    qc = lm.quantization
    if not qc:
        return LoadPlan(config=native, key_mapping=mapping, notes=notes)
    stored = _stored_experts(lm, native, qc, device, dtype)
    if stored is not None:
        return LoadPlan(config=stored[0], key_mapping=mapping, experts=stored[1], notes=(*notes, stored[2]))
    quant, dequantize, exact, more = _quantization(Path(model_dir), qc, device, dtype, compute)
    fp8 = quant is not None and getattr(quant, "dequantize", None) is False
    return LoadPlan(native, mapping, quant, dequantize, exact, fp8=fp8, notes=notes + more)


def prepared(model_dir: Path, device: str, dtype: str = "float32", compute: str | None = None) -> LoadPlan:
    """The plan, its notes logged; where the plan needs it, transformers' FP8 dequantization is
    first made exact for partial blocks (idempotent)."""
    p = plan(model_dir, device, dtype, compute)
    for note in p.notes:
        log.warning("checkpoint: %s", note)
    if p.exact_blocks:
        exact_block_dequantization()
    return p


def compute_choice(model_dir: Path, device: str, dtype: str, asked: str | None) -> tuple[str | None, str | None]:
    """The ``quantized_compute`` of a run on ``device`` in ``dtype``, and why it is not ``fp8``
    where it could have been. Block FP8: ``fp8`` by default where torch's block-scaled FP8 GEMM
    runs, else ``dequantized``. INT4-packed routed experts: None by default (expanded per layer, as
    runs before the choice), ``int4`` (the dequantizing grouped GEMM) or ``dequantized`` where
    asked. Other checkpoints: None (``asked`` refused). Raises ``OptionError`` for a choice the
    checkpoint or the device cannot take."""
    from hsx.capture.quantized import fp8, int4
    from hsx.errors import OptionError

    if asked is not None and asked not in COMPUTES:
        raise OptionError(f"--quantized-compute takes {', '.join(COMPUTES)}, not {asked!r}")
    lm = LanguageModel.of(model_dir)
    if held_experts(lm) is not None:
        if asked == "fp8":
            raise OptionError(f"--quantized-compute fp8 applies to FP8 checkpoints; {model_dir}'s experts are INT4")
        blocker = int4.gemm_blocker(device, dtype, lm.config) if asked == "int4" else None
        if blocker is not None:
            raise OptionError(f"--quantized-compute int4 cannot run here: {blocker}; leave it out (expanded per layer)")
        return asked, None
    if asked == "int4":
        raise OptionError(f"--quantized-compute int4 applies to INT4-packed routed experts; {model_dir} has none")
    qc = read_config(model_dir).get("quantization_config") or {}
    if qc.get("quant_method") not in FP8_METHODS:
        if asked is not None:
            raise OptionError(f"--quantized-compute applies to FP8 and INT4 checkpoints; {model_dir} is neither")
        return None, None
    if qc.get("dequantize"):
        if asked == "fp8":
            raise OptionError(f"{model_dir}/config.json asks for dequantize: --quantized-compute fp8 cannot apply")
        return "dequantized", "config.json asks for dequantize"
    blocker = fp8.gemm_blocker(device, dtype, qc.get("weight_block_size"), qc.get("activation_scheme", "dynamic"))
    if asked == "fp8" and blocker is not None:
        raise OptionError(f"--quantized-compute fp8 cannot run here: {blocker}; use --quantized-compute dequantized")
    if asked is not None:
        return asked, None
    return ("fp8", None) if blocker is None else ("dequantized", blocker)


# ---------------------------------------------------------------- remote code -> the native class


def _native_config(config: dict, composite: LanguageModel | None = None) -> tuple[Any, tuple[str, ...]]:
    """A native config object where config.json points at code transformers has natively but would
    not pick by itself (a model type it does not know, or an ``auto_map`` that ``trust_remote_code``
    would follow), or where ``config`` is the language model of a ``composite`` (transformers' own
    reading would load the whole composite); (None, ()) where transformers' own reading is right or
    it lacks the model."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_type = config.get("model_type")
    auto_map = config.get("auto_map") or {}
    architecture = (config.get("architectures") or [None])[0]
    known = isinstance(model_type, str) and model_type in CONFIG_MAPPING
    if known and not auto_map and composite is None:
        return None, ()
    if known:  # a type transformers has, with the repository's code beside it
        config_class = CONFIG_MAPPING[model_type]
    else:  # a type it does not know: the architecture's own config, if it has the architecture
        cls = getattr(transformers, architecture, None) if isinstance(architecture, str) else None
        config_class = getattr(cls, "config_class", None)
    native_type = getattr(config_class, "model_type", None)
    if not native_type or config_class not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return None, ()  # transformers lacks it: --trust-remote-code is the opt-in
    fields = {k: v for k, v in config.items() if k not in ("auto_map", "model_type")}
    native = config_class.from_dict(fields)
    runs = MODEL_FOR_CAUSAL_LM_MAPPING[config_class].__name__
    refs = list(auto_map.values())
    said = model_type if known else f"model type {model_type}"
    note = f"{said} with architecture {architecture} runs on transformers' own {runs} ({native_type})"
    if composite is not None:
        refs += list((read_config(composite.model_dir).get("auto_map") or {}).values())
        others = ", ".join(composite.other_parts) or "nothing else"
        note = f"language model of {composite.composite} on transformers' {runs} ({said} as {native_type})"
        note += f"; {others} not loaded"
    code = sorted({str(ref).split("--")[-1].split(".")[0] for ref in refs if isinstance(ref, str)})
    if code:
        note += f"; the repository's code ({', '.join(f'{c}.py' for c in code)}) is not run"
    return native, (note,)


# ---------------------------------------------------------------- quantized weights


def _stored_experts(lm: LanguageModel, native: Any, qc: dict, device: str, dtype: str) -> tuple[Any, Any, str] | None:
    """(native config without its quantization, format, note) where hsx keeps the routed experts as
    stored (``hsx.capture.quantized``: they are the checkpoint's only quantized weights, by the
    tensor names, ``held_experts``); None otherwise."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from hsx.capture.quantized import int4

    if held_experts(lm) is None:
        return None
    model_type = lm.config.get("model_type")
    if native is None and model_type not in CONFIG_MAPPING:
        raise UnsupportedModel(
            f"{lm.model_dir}: INT4-packed routed experts are kept packed on transformers' own classes only, "
            f"and transformers has no {lm.architecture}"
        )
    if importlib.util.find_spec("compressed_tensors") is None:
        raise UnsupportedModel(
            "this is a compressed-tensors checkpoint: install the compressed-tensors package to load it"
        )
    fmt = int4.Int4Experts(group_size=int4_group(qc))
    fields = {k: v for k, v in lm.config.items() if k not in ("quantization_config", "auto_map", "model_type")}
    config_class = type(native) if native is not None else CONFIG_MAPPING[model_type]
    note = (
        f"compressed-tensors INT4 routed experts (group {fmt.group_size}) stay packed on {device} and are expanded to "
        f"{dtype} per layer just before it runs; every other weight is loaded in {dtype}"
    )
    return config_class.from_dict(fields), fmt, note


def _quantization(
    model_dir: Path, qc: dict, device: str, dtype: str, compute: str | None
) -> tuple[Any, bool, bool, tuple[str, ...]]:
    import transformers
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

    method = qc.get("quant_method") or bnb_method(qc)
    if method not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        raise UnsupportedModel(
            f"{model_dir}/config.json: quantization method {method!r} is not one transformers "
            f"{transformers.__version__} implements (it would load the stored integers as weights); "
            "use a checkpoint in a format it implements, or a backend that reads this one"
        )
    if method in FP8_METHODS:
        return _fp8(model_dir, qc, device, dtype, compute)
    if method == "compressed-tensors":
        if importlib.util.find_spec("compressed_tensors") is None:
            raise UnsupportedModel(
                f"{model_dir} is a compressed-tensors checkpoint: install the compressed-tensors package to load it"
            )
        if device.startswith("cuda"):
            note = f"compressed-tensors weights ({qc.get('format', '?')}) load through transformers' quantizer"
            return None, False, False, (note,)
        from transformers import CompressedTensorsConfig

        config = CompressedTensorsConfig.from_dict(dict(qc))
        config.run_compressed = False
        return config, True, False, (f"compressed-tensors weights are decompressed to {dtype} at load on {device}",)
    return None, False, False, (f"{method} weights load through transformers' {method} quantizer",)


def _fp8(
    model_dir: Path, qc: dict, device: str, dtype: str, compute: str | None
) -> tuple[Any, bool, bool, tuple[str, ...]]:
    from transformers import FineGrainedFP8Config

    block = qc.get("weight_block_size")
    what = f"fp8 weights ({'block ' + 'x'.join(map(str, block)) if block else 'per tensor'} scales)"
    compute, why = compute_choice(model_dir, device, dtype, compute)
    config = FineGrainedFP8Config.from_dict(dict(qc))  # loading attributes override the checkpoint's
    if compute == "fp8":
        config.dequantize = False
        note = (
            f"quantized compute fp8: {what} stay FP8 on {device}; linear layers run on torch's block-scaled "
            "FP8 GEMM, their inputs quantized per token and 128 columns; routed experts are expanded to "
            f"{dtype} just before their layer runs"
        )
        return config, False, False, (note,)
    config.dequantize = True
    why = why or "asked for"
    note = (
        f"quantized compute dequantized ({why}, so hsx passes dequantize=True): {what} are each weight's "
        f"stored values times its block's scale, in {dtype}; no activation quantization, and the weights "
        "take their dtype's memory"
    )
    partial = _partial_blocks(model_dir, block) if block else []
    notes = (note,)
    if partial:
        name, shape = partial[0]
        notes += (
            f"{len(partial)} block-scaled weight(s) are not whole {block[0]}x{block[1]} blocks (e.g. {name} "
            f"{shape}); transformers would derive their block from the scale grid, so hsx applies the scales "
            "by the configured block",
        )
    return config, True, bool(partial), notes


def _partial_blocks(model_dir: Path, block: list[int]) -> list[tuple[str, list[int]]]:
    """Block-scaled weights (those with a ``weight_scale_inv``) whose last two dims are not whole
    blocks, as (name, shape), from the safetensors headers."""
    from hsx.errors import BadFile
    from hsx.store.format import safetensors_header

    rows, cols = block
    out = []
    for path in sorted(model_dir.rglob("*.safetensors")):
        with open(path, "rb") as f:
            try:
                header, _ = safetensors_header(f, os.fstat(f.fileno()).st_size, max_header=100 << 20)
            except BadFile:
                continue
        for name in header:
            if not name.endswith("_scale_inv"):
                continue
            shape = (header.get(name.removesuffix("_scale_inv")) or {}).get("shape") or []
            if len(shape) >= 2 and (shape[-2] % rows or shape[-1] % cols):
                out.append((name.removesuffix("_scale_inv"), shape))
    return sorted(out)


def exact_block_dequantization() -> None:
    """Make transformers' FP8 dequantization apply each scale to its configured block. Its own
    (``Fp8Dequantize._dequantize_one``) takes the block as shape / scale grid, which is the block
    only where the shape is a whole number of blocks; the replacement hands every other call (whole
    blocks, FP4, ue8m0 scales, per-tensor scales) to the original, so nothing else changes."""
    from transformers.integrations import finegrained_fp8

    from hsx.capture.quantized.fp8 import dequantize_blocks

    op = getattr(finegrained_fp8, "Fp8Dequantize", None)
    original = getattr(op, "_dequantize_one", None)
    if original is None:
        raise UnsupportedModel(
            "this checkpoint has block-scaled weights that are not whole blocks, and this transformers "
            "version has no dequantization hsx can correct: use another transformers version"
        )
    if getattr(original, "hsx_exact", False):
        return

    def dequantize_one(self, quantized, scales, output_dtype=None):
        config = getattr(getattr(self, "hf_quantizer", None), "quantization_config", None)
        block = getattr(config, "weight_block_size", None)
        # FP8 values, or (transformers 5.17) those values already cast to the model's dtype, which
        # holds them exactly; FP4 comes packed in integers and goes to the original
        values = quantized.dtype.is_floating_point
        if block and values and scales.dim() >= 2 and scales.dtype.is_floating_point and scales.element_size() >= 2:
            rows, cols = quantized.shape[-2:]
            grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
            if (rows % block[0] or cols % block[1]) and tuple(scales.shape[-2:]) == grid:
                return dequantize_blocks(quantized, scales, tuple(block), output_dtype or scales.dtype)
        return original(self, quantized, scales, output_dtype)

    dequantize_one.hsx_exact = True
    op._dequantize_one = dequantize_one
