"""Tool-call recognition: each parser against completions hand-written in its model's format and
against its family's real chat template's rendering of the agentic rows' calls, and the tokenizer's
own response template through transformers' ``parse_response``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY, with_text_arguments
from hsx.generate.toolcalls import (
    RESPONSE_TEMPLATE,
    Malformed,
    Recognizer,
    choose,
    deepseek_v3,
    glm45,
    gpt_oss,
    granite,
    hermes,
    kimi_k2,
    llama3_json,
    minimax_m2,
    mistral,
    qwen3,
    qwen3_coder,
)
from hsx.input import Conversation, ToolCall, read_conversations, to_message, tools_of


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


# ---------------------------------------------------------------- each family's parser on its template's real markup

DATA = Path(__file__).parent / "data"
EOS = "<|im_end|>"  # the bundled tokenizer's eos_token, which Mistral's template writes after a turn
DS_END = "<｜end▁of▁sentence｜>"
FAMILIES = {  # template, parser, the end-of-turn marker the template writes (a stop token, not the parser's)
    "kimi-k2-thinking": ("Kimi-K2-Thinking/chat_template.jinja", kimi_k2, EOS),
    "gpt-oss": ("gpt-oss-20b.jinja", gpt_oss, "<|call|>"),
    "qwen3": ("Qwen3.jinja", qwen3, EOS),
    "glm-4.6": ("GLM-4.6/chat_template.jinja", glm45, ""),
    "llama-3.1-json": ("tool_chat_template_llama3.1_json.jinja", llama3_json, "<|eot_id|>"),
    "mistral-small-3.1": ("Mistral-Small-3.1-24B-Instruct-2503.jinja", mistral, EOS),
    "glm-4.7": ("GLM-4.7-Flash/chat_template.jinja", glm45, ""),  # no newline after the name
    "qwen3-coder": ("Qwen3-Coder.jinja", qwen3_coder, EOS),
    "minimax-m2": ("MiniMax-M2/chat_template.jinja", minimax_m2, "[e~["),
    "deepseek-v3.1": ("DeepSeek-V3.1/chat_template.jinja", deepseek_v3, DS_END),  # the arguments as text
    "deepseek-v3.1-vllm": ("tool_chat_template_deepseekv31.jinja", deepseek_v3, DS_END),
    "deepseek-v3.2-vllm": ("tool_chat_template_deepseekv32.jinja", deepseek_v3, DS_END),
}


def _turn(prompt: str, upto: str) -> str:
    """The turn after ``prompt`` in ``upto``, the rendering up to it; where that writes other blanks
    than the prompt (vLLM's DeepSeek tool templates), after as many non-blank characters as it has."""
    if upto.startswith(prompt):
        return upto[len(prompt) :]
    n = len("".join(prompt.split()))
    at = [j for j, ch in enumerate(upto) if not ch.isspace()]
    assert "".join(upto[j] for j in at[:n]) == "".join(prompt.split())
    return upto[at[n - 1] + 1 :]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_parser_reads_back_the_calls_its_familys_template_writes(family):
    """Every call turn of the agentic rows, rendered by the family's real template (transformers'
    rendering of the conversation up to the turn, after the prompt it was served): the parser reads
    back the row's calls (by name and argument values, a number included), in order, their ids where
    the format writes them, and the reasoning and content the template wrote beside them."""
    from transformers import AutoTokenizer

    file, parser, end = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(TINY)
    tok.chat_template = (DATA / "templates" / file).read_text()
    read = 0
    for conv in read_conversations([DATA / "agentic.jsonl"]):
        if not isinstance(conv, Conversation) or not any(t.tool_calls for t in conv.turns):
            continue
        messages, tools = [to_message(t) for t in conv.turns], tools_of(conv)
        messages = with_text_arguments(messages) if family == "deepseek-v3.1" else messages  # it concatenates them
        for m in messages:  # as served: gpt-oss reads the reasoning as thinking
            m.update({"thinking": m["reasoning_content"]} if "reasoning_content" in m else {})
        for i, turn in enumerate(conv.turns):
            if not turn.tool_calls:
                continue
            try:
                prompt = tok.apply_chat_template(messages[:i], tools=tools, tokenize=False, add_generation_prompt=True)
                upto = tok.apply_chat_template(messages[: i + 1], tools=tools, tokenize=False)
            except Exception:  # a row the template refuses (test_plan checks which, in its words)
                continue
            if family == "kimi-k2-thinking" and not all(c.id.startswith("functions.") for c in turn.tool_calls):
                continue  # a dataset's own ids: Kimi's template writes no name then
            if family in ("glm-4.7", "minimax-m2") and not upto.startswith(prompt):  # the prompt opens <think>,
                prompt = prompt[: prompt.rindex("<think>")]  # which a turn without reasoning writes otherwise
            assert upto.startswith(prompt) or "vllm" in family, (family, conv.source.id)
            p = parser(_turn(prompt, upto).strip().removesuffix(end))
            calls = turn.tool_calls[:1] if family == "gpt-oss" else turn.tool_calls  # it writes the first only
            assert [(c.name, _args(c)) for c in p.calls] == [(c.name, _args(c)) for c in calls], (
                family,
                conv.source.id,
            )
            if family in ("kimi-k2-thinking", "mistral-small-3.1"):  # formats that write the id
                assert [c.id for c in p.calls] == [c.id[-9:] if family.startswith("mistral") else c.id for c in calls]
            rendered_reasoning = (
                family not in ("llama-3.1-json", "mistral-small-3.1", "qwen3-coder") and "deepseek" not in family
            )
            said = turn.reasoning or (turn.content if family == "gpt-oss" else "")  # gpt-oss: text is analysis
            assert p.reasoning == (said if rendered_reasoning else ""), (family, conv.source.id, p)
            kept_content = family in ("kimi-k2-thinking", "qwen3", "glm-4.6", "glm-4.7", "qwen3-coder", "minimax-m2")
            kept_content |= "deepseek" in family
            assert p.content == (turn.content if kept_content else ""), (family, conv.source.id, p)
            read += 1
    assert read >= 5


def test_model_output_variants_and_malformed_calls_of_the_new_families():
    """What the models write beyond their templates' rendering: gpt-oss' recipient after the channel
    and its constrain token, Llama's python tag and ``;``-separated calls, Mistral's ``[ARGS]`` form;
    an answer that is no call stays content; markup that says a call but does not parse is Malformed."""
    harmony = (
        "<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
    )
    p = gpt_oss(harmony)
    assert (p.reasoning, p.content, [(c.name, _args(c)) for c in p.calls]) == (
        "Look it up.",
        "",
        [("get_weather", {"city": "Oslo"})],
    )
    assert gpt_oss("<|channel|>final<|message|>It is 3 C.").content == "It is 3 C."
    with pytest.raises(Malformed, match="not JSON"):
        gpt_oss('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"city": ')
    p = llama3_json('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "arguments": {}}')
    assert [(c.name, _args(c)) for c in p.calls] == [("f", {"x": 1}), ("g", {})] and p.content == ""
    assert llama3_json('{"answer": 42} is the JSON you want.') == type(p)(
        "", '{"answer": 42} is the JSON you want.', ()
    )
    with pytest.raises(Malformed, match="not JSON"):
        llama3_json('<|python_tag|>{"name": "f", "parameters": {')
    p = mistral('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}')
    assert p.content == "Sure." and [(c.name, c.id, _args(c)) for c in p.calls] == [
        ("get_weather", "", {"city": "Rome"}),
        ("get_time", "a1b2c3d4e", {}),
    ]
    with pytest.raises(Malformed, match="not JSON"):
        mistral('[TOOL_CALLS] [{"name": "f", "arguments": {')
    with pytest.raises(Malformed, match="no function name"):
        mistral('[TOOL_CALLS] [{"arguments": {}}]')
    p = glm45("<think>hm</think>\n<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
    assert (p.reasoning, [(c.name, _args(c)) for c in p.calls]) == ("hm", [("search", {"q": 3})])  # "3" reads as 3
    with pytest.raises(Malformed, match="without a function name"):
        glm45("<tool_call><arg_key>q</arg_key><arg_value>x</arg_value></tool_call>")


def test_granite_qwen3_coder_and_minimax_read_what_their_models_write_and_refuse_what_does_not_parse():
    """Granite's template renders no calls: its system prompt tells the model to answer "with
    <|tool_call|> followed by a JSON list of tools used", which the parser reads, parallel calls too.
    Qwen3-Coder's and MiniMax-M2's markup cut short, and a Granite list that is not JSON, are
    Malformed; text without markup is content."""
    system = (DATA / "templates" / "granite-3.3-2b-instruct.jinja").read_text()
    assert "respond only with <|tool_call|> followed by a JSON list of tools used" in system
    p = granite(
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Rome"}}, '
        '{"name": "get_time", "arguments": {"tz": "Africa/Cairo", "h24": true}}]'
    )
    assert p.content == "" and [(c.name, _args(c)) for c in p.calls] == [
        ("get_weather", {"city": "Rome"}),
        ("get_time", {"tz": "Africa/Cairo", "h24": True}),
    ]
    assert granite("It is 18 C in Rome.") == type(p)("", "It is 18 C in Rome.", ())
    with pytest.raises(Malformed, match="not JSON"):
        granite('<|tool_call|>[{"name": "get_weather", "arguments": {"city": ')
    with pytest.raises(Malformed, match="no function name"):
        granite('<|tool_call|>[{"arguments": {}}]')
    with pytest.raises(Malformed, match="does not close"):
        qwen3_coder("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n")
    assert qwen3_coder("The answer is 4.").content == "The answer is 4."
    with pytest.raises(Malformed, match="without a complete call"):
        minimax_m2('<minimax:tool_call>\n<invoke name="get_weather"><parameter name="city">Rome</parameter>')
    p = minimax_m2("<think>\nNo call needed.\n</think>\n\nIt is 4.")
    assert (p.reasoning, p.content, p.calls) == ("No call needed.", "It is 4.", ())
