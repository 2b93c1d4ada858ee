"""Storage codecs: zstd is lossless, fp8 stays within its stated bound, and an encoded file is still
one plain, self-verifying safetensors file that every hsx reader decodes to the tensors of raw."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import load_file, save

from conftest import (
    HANG_GUARD_S,
    SMALL_RUN,
    TINY,
    conversations,
    extract_args,
    flip_byte,
    hsx,
    kill_after_new_files,
    run_files,
    verified_files,
    write_jsonl,
)
from hsx.assess.verify import verify
from hsx.bench.codec import bench_codecs, states
from hsx.data import HsxDataset, SampleUnavailable, collate_packed, collate_padded, read_mapped, read_verified
from hsx.spec import load_spec
from hsx.store import layout
from hsx.store.codec import Codec, dequantize, fp8_bound, prior_ratio, quantize_fp8, zstd_compress
from hsx.store.durable import write_parts
from hsx.store.format import (
    FORMAT,
    FORMAT_ENCODED,
    BadFile,
    SampleTensors,
    check,
    decode,
    decode_tensors,
    encode,
    read_header,
)
from hsx.store.writer import SampleWriter, seal

LAYERS = [1, 3, 4]
STORED = {
    Codec.RAW: {"aux_hidden_states", "hidden_states", "input_ids", "loss_mask"},
    Codec.ZSTD: {"aux_hidden_states.zstd", "hidden_states.zstd", "input_ids", "loss_mask"},
    Codec.FP8: {
        *("aux_hidden_states.fp8", "aux_hidden_states.scale", "hidden_states.fp8", "hidden_states.scale"),
        *("input_ids", "loss_mask"),
    },
}


FP8 = torch.float8_e4m3fn


def _sample(sid=5, t=37, h=64, dtype=torch.bfloat16, kind="normal") -> SampleTensors:
    s = states(kind, t, h, len(LAYERS), dtype, seed=sid)
    s.sample_id = sid
    return s


def _bytes(sample: SampleTensors, codec) -> bytes:
    return b"".join(encode(sample, LAYERS, codec)[0])


def _write(tmp_path: Path, sample: SampleTensors, codec) -> Path:
    path = tmp_path / f"{codec}" / layout.sample_name(sample.sample_id)
    path.parent.mkdir(exist_ok=True)
    write_parts(path, encode(sample, LAYERS, codec)[0])
    return path


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _rel_error(x: torch.Tensor, y: torch.Tensor, groups: int) -> float:
    """max |y - x| / amax of x's token-layer."""
    x = x.float().view(x.shape[0], groups, -1)
    err = (y.float().view(x.shape) - x).abs()
    return float((err / x.abs().amax(-1, keepdim=True).clamp_min(1e-30)).max())


# ---------------------------------------------------------------- zstd


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_zstd_round_trip_is_bit_identical_to_raw(dtype):
    s = _sample(dtype=dtype, kind="heavy")
    finfo = torch.finfo(dtype)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), finfo.tiny / 4, finfo.max])
    s.aux[3, : len(specials)] = specials.to(dtype)
    s.final[0] = 0
    raw, zstd = decode(_bytes(s, Codec.RAW)), decode(_bytes(s, Codec.ZSTD))
    assert raw.keys() == zstd.keys() == {"aux_hidden_states", "hidden_states", "input_ids", "loss_mask"}
    for k in raw:
        assert zstd[k].dtype == raw[k].dtype and zstd[k].shape == raw[k].shape
        assert torch.equal(_bits(zstd[k]), _bits(raw[k])), k  # bits: NaN and -0.0 included
    assert torch.equal(_bits(zstd["aux_hidden_states"]), _bits(s.aux))
    assert _bytes(s, Codec.ZSTD) == _bytes(s, "zstd")  # same input, same file: resume stays byte-identical


def test_zstd_lets_other_threads_run_while_it_compresses():
    """Blosc2 keeps the GIL by default: the writer threads would run one at a time."""
    import blosc2

    zstd_compress(torch.zeros(4, dtype=torch.bfloat16))
    assert blosc2.set_releasegil(True) is True


def _blosc2_frame(t: torch.Tensor) -> bytes:
    """The documented frame, made here straight with Blosc2: shuffle + zstd level 1, 8 MiB chunks, one thread."""
    import blosc2

    cparams = blosc2.CParams(
        codec=blosc2.Codec.ZSTD, clevel=1, typesize=t.element_size(), nthreads=1, filters=[blosc2.Filter.SHUFFLE]
    )
    return blosc2.SChunk(chunksize=8 << 20, data=t.reshape(-1).view(torch.uint8).numpy(), cparams=cparams).to_cframe()


def test_zstd_files_are_the_same_whatever_the_encoder_threads(tmp_path):
    """The writer's encoder threads (more of them than writers) change no byte: samples written with
    1 encoder thread and with 4 are the same files, each state's frame is the documented Blosc2
    frame of the tensor (one of them spans two chunks) and reads back with schunk_from_cframe; each
    staging slot is released once, as soon as its states are encoded."""
    import blosc2

    samples = [_sample(sid=i, t=t, h=h, dtype=dt) for i, (t, h, dt) in enumerate(SIZES)]
    files = {}
    for encoders, writers in ((1, 1), (4, 2)):
        run = tmp_path / f"enc{encoders}"
        writer = SampleWriter(run, 10, LAYERS, threads=writers, codec=Codec.ZSTD, encoders=encoders)
        released: list[int] = []
        futures = [writer.submit(s, release=functools.partial(released.append, s.sample_id)) for s in samples]
        writer.wait(futures)
        writer.close()
        assert sorted(released) == list(range(len(samples)))
        files[encoders] = run_files(run)
    assert files[1] == files[4] and len(files[1]) == len(samples)
    for s in samples:
        stored = load_file(layout.sample_path(tmp_path / "enc4", s.sample_id, 10))
        for name, t in (("aux_hidden_states", s.aux), ("hidden_states", s.final)):
            frame = stored[f"{name}.zstd"].numpy().tobytes()
            assert frame == _blosc2_frame(t), (s.sample_id, name)
            schunk = blosc2.schunk_from_cframe(frame)
            assert schunk[:] == t.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert blosc2.schunk_from_cframe(_blosc2_frame(samples[-1].aux)).nchunks == 2


SIZES = [(37, 64, torch.bfloat16), (300, 256, torch.float16), (1200, 1024, torch.float32)]


def test_the_encoders_encode_samples_in_flight_beyond_the_writers(tmp_path):
    """One writer thread, four encoder threads: both samples' states are encoding at once (each
    waits at a barrier for the other three), which they could not if encoding ran in the writers."""
    import threading

    barrier, calls, lock = threading.Barrier(4, timeout=HANG_GUARD_S), [], threading.Lock()

    def ready() -> None:
        with lock:
            calls.append(1)
            first = len(calls) <= 4
        if first:  # the encoders' calls; the writer calls it again after
            barrier.wait()

    writer = SampleWriter(tmp_path, 10, LAYERS, threads=1, codec=Codec.ZSTD, encoders=4)
    records = writer.wait([writer.submit(_sample(sid=i), ready=ready) for i in range(2)])
    writer.close()
    assert [r.sample_id for r in records] == [0, 1] and not barrier.broken


def test_zstd_shrinks_real_states_of_the_tiny_model(finished_run):
    path = layout.sample_path(finished_run, 7, 10)
    t = load_file(path)
    s = SampleTensors(7, t["input_ids"], t["loss_mask"], t["aux_hidden_states"], t["hidden_states"])
    data = _bytes(s, Codec.ZSTD)
    assert len(data) < 0.95 * path.stat().st_size
    assert all(torch.equal(decode(data)[k], t[k]) for k in t)


# ---------------------------------------------------------------- fp8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["normal", "heavy"])
def test_fp8_stays_within_its_stated_bound(dtype, kind):
    s = _sample(t=300, h=256, dtype=dtype, kind=kind)
    if dtype == torch.float16:  # fp16's own range
        s.aux.clamp_(-6e4, 6e4)
    before = s.aux.clone()
    out = decode(_bytes(s, Codec.FP8))
    assert torch.equal(s.aux, before)  # encoding never writes into the sample's buffers
    assert torch.equal(out["input_ids"], s.input_ids) and torch.equal(out["loss_mask"], s.loss_mask)
    assert out["aux_hidden_states"].dtype == dtype and out["aux_hidden_states"].shape == s.aux.shape
    assert _rel_error(s.aux, out["aux_hidden_states"], len(LAYERS)) <= fp8_bound(dtype)
    assert _rel_error(s.final, out["hidden_states"], 1) <= fp8_bound(dtype)
    # the bound is tight, not loose: rounding reaches nearly amax / 28
    assert _rel_error(s.aux, dequantize(*quantize_fp8(s.aux, 3), torch.float32), 3) > 0.035
    # and a value in e4m3's normal range errs by at most 2^-4 of itself
    q, scale = quantize_fp8(s.aux, 3)
    x = s.aux.float().view(300, 3, -1)
    y = dequantize(q, scale, torch.float32).view(x.shape)
    normal = x.abs() >= scale[..., None] * 2**-6
    assert ((y - x).abs()[normal] <= x.abs()[normal] * 2**-4 * (1 + 1e-6)).all()


def test_fp8_scales_are_per_token_and_layer_and_kept_for_trainers():
    s = _sample(t=29, h=64)
    kept = decode(_bytes(s, Codec.FP8), keep_fp8=True)
    assert kept["aux_hidden_states"].dtype == FP8 and kept["aux_hidden_states"].shape == (29, 3 * 64)
    assert kept["aux_hidden_states_scale"].shape == (29, 3) and kept["hidden_states_scale"].shape == (29, 1)
    amax = s.aux.float().view(29, 3, 64).abs().amax(-1)
    assert torch.equal(kept["aux_hidden_states_scale"], amax / 448)
    full = decode(_bytes(s, Codec.FP8))
    again = dequantize(kept["aux_hidden_states"], kept["aux_hidden_states_scale"])
    assert torch.equal(again, full["aux_hidden_states"])
    raw = _bytes(s, Codec.RAW)
    ratio = len(_bytes(_sample(t=2000, h=1024), Codec.FP8)) / len(_bytes(_sample(t=2000, h=1024), Codec.RAW))
    assert ratio == pytest.approx(prior_ratio(Codec.FP8, 2, 1024), rel=0.01)
    assert decode(raw, keep_fp8=True).keys() == decode(raw).keys()  # other codecs just decode


def test_fp8_zero_rows_decode_to_zeros_and_non_finite_rows_to_nan():
    s = _sample(t=6, h=32)
    s.aux[1] = 0  # a whole token
    s.aux[2, 32:64] = 0  # one layer of a token
    s.final.zero_()  # a whole state
    s.aux[4, 70] = float("inf")
    out = decode(_bytes(s, Codec.FP8))
    aux = out["aux_hidden_states"]
    assert (aux[1] == 0).all() and (aux[2, 32:64] == 0).all() and (out["hidden_states"] == 0).all()
    assert torch.isfinite(aux[[0, 1, 2, 3, 5]]).all() and torch.isfinite(aux[4, :64]).all()
    assert aux[4, 64:96].isnan().all()  # never plausible numbers for a broken row
    assert _rel_error(s.aux[[0, 1, 2, 3, 5]], aux[[0, 1, 2, 3, 5]], 3) <= fp8_bound(torch.bfloat16)


# NaN bit patterns with the sign set or a payload, per dtype: what an encoder must not pass through
ODD_NANS = {
    torch.float32: (0xFFC00000 - (1 << 32), 0x7F800001),
    torch.bfloat16: (0xFFC0 - (1 << 16), 0x7F81),
    torch.float16: (0xFE00 - (1 << 16), 0x7C01),
}
INT_OF = {4: torch.int32, 2: torch.int16}
GROUPS, COLS = 3, 3 * 32


def hard_states(tokens: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[tokens, 3*32] states of ``dtype`` holding, besides random rows of scales from 1e-6 to 1e6,
    the rows an fp8 encoder gets wrong: zeros, -0.0, the dtype's subnormals, a lone smallest
    subnormal (its scale underflows to 0), an amax whose scale is a float32 subnormal (x / scale then
    rounds past 448), the dtype's largest values, inf in one layer, -inf with NaN, and NaNs with the
    sign bit set or a payload (signalling)."""
    g = torch.Generator().manual_seed(seed)
    fi = torch.finfo(dtype)
    x = torch.randn(tokens, COLS, generator=g) * torch.exp(7 * torch.rand(tokens, 1, generator=g) - 3.5) ** 4
    x.clamp_(-fi.max, fi.max)  # float16's range
    x[0] = 0
    x[1] = -0.0
    x[2] = torch.randn(COLS, generator=g) * fi.smallest_normal / 8
    x[3] = 0
    x[3, 40] = fi.smallest_normal * fi.eps  # the dtype's smallest subnormal
    x[4] = torch.randn(COLS, generator=g) * 2.0**-140  # float32: scale subnormal (bf16/fp16: zeros)
    x[5] = torch.randn(COLS, generator=g).sign() * fi.max
    x[6, 33] = float("inf")
    x[7, 5], x[7, 70] = -float("inf"), float("nan")
    x = x.to(dtype)
    bits = x.view(INT_OF[x.element_size()])
    bits[8, 10], bits[8, 50] = ODD_NANS[dtype]
    bits[9, 90] = ODD_NANS[dtype][0]
    return x


def captured(aux: torch.Tensor, final: torch.Tensor, lengths: list[int], rows: list[int], offsets: list[int]):
    """A CapturedBatch laid out as given over [R, S, ...] copies of ``aux`` and ``final`` rows."""
    from hsx.capture import CapturedBatch

    R, S = max(rows) + 1, max(o + n for o, n in zip(offsets, lengths, strict=True))
    a = torch.zeros((R, S, aux.shape[1]), dtype=aux.dtype, device=aux.device)
    f = torch.zeros((R, S, final.shape[1]), dtype=final.dtype, device=final.device)
    done = 0
    for r, o, n in zip(rows, offsets, lengths, strict=True):
        a[r, o : o + n], f[r, o : o + n] = aux[done : done + n], final[done : done + n]
        done += n
    return CapturedBatch(list(range(len(lengths))), lengths, a, f, rows, offsets)


# two padded rows: samples 0 and 1 adjacent in row 0 (one copy), 2 alone in row 1, 3 after a gap
BATCH = dict(lengths=[9, 4, 14, 3], rows=[0, 0, 1, 0], offsets=[0, 9, 0, 15])


def hard_batch(dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    n = sum(BATCH["lengths"])
    aux, final = hard_states(n, dtype, seed), hard_states(n, dtype, seed + 1)[:, :32].contiguous()
    return captured(aux.to(device), final.to(device), **BATCH)


def sample_bytes(sid: int, aux, final, codec: Codec) -> bytes:
    """The file the writer makes of these states (already encoded or not)."""
    n = aux.shape[0]
    s = SampleTensors(sid, torch.arange(n), torch.ones(n, dtype=torch.uint8), aux, final)
    return b"".join(encode(s, LAYERS, codec)[0])


def check_staged_equals_host(batch, views, wanted: list[int], codec: Codec) -> None:
    """Each staged sample's file is byte for byte the file of its states encoded on the host, and
    it weighs its raw bytes in the writer's in-flight count (the disk guard scales raw bytes)."""
    assert len(views) == len(wanted)
    for i, (aux, final) in zip(wanted, views, strict=True):
        host_aux, host_final = (t.cpu() for t in batch.sample(i))
        assert sample_bytes(i, aux, final, codec) == sample_bytes(i, host_aux, host_final, codec), (i, codec)
        ids, mask = torch.arange(len(host_aux)), torch.ones(len(host_aux), dtype=torch.uint8)
        raw = SampleTensors(i, ids, mask, host_aux, host_final).nbytes
        assert raw == len(host_aux) * ((COLS + 32) * host_aux.element_size() + 9)  # ids int64, mask uint8
        assert SampleTensors(i, ids, mask, aux, final).nbytes == raw


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_encoded_where_captured_is_the_host_encoders_file(dtype):
    """The staging ring's own filling code (``SlotLayout.fill``, the one CUDA runs on its side
    stream), here on CPU tensors: the fp8 states it encodes before the copy make, through the
    writer's format code, the very bytes of the host encoder's file for the same states; raw slots
    carry the states as captured; samples adjacent in a row and samples apart both land right."""
    from hsx.staging import SlotLayout

    batch = hard_batch(dtype)
    for codec, wanted in ((Codec.FP8, [0, 1, 2, 3]), (Codec.FP8, [1, 3]), (Codec.RAW, [0, 2, 3])):
        layout = SlotLayout(codec, dtype, COLS, 32)
        views = layout.fill(layout.slot(40, pin=False), batch, wanted)
        assert all(isinstance(v, torch.Tensor) for pair in views for v in pair) is (codec is Codec.RAW)
        check_staged_equals_host(batch, views, wanted, codec)
        if codec is Codec.RAW:
            check_staged_equals_host(batch, views, wanted, Codec.ZSTD)  # zstd: the writer encodes raw slots
    with pytest.raises(ValueError, match="encoded as fp8"):
        sample_bytes(0, *views_of_fp8(batch), Codec.ZSTD)


def views_of_fp8(batch):
    from hsx.staging import SlotLayout

    layout = SlotLayout(Codec.FP8, batch.aux.dtype, COLS, 32)
    return layout.fill(layout.slot(40, pin=False), batch, [0])[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_non_finite_rows_store_one_nan_whatever_the_input_nan(dtype):
    """inf/inf and NaN inputs give NaNs whose bits depend on the machine (x86 makes a negative one,
    CUDA 0x7fffffff) or on the input (sign, payload): the file stores the one quiet NaN, so the
    device and the host write the same bytes. Finite rows are unaffected."""
    x = hard_states(12, dtype)
    q, scale = quantize_fp8(x, GROUPS)
    qb, sb = q.view(torch.uint8), scale.view(torch.int32)
    quiet = torch.tensor(float("nan")).view(torch.int32)
    assert quiet.item() == 0x7FC00000
    assert scale[6, 1] == float("inf") and scale[7, 0] == float("inf")
    assert qb[6, 33] == 0x7F and qb[7, 5] == 0x7F  # inf / inf, -inf / inf: x86 would give 0xff
    assert sb[7, 2] == quiet and sb[8, 0] == quiet and sb[8, 1] == quiet and sb[9, 2] == quiet
    assert qb[7, 70] == 0x7F and qb[8, 10] == 0x7F and qb[8, 50] == 0x7F and qb[9, 90] == 0x7F
    nan_rows = torch.zeros(12, GROUPS, dtype=torch.bool)
    nan_rows[6, 1] = nan_rows[7, 0] = nan_rows[7, 2] = nan_rows[8, 0] = nan_rows[8, 1] = nan_rows[9, 2] = True
    assert torch.equal(~scale.isfinite(), nan_rows)
    assert not q.float().view(12, GROUPS, -1)[~nan_rows].isnan().any()  # no NaN anywhere else
    assert (scale[:2] == 0).all() and (qb[0] == 0).all() and (qb[1] == 0x80).all()  # zeros keep their sign
    assert (scale[3] == 0).all() if dtype == torch.float32 else True  # 2^-149 / 448 underflows to 0


# ---------------------------------------------------------------- the file


@pytest.mark.parametrize("codec", list(Codec))
def test_every_codec_writes_a_plain_safetensors_file(tmp_path, codec):
    s = _sample()
    path = _write(tmp_path, s, codec)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        assert set(f.keys()) == STORED[codec]
        stored = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a Mapping
    assert set(load_file(path)) == STORED[codec]
    assert meta["sample_id"] == "5" and json.loads(meta["layers"]) == LAYERS and "layer_convention" in meta
    assert meta["format"] == (FORMAT if codec is Codec.RAW else FORMAT_ENCODED)
    assert read_header(path).codec is codec
    assert check(path, 5, deep=True).digest == meta["digest"]
    if codec is not Codec.RAW:
        assert meta["codec"] == codec
        assert json.loads(meta["states"]) == {
            "aux_hidden_states": {"dtype": "BF16", "shape": [37, 3 * 64]},
            "hidden_states": {"dtype": "BF16", "shape": [37, 64]},
        }
    if codec is Codec.ZSTD:
        assert stored["aux_hidden_states.zstd"].dtype == torch.uint8 and stored["aux_hidden_states.zstd"].ndim == 1
    if codec is Codec.FP8:
        assert stored["aux_hidden_states.fp8"].dtype == FP8 and stored["aux_hidden_states.scale"].dtype == torch.float32
    decoded = decode_tensors(stored, meta)
    assert all(torch.equal(decoded[k], v) for k, v in decode(path.read_bytes()).items())
    # the digest covers exactly the stored bytes, as a reader that knows no codec would hash them
    header = read_header(path)
    assert meta["digest"] == f"xxh3_128:{xxhash.xxh3_128(path.read_bytes()[header.data_start :]).hexdigest()}"


@pytest.mark.parametrize("codec", [Codec.ZSTD, Codec.FP8])
def test_damage_to_an_encoded_file_is_detected_as_for_raw(tmp_path, codec):
    path = _write(tmp_path, _sample(), codec)
    good, size = path.read_bytes(), path.stat().st_size
    start = read_header(path).data_start

    os.truncate(path, size - 3)
    with pytest.raises(BadFile, match="truncated"):
        check(path, 5, deep=False)

    for offset in (start + 3, (start + size) // 2, size - 7):  # ids, the middle of the payload, its end
        path.write_bytes(good)
        flip_byte(path, offset)
        check(path, 5, deep=False)  # a bit flip needs the deep check
        with pytest.raises(BadFile, match="digest mismatch"):
            check(path, 5, deep=True)
        with pytest.raises(BadFile, match="digest mismatch"):
            read_mapped(path, 5)  # an encoded file is hashed before its bytes reach a decoder

    path.write_bytes(bytes(size))
    with pytest.raises(BadFile) as e:
        check(path, 5, deep=False)
    assert e.value.kind in ("corrupt", "truncated")


def test_states_that_do_not_fit_their_metadata_are_corrupt(tmp_path):
    path = _write(tmp_path, _sample(), Codec.ZSTD)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    stored = load_file(path)
    states = json.loads(meta["states"])
    states["aux_hidden_states"]["shape"] = [37, 3 * 64 + 1]
    with pytest.raises(BadFile, match="do not decode"):
        decode_tensors(stored, meta | {"states": json.dumps(states)})
    states = json.loads(meta["states"])
    states["hidden_states"]["dtype"] = "F64X"  # a dtype name safetensors does not have
    with pytest.raises(BadFile, match="do not decode"):
        decode_tensors(load_file(path), meta | {"states": json.dumps(states)})
    stored["aux_hidden_states.zstd"] = stored["aux_hidden_states.zstd"][:-9]
    with pytest.raises(BadFile, match="do not decode"):
        decode_tensors(stored, meta)
    with pytest.raises(BadFile, match="do not decode"):
        decode_tensors(load_file(path), meta | {"codec": "lz4"})


def test_raw_files_are_what_they_were_and_old_files_still_read(tmp_path):
    T, H = 7, 8
    s = SampleTensors(
        sample_id=12345,
        input_ids=torch.arange(T, dtype=torch.int64) * 37,
        loss_mask=(torch.arange(T) % 2).to(torch.uint8),
        aux=(torch.arange(T * 3 * H, dtype=torch.float32).reshape(T, 3 * H) / 16 - 5).to(torch.bfloat16),
        final=(torch.arange(T * H, dtype=torch.float32).reshape(T, H) / 8 - 3).to(torch.bfloat16),
    )
    # the exact bytes hsx wrote before codecs existed, for this sample
    assert (
        hashlib.sha256(_bytes(s, Codec.RAW)).hexdigest()
        == "6bdd603f4c22e8f91c7bea89c98bc334e5dd14356495d80ccda76ce89cf92202"
    )
    assert _bytes(s, Codec.RAW) == b"".join(encode(s, LAYERS)[0])  # the old call, the same file

    # a format-1 file laid out by safetensors' own writer (another tensor order and header) reads too
    tensors = {"aux_hidden_states": s.aux, "hidden_states": s.final, "input_ids": s.input_ids, "loss_mask": s.loss_mask}
    meta = {"format": FORMAT, "sample_id": "12345", "num_tokens": str(T), "layers": json.dumps(LAYERS)}
    first = save(tensors, meta | {"digest": "xxh3_128:" + "0" * 32})
    data = first[8 + int.from_bytes(first[:8], "little") :]
    path = tmp_path / layout.sample_name(12345)
    path.write_bytes(save(tensors, meta | {"digest": f"xxh3_128:{xxhash.xxh3_128(data).hexdigest()}"}))
    assert check(path, 12345, deep=True).codec is Codec.RAW
    for read in (read_verified, read_mapped):
        t = read(path, 12345)
        assert all(torch.equal(t[k], v) for k, v in tensors.items())


# ---------------------------------------------------------------- readers: hsx.data and the exports' read


def _recode(src: Path, dest: Path, codec: Codec) -> Path:
    """The same run with every sample file rewritten through the writer with ``codec``, resealed,
    and the spec saying so (as if the run had been made with it)."""
    shutil.copytree(src, dest)
    spec = load_spec(dest).model_copy(update={"codec": codec})
    spec.save(dest)
    writer = SampleWriter(dest, spec.shard_size, list(spec.layers), threads=2, codec=codec)
    for shard in range(layout.num_shards(spec.plan.num_samples, spec.shard_size)):
        futures = []
        for sid in layout.shard_ids(shard, spec.shard_size, spec.plan.num_samples):
            path = layout.sample_path(src, sid, spec.shard_size)
            t, figure = load_file(path), read_header(path).fidelity
            s = SampleTensors(sid, t["input_ids"], t["loss_mask"], t["aux_hidden_states"], t["hidden_states"], figure)
            futures.append(writer.submit(s))
        seal(dest, shard, writer.wait(futures))
    writer.close()
    return dest


@pytest.fixture(scope="module")
def recoded(finished_run, tmp_path_factory) -> dict[Codec, Path]:
    root = tmp_path_factory.mktemp("recoded")
    return {Codec.RAW: finished_run} | {c: _recode(finished_run, root / c, c) for c in (Codec.ZSTD, Codec.FP8)}


def test_dataset_yields_the_same_dicts_for_every_codec(recoded):
    raw = HsxDataset(recoded[Codec.RAW], verify=True)
    assert len(raw) == 40
    first = layout.sample_path(recoded[Codec.ZSTD], 0, 10)
    assert read_header(first).codec is Codec.ZSTD and check(first, 0, deep=True)
    for deep in (False, True):
        zstd = HsxDataset(recoded[Codec.ZSTD], verify=deep)
        fp8 = HsxDataset(recoded[Codec.FP8], verify=deep)
        assert zstd.ids == fp8.ids == raw.ids  # sealed shards: the manifests agree with the files
        for i in range(0, 40, 3):
            a, b, c = raw[i], zstd[i], fp8[i]
            assert a.keys() == b.keys() == c.keys()
            for k in a:
                assert a[k] == b[k] if k == "sample_id" else torch.equal(a[k], b[k]), k
            for k in ("sample_id", "input_ids", "loss_mask"):
                assert a[k] == c[k] if k == "sample_id" else torch.equal(a[k], c[k])
            assert c["aux_hidden_states"].dtype == a["aux_hidden_states"].dtype
            assert _rel_error(a["aux_hidden_states"], c["aux_hidden_states"], 3) <= fp8_bound(torch.float32)
            assert _rel_error(a["hidden_states"], c["hidden_states"], 1) <= fp8_bound(torch.float32)
    # what the exports read (hsx.data.read_verified): the decoded tensors, the same for zstd
    for sid in (0, 39):
        a = read_verified(layout.sample_path(recoded[Codec.RAW], sid, 10), sid)
        b = read_verified(layout.sample_path(recoded[Codec.ZSTD], sid, 10), sid)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fp8_batches_for_a_trainer_that_dequantizes(recoded):
    ds = HsxDataset(recoded[Codec.FP8], keep_fp8=True)
    samples = [ds[i] for i in (4, 0, 9)]
    full = [HsxDataset(recoded[Codec.FP8])[i] for i in (4, 0, 9)]
    assert samples[0]["aux_hidden_states"].dtype == FP8 and samples[0]["aux_hidden_states_scale"].shape[1] == 3
    padded = collate_padded(samples)
    B, T = padded["input_ids"].shape
    assert padded["aux_hidden_states"].shape == (B, T, 192) and padded["aux_hidden_states_scale"].shape == (B, T, 3)
    states = dequantize(padded["aux_hidden_states"], padded["aux_hidden_states_scale"], torch.float32)
    for b, s in enumerate(full):
        n = s["input_ids"].shape[0]
        assert torch.equal(states[b, :n].to(s["aux_hidden_states"].dtype), s["aux_hidden_states"])
    packed = collate_packed(samples)
    assert packed["hidden_states_scale"].shape == (1, packed["input_ids"].shape[1], 1)


def test_a_damaged_encoded_file_is_unavailable_not_served(recoded, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(recoded[Codec.ZSTD], run)
    flip_byte(layout.sample_path(run, 3, 10), -5)
    with pytest.raises(SampleUnavailable, match=r"corrupt.*hsx extract --out"):
        HsxDataset(run, ids=[3])[0]  # even without verify: encoded files are hashed before decoding


def test_codec_bench_reports_every_codec():
    results = bench_codecs(tokens=64, hidden=128, threads=2, repeats=1, kinds=("heavy",))
    by = {r.codec: r for r in results}
    assert set(by) == {"raw", "zstd", "fp8"} and by["raw"].ratio == 1.0
    assert by["zstd"].ratio < 1 and by["fp8"].ratio < 0.6 and by["fp8"].max_err <= fp8_bound(torch.bfloat16)


# ---------------------------------------------------------------- a real run with a codec: kill -9, damage, resume


def expected_files(raw_run: Path, codec: Codec) -> dict[str, bytes]:
    """What an uninterrupted run with ``codec`` holds: the raw run's tensors, encoded (the writer's
    encoding is a function of the tensors alone), and their fidelity and tap figures, by path under shards/."""
    layers = list(load_spec(raw_run).layers)
    out = {}
    for p in sorted((raw_run / "shards").rglob("*.safetensors")):
        header, t = read_header(p), load_file(p)
        figure, taps = header.fidelity, header.metadata["taps"]  # what its run measured: the same in any codec
        sid = layout.parse_sample_name(p.name)
        s = SampleTensors(sid, t["input_ids"], t["loss_mask"], t["aux_hidden_states"], t["hidden_states"], figure)
        s = dataclasses.replace(s, taps=taps)
        out[str(p.relative_to(raw_run / "shards"))] = b"".join(encode(s, layers, codec)[0])
    return out


def test_kill_9_and_damage_then_resume_with_a_codec_is_byte_identical(finished_run, tmp_path):
    """A zstd run of the finished run's 40 conversations is killed (kill -9) once k new sample files
    exist (k from a seeded RNG, the seed printed); three of its verified encoded files are damaged
    (a bit flipped inside a compressed frame, a truncation, zero-fill) and a fourth is replaced by
    the raw run's valid file of the same sample (another codec); a resume asking for another
    codec is refused by name; the resume redoes exactly the missing and damaged files, and the run is
    then byte for byte what an uninterrupted zstd run holds, with the raw run's bits."""
    from typer.testing import CliRunner

    from hsx.cli import app

    data = write_jsonl(tmp_path / "convs.jsonl", conversations(40))
    out = tmp_path / "run"
    seed = int(os.environ.get("HSX_CRASH_SEED", time.time_ns() % 10_000))
    print(f"HSX_CRASH_SEED={seed}")
    k = random.Random(seed).randint(4, 12)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hsx", *map(str, extract_args(data, out, "--codec", "zstd"))],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    kill_after_new_files(proc, out, k, seed)
    assert proc.returncode == -signal.SIGKILL, f"seed {seed}: the kill did not land mid-run"
    assert k <= len(run_files(out)) < 40, f"seed {seed}: the kill came after the run had finished"
    assert load_spec(out).codec is Codec.ZSTD

    good = sorted(verified_files(out))
    assert len(good) >= 4 and all(read_header(p).codec is Codec.ZSTD for p in good), f"seed {seed}"
    flipped, truncated, zeroed, raw = good[0], good[len(good) // 2], good[-1], good[1]
    flip_byte(flipped, -100)  # inside the compressed frame: only the digest can tell
    truncated.write_bytes(truncated.read_bytes()[:-1000])
    zeroed.write_bytes(bytes(zeroed.stat().st_size))
    shutil.copyfile(finished_run / raw.relative_to(out), raw)  # valid, but not this run's codec
    untouched = verified_files(out)  # the raw file's digest holds: only its codec is wrong
    kept = {p: ident for p, ident in untouched.items() if p != raw}
    assert len(kept) == len(good) - 4, f"seed {seed}"

    for other in ("fp8", "raw"):  # the codec is per run: refused by name, before any work
        r = CliRunner().invoke(app, ["extract", "--out", str(out), "--codec", other])
        assert r.exit_code == 2 and f"codec: run has zstd, asked for {other}" in " ".join(r.output.split()), r.output
    assert verified_files(out) == untouched

    found = {p.path: p.detail for p in verify(out).result.problems}
    assert found[str(raw.relative_to(out))] == "stored with codec raw; this run's is zstd", found

    resumed = hsx("extract", "--out", out)
    said = " ".join(resumed.stdout.split() + resumed.stderr.split())
    assert "redone 3 corrupt, 1 truncated" in said, f"seed {seed}: {said}"
    assert run_files(out) == expected_files(finished_run, Codec.ZSTD), f"seed {seed}"
    final = verified_files(out)
    assert all(final[p] == ident for p, ident in kept.items()), f"seed {seed}: a verified file was rewritten"
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
    for sid in (0, 17, 39):  # and the bits are the raw run's
        a = HsxDataset(finished_run, ids=[sid], verify=True)[0]
        b = HsxDataset(out, ids=[sid], verify=True)[0]
        assert all(torch.equal(_bits(a[key]), _bits(b[key])) for key in a if key != "sample_id")


def test_a_new_run_stores_zstd_unless_asked_and_decodes_to_the_raw_runs_bits(finished_run, tmp_path):
    """The default codec (zstd, decided by the GPU measurement in docs/benchmarks.md): a run started
    with no --codec records zstd, stores zstd files, and each decodes to the raw run's tensors, bit
    for bit, in fewer bytes."""
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(40))
    out = tmp_path / "run"
    args = ["extract", "--model", TINY, "--data", data, "--out", out, *SMALL_RUN]  # no --codec
    hsx(*args)
    assert load_spec(out).codec is Codec.ZSTD
    raw = sorted((finished_run / "shards").rglob("*.safetensors"))
    files = sorted((out / "shards").rglob("*.safetensors"))
    assert [p.relative_to(out) for p in files] == [p.relative_to(finished_run) for p in raw]
    for mine, theirs in zip(files, raw, strict=True):
        assert read_header(mine).codec is Codec.ZSTD
        got, want = read_verified(mine, layout.parse_sample_name(mine.name)), load_file(theirs)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert sum(p.stat().st_size for p in files) < sum(p.stat().st_size for p in raw)
