"""The extraction job: set up a run (plan + spec) or resume one, then capture and store what is missing.

    hsx extract --model M --data D --out OUT     new run: plan, spec, then extraction
    hsx extract --out OUT                         resume: everything comes from OUT/hsx.json

Resume verifies what is on disk first (digests by default), removes stray temp files, and redoes
exactly the samples without a good file. Batches are fixed by the plan, so a redone sample is
computed in the same batch as in an uninterrupted run and its tensors are bit-identical.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hsx import target
from hsx.assess import volume
from hsx.capture import check_layers, default_layers
from hsx.capture.transformers import TransformersBackend, packing_supported, resolve_dtype
from hsx.input import read_conversations
from hsx.lock import GUARD, LOCK, METRICS, RunLock
from hsx.plan import PLAN_DIR, Plan, Tokenize, batches_for, tokenize_all, write_plan
from hsx.progress import Progress
from hsx.scaleout import registry as scaleout_registry
from hsx.spec import DataFile, PlanIdentity, RunSpec, differences, load_spec, now, who
from hsx.staging import Staging, staging_for
from hsx.store import layout
from hsx.store.durable import TMP_MARK, DiskFull, is_temp, write_durable
from hsx.store.format import FINAL_STATE, SampleTensors
from hsx.store.quarantine import quarantine
from hsx.store.scan import Problem, ShardScan, scan_run
from hsx.store.writer import FileRecord, SampleWriter, seal

DEFAULTS = {"max_length": 4096, "batch_tokens": 16384, "shard_size": 1000, "dtype": "auto"}
INIT_FILES = {PLAN_DIR, layout.REJECTS, LOCK, GUARD, METRICS}


class Refused(Exception):
    """The run cannot start or resume as asked; the message says why and what to do."""


@dataclass
class ExtractOptions:
    out: Path
    model: str | None = None
    data: list[Path] = field(default_factory=list)
    layers: list[int] | None = None
    max_length: int | None = None
    batch_tokens: int | None = None
    dtype: str | None = None
    device: str | None = None
    shard_size: int | None = None
    trust_remote_code: bool = False
    writers: int = 8
    max_inflight_bytes: int = 4 << 30  # host memory for states not yet on disk (pinned staging on CUDA)
    deep_verify: bool = True
    packing: str = "auto"  # auto | on | off: one packed row per batch (no padding computed) or padded rows
    compile: str = "auto"  # auto | on | off: torch.compile the decoder layers (auto: on for CUDA)
    allow_partial: bool = False  # start even when the projected size exceeds free space
    reserve_bytes: int | None = None  # kept free while running; None: max(1% of volume, 2x largest batch)
    backend: str | None = None  # transformers | vllm; a new run's default is transformers
    tensor_parallel_size: int | None = None  # vllm backend only; not part of the spec
    data_parallel_size: int | None = None  # vllm backend only; not part of the spec
    workers: int = 0  # scale-out: this many Ray workers, one per GPU (0: this process alone)
    ray_address: str | None = None  # join this Ray cluster; None: start a local one for the run


@dataclass
class Summary:
    run: Path
    total_samples: int
    total_tokens: int
    already_done: int
    written: int = 0
    tokens_written: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    rejected: int = 0
    redone: dict[str, int] = field(default_factory=dict)
    stray_removed: int = 0
    quarantined: int = 0
    waited_for_disk: float = 0.0  # seconds the forward pass waited for writes: > a few % means the disk is the limit

    @property
    def done(self) -> int:
        return self.already_done + self.written

    @property
    def complete(self) -> bool:
        return self.done == self.total_samples


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_packing(packing: str, device: str, architecture: str) -> bool:
    """auto: pack on CUDA where the model's attention is pluggable; padded rows otherwise."""
    if packing not in ("auto", "on", "off"):
        raise ValueError(f"--packing takes auto, on or off, not {packing!r}")
    if packing == "off":
        return False
    ok = packing_supported(architecture)
    if packing == "on" and not ok:
        raise ValueError(f"{architecture} does not take a pluggable attention function: use --packing off")
    return ok and (packing == "on" or device.startswith("cuda"))


def resolve_compile(compile: str, device: str, backend: str) -> bool:
    """auto: compile on CUDA where Triton is installed (the element-wise kernels it fuses are a
    quarter of the forward there); on CPU the compile takes longer than most runs gain."""
    if compile not in ("auto", "on", "off"):
        raise ValueError(f"--compile takes auto, on or off, not {compile!r}")
    if backend != "transformers":
        if compile == "on":
            raise ValueError(f"--compile applies to the transformers backend, not {backend}")
        return False
    if compile == "auto":
        return device.startswith("cuda") and importlib.util.find_spec("triton") is not None
    return compile == "on"


# ---------------------------------------------------------------- setting up or checking a run


def _asked(opts: ExtractOptions) -> dict:
    """What the operator gave on the command line, in the spec's terms (for the drift check)."""
    asked: dict = {}
    if opts.model is not None:
        model_dir = target.resolve(opts.model)
        asked["model"] = target.identity(opts.model, model_dir)
        asked["tokenizer"] = target.tokenizer_identity(target.load_tokenizer(model_dir, opts.trust_remote_code))
    if opts.data:
        asked["data"] = [DataFile.of(p) for p in opts.data]
    for key in ("layers", "max_length", "batch_tokens", "shard_size", "backend"):
        asked[key] = getattr(opts, key)
    if opts.dtype not in (None, "auto"):
        asked["dtype"] = opts.dtype
    for key, flag, value in (("packed", "packing", opts.packing), ("compiled", "compile", opts.compile)):
        if value not in ("auto", "on", "off"):
            raise ValueError(f"--{flag} takes auto, on or off, not {value!r}")
        if value != "auto":  # said out loud on a resume: it must match the run, never silently ignored
            asked[key] = value == "on"
    return asked


def remove_stray_temps(run: Path) -> int:
    """Remove the temp files a killed process left beside the run's own files (spec, plan, rejects,
    lock, metrics); shard folders are tidied by the scan. Returns how many were removed."""
    removed, mine = 0, f"{TMP_MARK}{os.getpid()}-"  # never this process's own (its heartbeat's)
    for folder in (run, run / PLAN_DIR):
        if folder.is_dir():
            for p in folder.iterdir():
                if is_temp(p.name) and mine not in p.name and p.is_file():
                    p.unlink(missing_ok=True)
                    removed += 1
    return removed


def create_run(opts: ExtractOptions, log: Callable[[str], None]) -> RunSpec:
    if not opts.model or not opts.data:
        raise Refused(f"{opts.out} is not a run yet: a new run needs --model and --data")
    if opts.out.exists():
        remove_stray_temps(opts.out)  # an interrupted set-up; the plan is rebuilt from the data
        foreign = sorted(p.name for p in opts.out.iterdir() if p.name not in INIT_FILES)
        if foreign:
            raise Refused(
                f"{opts.out} is not empty and holds no run spec ({', '.join(foreign[:5])}"
                f"{', ...' if len(foreign) > 5 else ''}): choose an empty or new folder"
            )
    for path in opts.data:
        if not path.is_file():
            raise Refused(f"{path}: no such data file")
    model_dir = target.resolve(opts.model)
    tokenizer = target.load_tokenizer(model_dir, opts.trust_remote_code)
    model = target.identity(opts.model, model_dir)
    layers = opts.layers if opts.layers is not None else default_layers(model.num_layers)
    check_layers(layers, model.num_layers)
    device = opts.device or default_device()
    dtype = resolve_dtype(opts.dtype or DEFAULTS["dtype"], device)
    packed = resolve_packing(opts.packing, device, model.architecture)
    backend, final_state = opts.backend or "transformers", FINAL_STATE
    if backend == "vllm":
        from hsx.capture.vllm import final_state as vllm_final_state

        final_state = vllm_final_state(model_dir)  # refuses a model whose final norm it cannot apply
    elif backend != "transformers":
        raise Refused(f"unknown backend {backend!r}: use transformers or vllm")
    compiled = resolve_compile(opts.compile, device, backend)
    max_length = opts.max_length or DEFAULTS["max_length"]
    opts.out.mkdir(parents=True, exist_ok=True)
    log(f"planning {len(opts.data)} data file(s) with {model.architecture}'s chat template")
    rows = read_conversations(opts.data)
    info, rejects = write_plan(opts.out, tokenize_all(rows, Tokenize(tokenizer, max_length)), max_length)
    write_durable(opts.out / layout.REJECTS, "".join(json.dumps(r.to_json()) + "\n" for r in rejects).encode())
    spec = RunSpec(
        created=now(),
        created_by=who(),
        backend=backend,
        final_state=final_state,
        model=model,
        tokenizer=target.tokenizer_identity(tokenizer),
        layers=layers,
        dtype=dtype,
        max_length=max_length,
        batch_tokens=opts.batch_tokens or DEFAULTS["batch_tokens"],
        shard_size=opts.shard_size or DEFAULTS["shard_size"],
        trust_remote_code=opts.trust_remote_code,
        packed=packed,
        compiled=compiled,
        data=[DataFile.of(p) for p in opts.data],
        plan=PlanIdentity(
            fingerprint=info.fingerprint,
            num_samples=info.num_samples,
            num_tokens=info.num_tokens,
            num_truncated=info.num_truncated,
            num_rejected=len(rejects),
        ),
    )
    spec.save(opts.out)  # last: its presence means the run exists
    log(
        f"plan: {info.num_samples} samples, {info.num_tokens} tokens, {info.num_truncated} truncated, "
        f"{len(rejects)} rejected (see {layout.REJECTS})"
    )
    return spec


def open_run(opts: ExtractOptions, log: Callable[[str], None]) -> RunSpec:
    """The run's spec: created for a new run, checked against the options for an existing one."""
    if not (opts.out / layout.SPEC).exists():
        return create_run(opts, log)
    spec = load_spec(opts.out)
    diffs = differences(spec, _asked(opts))
    if diffs:
        raise Refused(
            f"{opts.out} belongs to a run with other settings; refusing to resume:\n  - "
            + "\n  - ".join(diffs)
            + f"\nResume with the run's own settings: hsx extract --out {opts.out}"
        )
    return spec


def load_plan(run: Path, spec: RunSpec) -> Plan:
    try:
        plan = Plan(run)
    except (OSError, ValueError) as e:
        raise Refused(f"the plan in {run / PLAN_DIR} is unreadable ({e})") from e
    if plan.fingerprint() != spec.plan.fingerprint or len(plan) != spec.plan.num_samples:
        raise Refused(f"the plan in {run / PLAN_DIR} does not match the run spec's fingerprint")
    return plan


def model_dir_for(spec: RunSpec, opts: ExtractOptions) -> Path:
    """Where the model is now: --model if given (already fingerprint-checked), else the spec's path."""
    given = opts.model or spec.model.path
    try:
        path = target.resolve(given)
    except target.ModelNotFound as e:
        raise Refused(f"{e}; if the model moved, pass --model NEW_PATH (it must match the run's fingerprint)") from e
    if opts.model is None:
        diffs = spec.model.fingerprint.differences(target.identity(given, path).fingerprint)
        if diffs:
            raise Refused("the model changed since the run started:\n  - " + "\n  - ".join(diffs))
    return path


# ---------------------------------------------------------------- cleaning what a crash left


def tidy(run: Path, problems: list[Problem], summary: Summary) -> None:
    """Remove stray temp files; move files that are not where they belong aside, never delete them."""
    for p in problems:
        path = run / p.path
        if p.kind == "stray":
            path.unlink(missing_ok=True)
            summary.stray_removed += 1
        elif p.kind in ("misplaced", "foreign") and p.sample_id is None:
            quarantine(run, p)
            summary.quarantined += 1
        elif p.sample_id is not None:
            summary.redone[p.kind] = summary.redone.get(p.kind, 0) + 1


# ---------------------------------------------------------------- the extraction loop


class Extractor:
    guard: Callable[[int], None] | None = None  # called with a batch's bytes before it is captured

    def __init__(
        self,
        run: Path,
        spec: RunSpec,
        plan: Plan,
        backend: TransformersBackend,
        writer: SampleWriter,
        progress: Progress,
        staging: Staging,
    ):
        self.run, self.spec, self.plan = run, spec, plan
        self.backend, self.writer, self.progress, self.staging = backend, writer, progress, staging

    def shard(self, scan: ShardScan) -> list[Future]:
        """Capture and submit every missing sample of one shard; returns the futures to wait on."""
        missing = set(scan.missing)
        futures: list[Future] = []
        for batch in batches_for(scan.expected, self.plan.lengths, self.spec.batch_tokens, self.spec.packed):
            if missing.isdisjoint(batch.ids):
                continue
            if self.guard is not None:
                tokens = sum(int(self.plan.lengths[i]) for i in missing.intersection(batch.ids))
                self.guard(tokens * self.spec.bytes_per_token)
            seqs = [self.plan.input_ids(i) for i in batch.ids]
            captured = self.backend.capture(list(batch.ids), seqs)
            wanted = [row for row, sid in enumerate(captured.sample_ids) if sid in missing]
            host = self.staging.stage(captured, wanted)
            for row, (aux, final) in zip(wanted, host.views, strict=True):
                sid = captured.sample_ids[row]
                sample = SampleTensors(
                    sample_id=sid,
                    input_ids=torch.from_numpy(self.plan.input_ids(sid).astype("int64")),
                    loss_mask=torch.from_numpy(self.plan.loss_mask(sid).astype("uint8")),
                    aux=aux,
                    final=final,
                )
                fut = self.writer.submit(sample, release=host.done_one, ready=host.ready)
                fut.add_done_callback(self.progress.on_written(captured.lengths[row]))
                futures.append(fut)
        return futures

    def finish(self, scan: ShardScan, futures: list[Future]) -> list[FileRecord]:
        """Wait until a shard's writes are durable, then seal it (its old good files + the new ones)."""
        records: list[FileRecord] = self.writer.wait(futures)
        seal(self.run, scan.shard, list(scan.good.values()) + records)
        return records

    def close(self) -> None:
        self.staging.close()
        self.writer.close()  # in-flight writes complete or remove their temp files
        self.writer.sync()


class DiskFullStop(Exception):
    """The volume filled up; the run stopped cleanly and can resume once space is freed."""

    def __init__(self, summary: Summary, needed_bytes: int, path: Path, reason: str | None = None):
        super().__init__(reason or f"no space left on the output volume while writing {path}")
        self.summary = summary
        self.needed_bytes = needed_bytes


def extract(opts: ExtractOptions, log: Callable[[str], None] = print) -> Summary:
    if opts.workers:
        from hsx.scaleout.driver import extract_distributed  # imports Ray only on this path

        return extract_distributed(opts, log)
    spec = open_run(opts, log)
    run = opts.out
    progress = Progress(spec.plan.num_samples, spec.plan.num_tokens, spec.bytes_per_token)
    with RunLock(run, metrics=progress.metrics, warn=log) as lock:
        scaleout_registry.settle(run, lock.me, log)  # workers of a crashed scale-out driver: gone first
        remove_stray_temps(run)
        plan = load_plan(run, spec)
        summary = Summary(run, spec.plan.num_samples, spec.plan.num_tokens, 0, rejected=spec.plan.num_rejected)
        scans = verify_run(run, spec, opts.deep_verify)
        for s in scans:
            tidy(run, s.problems, summary)
        done_ids = [i for s in scans for i in s.good]
        summary.already_done = len(done_ids)
        progress.start(len(done_ids), int(plan.lengths[done_ids].sum()))
        for s in scans:
            if s.complete and not s.sealed:
                seal(run, s.shard, list(s.good.values()))
        todo = [s for s in scans if not s.complete]
        try:
            guard = volume.start_guard(run, spec, plan.lengths, scans, opts.allow_partial, opts.reserve_bytes, log)
        except volume.NotEnoughSpace as e:
            raise Refused(str(e)) from None
        try:
            if todo:
                run_shards(run, spec, plan, opts, todo, progress, guard)
        except DiskFull as e:
            summary.written, summary.tokens_written, summary.bytes_written = progress.session()
            left = spec.plan.num_tokens - progress.tokens_done()
            reason = str(e) if isinstance(e, volume.LowSpace) else None
            raise DiskFullStop(summary, left * spec.bytes_per_token, e.path, reason) from e
        finally:
            summary.seconds = progress.elapsed()
            summary.written, summary.tokens_written, summary.bytes_written = progress.session()
            summary.waited_for_disk = progress.waited_for_disk() if progress.waited_for_disk else 0.0
        return summary


def verify_run(run: Path, spec: RunSpec, deep: bool) -> list[ShardScan]:
    n = layout.num_shards(spec.plan.num_samples, spec.shard_size)
    shards_dir = run / layout.SHARDS
    if not shards_dir.exists() or not any(shards_dir.iterdir()):
        return [ShardScan(s, layout.shard_ids(s, spec.shard_size, spec.plan.num_samples)) for s in range(n)]
    with Progress.simple(f"verifying ({'digests' if deep else 'headers'})", n) as bar:
        return scan_run(run, spec.plan.num_samples, spec.shard_size, deep, on_shard=lambda _: bar.advance())


def run_shards(
    run: Path,
    spec: RunSpec,
    plan: Plan,
    opts: ExtractOptions,
    todo: list[ShardScan],
    progress: Progress,
    guard: volume.DiskGuard | None = None,
    backend: TransformersBackend | None = None,
    staging: Staging | None = None,
) -> None:
    if spec.backend == "vllm":
        from hsx.capture.vllm import run_shards_vllm

        return run_shards_vllm(run, spec, plan, opts, todo, progress, guard)
    extractor = open_extractor(run, spec, plan, opts, progress, guard, backend, staging)
    pending: list[tuple[ShardScan, list[Future]]] = []
    try:
        with progress.live():
            for scan in todo:
                pending.append((scan, extractor.shard(scan)))
                while len(pending) > 1:  # seal one shard behind, so the device never waits on fsync
                    extractor.finish(*pending.pop(0))
            while pending:
                extractor.finish(*pending.pop(0))
    finally:
        extractor.close()


def open_extractor(
    run: Path,
    spec: RunSpec,
    plan: Plan,
    opts: ExtractOptions,
    progress: Progress,
    guard: volume.DiskGuard | None = None,
    backend: TransformersBackend | None = None,
    staging: Staging | None = None,
) -> Extractor:
    """One process's capture -> store pipeline (backend, host staging, writer threads); shared with
    the scale-out workers, so every process writes a shard the same way."""
    backend = backend or open_backend(spec, opts)
    width = len(spec.layers) * spec.model.hidden_size
    slot_tokens = max(spec.batch_tokens, spec.max_length)
    staging = staging or staging_for(
        backend.device, backend.dtype, width, spec.model.hidden_size, slot_tokens, opts.max_inflight_bytes
    )
    writer = SampleWriter(run, spec.shard_size, spec.layers, opts.writers, opts.max_inflight_bytes)
    extractor = Extractor(run, spec, plan, backend, writer, progress, staging)
    progress.waited_for_disk = lambda: staging.waited + writer.waited
    if guard is not None:
        guard.in_flight = lambda: writer.inflight  # queued bytes not yet on disk count against free space
        extractor.guard = guard
    return extractor


def open_backend(spec: RunSpec, opts: ExtractOptions) -> TransformersBackend:
    device = opts.device or default_device()
    return TransformersBackend.load(
        model_dir_for(spec, opts), spec.layers, spec.dtype, device, spec.packed, spec.trust_remote_code, spec.compiled
    )
