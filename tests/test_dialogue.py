"""Regeneration of tool conversations: the target's calls answered with the dataset's results, paired
by tool name in order, and the conversation ended (kept, with its reason) where a call cannot be paired.

The target is scripted (an ``Engine`` answering by the prompt's text, tokenized by the real
tokenizer), so the calls it makes are known; everything else is the real job: OpenAI rows read by
the input stage, the plan, the chat
template (a Qwen3-like tool template), the hermes/Qwen3 parser, the files, resume, extraction and
export. References are the tokenizer's own ``apply_chat_template`` and ``decode``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY, run_files, write_jsonl
from hsx.generate.engines.base import Completion, Engine, Request
from hsx.generate.export import openai_message
from hsx.generate.job import generate
from hsx.generate.options import GenerateOptions
from hsx.genrun.record import read_record
from hsx.input import ToolCall, Turn, to_message
from hsx.store import layout

TEMPLATE = (  # Qwen3's layout of tools, reasoning, calls and results, written small
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}"
    '{% for c in m.tool_calls or [] %}<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TOOLS = (json.dumps(WEATHER), json.dumps({"type": "function", "function": {"name": "get_news"}}))


def _call(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def script(prompt: str) -> str:
    """What the scripted target answers: by the last user request and the results it has had since."""
    turns = prompt.split("<|im_start|>")
    asks = [i for i, t in enumerate(turns) if t.startswith("user\n") and not t.startswith("user\n<tool_response>")]
    ask, got = turns[asks[-1]], sum(t.startswith("user\n<tool_response>") for t in turns[asks[-1] :])
    if "Paris and Rome" in ask and got == 0:  # two parallel calls, after thinking
        return (
            "<think>\nTwo cities, two calls.\n</think>\n\n"
            + _call("get_weather", {"city": "Paris"})
            + _call("get_weather", {"city": "Rome"})
        )
    if "news, then" in ask and got < 2:  # two calls one after the other
        return "One moment." + _call(["get_news", "get_weather"][got], {"topic": "local"})
    if "broken" in ask:  # a call whose arguments are cut short
        return '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    if "time" in ask:
        return _call("get_time", {"tz": "Asia/Tokyo"})
    return f"I have {got} results." if got else "Hello! How can I help?"


class Scripted(Engine):
    """Answers up to four requests at a time, in reverse order of submission; ``crash_after``: raise
    KeyboardInterrupt (as Ctrl-C would) once that many outcomes have been given."""

    name, version, max_pending = "scripted", "1", 4

    def __init__(self, model_dir: Path, crash_after: int | None = None):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.queue: list[Request] = []
        self.given, self.crash_after = 0, crash_after

    def submit(self, request: Request) -> None:
        self.queue.append(request)

    def poll(self, timeout=None) -> list:
        out, self.queue = [self._answer(r) for r in reversed(self.queue)], []
        self.given += len(out)
        if self.crash_after is not None and self.given >= self.crash_after:
            raise KeyboardInterrupt
        return out

    def _answer(self, r: Request) -> Completion:
        text = script(self.tok.decode(list(r.prompt_ids)))
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return Completion(r.key, r.prompt_ids, tuple(ids), "stop")

    def close(self) -> None:
        pass


def _row(turns: list[Turn], tools: tuple[str, ...] = TOOLS) -> tuple[list[Turn], tuple[str, ...]]:
    return turns, tools


def _calls(*specs: tuple[str, str]) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(name, json.dumps({"q": i}), cid) for i, (name, cid) in enumerate(specs))


ROWS = [
    # 0: parallel calls, both paired (results found by their tool_call_id), then a plain episode
    _row(
        [
            Turn("user", "Weather in Paris and Rome?"),
            Turn("assistant", "", tool_calls=_calls(("get_weather", "a"), ("get_weather", "b"))),
            Turn("tool", "RESULT-PARIS 18C", tool_call_id="a"),
            Turn("tool", "RESULT-ROME 24C", tool_call_id="b"),
            Turn("assistant", "Sunny in both."),
            Turn("user", "Thanks, hello again"),
            Turn("assistant", "Bye."),
        ]
    ),
    # 1: the target calls a tool the dataset's turn has no result of
    _row(
        [
            Turn("user", "What time is it in Tokyo?"),
            Turn("assistant", "", tool_calls=_calls(("get_weather", "c"))),
            Turn("tool", "RESULT-TOKYO", name="get_weather"),
            Turn("assistant", "Rainy."),
        ]
    ),
    # 2: sequential calls; results named by name, then by position after their call
    _row(
        [
            Turn("user", "The news, then the weather"),
            Turn("assistant", "", tool_calls=_calls(("get_news", ""))),
            Turn("tool", "RESULT-NEWS", name="get_news"),
            Turn("assistant", "", tool_calls=_calls(("get_weather", ""))),
            Turn("tool", "RESULT-LOCAL"),
            Turn("assistant", "Quiet day, mild."),
        ]
    ),
    # 3: more calls than the dataset has results of that tool
    _row(
        [
            Turn("user", "Weather in Paris and Rome, briefly"),
            Turn("assistant", "", tool_calls=_calls(("get_weather", "d"))),
            Turn("tool", "RESULT-ONLY-ONE", tool_call_id="d"),
            Turn("assistant", "Warm."),
        ]
    ),
    # 4: no tool result left (the dataset answered without calling), and plain chat without tools
    _row([Turn("user", "Paris and Rome weather, from memory"), Turn("assistant", "Probably warm.")]),
    _row([Turn("user", "hello"), Turn("assistant", "Hi.")], ()),
    # 6: a call the parser cannot read
    _row([Turn("user", "a broken call"), Turn("assistant", "", tool_calls=_calls(("get_weather", "e")))]),
]
RESULTS = ("RESULT-PARIS", "RESULT-ROME", "RESULT-NEWS", "RESULT-LOCAL", "RESULT-TOKYO", "RESULT-ONLY-ONE")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tools") / "model"
    shutil.copytree(TINY, path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


def openai_rows() -> list[dict]:
    """``ROWS`` as OpenAI rows (calls' arguments as JSON text, results as ``role: tool``)."""
    return [
        {"id": f"r{i}", "messages": [openai_message(to_message(t)) for t in turns]}
        | ({"tools": [json.loads(t) for t in tools]} if tools else {})
        for i, (turns, tools) in enumerate(ROWS)
    ]


def _generate(out: Path, model: Path, monkeypatch, crash_after: int | None = None, parser="qwen3", **kw):
    """``hsx generate`` with the scripted target on ``ROWS``, read from a JSONL file by the input stage."""
    data = model.parent / "tools.jsonl"  # one data file for every run: the files name their source
    if not data.exists():
        write_jsonl(data, openai_rows())
    monkeypatch.setattr("hsx.generate.job.open_engine", lambda name, settings: Scripted(model, crash_after))
    opts = GenerateOptions(out=out, model=str(model), data=[data], tool_parser=parser, shard_size=2, **kw)
    return generate(opts, log=lambda m: None)


def _records(out: Path) -> list:
    return [read_record(layout.sample_path(out, i, 2), i) for i in range(len(ROWS))]


@pytest.fixture(scope="module")
def tool_run(model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gen") / "gen"
    with pytest.MonkeyPatch.context() as mp:
        summary = _generate(out, model, mp)
    assert summary.complete and summary.ended_now == 4 and summary.rejected_now == 0
    return out


def test_calls_are_answered_with_the_datasets_results_paired_by_name_in_order(tool_run, model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    recs = _records(tool_run)
    par, time_, seq, more, none_, plain, broken = recs
    # 0: the target's parallel calls, its reasoning split off, each call given the next get_weather result
    assert par.ended is None and par.ok and par.tools == [json.loads(t) for t in TOOLS]
    roles = [m["role"] for m in par.messages]
    assert roles == ["user", "assistant", "tool", "tool", "assistant", "user", "assistant"]
    calls = par.messages[1]
    assert calls["reasoning_content"] == "Two cities, two calls." and calls["content"] == ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls["tool_calls"]] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]
    ids = [c["id"] for c in calls["tool_calls"]]  # hsx's where the format writes none: Kimi's form, 9+ characters
    assert ids == ["functions.get_weather:0", "functions.get_weather:1"]
    assert [(m["content"], m["tool_call_id"]) for m in par.messages[2:4]] == [
        ("RESULT-PARIS 18C", ids[0]),
        ("RESULT-ROME 24C", ids[1]),
    ]
    assert par.messages[4]["content"] == "I have 2 results." and par.messages[6]["content"] == "Hello! How can I help?"
    assert [t.message for t in par.turns] == [1, 4, 6]
    # every prompt is the template over the messages so far, and a step after calls holds exactly the
    # ids the target produced (the template renders its turn as it wrote it)
    for prev, t in zip(par.turns, par.turns[1:], strict=False):
        text = tok.apply_chat_template(
            par.messages[: t.message], tools=par.tools, tokenize=False, add_generation_prompt=True
        )
        assert tok.decode(t.prompt_ids.tolist()) == text
        n, m = len(prev.prompt_ids), len(prev.completion_ids)
        assert t.prompt_ids[: n + m].tolist() == [*prev.prompt_ids.tolist(), *prev.completion_ids.tolist()]
    # 2: one call after the other, each answered
    assert seq.ended is None and [m["content"] for m in seq.messages if m["role"] == "tool"] == [
        "RESULT-NEWS",
        "RESULT-LOCAL",
    ]
    assert seq.messages[-1]["content"] == "I have 2 results." and len(seq.turns) == 3
    assert [c["id"] for m in seq.messages for c in m.get("tool_calls") or []] == [
        "functions.get_news:0",  # numbered over the conversation's calls, as Kimi numbers its own
        "functions.get_weather:1",
    ]
    # the three that cannot be paired end at the target's call, kept with the reason
    assert time_.ended == "turn 1: the target called 'get_time', a tool the dataset's turn has no result of"
    assert more.ended == "turn 1: the target called 'get_weather' more times than the dataset's turn has results of it"
    assert (
        none_.ended == "turn 1: the target called 'get_weather' and the dataset has no tool result left for this turn"
    )
    for rec in (time_, more, none_):
        assert rec.ok and len(rec.turns) == 1 and rec.messages[-1]["tool_calls"] and len(rec.messages) == 2
    assert plain.ended is None and plain.messages[-1]["content"] == "Hello! How can I help?"
    assert broken.ended.startswith("turn 1: the target's tool call does not parse (a <tool_call> is not JSON")
    assert broken.messages[-1] == {"role": "assistant", "content": script("user\na broken call")}
    rejects = (tool_run / layout.REJECTS).read_text()
    assert rejects == ""  # ended conversations are data, not rejects


def test_status_counts_the_conversations_that_ended_at_an_unpaired_call(tool_run):
    from hsx.assess.status import assess

    progress = assess(tool_run).get("progress")
    counts = progress.data["conversations"]
    assert counts["ended"] == 4 and counts["rejected"] == 0
    assert any("4 ended early" in d and "a tool call had no result to pair" in d for d in progress.details)


def test_extraction_masks_the_targets_turns_and_never_a_tool_result(tool_run, model, tmp_path):
    from transformers import AutoTokenizer

    from hsx.extract import ExtractOptions, extract
    from hsx.plan import Plan

    out = tmp_path / "x"
    extract(ExtractOptions(out=out, model=str(model), data=[tool_run], device="cpu", writers=1), log=lambda m: None)
    plan = Plan(out)
    assert len(plan) == len(ROWS)  # the template keeps every turn: one sample per conversation
    tok = AutoTokenizer.from_pretrained(model)
    masked = []
    for i in range(len(plan)):
        ids, mask = plan.input_ids(i), plan.loss_mask(i).astype(bool)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
        masked.append([tok.decode(ids[lo:hi].tolist()) for lo, hi in zip(edges[::2], edges[1::2], strict=True)])
        whole = tok.decode(ids.tolist())
        assert all(r not in span for span in masked[-1] for r in RESULTS)
        assert "<tool_response>" in whole or i in (1, 3, 4, 5, 6)  # the results are there, unmasked
    assert masked[0] == [
        '<think>\nTwo cities, two calls.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
        '"Paris"}}\n</tool_call><tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        "<|im_end|>",
        "I have 2 results.<|im_end|>",
        "Hello! How can I help?<|im_end|>",
    ]
    assert ['"name": "get_news"' in masked[2][0], '"name": "get_weather"' in masked[2][1]] == [True, True]
    assert masked[2][2] == "I have 2 results.<|im_end|>"
    assert masked[1] == [_call("get_time", {"tz": "Asia/Tokyo"}) + "<|im_end|>"]


def test_generate_export_writes_openai_rows_with_calls_results_and_reasoning(tool_run, tmp_path):
    from hsx.generate.export import export_jsonl

    done = export_jsonl(tool_run, tmp_path / "e.jsonl")
    assert (done.conversations, done.rejected) == (len(ROWS), 0)
    rows = [json.loads(x) for x in (tmp_path / "e.jsonl").read_text().splitlines()]
    first = rows[0]
    assert first["tools"] == [json.loads(t) for t in TOOLS] and "ended" not in first
    call = first["messages"][1]
    assert call["role"] == "assistant" and call["reasoning_content"] == "Two cities, two calls."
    assert [c["type"] for c in call["tool_calls"]] == ["function", "function"]
    assert [json.loads(c["function"]["arguments"]) for c in call["tool_calls"]] == [{"city": "Paris"}, {"city": "Rome"}]
    results = first["messages"][2:4]
    assert [r["role"] for r in results] == ["tool", "tool"]
    assert [r["tool_call_id"] for r in results] == [c["id"] for c in call["tool_calls"]]
    assert all("name" not in r for r in results)  # the dataset's results have none: none is invented
    assert rows[1]["ended"].endswith("a tool the dataset's turn has no result of")
    assert "tools" not in rows[5] and rows[5]["messages"][-1] == {
        "role": "assistant",
        "content": "Hello! How can I help?",
    }


def test_an_interrupted_tool_loop_resumes_to_the_same_bytes(tool_run, model, tmp_path, monkeypatch):
    """Stopped while conversations are between a call and its answer: the resume redoes them from
    their first turn, and the run is byte for byte the uninterrupted one."""
    out = tmp_path / "gen"
    with pytest.raises(KeyboardInterrupt):
        _generate(out, model, monkeypatch, crash_after=6)  # at the second poll: two conversations mid-loop
    written = {p.name for p in (out / "shards").rglob("*.safetensors")}
    assert 0 < len(written) < len(ROWS)
    summary = _generate(out, model, monkeypatch)
    assert summary.already_done == len(written) and summary.written == len(ROWS) - len(written)
    assert run_files(out) == run_files(tool_run)
    from hsx.errors import Refused

    with pytest.raises(Refused, match="tool parser: run has qwen3, asked for hermes"):
        generate(GenerateOptions(out=out, tool_parser="hermes"), log=lambda m: None)


def test_tool_rows_without_a_way_to_read_calls_are_refused_before_a_plan(model, tmp_path, monkeypatch):
    from hsx.errors import OptionError
    from hsx.generate.toolcalls import PARSERS

    with pytest.raises(OptionError, match=rf"row 0 has tools, .* --tool-parser \({', '.join(PARSERS)}\)"):
        _generate(tmp_path / "gen", model, monkeypatch, parser=None)
    assert not (tmp_path / "gen" / "hsx.json").exists() and not list((tmp_path / "gen").rglob("*.parquet"))


@pytest.mark.parametrize(
    ("file", "refusal"),
    [
        ("Mistral-Small-3.1-24B-Instruct-2503.jinja", "Tool call IDs should be alphanumeric strings with length >= 9"),
        ("tool_chat_template_llama3.1_json.jinja", "This model only supports single tool-calls at once!"),
    ],
)
def test_regenerating_every_turn_plans_rows_whose_calls_the_template_refuses(file, refusal):
    """The dataset's calls (ids of 2 characters, two in one turn) are replaced by the target's own when
    every episode is regenerated: planning renders only the prompt of the first, and plans the row.
    With --turns last they stay in the prompt of the last episode: the row is refused in the
    template's own words."""
    from hsx.generate.folder import plan_rows
    from hsx.input import Conversation, Reject, Source, normalize
    from hsx.plan import Tokenize
    from hsx.target import load_tokenizer

    tok = load_tokenizer(TINY, False)
    tok.chat_template = (Path(__file__).parent / "data" / "templates" / file).read_text()
    weather = {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    row = {
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": None, "tool_calls": [weather | {"id": "c1"}, weather | {"id": "c2"}]},
            {"role": "tool", "tool_call_id": "c1", "content": "RESULT-PARIS"},
            {"role": "tool", "tool_call_id": "c2", "content": "RESULT-ROME"},
            {"role": "assistant", "content": "Both sunny."},
            {"role": "user", "content": "Thanks"},
            {"role": "assistant", "content": "Bye."},
        ],
    }
    conv = normalize(row, Source("d.jsonl", 0, ""))
    assert isinstance(conv, Conversation)
    tokenize = Tokenize(tok, 4096)
    (planned,) = plan_rows([(0, conv)], tokenize, "all", 1, 16)
    assert not isinstance(planned, Reject) and planned.targets == [1, 6]
    (refused,) = plan_rows([(0, conv)], tokenize, "last", 1, 16)
    assert isinstance(refused, Reject) and refusal in refused.reason


class Replays(Engine):
    """A target that answers each prompt with the turn the family's template writes for the row's
    own turn at that point (``turns``: prompt text -> turn text), ended by the eos token."""

    name, version, max_pending = "scripted", "1", 4

    def __init__(self, tok, turns: dict[str, str]):
        self.tok, self.turns, self.queue = tok, turns, []

    def submit(self, request: Request) -> None:
        self.queue.append(request)

    def poll(self, timeout=None) -> list:
        out, self.queue = [self._answer(r) for r in self.queue], []
        return out

    def _answer(self, r: Request) -> Completion:
        text = self.turns[self.tok.decode(list(r.prompt_ids))]
        ids = [*self.tok(text, add_special_tokens=False)["input_ids"], self.tok.eos_token_id]
        return Completion(r.key, r.prompt_ids, tuple(ids), "stop")

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("file", "parser"),
    [("GLM-4.7-Flash/chat_template.jinja", "glm45"), ("Qwen3-Coder.jinja", "qwen3_coder"),
     ("MiniMax-M2/chat_template.jinja", "minimax_m2")],
)  # fmt: skip
def test_generate_reads_back_and_renders_the_new_families_calls(file, parser, tmp_path, monkeypatch):
    """hsx generate on the story row with GLM-4.7's, Qwen3-Coder's and MiniMax-M2's real templates and
    their parsers: the target writes its call and its answer as the template writes the row's; the
    call is read back (name, arguments, reasoning where the template writes it), answered with the
    row's result, and the answer's prompt is the template's rendering of the conversation so far."""
    from transformers import AutoTokenizer

    from hsx.input import Conversation, read_conversations, tools_of

    path = tmp_path / "model"
    shutil.copytree(TINY, path)
    (path / "chat_template.jinja").write_text((Path(__file__).parent / "data" / "templates" / file).read_text())
    tok = AutoTokenizer.from_pretrained(path)
    agentic = Path(__file__).parent / "data" / "agentic.jsonl"
    (story,) = [c for c in read_conversations([agentic]) if isinstance(c, Conversation) and c.source.id == "story"]
    messages, tools = [to_message(t) for t in story.turns], tools_of(story)
    turns = {}
    for i in (2, 4):  # the call, the answer: what the template writes after each served prompt
        prompt = tok.apply_chat_template(messages[:i], tools=tools, tokenize=False, add_generation_prompt=True)
        upto = tok.apply_chat_template(messages[: i + 1], tools=tools, tokenize=False)
        opened = prompt if upto.startswith(prompt) else prompt[: prompt.rindex("<think>")]
        turns[prompt] = upto[len(opened) :].rstrip().removesuffix("[e~[").removesuffix(tok.eos_token)
    row = json.loads(next(line for line in agentic.read_text().splitlines() if '"id": "story"' in line))
    data = write_jsonl(tmp_path / "story.jsonl", [row])
    monkeypatch.setattr("hsx.generate.job.open_engine", lambda name, settings: Replays(tok, turns))
    out = tmp_path / "gen"
    assert generate(GenerateOptions(out=out, model=str(path), data=[data], tool_parser=parser), log=lambda m: None)
    (rec,) = [read_record(p, 0) for p in (out / "shards").rglob("*.safetensors")]
    assert rec.ended is None and [m["role"] for m in rec.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    (call,) = rec.messages[2]["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == ("get_weather", {"city": "Oslo"})
    assert (
        rec.messages[3]["content"] == "TOOLRES 21 C and sunny" and "Yes: 21 C and sunny." in rec.messages[4]["content"]
    )
    served = tok.apply_chat_template(rec.messages[:4], tools=rec.tools, tokenize=False, add_generation_prompt=True)
    assert tok.decode(rec.turns[1].prompt_ids.tolist()) == served
