"""The target model: where its files are and what identifies it (config, weights, tokenizer)."""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from hsx.errors import ModelChanged, ModelNotFound, RecordDamaged, TokenizerError, UnsupportedModel
from hsx.fingerprint import (
    FileState,
    ModelFiles,
    config_digest,
    digest_bytes,
    digest_file,
    digest_json,
    file_state,
    is_weight,
    model_files,
    model_files_listing,
    model_fingerprint,
    probe_digest,
)
from hsx.spec import JobSpec, ModelIdentity, Quantization, TokenizerIdentity, model_location
from hsx.store import layout
from hsx.store.records import read_record, write_record


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


# Model types whose ``num_hidden_layers`` counts sub-layers, with the field that counts decoder
# layers: LongCat-Flash's decoder layer holds two attention + MLP sub-layers, and SGLang's and
# vLLM's captures for its drafts index decoder layers, as hsx's layer ids do.
SUBLAYERED = {"longcat_flash": "num_layers"}


def decoder_layers(config) -> int:
    """The number of decoder layers (what a layer id counts) of a config.json dict or a config object."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    field = SUBLAYERED.get(str(get("model_type", "")), "num_hidden_layers")
    if get(field) is None:
        raise UnsupportedModel(f"the model's config has no {field}: its number of decoder layers is unknown")
    return int(get(field))


def layer_convention(config: dict) -> str:
    """What a run's layer ids mean for this model, as its spec records it: hsx's convention, and
    where the model's layers differ, how (DeepSeek-V4's streams, LongCat-Flash's sub-layers)."""
    from hsx.store.format import LAYER_CONVENTION

    notes = []
    if config.get("hc_mult"):
        notes.append(
            f"a tap is the mean over the layer output's {config['hc_mult']} hyper-connection streams, as SGLang "
            "captures it"
        )
    if (field := SUBLAYERED.get(str(config.get("model_type", "")))) is not None:
        notes.append(f"k counts decoder layers ({field}), each of two attention + MLP sub-layers")
    return "; ".join([LAYER_CONVENTION, *notes])


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
        num_layers=decoder_layers(config),
        hidden_size=int(config["hidden_size"]),
        fingerprint=model_fingerprint(model_dir),
        quantization=quantization_of(model_dir),
    )


def remote_tokenizer(model_dir: Path) -> str | None:
    """The repository's tokenizer class its ``tokenizer_config.json`` names by ``auto_map``
    (``tokenization_kimi.TikTokenTokenizer``), None where it names none."""
    try:
        config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    named = (config.get("auto_map") or {}).get("AutoTokenizer")
    named = next((n for n in named if n), None) if isinstance(named, list) else named
    return str(named).split("--")[-1] if named else None


def load_tokenizer(model_dir: Path, trust_remote_code: bool):
    """The checkpoint's own tokenizer, through its own class: a repository's (by ``auto_map``, under
    --trust-remote-code) as serving engines load it, slow (Python) ones such as Kimi's
    ``TikTokenTokenizer`` included. Refused by name, before anything is written, where that class is
    the repository's code and remote code is not allowed, or where its code does not import under the
    installed transformers (Kimi-K2's imports ``bytes_to_unicode`` from where transformers 5 no longer
    has it), with the fix. Never a stand-in: without the repository's code, transformers converts
    Kimi's ``tiktoken.model`` to a fast tokenizer whose template renders the tools as JSON, a prompt
    the target is never served."""
    import transformers
    from transformers import AutoTokenizer

    code = remote_tokenizer(model_dir)
    if code is not None and not trust_remote_code:
        raise TokenizerError(
            f"{model_dir}: the tokenizer is the repository's code ({code}, by auto_map in "
            "tokenizer_config.json): pass --trust-remote-code to run it (hsx runs the tokenizer's code only)"
        )
    try:
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except ImportError as e:
        if code is None:
            raise
        file = f"{code.rsplit('.', 1)[0]}.py"
        missing = re.search(r"cannot import name '(\w+)' from '([\w.]+)'", str(e))
        fix = (
            f"change that import in {file} to where transformers {transformers.__version__} has {missing[1]}"
            + (
                " (from transformers.convert_slow_tokenizer import bytes_to_unicode, as Kimi-K2.5's "
                "tokenization_kimi.py imports it)"
                if missing[1] == "bytes_to_unicode"
                else ""
            )
            if missing
            else "install what it names"
        )
        raise TokenizerError(
            f"{model_dir}: the repository's tokenizer code ({file}) does not import under transformers "
            f"{transformers.__version__}: {str(e).splitlines()[0]}. The fix: {fix}"
        ) from None


TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


def tokenizer_files(tokenizer) -> dict[str, str]:
    """The files of its folder the tokenizer was built from, by name, with their digests: its
    vocabulary files, its config and chat templates, and the repository code its ``auto_map`` names."""
    folder = Path(tokenizer.name_or_path)
    code = remote_tokenizer(folder)
    names = {*TOKENIZER_FILES, *tokenizer.vocab_files_names.values(), "tokenizer.json"}
    names |= {f"{code.rsplit('.', 1)[0]}.py"} if code else set()
    names |= {f"additional_chat_templates/{p.name}" for p in folder.glob("additional_chat_templates/*.jinja")}
    return {n: digest_file(folder / n) for n in sorted(names) if (folder / n).is_file()}


def tokenizer_identity(tokenizer) -> TokenizerIdentity:
    """What identifies the tokenizer a run planned with: its vocabulary and special tokens, its chat
    template (a repository's named templates, ``{name: template}``, as a whole), and which class
    and files it is (a slow tokenizer's vocabulary is read through its class: ``get_vocab``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    specials = tokenizer.special_tokens_map
    template = tokenizer.chat_template
    kind = type(tokenizer).__name__ + ("" if getattr(tokenizer, "is_fast", False) else " (slow)")
    code = remote_tokenizer(Path(tokenizer.name_or_path))
    return TokenizerIdentity(
        digest=digest_json({"vocab": digest_bytes(vocab.encode()), "special": specials}),
        chat_template=digest_json(template) if isinstance(template, dict) else digest_bytes((template or "").encode()),
        tokenizer_class=kind + (f", the repository's {code}" if code else ""),
        files=tokenizer_files(tokenizer),
    )


def model_dir_for(
    run: Path, spec: JobSpec, given: str | None = None, known: ModelIdentity | None = None, keep: bool = False
) -> Path:
    """Where the run's model is now: ``given`` (a --model), else where the run last recorded it
    (``spec.model_location``); refused unless it is the run's model: every file as the run
    recorded it (``check_files``), or, for a run made before hsx recorded them, its fingerprint
    (``known``: the identity of ``given`` the caller has read already). ``keep``: record the files'
    new places where they moved (for a run made before, the files of the model that proved the
    run's), only once they proved the same."""
    where = given or model_location(run, spec)
    try:
        path = resolve(where)
    except ModelNotFound as e:
        note = "" if given else relative_note(where)
        raise ModelNotFound(
            f"{e}; {note or 'if the model moved, pass --model NEW_PATH'} (it must match the run's fingerprint)"
        ) from e
    what = "the model changed since the run started" if given is None else f"{path} is not the run's model"
    if files_record(run, spec) is not None:
        diffs = check_files(run, spec, path, keep)
    else:
        diffs = spec.model.fingerprint.differences((known or identity(where, path)).fingerprint)
        if keep and not diffs:
            _write_files(run, model_files(path))
    if diffs:
        raise ModelChanged(f"{what}:\n  - " + "\n  - ".join(diffs))
    return path


def files_record(run: Path, spec: JobSpec) -> ModelFiles | None:
    """The run's record of its model's files (``OUT/model-files.json``); None for a run made
    before hsx kept one. Raises ``RecordDamaged`` where it is damaged, another run's, or missing
    from a run that keeps one: never trusted, nor read as none (the probes miss what it catches)."""
    path = run / layout.MODEL_FILES
    try:
        body = read_record(run, path)
        if body is None and spec.model_files:
            raise RecordDamaged(path, "missing")
        return None if body is None else ModelFiles.model_validate(body)
    except RecordDamaged as e:
        raise RecordDamaged(path, f"{e.why}; {REBUILD.format(run=run)}") from None
    except ValueError as e:
        raise RecordDamaged(path, f"garbled ({str(e).splitlines()[0]}); {REBUILD.format(run=run)}") from None


# the repair of a damaged or missing model-files.json: nothing in the run can prove the model unchanged
# without it, so a person vouches for the model, compared by the fingerprint's probes
REBUILD = (
    "without it nothing proves the model unchanged (the fingerprint's probes miss a tensor between them): "
    "restore it from a copy of the run, or, with the model known to be the run's, rebuild it: "
    "hsx verify {run} --repair --model PATH"
)


def rebuild_files(run: Path, spec: JobSpec, model: str) -> list[str]:
    """``hsx verify --repair --model``: a damaged or missing record rebuilt from ``model`` as it
    stands, once its fingerprint matched the spec's (the damaged one is kept beside, ``.damaged``);
    the differences where it does not (nothing is written then)."""
    model_dir = resolve(model)
    diffs = spec.model.fingerprint.differences(identity(model, model_dir).fingerprint)
    if not diffs:
        path = run / layout.MODEL_FILES
        if path.exists():
            os.replace(path, path.with_name(path.name + ".damaged"))
        _write_files(run, model_files(model_dir))
    return diffs


def record_files(run: Path, model_dir: Path) -> None:
    """A new run's record of its model's files, written once its spec is: small files with their
    digests, weights by where they stand (``Digests`` adds theirs in the background)."""
    _write_files(run, model_files(model_dir))


def _write_files(run: Path, record: ModelFiles) -> None:
    write_record(run, run / layout.MODEL_FILES, record.model_dump(mode="json"))


def check_files(run: Path, spec: JobSpec, model_dir: Path, keep: bool = False) -> list[str]:
    """How ``model_dir`` differs from the model the run recorded, file by file, at a cost that
    suits a checkpoint of a terabyte: a file that stands as recorded (size, mtime, inode) is not
    read; one that moved or changed is read whole where the run holds its full digest, else
    compared by the fingerprint's probes; a config, tokenizer or chat template file that changed
    is judged by what it means (the config's digest, the tokenizer's identity: the spec's).
    ``keep``: record where the files stand now, once they proved the same."""
    record = files_record(run, spec)
    assert record is not None  # the caller checked the run keeps one
    now: dict[str, FileState] = {}
    diffs: list[str] = []
    meaning = False  # a file other than the weights changed: judge the config and tokenizer
    probes = {w.name: w for w in spec.model.fingerprint.weights}
    for name in sorted(record.files.keys() | set(model_files_listing(model_dir))):
        then, path = record.files.get(name), model_dir / name
        if then is None or not path.is_file():
            diffs += [f"{'unexpected' if then is None else 'missing'} weight file {name}"] if is_weight(name) else []
            meaning = meaning or not is_weight(name)
            continue
        state = file_state(path, then.digest)
        if not state.same_place(then):
            if then.digest is not None:
                state.digest = digest_file(path)
                if state.digest != then.digest:
                    diffs += [f"{name}: content differs (full digest)"] if is_weight(name) else []
                    meaning = meaning or not is_weight(name)
            elif name in probes and probe_digest(path) != probes[name].header:
                diffs.append(f"{name}: content differs")
        now[name] = state
    if meaning:
        diffs += _meaning(spec, model_dir)
    if keep and not diffs and now != record.files:
        _write_files(run, ModelFiles(files=now))
    return diffs


class Digests:
    """The full digests the run's record lacks (its weights'), computed on a thread of their own
    while the job works, so that a terabyte is read once, beside the first run, not before it; a
    session that stops first leaves the rest to the next. A digest is kept only for a file that
    stands as recorded once it was read."""

    def __init__(self, run: Path, spec: JobSpec, model_dir: Path):
        self.run, self.spec, self.model_dir = run, spec, model_dir
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._hash, name="hsx-model-digests", daemon=True)

    def __enter__(self) -> Digests:
        record = files_record(self.run, self.spec)
        if record is not None and any(f.digest is None for f in record.files.values()):
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _hash(self) -> None:
        record = files_record(self.run, self.spec)
        if record is None:
            return
        for name, then in record.files.items():
            path = self.model_dir / name
            if then.digest is not None or not file_state(path).same_place(then):
                continue  # a file that moved since is compared, and recorded, by the next check_files
            digest = digest_file(path, self._stop.is_set)
            if digest is None:
                return
            if file_state(path).same_place(then):
                then.digest = digest
                _write_files(self.run, record)


def _meaning(spec: JobSpec, model_dir: Path) -> list[str]:
    """What a changed config, tokenizer or template file changes of the run: nothing, or these."""
    out = [] if config_digest(model_dir) == spec.model.fingerprint.config else ["config.json differs"]
    have = tokenizer_identity(load_tokenizer(model_dir, getattr(spec, "trust_remote_code", False)))
    if have.digest != spec.tokenizer.digest:
        out.append("tokenizer: vocabulary or special tokens differ")
    if have.chat_template != spec.tokenizer.chat_template:
        out.append("chat template differs")
    return out
