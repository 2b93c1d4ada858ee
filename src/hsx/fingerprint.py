"""Content fingerprints: what makes a model, a tokenizer or a data file "the same" across a resume.

All digests are xxh3-128 in hex. A model is identified by its config and, for each weight file, its
name, size, safetensors header and 16 evenly spaced 4 KiB probes of its data (cheap: reads ~64 KiB per
file, yet catches a retrained or swapped checkpoint of the same shapes); ``full=True`` hashes every byte.
The probes see a few KiB of the data at most and miss small tensors: a quantized checkpoint's
scales (fine-grained FP8's per-block ``weight_scale_inv``, compressed-tensors' ``weight_scale`` /
``weight_zero_point``...) decide its weights as much as the stored integers do, so every tensor of a
safetensors file whose name says it is one is hashed whole as well (``WeightFile.scales``).

The probes cannot see every tensor (one scaled by 1.5 between them went unnoticed), so a run also
keeps ``ModelFiles``: every file of the model folder by its identity on disk (size, mtime, inode)
and its full digest, computed at once for the small files (config, tokenizer, chat template) and in
the background of the first run for the weights (``target.check_files``, ``target.Digests``).
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path

import xxhash
from pydantic import BaseModel

CHUNK = 8 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def digest_bytes(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def digest_json(obj: object) -> str:
    return digest_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


def digest_file(path: Path, stop: Callable[[], bool] = lambda: False) -> str | None:
    """The file's digest; None where ``stop`` said so between two chunks."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            if stop():
                return None
    return h.hexdigest()


class WeightFile(BaseModel):
    name: str
    size: int
    header: str  # digest of header + probes, or of the whole file when ``full``
    # digest of every quantization scale tensor of a safetensors file (names and bytes), None
    # where it has none; fingerprints made before hsx hashed them have None too, and are not compared
    scales: str | None = None


class ModelFingerprint(BaseModel):
    config: str
    weights: list[WeightFile]

    def differences(self, other: ModelFingerprint) -> list[str]:
        out = []
        if self.config != other.config:
            out.append("config.json differs")
        mine = {w.name: w for w in self.weights}
        theirs = {w.name: w for w in other.weights}
        for name in sorted(mine.keys() - theirs.keys()):
            out.append(f"weight file {name} missing")
        for name in sorted(theirs.keys() - mine.keys()):
            out.append(f"unexpected weight file {name}")
        for name in sorted(mine.keys() & theirs.keys()):
            a, b = mine[name], theirs[name]
            if a.size != b.size:
                out.append(f"{name}: size {b.size} != {a.size}")
            elif a.header != b.header:
                out.append(f"{name}: content differs")
            elif a.scales is not None and b.scales is not None and a.scales != b.scales:
                out.append(f"{name}: quantization scales differ")
        return out


PROBES, PROBE_BYTES = 16, 4096


def probe_digest(path: Path) -> str:
    """Digest of the first 8 bytes, the header they announce (as safetensors frames it) and the
    probes after it. Run specs store these values, so the bytes hashed are fixed: weight files of
    any kind (.bin, .gguf too) go through here and the header is hashed, never parsed, which is
    why the safetensors reader of ``hsx.store.format`` (it parses, and refuses non-safetensors
    files) is not used."""
    h = xxhash.xxh3_128()
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        h.update(raw)
        start = 8
        if len(raw) == 8:
            (n,) = struct.unpack("<Q", raw)
            h.update(f.read(min(n, 100 << 20)))
            start = 8 + n
        span = max(size - start - PROBE_BYTES, 0)
        for i in range(PROBES):
            f.seek(start + span * i // (PROBES - 1))
            h.update(f.read(PROBE_BYTES))
    return h.hexdigest()


# the last part of a tensor's name, for the tensors quantization methods store beside their weights
SCALE_NAME = re.compile(r"(scale|zero_point|zeros|g_idx)[^.]*$")
MAX_SCALE_BYTES = 64 << 20  # a tensor this large is a weight whatever its name; the probes sample it


def _scales_digest(path: Path) -> str | None:
    """Digest of the names and bytes of every scale tensor in a safetensors file, in name order;
    None where it has none (or is not a readable safetensors file: ``header`` covers that)."""
    from hsx.errors import BadFile
    from hsx.store.format import safetensors_header  # the one reader (it parses: safetensors files only)

    with open(path, "rb") as f:
        try:
            header, start = safetensors_header(f, os.fstat(f.fileno()).st_size, max_header=100 << 20)
        except BadFile:
            return None
        spans = []
        for name, entry in header.items():
            if name == "__metadata__" or not isinstance(entry, dict) or not SCALE_NAME.search(name):
                continue
            begin, end = entry.get("data_offsets", (0, 0))
            if 0 < end - begin <= MAX_SCALE_BYTES:
                spans.append((name, begin, end))
        if not spans:
            return None
        h = xxhash.xxh3_128()
        for name, begin, end in sorted(spans):
            f.seek(start + begin)
            h.update(name.encode() + b"\0")
            h.update(f.read(end - begin))
    return h.hexdigest()


def config_digest(model_dir: Path) -> str:
    """The model's config.json, but for the transformers version that saved it."""
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("transformers_version", None)
    return digest_json(config)


def model_fingerprint(model_dir: Path, full: bool = False) -> ModelFingerprint:
    weights = []
    for path in sorted(model_dir.rglob("*")):
        if not path.is_file() or not path.name.endswith(WEIGHT_SUFFIXES):
            continue
        header = digest_file(path) if full else probe_digest(path)
        scales = _scales_digest(path) if path.name.endswith(".safetensors") else None
        name = str(path.relative_to(model_dir))
        weights.append(WeightFile(name=name, size=path.stat().st_size, header=header, scales=scales))
    return ModelFingerprint(config=config_digest(model_dir), weights=weights)


class FileState(BaseModel):
    """One file of a model folder: how it stands on disk (an edit, a copy or a move changes one of
    these), and its full digest once computed (None for a weight file not hashed yet)."""

    size: int
    mtime_ns: int
    inode: int
    digest: str | None = None
    ctime_ns: int | None = None  # an edit in place that restores size and mtime still moves it (None: older records)

    def same_place(self, other: FileState) -> bool:
        """Unchanged on disk since ``other`` was recorded: its digest needs no reading again. The
        ctime is the kernel's own (no call sets it), so an edit that keeps size, mtime and inode shows."""
        place = (self.size, self.mtime_ns, self.inode) == (other.size, other.mtime_ns, other.inode)
        return place and (self.ctime_ns is None or other.ctime_ns is None or self.ctime_ns == other.ctime_ns)


class ModelFiles(BaseModel):
    """Every file of a model folder (path relative to it), as ``model_files`` records it."""

    files: dict[str, FileState]


SMALL_FILE = 64 << 20  # a file smaller than this is hashed whole when the run records it


def is_weight(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES)


def file_state(path: Path, digest: str | None = None) -> FileState:
    st = path.stat()
    return FileState(size=st.st_size, mtime_ns=st.st_mtime_ns, inode=st.st_ino, digest=digest, ctime_ns=st.st_ctime_ns)


def model_files_listing(model_dir: Path) -> list[str]:
    """The model folder's files, relative to it (a hub cache's or git's own hidden files are not the model's)."""
    out = []
    for path in sorted(model_dir.rglob("*")):
        rel = path.relative_to(model_dir)
        if path.is_file() and not any(part.startswith(".") for part in rel.parts):
            out.append(str(rel))
    return out


def model_files(model_dir: Path) -> ModelFiles:
    """The model folder's files as they stand, each smaller than ``SMALL_FILE`` with its full
    digest (config, tokenizer, template: milliseconds), the larger ones (weight shards) by their
    state alone: their digests come later, in the background (``target.Digests``)."""
    out = {}
    for name in model_files_listing(model_dir):
        path = model_dir / name
        small = path.stat().st_size < SMALL_FILE
        out[name] = file_state(path, digest_file(path) if small else None)
    return ModelFiles(files=out)
