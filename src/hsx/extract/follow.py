"""An extraction that follows its generate run: conversations finished since it was planned become
samples appended to its plan.

An extraction of an unfinished generate run (``--allow-incomplete``) rejects every conversation not
generated yet (``genrun.samples.NOT_GENERATED``). Each resume looks again, under the run's lock:
the conversations the generate run has finished since are planned token for token
(``GeneratedRun.samples``) and appended as a part of the plan, ids after the last
(``plan.write_part``); the growth is recorded beside the spec (``spec.PlanGrowth``: the commit
point; the spec itself is never rewritten), and ``rejects.jsonl`` is rewritten from it. A crash
before the record leaves an unrecorded part, written again next time; a crash after it leaves
stale rejects, rewritten next time.

The samples planned before keep their ids, files and batches (a part is batched on its own:
``Plan.batches``), so what was extracted stays valid. The conversations this run planned must be in
the generate run as they were: otherwise it is not followed, and the resume says why.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from hsx.errors import HsxError, Refused
from hsx.genrun.samples import NOT_GENERATED, GeneratedRun, not_generated
from hsx.input import read_rejects
from hsx.plan import Plan, write_part
from hsx.spec import Extension, PlanGrowth, RunSpec, load_spec, now, plan_growth, who, write_record
from hsx.store import layout
from hsx.store.durable import fsync_dir, write_durable


def follow(run: Path, spec: RunSpec, log: Callable[[str], None]) -> RunSpec:
    """``spec`` grown by the conversations its generate run finished since (or as it was: not an
    extraction of a generate run, nothing new, or the generate run unreadable or changed)."""
    if spec.generate_spec is None:
        return spec
    waiting = not_generated(run)
    gen = _read(spec, log) if waiting else None
    if not (gen is not None and set(waiting) & gen.files.keys()) and _stale_rejects(run) is None:
        return spec
    spec, waiting = load_spec(run), not_generated(run)  # under the run's lock (job.stage.open_run): one grower
    new = [cid for cid in waiting if gen is not None and cid in gen.files]
    if new:
        _grow(run, spec, gen, waiting, new, log)
    if (rows := _stale_rejects(run)) is not None:  # also after a crash between a record and its rejects
        write_durable(run / layout.REJECTS, "".join(json.dumps(r) + "\n" for r in rows).encode())
    return load_spec(run)


def unchanged(run: Path, spec: RunSpec) -> None:
    """Refuse to go on with ``spec`` when another resume grew the plan since it was read (between
    ``follow`` and this process taking the run's lock)."""
    growth = plan_growth(run)
    if growth is not None and growth.plan != spec.plan:
        raise Refused(
            f"the plan of {run} grew while this process started (another hsx extract planned conversations "
            "its generate run finished since): run the command again"
        )


def _read(spec: RunSpec, log: Callable[[str], None]) -> GeneratedRun | None:
    """The generate run, when it can be followed; else None, with the reason logged."""
    path = Path(spec.data[0].name)
    try:
        gen = GeneratedRun.read(path)
    except HsxError as e:
        log(f"not following the generate run {path}: {e}; the conversations not generated yet stay out of this run")
        return None
    if gen.spec.digest() != spec.generate_spec:
        log(f"not following {path}: its spec is not the one this run was planned from")
        return None
    return gen


def _grow(
    run: Path, spec: RunSpec, gen: GeneratedRun, waiting: list[int], new: list[int], log: Callable[[str], None]
) -> None:
    growth = plan_growth(run)
    planned = gen.identity(skip=set(waiting))
    if planned.key() != spec.data[0].key():
        log(
            f"not following {gen.path}: conversations this run planned changed since ({spec.data[0].size} files "
            f"then, {planned.size} of them now, or their bytes differ); extract it into a new run to take them"
        )
        return
    extensions = growth.extensions if growth is not None else []
    first = spec.plan.num_samples
    part = write_part(run, len(extensions) + 1, gen.samples(new, spec.max_length), first)
    if part.num_samples and first % spec.shard_size:  # its SEALED lists only the ids the shard had
        shard = layout.shard_dir(run, layout.shard_of(first, spec.shard_size))
        if (shard / layout.SEALED).exists():
            (shard / layout.SEALED).unlink()
            fsync_dir(shard)
    parts = [*spec.plan.parts, part.name] if part.name else spec.plan.parts
    plan = Plan(run, parts)
    left = [cid for cid in waiting if cid not in gen.files]
    extension = Extension(
        part=part.name,
        first_id=first,
        num_samples=part.num_samples,
        conversations=new,
        rejects=[r.to_json() for r in part.rejects],
        recorded=now(),
        by=who(),
    )
    extensions = [*extensions, extension]
    rejected = len(_rejects(read_rejects(run / layout.REJECTS), left, extensions))
    identity = spec.plan.model_copy(
        update={
            "fingerprint": plan.fingerprint(),
            "num_samples": len(plan),
            "num_tokens": int(plan.lengths.sum()),
            "num_truncated": spec.plan.num_truncated + part.num_truncated,
            "num_rejected": rejected,
            "parts": parts,
            "grown_from": spec.plan.origin,
        }
    )
    record = PlanGrowth(extensions=extensions, waiting=left, plan=identity, data=[gen.identity(skip=set(left))])
    write_record(run, run / layout.PLAN_DIR / layout.GROWTH, record)
    log(
        f"plan grew: {len(new)} conversations generated since -> {part.num_samples} samples "
        f"(ids {first}..{first + part.num_samples - 1}), {len(part.rejects)} rejected; "
        f"{len(left)} still wait for generation"
    )


def _rejects(lines: list[dict], waiting: list[int], extensions: list[Extension]) -> list[dict]:
    """The run's rejects once grown: no "not generated" for a conversation no longer waiting, and every
    growth's own rejects, once each."""
    still = set(waiting)
    out = [r for r in lines if r.get("reason") != NOT_GENERATED or r.get("row") in still]
    seen = {json.dumps(r, sort_keys=True) for r in out}
    for r in (r for e in extensions for r in e.rejects):
        if (key := json.dumps(r, sort_keys=True)) not in seen:
            out.append(r)
            seen.add(key)
    return out


def _stale_rejects(run: Path) -> list[dict] | None:
    """What ``rejects.jsonl`` should hold once the recorded growth is applied, where it does not yet
    (None: no growth, or the file already says it)."""
    growth = plan_growth(run)
    if growth is None:
        return None
    lines = read_rejects(run / layout.REJECTS)
    rows = _rejects(lines, growth.waiting, growth.extensions)
    return rows if rows != lines else None
