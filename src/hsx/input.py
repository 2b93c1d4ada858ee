"""Input stage: read conversation files and normalise every row to a ``Conversation`` or a ``Reject``.

Accepted files: JSONL (one row per line), JSON (an array of rows) and Parquet; a Hugging Face dataset
(a ``save_to_disk`` folder, or a name in the local cache: ``hsx.hfdatasets``). Accepted rows:
ShareGPT (``conversations`` of ``from``/``value``) and OpenAI (``messages`` of ``role``/``content``),
each with an optional ``id``. A row that cannot become a sample is never dropped: it becomes a
``Reject`` carrying its file, row number and the reason, and the run goes on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hsx.errors import InputError

ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
}
# Image content a conversation may carry: OpenAI content parts, and the field LLaVA-style ShareGPT
# rows put the picture in. hsx captures the language model's states of text conversations only.
IMAGE_PARTS = ("image_url", "image", "input_image")
IMAGE_FIELDS = ("image", "images")
TEXT_ONLY = "hsx extracts text conversations only (multimodal extraction is not supported yet)"


@dataclass(frozen=True)
class ToolCall:
    """One function call an assistant turn makes. ``arguments`` is JSON text (OpenAI's form), whatever
    form the row gave it in, so that a call compares and digests the same from any source."""

    name: str
    arguments: str
    id: str = ""


@dataclass(frozen=True)
class Turn:
    """One message. ``reasoning`` and ``tool_calls`` belong to assistant turns; ``tool_call_id`` and
    ``name`` to tool results (role ``tool``)."""

    role: str  # system | user | assistant | tool
    content: str
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""


@dataclass(frozen=True)
class Source:
    """Where a row came from: file name as given, 0-based row number, the row's own id if any."""

    file: str
    row: int
    id: str


@dataclass(frozen=True)
class Conversation:
    """``tools``: the function schemas the row offers the model (OpenAI's ``tools`` list), JSON text
    per tool, in the row's order; the chat template renders them."""

    source: Source
    turns: tuple[Turn, ...]
    tools: tuple[str, ...] = ()


def to_message(turn: Turn) -> dict:
    """The message a chat template reads (transformers' convention): calls as
    ``{"type": "function", "function": {"name", "arguments"}}`` with the arguments as the object their
    JSON text holds (templates serialise them themselves), the reasoning as ``reasoning_content``."""
    message: dict = {"role": turn.role, "content": turn.content}
    if turn.reasoning:
        message["reasoning_content"] = turn.reasoning
    if turn.tool_calls:
        message["tool_calls"] = [_call_message(c) for c in turn.tool_calls]
    if turn.tool_call_id:
        message["tool_call_id"] = turn.tool_call_id
    if turn.name:
        message["name"] = turn.name
    return message


def _call_message(call: ToolCall) -> dict:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = call.arguments
    out: dict = {"type": "function", "function": {"name": call.name, "arguments": arguments}}
    if call.id:
        out["id"] = call.id
    return out


def tools_of(conv: Conversation) -> list[dict] | None:
    """The ``tools=`` a chat template takes, or None where the row offers none."""
    return [json.loads(t) for t in conv.tools] or None


@dataclass(frozen=True)
class Reject:
    source: Source
    reason: str

    def to_json(self) -> dict:
        return {"file": self.source.file, "row": self.source.row, "id": self.source.id, "reason": self.reason}


def _text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: accept text parts only
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind in IMAGE_PARTS:
                raise ValueError(f"{where}: non-text content part ({kind}): image content; {TEXT_ONLY}")
            if not isinstance(part, dict) or kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}: non-text content part ({kind})")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{where}: content is {type(content).__name__}, not text")


def normalize(row: object, source: Source) -> Conversation | Reject:
    """One raw row -> a validated conversation, or the reason it cannot be one."""
    if not isinstance(row, dict):
        return Reject(source, f"row is a {type(row).__name__}, not an object")
    row_id = row.get("id")
    if row_id is not None:
        source = Source(source.file, source.row, str(row_id))
    image = next((k for k in IMAGE_FIELDS if row.get(k)), None)
    if image is not None:  # LLaVA-style ShareGPT: the picture beside the turns, "<image>" in their text
        return Reject(source, f"image content ('{image}' field); {TEXT_ONLY}")
    if isinstance(row.get("conversations"), list):
        raw, role_key, text_key = row["conversations"], "from", "value"
    elif isinstance(row.get("messages"), list):
        raw, role_key, text_key = row["messages"], "role", "content"
    else:
        keys = ", ".join(sorted(map(str, row))) or "none"
        return Reject(source, f"unknown schema: no 'conversations' or 'messages' list (keys: {keys})")
    if not raw:
        return Reject(source, "empty conversation")
    turns = []
    try:
        for i, turn in enumerate(raw):
            if not isinstance(turn, dict):
                raise ValueError(f"turn {i} is a {type(turn).__name__}, not an object")
            role = ROLES.get(str(turn.get(role_key, "")).lower())
            if role is None:
                raise ValueError(f"turn {i}: unknown role {turn.get(role_key)!r}")
            turns.append(Turn(role, _text(turn.get(text_key), f"turn {i}")))
    except ValueError as e:
        return Reject(source, str(e))
    if not any(t.role == "assistant" for t in turns):
        return Reject(source, "no assistant turn")
    if all(not t.content.strip() for t in turns if t.role == "assistant"):
        return Reject(source, "every assistant turn is empty")
    return Conversation(source, tuple(turns))


def _rows(path: Path, name: str, split: str | None = None) -> Iterator[tuple[int, object] | Reject]:
    from hsx import hfdatasets

    if hfdatasets.is_source(path):
        yield from hfdatasets.rows(path, split)
        return
    if split is not None:
        raise InputError(f"{name}: --split {split} applies to a Hugging Face dataset, not to a data file")
    suffix = path.suffix.lower()
    try:
        if suffix in (".jsonl", ".ndjson"):
            with open(path, encoding="utf-8", errors="strict") as f:
                for i, line in enumerate(f):
                    if not line.strip():
                        continue
                    try:
                        yield i, json.loads(line)
                    except json.JSONDecodeError as e:
                        yield Reject(Source(name, i, ""), f"malformed JSON: {e.msg} at column {e.colno}")
        elif suffix == ".json":
            try:
                rows = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise InputError(f"{name}: not valid JSON ({e.msg}, line {e.lineno})") from e
            if not isinstance(rows, list):
                raise InputError(f"{name}: a .json data file must hold an array of rows")
            yield from enumerate(rows)
        elif suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                table = pq.ParquetFile(path)
            except Exception as e:
                raise InputError(f"{name}: not a readable Parquet file ({e})") from e
            i = 0
            for batch in table.iter_batches(batch_size=1024):
                for row in batch.to_pylist():
                    yield i, row
                    i += 1
        else:
            raise InputError(f"{name}: unknown data file type {suffix!r} (use .jsonl, .json or .parquet)")
    except UnicodeDecodeError as e:
        raise InputError(f"{name}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    except OSError as e:
        raise InputError(f"{name}: cannot read ({e.strerror or e})") from e


def check_source(path: Path, split: str | None = None) -> None:
    """Refuse a ``--data`` that names nothing readable (a dataset: not cached, no such split), before
    anything is written."""
    from hsx import hfdatasets

    if hfdatasets.is_source(path):
        hfdatasets.load(path, split)
    elif not path.is_file():
        raise InputError(f"{path}: no such data file")
    elif split is not None:
        raise InputError(f"{path}: --split {split} applies to a Hugging Face dataset, not to a data file")


def read_conversations(
    paths: list[Path], split: str | None = None, limit: int | None = None
) -> Iterator[Conversation | Reject]:
    """Every row of every source, in order, as a ``Conversation`` or a ``Reject``; ``split``: of the
    Hugging Face datasets among them; ``limit``: the first rows only, counted over all sources."""
    from hsx import hfdatasets

    count = 0
    for path in paths:
        if not path.is_file() and not hfdatasets.is_source(path):
            raise InputError(f"{path}: no such data file")
        name = str(path)
        for item in _rows(path, name, split):
            if limit is not None and count >= limit:
                return
            count += 1
            if isinstance(item, Reject):
                yield item
            else:
                row, raw = item
                yield normalize(raw, Source(name, row, ""))
