"""The per-sample file: plain safetensors, self-verifying, written without copies.

    [8 bytes: header length n, little endian][n bytes: JSON header, space padded to 8][data]

Tensors, in data order: ``aux_hidden_states`` [T, L*H] and ``hidden_states`` [T, H] in the model's
dtype, ``input_ids`` [T] int64, ``loss_mask`` [T] uint8. No padding tokens are stored. A run with no
taps (``--layers mtp``) stores no ``aux_hidden_states``: the final state alone.
``__metadata__`` (all strings): ``format``, ``sample_id``, ``num_tokens``, ``layers`` (JSON list of
hsx layer ids), ``layer_convention``, ``final_state`` (the label of its norm: ``FINAL_STATES``, read
back by ``final_norm_of``), ``digest`` = ``xxh3_128:<hex>`` of the data section. Cheap check: the
header parses and the file size matches it. Deep check: the digest.

With a storage codec (``hsx.store.codec``) the two states are stored encoded, under the names the
codec gives (``aux_hidden_states.zstd``, or ``.fp8`` + ``.scale``), and ``input_ids`` and
``loss_mask`` as they are; tensors are laid out by falling alignment (8, 4, then 1-byte types), so
every one is aligned for any reader. ``format`` is then ``hsx-sample/2`` and ``__metadata__`` adds
``codec`` and ``states`` (JSON: each state's original ``dtype`` and ``shape``). Raw files keep
``hsx-sample/1``, byte for byte what they were: a reader that predates codecs still reads them, and
refuses an encoded file by its format instead of handing out its payload as hidden states. The
digest covers the stored bytes, so every check above works on encoded files unchanged and never
decodes; only ``decode`` does.

A run that checks its fidelity (``hsx.fidelity``) adds ``fidelity`` to ``__metadata__``: the
sample's ``Figure`` as JSON. It sits in the header beside the sample id and the layers, where the
cheap check reads it without touching the data; like them it is outside the data digest (any
reader's hash of the stored bytes stays the file's digest), and the shard's SEALED lists it too.
A file without it (a run made before, or one that checks nothing) is as it was. A run that checks
its taps (``hsx.certify``) adds ``taps`` the same way: each tap's and the final state's figures, and
the shadow's differences where the sample was recomputed.

A run made with ``--teacher`` (``hsx.teacher``) adds the target's own next-token distribution, one
row per position whose ``loss_mask`` is 1, in order (M rows): the distribution the target's final
norm and LM head give at that position, over the token after it. ``--teacher topk:K``:
``teacher_ids`` [M, K] int32 (token ids, most likely first) and ``teacher_logprobs`` [M, K] in the
model's dtype (log-softmax over the full vocabulary). ``--teacher draft-vocab:FILE``:
``teacher_argmax`` [M] int32 (the full vocabulary's argmax, which tells a trainer whether the
target's choice is in the draft vocabulary) and ``teacher_probs`` [M, D] in the model's dtype (softmax
over the logits of the D draft-vocabulary ids only, in the order of the run's ``teacher-vocab.npy``).
They lie between ``input_ids`` and ``loss_mask`` in a raw file (ints first, so every tensor stays
aligned), and beside ``input_ids`` unencoded in an encoded one; they are in the data section, so
the digest covers them. ``__metadata__`` adds ``teacher`` (JSON: ``kind``, ``k`` or ``vocab_size``
and ``vocab_digest``); the format version is unchanged: a reader that predates them reads the states
as before and leaves them.
"""

from __future__ import annotations

import functools
import io
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import xxhash

from hsx.errors import BadFile, Damage
from hsx.store.codec import Codec, Encoded, decode_state, encode_state

if TYPE_CHECKING:
    import torch  # imported where a function needs it: checking a file never loads torch

FORMAT = "hsx-sample/1"  # raw states
FORMAT_ENCODED = "hsx-sample/2"  # states stored through a codec other than raw
FORMATS = (FORMAT, FORMAT_ENCODED)
CONVERSATION = "hsx-conversation/1"  # a generate run's file (``hsx.genrun.record``): token ids, no states
STATES = ("aux_hidden_states", "hidden_states")
TEACHER = ("teacher_ids", "teacher_argmax", "teacher_logprobs", "teacher_probs")  # a --teacher run's, in data order
LAYER_CONVENTION = "hsx/1: layer k = output of decoder layer k (0-based) = HF hidden_states[k+1]"
FINAL_STATE = "last decoder layer output after the final norm"
FINAL_STATE_PRENORM = "last decoder layer output before the final norm"
FinalStateNorm = Literal["post", "pre"]  # the final state as stored: after the final norm, or before it
FINAL_STATES: dict[FinalStateNorm, str] = {"post": FINAL_STATE, "pre": FINAL_STATE_PRENORM}  # the file's label of each
MAX_HEADER = 1 << 20


@functools.cache
def _dtypes() -> dict:
    """torch dtype -> safetensors' name for it."""
    import torch

    return {
        torch.float32: "F32",
        torch.bfloat16: "BF16",
        torch.float16: "F16",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.uint8: "U8",
        torch.float8_e4m3fn: "F8_E4M3",
    }


@functools.cache
def _torch_dtypes() -> dict:
    """safetensors' dtype name -> torch dtype (a name not here is a corrupt file's: KeyError)."""
    return {name: t for t, name in _dtypes().items()}


DIGEST = "xxh3_128"  # every digest hsx writes: "<DIGEST>:<hex>"


def digest_text(h) -> str:
    """A running xxh3-128 hash as hsx writes digests."""
    return f"{DIGEST}:{h.hexdigest()}"


def digest(data: bytes | memoryview) -> str:
    return digest_text(xxhash.xxh3_128(data))


def safetensors_header(f, size: int, max_header: int = MAX_HEADER) -> tuple[dict, int]:
    """Any safetensors file's JSON header (``__metadata__`` included) and where its data starts,
    read from an open binary file of ``size`` bytes. Raises ``BadFile`` when it cannot be one."""
    raw = f.read(8)
    if len(raw) < 8:
        raise BadFile("truncated", f"{size} bytes, shorter than a header")
    (n,) = struct.unpack("<Q", raw)
    if n == 0 or n > max_header or 8 + n > size:
        raise BadFile("truncated" if 8 + n > size and n <= max_header else "corrupt", f"header length {n}")
    try:
        header = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError) as e:
        raise BadFile("corrupt", f"header does not parse ({e})") from e
    if not isinstance(header, dict):
        raise BadFile("corrupt", "header is not a JSON object")
    return header, 8 + n


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    import torch

    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


@dataclass(frozen=True)
class Figure:
    """A sample's fidelity, as ``hsx.fidelity`` measures it: of its ``checked`` tokens, how many the
    target's LM head on the final state predicts (``agreed``: the argmax is the actual next token),
    how many more it misses by a near tie only, and the sum of the actual next tokens' log-probabilities."""

    checked: int
    agreed: int
    near_ties: int
    logprob: float

    @property
    def matched(self) -> int:
        """Agreed, or missed by a near tie only: what a floor counts."""
        return self.agreed + self.near_ties

    @property
    def agreement(self) -> float:
        return self.agreed / self.checked if self.checked else 1.0

    def __add__(self, other: Figure) -> Figure:
        return Figure(
            self.checked + other.checked,
            self.agreed + other.agreed,
            self.near_ties + other.near_ties,
            self.logprob + other.logprob,
        )

    def text(self) -> str:
        """As ``__metadata__`` keeps it (the log-probability to 6 significant digits)."""
        body = {"checked": self.checked, "agreed": self.agreed, "near_ties": self.near_ties}
        return json.dumps(body | {"logprob": float(f"{self.logprob:.6g}")}, separators=(",", ":"))

    @classmethod
    def parse(cls, text: str | dict | None) -> Figure | None:
        """From ``text`` (or its JSON already parsed); None where there is none. Raises ``ValueError``."""
        if text is None:
            return None
        body = json.loads(text) if isinstance(text, str) else text
        try:
            return cls(int(body["checked"]), int(body["agreed"]), int(body["near_ties"]), float(body["logprob"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a fidelity figure: {text!r}") from e


NO_FIGURE = Figure(0, 0, 0, 0.0)


@dataclass
class SampleTensors:
    """One sample's host-side tensors, ready to be written. The states may come already encoded by
    the file's codec (``Encoded``: fp8 quantized on the device)."""

    sample_id: int
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # uint8 [T]
    aux: torch.Tensor | Encoded  # [T, L*H]
    final: torch.Tensor | Encoded  # [T, H]
    fidelity: Figure | None = None  # where the run checks its fidelity
    teacher: dict[str, torch.Tensor] | None = None  # where the run stores one: ``TEACHER`` names -> rows
    teacher_info: str | None = None  # its ``__metadata__`` entry (``hsx.teacher.Teacher.info``)
    taps: str | None = None  # its tap figures (``hsx.certify.Taps.text``), where the run checks its taps

    def tensors(self) -> list[tuple[str, torch.Tensor | Encoded]]:
        """The file's tensors in data order; no aux states where the run has no taps (width 0)."""
        aux = [] if self.aux.shape[-1] == 0 else [("aux_hidden_states", self.aux)]
        teacher = [(k, self.teacher[k]) for k in TEACHER if k in self.teacher] if self.teacher else []
        return [
            *aux,
            ("hidden_states", self.final),
            ("input_ids", self.input_ids),
            *teacher,
            ("loss_mask", self.loss_mask),
        ]

    @property
    def nbytes(self) -> int:
        """Bytes as captured (raw), encoded states included: the writer's in-flight budget and the
        disk guard count raw bytes."""
        return sum(t.captured_nbytes if isinstance(t, Encoded) else t.nbytes for _, t in self.tensors())


def encode(
    sample: SampleTensors, layers: list[int], codec: Codec = Codec.RAW, final: FinalStateNorm = "post"
) -> tuple[list[memoryview | bytes], str]:
    """The file's parts (header, then each tensor's bytes) and the data digest. Raw parts are views
    of the sample's own buffers; encoded ones are new buffers made here, in the caller's thread, or
    the sample's own where its states came encoded. ``final``: the final state's norm, labelled."""
    import torch

    codec = Codec(codec)
    metadata = {"format": FORMAT if codec is Codec.RAW else FORMAT_ENCODED}
    if codec is Codec.RAW:
        if isinstance(sample.aux, Encoded) or isinstance(sample.final, Encoded):
            raise ValueError("a raw file stores its states as captured, not encoded")
        stored: list[tuple[str, torch.Tensor | bytes]] = sample.tensors()
    else:
        metadata["codec"] = codec.value
        groups = {"aux_hidden_states": len(layers), "hidden_states": 1}
        states = {k: t for k, t in sample.tensors() if k in STATES}
        stored = [(k, t) for k, t in sample.tensors() if k not in STATES]
        for name, t in states.items():
            stored += encode_state(codec, name, t, groups[name])
        stored.sort(key=lambda e: -_align(e[1]))  # stable: 8-byte, then 4-byte, then 1-byte types
    views = [
        (name, _dtypes()[t.dtype], list(t.shape), tensor_bytes(t))
        if isinstance(t, torch.Tensor)
        else (name, "U8", [memoryview(t).nbytes], memoryview(t))
        for name, t in stored
    ]
    metadata |= {
        "sample_id": str(sample.sample_id),
        "num_tokens": str(sample.input_ids.shape[0]),
        "layers": json.dumps(layers),
        "layer_convention": LAYER_CONVENTION,
        "final_state": FINAL_STATES[final],
    }
    if sample.fidelity is not None:
        metadata["fidelity"] = sample.fidelity.text()
    if sample.teacher_info is not None:
        metadata["teacher"] = sample.teacher_info
    if sample.taps is not None:
        metadata["taps"] = sample.taps
    if codec is not Codec.RAW:
        metadata["states"] = json.dumps(
            {name: {"dtype": _dtypes()[t.dtype], "shape": list(t.shape)} for name, t in states.items()},
            separators=(",", ":"),
        )
    return pack(views, metadata)


def pack(views: list[tuple[str, str, list[int], memoryview]], metadata: dict[str, str]) -> tuple[list, str]:
    """A self-verifying safetensors file of these tensors (name, safetensors dtype, shape, bytes, in
    data order): its parts (header, then each tensor's bytes, uncopied) and the data digest, which
    is added to ``metadata`` last. Every file hsx writes into shards is made here."""
    h = xxhash.xxh3_128()
    for *_, view in views:
        h.update(view)
    digest = digest_text(h)
    header: dict = {"__metadata__": metadata | {"digest": digest}}
    offset = 0
    for name, dtype, shape, view in views:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + view.nbytes]}
        offset += view.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return [struct.pack("<Q", len(raw)) + raw] + [v for *_, v in views], digest


def _align(t: torch.Tensor | bytes) -> int:
    return 1 if isinstance(t, bytes | bytearray | memoryview) else t.element_size()


def decode(data: bytes, keep_fp8: bool = False) -> dict[str, torch.Tensor]:
    """A whole sample file's bytes (verified by the caller) as the tensors a raw file holds:
    ``aux_hidden_states``, ``hidden_states`` in the model's dtype, ``input_ids``, ``loss_mask``
    (and a ``--teacher`` run's ``TEACHER`` tensors).
    ``keep_fp8``: see ``decode_tensors``. Raises ``BadFile`` when the stored tensors do not decode."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    header, _ = safetensors_header(io.BytesIO(data), len(data))
    try:
        stored = load(data)
    except SafetensorError as e:
        raise BadFile("corrupt", f"not a readable safetensors file ({e})") from e
    return decode_tensors(stored, header.get("__metadata__") or {}, keep_fp8)


def decode_tensors(
    stored: dict[str, torch.Tensor], metadata: dict[str, str], keep_fp8: bool = False
) -> dict[str, torch.Tensor]:
    """The tensors of a file (as read by any safetensors reader) decoded by its ``__metadata__``.
    ``keep_fp8``: states of an fp8 file stay as stored, float8_e4m3fn with float32 scales beside
    them (``aux_hidden_states_scale`` [T, L], ``hidden_states_scale`` [T, 1]); other files decode."""
    try:
        codec = codec_of(metadata)
        teacher = {k: stored[k] for k in TEACHER if k in stored}
        if codec is Codec.RAW:
            kept = (*STATES, "input_ids", "loss_mask")
            return {k: stored[k] for k in kept if k in stored or k != STATES[0]} | teacher
        out = {k: stored[k] for k in ("input_ids", "loss_mask")} | teacher
        for name, info in json.loads(metadata["states"]).items():
            if name not in STATES:
                raise ValueError(f"unknown state {name!r}")
            dtype = _torch_dtypes()[info["dtype"]]
            out |= decode_state(codec, name, stored, dtype, list(info["shape"]), keep_fp8)
    except (KeyError, ValueError, TypeError) as e:
        raise BadFile("corrupt", f"stored tensors do not decode ({e!r})") from e
    missing = set(STATES) - set(out) - ({STATES[0]} if metadata.get("layers") == "[]" else set())
    if missing:
        raise BadFile("corrupt", f"states missing from the file: {sorted(missing)}")
    return out


def final_norm_of(metadata: dict[str, str]) -> FinalStateNorm:
    """The norm of a sample file's final state, by its label (files made before hsx could store it
    before the norm say it is after). Raises ``ValueError`` for a label hsx never writes."""
    label = metadata.get("final_state", FINAL_STATE)
    for side, text in FINAL_STATES.items():
        if label.startswith(text):
            return side
    raise ValueError(f"unknown final state {label!r}")


def codec_of(metadata: dict[str, str]) -> Codec:
    """The codec a file's states are stored with, by its format version. Raises ``ValueError``."""
    fmt = metadata.get("format")
    if fmt == FORMAT and "codec" not in metadata:
        return Codec.RAW
    if fmt == FORMAT_ENCODED:
        codec = Codec(metadata.get("codec"))
        if codec is not Codec.RAW:
            return codec
    raise ValueError(f"format {fmt!r} with codec {metadata.get('codec')!r}")


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

    @property
    def fidelity(self) -> Figure | None:
        """The sample's fidelity figure, where its run checked it."""
        return Figure.parse(self.metadata.get("fidelity"))

    @property
    def codec(self) -> Codec | None:
        """None for a conversation file, which stores no states."""
        return None if self.metadata.get("format") == CONVERSATION else codec_of(self.metadata)


STATE_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}  # a run's dtype as safetensors names it


@dataclass(frozen=True)
class Expected:
    """What every sample file of a run says of itself, by the run's spec: its codec, layers, final
    state's side of the norm, dtype and width, and the teacher it stores (``--teacher``). A valid
    file that says otherwise is another run's (a shard copied in): never this run's sample, whatever
    its digest."""

    codec: Codec
    layers: tuple[int, ...]
    final: FinalStateNorm
    dtype: str  # the run's dtype (``STATE_DTYPES``'s keys)
    hidden_size: int
    teacher: str | None = None  # a --teacher run's ``teacher`` metadata (``spec.TeacherSpec.label``)

    def judge(self, header: Header) -> None:
        """Raise ``BadFile`` naming the first thing ``header`` holds that this run's files do not."""
        if header.codec is not self.codec:
            raise BadFile(Damage.CORRUPT, f"stored with codec {header.codec}; this run's is {self.codec}")
        meta = header.metadata
        try:
            theirs = [
                ("layers", json.loads(meta.get("layers", "null")), list(self.layers)),
                ("final state", final_norm_of(meta), self.final),
                ("teacher", meta.get("teacher"), self.teacher),
                *((f"{name} (dtype, width)", got, want) for name, got, want in self._states(header)),
            ]
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise BadFile(Damage.CORRUPT, f"header does not parse ({e!r})") from e
        for what, got, want in theirs:
            if got != want:
                raise BadFile(Damage.FOREIGN, f"another run's file: its {what} {got}, this run's {want}")

    def _states(self, header: Header) -> list[tuple[str, tuple, tuple]]:
        """Each state's (dtype, width) as the file stores it (an encoded file's before encoding), and the run's."""
        stored = json.loads(header.metadata["states"]) if "states" in header.metadata else header.tensors
        widths = {"aux_hidden_states": len(self.layers) * self.hidden_size, "hidden_states": self.hidden_size}
        dtype = STATE_DTYPES[self.dtype]
        out = []
        for name, width in widths.items():
            info = stored.get(name)
            got = (info["dtype"], info["shape"][-1]) if info is not None else None
            out.append((name, got, (dtype, width) if width else None))
        return out


def read_header(path: Path) -> Header:
    """Parse and sanity-check the header (the cheap check, minus the id match)."""
    with open(path, "rb") as f:
        return _header(f, os.fstat(f.fileno()).st_size)


def _header(f, size: int) -> Header:
    """The header of a sample file of ``size`` bytes, read from ``f`` (a file, or the bytes a data plane holds)."""
    header, start = safetensors_header(f, size)
    try:
        metadata = header.pop("__metadata__")
        if metadata.get("format") != CONVERSATION:
            codec_of(metadata)
            Figure.parse(metadata.get("fidelity"))
        ends = sorted((v["data_offsets"][0], v["data_offsets"][1]) for v in header.values())
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise BadFile("corrupt", f"header does not parse ({e})") from e
    pos = 0
    for lo, hi in ends:
        if lo != pos or hi < lo:
            raise BadFile("corrupt", "tensor offsets are not contiguous")
        pos = hi
    if size != start + pos:
        kind = "truncated" if size < start + pos else "corrupt"
        raise BadFile(kind, f"size {size} != {start + pos} from its header")
    return Header(metadata, header, start, pos)


def _checked_header(path: Path, expected_id: int, expected: Expected | None = None) -> Header:
    return _judged(read_header(path), expected_id, expected)


def _judged(header: Header, expected_id: int, expected: Expected | None) -> Header:
    if header.sample_id != expected_id:
        raise BadFile("misplaced", f"holds sample {header.sample_id}, expected {expected_id}")
    if expected is not None:
        expected.judge(header)
    return header


def _match(header: Header, h) -> None:
    if digest_text(h) != header.digest:
        raise BadFile("corrupt", "digest mismatch")


def check(path: Path, expected_id: int, deep: bool, expected: Expected | None = None) -> Header:
    """Verify one file; raise ``BadFile`` on any problem, return its header when it is good.
    The deep check streams the data (bounded memory); ``read_checked`` keeps it. ``expected``: what
    the run's files hold (``Expected``; None: a file read on its own)."""
    header = _checked_header(path, expected_id, expected)
    if deep:
        h = xxhash.xxh3_128()
        with open(path, "rb") as f:
            f.seek(header.data_start)
            while chunk := f.read(16 << 20):
                h.update(chunk)
        _match(header, h)
    return header


def read_checked(path: Path, expected_id: int, expected: Expected | None = None) -> bytes:
    """The whole file after the deep check, for a reader that wants the tensors too (one read)."""
    header = _checked_header(path, expected_id, expected)
    raw = path.read_bytes()
    if len(raw) != header.data_start + header.data_size:
        raise BadFile("truncated", f"{path} changed size while being read")
    _match(header, xxhash.xxh3_128(memoryview(raw)[header.data_start :]))
    return raw


def checked_bytes(raw: bytes, expected_id: int, expected: Expected | None = None) -> bytes:
    """A sample file's bytes got from elsewhere than its path (``hsx.plane``), deep-checked as
    ``read_checked`` checks a file: its header, id, what its run's files hold, and its digest."""
    header = _judged(_header(io.BytesIO(raw), len(raw)), expected_id, expected)
    _match(header, xxhash.xxh3_128(memoryview(raw)[header.data_start :]))
    return raw
