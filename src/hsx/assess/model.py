"""Is the model the run started with still there, unchanged, and can the spec's backend capture it?

Only fingerprints are compared (config, weight file names and sizes, safetensors headers and data
probes), as the spec records them, and the run's record of its files is stat'ed (what moved or was
touched, which the next resume reads whole): the model is never loaded. A hub id is looked up in the local
cache only, so ``hsx status`` never downloads anything.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import itertools
from pathlib import Path

from hsx.assess.checks import Check
from hsx.errors import UnsupportedModel
from hsx.extract.backends import BACKENDS
from hsx.fingerprint import ModelFiles, file_state, model_fingerprint
from hsx.spec import RunSpec
from hsx.target import decoder_layers, load_config, relative_note
from hsx.units import size


def _package(backend: str) -> str | None:
    """The package that must import for ``backend`` to run (``extract.backends``); None: no backend of hsx's."""
    found = BACKENDS.get(backend)
    return found.package if found else None


def locate(given: str) -> Path | None:
    """The model folder, from a local path or the local hub cache; None when it is not on this machine."""
    path = Path(given).expanduser()
    if path.is_dir():
        return path
    if path.exists() or given.startswith((".", "/", "~")) or given.count("/") != 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(given, local_files_only=True))
    except Exception:
        return None


def moved(files: ModelFiles, model_dir: Path) -> dict[str, int]:
    """The recorded files that no longer stand as the run recorded them (size, mtime, inode: one stat
    each, nothing read), with their sizes: the next resume reads each whole to prove it the same."""
    out = {}
    for name, then in files.files.items():
        path = model_dir / name
        if path.is_file() and not (now := file_state(path)).same_place(then):
            out[name] = now.size
    return out


def check_model(
    spec: RunSpec, model_dir: Path | None, where: str, recorded: bool = True, files: ModelFiles | None = None
) -> Check:
    """``where``: the path looked at, ``model_dir`` what it resolved to (None: not here).
    ``recorded``: ``where`` is the run's own record of its model (spec or model-location.json);
    False for ``hsx status --model PATH``, whose match is a resume with that --model away from
    being the run's. ``files``: the run's record of its model's files (None for a run made before)."""
    if model_dir is None:
        note = relative_note(where) if recorded else ""
        return Check(
            "model",
            "fail",
            f"{where}: not found from this directory" if note else f"{where}: not found on this machine",
            action=(note or "if it moved, resume with --model NEW_PATH")
            + " (the weights must match the run's fingerprint)",
            data={"path": where, "found": False},
        )
    try:
        now = model_fingerprint(model_dir)
    except (OSError, ValueError) as e:
        return Check("model", "fail", f"{model_dir}: unreadable ({e})", data={"path": str(model_dir), "found": True})
    diffs = spec.model.fingerprint.differences(now)
    total = sum(w.size for w in now.weights)
    data = {"path": str(model_dir), "found": True, "differences": diffs, "weight_bytes": total}
    if diffs:
        return Check(
            "model",
            "fail",
            f"{model_dir}: changed since the run started ({len(diffs)} difference{'s' if len(diffs) > 1 else ''})",
            details=diffs,
            action="restore the original weights, or point --model at a copy that matches the fingerprint",
            data=data,
        )
    figure = f"{model_dir}: config + {len(now.weights)} weight file(s), {size(total)}, match the fingerprint"
    touched = moved(files, model_dir) if files is not None else {}
    if touched:
        figure += (
            f"; {len(touched)} file(s), {size(sum(touched.values()))}, moved or touched since the run recorded"
            f" them ({', '.join(sorted(touched))}): the next resume reads them whole to check them"
        )
        data["moved"] = sorted(touched)
    if not recorded:
        return Check(
            "model",
            "warn",
            figure + "; the run does not look there yet",
            action=f"resume with --model {where}: it is recorded as the run's model",
            data=data,
        )
    return Check("model", "ok", figure, data=data)


def check_capture(spec: RunSpec, model_dir: Path | None, deep: bool = False) -> Check:
    """Can the spec's backend capture the model? ``deep`` imports the backend; otherwise (seconds
    count for ``hsx status``) its installed package is looked up and the model's class found in
    its source, without importing it."""
    module = _package(spec.backend)
    if module is None:
        return Check(
            "capture", "fail", f"unknown backend {spec.backend!r} in the run spec", data={"backend": spec.backend}
        )
    try:
        found = importlib.util.find_spec(module)
        if found is None or not found.submodule_search_locations:
            raise ImportError(f"no module named {module!r}")
        version = importlib.metadata.version(module)
        names = dir(importlib.import_module(module)) if deep else None  # the lazy module's names: no torch
    except Exception as e:
        return Check(
            "capture",
            "fail",
            f"backend {spec.backend}: cannot import {module} ({e})",
            action=f"install {module} in this environment",
            data={"backend": spec.backend, "importable": False},
        )
    data = {"backend": spec.backend, "version": version, "importable": True, "layers": spec.layers}
    if model_dir is None:
        return Check("capture", "warn", f"{module} {version} installed; layers not checked: model not found", data=data)
    try:
        config = load_config(model_dir)
        num_layers = decoder_layers(config)
    except (OSError, ValueError, KeyError, UnsupportedModel) as e:
        return Check("capture", "fail", f"config.json of {model_dir} unreadable ({e})", data=data)
    data["num_layers"] = num_layers
    bad = [k for k in spec.layers if not 0 <= k < num_layers]
    if bad:
        return Check(
            "capture",
            "fail",
            f"layers {bad} out of range: the model has {num_layers} decoder layers",
            action="the model is not the one the run was planned for",
            data=data,
        )
    arch = config["architectures"][0]
    has = arch in names if names is not None else _defines(Path(found.submodule_search_locations[0]), arch, config)
    if not spec.trust_remote_code and not has:
        return Check(
            "capture",
            "fail",
            f"{module} {version} has no {arch}",
            action=f"install the {module} version that supports {arch}",
            data=data,
        )
    return Check(
        "capture",
        "ok",
        f"{module} {version} ({arch}); layers {spec.layers} of {num_layers} decoder layers",
        data=data,
    )


def _defines(package: Path, arch: str, config: dict) -> bool:
    """Whether the installed package's source defines class ``arch``: first where transformers
    keeps the model type's code, then anywhere in the package."""
    want = f"class {arch}(".encode()
    folder = str(config.get("model_type", "")).replace("-", "_")
    first = sorted((package / "models" / folder).glob("modeling_*.py")) if folder else []
    return any(want in p.read_bytes() for p in itertools.chain(first, package.rglob("*.py")))


def check_engine(spec) -> Check:
    """A generate run's ``capture`` line: is the engine the run generated with installed, at its version?
    (Looked up, not imported; a server backend's engine runs elsewhere, and a resume checks it then.)"""
    engine = spec.engine
    data = {"backend": engine.name, "version": engine.version}
    module = _package(engine.name)
    if module is None:
        return Check(
            "capture", "ok", f"engine {engine.name} {engine.version}: checked when a resume connects", data=data
        )
    try:
        installed = importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return Check(
            "capture",
            "fail",
            f"engine {engine.name}: {module} is not installed",
            action=f"install {module} {engine.version}",
            data=data,
        )
    data["installed"] = installed
    if not engine.version.startswith(installed):
        return Check(
            "capture",
            "fail",
            f"engine {engine.name}: {module} {installed} installed, the run generated with {engine.version}",
            action=f"install {module} {engine.version}: a resume with another version is refused",
            data=data,
        )
    return Check("capture", "ok", f"engine {engine.name} {engine.version}, as the run generated with", data=data)
