"""Streaming, resumable export of a run into a trainer's own format.

DEST holds, besides the trainer's files:

    .hsx-export-job.json        what this export is (trainer, options, source plan); written first
    .hsx-export-progress.jsonl  one line per finished sample (its files, sizes, digests)
    hsx-export.json             the manifest, written last: every file written, and how, with the run's
                                certificate (``hsx.certify``) as it stood

Each output file is written to a temp name, fsynced and renamed (``store.durable``), and only then
logged, so a logged file is complete. A killed export rerun with the same arguments removes stray
temp files and continues after the last logged sample; logged samples keep their index, so a rerun
also continues when the run gained samples since (``--allow-incomplete``: repaired or extracted
since): they take the next indices. Every source file is deep-checked (its digest) as it is read;
a bad one stops the export with its name, the command that redoes it and the one that continues.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hsx import certify
from hsx.data import available_ids, read_verified
from hsx.drafts import EAGLE3
from hsx.errors import BadFile, ExportRefused, OptionError
from hsx.export.automodel import Automodel
from hsx.export.deepspec import DeepSpec
from hsx.export.modelopt import ModelOpt
from hsx.export.specforge import SpecForge
from hsx.export.speculators import Speculators
from hsx.export.trainer import (
    DIRECTION_ONLY,
    PRENORM_ADVICE,
    Context,
    ExportOptions,
    TrainerFormat,
    Written,
    export_taps,
)
from hsx.export.vocab import check_map, draft_map, target_vocab_size, token_counts
from hsx.plan import load_plan
from hsx.progress import Progress
from hsx.spec import RunSpec, load_spec, model_location, now
from hsx.store import layout
from hsx.store.durable import is_temp, writable_folder, write_durable

EXPORT_FORMAT = "hsx-export/1"
JOB = ".hsx-export-job.json"
LOG = ".hsx-export-progress.jsonl"
MANIFEST = "hsx-export.json"
# in the job of exports made before the export's samples could grow on a rerun; no longer compared
FORMER_KEYS = ("samples", "ids_digest")
FORMATS: dict[str, type[TrainerFormat]] = {f.name: f for f in (SpecForge, Speculators, ModelOpt, DeepSpec, Automodel)}


# ---------------------------------------------------------------- DEST: job identity, progress log


def _clean(dest: Path) -> int:
    """Remove the temp files an interrupted export left."""
    n = 0
    for root, _dirs, files in os.walk(dest):
        for name in files:
            if is_temp(name):
                (Path(root) / name).unlink()
                n += 1
    return n


@dataclass(frozen=True)
class Done:
    """A sample the progress log records as exported: its id and the files written for it."""

    sample_id: int
    files: list[Written]
    norm_error: float = 0.0  # the export's largest norm error when it was logged (``Context.max_norm_error``)


def open_dest(dest: Path, job: dict) -> dict[int, Done]:
    """Create DEST or check it holds this same export; return the samples already done, by index."""
    if dest.exists() and not dest.is_dir():
        raise ExportRefused(f"{dest} exists and is not a folder")
    if dest.exists() and (dest / JOB).exists():
        try:
            stored = json.loads((dest / JOB).read_text())
        except ValueError as e:
            raise ExportRefused(f"{dest / JOB} is damaged ({e}); remove {dest} and export again") from e
        diffs = [k for k in sorted((set(stored) | set(job)) - set(FORMER_KEYS)) if stored.get(k) != job.get(k)]
        if diffs:
            raise ExportRefused(
                f"{dest} holds another export (differs in: {', '.join(diffs)}); choose another DEST or remove it"
            )
    elif dest.exists() and any(not is_temp(p.name) for p in dest.iterdir()):  # a kill's temps are ours
        raise ExportRefused(f"{dest} is not empty and holds no hsx export: choose an empty or new folder")
    else:
        writable_folder(dest)  # under a file, read-only: refused by name before anything is written
        write_durable(dest / JOB, json.dumps(job, indent=1, sort_keys=True).encode())
    _clean(dest)
    done: dict[int, Done] = {}
    try:
        lines = (dest / LOG).read_text().splitlines()
    except FileNotFoundError:
        lines = []
    for line in lines:
        try:
            entry = json.loads(line)
            files = [Written(f["path"], int(f["size"]), f["digest"]) for f in entry["files"]]
            index, sid, error = int(entry["index"]), int(entry["sample_id"]), float(entry.get("norm_error", 0.0))
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line of a killed export
        if all((dest / w.path).is_file() and (dest / w.path).stat().st_size == w.size for w in files):
            done[index] = Done(sid, files, error)
    return done


def assign(ids: list[int], done: dict[int, Done], dest: Path) -> list[int]:
    """The sample id of each export index. Logged samples keep their index, so a rerun continues
    whatever the run gained since (a sample repaired, or extracted since, with --allow-incomplete);
    the others fill the free indices in id order. A logged sample whose index falls past the end
    (the run lost files since) is dropped, its files removed: no trainer may glob a stale one."""
    while True:
        kept = {d.sample_id for d in done.values()}
        rest = [i for i in ids if i not in kept]
        total = len(done) + len(rest)
        past = [i for i in done if i >= total]
        if not past:
            break
        for i in past:
            for w in done.pop(i).files:
                (dest / w.path).unlink(missing_ok=True)
    order = [-1] * total
    for i, d in done.items():
        order[i] = d.sample_id
    free = (i for i in range(total) if order[i] < 0)
    for sid, i in zip(rest, free, strict=True):
        order[i] = sid
    return order


class ProgressLog:
    """Appends one line per finished sample; fsynced in batches (a lost line only costs a redo)."""

    def __init__(self, path: Path, every: int = 32):
        self.f = open(path, "a")  # noqa: SIM115 - closed in close()
        self.every, self.pending = every, 0

    def add(self, index: int, sid: int, files: list[Written], norm_error: float) -> None:
        """``norm_error``: the export's largest so far, so that a rerun reports what earlier runs checked."""
        entry = {"index": index, "sample_id": sid, "files": [w.to_json() for w in files], "norm_error": norm_error}
        self.f.write(json.dumps(entry, separators=(",", ":")) + "\n")
        self.pending += 1
        if self.pending >= self.every:
            self.sync()

    def sync(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.pending = 0

    def close(self) -> None:
        self.sync()
        self.f.close()


# ---------------------------------------------------------------- the export


@dataclass
class ExportSummary:
    dest: Path
    to: str
    samples: int
    written: int
    already_done: int
    files: int
    bytes: int
    seconds: float
    final_state: str
    max_norm_error: float | None
    train: str  # what the trainer must be told (its command, or the setting) for the run's layers
    draft: str = EAGLE3
    taps: list[int] = field(default_factory=list)  # hsx ids
    filtered: dict[int, str] = field(default_factory=dict)  # sample id -> why its trainer cannot take it
    teacher: str = ""  # what became of a --teacher run's distribution ("" for a run without)

    def lines(self) -> list[str]:
        err = "" if self.max_norm_error is None else f", max norm error {self.max_norm_error:.1e}"
        out = [
            f"exported   {self.samples} samples to {self.dest} ({self.to}, {self.draft} draft, taps {self.taps} "
            f"in hsx ids): {self.written} written now, {self.already_done} already done",
            f"files      {self.files}, {self.bytes / 1e6:,.1f} MB in {self.seconds:.1f}s; manifest hsx-export.json",
            f"final      {self.final_state}{err}",
            f"train      {self.train}",
            *([f"teacher    {self.teacher}"] if self.teacher else []),
        ]
        if self.filtered:
            reasons = sorted(set(self.filtered.values()))
            first = ", ".join(map(str, sorted(self.filtered)[:10])) + (", ..." if len(self.filtered) > 10 else "")
            out.insert(
                1,
                f"filtered   {len(self.filtered)} samples its trainer cannot take: {'; '.join(reasons)} "
                f"(ids {first}; all in hsx-export.json)",
            )
        return out


def export_ids(opts: ExportOptions, spec: RunSpec) -> list[int]:
    """The samples to export: all of the plan's, or (``allow_incomplete``) those with a good file."""
    found = available_ids(opts.run, spec, sealed_only=False)
    if found.unavailable and not opts.allow_incomplete:
        raise ExportRefused(
            f"{opts.run} is incomplete: {len(found.unavailable)} of {spec.plan.num_samples} samples have no good "
            f"file: {found.summary()}. Finish it with: {opts.extract_command()}  "
            f"(or pass --allow-incomplete to export the {len(found.ids)} that are done)"
        )
    if not found.ids:
        raise ExportRefused(f"{opts.run} has no finished sample to export")
    return found.ids


def run_export(opts: ExportOptions, log: Callable[[str], None] = print) -> ExportSummary:
    if opts.to not in FORMATS:
        raise ExportRefused(f"--to takes one of {', '.join(FORMATS)}, not {opts.to!r}")
    cls = FORMATS[opts.to]
    if opts.draft not in cls.drafts:
        takes = [f"{to} ({', '.join(f.drafts)})" for to, f in FORMATS.items() if opts.draft in f.drafts]
        why = cls.untaken.get(opts.draft)
        raise ExportRefused(
            f"{opts.to}'s trainer takes the draft types {', '.join(cls.drafts)}, not {opts.draft}"
            + (f" ({why})" if why else "")
            + (f"; {opts.draft} is trained by {'; '.join(takes)}" if takes else "")
        )
    if opts.prenorm and not cls.takes_prenorm:
        reads = "pre-norm, which it gets without --prenorm," if cls.reads == "pre" else "post-norm"
        raise OptionError(
            f"--prenorm does not apply to --to {opts.to}: its trainer reads the final state {reads} and nothing "
            "else; drop --prenorm"
        )
    run = opts.run
    spec = load_spec(run)
    certify.read_certificate(run)  # checked: an edited certificate, or another run's, is refused
    plan = load_plan(run, spec)
    ids = export_ids(opts, spec)
    ctx = Context(opts, spec, plan, ids, export_taps(spec, opts.draft, opts.taps))
    fmt = cls.build(ctx)
    fmt.check()
    filtered = {sid: why for sid in ids if (why := fmt.refuse(sid)) is not None}
    ids = [sid for sid in ids if sid not in filtered]
    if not ids:
        raise ExportRefused(f"none of the run's samples can be exported for {opts.to}: {next(iter(filtered.values()))}")
    final = fmt.side() if fmt.holds_final() else None  # the final state's side the files hold
    if final is not None:
        ctx.load_norm(final)
    converted = final == "pre" and spec.final_norm == "post"  # the pre-norm state derived, checked
    if ctx.derived == DIRECTION_ONLY:
        log(f"warning: the pre-norm final state is derived from this post-norm run: {DIRECTION_ONLY}; {PRENORM_ADVICE}")
    vocab_size = None
    if opts.draft_vocab is not None:  # checked before DEST is touched: a refusal leaves it free for the fix
        vocab_size = opts.target_vocab or target_vocab_size(ctx.model())
        check_map(token_counts(plan, ids), opts.draft_vocab, vocab_size)
    drafted = {"draft": opts.draft, "taps": ctx.taps} if opts.draft != EAGLE3 or opts.taps is not None else {}
    job = {
        "format": EXPORT_FORMAT,
        "to": opts.to,
        "options": fmt.job() | {"draft_vocab": opts.draft_vocab, "target_vocab": vocab_size} | drafted,
        "source_plan": spec.plan.origin,  # a plan grown since (extract.follow) is the same export's source
        "source_model": spec.model.fingerprint.config,
        "source_layers": spec.layers,
    }
    dest = opts.dest
    done = open_dest(dest, job)
    ids = ctx.ids = assign(ids, done, dest)
    ctx.max_norm_error = max((d.norm_error for d in done.values()), default=0.0)  # what earlier runs checked
    t0 = time.monotonic()
    progress_log = ProgressLog(dest / LOG)
    written = 0
    try:
        with Progress.simple(f"exporting to {opts.to}", len(ids)) as bar:
            bar.advance(len(done))
            for index, sid in enumerate(ids):
                if index in done:
                    continue
                path = layout.sample_path(run, sid, spec.shard_size)
                try:
                    t = read_verified(path, sid, expected=spec.footprint().files)
                except (BadFile, FileNotFoundError) as e:
                    progress_log.close()
                    what = "missing" if isinstance(e, FileNotFoundError) else str(e)
                    raise ExportRefused(
                        f"source file {path} (sample {sid}) is {what}; {len(done)} of {len(ids)} samples are "
                        f"exported. Redo it with: {opts.extract_command()}\nthen continue this export with: "
                        f"{opts.command()}"
                    ) from None
                files = fmt.sample(index, sid, t)
                progress_log.add(index, sid, files, ctx.max_norm_error)
                done[index] = Done(sid, files, ctx.max_norm_error)
                written += 1
                bar.advance()
                if opts.pace:
                    progress_log.sync()
                    time.sleep(opts.pace)
    finally:
        if not progress_log.f.closed:
            progress_log.close()
    vocab = None
    if opts.draft_vocab is not None:
        counts = token_counts(plan, ids)
        d2t, t2d = draft_map(counts, opts.draft_vocab, vocab_size)
        vocab = (d2t, t2d, {int(i): int(c) for i, c in enumerate(counts) if c})
    extra = fmt.finish(vocab)
    files = [w for i in sorted(done) for w in done[i].files] + extra
    manifest = {
        "format": EXPORT_FORMAT,
        "to": opts.to,
        "trainer_format": fmt.description,
        "created": now(),
        "source": {
            "run": str(run.resolve()),
            "plan_fingerprint": spec.plan.fingerprint,
            "model": model_location(run, spec),
            "layers": spec.layers,
            "layer_convention": spec.layer_convention,
            "final_norm": spec.final_norm,
            "dtype": spec.dtype,
        },
        "draft": opts.draft,
        "taps": ctx.taps,
        "final_state": fmt.final_state(),
        "final_state_norm": {"stored": spec.final_norm, "exported": final, "derived": ctx.derived or None},
        "train": fmt.train_hint(),
        "teacher": fmt.teacher_note() or None,
        "max_norm_error": ctx.max_norm_error if converted else None,
        "filtered": [{"sample_id": sid, "why": why} for sid, why in sorted(filtered.items())],
        "samples": [{"index": i, "sample_id": sid} for i, sid in enumerate(ids)],
        "files": [w.to_json() for w in files],
        # the run's certificate as it stood (hsx.certify): what each tap is and what its checks found
        # as stamped: its run identity and digest check it here too (store.records)
        "certificate": json.loads(cert.read_bytes()) if (cert := run / layout.CERTIFICATE).exists() else None,
    }
    write_durable(dest / MANIFEST, json.dumps(manifest, indent=1).encode())
    return ExportSummary(
        dest=dest,
        to=opts.to,
        samples=len(ids),
        written=written,
        already_done=len(ids) - written,
        files=len(files),
        bytes=sum(w.size for w in files),
        seconds=time.monotonic() - t0,
        final_state=fmt.final_state(),
        max_norm_error=ctx.max_norm_error if converted else None,
        train=fmt.train_hint(),
        draft=opts.draft,
        taps=ctx.taps,
        filtered=filtered,
        teacher=fmt.teacher_note(),
    )
