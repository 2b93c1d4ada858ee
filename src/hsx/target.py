"""The target model: where its files are and what identifies it (config, weights, tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

from hsx.errors import ModelChanged, ModelNotFound
from hsx.fingerprint import digest_bytes, digest_json, model_fingerprint
from hsx.spec import ModelIdentity, RunSpec, TokenizerIdentity, model_location


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
    config = json.loads((model_dir / "config.json").read_text())
    return config.get("text_config", config) | {"architectures": config.get("architectures", ["?"])}


def identity(model: str, model_dir: Path) -> ModelIdentity:
    from hsx.capture import checkpoint  # the capture package loads torch: not for hsx status

    config = load_config(model_dir)
    return ModelIdentity(
        path=location(model),
        architecture=config["architectures"][0],
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=int(config["hidden_size"]),
        fingerprint=model_fingerprint(model_dir),
        quantization=checkpoint.quantization_of(model_dir),
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


def model_dir_for(run: Path, spec: RunSpec, given: str | None = None, checked: bool = False) -> Path:
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
