"""The run's own records, self-verifying: one mechanism for every record hsx keeps beside the data
(``sealed/``, each shard's ``SEALED``, ``consumed/``, ``model-files.json``, ``fidelity.json``,
``window.json``, a consumer's records).

A record is JSON written whole (``write_durable``) with two fields added: ``run``, the run's
identity (from its spec, written once: ``identity``), and ``record_digest``, the
digest of everything else in it. A reader (``read_record``) gets the record's body, None where it does not
exist, or ``RecordDamaged`` naming what is wrong: unreadable or not a file, truncated or garbled
(no JSON, or the digest does not match), not of its kind, or another run's (swapped in or copied).
So a record is never trusted where it is damaged, nor dropped as if absent: each caller says what
the damage means and how it is repaired (rebuilt from the data where it can be). Records written
before hsx stamped them (no ``run``) are read as they are.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from hsx.errors import RecordDamaged
from hsx.store import layout
from hsx.store.durable import write_durable
from hsx.store.format import digest

RUN, DIGEST = "run", "record_digest"


def identity(run: Path) -> str | None:
    """The run's identity: the digest of what its spec says of it (``IDENTITY``; the spec is written
    once); None before the spec exists or where it does not parse."""
    try:
        st = os.stat(run / layout.SPEC)
    except OSError:
        return None
    return _identity(str(run / layout.SPEC), st.st_ino, st.st_size, st.st_mtime_ns)


# what tells one run from another in its spec: when and by whom it was made, and its plan; not where
# its model lives (a path a person may correct) nor how its files are stored (a copy re-encoded is the
# same run): what its files hold is judged file by file (``format.Expected``)
IDENTITY = ("kind", "created", "created_by", "plan")
# what a spec that lacks one of them says: a spec written before hsx recorded a run's kind is an
# extraction's (``spec.read_spec``), so its records and a new spec's of the same run are one identity
IDENTITY_DEFAULTS = {"kind": "extract"}


@functools.lru_cache(maxsize=64)
def _identity(path: str, ino: int, size: int, mtime_ns: int) -> str | None:
    try:
        spec = json.loads(Path(path).read_bytes())
        return _body_digest(IDENTITY_DEFAULTS | {k: spec[k] for k in IDENTITY if k in spec})
    except (OSError, ValueError, TypeError):
        return None


def _body_digest(body: dict) -> str:
    return digest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def stamped(run: Path, body: dict, indent: int | None = 0) -> bytes:
    """``body`` as a record of ``run``: its identity and the digest of the two together."""
    out = {k: v for k, v in body.items() if k not in (RUN, DIGEST)} | {RUN: identity(run)}
    return json.dumps(out | {DIGEST: _body_digest(out)}, indent=indent).encode()


def write_record(run: Path, path: Path, body: dict, indent: int | None = 0) -> None:
    """Write the record at ``path`` whole and durable, stamped with ``run``'s identity."""
    write_durable(path, stamped(run, body, indent))


def read_record(run: Path, path: Path, fmt: str | None = None) -> dict | None:
    """The record at ``path`` (without its stamp), None where there is none. ``fmt``: the value its
    ``format`` field must have. Raises ``RecordDamaged`` saying what is wrong."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise RecordDamaged(path, "a folder where the record should be") from None
    except NotADirectoryError:
        raise RecordDamaged(path, f"{path.parent.name} is a file where the folder of records should be: "
                            "move it aside, then resume") from None  # fmt: skip
    except OSError as e:
        raise RecordDamaged(path, f"unreadable ({e.strerror})") from None
    return parse_record(run, path, raw, fmt)


def parse_record(run: Path, path: Path, raw: bytes, fmt: str | None = None) -> dict:
    """``read_record``'s judgement of a record's bytes already read (a reader that needs their stat too)."""
    return judge(path, raw, identity(run), fmt)


def judge(path: Path, raw: bytes, run: str | None, fmt: str | None = None) -> dict:
    """``parse_record`` with the run's identity known (``run``): a reader of many records at once
    (the lines of a consumer's acks log) looks it up once."""
    try:
        body = json.loads(raw)
    except ValueError:
        raise RecordDamaged(path, "truncated or garbled (not JSON)") from None
    if not isinstance(body, dict):
        raise RecordDamaged(path, "garbled (not a JSON object)")
    if fmt is not None and body.get("format") != fmt:
        raise RecordDamaged(path, f"not a {fmt} record")
    if DIGEST in body or RUN in body:
        stamp = body.pop(DIGEST, None)
        if stamp != _body_digest(body):
            raise RecordDamaged(path, "garbled (its digest does not match its content)")
        if body.pop(RUN) != run:
            raise RecordDamaged(path, "another run's record (its run identity is not this run's spec)")
    return body


def record_folder(path: Path) -> Path:
    """``path`` as a folder for records, made where absent. A file in its place is named
    (``RecordDamaged``): moving it is a repair's (``hsx verify --repair``), never a silent write's."""
    try:
        path.mkdir(exist_ok=True)
    except FileExistsError:
        raise RecordDamaged(
            path, f"{path.name} is a file where the folder of records should be: move it aside, then resume"
        ) from None
    return path
