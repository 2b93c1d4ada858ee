"""A generate run's frozen input plan: which conversations to regenerate, each under a key of its own.

One row per (input conversation, sample): its key (``<data file>:<row>#<sample>``, unique in the
run), its source, the messages as the dataset has them (as a chat template reads them, up to its
last assistant turn and the tool results after it: nothing later is generated), the tools it
offers, the episodes to regenerate (``generate.dialogue``) and an estimate of the tokens its file
will hold (the rows are planned by the generate stage: ``generate.folder.plan_rows``). The row
index is the conversation id, which names its file (``store.layout``). The plan is built once
(reading and rendering the data), written like an extraction's plan (temp, fsync, rename) into
``GEN/plan/``, fingerprinted over its content; a resume reads only this.

Planning rejects what cannot be regenerated: what the input stage rejects (images, unknown
roles...), conversations the chat template cannot render, and those whose first prompt
already reaches ``max_length``. A later turn's prompt grows with the target's own answers, so its
length is checked when it is generated (``generate.job``). This module is the plan as data: written
once, read back, checked against the spec; ``extract`` and ``assess`` read it without the stage.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from hsx.errors import PlanError
from hsx.input import Reject
from hsx.plan import PLAN_META, NoUsableSamples
from hsx.store.durable import durable_rename, write_durable
from hsx.store.layout import PLAN_DIR, PLAN_FILE

SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("source_file", pa.string()),
        ("source_row", pa.int64()),
        ("source_id", pa.string()),
        ("sample", pa.int32()),
        ("messages", pa.string()),  # JSON list of messages as a chat template reads them (input.to_message)
        ("tools", pa.string()),  # JSON: the tools the row offers (the template's tools=), or null
        ("targets", pa.list_(pa.int32())),  # the first message of each episode to regenerate (generate.dialogue)
        ("estimate", pa.int64()),  # tokens its file is expected to hold (space and pace)
    ]
)


@dataclass(frozen=True)
class Planned:
    key: str
    source_file: str
    source_row: int
    source_id: str
    sample: int
    messages: list[dict]
    tools: list[dict] | None
    targets: list[int]
    estimate: int
    ids_given: int = 0  # the dataset's calls planning gave an id (``input.call_id``; not stored: for the summary)


def _row_digest(cid: int, row: Planned) -> bytes:
    fields = [row.key, row.sample, row.messages, row.targets] + ([row.tools] if row.tools else [])
    body = json.dumps(fields, separators=(",", ":")).encode()
    return cid.to_bytes(8, "little") + len(body).to_bytes(8, "little") + body


@dataclass(frozen=True)
class GenPlanInfo:
    fingerprint: str
    num_samples: int  # conversations
    num_tokens: int  # the estimate, summed
    num_truncated: int
    max_length: int
    call_ids_given: int = 0  # the data's calls without an id that planning gave one (input.call_id)


def write_gen_plan(run: Path, rows: Iterable[Planned | Reject], max_length: int) -> tuple[GenPlanInfo, list[Reject]]:
    """Write the plan once (temp, fsync, rename, then its info); rejects are returned to be recorded."""
    plan_dir = run / PLAN_DIR
    plan_dir.mkdir(parents=True, exist_ok=True)
    tmp = plan_dir / f".{PLAN_FILE}.tmp-{os.getpid()}"
    rejects: list[Reject] = []
    planned: list[Planned] = []
    h = xxhash.xxh3_128()
    for item in rows:
        if isinstance(item, Reject):
            rejects.append(item)
        else:
            h.update(_row_digest(len(planned), item))
            planned.append(item)
    if not planned:
        raise NoUsableSamples(rejects)  # its caller writes the rejects where its refusal says
    cols = {name: [getattr(r, name) for r in planned] for name in SCHEMA.names if name not in ("messages", "tools")}
    cols["messages"] = [json.dumps(r.messages, ensure_ascii=False) for r in planned]
    cols["tools"] = [json.dumps(r.tools, ensure_ascii=False) for r in planned]
    try:
        pq.write_table(pa.table(cols, schema=SCHEMA), tmp, compression="zstd")
        durable_rename(tmp, plan_dir / PLAN_FILE)
    except BaseException:  # a failed write or Ctrl-C: no half-written plan stays behind
        tmp.unlink(missing_ok=True)
        raise
    given = sum(r.ids_given for r in planned if r.sample == 0)
    info = GenPlanInfo(h.hexdigest(), len(planned), sum(r.estimate for r in planned), 0, max_length, given)
    write_durable(plan_dir / PLAN_META, json.dumps(info.__dict__, indent=1).encode())
    return info, rejects


class GenPlan:
    """The frozen input plan of a generate run, in memory (messages are text: small next to a model)."""

    def __init__(self, run: Path):
        table = pq.read_table(run / PLAN_DIR / PLAN_FILE)
        if table.schema.names != SCHEMA.names:
            raise ValueError(f"not a generate plan (columns {table.schema.names})")
        self._rows = table.to_pylist()
        self.lengths = np.asarray([r["estimate"] for r in self._rows], dtype=np.int64)

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, cid: int) -> Planned:
        r = self._rows[cid]
        return Planned(
            r["key"],
            r["source_file"],
            r["source_row"],
            r["source_id"],
            r["sample"],
            json.loads(r["messages"]),
            json.loads(r["tools"]),
            list(r["targets"]),
            r["estimate"],
        )

    def fingerprint(self) -> str:
        h = xxhash.xxh3_128()
        for cid in range(len(self)):
            h.update(_row_digest(cid, self.row(cid)))
        return h.hexdigest()


def load_gen_plan(run: Path, spec) -> GenPlan:
    """The run's plan, refused unless it matches the spec's fingerprint."""
    try:
        plan = GenPlan(run)
    except (OSError, ValueError, KeyError) as e:
        raise PlanError(f"the plan in {run / PLAN_DIR} is unreadable ({e})") from e
    if len(plan) != spec.plan.num_samples or plan.fingerprint() != spec.plan.fingerprint:
        raise PlanError(f"the plan in {run / PLAN_DIR} does not match the run spec's fingerprint")
    return plan
