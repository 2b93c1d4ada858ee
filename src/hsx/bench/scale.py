"""Recovery at scale: how long status, verification and a no-op resume take on a run of tens of
thousands of files, next to the disk's own read rate over the same files.

It builds a finished run without a forward pass: a plan of random token ids, sample files of
random states written through the store's encoder, one ``sync``, then every shard sealed, exactly
the on-disk state ``hsx extract`` leaves (its spec names the bundled tiny model, so a resume of it
is a real one). Then it times, each as the command line runs it (a fresh process, imports included):
``hsx status`` (fast: sealed shards are trusted by listing), ``hsx status --deep``,
``hsx verify --deep``, and ``hsx extract --out RUN`` (a no-op resume: every digest verified, no
model loaded); and ``cat`` of the same files in N parallel streams, the disk's rate for them. With
``--cold`` the page cache is dropped before each read (root only; skipped otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hsx.capture import default_layers
from hsx.plan import Sample, write_plan
from hsx.spec import PlanIdentity, RunSpec, now, who
from hsx.store import layout
from hsx.store.format import SampleTensors, encode
from hsx.store.writer import FileRecord, seal
from hsx.target import identity, load_tokenizer, tokenizer_identity
from hsx.tinymodel import bundled_path
from hsx.units import size


def build_run(run: Path, samples: int, tokens: int, shard_size: int, threads: int = 8) -> RunSpec:
    """A finished, sealed run of ``samples`` files of ``tokens`` tokens each (bf16, the tiny model's shape)."""
    model_dir = bundled_path("tiny-llama")
    model = identity(str(model_dir), model_dir)
    layers = default_layers(model.num_layers)
    input_ids = np.random.default_rng(0).integers(0, 2048, (samples, tokens)).astype(np.int32)
    run.mkdir(parents=True)
    plan_rows = (Sample(ids, np.ones(tokens, np.int8), False, "synthetic", i, "") for i, ids in enumerate(input_ids))
    info, _ = write_plan(run, plan_rows, tokens)
    spec = RunSpec(
        created=now(),
        created_by=who(),
        backend="transformers",
        model=model,
        tokenizer=tokenizer_identity(load_tokenizer(model_dir, False)),
        layers=layers,
        dtype="bfloat16",
        max_length=tokens,
        batch_tokens=max(tokens, 4096),
        shard_size=shard_size,
        data=[],
        plan=PlanIdentity.of(info, 0),
    )
    h = model.hidden_size
    # one pool of random states; each sample is a contiguous window of it at its own offset
    pool = torch.randn(tokens * (len(layers) + 1) * h + samples).to(torch.bfloat16)

    def write(sid: int) -> FileRecord:
        aux_n, fin_n = tokens * len(layers) * h, tokens * h
        sample = SampleTensors(
            sid,
            torch.from_numpy(input_ids[sid].astype(np.int64)),
            torch.ones(tokens, dtype=torch.uint8),
            pool[sid : sid + aux_n].view(tokens, len(layers) * h),
            pool[sid + aux_n : sid + aux_n + fin_n].view(tokens, h),
        )
        parts, digest = encode(sample, layers)
        path = layout.sample_path(run, sid, shard_size)
        with open(path, "wb") as f:
            f.writelines(parts)
        return FileRecord(sid, sum(memoryview(p).nbytes for p in parts), digest)

    n_shards = layout.num_shards(samples, shard_size)
    for s in range(n_shards):
        layout.shard_dir(run, s).mkdir(parents=True)
    with ThreadPoolExecutor(threads) as pool_:
        records = list(pool_.map(write, range(samples)))
    os.sync()  # every file durable before any manifest says so, as hsx extract guarantees per shard
    for s in range(n_shards):
        seal(run, s, [records[i] for i in layout.shard_ids(s, shard_size, samples)])
    spec.save(run)
    return spec


def drop_caches() -> bool:
    """Empty the page cache so the next read comes from the disk; False where that is not allowed."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


@dataclass
class Timed:
    name: str
    seconds: float  # the whole command, process start and imports included
    bytes: int = 0
    scan_seconds: float | None = None  # the scan alone, as hsx reports it
    note: str = ""

    @property
    def rate(self) -> float:
        t = self.scan_seconds or self.seconds
        return self.bytes / t if t else 0.0


def hsx(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hsx", *args], capture_output=True, text=True, env=env)
    return time.perf_counter() - t0, proc


def integrity_of(report: dict) -> dict:
    checks = report.get("checks") or [report["integrity"]]
    return next(c for c in checks if c["name"] == "integrity")["data"]


def timed_hsx(name: str, *args: str) -> Timed:
    seconds, proc = hsx(*args)
    try:
        data = integrity_of(json.loads(proc.stdout)) if "--json" in args else None
    except (ValueError, KeyError, StopIteration):
        data = None
    if data is None:
        last = (proc.stderr or proc.stdout).strip().splitlines()
        return Timed(name, seconds, note=f"exit {proc.returncode}: {last[-1] if last else ''}")
    note = f"exit {proc.returncode}, {data['files_opened']:,} files opened, {data['files_trusted']:,} trusted by seal"
    return Timed(name, seconds, data["bytes_read"], data["seconds"], note)


def cat_parallel(files: list[Path], streams: int) -> Timed:
    """The disk's own rate for these files: ``cat`` in ``streams`` parallel processes."""
    total = sum(p.stat().st_size for p in files)
    t0 = time.perf_counter()
    subprocess.run(
        ["xargs", "-0", "-P", str(streams), "-n", str(max(1, len(files) // (streams * 8))), "cat"],
        input=b"\0".join(str(p).encode() for p in files),
        stdout=subprocess.DEVNULL,
        check=True,
    )
    return Timed(f"cat, {streams} streams", time.perf_counter() - t0, total)


def bench(workdir: Path, samples: int, tokens: int, shard_size: int, streams: int, cold: bool) -> list[Timed]:
    run = workdir / "run"
    if run.exists():
        shutil.rmtree(run)
    t0 = time.perf_counter()
    build_run(run, samples, tokens, shard_size)
    files = sorted(run.glob(f"{layout.SHARDS}/*/*{layout.SUFFIX}"))
    total = sum(p.stat().st_size for p in files)
    print(f"built {len(files):,} files, {size(total)}, in {time.perf_counter() - t0:.1f} s: {run}", flush=True)
    dropped = cold and drop_caches()
    if cold and not dropped:
        print("--cold: cannot drop the page cache here (needs root); timing warm", flush=True)
    mode = "cold" if dropped else "warm"

    def phase(make) -> Timed:
        if dropped:
            drop_caches()
        result = make()
        result.name += f" ({mode})"
        print(row(result), flush=True)
        return result

    out = [
        phase(lambda: timed_hsx("hsx status", "status", str(run), "--json")),
        phase(lambda: timed_hsx("hsx status --deep", "status", str(run), "--deep", "--json")),
        phase(lambda: timed_hsx("hsx verify --deep", "verify", str(run), "--deep", "--json")),
        phase(lambda: cat_parallel(files, streams)),
        phase(lambda: timed_hsx("no-op resume", "extract", "--out", str(run))),
        phase(lambda: timed_hsx("no-op resume --fast-verify", "extract", "--out", str(run), "--fast-verify")),
    ]
    verify, disk = out[2], out[3]
    if verify.rate and disk.rate:
        print(f"verify --deep reads at {verify.rate / disk.rate:.2f}x the disk's rate ({streams} cat streams)")
    return out


def row(t: Timed) -> str:
    line = f"{t.name:<36} {t.seconds:7.2f} s"
    if t.bytes:
        scan = f", scan {t.scan_seconds:.2f} s" if t.scan_seconds is not None else ""
        line += f"  {size(t.bytes)}{scan}, {t.rate / 1e9:.2f} GB/s"
    return line + (f"  [{t.note}]" if t.note else "")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hsx.bench.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=40000)
    p.add_argument("--tokens", type=int, default=16, help="tokens per sample (the file size follows)")
    p.add_argument("--shard-size", type=int, default=2000)
    p.add_argument("--streams", type=int, default=8, help="parallel cat streams for the disk's own rate")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each timed read (root)")
    p.add_argument("--workdir", type=Path, required=True, help="where the run is built (replaced)")
    a = p.parse_args(argv)
    bench(a.workdir, a.samples, a.tokens, a.shard_size, a.streams, a.cold)


if __name__ == "__main__":
    main()
