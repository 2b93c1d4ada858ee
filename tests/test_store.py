import json
import os
import stat
import threading
import time

import pytest
import torch
from safetensors import safe_open

from hsx.store import layout
from hsx.store.durable import is_temp, temp_name, temp_of, write_parts
from hsx.store.format import BadFile, SampleTensors, check, encode, read_header
from hsx.store.scan import scan_shard
from hsx.store.writer import SampleWriter, read_seal, seal


def _sample(sid: int, t: int = 11, h: int = 8, layers: int = 3, dtype=torch.bfloat16) -> SampleTensors:
    g = torch.Generator().manual_seed(sid)
    return SampleTensors(
        sample_id=sid,
        input_ids=torch.randint(0, 1000, (t,), generator=g),
        loss_mask=(torch.rand(t, generator=g) > 0.5).to(torch.uint8),
        aux=torch.randn(t, layers * h, generator=g).to(dtype),
        final=torch.randn(t, h, generator=g).to(dtype),
    )


def _write(tmp_path, sid=5, **kw):
    s = _sample(sid, **kw)
    path = tmp_path / layout.sample_name(sid)
    parts, digest = encode(s, [1, 3, 4])
    write_parts(path, parts)
    return s, path, digest


def test_file_is_plain_safetensors_with_the_contracted_metadata(tmp_path):
    s, path, digest = _write(tmp_path)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        assert set(f.keys()) == {"aux_hidden_states", "hidden_states", "input_ids", "loss_mask"}
        assert torch.equal(f.get_tensor("aux_hidden_states"), s.aux)
        assert torch.equal(f.get_tensor("hidden_states"), s.final)
        assert torch.equal(f.get_tensor("input_ids"), s.input_ids)
        assert torch.equal(f.get_tensor("loss_mask"), s.loss_mask)
    assert meta["sample_id"] == "5" and meta["num_tokens"] == "11" and json.loads(meta["layers"]) == [1, 3, 4]
    assert meta["digest"] == digest and "layer_convention" in meta and meta["format"] == "hsx-sample/1"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 & ~_umask()
    assert not [p for p in tmp_path.iterdir() if is_temp(p.name)]
    assert check(path, 5, deep=True).digest == digest


def _umask():
    m = os.umask(0)
    os.umask(m)
    return m


def _flip(path, offset_from_end):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def test_damage_is_detected(tmp_path):
    _, path, _ = _write(tmp_path)
    size = path.stat().st_size
    os.truncate(path, size - 3)
    with pytest.raises(BadFile, match="truncated"):
        check(path, 5, deep=False)

    _, path, _ = _write(tmp_path)
    _flip(path, 7)  # inside the data: only the digest sees it
    check(path, 5, deep=False)
    with pytest.raises(BadFile, match="digest mismatch"):
        check(path, 5, deep=True)

    _, path, _ = _write(tmp_path)
    path.write_bytes(b"\0" * size)  # same size, zero-filled (a crash after the size was extended)
    with pytest.raises(BadFile) as e:
        check(path, 5, deep=False)
    assert e.value.kind in ("corrupt", "truncated")

    _, path, _ = _write(tmp_path)
    with pytest.raises(BadFile, match="misplaced"):
        check(path, 6, deep=False)

    raw = bytearray(path.read_bytes())
    raw[8:10] = b"[["  # header no longer parses
    path.write_bytes(bytes(raw))
    with pytest.raises(BadFile, match="corrupt"):
        read_header(path)


def test_writer_seals_and_scan_classifies(tmp_path):
    run = tmp_path
    writer = SampleWriter(run, shard_size=4, layers=[1, 3, 4], threads=3, max_inflight_bytes=4096)
    futures = [writer.submit(_sample(i)) for i in range(4)]
    records = writer.wait(futures)
    writer.close()
    seal(run, 0, records)
    scan = scan_shard(run, 0, range(4), deep=True)
    assert scan.sealed and scan.complete and read_seal(run, 0) == scan.good

    folder = layout.shard_dir(run, 0)
    _flip(folder / layout.sample_name(2), 3)
    (folder / ".000000003.safetensors.tmp-1-2").write_bytes(b"partial")
    (folder / layout.sample_name(9)).write_bytes(b"x")
    (folder / "notes.txt").write_text("hi")
    cheap = scan_shard(run, 0, range(4), deep=False)
    assert cheap.missing == [] and cheap.sealed  # a bit flip needs the deep check
    deep = scan_shard(run, 0, range(4), deep=True)
    assert deep.missing == [2] and not deep.sealed and deep.state == "partial"
    kinds = sorted((p.kind, p.path.split("/")[-1]) for p in deep.problems)
    assert kinds == [
        ("corrupt", "000000002.safetensors"),
        ("foreign", "notes.txt"),
        ("misplaced", "000000009.safetensors"),
        ("stray", ".000000003.safetensors.tmp-1-2"),
    ]


def test_writer_backpressure_holds_the_producer_and_counts_the_wait(tmp_path):
    """Over the in-flight budget, submit blocks until a write finishes, and says how long it blocked."""
    writer = SampleWriter(tmp_path, shard_size=4, layers=[1, 3, 4], threads=2, max_inflight_bytes=1)
    gate = threading.Event()
    first = writer.submit(_sample(0), ready=gate.wait)  # its buffers are "not filled yet"
    threading.Timer(0.3, gate.set).start()
    t0 = time.monotonic()
    second = writer.submit(_sample(1))  # over budget: waits for the first to be written
    assert time.monotonic() - t0 >= 0.25 and layout.sample_path(tmp_path, 0, 4).exists()
    assert writer.waited >= 0.25
    writer.wait([first, second])
    writer.close()
    assert writer.inflight == 0


def test_writer_error_removes_temp_file_and_stops(tmp_path):
    writer = SampleWriter(tmp_path, shard_size=4, layers=[0], threads=2)
    layout.shard_dir(tmp_path, 0).mkdir(parents=True)
    (layout.shard_dir(tmp_path, 0) / layout.sample_name(1)).mkdir()  # rename onto a folder fails
    futures = [writer.submit(_sample(i, layers=1)) for i in range(2)]
    with pytest.raises(OSError):
        writer.wait(futures)
    writer.close()
    assert not [p for p in layout.shard_dir(tmp_path, 0).iterdir() if is_temp(p.name)]
    with pytest.raises(OSError):
        writer.submit(_sample(2, layers=1))


def test_a_temp_file_names_what_it_was_to_become_and_its_writer(tmp_path):
    """The sweepers of cut-off writes (run folder, worker records) read the temp name back."""
    path = tmp_path / "host-7.json"
    assert temp_of(temp_name(path).name) == ("host-7.json", os.getpid())
    assert temp_of(".plan.json.tmp-123") == ("plan.json", 123)  # a temp without a thread id
    assert temp_of(".x.json.tmp-abc") == ("x.json", None)  # another naming: no writer to check
    assert temp_of("host-7.json") is None and temp_of("x.tmp-1") is None


def test_a_valid_file_that_is_not_the_sealed_one_is_redone(tmp_path):
    writer = SampleWriter(tmp_path, shard_size=2, layers=[0], threads=1)
    records = writer.wait([writer.submit(_sample(i, layers=1)) for i in range(2)])
    seal(tmp_path, 0, records)
    other = _sample(1, layers=1)
    other.final = other.final + 1  # a well-formed file from some other run, same id
    writer.wait([writer.submit(other)])
    writer.close()
    scan = scan_shard(tmp_path, 0, range(2), deep=True)
    assert scan.missing == [1] and not scan.sealed
    assert [(p.kind, p.detail) for p in scan.problems] == [("corrupt", "differs from the shard's SEALED manifest")]
