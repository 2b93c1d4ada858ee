"""Shared test helpers: the bundled tiny model, small conversation files, running hsx for real."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

# One intra-op thread in the test processes and every process they start (inherited), unless set:
# the models here are tiny, so more threads gain nothing, while two test processes and their
# children, each with a thread per core, oversubscribe a small CI machine and their spinning
# OpenMP threads burn the cores the others wait for (a third of the suite's CPU time on 2 cores).
# Set before torch is imported anywhere in the process, which reads it then.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Python's own Ctrl-C handling in the test processes, whatever started them: a background job of a
# non-interactive shell (``cmd &`` in a script) ignores SIGINT, every process under it inherits that,
# and the tests that press Ctrl-C on hsx (or on the Ray driver's watch) would see nothing happen.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest
import torch

from hsx.tinymodel import bundled_path

# Without CUDA, Triton's kernels run only in its interpreter (test_int4_kernel), which
# ``triton.jit`` chooses as it decorates, its own library's functions included, when triton is
# first imported: so here, before anything imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY = bundled_path("tiny-llama")
# Every wall-clock limit a test sets is this hang guard: a hang, never a pace. The slowest healthy
# command in CI (test_bench's ``hsx bench --compile on``, compiling) took 186 s on a loaded 2-core
# machine; four times slower it still ends well inside 30 minutes.
HANG_GUARD_S = 1800
SHAREGPT = bundled_path("data/sharegpt_dummy_conversation.json")


# The modules that take longest on CI's 2-core machine, in that order, run first: xdist hands each
# worker whole modules in collection order (--dist loadscope), so one of these begun last ran alone
# for minutes at the end while the other workers had nothing left. Order only: every test runs.
SLOWEST_FIRST = (
    "test_parallel_faults", "test_diskguard", "test_scaleout", "test_parallel", "test_cli", "test_consumer",
    "test_quantized", "test_extract", "test_status", "test_generate",
)  # fmt: skip


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order


def conversations(n: int, start: int = 0) -> list[dict]:
    return json.loads(SHAREGPT.read_text())[start : start + n]


def with_text_arguments(messages: list[dict]) -> list[dict]:
    """Chat messages with each call's arguments as their JSON text, as a server hands them to a
    template that concatenates them (DeepSeek's official ones)."""
    for m in messages:
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.dumps(c["function"]["arguments"], ensure_ascii=False)
    return messages


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def tiny_model() -> Path:
    return TINY


@pytest.fixture
def convs(tmp_path: Path) -> Path:
    """40 real multi-turn conversations as JSONL."""
    return write_jsonl(tmp_path / "convs.jsonl", conversations(40))


def hsx(
    *args: str, check: bool = True, timeout: float = HANG_GUARD_S, env: dict | None = None, **kw
) -> subprocess.CompletedProcess:
    """Run the real command line in a subprocess (``env``: variables added to this one's)."""
    env = os.environ | {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"} | (env or {})
    proc = subprocess.run(
        [sys.executable, "-m", "hsx", *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env, **kw
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"hsx {' '.join(map(str, args))} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def save_random(config, path: Path, seed: int = 0, whole=None) -> Path:
    """A random model of ``config`` in float32, saved as transformers saves it (``whole``: the auto
    class of a release that is no causal LM, e.g. ``AutoModelForImageTextToText``)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    (whole or AutoModelForCausalLM).from_config(config).to(torch.float32).eval().save_pretrained(path)
    return path


def save_tiny(config, path: Path, seed: int = 0, whole=None) -> Path:
    """``save_random`` with the bundled tokenizer and chat template (``config.vocab_size`` must be
    the tokenizer's 2048), so that ``hsx extract`` runs on it."""
    import shutil

    save_random(config, path, seed, whole)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY / name, path / name)
    return path


def run_files(out: Path) -> dict[str, bytes]:
    """Every sample file of a run, by path relative to its shards folder, with its bytes."""
    root = out / "shards"
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.safetensors"))}


# ---------------------------------------------------------------- finished run and real damage (status, verify)

SMALL_RUN = ("--shard-size", "10", "--batch-tokens", "512", "--writers", "2", "--device", "cpu")


def extract_args(data: Path, out: Path, *extra: str) -> list:
    """``hsx extract`` of a new small run: 10 samples a shard, small batches, CPU, raw unless a
    ``--codec`` is given (the byte-identity, disk and resume tests compare with ``finished_run``)."""
    codec = () if "--codec" in extra else ("--codec", "raw")
    return ["extract", "--model", TINY, "--data", data, "--out", out, *SMALL_RUN, *codec, *extra]


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory) -> Path:
    """A complete raw run of the first 40 conversations (4 sealed shards): the states as the model
    gave them, which the codec tests encode and the readers' tests load as they are. Copy it before
    changing it."""
    root = tmp_path_factory.mktemp("finished")
    data = write_jsonl(root / "convs.jsonl", conversations(40))
    hsx(*extract_args(data, root / "run"))
    return root / "run"


def unwrite(run: Path, shard: int) -> None:
    """Make ``shard`` of a finished run one not written yet: its folder, and the run's record that
    it sealed it (without which a deleted shard is data lost, not work left)."""
    import shutil

    from hsx.store import layout

    shutil.rmtree(layout.shard_dir(run, shard))
    layout.seal_record(run, shard).unlink()


def load_states(path: Path) -> dict:
    """A sample file's tensors as a raw file holds them, whatever its codec (new runs store zstd)."""
    from hsx.store.format import decode

    return decode(Path(path).read_bytes())


def flip_byte(path: Path, offset: int) -> None:
    """Flip one bit in place (negative offsets count from the end)."""
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_SET if offset >= 0 else os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))


def damage(run: Path) -> dict[str, str]:
    """Inject one real fault of each kind into a finished run; returns path (relative to run) -> kind."""
    s0, s1 = run / "shards" / "000000", run / "shards" / "000001"
    truncated = s0 / "000000001.safetensors"
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    flip_byte(s0 / "000000002.safetensors", -3)  # data section: only the digest can tell
    zeros = s0 / "000000003.safetensors"
    zeros.write_bytes(bytes(zeros.stat().st_size))
    (s0 / "000000005.safetensors").write_bytes((s0 / "000000004.safetensors").read_bytes())  # right name, wrong sample
    os.rename(s1 / "000000015.safetensors", s0 / "000000015.safetensors")  # wrong shard folder
    (s0 / ".000000006.safetensors.tmp-4242-1").write_bytes(b"half a write")
    return {
        "shards/000000/000000001.safetensors": "truncated",
        "shards/000000/000000002.safetensors": "corrupt",  # deep check only
        "shards/000000/000000003.safetensors": "corrupt",
        "shards/000000/000000005.safetensors": "misplaced",
        "shards/000000/000000015.safetensors": "misplaced",
        "shards/000001/000000015.safetensors": "missing",
        "shards/000000/.000000006.safetensors.tmp-4242-1": "stray",
    }


def normed_model(dest: Path) -> Path:
    """The tiny Llama with a non-trivial final norm (mixed signs and scales), so post/weight is tested."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(TINY, dest)
    weights = load_file(dest / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    w = torch.empty(64).uniform_(0.2, 3.0, generator=g) * torch.where(torch.rand(64, generator=g) < 0.2, -1.0, 1.0)
    weights["model.norm.weight"] = w
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def require(module: str):
    """Import an optional dependency, or skip; where HSX_REQUIRE names it (CI does), fail instead."""
    import importlib

    required = {m.strip() for m in os.environ.get("HSX_REQUIRE", "").split(",") if m.strip()}
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if module in required or module.split(".")[0] in required:
            raise AssertionError(f"{module} is required here (HSX_REQUIRE) but does not import: {e}") from e
        pytest.skip(f"{module} is not installed")


def verified_files(out: Path) -> dict[Path, tuple[int, int]]:
    """path -> (inode, mtime) of every sample file that passes the deep check right now."""
    from hsx.store.format import BadFile, check
    from hsx.store.layout import parse_sample_name

    good = {}
    for p in (out / "shards").rglob("*.safetensors") if (out / "shards").exists() else []:
        try:
            check(p, parse_sample_name(p.name), deep=True)
        except (BadFile, OSError):
            continue
        st = p.stat()
        good[p] = (st.st_ino, st.st_mtime_ns)
    return good


def kill_after_new_files(proc: subprocess.Popen, out: Path, k: int, seed: int, sig: int = 9, log: Path | None = None):
    """Send ``sig`` (SIGKILL by default) to ``proc`` (an extract or generate run into ``out``) as soon
    as k sample or conversation files have appeared that were not there when it started (and, with
    ``log``, its stderr file, a progress line): a progress point, never a clock. Waits for its end."""
    import time

    def files() -> set[Path]:
        return set((out / "shards").rglob("*.safetensors")) if (out / "shards").exists() else set()

    def ready() -> bool:
        return log is None or any(line.startswith("progress done=") for line in log.read_text().splitlines())

    before = files()
    deadline = time.monotonic() + HANG_GUARD_S
    while len(files() - before) < k or not ready():
        assert proc.poll() is None, f"seed {seed}: the run ended (rc {proc.returncode}) before {k} new files"
        assert time.monotonic() < deadline, f"seed {seed}: no progress for {HANG_GUARD_S} s"
        time.sleep(0.005)
    proc.send_signal(sig)
    proc.wait(timeout=HANG_GUARD_S)


# ---------------------------------------------------------------- a real small volume that fills


@pytest.fixture
def tmpfs(tmp_path):
    """Mount a size-limited tmpfs: ``tmpfs(name, size="2m", nr_inodes=30)``; unmounted after the test."""
    mounted: list[Path] = []

    def mount(name: str, **opts) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        d = tmp_path / name
        d.mkdir()
        opt = ",".join(f"{k}={v}" for k, v in opts.items())
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opt, "tmpfs", str(d)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"this machine refuses to mount a tmpfs: {r.stderr.strip()}")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], check=False)


def remount(d: Path, **opts) -> None:
    opt = ",".join(["remount", *(f"{k}={v}" for k, v in opts.items())])
    subprocess.run(["mount", "-o", opt, str(d)], check=True)


def assert_clean_stop(run: Path) -> int:
    """No temp file left, every sample file passes the deep check; returns how many there are."""
    from hsx.store.durable import is_temp
    from hsx.store.format import check
    from hsx.store.layout import parse_sample_name

    files = list((run / "shards").rglob("*"))
    assert not [p for p in files if is_temp(p.name)]
    samples = [p for p in files if p.name.endswith(".safetensors")]
    for p in samples:
        check(p, parse_sample_name(p.name), deep=True)
    return len(samples)


def stopped_cleanly(proc: subprocess.CompletedProcess, run: Path, total: int, unit: str = "samples") -> tuple[int, str]:
    """``proc`` (an ``hsx extract``/``generate`` whose volume filled) stopped as every executor stops on a
    full disk: exit 3, the same three sentences, no traceback; every file left verifies. Returns how
    many files it left and the command it said resumes."""
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr
    done = assert_clean_stop(run)
    stop = re.search(
        rf"\. Stopped cleanly: {done}/{total} {unit} are done and verified; about [0-9.,]+ [kMG]?B more are needed "
        r"to finish\. Free space, then resume: (hsx \S+ --out \S+)$",
        err,
    )
    assert stop is not None and 0 < done < total, err
    return done, stop.group(1)
