"""The per-sample file: plain safetensors, self-verifying, written without copies.

    [8 bytes: header length n, little endian][n bytes: JSON header, space padded to 8][data]

Tensors, in data order: ``aux_hidden_states`` [T, L*H] and ``hidden_states`` [T, H] in the model's
dtype, ``input_ids`` [T] int64, ``loss_mask`` [T] uint8. No padding tokens are stored.
``__metadata__`` (all strings): ``format``, ``sample_id``, ``num_tokens``, ``layers`` (JSON list of
hsx layer ids), ``layer_convention``, ``final_state``, ``digest`` = ``xxh3_128:<hex>`` of the data
section. Cheap check: the header parses and the file size matches it. Deep check: the digest.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

FORMAT = "hsx-sample/1"
LAYER_CONVENTION = "hsx/1: layer k = output of decoder layer k (0-based) = HF hidden_states[k+1]"
FINAL_STATE = "last decoder layer output after the final norm"
MAX_HEADER = 1 << 20

_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
}


def _bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


@dataclass
class SampleTensors:
    """One sample's host-side tensors, ready to be written."""

    sample_id: int
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # uint8 [T]
    aux: torch.Tensor  # [T, L*H]
    final: torch.Tensor  # [T, H]

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [
            ("aux_hidden_states", self.aux),
            ("hidden_states", self.final),
            ("input_ids", self.input_ids),
            ("loss_mask", self.loss_mask),
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors())


def encode(sample: SampleTensors, layers: list[int]) -> tuple[list[memoryview | bytes], str]:
    """The file's parts (header, then each tensor's bytes) and the data digest."""
    views = [(name, t, _bytes(t)) for name, t in sample.tensors()]
    h = xxhash.xxh3_128()
    for _, _, view in views:
        h.update(view)
    digest = f"xxh3_128:{h.hexdigest()}"
    header: dict = {
        "__metadata__": {
            "format": FORMAT,
            "sample_id": str(sample.sample_id),
            "num_tokens": str(sample.input_ids.shape[0]),
            "layers": json.dumps(layers),
            "layer_convention": LAYER_CONVENTION,
            "final_state": FINAL_STATE,
            "digest": digest,
        }
    }
    offset = 0
    for name, t, view in views:
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + view.nbytes],
        }
        offset += view.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return [struct.pack("<Q", len(raw)) + raw] + [v for _, _, v in views], digest


class BadFile(Exception):
    """Why a sample file is not valid; ``kind`` is truncated | corrupt | misplaced."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


@dataclass(frozen=True)
class Header:
    metadata: dict[str, str]
    tensors: dict[str, dict]
    data_start: int
    data_size: int

    @property
    def sample_id(self) -> int:
        return int(self.metadata["sample_id"])

    @property
    def digest(self) -> str:
        return self.metadata["digest"]

    @property
    def num_tokens(self) -> int:
        return int(self.metadata["num_tokens"])


def read_header(path: Path) -> Header:
    """Parse and sanity-check the header (the cheap check, minus the id match)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) < 8:
            raise BadFile("truncated", f"{size} bytes, shorter than a header")
        (n,) = struct.unpack("<Q", raw)
        if n == 0 or n > MAX_HEADER or 8 + n > size:
            raise BadFile("truncated" if 8 + n > size and n <= MAX_HEADER else "corrupt", f"header length {n}")
        try:
            header = json.loads(f.read(n))
            metadata = header.pop("__metadata__")
            if metadata.get("format") != FORMAT:
                raise ValueError(f"format {metadata.get('format')!r}")
            ends = sorted((v["data_offsets"][0], v["data_offsets"][1]) for v in header.values())
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise BadFile("corrupt", f"header does not parse ({e})") from e
    pos = 0
    for lo, hi in ends:
        if lo != pos or hi < lo:
            raise BadFile("corrupt", "tensor offsets are not contiguous")
        pos = hi
    if size != 8 + n + pos:
        kind = "truncated" if size < 8 + n + pos else "corrupt"
        raise BadFile(kind, f"size {size} != {8 + n + pos} from its header")
    return Header(metadata, header, 8 + n, pos)


def _checked_header(path: Path, expected_id: int) -> Header:
    header = read_header(path)
    if header.sample_id != expected_id:
        raise BadFile("misplaced", f"holds sample {header.sample_id}, expected {expected_id}")
    return header


def _match(header: Header, h) -> None:
    if f"xxh3_128:{h.hexdigest()}" != header.digest:
        raise BadFile("corrupt", "digest mismatch")


def check(path: Path, expected_id: int, deep: bool) -> Header:
    """Verify one file; raise ``BadFile`` on any problem, return its header when it is good.
    The deep check streams the data (bounded memory); ``read_checked`` keeps it."""
    header = _checked_header(path, expected_id)
    if deep:
        h = xxhash.xxh3_128()
        with open(path, "rb") as f:
            f.seek(header.data_start)
            while chunk := f.read(16 << 20):
                h.update(chunk)
        _match(header, h)
    return header


def read_checked(path: Path, expected_id: int) -> bytes:
    """The whole file after the deep check, for a reader that wants the tensors too (one read)."""
    header = _checked_header(path, expected_id)
    raw = path.read_bytes()
    if len(raw) != header.data_start + header.data_size:
        raise BadFile("truncated", f"{path} changed size while being read")
    _match(header, xxhash.xxh3_128(memoryview(raw)[header.data_start :]))
    return raw
