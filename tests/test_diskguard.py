"""The disk guard on real small filesystems (size- and inode-limited tmpfs mounts).

A run that cannot fit is refused at start with the figures; with --allow-partial it stops cleanly
when free space falls under the reserve, or on a real ENOSPC (inodes run out, which the byte guard
cannot foresee). Either way no partial file survives, and after space is freed the resumed run is
byte-identical to one that never ran short.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from conftest import (
    HANG_GUARD_S,
    TINY,
    assert_clean_stop,
    conversations,
    extract_args,
    hsx,
    remount,
    run_files,
    stopped_cleanly,
    unwrite,
    write_jsonl,
)
from hsx.cli import app
from hsx.job import space as volume

EXIT_REFUSED, EXIT_DISK_FULL = 2, 3


def test_guard_and_projection_on_a_real_small_volume(tmpfs):
    d = tmpfs("vol", size="1m")
    v = volume.volume_of(d / "run" / "not-yet")  # the nearest existing parent decides
    assert v.fstype == "tmpfs" and v.mount == str(d) and v.total == 1 << 20 and v.free == 1 << 20
    guard = volume.DiskGuard(d, reserve=256 << 10)
    guard(100 << 10)
    with pytest.raises(volume.LowSpace) as e:
        guard(900 << 10)
    assert e.value.reserve == 256 << 10 and "under the reserve of 262.1 kB" in str(e.value)
    (d / "filler").write_bytes(bytes(700 << 10))
    with pytest.raises(volume.LowSpace):
        guard(100 << 10)
    guard.in_flight = lambda: 0
    (d / "filler").unlink()
    guard(100 << 10)
    assert guard.in_flight() == 0
    with pytest.raises(volume.LowSpace):  # bytes queued in the writer count as already spent
        volume.DiskGuard(d, 256 << 10, in_flight=lambda: 800 << 10)(1)

    p = volume.project(d, 1000, 2000, 10, 1500, 8, 0, volume.largest_batch_bytes(100, 300, 1000))
    assert p.reserve == 600_000 and p.needed_bytes == 1500 * 1000 + 8 * volume.FILE_OVERHEAD
    assert not p.fits and p.margin == (1 << 20) - p.needed_bytes - p.reserve
    msg = p.refusal(d / "run")
    assert "short by" in msg and "--allow-partial" in msg and str(d) in msg


def test_volume_too_small_refuses_then_stops_cleanly_then_resumes_identical(tmpfs, finished_run, tmp_path):
    d = tmpfs("small", size="2m")
    run = d / "run"
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(40))

    refused = hsx(*extract_args(data, run), check=False)
    assert refused.returncode == EXIT_REFUSED, refused.stderr
    assert "projected size 2.9 MB" in refused.stderr and "not enough space on" in refused.stderr
    assert "short by" in refused.stderr and "--allow-partial" in refused.stderr

    stopped = hsx("extract", "--out", run, "--allow-partial", check=False)
    assert "is under the reserve of" in " ".join(stopped.stderr.split())
    done, resume = stopped_cleanly(stopped, run, 40)
    assert resume == f"hsx extract --out {run}"

    r = CliRunner().invoke(app, ["status", str(run)])
    assert r.exit_code == 2 and "fail volume" in " ".join(r.output.split()), r.output
    assert "ok integrity" in " ".join(r.output.split())

    remount(d, size="16m")
    resumed = hsx("extract", "--out", run)
    assert f"{40 - done} written now, {done} were already verified" in resumed.stdout
    assert run_files(run) == run_files(finished_run)


def test_real_enospc_when_inodes_run_out_stops_cleanly_and_resumes_identical(tmpfs, finished_run, tmp_path):
    d = tmpfs("inodes", size="64m", nr_inodes=30)  # bytes to spare, files not: the byte guard cannot see it
    run = d / "run"
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(40))

    refused = hsx(*extract_args(data, run), check=False)
    assert refused.returncode == EXIT_REFUSED and "inodes free" in refused.stderr, refused.stderr

    stopped = hsx("extract", "--out", run, "--allow-partial", check=False)
    err = " ".join(stopped.stderr.split())
    assert stopped.returncode == EXIT_DISK_FULL, stopped.stderr
    assert "no space left on the output volume while writing" in err and "Stopped cleanly:" in err
    done = assert_clean_stop(run)
    assert 0 < done < 40

    remount(d, nr_inodes=400)
    hsx("extract", "--out", run)
    assert run_files(run) == run_files(finished_run)


# ---------------------------------------------------------------- with a storage codec


def _session(files: int, tokens: int, stored: int):
    return lambda: (files, tokens, stored)


def test_the_projection_and_the_guard_use_the_codecs_ratio(tmpfs, finished_run):
    from hsx.errors import NotEnoughSpace
    from hsx.plan import Plan
    from hsx.spec import load_spec
    from hsx.store import layout
    from hsx.store.codec import Codec
    from hsx.store.scan import ShardScan, scan_run

    raw = load_spec(finished_run)
    zstd, fp8 = (raw.model_copy(update={"codec": c}) for c in (Codec.ZSTD, Codec.FP8))
    bpt = raw.bytes_per_token  # float32 states [1, 3, 4] + final, hidden 64: 4 * 64 * 4 + 9
    assert bpt == 1033
    # raw is exact, fp8 known in advance (1 byte a value + a float32 scale per 64), zstd measured
    assert volume.stored_ratio(raw) == 1.0 and volume.stored_ratio(fp8) == (1 + 4 / 64) / 4
    assert volume.stored_ratio(zstd) == 1.0
    assert volume.stored_ratio(zstd, volume.Measured(volume.MIN_FILES - 1, 1000, 500)) == 1.0
    assert volume.stored_ratio(zstd, volume.Measured(volume.MIN_FILES, 1000, 500)) == 0.5 * (1 + volume.MARGIN)
    assert volume.stored_ratio(zstd, volume.Measured(volume.MIN_FILES, 1000, 999)) == 1.0  # never above raw
    lengths = Plan(finished_run).lengths
    scans = scan_run(finished_run, 40, 10, deep=False)
    m = volume.Measured.on_disk(raw, lengths, scans)
    on_disk = sum(p.stat().st_size for p in (finished_run / "shards").rglob("*.safetensors"))
    assert m.files == 40 and m.raw == int(lengths.sum()) * bpt and m.stored == on_disk

    # a new run on a 2 MB volume: raw (2.9 MB) does not fit; fp8 does; zstd is refused at raw size by
    # a start that must decide now, and left to its first files by one that measures first
    d = tmpfs("codec", size="2m")
    empty = [ShardScan(s, layout.shard_ids(s, 10, 40)) for s in range(4)]
    logged: list[str] = []
    with pytest.raises(NotEnoughSpace, match="short by"):
        volume.plan_space(d, raw, lengths, empty, False, None, logged.append)
    space = volume.plan_space(d, fp8, lengths, empty, False, None, logged.append)
    assert "fp8 stores 0.266 of raw" in logged[-1] and not space.forecast.start.undecided
    with pytest.raises(NotEnoughSpace):
        volume.plan_space(d, zstd, lengths, empty, False, None, logged.append)
    space = volume.plan_space(d, zstd, lengths, empty, False, None, logged.append, measure_first=True)
    assert "zstd at raw size until its ratio is measured on 8 files" in logged[-2]
    assert "judged again on its first 8 files" in logged[-1] and space.forecast.start.undecided

    # the guard judges it once 8 files are measured: at 0.9 of raw the rest does not fit, at half it does
    f = space.forecast
    f.session = _session(7, 400, 400 * bpt // 2)
    volume.DiskGuard(d, space.reserve, forecast=f)(1)  # 7 files: not yet judged
    assert not f.decided
    f.session = _session(8, 400, 400 * bpt * 9 // 10)
    with pytest.raises(NotEnoughSpace, match="measured on its first 8 files: not enough space"):
        volume.DiskGuard(d, space.reserve, forecast=f)(1)
    f = volume.plan_space(d, zstd, lengths, empty, False, None, logged.append, measure_first=True).forecast
    f.session = _session(20, 1500, 1500 * bpt // 2)
    volume.DiskGuard(d, space.reserve, forecast=f)(1)
    assert f.decided and f.ratio() == 0.5 * (1 + volume.MARGIN)

    # batches and bytes in flight count at the ratio (0.525 here)
    reserve = 256 << 10
    for in_flight, batch in ((0, 1900 << 10), (1000 << 10, 1000 << 10)):
        with pytest.raises(volume.LowSpace):
            volume.DiskGuard(d, reserve, lambda n=in_flight: n)(batch)
        volume.DiskGuard(d, reserve, lambda n=in_flight: n, forecast=f)(batch)
    with pytest.raises(volume.LowSpace):
        volume.DiskGuard(d, reserve, lambda: 2500 << 10, forecast=f)(1000 << 10)


def test_a_zstd_run_too_large_at_raw_size_is_judged_on_its_first_files(tmpfs, finished_run, tmp_path):
    from hsx.store.codec import Codec
    from test_codec import expected_files

    d = tmpfs("zstd", size="3m")  # raw needs 2.9 MB + a 1.1 MB reserve; zstd ~2.6 MB: neither fits
    run = d / "run"
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(40))
    refused = hsx(*extract_args(data, run, "--codec", "zstd"), check=False)
    err = " ".join(refused.stderr.split())
    assert refused.returncode == EXIT_REFUSED, refused.stderr
    assert "zstd at raw size until its ratio is measured on 8 files" in err
    assert "the run starts and is judged again on its first 8 files" in err
    assert "measured on its first" in err and "not enough space on" in err and "--allow-partial" in err
    done = assert_clean_stop(run)
    assert 8 <= done < 40  # decided on the first files, long before the volume was full
    expected = expected_files(finished_run, Codec.ZSTD)  # what an uninterrupted zstd run holds
    written = run_files(run)
    assert len(written) == done and all(expected[name] == data for name, data in written.items())


def test_a_scaled_out_zstd_run_too_large_at_raw_size_is_judged_by_its_workers(tmpfs, finished_run, tmp_path):
    """The same run as above over two Ray workers: the driver starts it as a single process would,
    and the workers' guards judge it on their first files (each against the whole rest of the run).
    A resume then measures the ratio on the files on disk and is refused at its start."""
    from conftest import require
    from hsx.store.codec import Codec
    from test_codec import expected_files

    require("ray")
    d = tmpfs("zstd-workers", size="3m")
    run = d / "run"
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(40))
    refused = hsx(*extract_args(data, run, "--codec", "zstd", "--workers", "2"), check=False)
    out = " ".join((refused.stdout + refused.stderr).split())
    assert refused.returncode == EXIT_REFUSED, out
    assert "the run starts and is judged again on its first 8 files" in out
    assert "measured on its first" in out and "not enough space on" in out
    done = assert_clean_stop(run)
    assert 8 <= done < 40
    expected = expected_files(finished_run, Codec.ZSTD)
    written = run_files(run)
    assert len(written) == done and all(expected[name] == data for name, data in written.items())

    again = hsx("extract", "--out", run, "--workers", "2", "--device", "cpu", check=False)
    out = " ".join((again.stdout + again.stderr).split())
    assert again.returncode == EXIT_REFUSED, out
    assert f"measured on {done} files" in out and "not enough space on" in out
    assert run_files(run) == written


def test_a_ray_worker_whose_volume_fills_stops_the_run_as_one_process_does(tmpfs, finished_run, tmp_path):
    """Two Ray workers on a real 3 MB tmpfs: the worker that meets the reserve stops its shard cleanly,
    its outcome stops the driver, and the run ends with the exit code and words of a process of its
    own (the space still needed counted by the driver); every file left verifies, and the resume it
    prints, once the volume grew, finishes the run bit-identical to an uninterrupted one."""
    from conftest import require

    require("ray")
    d = tmpfs("workers", size="3m")  # the reserve counts the other worker's batch too
    run = d / "run"
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(40))
    stopped = hsx(*extract_args(data, run, "--workers", "2", "--allow-partial"), check=False)
    assert "is under the reserve of" in " ".join(stopped.stderr.split())
    done, resume = stopped_cleanly(stopped, run, 40)
    assert resume == f"hsx extract --out {run}"
    assert not (run / "workers").exists() and not (run / "lock.json").exists()
    remount(d, size="16m")
    resumed = hsx(*shlex.split(resume)[1:])
    assert f"{40 - done} written now, {done} were already verified" in resumed.stdout
    assert run_files(run) == run_files(finished_run)


def test_a_generate_run_stopped_by_a_full_volume_prints_the_generate_resume_that_works(tmpfs, tmp_path):
    d = tmpfs("gen", size="64m", nr_inodes=24)  # bytes to spare, files not: it stops on a real ENOSPC
    run = d / "gen"
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(30))
    args = ["generate", "--model", TINY, "--data", data, "--out", run, "--device", "cpu", "--max-new-tokens", "2",
            "--shard-size", "50", "--allow-partial"]  # fmt: skip
    stopped = hsx(*args, check=False)
    err = " ".join(stopped.stderr.split())
    assert stopped.returncode == EXIT_DISK_FULL and "Stopped cleanly:" in err, stopped.stderr
    assert f"Free space, then resume: hsx generate --out {run}" in err, err
    done = assert_clean_stop(run)
    assert 0 < done < 30 and f"{done}/30 conversations are done" in err, err
    remount(d, nr_inodes=4096)
    resumed = hsx(*shlex.split(err.split("then resume: ", 1)[1])[1:])
    assert re.search(rf"convs +30/30 done, {30 - done} written now .*, {done} were already verified", resumed.stdout)


# ---------------------------------------------------------------- other write errors: their own words


def test_a_file_size_limit_stops_cleanly_in_its_own_words_and_resumes_identical(finished_run, tmp_path):
    """A real ``ulimit -f`` (RLIMIT_FSIZE in the child) smaller than the larger samples: EFBIG was a
    traceback. The run stops cleanly, says what stopped it and what to do, leaves every file whole,
    and the resume without the limit writes the run an unlimited one writes."""
    import resource

    limit = 105_000  # the plan, the spec and most samples fit; the two largest (~109 kB, in shard 2) do not

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    run = tmp_path / "run"
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(40))
    stopped = hsx(*extract_args(data, run), check=False, preexec_fn=small_files, env={"PYTHONDONTWRITEBYTECODE": "1"})
    err = " ".join(stopped.stderr.split())
    assert stopped.returncode == EXIT_DISK_FULL and "Traceback" not in stopped.stderr, stopped.stderr
    assert "a file reached the size limit (ulimit -f, or the file system's largest file) while writing" in err, err
    assert f"Raise the file-size limit (ulimit -f), then resume: hsx extract --out {run}" in err, err
    assert 0 < assert_clean_stop(run) < 40
    hsx("extract", "--out", run)
    assert run_files(run) == run_files(finished_run)


def test_a_read_only_volume_stops_cleanly_and_destinations_there_are_refused(tmpfs, finished_run, tmp_path):
    """A real read-only tmpfs: the resume is refused in its own words (no traceback), and goes on
    once the volume is writable again; an export or a vocabulary aimed at it, under a
    file or at a file is refused by name (they were tracebacks), and so is a consumer whose
    consumers/ is a file."""
    from hsx.data import StreamDataset
    from hsx.errors import Unwritable

    d = tmpfs("ro", size="64m")
    run = d / "run"
    shutil.copytree(finished_run, run)
    unwrite(run, 3)
    subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)
    refused = hsx("extract", "--out", run, check=False)  # refused before anything is written
    err = " ".join(refused.stderr.split())
    assert refused.returncode == EXIT_REFUSED and "Traceback" not in refused.stderr, refused.stderr
    assert "is not writable here (read-only" in err, err

    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    for dest, why in ((d / "export", "Read-only file system"), (a_file / "sub", "is a file, not a folder"),
                      (a_file, "not a folder")):  # fmt: skip
        for args in (["export", finished_run, dest, "--to", "speculators"], ["vocab", finished_run, "--size", "48",
                                                                              "--dest", dest]):  # fmt: skip
            r = CliRunner().invoke(app, list(map(str, args)))
            assert isinstance(r.exception, SystemExit), (args, r.output)  # a refusal, never a traceback
            assert r.exit_code == EXIT_REFUSED and why in " ".join(r.output.split()), (args, r.output)

    subprocess.run(["mount", "-o", "remount,rw", str(d)], check=True)
    hsx("extract", "--out", run)
    assert run_files(run) == run_files(finished_run)
    (run / "consumers").write_text("not a folder")
    with pytest.raises(Unwritable, match="consumers is a file, not a folder"):
        StreamDataset(run, "draft", max_tokens=512, seed=0, log=lambda _: None)


def test_an_io_error_mid_run_stops_cleanly_in_its_own_words_and_the_moved_run_resumes_identical(finished_run, tmp_path):
    """A real EIO: the run's volume is an ext4 on a loop device, and its backing file is cut short
    while the extraction is stopped (SIGSTOP) between two samples, so that the next write it makes
    durable fails in the block layer. It stops cleanly, in its own words (it was a traceback class no
    test met), and the run moved off the failed volume resumes to the bytes an unbroken run has."""
    import signal
    import time

    if os.geteuid() != 0:
        pytest.skip("a loop device needs root")
    image, volume = tmp_path / "volume.img", tmp_path / "volume"
    volume.mkdir()
    subprocess.run(["truncate", "-s", "64M", str(image)], check=True)
    # no journal: a failed write is the data write's EIO, not a journal abort (EROFS) first
    subprocess.run(["mkfs.ext4", "-q", "-O", "^has_journal", str(image)], check=True)
    loop = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True, text=True)
    if loop.returncode != 0:
        pytest.skip(f"this machine gives no loop device: {loop.stderr.strip()}")
    device = loop.stdout.strip()
    try:
        subprocess.run(["mount", "-o", "errors=continue", device, str(volume)], check=True)
        run = volume / "run"
        shutil.copytree(finished_run, run)
        for shard in (1, 2, 3):  # 30 samples left to write
            unwrite(run, shard)
        before = set((run / "shards").rglob("*.safetensors"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "hsx", "extract", "--out", str(run)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=os.environ | {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"},
        )
        deadline = time.monotonic() + HANG_GUARD_S
        while not set((run / "shards").rglob("*.safetensors")) - before:  # progress: a new sample written
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.005)
        proc.send_signal(signal.SIGSTOP)
        subprocess.run(["truncate", "-s", "1M", str(image)], check=True)  # every block past 1 MB is gone
        subprocess.run(["losetup", "-c", device], check=True)
        proc.send_signal(signal.SIGCONT)
        _, err = proc.communicate(timeout=HANG_GUARD_S)
        said = " ".join(err.split())
        assert proc.returncode == EXIT_DISK_FULL and "Traceback" not in err, err
        assert "an I/O error on the output volume while writing" in said, said
        assert f"Check the volume (dmesg, its health) or move the run, then resume: hsx extract --out {run}" in said
        moved = tmp_path / "moved"
        shutil.copytree(run, moved)  # what was written before the failure, read back as it was made durable
    finally:
        subprocess.run(["umount", "-l", str(volume)], check=False)
        subprocess.run(["losetup", "-d", device], check=False)
    assert 10 < assert_clean_stop(moved) < 40
    hsx("extract", "--out", moved)
    assert run_files(moved) == run_files(finished_run)
