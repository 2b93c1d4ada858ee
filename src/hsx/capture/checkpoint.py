"""How to load a checkpoint as its publisher released it: the one place that reads a model folder's
config.json for what ``from_pretrained`` needs beyond the weights, and says what it decided.

Two kinds of released checkpoint need more than ``AutoModelForCausalLM.from_pretrained(folder)``:

- Quantized weights (config.json carries a ``quantization_config``): they load through transformers'
  own quantizer, and its TP/EP plans, as the checkpoint asks. Fine-grained FP8 with block scales
  (``quant_method: fp8``, ``weight_block_size: [128, 128]``: float8_e4m3fn weights and a float32
  ``weight_scale_inv`` per block, as DeepSeek-V3 and Kimi-K2 are released) runs transformers' FP8
  kernels on a CUDA device that has them (compute capability 8.9 or more, the kernel loadable).
  Elsewhere (CPU, older GPUs, no kernel) hsx asks for ``dequantize=True`` itself, rather than leave
  it to transformers (which does so on a machine without a GPU, but on a GPU machine would load FP8
  layers that ``--device cpu`` cannot run): each weight is multiplied out to the run's dtype at load.
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

``quantization_of`` is what the run spec records (``ModelIdentity.quantization``); ``plan`` is the
decision for one device, ``load_kwargs`` carries it out (notes logged) for ``from_pretrained``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx.errors import UnsupportedModel
from hsx.spec import Quantization

log = logging.getLogger("hsx.checkpoint")

FP8_METHODS = ("fp8", "mxfp8")  # transformers' FineGrainedFP8Config reads both


def read_config(model_dir: Path) -> dict:
    """config.json as it is (top level: a composite model's quantization_config sits there)."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def quantization_of(model_dir: Path) -> Quantization | None:
    """The checkpoint's quantization as config.json states it, None for unquantized weights."""
    qc = read_config(model_dir).get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method") or _bnb_method(qc) or "?")
    return Quantization(method=method, config=qc, experts=_held_experts(Path(model_dir), read_config(model_dir), qc))


def _bnb_method(qc: dict) -> str | None:
    if qc.get("load_in_4bit"):
        return "bitsandbytes_4bit"
    if qc.get("load_in_8bit"):
        return "bitsandbytes_8bit"
    return None


@dataclass(frozen=True)
class LoadPlan:
    """What ``from_pretrained`` needs beyond the folder for one checkpoint on one device."""

    config: Any = None  # a native transformers config read from config.json, replacing transformers' own reading
    quantization_config: Any = None  # the checkpoint's quantization config with hsx's loading attributes
    dequantize: bool = False  # quantized weights expanded to the run's dtype at load (no quantized kernels)
    exact_blocks: bool = False  # some block-scaled weights are not whole blocks: hsx applies their scales
    notes: tuple[str, ...] = field(default_factory=tuple)  # one line per decision, for the log
    experts: Any = None  # an ExpertFormat: routed experts kept as stored, expanded per layer (capture.quantized)

    def kwargs(self) -> dict:
        out: dict = {}
        if self.config is not None:
            out["config"] = self.config
        if self.quantization_config is not None:
            out["quantization_config"] = self.quantization_config
        return out


def plan(model_dir: Path, device: str, dtype: str = "float32") -> LoadPlan:
    """How to load the checkpoint in ``model_dir`` onto ``device`` in ``dtype`` (a --dtype name).
    Raises ``UnsupportedModel`` for a quantization transformers cannot load here."""
    config = read_config(model_dir)
    native, notes = _native_config(config)
    qc = config.get("quantization_config")
    if not qc:
        return LoadPlan(config=native, notes=notes)
    stored = _stored_experts(Path(model_dir), config, qc, device, dtype)
    if stored is not None:
        return LoadPlan(config=stored[0], experts=stored[1], notes=(*notes, stored[2]))
    quant, dequantize, exact, more = _quantization(Path(model_dir), qc, device, dtype)
    return LoadPlan(native, quant, dequantize, exact, notes + more)


def load_kwargs(model_dir: Path, device: str, dtype: str = "float32") -> dict:
    """The plan's ``from_pretrained`` keyword arguments (see ``prepared``)."""
    return prepared(model_dir, device, dtype).kwargs()


def prepared(model_dir: Path, device: str, dtype: str = "float32") -> LoadPlan:
    """The plan, its notes logged; where the plan needs it, transformers' FP8 dequantization is
    first made exact for partial blocks (idempotent)."""
    p = plan(model_dir, device, dtype)
    for note in p.notes:
        log.warning("checkpoint: %s", note)
    if p.exact_blocks:
        exact_block_dequantization()
    return p


# ---------------------------------------------------------------- remote code -> the native class


def _native_config(config: dict) -> tuple[Any, tuple[str, ...]]:
    """A native config object where config.json points at code transformers has natively but would
    not pick by itself (a model type it does not know, or an ``auto_map`` that ``trust_remote_code``
    would follow); (None, ()) where transformers' own reading is right or it lacks the model."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_type = config.get("model_type")
    auto_map = config.get("auto_map") or {}
    architecture = (config.get("architectures") or [None])[0]
    known = isinstance(model_type, str) and model_type in CONFIG_MAPPING
    if known and not auto_map:
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
    code = sorted({str(ref).split("--")[-1].split(".")[0] for ref in auto_map.values() if isinstance(ref, str)})
    said = model_type if known else f"model type {model_type}"
    note = f"{said} with architecture {architecture} runs on transformers' own {runs} ({native_type})"
    if code:
        note += f"; the repository's code ({', '.join(f'{c}.py' for c in code)}) is not run"
    return native, (note,)


# ---------------------------------------------------------------- quantized weights


def _expert_format(model_dir: Path, config: dict, qc: dict):
    """The ``ExpertFormat`` hsx keeps this checkpoint's routed experts in, where they are its only
    quantized weights (by the tensor names) and transformers has the architecture; else None."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from hsx.capture.quantized import experts, int4

    group = int4.routed_experts_int4(qc)
    if group is None or (_native_config(config)[0] is None and config.get("model_type") not in CONFIG_MAPPING):
        return None
    packed = [k for k in experts.weight_files(model_dir) if k.endswith(".weight_packed")]
    if not packed or not all(experts.ROUTED.search(k) for k in packed):
        return None
    return int4.Int4Experts(group_size=group)


def _held_experts(model_dir: Path, config: dict, qc: dict) -> str | None:
    fmt = _expert_format(model_dir, config, qc)
    return None if fmt is None else f"{fmt.name} group {fmt.group_size}"


def _stored_experts(model_dir: Path, config: dict, qc: dict, device: str, dtype: str) -> tuple[Any, Any, str] | None:
    """(native config without its quantization, format, note) where hsx keeps the routed experts as
    stored (``hsx.capture.quantized``); None otherwise."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    fmt = _expert_format(model_dir, config, qc)
    if fmt is None:
        return None
    native, _ = _native_config(config)
    if importlib.util.find_spec("compressed_tensors") is None:
        raise UnsupportedModel(
            "this is a compressed-tensors checkpoint: install the compressed-tensors package to load it"
        )
    fields = {k: v for k, v in config.items() if k not in ("quantization_config", "auto_map", "model_type")}
    config_class = type(native) if native is not None else CONFIG_MAPPING[config["model_type"]]
    note = (
        f"compressed-tensors INT4 routed experts (group {fmt.group_size}) stay packed on {device} and are expanded to "
        f"{dtype} per layer just before it runs; every other weight is loaded in {dtype}"
    )
    return config_class.from_dict(fields), fmt, note


def _quantization(model_dir: Path, qc: dict, device: str, dtype: str) -> tuple[Any, bool, bool, tuple[str, ...]]:
    import transformers
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

    method = qc.get("quant_method") or _bnb_method(qc)
    if method not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        raise UnsupportedModel(
            f"{model_dir}/config.json: quantization method {method!r} is not one transformers "
            f"{transformers.__version__} implements (it would load the stored integers as weights); "
            "use a checkpoint in a format it implements, or a backend that reads this one"
        )
    if method in FP8_METHODS:
        return _fp8(model_dir, qc, device, dtype)
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


def _fp8(model_dir: Path, qc: dict, device: str, dtype: str) -> tuple[Any, bool, bool, tuple[str, ...]]:
    from transformers import FineGrainedFP8Config

    block = qc.get("weight_block_size")
    what = f"fp8 weights ({'block ' + 'x'.join(map(str, block)) if block else 'per tensor'} scales)"
    if qc.get("dequantize"):
        config, why = None, "config.json asks for dequantize"
    else:
        reason = fp8_kernel_blocker(device)
        if reason is None:
            return None, False, False, (f"{what} run on transformers' FP8 kernels on {device}",)
        config = FineGrainedFP8Config.from_dict(dict(qc))  # loading attributes override the checkpoint's
        config.dequantize = True
        why = f"{reason}, so hsx passes dequantize=True"
    note = (
        f"{what} are dequantized ({why}): each weight is its stored values times its block's scale, "
        f"in {dtype}; the numbers differ from FP8 kernels' (no activation quantization) and the "
        "weights take their dtype's memory"
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


def fp8_kernel_blocker(device: str) -> str | None:
    """Why transformers' FP8 kernels cannot run on ``device`` (one line), or None where they can."""
    if not device.startswith("cuda"):
        return f"transformers has no FP8 kernels for {device}"
    import torch

    major, minor = torch.cuda.get_device_capability(torch.device(device))
    if (major, minor) < (8, 9):
        return f"compute capability {major}.{minor} < 8.9 has no FP8 kernels"
    try:
        from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel

        load_finegrained_fp8_kernel()
    except Exception as e:  # ImportError without the kernels package; a hub error offline
        first = (str(e).splitlines() or [type(e).__name__])[0]
        return f"transformers' FP8 kernel cannot be loaded here ({first[:200]})"
    return None


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


def dequantize_blocks(weight, scale_inv, block: tuple[int, int], dtype):
    """Block-scaled FP8 weights [..., N, K] times their scales [..., ceil(N/bn), ceil(K/bk)] (each
    scale covers a bn x bk block, the last row and column of blocks partial), in ``dtype``."""
    import torch

    rows, cols = weight.shape[-2:]
    scale = scale_inv.to(torch.float32)
    scale = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.to(torch.float32) * scale).to(dtype)


def exact_block_dequantization() -> None:
    """Make transformers' FP8 dequantization apply each scale to its configured block. Its own
    (``Fp8Dequantize._dequantize_one``) takes the block as shape / scale grid, which is the block
    only where the shape is a whole number of blocks; the replacement hands every other call (whole
    blocks, FP4, ue8m0 scales, per-tensor scales) to the original, so nothing else changes."""
    from transformers.integrations import finegrained_fp8

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
