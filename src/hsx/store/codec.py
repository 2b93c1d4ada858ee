"""Storage codecs for a sample's hidden states: what is stored in place of each state tensor.

- ``raw``: the tensor as it is (the files of runs made before codecs existed).
- ``zstd``: lossless. The tensor's bytes go through Blosc2 (byte shuffle at the element size, so
  the sign/exponent bytes, which repeat, are compressed apart from the mantissa bytes, which barely
  do; then zstd at level 1, the best size and speed of its levels on such data) and are stored as
  one ``uint8`` tensor ``<name>.zstd`` holding a Blosc2 contiguous frame. Decoding gives the exact
  bytes back. One Blosc2 thread per tensor: the same input gives the same frame on any machine
  (Blosc2's own threads place each block where it finishes first: five runs on 2 threads gave five
  different frames). The parallelism is across tensors instead: the writer's encoder threads, one
  per core, each compress one state at a time, with the GIL released.
- ``fp8``: lossy. ``<name>.fp8`` is float8_e4m3fn [T, G*H] and ``<name>.scale`` float32 [T, G] with
  one scale per token and layer (G = number of layers for ``aux_hidden_states``, 1 for
  ``hidden_states``): scale = amax / 448 over the layer's H values of that token; x ≈ fp8 * scale
  (``dequantize``). A zero row has scale 0 and decodes to zeros; a row holding inf or NaN decodes to
  NaN throughout (never to plausible numbers). Every NaN is stored as the one quiet NaN (float32
  0x7fc00000, fp8 0x7f): x86, ARM and CUDA each make their own NaN bits for inf/inf, and the file
  must be the same bytes wherever it is encoded.

  On CUDA the run quantizes on the device before the device-to-host copy (``hsx.staging``), so the
  copy and the pinned host memory carry half the bytes; the writer then stores the payload as it is
  (``Encoded``). Same torch ops, same float32 formula, IEEE division and the same e4m3 rounding on
  both: the device's bytes are the host's.

  Error bound, per element, relative to the amax of its token-layer (``fp8_bound``): with x/scale in
  [-448, 448], rounding to e4m3 (3 mantissa bits) errs by at most half the spacing of its top
  binade, 16 of 448, so |x̂ - x| <= amax / 28 (3.57%) decoded to float32, plus float32 rounding
  (< 1e-6). Decoding to the model's dtype adds its own rounding, at most its unit roundoff of |x̂|:
  2^-8 for bf16 (total 3.96%), 2^-11 for fp16. Values above amax / 28672 (e4m3's normal range) also
  err by at most 2^-4 (6.25%) of themselves. Measured on random-normal rows [2000, 3*4096] bf16:
  max 3.57% of amax in float32 and 3.77% in bf16; RMS error 2.6% of the row's RMS
  (``hsx.bench.codec``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch  # imported where a function needs it: hsx status and verify never load torch


class Codec(StrEnum):
    RAW = "raw"
    ZSTD = "zstd"
    FP8 = "fp8"


# A new run's codec when none is asked for: zstd, lossless at 0.69x raw's bytes, since it kept 0.992x
# raw's tok/s on a GPU machine's disk and 0.984x in its memory (docs/benchmarks.md, "The default codec").
DEFAULT_CODEC = Codec.ZSTD

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


ZSTD_LEVEL = 1
_CHUNK = 8 << 20  # Blosc2 chunk: well under its 2 GiB limit per chunk, large enough for zstd
_BLOCK = 4 << 20  # float32 bytes of scratch per step of (de)quantizing: bounded memory per thread
_DEVICE_BLOCK = 256 << 20


@dataclass(frozen=True)
class Encoded:
    """A state encoded before the writer lays out its file: fp8 on the device, before its copy to
    the host, or any codec by the writer's encoder threads. Holds the tensors (``bytes`` for a
    ``uint8`` payload) ``encode_state`` stores for it, in its order, and the dtype and shape it had,
    which the file records; the file format code stores them as they are."""

    codec: Codec
    dtype: torch.dtype
    shape: tuple[int, int]
    tensors: tuple[torch.Tensor | bytes, ...]

    @property
    def captured_nbytes(self) -> int:
        """Bytes of the state as captured: what the writer's in-flight bytes and the disk guard
        count (raw bytes, which the guard scales by the codec's ratio)."""
        return self.shape[0] * self.shape[1] * self.dtype.itemsize


def encode_early(codec: Codec, t: torch.Tensor, groups: int) -> Encoded:
    """State ``t`` [T, groups*H] encoded by a codec other than raw, where it lies (fp8: any device;
    zstd: a CPU tensor)."""
    if codec is Codec.ZSTD:
        return Encoded(codec, t.dtype, (t.shape[0], t.shape[1]), (zstd_compress(t),))
    if codec is Codec.FP8:
        return Encoded(codec, t.dtype, (t.shape[0], t.shape[1]), quantize_fp8(t, groups))
    raise ValueError(f"codec {codec!r} stores states as they are")


def encode_state(
    codec: Codec, name: str, t: torch.Tensor | Encoded, groups: int
) -> list[tuple[str, torch.Tensor | bytes]]:
    """What is stored for state ``name`` [T, groups*H] by a codec other than raw: tensors, or
    ``bytes`` for a ``uint8`` payload. An ``Encoded`` state is already that: it is only named."""
    e = t if isinstance(t, Encoded) else encode_early(codec, t, groups)
    if e.codec is not codec:
        raise ValueError(f"{name} was encoded as {e.codec}, the file's codec is {codec}")
    names = {Codec.ZSTD: (f"{name}.zstd",), Codec.FP8: (f"{name}.fp8", f"{name}.scale")}[codec]
    return list(zip(names, e.tensors, strict=True))


def decode_state(
    codec: Codec,
    name: str,
    stored: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    shape: list[int],
    keep_fp8: bool = False,
) -> dict[str, torch.Tensor]:
    """State ``name`` of a file encoded by ``codec`` back as ``dtype`` ``shape``. With ``keep_fp8``
    an fp8 state stays as stored: ``name`` float8_e4m3fn and ``name_scale`` float32 (for trainers
    that dequantize on the device). Raises ``ValueError`` when the stored tensors do not fit the shape and dtype."""
    if codec is Codec.ZSTD:
        return {name: zstd_decompress(stored[f"{name}.zstd"], dtype, shape)}
    if codec is Codec.FP8:
        import torch

        q, scale = stored[f"{name}.fp8"], stored[f"{name}.scale"]
        if q.dtype != torch.float8_e4m3fn or list(q.shape) != shape or scale.dtype != torch.float32 or scale.ndim != 2:
            raise ValueError(f"{name}: fp8 {q.dtype} {list(q.shape)} does not decode to {shape}")
        if scale.shape[0] != shape[0] or shape[1] % scale.shape[1]:
            raise ValueError(f"{name}: scales {list(scale.shape)} do not fit {shape}")
        if keep_fp8:
            return {name: q, f"{name}_scale": scale}
        return {name: dequantize(q, scale, dtype)}
    raise ValueError(f"codec {codec!r} stores {name} as it is")


# ---------------------------------------------------------------- zstd (Blosc2: shuffle + zstd)


@functools.cache
def _blosc2():
    """Blosc2, set to release the GIL while it (de)compresses: it holds it by default, which would
    serialize the writer threads and stall the thread that feeds the model. Our chunks are MBs, so
    the cost Blosc2 warns of for small blocks does not apply."""
    import blosc2

    blosc2.set_releasegil(True)
    return blosc2


def prepare(codec: Codec) -> None:
    """Import what ``codec``'s encoder needs now, in the caller's thread: otherwise every encoder
    thread's first state waits on the import lock (Blosc2 takes most of a second to import)."""
    if codec is Codec.ZSTD:
        _blosc2()


def _cparams(typesize: int):
    blosc2 = _blosc2()
    return blosc2.CParams(
        codec=blosc2.Codec.ZSTD,
        clevel=ZSTD_LEVEL,
        typesize=typesize,
        nthreads=1,
        filters=[blosc2.Filter.SHUFFLE],
        filters_meta=[0],
    )


def zstd_compress(t: torch.Tensor) -> bytes:
    """A contiguous CPU tensor's bytes as one Blosc2 frame (byte-shuffled at its element size, zstd)."""
    import torch

    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous")
    data = t.reshape(-1).view(torch.uint8).numpy()
    return _blosc2().SChunk(chunksize=_CHUNK, data=data, cparams=_cparams(t.element_size())).to_cframe()


def zstd_decompress(frame: torch.Tensor | bytes | memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """The tensor a ``zstd_compress`` frame holds, checked against the expected dtype and shape."""
    import torch

    buf = frame.numpy() if isinstance(frame, torch.Tensor) else frame
    out = torch.empty(shape, dtype=dtype)
    want = out.numel() * out.element_size()
    try:
        chunk = _blosc2().schunk_from_cframe(buf, copy=False)
        if chunk.nbytes != want or chunk.typesize != out.element_size():
            raise ValueError(f"frame holds {chunk.nbytes} bytes of {chunk.typesize}-byte items, expected {want}")
        if want:
            chunk.get_slice(0, None, out=out.view(-1).view(torch.uint8).numpy())
    except RuntimeError as e:  # Blosc2's answer to a damaged frame
        raise ValueError(f"not a readable Blosc2 frame ({e})") from e
    return out


# ---------------------------------------------------------------- fp8 e4m3, a scale per token and layer


def _row_steps(rows: int, row_elems: int, device: torch.device) -> range:
    """Row blocks of about ``_BLOCK`` float32 bytes on the CPU (cache-sized), ``_DEVICE_BLOCK`` on an
    accelerator (few launches, bounded scratch beside the model). Rows are independent: the blocks
    never change the result."""
    per = (_BLOCK if device.type == "cpu" else _DEVICE_BLOCK) // max(1, 4 * row_elems)
    return range(0, rows, max(1, per))


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, groups*H] as float8_e4m3fn [T, groups*H] and float32 scales [T, groups] (amax / 448).
    Works in row blocks so its float32 scratch stays a few MB whatever T is."""
    import torch

    T, D = x.shape
    if D % groups:
        raise ValueError(f"{D} columns do not split into {groups} layers")
    g = x.view(T, groups, D // groups)
    q = torch.empty((T, groups, D // groups), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((T, groups), dtype=torch.float32, device=x.device)
    # A 0-dim tensor on x's device, not a Python float: CUDA turns division by a host scalar into a
    # multiplication by its reciprocal, which rounds differently from the host's true division (13.6%
    # of scales differed); dividing by a device tensor is a true division on every device.
    fp8_max = torch.tensor(FP8_MAX, dtype=torch.float32, device=x.device)
    step = _row_steps(T, D, x.device)
    for lo in step:
        hi = lo + step.step
        blk = g[lo:hi].to(torch.float32, copy=True)  # scratch: never the caller's float32 tensor
        s = blk.abs().amax(-1) / fp8_max
        scale[lo:hi] = s.masked_fill_(s.isnan(), math.nan)  # one NaN's bits on every machine
        blk.div_(torch.where(s > 0, s, 1).unsqueeze(-1))
        q[lo:hi] = blk.masked_fill_(blk.isnan(), math.nan)
    return q.view(T, D), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """fp8 states [..., G*H] with scales [..., G] back to ``dtype`` (default bfloat16; float32
    arithmetic, one rounding). Any leading dims: a trainer may collate fp8 batches and dequantize
    them on its device."""
    import torch

    dtype = dtype or torch.bfloat16
    D, G = q.shape[-1], scale.shape[-1]
    rows = q.reshape(-1, G, D // G)
    scales = scale.reshape(-1, G, 1)
    out = torch.empty(rows.shape, dtype=dtype, device=q.device)
    step = _row_steps(rows.shape[0], D, q.device)
    for lo in step:
        hi = lo + step.step
        out[lo:hi] = rows[lo:hi].float().mul_(scales[lo:hi])
    return out.view(q.shape)


def fp8_bound(dtype: torch.dtype) -> float:
    """Largest |x̂ - x| / amax of the token-layer for fp8 decoded to ``dtype`` (see the module notes)."""
    import torch

    return 1 / 28 + torch.finfo(dtype).eps / 2 + 2**-20


def is_lossless(codec: Codec) -> bool:
    """Whether decoding gives back the exact bits the model produced."""
    return Codec(codec) is not Codec.FP8


def prior_ratio(codec: Codec, itemsize: int, hidden_size: int) -> float:
    """Stored / raw bytes of the states to assume before any batch is measured: exact for raw and
    fp8, 1.0 for zstd (lossless compression promises nothing until it has seen the data)."""
    if codec is Codec.FP8:
        return (1 + 4 / hidden_size) / itemsize
    return 1.0
