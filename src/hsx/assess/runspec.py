"""The run spec and the frozen plan: present, parseable, and agreeing with each other.

Resume reads only these two (plus the model): if both are intact, the source data, the script and
the machine it ran on are not needed. The plan's fingerprint is recomputed from its tokens, so a
damaged or swapped plan is caught even when the Parquet file still parses. A generate run's spec
(``kind: generate``) and input plan are read and checked the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hsx.assess.checks import Check
from hsx.genrun.plan import GenPlan
from hsx.genrun.spec import GenerateSpec, load_any
from hsx.plan import PLAN_DIR, PLAN_FILE, Plan
from hsx.spec import GENERATE, RunSpec, SpecError
from hsx.store import layout
from hsx.units import size


@dataclass
class RunFiles:
    check: Check
    spec: RunSpec | GenerateSpec | None
    plan: Plan | GenPlan | None


def inspect(run: Path) -> RunFiles:
    try:
        spec = load_any(run)
    except SpecError as e:
        if not (run / layout.SPEC).exists() and not (run / layout.SHARDS).exists() and run.is_dir():
            never = _never_a_run(run)
            if never is not None:
                return RunFiles(never, None, None)
        lost = (run / layout.SPEC).exists() or (run / PLAN_DIR).exists()
        action = f"restore {layout.SPEC} from a backup of this run folder" if lost else "check the path"
        return RunFiles(Check("spec", "fail", str(e), action=action, data={}), None, None)
    data = {
        "format": spec.format,
        "created": spec.created,
        "created_by": spec.created_by,
        "plan_fingerprint": spec.plan.fingerprint,
        "num_samples": spec.plan.num_samples,
        "num_tokens": spec.plan.num_tokens,
        "plan_ok": False,
    }
    try:
        plan = GenPlan(run) if spec.kind == GENERATE else Plan(run, spec.plan.parts)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return RunFiles(
            Check(
                "spec",
                "fail",
                f"{layout.SPEC} parses; the plan in {PLAN_DIR}/ is unreadable ({type(e).__name__}: {e})",
                action=f"restore {PLAN_DIR}/ from a backup of this run folder: resume cannot rebuild it by itself",
                data=data,
            ),
            spec,
            None,
        )
    fp = plan.fingerprint()
    if fp != spec.plan.fingerprint or len(plan) != spec.plan.num_samples:
        return RunFiles(
            Check(
                "spec",
                "fail",
                f"the plan ({len(plan)} samples, fingerprint {fp[:12]}) does not match the spec's "
                f"({spec.plan.num_samples} samples, {spec.plan.fingerprint[:12]})",
                action=f"restore {PLAN_DIR}/ of this run: it was replaced or damaged",
                data=data | {"plan_fingerprint_found": fp},
            ),
            spec,
            None,
        )
    data["plan_ok"] = True
    plan_bytes = sum((run / PLAN_DIR / f).stat().st_size for f in (PLAN_FILE, *spec.plan.parts))
    return RunFiles(
        Check(
            "spec",
            "ok",
            f"{layout.SPEC} and plan ({spec.plan.num_samples:,} samples, {size(plan_bytes)}) parse, "
            f"plan fingerprint {fp[:12]} matches; created {spec.created} by {spec.created_by}; "
            "resume needs only this folder and the model",
            data=data,
        ),
        spec,
        plan,
    )


def _never_a_run(run: Path) -> Check | None:
    """A folder where ``hsx extract`` started a run that never came to be (no spec, no shard): why,
    from its record (``job.folder.Failure``), and the command that starts it again."""
    from hsx.job.folder import failed_start

    record = failed_start(run)
    if record is None and not (run / PLAN_DIR).exists():
        return None
    reason = record.reason if record else "it stopped while planning, before the run spec was written"
    command = (record and record.command) or f"hsx extract --model MODEL --data DATA --out {run}"
    rejects = run / layout.REJECTS
    return Check(
        "spec",
        "fail",
        f"not a run: a start that never became one ({reason})",
        details=[f"at {record.where}"] if record and record.where else [],
        action="fix the cause, then start it again"
        + (f" (each rejected row and its reason: {rejects})" if rejects.is_file() else ""),
        data={"never_a_run": True, "reason": reason, "start_command": command},
    )


def crash(run: Path) -> Check | None:
    """The last session's error hsx did not expect (``OUT/crash.json``), until a session completes:
    a resume as it stands meets it again, so a person acts first (exit 2)."""
    from hsx.job.folder import read_failure

    record = read_failure(run, layout.CRASH)
    if record is None:
        return None
    where = f" at {record.where}" if record.where else ""
    details = [f"command: {record.command}"] if record.command else []
    details += [f"log: {line}" for line in record.log[-5:]]
    return Check(
        "crash",
        "fail",
        f"the last session failed unexpectedly at {record.at} ({record.by}): {record.reason}{where}",
        details=details,
        action=f"a bug in hsx or a model it cannot run: the traceback is in {run / layout.CRASH}; fix the cause "
        "(or report it with that file) before resuming",
        data=record.model_dump(exclude={"traceback"}),
    )
