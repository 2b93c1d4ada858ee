"""Content fingerprints: what makes a model, a tokenizer or a data file "the same" across a resume.

All digests are xxh3-128 in hex. A model is identified by its config and, for each weight file, its
name, size, safetensors header and 16 evenly spaced 4 KiB probes of its data (cheap: reads ~64 KiB per
file, yet catches a retrained or swapped checkpoint of the same shapes); ``full=True`` hashes every byte.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import xxhash
from pydantic import BaseModel

CHUNK = 8 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def digest_bytes(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def digest_json(obj: object) -> str:
    return digest_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


def digest_file(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


class WeightFile(BaseModel):
    name: str
    size: int
    header: str  # digest of header + probes, or of the whole file when ``full``


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
        return out


PROBES, PROBE_BYTES = 16, 4096


def _probe_digest(path: Path) -> str:
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


def model_fingerprint(model_dir: Path, full: bool = False) -> ModelFingerprint:
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("transformers_version", None)
    weights = []
    for path in sorted(model_dir.rglob("*")):
        if not path.is_file() or not path.name.endswith(WEIGHT_SUFFIXES):
            continue
        header = digest_file(path) if full else _probe_digest(path)
        weights.append(WeightFile(name=str(path.relative_to(model_dir)), size=path.stat().st_size, header=header))
    return ModelFingerprint(config=digest_json(config), weights=weights)
