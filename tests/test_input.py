import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hsx.input import (
    Conversation,
    InputError,
    Reject,
    Source,
    ToolCall,
    Turn,
    normalize,
    read_conversations,
    to_message,
    tools_of,
)


def _read(path):
    return list(read_conversations([path]))


def test_sharegpt_and_openai_rows_normalise_to_the_same_turns(tmp_path):
    share = {
        "id": 7,
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "Q"},
            {"from": "gpt", "value": "A"},
        ],
    }
    openai = {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "Q"}]},
            {"role": "assistant", "content": "A"},
        ]
    }
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(share) + "\n" + json.dumps(openai) + "\n")
    a, b = _read(path)
    assert isinstance(a, Conversation) and isinstance(b, Conversation)
    assert a.turns == b.turns
    assert [t.role for t in a.turns] == ["system", "user", "assistant"]
    assert (a.source.row, a.source.id, b.source.row, b.source.id) == (0, "7", 1, "")


def test_every_bad_row_is_rejected_with_its_row_number_and_reason(tmp_path):
    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    lines = [
        json.dumps(good),
        '{"conversations": [',  # malformed JSON
        json.dumps({"text": "plain"}),  # unknown schema
        json.dumps({"conversations": []}),  # empty
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),  # no assistant
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                    {"role": "assistant", "content": "a"},
                ]
            }
        ),  # non-text content
        json.dumps({"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "a"}]}),
        json.dumps([1, 2]),  # not an object
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]}),
        json.dumps(good),
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    items = _read(path)
    rejects = [i for i in items if isinstance(i, Reject)]
    assert [r.source.row for r in rejects] == [1, 2, 3, 4, 5, 6, 7, 8]
    reasons = [r.reason for r in rejects]
    assert reasons[0].startswith("malformed JSON")
    assert "unknown schema" in reasons[1]
    assert reasons[2] == "empty conversation"
    assert reasons[3] == "no assistant turn"
    assert "non-text content part (image_url)" in reasons[4]
    assert "unknown role 'wizard'" in reasons[5]
    assert "not an object" in reasons[6]
    assert "not text" in reasons[7]
    assert [i.source.row for i in items if isinstance(i, Conversation)] == [0, 9]
    assert all(r.source.file == str(path) for r in rejects)


def test_json_array_and_parquet_inputs(tmp_path):
    rows = [
        {"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
        for i in range(3)
    ]
    jpath = tmp_path / "rows.json"
    jpath.write_text(json.dumps(rows))
    ppath = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), ppath)
    assert [c.turns for c in _read(jpath)] == [c.turns for c in _read(ppath)]
    assert [c.source.id for c in _read(ppath)] == ["r0", "r1", "r2"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.json", "{not json", "not valid JSON"),
        ("obj.json", '{"a": 1}', "must hold an array"),
        ("bad.parquet", "not parquet", "not a readable Parquet file"),
        ("rows.csv", "a,b", "unknown data file type"),
    ],
)
def test_unreadable_files_are_a_clear_error(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(InputError, match=message):
        _read(path)
    with pytest.raises(InputError, match="no such data file"):
        _read(tmp_path / "missing.jsonl")


# ---------------------------------------------------------------- tools, tool calls, tool results, reasoning

AGENTIC = Path(__file__).parent / "data" / "agentic.jsonl"  # rows shaped like the public datasets


def _by_id() -> dict:
    return {item.source.id: item for item in _read(AGENTIC)}


def test_openai_tool_rows_keep_calls_results_tools_and_reasoning():
    rows = _by_id()
    conv = rows["openai-parallel"]
    assert [t.role for t in conv.turns] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    call = conv.turns[2]
    # arguments given as JSON text and as an object read the same; null content beside calls is empty text
    assert call.tool_calls == (
        ToolCall("get_weather", '{"city": "Oslo", "unit": "c"}', "call_a1"),
        ToolCall("get_weather", '{"city": "Lima"}', "call_b2"),
    )
    assert (call.content, call.reasoning) == ("", "Two cities, so two weather lookups at once.")
    # each result paired with its call by id; no name the row did not give (a template renders the role then)
    pairs = [(t.tool_call_id, t.name) for t in conv.turns[3:5]]
    assert pairs == [("call_a1", ""), ("call_b2", "")]
    raw = json.loads(AGENTIC.read_text().splitlines()[4])
    assert tools_of(conv) == raw["tools"]

    def weather(arguments: dict, call_id: str) -> dict:
        return {"type": "function", "function": {"name": "get_weather", "arguments": arguments}, "id": call_id}

    assert to_message(call) == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Two cities, so two weather lookups at once.",
        "tool_calls": [weather({"city": "Oslo", "unit": "c"}, "call_a1"), weather({"city": "Lima"}, "call_b2")],
    }
    stock = rows["openai-tools-string"]  # tools as the JSON text of a list; content beside a call
    assert [t["function"]["name"] for t in tools_of(stock)] == ["get_stock_price"]
    assert stock.turns[1].content == "Looking up the ticker now."
    assert stock.turns[1].tool_calls == (ToolCall("get_stock_price", '{"ticker": "ACME"}', "call_s1"),)
    assert rows["reason-thinking"].turns[1].reasoning == "Ninety-one is seven times thirteen."  # the alias
    assert rows["reason-multiturn"].turns[3].reasoning == "Fifty-one and nine make sixty."


def test_sharegpt_function_calling_rows_read_as_the_same_calls_and_results():
    rows = _by_id()
    glaive = rows["glaive-parallel"]
    assert glaive.turns[0] == Turn("system", "SYSP You may call functions.")  # the row-level system prompt
    assert [t.role for t in glaive.turns] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    # one function_call turn holding a list is one assistant turn with parallel calls, paired in order
    # calls without ids are given Kimi-K2's (functions.NAME:N, N counting the row's calls), and their results too
    assert glaive.turns[2].tool_calls == (
        ToolCall("get_weather", '{"city": "Rome"}', "functions.get_weather:0"),
        ToolCall("get_weather", '{"city": "Cairo"}', "functions.get_weather:1"),
    )
    assert glaive.ids_given == 2
    assert [(t.content, t.name, t.tool_call_id) for t in glaive.turns[3:5]] == [
        ("TOOLRES Rome 18 C", "", "functions.get_weather:0"),
        ("TOOLRES Cairo 31 C", "", "functions.get_weather:1"),
    ]
    # bare function schemas are offered to the template as OpenAI's tools, as serving passes them
    assert [t["type"] for t in tools_of(glaive)] == ["function"]
    assert tools_of(glaive)[0]["function"]["name"] == "get_weather"
    single = rows["glaive-sharegpt"]
    call_id = "functions.get_stock_price:0"
    assert single.turns[2].tool_calls == (ToolCall("get_stock_price", '{"ticker": "ZETA"}', call_id),)
    assert single.turns[3] == Turn("tool", '{"price": "TOOLRES 7.05"}', tool_call_id=call_id)
    # calls a dataset writes in the assistant's text (ToolACE, Hermes) stay text; their results stay as given
    for key in ("toolace", "hermes-fc"):
        conv = rows[key]
        assert [t.role for t in conv.turns] == ["system", "user", "assistant", "tool", "assistant"]
        assert not conv.turns[2].tool_calls and conv.turns[2].content.startswith(("[get_stock_price(", "<tool_call>"))
        assert conv.turns[3].content.startswith(("[{", "<tool_response>")) and conv.turns[3].name == ""


def test_metadata_fields_are_named_and_null_columns_are_not(tmp_path):
    rows = _by_id()
    assert rows["plain-openai"].ignored == ("category", "messages[].name", "messages[].weight")
    assert rows["hermes-fc"].ignored == ("category", "subcategory")
    assert rows["openai-parallel"].ignored == ()
    # Parquet gives every row every column, absent ones as null: a null is not metadata, nor content
    lines = AGENTIC.read_text().splitlines()
    picked = [json.loads(lines[i]) for i in (0, 5)]  # plain ShareGPT, OpenAI tools
    for row in picked:
        row.setdefault("messages", None)
        row.setdefault("conversations", None)
        row.setdefault("tools", None)
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(picked), path)
    from_parquet = _read(path)
    assert [c.turns for c in from_parquet] == [rows["plain-sharegpt"].turns, rows["openai-tools-string"].turns]
    assert [c.ignored for c in from_parquet] == [(), ()] and from_parquet[1].tools == rows["openai-tools-string"].tools


def _openai(*turns, **row) -> dict:
    return {"messages": [{"role": "user", "content": "q"}, *turns], **row}


CALL = {"id": "c1", "function": {"name": "f", "arguments": "{}"}}
SAID, CALLED = {"from": "human", "value": "q"}, {"from": "gpt", "value": "Let me look."}
CALLS = {"from": "function_call", "value": '{"name": "f", "arguments": {"x": 1}}'}
RESULTS = [CALLS, {"from": "observation", "value": "r"}, {"from": "observation", "value": "r"}]


def test_a_call_turn_right_after_the_assistants_text_is_that_turns_call():
    row = {"conversations": [SAID, CALLED, *RESULTS[:2], {"from": "gpt", "value": "done"}]}
    conv = normalize(row, Source("f", 0, ""))
    assert [t.role for t in conv.turns] == ["user", "assistant", "tool", "assistant"]
    assert conv.turns[1] == Turn("assistant", "Let me look.", tool_calls=(ToolCall("f", '{"x": 1}', "functions.f:0"),))
    assert conv.turns[2] == Turn("tool", "r", tool_call_id="functions.f:0")


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ("broken-orphan-result", "turn 1: a tool result with no assistant turn (no call) before it"),
        ("broken-arguments", "turn 1: arguments of the call to 'get_weather': not valid JSON"),
        ("broken-call-id", "turn 2: a tool result for call id 'c9', which no open call has"),
        ("broken-function-call", "turn 1: a 'function_call' turn: not valid JSON"),
        ("broken-extra-result", "turn 3: more tool results than the 1 call(s) before them"),
        ({"system": "S", "conversations": [SAID, CALLED, *RESULTS]},  # the row's numbering, whatever joins
         "turn 4: more tool results than the 1 call(s) before them"),
        (_openai({"role": "assistant", "content": "a"}, {"role": "user", "content": "q", "thinking": "t"}),
         "turn 2: a user turn holds reasoning"),
        (_openai({"role": "assistant", "content": None, "refusal": "I can't."}),
         "turn 1: 'refusal' carries content hsx does not render"),
        ({"system": "S1", "messages": [{"role": "system", "content": "S2"}, {"role": "assistant", "content": "a"}]},
         "a row-level 'system' and a system turn that differ"),
        (_openai({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}),
         "turn 1: the arguments of the call to 'f' are a list, not an object"),
        (_openai({"role": "assistant", "content": "a"}, tools='{"name": "f"}'), "'tools' is a dict, not a list"),
        (_openai({"role": "assistant", "content": "a", "reasoning_content": "x", "thinking": "y"}),
         "turn 1: 'reasoning_content' and 'thinking' hold different reasoning"),
        (_openai({"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "name": "g", "content": "r"}),
         "turn 2: a result of 'g', which no open call calls"),
    ],
)  # fmt: skip
def test_really_broken_tool_rows_are_rejected_with_their_reason(row, reason):
    got = _by_id()[row] if isinstance(row, str) else normalize(row, Source("f", 0, ""))
    assert isinstance(got, Reject) and got.reason.startswith(reason), got


def _chat(*turns, **fields) -> dict:
    return {"chat": list(turns), **fields}


def _parquet(path: Path, rows: list[dict]) -> None:
    """Rows with different fields in one table: each field a column, null where a row lacks it."""
    names = list(dict.fromkeys(k for r in rows for k in r))
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in names} for r in rows]), path)


USER, ASSISTANT = {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}
HUMAN, GPT = {"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_column_reads_every_rows_turns_from_that_field_and_a_row_without_it_is_a_reject(tmp_path, suffix):
    """--column: OpenAI or ShareGPT turns under any name, in every file type; a row that lacks the
    field (absent, or null as Parquet writes it) is a reject that names it, never skipped."""
    rows = [
        _chat(USER, ASSISTANT, id="openai"),
        _chat(HUMAN, GPT, id="sharegpt", system="S"),
        {"id": "standard", "conversations": [HUMAN, GPT]},  # the standard field, which --column does not read
        _chat(id="empty"),
        {"id": "string", "chat": "Q A"},
        _chat({"speaker": "user", "text": "Q"}, id="no-role"),
    ]
    path = tmp_path / f"rows{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    else:  # a column holds one type: not the string's row, nor the one whose turns have other fields
        _parquet(path, rows[:4])
    got = {c.source.id: c for c in read_conversations([path], column="chat")}
    openai, share = got["openai"], got["sharegpt"]
    assert isinstance(openai, Conversation) and [(t.role, t.content) for t in openai.turns] == [
        ("user", "Q"),
        ("assistant", "A"),
    ]
    assert isinstance(share, Conversation) and share.turns == (Turn("system", "S"), *openai.turns)
    assert got["standard"] == Reject(
        Source(str(path), 2, "standard"), "no 'chat' field, which --column chat names (keys: conversations, id)"
    )
    assert got["empty"].reason == "empty conversation"
    if suffix != ".parquet":
        assert got["string"].reason == "'chat' is a str, not a list of turns"
        assert (
            got["no-role"].reason
            == "'chat' turns have neither 'role' (OpenAI) nor 'from' (ShareGPT) (keys: speaker, text)"
        )
    without = {c.source.id: c for c in read_conversations([path])}  # no --column: as before, chat is unknown
    assert isinstance(without["standard"], Conversation) and without["standard"].turns == openai.turns
    assert without["openai"].reason.startswith("unknown schema: no 'conversations' or 'messages' list")


def test_either_kind_of_turns_reads_under_either_standard_field():
    """SpecForge's rows: ``conversations`` of role/content turns (common on the Hub), read as they are,
    as ShareGPT turns under ``messages`` are; --column names the field without changing how it reads."""
    row = {"conversations": [USER, ASSISTANT], "messages": "ignored"}
    for got in (normalize(row, Source("f", 0, "")), normalize(row, Source("f", 0, ""), "conversations")):
        assert isinstance(got, Conversation) and [(t.role, t.content) for t in got.turns] == [
            ("user", "Q"),
            ("assistant", "A"),
        ]
        assert got.ignored == ("messages",)
    sharegpt = normalize({"messages": [HUMAN, GPT]}, Source("f", 0, ""))
    assert sharegpt.turns == got.turns
    no_role = normalize({"conversations": [{"speaker": "user", "text": "Q"}]}, Source("f", 0, ""))
    assert no_role.reason == (
        "'conversations' turns have neither 'role' (OpenAI) nor 'from' (ShareGPT) (keys: speaker, text)"
    )


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_a_column_no_row_has_is_refused_naming_the_columns_there(tmp_path, suffix):
    from hsx.input import check_source

    rows = [{"id": "a", "conversations": [HUMAN, GPT]}, {"id": "b", "chat": [USER, ASSISTANT], "turns": 2}]
    path = tmp_path / f"rows{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{not json\n")
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        _parquet(path, rows)
    check_source(path, column="chat")  # one row has it: the others are rejects, not a refusal
    with pytest.raises(InputError) as refused:
        check_source(path, column="dialog")
    assert str(refused.value) == (
        f"{path}: no row has a column 'dialog' (--column dialog); its rows have: chat, conversations, id, turns"
    )


def test_xlam_rows_read_as_a_request_and_its_calls_and_glaive_transcripts_are_refused_naming_the_conversion():
    rows = _by_id()
    xlam = rows["xlam"]
    assert [t.role for t in xlam.turns] == ["user", "assistant"] and xlam.turns[0].content.startswith("USERQ")
    assert xlam.turns[1].tool_calls == (
        ToolCall("get_weather", '{"city": "Rome"}', "functions.get_weather:0"),
        ToolCall("get_weather", '{"city": "Paris"}', "functions.get_weather:1"),
    )
    assert tools_of(xlam)[0]["function"]["name"] == "get_weather" and xlam.ids_given == 2
    assert rows["glaive-v2"].reason.startswith("a glaive-function-calling-v2 transcript")
    assert "convert it to ShareGPT turns first" in rows["glaive-v2"].reason
    specforge = rows["specforge"]  # SpecForge's own rows: conversations of role/content turns
    assert [(t.role, t.content) for t in specforge.turns] == [("user", "USERQ Name a prime."), ("assistant", "Seven.")]


def test_a_call_without_an_id_gets_one_and_a_results_own_id_still_pairs_it():
    """Ids are given after pairing: a result naming an id its call lacks keeps its own."""
    row = _openai(
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}] * 2},
        {"role": "tool", "content": "one", "tool_call_id": "mine"},
        {"role": "tool", "content": "two"},
        {"role": "assistant", "tool_calls": [{"id": "kept", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "content": "three"},
    )
    conv = normalize(row, Source("f", 0, ""))
    assert [c.id for c in conv.turns[1].tool_calls] == ["functions.f:0", "functions.f:1"]
    assert [(t.tool_call_id, t.name) for t in conv.turns[2:4]] == [("mine", ""), ("functions.f:1", "")]
    assert conv.turns[4].tool_calls[0].id == "kept" and conv.turns[5].tool_call_id == "kept"
    assert conv.ids_given == 2


# ---------------------------------------------------------------- hostile rows: every reader, bounded


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _hostile_rows(rng, limit: int, text: bool) -> list[tuple[str, object]]:
    """(kind, row) pairs: good rows and hostile ones; ``text``: the file is JSON text (JSONL, JSON),
    whose bytes may also be invalid UTF-8 or not JSON at all. A row is an object, or bytes as stored."""
    good = {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}], "meta": ""}
    kinds = ["good", "oversized", "deep_string", "empty", "not_object"]
    kinds += ["deep_row", "bad_utf8", "malformed"] if text else []
    rows = [("good", good)]
    for _ in range(60):
        kind = rng.choice(kinds)
        if kind == "good":
            rows.append((kind, good | {"meta": "é" * rng.randint(0, 200)}))
        elif kind == "oversized":  # one long value, up to 16 times the row limit
            big = {"from": "human", "value": "x" * rng.randint(limit + 1, 16 * limit)}
            rows.append((kind, {"conversations": [big, good["conversations"][1]], "meta": ""}))
        elif kind == "deep_string":  # JSON text a field holds (the tools), nested past the limit
            rows.append((kind, good | {"tools": _nested(rng.randint(65, 3000))}))
        elif kind == "empty":
            rows.append((kind, {"conversations": [], "meta": ""}))
        elif kind == "not_object":
            rows.append((kind, rng.choice([[1, 2], "text", 7]) if text else {"meta": "no turns"}))
        elif kind == "deep_row":
            rows.append((kind, f'{{"conversations": {_nested(rng.randint(65, 5000))}}}'.encode()))
        elif kind == "bad_utf8":
            rows.append((kind, json.dumps(good).encode()[:-2] + bytes([rng.choice([0xFF, 0xC3, 0x80])]) + b'"}'))
        else:
            rows.append((kind, b'{"conversations": [tru, 1]}'))  # balanced: a JSON array goes on
    return rows


REASONS = {
    "oversized": "larger than the row limit of",
    "deep_string": "not valid JSON (nested deeper than 64 levels",
    "deep_row": "nested deeper than 64 levels of objects and lists (the nesting limit)",
    "bad_utf8": "not UTF-8 text",
    "malformed": "malformed JSON",
    "empty": "empty conversation",
    "not_object": "",  # "row is a list, not an object" or "unknown schema"
}


def _write(path: Path, fmt: str, rows: list[tuple[str, object]]) -> Path:
    def raw(row: object) -> bytes:
        return row if isinstance(row, bytes) else json.dumps(row, ensure_ascii=False).encode()

    if fmt == "jsonl":
        path.write_bytes(b"\xef\xbb\xbf" + b"".join(raw(r) + b"\n" for _, r in rows))  # a BOM before row 0
    elif fmt == "json":
        path.write_bytes(b"\xef\xbb\xbf[\n" + b",\n".join(raw(r) for _, r in rows) + b"\n]")
    else:
        table = pa.Table.from_pylist([{"tools": None} | r for _, r in rows])
        if fmt == "parquet":
            pq.write_table(table, path, row_group_size=16)
        else:
            from conftest import require

            require("datasets").Dataset(table).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "datasets"])
def test_fuzz_every_reader_rejects_hostile_rows_by_name_within_a_memory_bound(tmp_path, monkeypatch, fmt):
    """Generated hostile rows through each reader (a row past the size limit, nested past the
    nesting limit in the row or in JSON text a field holds, not UTF-8, not JSON, not an object,
    empty), among good ones: every row comes out once, in order, a good one equal to what json
    gives for it (the independent reference), a hostile one as a reject naming its row and the
    limit; a BOM costs no row; and no reader holds a row past the limit: the Python memory peak
    stays under a few rows' worth, where the largest row is 16 times the limit."""
    import random
    import tracemalloc

    from hsx import input as reader

    limit = 64 << 10  # the bounds made small, so that hostile rows stay small in the test
    monkeypatch.setattr(reader, "MAX_ROW_BYTES", limit)
    monkeypatch.setattr(reader, "CHUNK", 16 << 10)
    seed = 4242
    rows = _hostile_rows(random.Random(seed), limit, fmt in ("jsonl", "json"))
    path = _write(tmp_path / f"rows.{fmt}", fmt, rows)
    next(read_conversations([path]))  # what the reader imports the first time is not what it holds
    tracemalloc.start()
    try:
        out = list(read_conversations([path]))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [o.source.row for o in out] == list(range(len(rows))), f"seed {seed}"
    for (kind, row), got in zip(rows, out, strict=True):
        if kind == "good":
            ref = normalize(json.loads(json.dumps(row)), got.source)  # json's own reading of the row
            assert got == ref and isinstance(got, Conversation), (seed, got)
        else:
            assert isinstance(got, Reject) and REASONS[kind] in got.reason, (seed, kind, got)
    assert peak < 12 * limit, f"seed {seed}: {peak} bytes held at once, the largest row is {16 * limit}"


def test_a_hostile_row_is_a_reject_naming_it_and_every_good_row_is_planned(tmp_path):
    """The real command on one file: a row nested 5,000 deep (it ended the start with a
    RecursionError), one holding JSON text nested 3,000 deep, one invalid UTF-8 byte (it refused the
    whole file), a row past the 32 MiB row limit (a 50 MB row once took 11 GB to reject), and a
    byte-order mark (it cost row 0): each hostile row is a reject naming its row and the limit, the
    good rows around them are planned, and status counts the rejects."""
    from typer.testing import CliRunner

    from conftest import TINY, conversations, hsx
    from hsx.cli import app
    from hsx.input import MAX_ROW_BYTES

    good = [json.dumps(c).encode() for c in conversations(3)]
    deep_text = {"messages": [{"role": "user", "content": "q"},
                              {"role": "assistant", "content": "", "tool_calls": [
                                  {"function": {"name": "f", "arguments": _nested(3000)}}]}]}  # fmt: skip
    big = {"conversations": [{"from": "human", "value": "x" * MAX_ROW_BYTES}, {"from": "gpt", "value": "A"}]}
    rows = [
        b"\xef\xbb\xbf" + good[0],
        b'{"conversations": ' + _nested(5000).encode() + b"}",
        json.dumps(deep_text).encode(),
        good[1][:-2] + b'\xff"}',
        json.dumps(big).encode(),
        good[2],
    ]
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b"\n".join(rows) + b"\n")
    out = tmp_path / "run"
    r = hsx("extract", "--model", TINY, "--data", data, "--out", out, "--device", "cpu", "--codec", "raw", check=False)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    rejects = {j["row"]: j["reason"] for j in map(json.loads, (out / "rejects.jsonl").read_text().splitlines())}
    assert sorted(rejects) == [1, 2, 3, 4], rejects
    assert rejects[1] == "nested deeper than 64 levels of objects and lists (the nesting limit)"
    assert "arguments of the call to 'f': not valid JSON (nested deeper than 64 levels" in rejects[2]
    assert rejects[3].startswith("not UTF-8 text (invalid start byte at byte")
    assert rejects[4] == f"row of {len(rows[4]) + 1:,} bytes: larger than the row limit of {MAX_ROW_BYTES:,} bytes"
    plan = pq.read_table(out / "plan" / "plan.parquet")
    assert sorted(set(plan.column("source_row").to_pylist())) == [0, 5]
    status = CliRunner().invoke(app, ["status", str(out)])
    assert "rejected: 4 input rows at planning; each with its reason in" in status.output, status.output
