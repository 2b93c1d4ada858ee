"""``hsx generate-export GEN DEST.jsonl``: the regenerated conversations for other trainers' pipelines.

One JSON line per conversation, in conversation id order, read from verified files only: its key,
source, sample, the messages as OpenAI rows (the target's answers in place, with its
``reasoning_content`` and ``tool_calls``, arguments as JSON text; the dataset's results spliced in as
``role: tool`` turns with ``tool_call_id`` and ``name``), the ``tools`` offered, ``ended`` where the
conversation stopped at a call the dataset has no result for, and, per generated turn, the prompt
and completion token ids exactly as the engine ran and produced them, the finish reason and the
text. A trainer that tokenizes the messages itself may get other ids than the target produced; one
that reads ``prompt_ids`` + ``completion_ids`` gets exactly the target's. Rejected conversations
are left out (``GEN/rejects.jsonl`` lists them). The file appears whole or not at all (temp, fsync,
rename). An unfinished run is refused unless asked, as extraction refuses it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hsx.errors import BadFile, ExportRefused
from hsx.genrun.record import ConversationRecord, read_record
from hsx.genrun.samples import GeneratedRun
from hsx.job.options import writable_folder
from hsx.store import layout
from hsx.store.durable import write_parts


@dataclass(frozen=True)
class Exported:
    path: Path
    conversations: int
    rejected: int
    missing: int
    bytes: int

    def lines(self) -> list[str]:
        return [
            f"{self.conversations} conversations to {self.path} ({self.bytes / 1e6:,.1f} MB); "
            f"{self.rejected} rejected and {self.missing} not generated left out"
        ]


def openai_message(message: dict) -> dict:
    """A message as the template read it (``input.to_message``: call arguments as objects) -> an
    OpenAI chat message (arguments as JSON text)."""
    out = dict(message)
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": c.get("id", ""),
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": a
                    if isinstance(a := c["function"]["arguments"], str)
                    else json.dumps(a, ensure_ascii=False),
                },
            }
            for c in message["tool_calls"]
        ]
    return out


def line(rec: ConversationRecord) -> bytes:
    body = {
        "key": rec.key,
        "source": rec.source.__dict__,
        "sample": rec.sample,
        "messages": [openai_message(m) for m in rec.messages],
        **({"tools": rec.tools} if rec.tools else {}),
        **({"ended": rec.ended} if rec.ended else {}),
        "turns": [
            {
                "message": t.message,
                "prompt_ids": t.prompt_ids.tolist(),
                "completion_ids": t.completion_ids.tolist(),
                "finish_reason": t.finish_reason,
                "text": t.text,
            }
            for t in rec.turns
        ],
    }
    return json.dumps(body, ensure_ascii=False).encode() + b"\n"


def export_jsonl(run: Path, dest: Path, allow_incomplete: bool = False) -> Exported:
    if dest.is_dir():
        raise ExportRefused(f"{dest} is a folder: name the JSONL file to write (for example {dest / 'gen.jsonl'})")
    writable_folder(dest.parent, "DEST")
    gen = GeneratedRun.read(run)
    spec, files = gen.spec, gen.files
    missing = spec.plan.num_samples - len(files)
    if missing and not allow_incomplete:
        raise ExportRefused(
            f"{run} is an unfinished generate run ({len(files)} of {spec.plan.num_samples} conversations): "
            f"finish it (hsx generate --out {run}) or export what is there with --allow-incomplete"
        )
    counts = {"ok": 0, "rejected": 0}

    def lines() -> Iterator[bytes]:
        for cid in files:
            path = layout.sample_path(run, cid, spec.shard_size)
            try:
                rec = read_record(path, cid)
            except (BadFile, FileNotFoundError) as e:
                what = "missing" if isinstance(e, FileNotFoundError) else f"damaged ({e})"
                raise ExportRefused(
                    f"conversation file {path} (conversation {cid}) is {what}; nothing was exported. Repair the run: "
                    f"hsx verify {run} --repair, then hsx generate --out {run}, then this export again"
                ) from None
            counts["ok" if rec.ok else "rejected"] += 1
            if rec.ok:
                yield line(rec)

    dest.parent.mkdir(parents=True, exist_ok=True)
    size = write_parts(dest, lines())
    return Exported(dest, counts["ok"], counts["rejected"], missing, size)
