"""Input stage: read conversation files and normalise every row to a ``Conversation`` or a ``Reject``.

Accepted files: JSONL (one row per line), JSON (an array of rows) and Parquet; a Hugging Face dataset
(a ``save_to_disk`` folder, or a name in the local cache: ``hsx.hfdatasets``). Accepted rows:
``conversations`` or ``messages`` of ShareGPT (``from``/``value``) or OpenAI (``role``/``content``)
turns, told apart by their keys, each with an optional ``id``, ``system`` and ``tools``; xLAM's
``query``/``answers``/``tools``; ``--column NAME`` reads every row's turns from that field instead. A
turn keeps everything the target's template renders: reasoning (``reasoning_content``, or its aliases
``thinking`` and ``reasoning``), tool calls (OpenAI ``tool_calls``, or ShareGPT ``function_call`` turns
holding a JSON call) and tool results (role ``tool``; ShareGPT ``tool`` / ``observation``), each result
paired with the call it answers; a call without an id is given one (``call_id``).
A field hsx does not use is metadata: named in the conversation's ``ignored``, counted in the plan.
A row that cannot become a sample is never dropped: it becomes a ``Reject`` carrying its file, row
number and the reason, and the run goes on.
"""

from __future__ import annotations

import json
import re
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
    "tool": "tool",
    "observation": "tool",  # LLaMA-Factory's ShareGPT (glaive, ToolACE conversions)
    "function_response": "tool",
    "ipython": "tool",  # Llama 3.1's name for a tool's output
}
OPENAI_ROLES = ROLES | {"function": "tool"}  # OpenAI's older function result (a ShareGPT "function" is ambiguous)
CALL_ROLES = ("function_call",)  # ShareGPT turns that hold the assistant's call(s) as JSON
REASONING = ("reasoning_content", "thinking", "reasoning")  # one turn's reasoning, under any of its names
UNSUPPORTED = ("refusal", "audio")  # message fields with content hsx has no place for: the row is rejected
# Image content a conversation may carry: OpenAI content parts, and the field LLaVA-style ShareGPT
# rows put the picture in. hsx captures the language model's states of text conversations only.
IMAGE_PARTS = ("image_url", "image", "input_image")
IMAGE_FIELDS = ("image", "images")
TEXT_ONLY = "hsx extracts text conversations only (multimodal extraction is not supported yet)"


def call_id(name: str, k: int) -> str:
    """The id hsx gives the ``k``-th call of a conversation where it has none: Kimi-K2's own form, which
    templates that render ids need (Kimi-K2's writes a call by its id alone, Mistral's wants 9 characters
    or more)."""
    return f"functions.{name}:{k}"


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
    per tool, in the row's order; the chat template renders them. ``ignored``: the row's fields that
    hold something no template reads (metadata such as ``category``, ``conversations[].weight``).
    ``ids_given``: its calls that had no id and were given one (``call_id``)."""

    source: Source
    turns: tuple[Turn, ...]
    tools: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    ids_given: int = 0


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


def read_rejects(path: Path) -> list[dict]:
    """A run's ``rejects.jsonl``, a line per reject (``Reject.to_json``); none where there is no file."""
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def split_think(text: str) -> tuple[str, str]:
    """(reasoning, rest): the text up to ``</think>`` (without a leading ``<think>``, which the
    prompt may have written), newlines around it dropped as the templates render them. A
    completion cut inside its reasoning is all reasoning."""
    end = text.find("</think>")
    head = text if end < 0 else text[:end]
    stripped = head.lstrip()
    opened = stripped.startswith("<think>")
    if end < 0 and not opened:
        return "", text
    if opened:
        head = stripped[len("<think>") :]
    rest = "" if end < 0 else text[end + len("</think>") :]
    return head.strip("\n"), rest.lstrip("\n")


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


def _given(value: object) -> bool:
    """A field holds something (Parquet rows carry every column, absent ones as null)."""
    return value is not None and value != "" and value != [] and value != {}


def _json(value: object, what: str) -> object:
    """A field given as an object or as the JSON text of one (both forms are common)."""
    if not isinstance(value, str):
        return value
    try:
        return parse_json(value)
    except ValueError as e:
        raise ValueError(f"{what}: not valid JSON ({e})") from None


def _call(raw: object, where: str) -> ToolCall:
    """One call, OpenAI's ``{"id", "function": {"name", "arguments"}}`` or the bare ``{"name", "arguments"}``
    that ShareGPT function-call datasets hold; arguments as an object or its JSON text."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: a tool call is a {type(raw).__name__}, not an object")
    fn = raw["function"] if isinstance(raw.get("function"), dict) else raw
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: a tool call has no function name")
    args = fn.get("arguments", fn.get("parameters"))
    args = {} if args is None else _json(args, f"{where}: arguments of the call to {name!r}")
    if not isinstance(args, dict):
        raise ValueError(f"{where}: the arguments of the call to {name!r} are a {type(args).__name__}, not an object")
    return ToolCall(name, json.dumps(args, ensure_ascii=False), str(raw.get("id") or ""))


def _calls(value: object, where: str) -> tuple[ToolCall, ...]:
    value = _json(value, f"{where}: tool calls")
    return tuple(_call(c, where) for c in (value if isinstance(value, list) else [value]))


def _tools(value: object) -> tuple[str, ...]:
    """The row's tools as OpenAI's ``{"type": "function", "function": {...}}`` JSON text each (a bare
    function schema is wrapped: serving passes tools to the template in that form)."""
    if not _given(value):
        return ()
    tools = _json(value, "'tools'")
    if not isinstance(tools, list):
        raise ValueError(f"'tools' is a {type(tools).__name__}, not a list")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or not ("function" in tool or "name" in tool):
            raise ValueError(f"'tools' holds {str(tool)[:60]!r}, not a function schema")
        out.append(
            json.dumps(tool if "function" in tool else {"type": "function", "function": tool}, ensure_ascii=False)
        )
    return tuple(out)


def _reasoning(turn: dict, where: str) -> str:
    found = {k: turn[k] for k in REASONING if _given(turn.get(k))}
    for k, v in found.items():
        if not isinstance(v, str):
            raise ValueError(f"{where}: '{k}' is a {type(v).__name__}, not text")
    if len(set(found.values())) > 1:
        raise ValueError(f"{where}: {' and '.join(map(repr, found))} hold different reasoning")
    return next(iter(found.values()), "")


def _turn(raw: dict, role: str, text_key: str, where: str) -> Turn:
    """One message with everything it carries; a field with content hsx cannot place raises."""
    for k in UNSUPPORTED:
        if _given(raw.get(k)):
            raise ValueError(f"{where}: '{k}' carries content hsx does not render")
    reasoning = _reasoning(raw, where)
    calls: tuple[ToolCall, ...] = ()
    if _given(raw.get("tool_calls")):
        calls = _calls(raw["tool_calls"], where)
    elif _given(raw.get("function_call")):  # OpenAI's older single-call form
        calls = (_call(raw["function_call"], where),)
    if (reasoning or calls) and role != "assistant":
        raise ValueError(f"{where}: a {role} turn holds {'reasoning' if reasoning else 'tool calls'}")
    content = raw.get(text_key)
    if role == "tool" and (isinstance(content, dict) or (isinstance(content, list) and not _parts(content))):
        content = json.dumps(content, ensure_ascii=False)  # a tool's structured output, as the JSON it is
    elif content is None and (reasoning or calls):
        content = ""
    text = _text(content, where)
    if role != "tool":
        return Turn(role, text, reasoning, calls)
    return Turn(role, text, tool_call_id=str(raw.get("tool_call_id") or ""), name=str(raw.get("name") or ""))


def _parts(content: list) -> bool:
    return all(isinstance(p, dict) and "type" in p for p in content)


def _metadata(raw: dict, known: set[str], prefix: str) -> set[str]:
    """The names of fields that hold something hsx does not use (metadata: counted, never rendered)."""
    return {prefix + str(k) for k, v in raw.items() if k not in known and _given(v)}


def _turns(raw: list, role_key: str, text_key: str, list_key: str) -> tuple[list[Turn], list[int], set[str]]:
    """The turns, the row's index of each (for reasons: a call turn may join the text before it),
    and the metadata fields the messages hold."""
    turns: list[Turn] = []
    at: list[int] = []
    ignored: set[str] = set()
    for i, item in enumerate(raw):
        where = f"turn {i}"
        if not isinstance(item, dict):
            raise ValueError(f"{where} is a {type(item).__name__}, not an object")
        said = str(item.get(role_key, "")).lower()
        if said in CALL_ROLES:  # ShareGPT function-call datasets: the assistant's call(s) as a JSON turn
            calls = _calls(_json(item.get(text_key), f"{where}: a '{said}' turn"), where)
            last = turns[-1] if turns else None
            if last is not None and last.role == "assistant" and not last.tool_calls:  # its text, then its calls
                turns[-1] = Turn("assistant", last.content, last.reasoning, calls)
            else:
                turns.append(Turn("assistant", "", "", calls))
                at.append(i)
            ignored |= _metadata(item, {role_key, text_key}, f"{list_key}[].")
            continue
        role = (OPENAI_ROLES if role_key == "role" else ROLES).get(said)
        if role is None:
            raise ValueError(f"{where}: unknown role {item.get(role_key)!r}")
        turns.append(_turn(item, role, text_key, where))
        at.append(i)
        used = {role_key, text_key, *UNSUPPORTED, *REASONING, "tool_calls", "function_call"}
        if role == "tool":
            used |= {"tool_call_id", "name"}
        ignored |= _metadata(item, used, f"{list_key}[].")
    return turns, at, ignored


def _paired(turns: list[Turn], at: list[int]) -> tuple[list[Turn], int]:
    """Each tool result paired with a call of the assistant turn before it: by id, else by name, else
    in order; its missing ``tool_call_id`` is the call's (templates render it), its ``name`` stays as
    given (a result served without one is rendered without one: Kimi's writes its role then). A call
    without an id is given one (``call_id``), after pairing, so a result's own id still pairs it.
    Where that turn writes its calls in its text (Hermes, ToolACE datasets), results stay as given.
    Returns the turns and how many ids were given."""
    out: list[Turn] = []
    made: tuple[ToolCall, ...] = ()  # the calls of the last assistant turn, as the row has them
    ids: list[str] = []  # ... and the id each call has now
    open_calls: list[int] = []  # positions among them not answered yet
    caller = False
    count = 0
    for i, turn in zip(at, turns, strict=True):
        if turn.role == "assistant":
            made, caller = turn.tool_calls, True
            ids = [c.id or call_id(c.name, count + k) for k, c in enumerate(made)]
            open_calls = list(range(len(made)))
            count += len(made)
            if made:
                calls = tuple(ToolCall(c.name, c.arguments, cid) for c, cid in zip(made, ids, strict=True))
                turn = Turn("assistant", turn.content, turn.reasoning, calls)
        elif turn.role != "tool":
            made, caller, open_calls = (), False, []
        elif not caller:
            raise ValueError(f"turn {i}: a tool result with no assistant turn (no call) before it")
        elif made:
            k = _match(turn, open_calls, made, i)
            open_calls.remove(k)
            turn = Turn("tool", turn.content, tool_call_id=turn.tool_call_id or ids[k], name=turn.name)
        out.append(turn)
    given = sum(not c.id for t in turns if t.role == "assistant" for c in t.tool_calls)
    return out, given


def _match(result: Turn, open_calls: list[int], made: tuple[ToolCall, ...], i: int) -> int:
    """The position in ``made`` of the call ``result`` answers, among ``open_calls``."""
    if result.tool_call_id and any(c.id for c in made):
        k = next((k for k in open_calls if made[k].id == result.tool_call_id), None)
        if k is None:
            raise ValueError(f"turn {i}: a tool result for call id {result.tool_call_id!r}, which no open call has")
        return k
    if not open_calls:
        raise ValueError(f"turn {i}: more tool results than the {len(made)} call(s) before them")
    if result.name:
        k = next((k for k in open_calls if made[k].name == result.name), None)
        if k is None:
            raise ValueError(f"turn {i}: a result of {result.name!r}, which no open call calls")
        return k
    return open_calls[0]


def _keys(turns: list, field: str) -> tuple[str, str]:
    """The role and text keys of a list of turns, OpenAI's or ShareGPT's: a field of any name may hold
    either (SpecForge's ``conversations`` of ``role``/``content`` is common). A key held null is absent
    (Parquet and Arrow give every struct field to every turn)."""
    first = next((t for t in turns if isinstance(t, dict)), {})
    for keys in (("role", "content"), ("from", "value")):
        if first.get(keys[0]) is not None:
            return keys
    raise ValueError(f"'{field}' turns have neither 'role' (OpenAI) nor 'from' (ShareGPT) (keys: {_names(first)})")


def _names(row: dict) -> str:
    return ", ".join(sorted(str(k) for k, v in row.items() if v is not None)) or "none"


XLAM = ("query", "answers")  # xLAM function-calling rows: the request, the calls answering it; and "tools"
GLAIVE_V2 = (
    "a glaive-function-calling-v2 transcript ('chat' text of USER:/ASSISTANT:/FUNCTION RESPONSE: lines): "
    "hsx reads turns, not transcripts; convert it to ShareGPT turns first (LLaMA-Factory's glaive_toolcall "
    "datasets are that conversion)"
)


def _xlam(row: dict) -> tuple[list[Turn], list[int], set[str], set[str]]:
    """An xLAM row: the user's ``query``, and the assistant's calls (``answers``, JSON text) answering it."""
    turns = [
        Turn("user", _text(row["query"], "'query'")),
        Turn("assistant", "", "", _calls(row["answers"], "'answers'")),
    ]
    return turns, [0, 1], set(), set(XLAM)


def _row_turns(row: dict, column: str | None) -> tuple[list[Turn], list[int], set[str], set[str]] | str:
    """The row's turns (``_turns``), the row index of each, the metadata fields among its turns, and
    the row fields read; or why the row holds no turns hsx reads."""
    if column is not None:
        held = row.get(column)  # None: absent (a Parquet or Arrow row holds every column, null where absent)
        if held is None:
            return f"no '{column}' field, which --column {column} names (keys: {_names(row)})"
        if not isinstance(held, list):
            return f"'{column}' is a {type(held).__name__}, not a list of turns"
        field = column
    else:
        field = next((k for k in ("conversations", "messages") if isinstance(row.get(k), list)), "")
    if not field:
        if all(_given(row.get(k)) for k in XLAM):
            return _xlam(row)
        if isinstance(row.get("chat"), str):
            return GLAIVE_V2
        keys = ", ".join(sorted(map(str, row))) or "none"
        return f"unknown schema: no 'conversations' or 'messages' list (keys: {keys})"
    if not row[field]:
        return "empty conversation"
    role_key, text_key = _keys(row[field], field)
    return *_turns(row[field], role_key, text_key, field), {field}


def normalize(row: object, source: Source, column: str | None = None) -> Conversation | Reject:
    """One raw row -> a validated conversation, or the reason it cannot be one; ``column``: the
    field that holds its turns (``--column``), else ``conversations``, ``messages`` or xLAM's."""
    if not isinstance(row, dict):
        return Reject(source, f"row is a {type(row).__name__}, not an object")
    row_id = row.get("id")
    if row_id is not None:
        source = Source(source.file, source.row, str(row_id))
    image = next((k for k in IMAGE_FIELDS if row.get(k)), None)
    if image is not None:  # LLaVA-style ShareGPT: the picture beside the turns, "<image>" in their text
        return Reject(source, f"image content ('{image}' field); {TEXT_ONLY}")
    try:
        read = _row_turns(row, column)
        if isinstance(read, str):
            return Reject(source, read)
        turns, at, ignored, fields = read
        turns, given = _paired(turns, at)
        tools = _tools(row.get("tools") if _given(row.get("tools")) else row.get("functions"))
        system = row.get("system")
        if _given(system):  # a row-level system prompt (LLaMA-Factory's ShareGPT, ToolACE)
            system = _text(system, "'system'")
            if turns and turns[0].role == "system":
                if turns[0].content != system:
                    raise ValueError("a row-level 'system' and a system turn that differ")
            else:
                turns.insert(0, Turn("system", system))
    except ValueError as e:
        return Reject(source, str(e))
    if not any(t.role == "assistant" for t in turns):
        return Reject(source, "no assistant turn")
    if all(not (t.content.strip() or t.reasoning or t.tool_calls) for t in turns if t.role == "assistant"):
        return Reject(source, "every assistant turn is empty")
    ignored |= _metadata(row, {*fields, "id", "system", "tools", "functions", *IMAGE_FIELDS}, "")
    return Conversation(source, tuple(turns), tools, tuple(sorted(ignored)), given)


# ---------------------------------------------------------------- files -> rows, each within its bounds
# A row is read, decoded and parsed on its own: a row over a bound becomes a reject naming the row and
# the bound, and the rest of its file is read on. No row is held larger than MAX_ROW_BYTES, and no
# file is held whole (a JSON array is split into its rows as it streams by).
MAX_ROW_BYTES = 32 << 20  # a row's bytes as stored; conversations a draft trains on are far smaller
MAX_NESTING = 64  # levels of objects and lists in a row, or in JSON text a field holds (tool arguments)
NESTED = f"nested deeper than {MAX_NESTING} levels of objects and lists (the nesting limit)"
CHUNK = 1 << 20
BOM = b"\xef\xbb\xbf"


def json_depth(value: object) -> int:
    """How deep objects and lists nest in ``value`` (a scalar: 0), walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


def json_leaves(value: object) -> Iterator[object]:
    """Every value in ``value`` that is neither an object nor a list."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict | list):
            stack += item.values() if isinstance(item, dict) else item
        else:
            yield item


def parse_json(text: str | bytes) -> object:
    """JSON text nested at most ``MAX_NESTING`` deep: ``json.JSONDecodeError`` where it is not JSON,
    ``ValueError`` where it nests deeper (text deeper than Python's parser can take too, never a
    ``RecursionError``)."""
    try:
        value = json.loads(text)
    except RecursionError:
        value = TOO_DEEP
    if value is TOO_DEEP or json_depth(value) > MAX_NESTING:
        raise ValueError(NESTED)
    return value


TOO_DEEP = object()


def _too_large(size: int | str) -> str:
    return f"row of {size} bytes: larger than the row limit of {MAX_ROW_BYTES:,} bytes"


def _row(raw: bytes, i: int, name: str) -> tuple[int, object] | Reject:
    """One stored row's bytes -> (row number, value), or the reject saying which bound it broke."""
    try:
        return i, parse_json(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return Reject(Source(name, i, ""), f"not UTF-8 text ({e.reason} at byte {e.start} of the row)")
    except json.JSONDecodeError as e:
        return Reject(Source(name, i, ""), f"malformed JSON: {e.msg} at column {e.colno}")
    except ValueError as e:
        return Reject(Source(name, i, ""), str(e))


def _jsonl(f, name: str) -> Iterator[tuple[int, object] | Reject]:
    """A JSON line at a time (a blank line is no row but keeps its number); a line over the row
    limit is skipped to its end without being held."""
    i = 0
    while line := f.readline(MAX_ROW_BYTES + 1):
        if i == 0:
            line = line.removeprefix(BOM)
        if len(line) > MAX_ROW_BYTES and not line.endswith(b"\n"):
            size = len(line)
            while (rest := f.readline(CHUNK)) and not rest.endswith(b"\n"):
                size += len(rest)
            yield Reject(Source(name, i, ""), _too_large(f"{size + len(rest):,}"))
        elif line.strip():
            yield _row(line, i, name)
        i += 1


_OUTSIDE = re.compile(rb'["\[\]{},]')  # what changes the structure outside a string
_INSIDE = re.compile(rb'["\\]')  # what ends a string, or escapes the byte after it


def _json_array(f, name: str) -> Iterator[tuple[int, object] | Reject]:
    """The rows of a file holding one JSON array, streamed: the array is split into its elements by
    their brackets and strings (without parsing them), so a row is held only up to the row limit
    and one nested past the nesting limit is never parsed. A file that is not one array is refused."""
    level = 0  # 0: before the array; 1: between its rows; deeper: inside a row's objects and lists
    in_string = escaped = done = False
    piece, size, deepest, i = bytearray(), 0, 0, 0

    def element(end: bool) -> Iterator[tuple[int, object] | Reject]:
        nonlocal piece, size, deepest, i
        if not piece.strip() and size <= MAX_ROW_BYTES:
            if end and i == 0:  # [] or [ ]: no rows
                return
            raise InputError(f"{name}: not valid JSON (an empty element in the array, after row {i - 1})")
        if size > MAX_ROW_BYTES:
            yield Reject(Source(name, i, ""), _too_large(f"{size:,}"))
        elif deepest > MAX_NESTING:
            yield Reject(Source(name, i, ""), NESTED)
        else:
            yield _row(bytes(piece), i, name)
        piece, size, deepest, i = bytearray(), 0, 0, i + 1

    first = True
    while chunk := f.read(CHUNK):
        if first:
            chunk, first = chunk.removeprefix(BOM), False
        pos, n, keep = 0, len(chunk), 0  # keep: where this chunk's part of the current row begins
        while pos < n:
            if done:
                if chunk[pos:].strip():
                    raise InputError(f"{name}: not valid JSON (more after the array's end)")
                break
            if escaped:
                pos, escaped = pos + 1, False
                continue
            m = (_INSIDE if in_string else _OUTSIDE).search(chunk, pos)
            if m is None:
                break
            c, pos = m.group(), m.end()
            if in_string:
                escaped, in_string = c == b"\\", c == b"\\"
                continue
            if level == 0:
                if c != b"[" or chunk[keep : m.start()].strip():
                    raise _not_an_array(name, chunk if n < CHUNK else None)
                level, keep = 1, pos
            elif c == b'"':
                in_string = True
            elif c in b"[{":
                level += 1
                deepest = max(deepest, level - 1)
            elif c in b"]}" and level > 1:
                level -= 1
            elif level == 1 and c in b",]":
                size += m.start() - keep
                if size <= MAX_ROW_BYTES:
                    piece += chunk[keep : m.start()]
                yield from element(end=c == b"]")
                keep, done = pos, c == b"]"
        if level >= 1 and not done:
            size += n - keep
            if size <= MAX_ROW_BYTES:
                piece += chunk[keep:n]
            else:
                piece = bytearray()
    if level == 0:
        raise _not_an_array(name, b"")
    if not done:
        raise InputError(f"{name}: not valid JSON (the array is not closed)")


def _not_an_array(name: str, whole: bytes | None) -> InputError:
    """A .json file that does not hold an array: not JSON at all, where ``whole`` (the file, if it
    is small) says so, or JSON of another kind."""
    try:
        json.loads(whole) if whole is not None else None
    except (ValueError, RecursionError) as e:
        return InputError(f"{name}: not valid JSON ({getattr(e, 'msg', 'nested too deep')})")
    return InputError(f"{name}: a .json data file must hold an array of rows")


def _table(batches: Iterator, name: str) -> Iterator[tuple[int, object] | Reject]:
    """Rows of Arrow batches (Parquet, a Hugging Face dataset): a row over the row limit is never
    made into Python objects; one nested past the nesting limit is a reject."""
    i = 0
    for batch in batches:
        for k in range(batch.num_rows):
            one = batch.slice(k, 1)
            if one.nbytes > MAX_ROW_BYTES:
                yield Reject(Source(name, i, ""), _too_large(f"{one.nbytes:,}"))
            else:
                try:
                    row = one.to_pylist()[0]
                    deep = json_depth(row) > MAX_NESTING
                except RecursionError:
                    deep = True
                if deep:
                    yield Reject(Source(name, i, ""), NESTED)
                else:
                    yield i, row
            i += 1


def _rows(path: Path, name: str, split: str | None = None) -> Iterator[tuple[int, object] | Reject]:
    from hsx import hfdatasets

    if hfdatasets.is_source(path):
        yield from _table(hfdatasets.batches(path, split), name)
        return
    if split is not None:
        raise InputError(f"{name}: --split {split} applies to a Hugging Face dataset, not to a data file")
    suffix = path.suffix.lower()
    try:
        if suffix in (".jsonl", ".ndjson"):
            with open(path, "rb") as f:
                yield from _jsonl(f, name)
        elif suffix == ".json":
            with open(path, "rb") as f:
                yield from _json_array(f, name)
        elif suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                table = pq.ParquetFile(path)
            except Exception as e:
                raise InputError(f"{name}: not a readable Parquet file ({e})") from e
            yield from _table(table.iter_batches(batch_size=TABLE_BATCH), name)
        else:
            raise InputError(f"{name}: unknown data file type {suffix!r} (use .jsonl, .json or .parquet)")
    except OSError as e:
        raise InputError(f"{name}: cannot read ({e.strerror or e})") from e


TABLE_BATCH = 64  # Arrow rows read at a time: a batch of large rows stays a small multiple of the row limit


def _not_a_file(path: Path) -> InputError:
    """Why ``path`` cannot be read as data: it is a folder (not a saved dataset), or nothing."""
    if path.is_dir():
        return InputError(
            f"{path} is a folder, not a data file nor a Hugging Face dataset saved with save_to_disk "
            "(no state.json or dataset_dict.json in it): name the .jsonl, .json or .parquet files in it"
        )
    return InputError(f"{path}: no such data file")


def check_source(path: Path, split: str | None = None, column: str | None = None) -> None:
    """Refuse a ``--data`` that names nothing readable (a dataset: not cached, no such split), or
    whose rows lack the ``--column`` altogether, before anything is written."""
    from hsx import hfdatasets

    if hfdatasets.is_source(path):
        hfdatasets.load(path, split)
    elif not path.is_file():
        raise _not_a_file(path)
    elif split is not None:
        raise InputError(f"{path}: --split {split} applies to a Hugging Face dataset, not to a data file")
    if column is not None and (have := _columns(path, split, column)) is not None:
        raise InputError(
            f"{path}: no row has a column {column!r} (--column {column}); its rows have: {', '.join(have) or 'none'}"
        )


def _columns(path: Path, split: str | None, column: str) -> list[str] | None:
    """None where the source has ``column``; else the columns its rows do have. A table's are its
    schema's; a JSON file's rows are read until one has it (all of them where none has)."""
    from hsx import hfdatasets

    if hfdatasets.is_source(path):
        names = hfdatasets.load(path, split).column_names
    elif path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        names = pq.read_schema(path).names
    else:
        seen: dict[str, None] = {}
        for item in _rows(path, str(path)):
            if not isinstance(item, Reject) and isinstance(item[1], dict):
                if column in item[1]:
                    return None
                seen |= dict.fromkeys(map(str, item[1]))
        names = list(seen)
    return None if column in names else sorted(names)


def read_conversations(
    paths: list[Path], split: str | None = None, limit: int | None = None, column: str | None = None
) -> Iterator[Conversation | Reject]:
    """Every row of every source, in order, as a ``Conversation`` or a ``Reject``; ``split``: of the
    Hugging Face datasets among them; ``limit``: the first rows only, counted over all sources;
    ``column``: the field every row's turns are read from (``normalize``)."""
    from hsx import hfdatasets

    count = 0
    for path in paths:
        if not path.is_file() and not hfdatasets.is_source(path):
            raise _not_a_file(path)
        name = str(path)
        for item in _rows(path, name, split):
            if limit is not None and count >= limit:
                return
            count += 1
            if isinstance(item, Reject):
                yield item
            else:
                row, raw = item
                yield normalize(raw, Source(name, row, ""), column)
