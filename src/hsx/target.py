"""The target model: where its files are and what identifies it (config, weights, tokenizer)."""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from hsx.errors import ModelChanged, ModelNotFound, UnsupportedModel
from hsx.fingerprint import digest_bytes, digest_json, model_fingerprint
from hsx.spec import JobSpec, ModelIdentity, Quantization, TokenizerIdentity, model_location


def resolve(model: str) -> Path:
    """A local folder as given, or a Hugging Face hub id from the local cache (or a download)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{model}: folder has no config.json, not a Hugging Face model")
        return path.resolve()
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ModelNotFound(f"{model}: no such model folder")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model))
    except Exception as e:
        raise ModelNotFound(f"{model}: not a local folder and not available from the hub ({e})") from e


def location(model: str) -> str:
    """How a run records where its model is: a local folder as an absolute path (a resume, status or
    export from any directory finds it), a hub id as given."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.is_dir() else model


def relative_note(where: str) -> str:
    """Why a recorded model path may not be found from here: an older hsx stored a relative path as
    typed, which only resolves from the directory the run was made in ("" for an absolute one)."""
    if Path(where).expanduser().is_absolute():
        return ""
    what = (
        "is relative" if where.startswith(".") or where.count("/") != 1 else "is a hub id not found here, or relative"
    )
    return (
        f"the run's model path {where} {what} (an older hsx stored a folder as typed): run from the directory "
        "the run was made in, or pass --model PATH"
    )


def load_config(model_dir: Path) -> dict:
    """The config of the model hsx runs: the language model's (``LanguageModel.config``)."""
    return LanguageModel.of(model_dir).config


@dataclass(frozen=True)
class LanguageModel:
    """The part of a checkpoint hsx runs, and where the checkpoint keeps it: the one place that
    tells a composite checkpoint's language model from the rest (read from files, no torch).

    A composite (Kimi-K2.5: ``model_type: kimi_k25``, a vision tower, a projector) whose
    ``text_config`` names its own causal-LM architecture (``DeepseekV3ForCausalLM``) is run as that
    language model alone: its config is ``text_config``, its weights are the checkpoint's names
    under ``prefix`` (``language_model.``), and nothing else of the checkpoint is loaded. Any other
    checkpoint is its own language model (a composite whose text config names no architecture
    loads as transformers files it, ``composite`` None)."""

    model_dir: Path
    config: dict  # the language model's config.json fields; ``architectures`` what runs
    quantization: dict | None  # its quantization_config, wherever config.json puts it
    composite: str | None = None  # the composite's model type, where the language model is one part

    @classmethod
    def of(cls, model_dir: Path) -> LanguageModel:
        top = json.loads((Path(model_dir) / "config.json").read_text())
        text = top.get("text_config")
        if not isinstance(text, dict):
            return cls(
                Path(model_dir),
                top | {"architectures": top.get("architectures", ["?"])},
                top.get("quantization_config"),
            )
        quant = text.get("quantization_config") or top.get("quantization_config")
        own = text.get("architectures") or []
        if own and str(own[0]).endswith("ForCausalLM") and own != top.get("architectures"):
            return cls(Path(model_dir), dict(text), quant, str(top.get("model_type")))
        return cls(Path(model_dir), text | {"architectures": top.get("architectures", ["?"])}, quant)

    @property
    def architecture(self) -> str:
        return str(self.config["architectures"][0])

    @functools.cached_property
    def weights(self) -> dict[str, tuple[Path, dict]]:
        """The checkpoint's ``weight_table`` (read once)."""
        return weight_table(self.model_dir)

    @functools.cached_property
    def prefix(self) -> str:
        """What the language model's weight names carry in the checkpoint ("" for a plain causal LM):
        the one top-level name under which the weights are a causal LM's own (its base model under
        ``model.``, as transformers names it); read from the safetensors headers."""
        if self.composite is None or not self.weights:
            return ""  # a plain causal LM; or a shape folder, which has no weights to map
        tops = {name.split(".", 1)[0] for name in self.weights if "." in name}
        found = sorted(t for t in tops if any(n.startswith(f"{t}.model.") for n in self.weights))
        if len(found) != 1:
            raise UnsupportedModel(
                f"{self.model_dir}: cannot tell the language model's weights of this {self.composite} checkpoint "
                f"(a causal LM's weights under one top-level name; found {found or 'none'} among {sorted(tops)})"
            )
        return found[0] + "."

    @property
    def other_parts(self) -> list[str]:
        """The composite's top-level weight names that are not the language model's (not loaded)."""
        if self.composite is None:
            return []
        return sorted({n.split(".", 1)[0] for n in self.weights} - {self.prefix.rstrip(".")})


def weight_table(model_dir: Path) -> dict[str, tuple[Path, dict]]:
    """Tensor name -> (weight file, safetensors header entry: dtype, shape, data_offsets) over the
    checkpoint's files (those its index names, else every ``*.safetensors``); headers only, no
    weight is read. Empty for a folder without weights. Raises ``BadFile`` / ``OSError``."""
    from hsx.errors import BadFile
    from hsx.store.format import safetensors_header  # the one safetensors header reader

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({model_dir / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    out: dict[str, tuple[Path, dict]] = {}
    for path in files:
        with open(path, "rb") as f:
            try:
                header, _ = safetensors_header(f, os.fstat(f.fileno()).st_size, max_header=100_000_000)
            except BadFile as e:
                raise BadFile(e.kind, f"{path}: {e.detail}") from e
        header.pop("__metadata__", None)
        out.update((name, (path, entry)) for name, entry in header.items())
    return out


def quantization_of(model_dir: Path) -> Quantization | None:
    """The language model's quantization as config.json states it (at the top level or inside a
    composite's ``text_config``), None for unquantized weights."""
    qc = LanguageModel.of(model_dir).quantization
    if not qc:
        return None
    method = str(qc.get("quant_method") or bnb_method(qc) or "?")
    return Quantization(method=method, config=qc, experts=held_experts(LanguageModel.of(model_dir)))


INT4_BITS = 4
ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.(gate|up|down)_proj\.")  # a routed expert's projection, by name


def int4_group(qc: dict | None) -> int | None:
    """The group size where a ``quantization_config`` is compressed-tensors pack-quantized INT4,
    symmetric, group-wise, with one config group (the form Kimi-K2-Thinking / Kimi-K2.5 ship), else None."""
    if not qc or qc.get("quant_method") != "compressed-tensors" or qc.get("format") != "pack-quantized":
        return None
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        return None
    w = groups[0].get("weights") or {}
    if groups[0].get("input_activations") or w.get("num_bits") != INT4_BITS or w.get("type", "int") != "int":
        return None
    if not w.get("symmetric", True) or w.get("strategy") != "group" or not w.get("group_size"):
        return None
    if int(w["group_size"]) % (32 // INT4_BITS):
        return None  # a group that is not whole words
    return int(w["group_size"])


def held_experts(lm: LanguageModel) -> str | None:
    """How hsx holds the routed experts in device memory where they are the checkpoint's only
    quantized weights (``hsx.capture.quantized``): ``int4-packed group N``; None where the
    quantized weights load through transformers (or there are none). From the config and the
    safetensors headers alone, so that status and the spec need neither torch nor the weights."""
    group = int4_group(lm.quantization)
    if group is None:
        return None
    packed = [name for name in lm.weights if name.endswith(".weight_packed")]
    if not packed or not all(ROUTED_EXPERT.search(name) for name in packed):
        return None
    return f"int4-packed group {group}"


def bnb_method(qc: dict) -> str | None:
    if qc.get("load_in_4bit"):
        return "bitsandbytes_4bit"
    if qc.get("load_in_8bit"):
        return "bitsandbytes_8bit"
    return None


def identity(model: str, model_dir: Path) -> ModelIdentity:
    config = load_config(model_dir)
    return ModelIdentity(
        path=location(model),
        architecture=config["architectures"][0],
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=int(config["hidden_size"]),
        fingerprint=model_fingerprint(model_dir),
        quantization=quantization_of(model_dir),
    )


def load_tokenizer(model_dir: Path, trust_remote_code: bool):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)


def tokenizer_identity(tokenizer) -> TokenizerIdentity:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    specials = tokenizer.special_tokens_map
    return TokenizerIdentity(
        digest=digest_json({"vocab": digest_bytes(vocab.encode()), "special": specials}),
        chat_template=digest_bytes((tokenizer.chat_template or "").encode()),
    )


def model_dir_for(run: Path, spec: JobSpec, given: str | None = None, checked: bool = False) -> Path:
    """Where the run's model is now: ``given`` (a --model), else where the run last recorded it
    (``spec.model_location``); refused unless its fingerprint matches the run's (``checked``: the
    caller has just compared it, skip the re-read)."""
    where = given or model_location(run, spec)
    try:
        path = resolve(where)
    except ModelNotFound as e:
        note = "" if given else relative_note(where)
        raise ModelNotFound(
            f"{e}; {note or 'if the model moved, pass --model NEW_PATH'} (it must match the run's fingerprint)"
        ) from e
    if not checked:
        diffs = spec.model.fingerprint.differences(identity(where, path).fingerprint)
        if diffs:
            what = "the model changed since the run started" if given is None else f"{path} is not the run's model"
            raise ModelChanged(f"{what}:\n  - " + "\n  - ".join(diffs))
    return path
