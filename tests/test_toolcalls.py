"""Tool-call recognition: each parser against completions hand-written in its model's format, and the
tokenizer's own response template through transformers' ``parse_response``."""

from __future__ import annotations

import json

import pytest

from conftest import TINY
from hsx.generate.toolcalls import RESPONSE_TEMPLATE, Malformed, Recognizer, choose, deepseek_v3, hermes, kimi_k2, qwen3
from hsx.input import ToolCall


def _args(call: ToolCall) -> dict:
    return json.loads(call.arguments)


def test_hermes_reads_parallel_calls_and_the_content_before_them():
    text = (
        "I will look both up.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Rome"}}\n</tool_call>'
    )
    p = hermes(text)
    assert p.content == "I will look both up." and p.reasoning == ""
    assert [c.name for c in p.calls] == ["get_weather", "get_time"]
    assert [_args(c) for c in p.calls] == [{"city": "Paris", "unit": "c"}, {"tz": "Europe/Rome"}]
    assert hermes("Just an answer.") == type(p)("", "Just an answer.", ())
    with pytest.raises(Malformed, match="not JSON"):
        hermes('<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>')
    with pytest.raises(Malformed, match="no function name"):
        hermes('<tool_call>{"arguments": {}}</tool_call>')


def test_qwen3_splits_the_reasoning_whether_or_not_the_prompt_opened_it():
    call = '<tool_call>\n{"name": "search", "arguments": {"q": "hsx"}}\n</tool_call>'
    for text in (f"<think>\nFind it first.\n</think>\n\n{call}", f"Find it first.\n</think>\n\n{call}"):
        p = qwen3(text)
        assert p.reasoning == "Find it first." and p.content == ""
        assert [(c.name, _args(c)) for c in p.calls] == [("search", {"q": "hsx"})]
    p = qwen3("<think>\nNothing to call.\n</think>\n\nThe answer is 4.")
    assert (p.reasoning, p.content, p.calls) == ("Nothing to call.", "The answer is 4.", ())
    cut = qwen3("<think>\nstill thinking when the length ran out")  # finish reason length
    assert (cut.reasoning, cut.content) == ("still thinking when the length ran out", "")
    assert qwen3("No thinking here.").content == "No thinking here."


def test_kimi_k2_reads_its_sections_ids_and_parallel_calls():
    text = (
        "<think>Two cities.</think>Checking."
        "<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|>'
        "<|tool_calls_section_end|>"
    )
    p = kimi_k2(text)
    assert (p.reasoning, p.content) == ("Two cities.", "Checking.")
    assert [(c.name, c.id, _args(c)) for c in p.calls] == [
        ("get_weather", "functions.get_weather:0", {"city": "Paris"}),
        ("get_weather", "functions.get_weather:1", {"city": "Rome"}),
    ]
    assert kimi_k2("Plain answer.").calls == ()
    with pytest.raises(Malformed, match="not JSON"):
        kimi_k2(
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{oops"
            "<|tool_call_end|><|tool_calls_section_end|>"
        )
    with pytest.raises(Malformed, match="without a complete call"):  # cut by the length limit
        kimi_k2("<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{")


def test_deepseek_v3_reads_its_fenced_calls_and_v31s():
    v3 = (
        "Let me check.<｜tool▁calls▁begin｜>"
        '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n'
        '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{"tz": "UTC"}\n```<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜>"
    )
    p = deepseek_v3(v3)
    assert p.content == "Let me check."
    assert [(c.name, _args(c)) for c in p.calls] == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]
    v31 = (
        "<think>hm</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Oslo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    p = deepseek_v3(v31)
    assert p.reasoning == "hm" and [(c.name, _args(c)) for c in p.calls] == [("get_weather", {"city": "Oslo"})]
    with pytest.raises(Malformed):
        deepseek_v3(
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n[1]\n```<｜tool▁call▁end｜>"
        )


SCHEMA = {  # a response template in transformers' format, for the bundled tokenizer's hermes-like output
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "content": {},
        "reasoning_content": {"open": "<think>", "close": "</think>"},
        "tool_calls": {
            "open": "<tool_call>",
            "close": "</tool_call>",
            "content": "json",
            "repeats": True,
            "transform": {
                "type": "function",
                "function": {"name": "{content.name}", "arguments": "{content.arguments}"},
            },
        },
    },
}


def test_a_tokenizers_response_template_is_used_when_it_has_one():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    assert choose(tok, None) is None and choose(tok, "hermes") == "hermes"
    tok.response_template = SCHEMA  # as tokenizer_config.json's "response_template" loads
    assert choose(tok, None) == RESPONSE_TEMPLATE and choose(tok, "qwen3") == "qwen3"  # a named parser wins
    prompt = tok("<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    body = tok(text, add_special_tokens=False)["input_ids"]
    p = Recognizer(tok, RESPONSE_TEMPLATE)(text, prompt["input_ids"], body, None)
    assert p.content == "Sure." and [(c.name, _args(c)) for c in p.calls] == [("get_weather", {"city": "Paris"})]
    assert p == Recognizer(tok, "hermes")(text, [], [], None)  # the named parser reads it alike
    with pytest.raises(ValueError, match="--tool-parser takes"):
        Recognizer(tok, "llama4")
