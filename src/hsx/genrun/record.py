"""One generated conversation as a file: plain safetensors, self-verifying like a sample file.

    prompt_ids      int32 [sum of the turns' prompt lengths]       each turn's prompt, as the engine ran it
    completion_ids  int32 [sum of the turns' completion lengths]   each turn's completion, as it produced it
    record          uint8 [n]   UTF-8 JSON: key, source, sample, status (ok | ended | rejected) and why,
                                the tools offered, the final messages (the target's turns, with their
                                reasoning and calls, and the results spliced in), and per turn its
                                message index, prompt and completion lengths, finish reason, text

A conversation whose next prompt no longer fits ``--max-length`` after some turns were generated
ends there and is kept (status ``ended``, with why): its messages stop at its last generated answer.

``__metadata__`` holds the format (``hsx-conversation/1``), the conversation id (``sample_id``, its row
in the input plan), key, status, number of turns and tokens, and the digest of the data section, so
the store's checks (``store.format.check``, ``store.scan``) verify it as they verify a sample file.
The texts and messages are in the data section, not the header: a safetensors header is capped
(``format.MAX_HEADER``) and a long conversation would not fit; the digest covers them all the same.
A rejected conversation (a later turn's prompt over the length limit, the engine giving up) is a
file too: it is done exactly once, and the run's rejects list is rebuilt from these files. One that
ended at an unpaired call is ``ok`` (every turn in it is the target's own) with ``ended`` set, also in
``__metadata__``, so ``hsx status`` counts them from the headers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hsx.errors import BadFile, Damage
from hsx.input import Source
from hsx.store.format import CONVERSATION, pack, read_checked


@dataclass(frozen=True)
class GeneratedTurn:
    message: int  # index of the assistant message it regenerated
    prompt_ids: np.ndarray  # int32
    completion_ids: np.ndarray  # int32
    finish_reason: str  # stop | length
    text: str  # the completion decoded (without its stop token): the message's new content


@dataclass(frozen=True)
class ConversationRecord:
    id: int  # row of the input plan
    key: str
    source: Source
    sample: int  # which of the samples per prompt
    messages: list[dict]  # as a chat template reads them (input.to_message); generated turns in place
    turns: list[GeneratedTurn] = field(default_factory=list)
    reason: str | None = None  # set: the conversation is rejected, with why
    ended: str | None = None  # set: kept, but ended before its last target turn (a later prompt did not fit,
    # or a call the dataset has no result for), with why
    tools: list[dict] | None = None  # the tools the row offered the target

    @property
    def ok(self) -> bool:
        return self.reason is None

    @property
    def status(self) -> str:
        """ok, ended (kept, its later turns not generated) or rejected, as the file's header says."""
        return "rejected" if self.reason is not None else "ended" if self.ended is not None else "ok"

    @property
    def num_tokens(self) -> int:
        return sum(len(t.prompt_ids) + len(t.completion_ids) for t in self.turns)


def _ids(parts: list[np.ndarray]) -> np.ndarray:
    return np.ascontiguousarray(np.concatenate(parts) if parts else np.zeros(0), dtype="<i4")


def encode_record(rec: ConversationRecord) -> tuple[list, str]:
    """The file's parts and its digest (``store.format.pack``)."""
    prompts = _ids([t.prompt_ids for t in rec.turns])
    completions = _ids([t.completion_ids for t in rec.turns])
    body = {
        "key": rec.key,
        "source": rec.source.__dict__,
        "sample": rec.sample,
        "status": rec.status,
        "reason": rec.reason,
        "ended": rec.ended,
        "tools": rec.tools,
        "messages": rec.messages,
        "turns": [
            {
                "message": t.message,
                "prompt_len": len(t.prompt_ids),
                "completion_len": len(t.completion_ids),
                "finish_reason": t.finish_reason,
                "text": t.text,
            }
            for t in rec.turns
        ],
    }
    blob = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    views = [
        ("prompt_ids", "I32", [len(prompts)], memoryview(prompts).cast("B")),
        ("completion_ids", "I32", [len(completions)], memoryview(completions).cast("B")),
        ("record", "U8", [len(blob)], memoryview(blob)),
    ]
    metadata = {
        "format": CONVERSATION,
        "sample_id": str(rec.id),
        "key": rec.key,
        "status": body["status"],
        "num_turns": str(len(rec.turns)),
        "num_tokens": str(rec.num_tokens),
    } | ({"ended": "true"} if rec.ended else {})
    return pack(views, metadata)


def read_record(path: Path, conversation_id: int) -> ConversationRecord:
    """A conversation file, after the deep check; ``BadFile`` when it is not a valid one."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    raw = read_checked(path, conversation_id)
    try:
        tensors = load(raw)
        body = json.loads(bytes(tensors["record"]))
        prompts, completions = tensors["prompt_ids"], tensors["completion_ids"]
        turns, p, c = [], 0, 0
        for t in body["turns"]:
            np_, nc = t["prompt_len"], t["completion_len"]
            turns.append(
                GeneratedTurn(
                    t["message"], prompts[p : p + np_], completions[c : c + nc], t["finish_reason"], t["text"]
                )
            )
            p, c = p + np_, c + nc
        return ConversationRecord(
            conversation_id,
            body["key"],
            Source(**body["source"]),
            body["sample"],
            body["messages"],
            turns,
            body["reason"],
            body.get("ended"),
            body.get("tools"),
        )
    except (SafetensorError, KeyError, TypeError, ValueError) as e:
        raise BadFile(Damage.CORRUPT, f"not a conversation file ({e!r})") from e


def statuses(run: Path, num_conversations: int, shard_size: int) -> dict[int, str]:
    """Conversation id -> status (ok, ended, rejected) of every conversation file, from its header
    alone (unreadable files are left out: the scans report them)."""
    from hsx.errors import HsxError
    from hsx.store import layout
    from hsx.store.format import read_header

    out = {}
    for shard in range(layout.num_shards(num_conversations, shard_size)):
        folder = layout.shard_dir(run, shard)
        for path in sorted(folder.iterdir()) if folder.is_dir() else []:
            cid = layout.parse_sample_name(path.name)
            try:
                if cid is not None:
                    out[cid] = read_header(path).metadata.get("status", "ok")
            except (OSError, HsxError):
                continue
    return out
