import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hsx.input import Conversation, InputError, Reject, read_conversations


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
