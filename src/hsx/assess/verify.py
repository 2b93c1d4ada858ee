"""``hsx verify``: the integrity check alone, for scripts; ``repair`` moves bad files aside;
``--fidelity`` also recomputes the fidelity of a sample of files from the checkpoint (``assess.fidelity``);
``--reference`` their taps through transformers' plain path (``assess.reference``).

Repair never deletes: every bad, stray or foreign file goes to ``OUT/quarantine/<its path>`` with a
``.reason`` file next to it (kind, detail, sample id, time), so the next ``hsx extract --out OUT``
finds those slots empty and redoes exactly those samples. It refuses while an extractor is alive:
moving files under a running writer would race with its renames.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hsx import target
from hsx.assess import fidelity, integrity, reference, workers
from hsx.assess.checks import Check
from hsx.errors import Exit, ModelChanged, RecordDamaged, Refused, RepairRefused
from hsx.genrun.spec import GenerateSpec, load_any
from hsx.job.options import check_device, default_device, resume_command
from hsx.spec import GENERATE, RunSpec
from hsx.store import layout
from hsx.store.quarantine import Moved, quarantine


@dataclass
class VerifyResult:
    run: Path
    spec: RunSpec | GenerateSpec
    result: integrity.Integrity
    check: Check
    moved: list[Moved] = field(default_factory=list)
    fidelity: Check | None = None  # --fidelity: the recomputation
    reference: Check | None = None  # --reference: the plain path's recomputation, tap by tap

    @property
    def exit_code(self) -> int:
        """0 clean, 1 problems hsx extract redoes (after a repair: the samples it will redo), 2 states
        that fail their fidelity (a person finds the cause: their bytes are good, no resume redoes them)."""
        if any(c is not None and c.level == "fail" for c in (self.fidelity, self.reference)):
            return Exit.ACT
        if self.result.problems:
            return Exit.REDO
        return Exit.OK

    def to_json(self) -> dict:
        return {
            "run": str(self.run),
            "exit_code": self.exit_code,
            "integrity": self.check.to_json(),
            "fidelity": None if self.fidelity is None else self.fidelity.to_json(),
            "reference": None if self.reference is None else self.reference.to_json(),
            "quarantined": [m.__dict__ for m in self.moved],
            "redo_sample_ids": self.redo_ids(),
        }

    @property
    def command(self) -> str:
        """The command that redoes what repair moved aside: the run's kind (``generate``, ``extract``)."""
        return self.spec.kind

    def lines(self) -> list[str]:
        """After a repair: the command that redoes what it moved aside."""
        if not self.moved:
            return []
        return [f"next: {resume_command(self.run, command=self.command)}  # redoes {len(self.redo_ids())} samples"]

    def redo_ids(self) -> list[int]:
        return sorted({p.sample_id for p in self.result.problems if p.sample_id is not None})


def verify(
    run: Path,
    deep: bool = False,
    repair: bool = False,
    threads: int | None = None,
    fidelity_files: int = 0,
    device: str | None = None,
    model: str | None = None,
    reference_files: int = 0,
) -> VerifyResult:
    """``threads``: parallel readers (None: the store's default for this machine). ``fidelity_files``:
    recompute the fidelity of this many files from the checkpoint (``model``: where it moved) on
    ``device`` (None: CUDA where there is one); ``reference_files``: recompute this many files'
    taps through transformers' plain path (``assess.reference``), recorded in the certificate."""
    spec = load_any(run)
    worker = workers.inspect(run)
    if repair and worker.alive:
        h = worker.holder
        raise RepairRefused(f"an {h.noun} is running on this run (pid {h.pid} on {h.host}): repair after it stops")
    result = integrity.inspect(run, spec, deep, worker.alive, threads)
    moved = []
    if repair:
        for p in result.problems:
            if (m := quarantine(run, p)) is not None:
                moved.append(m)
    out = VerifyResult(run, spec, result, integrity.check(result, command=spec.kind), moved)
    if fidelity_files or reference_files:
        device = device or default_device()
        check_device(device)
        if spec.kind == GENERATE:
            raise Refused(f"{run} is a generate run: it holds token ids, no states to check")
        model_dir = target.model_dir_for(run, spec, model)
    if fidelity_files:
        out.fidelity = fidelity.recompute(run, spec, result.scans, model_dir, fidelity_files, device)
    if reference_files:
        out.reference = reference.recompute(run, spec, result.scans, model_dir, reference_files, device)
    if repair and moved:
        out.check.details.append(f"{len(moved)} files moved to {layout.QUARANTINE}/ with a .reason each")
    if repair:
        out.check.details += _model_record(run, spec, model)
    return out


def _model_record(run: Path, spec: RunSpec | GenerateSpec, model: str | None) -> list[str]:
    """A damaged or missing model-files.json rebuilt from ``--model`` (the person vouches for it; its
    fingerprint must match), or left named where no --model was given."""
    try:
        target.files_record(run, spec)
        return []
    except RecordDamaged as e:
        if model is None:
            return [f"{layout.MODEL_FILES}: {e.why}"]
        diffs = target.rebuild_files(run, spec, model)
        if diffs:
            raise ModelChanged(f"{model} is not the run's model:\n  - " + "\n  - ".join(diffs)) from None
        return [f"{layout.MODEL_FILES} rebuilt from {model} (its fingerprint matches the spec's)"]
