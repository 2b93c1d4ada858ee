"""Tool-call recognition: a completion's text -> the target's reasoning, content and calls.

Regeneration must put the target's own turn back into the conversation as a serving stack would
(``input.to_message``: reasoning as ``reasoning_content``, calls as ``tool_calls``), so that the
next prompt renders it through the chat template and the calls can be answered with the
dataset's results. The model's own means come first: a response template in the tokenizer's
config (transformers' ``parse_response``) is used where the tokenizer has one; otherwise the
parser named by ``--tool-parser`` (it changes the output, so the run spec records it):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated for parallel
  calls; the content is the text before the first call.
- ``qwen3``: hermes' calls, with the reasoning in ``<think>...</think>`` (the template may have
  written the opening tag in the prompt).
- ``kimi_k2`` (Kimi-K2, Kimi-K2.5): ``<|tool_calls_section_begin|>`` then per call
  ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>``, then
  ``<|tool_calls_section_end|>``; the call id is ``functions.NAME:IDX``; reasoning in ``<think>``.
- ``deepseek_v3``: ``<｜tool▁calls▁begin｜>`` then per call ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME``
  and the arguments in a ```` ```json ```` fence, ``<｜tool▁call▁end｜>`` (V3.1's
  ``NAME<｜tool▁sep｜>{json}`` too); reasoning in ``<think>``.
- ``glm45`` (GLM-4.5, GLM-4.6): ``<tool_call>NAME`` then per argument ``<arg_key>KEY</arg_key>``
  ``<arg_value>VALUE</arg_value>`` (a string as it is, anything else as JSON), ``</tool_call>``;
  reasoning in ``<think>``.
- ``gpt_oss`` (gpt-oss' harmony format; vLLM calls it ``openai``): messages of channels, each
  ``<|channel|>NAME<|message|>TEXT`` up to ``<|end|>``, ``<|call|>`` or ``<|return|>``: ``analysis``
  is reasoning, ``final`` the content, and a message to ``functions.NAME`` (``to=`` in its header)
  a call with its JSON arguments.
- ``llama3_json`` (Llama 3.1, 3.2, 3.3): the turn is JSON ``{"name": ..., "parameters": {...}}``
  (``arguments`` too), several separated by ``;``, after ``<|python_tag|>`` or alone.
- ``mistral``: the content, then ``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments", "id"}``
  (Mistral Small 3.x), or per call ``NAME[ARGS]{json}`` (later tokenizers, ``[CALL_ID]ID`` beside).

A call whose markup is there but does not parse is ``Malformed``: the conversation ends there, with
the reason, rather than going on with a call the target did not make.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from hsx.input import ToolCall, split_think

RESPONSE_TEMPLATE = "response_template"  # what the spec records when the tokenizer's own template parses
ENGINE = "engine"  # what it records when the engine parses (a server's chat completions)


class Malformed(ValueError):
    """Call markup the parser cannot read: the text says a call, but not which or with what."""


@dataclass(frozen=True)
class Parsed:
    reasoning: str
    content: str
    calls: tuple[ToolCall, ...]


def _arguments(value: object) -> str:
    """Arguments as JSON text (``ToolCall``'s form), from an object or from JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise Malformed(f"arguments are not JSON: {value[:80]!r}") from e
    if not isinstance(value, dict):
        raise Malformed(f"arguments are a {type(value).__name__}, not an object")
    return json.dumps(value, ensure_ascii=False)


def _json_call(body: str, where: str) -> ToolCall:
    try:
        call = json.loads(body)
    except ValueError as e:
        raise Malformed(f"{where} is not JSON: {body.strip()[:80]!r}") from e
    return _named_call(call, where)


def _named_call(call: object, where: str) -> ToolCall:
    """``{"name", "arguments"}`` (or ``parameters``; an ``id`` where the format writes one) -> a call."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise Malformed(f"{where} has no function name: {json.dumps(call)[:80]!r}")
    return ToolCall(
        call["name"], _arguments(call.get("arguments", call.get("parameters", {}))), str(call.get("id") or "")
    )


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def hermes(text: str) -> Parsed:
    start = text.find("<tool_call>")
    if start < 0:
        return Parsed("", text, ())
    calls = tuple(_json_call(m.group(1), "a <tool_call>") for m in _HERMES.finditer(text, start))
    return Parsed("", text[:start].rstrip("\n"), calls)


def qwen3(text: str) -> Parsed:
    reasoning, rest = split_think(text)
    calls = hermes(rest)
    return Parsed(reasoning, calls.content, calls.calls)


_KIMI_SECTION = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?P<id>[^<]+?)\s*<\|tool_call_argument_begin\|>(?P<args>.*?)\s*<\|tool_call_end\|>",
    re.DOTALL,
)


def kimi_k2(text: str) -> Parsed:
    reasoning, rest = split_think(text)
    start = min((i for i in (rest.find(s) for s in _KIMI_SECTION) if i >= 0), default=-1)
    if start < 0:
        return Parsed(reasoning, rest, ())
    calls = []
    for m in _KIMI_CALL.finditer(rest, start):
        call_id = m.group("id")
        name = call_id.split(":", 1)[0].split(".", 1)[-1]  # functions.NAME:IDX
        if not name:
            raise Malformed(f"a Kimi tool call id without a function name: {call_id!r}")
        calls.append(ToolCall(name, _arguments(m.group("args")), call_id))
    if not calls:
        raise Malformed("a Kimi tool-calls section without a complete call")
    return Parsed(reasoning, rest[:start], tuple(calls))


_DS_BEGIN = "<｜tool▁calls▁begin｜>"
_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(?P<head>.*?)<｜tool▁sep｜>(?P<body>.*?)<｜tool▁call▁end｜>", re.DOTALL)
_DS_FENCE = re.compile(r"^(?P<name>[^\n`]*)\s*```(?:json)?\s*(?P<args>.*?)\s*```\s*$", re.DOTALL)


def deepseek_v3(text: str) -> Parsed:
    reasoning, rest = split_think(text)
    start = rest.find(_DS_BEGIN)
    if start < 0:
        return Parsed(reasoning, rest, ())
    calls = []
    for m in _DS_CALL.finditer(rest, start):
        head, body = m.group("head").strip(), m.group("body")
        fenced = _DS_FENCE.match(body)
        if head == "function" and fenced:  # V3: function<sep>NAME ```json {...} ```
            calls.append(ToolCall(fenced.group("name").strip(), _arguments(fenced.group("args"))))
        elif head:  # V3.1: NAME<sep>{...}
            calls.append(ToolCall(head, _arguments(body.strip())))
        else:
            raise Malformed(f"a DeepSeek tool call without a function name: {m.group(0)[:80]!r}")
    if not calls:
        raise Malformed("a DeepSeek tool-calls block without a complete call")
    return Parsed(reasoning, rest[:start], tuple(calls))


_GLM_CALL = re.compile(r"<tool_call>(?P<body>.*?)(?:</tool_call>|$)", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>", re.DOTALL)


def _glm_value(text: str) -> object:
    """GLM writes a string argument as it is and anything else as JSON: what reads as JSON is that
    (a string that reads as JSON, such as "3", cannot be told apart without the tool's schema)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def glm45(text: str) -> Parsed:
    reasoning, rest = split_think(text)
    start = rest.find("<tool_call>")
    if start < 0:
        return Parsed(reasoning, rest.strip(), ())
    calls = []
    for m in _GLM_CALL.finditer(rest, start):
        body = m.group("body").strip()  # GLM-4.5/4.6 write a newline after the name, GLM-4.7 none
        end = min((at for at in (body.find("\n"), body.find("<arg_key>")) if at >= 0), default=len(body))
        name, args = body[:end], body[end:]
        if not name.strip() or "<arg_" in name:
            raise Malformed(f"a GLM tool call without a function name: {m.group(0)[:80]!r}")
        arguments = {a.group("key").strip(): _glm_value(a.group("value")) for a in _GLM_ARG.finditer(args)}
        calls.append(ToolCall(name.strip(), json.dumps(arguments, ensure_ascii=False)))
    return Parsed(reasoning, rest[:start].strip(), tuple(calls))


_CODER_CALL = re.compile(
    r"<tool_call>\s*<function=(?P<name>[^>\n]*)>(?P<body>.*?)</function>\s*</tool_call>", re.DOTALL
)
_CODER_ARG = re.compile(r"<parameter=(?P<key>[^>\n]*)>\n?(?P<value>.*?)\n?</parameter>", re.DOTALL)


def qwen3_coder(text: str) -> Parsed:
    """Qwen3-Coder's XML calls: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>
    ...</function>\\n</tool_call>``, values written as GLM's are (``_glm_value``)."""
    reasoning, rest = split_think(text)
    start = rest.find("<tool_call>")
    if start < 0:
        return Parsed(reasoning, rest.strip(), ())
    calls = list(_CODER_CALL.finditer(rest, start))
    if not calls or rest[calls[-1].end() :].strip():
        raise Malformed(f"a Qwen3-Coder <tool_call> that does not close: {rest[start:][:80]!r}")
    return Parsed(reasoning, rest[:start].strip(), tuple(_xml_call(m, _CODER_ARG) for m in calls))


def _xml_call(m: re.Match, args: re.Pattern) -> ToolCall:
    name = m.group("name").strip()
    if not name:
        raise Malformed(f"a tool call without a function name: {m.group(0)[:80]!r}")
    arguments = {a.group("key").strip(): _glm_value(a.group("value")) for a in args.finditer(m.group("body"))}
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


_MINIMAX_BEGIN, _MINIMAX_END = "<minimax:tool_call>", "</minimax:tool_call>"
_MINIMAX_CALL = re.compile(r'<invoke name="(?P<name>[^"]*)">(?P<body>.*?)</invoke>', re.DOTALL)
_MINIMAX_ARG = re.compile(r'<parameter name="(?P<key>[^"]*)">(?P<value>.*?)</parameter>', re.DOTALL)


def minimax_m2(text: str) -> Parsed:
    """MiniMax-M2's calls: ``<minimax:tool_call>`` then per call ``<invoke name="NAME">`` with a
    ``<parameter name="KEY">VALUE</parameter>`` per argument (strings as they are, else JSON)."""
    reasoning, rest = split_think(text)
    start = rest.find(_MINIMAX_BEGIN)
    if start < 0:
        return Parsed(reasoning, rest.strip(), ())
    end = rest.find(_MINIMAX_END, start)
    block = rest[start + len(_MINIMAX_BEGIN) : end if end >= 0 else len(rest)]
    calls = [_xml_call(m, _MINIMAX_ARG) for m in _MINIMAX_CALL.finditer(block)]
    if end < 0 or not calls:
        raise Malformed(f"a MiniMax tool-call block without a complete call: {rest[start:][:80]!r}")
    return Parsed(reasoning, rest[:start].strip(), tuple(calls))


_GRANITE = "<|tool_call|>"


def granite(text: str) -> Parsed:
    """Granite's calls: ``<|tool_call|>`` and a JSON list of ``{"name", "arguments"}``."""
    start = text.find(_GRANITE)
    if start < 0:
        return Parsed("", text, ())
    after = text[start + len(_GRANITE) :]
    listed, _ = _decoded(text, "a Granite <|tool_call|> list", len(text) - len(after.lstrip()))
    if not isinstance(listed, list):
        raise Malformed(f"a Granite <|tool_call|> is a {type(listed).__name__}, not a list")
    return Parsed("", text[:start].rstrip(), tuple(_named_call(c, "a Granite tool call") for c in listed))


_HARMONY = re.compile(
    r"(?:<\|start\|>)?(?P<head>[^<]*(?:<\|(?:channel|constrain)\|>[^<]*)*)<\|message\|>"
    r"(?P<body>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|$)",
    re.DOTALL,
)


def gpt_oss(text: str) -> Parsed:
    reasoning, content, calls = [], [], []
    for m in _HARMONY.finditer(text):
        head, body = m.group("head"), m.group("body")
        channel = re.search(r"<\|channel\|>\s*(\w+)", head)
        recipient = re.search(r"to=functions\.([^\s<]+)", head)
        if recipient:
            calls.append(ToolCall(recipient.group(1), _arguments(body)))
        elif channel is not None and channel.group(1) == "analysis":
            reasoning.append(body)
        else:
            content.append(body)
    if not (reasoning or content or calls):
        return Parsed("", text, ())
    return Parsed("\n".join(reasoning), "\n".join(content), tuple(calls))


_PYTHON_TAG = "<|python_tag|>"


def llama3_json(text: str) -> Parsed:
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)  # after the tag it is a call, whatever else it may say
    body = body.removeprefix(_PYTHON_TAG).lstrip()
    if not tagged and not body.startswith("{"):
        return Parsed("", text, ())
    calls, at = [], 0
    try:
        while at < len(body):
            call, at = _decoded(body, "a Llama tool call", at)
            calls.append(_named_call(call, "a Llama tool call"))
            at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
    except Malformed:
        if tagged:
            raise
        return Parsed("", text, ())  # an answer that begins with a brace
    return Parsed("", "", tuple(calls))


_MISTRAL = "[TOOL_CALLS]"
_MISTRAL_CALL = re.compile(
    r"\[TOOL_CALLS\](?P<name>[^\[]+?)(?:\[CALL_ID\](?P<id>[^\[]*))?\[ARGS\](?P<args>.*?)(?=\[TOOL_CALLS\]|$)", re.DOTALL
)


def mistral(text: str) -> Parsed:
    start = text.find(_MISTRAL)
    if start < 0:
        return Parsed("", text, ())
    rest = text[start + len(_MISTRAL) :].lstrip()
    if not rest.startswith("["):  # NAME[ARGS]{json} per call
        calls = []
        for m in _MISTRAL_CALL.finditer(text, start):
            args, _ = _decoded(m.group("args").strip(), "a Mistral tool call's arguments")
            calls.append(ToolCall(m.group("name").strip(), _arguments(args), (m.group("id") or "").strip()))
        if not calls:
            raise Malformed(f"a Mistral tool call without its name and [ARGS]: {text[start:][:80]!r}")
        return Parsed("", text[:start].rstrip(), tuple(calls))
    listed, _ = _decoded(rest, "a Mistral [TOOL_CALLS] list")
    if not isinstance(listed, list):
        raise Malformed(f"a Mistral [TOOL_CALLS] is a {type(listed).__name__}, not a list")
    return Parsed("", text[:start].rstrip(), tuple(_named_call(c, "a Mistral tool call") for c in listed))


def _decoded(text: str, what: str, at: int = 0) -> tuple[object, int]:
    """The JSON value at ``at`` in ``text`` and where it ends (what follows it, such as an end-of-turn
    marker, is left)."""
    try:
        return json.JSONDecoder().raw_decode(text, at)
    except ValueError as e:
        raise Malformed(f"{what} is not JSON: {text[at:][:80]!r}") from e


PARSERS: dict[str, Callable[[str], Parsed]] = {
    "hermes": hermes,
    "qwen3": qwen3,
    "kimi_k2": kimi_k2,
    "deepseek_v3": deepseek_v3,
    "glm45": glm45,
    "qwen3_coder": qwen3_coder,
    "minimax_m2": minimax_m2,
    "granite": granite,
    "gpt_oss": gpt_oss,
    "llama3_json": llama3_json,
    "mistral": mistral,
}


def from_message(message: dict) -> Parsed:
    """A parsed message (transformers' ``parse_response``, an engine's chat completion) as a ``Parsed``."""
    calls = []
    for c in message.get("tool_calls") or []:
        f = c.get("function", c) if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise Malformed(f"a parsed call without a name: {c!r}")
        calls.append(ToolCall(f["name"], _arguments(f.get("arguments", {})), str(c.get("id") or "")))
    reasoning = message.get("reasoning_content") or message.get("thinking") or message.get("reasoning") or ""
    return Parsed(str(reasoning), str(message.get("content") or ""), tuple(calls))


class Recognizer:
    """Parses the target's completions by ``how``: ``RESPONSE_TEMPLATE`` (the tokenizer's own) or a
    name in ``PARSERS``."""

    def __init__(self, tokenizer, how: str):
        if how != RESPONSE_TEMPLATE and how not in PARSERS:
            raise ValueError(f"--tool-parser takes {', '.join(PARSERS)}, not {how!r}")
        self.tokenizer, self.how = tokenizer, how

    def __call__(self, text: str, prompt_ids: list[int], body_ids: list[int], tools: list[dict] | None) -> Parsed:
        if self.how != RESPONSE_TEMPLATE:
            return PARSERS[self.how](text)
        try:
            message = self.tokenizer.parse_response(body_ids, prefix=prompt_ids, tools=tools)
        except (KeyError, TypeError, ValueError) as e:
            raise Malformed(f"the tokenizer's response template cannot parse it ({e})") from e
        return from_message(message)


def choose(tokenizer, named: str | None) -> str | None:
    """How a new run recognises calls: the parser named, else the tokenizer's response template
    where it has one, else none (completions are content only, as before tools)."""
    if named is not None:
        return named
    return RESPONSE_TEMPLATE if getattr(tokenizer, "response_template", None) else None
