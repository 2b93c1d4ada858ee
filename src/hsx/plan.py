"""Plan stage: conversations -> the frozen, tokenized work list that a run extracts.

The chat template of the target's own tokenizer renders each conversation, with its tools, tool
calls, tool results and reasoning (``input.to_message``). The loss mask marks what the target
generates: every assistant turn's reasoning, content and call markup and its end-of-turn token;
never tool results, the tools block, system or user turns. It is derived from renderings alone, so
templates without ``{% generation %}`` markers work, and no template need render a conversation the
same way as it grows (``Tokenize.generated``): each assistant turn is extracted after its prompt as
the target was served it (``render(turns[:i], add_generation_prompt=True)``), followed by the turn
as the template writes it when it is the latest (found in ``render(turns[:i+1])``). The whole
conversation is one sample for every turn it holds exactly so; the others are extracted in the text of
a later turn that holds them, or in their own. What a template leaves out is counted (``COUNTS``).

The plan is written once into ``OUT/plan/plan.parquet`` with its fingerprint (a digest of the
token content, not of the file bytes). Sample id = row index in the plan. Resume reads only this.
An extraction of an unfinished generate run may grow its plan later: samples are appended in parts
(``write_part``, ``extract.follow``), never changed, and each part is batched on its own, so the
samples planned before are computed in the same batches as ever (invariant 7).
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from hsx.errors import PlanError, TokenizerError
from hsx.input import REASONING, Conversation, Reject, ToolCall, Turn, split_think, to_message, tools_of
from hsx.store.layout import PLAN_DIR, PLAN_FILE, part_name

PLAN_META = "plan.json"

SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("truncated", pa.bool_()),
        ("source_file", pa.string()),
        ("source_row", pa.int64()),
        ("source_id", pa.string()),
    ]
)


class NoUsableSamples(PlanError):
    """Every row was rejected: ``rejects`` says why, for the caller to write where its message says."""

    def __init__(self, rejects: list[Reject]):
        super().__init__(
            f"no usable samples: all {len(rejects)} rows were rejected"
            if rejects
            else "no usable samples: the data holds no rows"
        )
        self.rejects = rejects


class TemplateError(ValueError):
    """The chat template cannot be used to derive loss masks for this conversation."""


@dataclass(frozen=True)
class Sample:
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # int8 [T]
    truncated: bool
    source_file: str
    source_row: int
    source_id: str


# What rendering counts beside the samples (PlanInfo.rendering, the spec's plan.rendering): per key,
# how many assistant turns (calls, tool turns, rows) it concerns and what it means in the plan summary.
COUNTS = {
    "reasoning_unrendered": "assistant turns' reasoning the chat template does not render",
    "content_unrendered": "assistant turns' content the chat template does not render",
    "calls_unrendered": "tool calls the chat template does not render (by name and argument values; a template "
    "that writes a call by its id alone, as Kimi-K2's, shows no name for an id without it)",
    "tool_results_unrendered": "tool results the chat template does not render",
    "tools_unrendered": "rows' tools the chat template does not render",
    "own_sample_turns": "assistant turns extracted in a sample after their own prompt, not in the whole "
    "conversation (the template writes the conversation otherwise once later turns follow)",
    "past_max_length_turns": "assistant turns past --max-length (not extracted)",
    "served_blanks_turns": "assistant turns whose context the template's rendering of the conversation writes "
    "with other blanks than the prompt the target was served (the served prompt is stored)",
    "unforced_turns": "assistant turns the template writes without the text their prompt forced after the "
    "generation prompt (DeepSeek-R1's <think>), masked after that prompt as written",
    "text_arguments_rows": "rows whose calls' arguments the chat template renders only as JSON text, not as the "
    "objects serving engines give it (DeepSeek's official templates concatenate them as text): given as text",
    "result_names_given": "rows whose tool results the chat template renders only with a name the data does not "
    "give them (vLLM's Hermes template requires one): each named by the call it answers",
    "tool_use_template_rows": "rows rendered with the tokenizer's tool_use chat template (they offer tools; the "
    "others with its default), as transformers and serving engines pick",
    "call_ids_given": "tool calls without an id in the data, given one (functions.NAME:N, as Kimi-K2 writes them; "
    "templates such as Kimi-K2's and Mistral's render ids)",
}


@dataclass(frozen=True)
class Notes:
    """What one conversation's rendering says beside its samples: ``counts`` by ``COUNTS`` key, and
    the row's metadata fields (``Conversation.ignored``). ``write_plan`` sums them into ``PlanInfo``."""

    counts: dict[str, int]
    ignored: tuple[str, ...] = ()


@dataclass(frozen=True)
class Tokenized:
    samples: tuple[Sample, ...]
    notes: Notes


def _shown(text: str, rendered: str) -> bool:
    """``text`` is in ``rendered`` as given or JSON-escaped (templates write tool output with tojson)."""
    t = text.strip()
    return not t or any(form in rendered for form in (t, json.dumps(t)[1:-1], json.dumps(t, ensure_ascii=False)[1:-1]))


def _value_shown(value: object, rendered: str) -> bool:
    """An argument's value is in ``rendered``: each key and each scalar, as text or as JSON."""
    if isinstance(value, dict):
        return all(_shown(str(k), rendered) and _value_shown(v, rendered) for k, v in value.items())
    if isinstance(value, list):
        return all(_value_shown(v, rendered) for v in value)
    if isinstance(value, str):
        return _shown(value, rendered)
    return json.dumps(value) in rendered or str(value) in rendered


def _calls_unshown(calls: tuple[ToolCall, ...], rendered: str) -> int:
    """How many of ``calls`` ``rendered`` lacks, one by one: each call's name, in order after the
    previous one's (a dropped second call of the same tool counts), and its arguments' keys and values
    between the names of the calls around it (templates write them before or after the name)."""
    names: list[tuple[ToolCall, int]] = []
    at = 0
    for call in calls:
        pos = rendered.find(call.name, at)
        if pos >= 0:
            names.append((call, pos))
            at = pos + len(call.name)
    bounds = [0, *(pos for _, pos in names), len(rendered)]
    shown = sum(
        _value_shown(json.loads(call.arguments), rendered[bounds[k] : bounds[k + 2]])
        for k, (call, _) in enumerate(names)
    )
    return len(calls) - shown


def _said(turn: Turn) -> tuple[str, str]:
    """The turn's reasoning and content; reasoning written inline (``<think>...</think>`` before the
    answer, which templates such as Qwen3's and GLM's read as reasoning) is reasoning."""
    if turn.reasoning or "</think>" not in turn.content:
        return turn.reasoning, turn.content
    return split_think(turn.content)


def _prompt_end(prompt: str, text: str) -> int | None:
    """Where the turn after ``prompt`` starts in ``text``, the rendering up to that turn: exactly
    where ``prompt`` ends, or else, for templates whose indentation leaks other blanks around a turn
    than after its generation prompt, at the turn's first non-blank (blanks the template wrote, not
    the target); None where ``text`` does not extend ``prompt``."""
    if text.startswith(prompt):
        return len(prompt)
    bare = "".join(prompt.split())
    if not "".join(text.split()).startswith(bare):
        return None
    seen = 0
    for word in re.finditer(r"\S+", text):
        if seen + len(word.group()) > len(bare):  # the turn starts inside this word or at its start
            return word.start() + len(bare) - seen
        seen += len(word.group())
    return len(text)  # the turn renders to blanks only


def _context_end(context: str, text: str) -> int | None:
    """Where ``context`` (a rendering of the turns before one) ends in ``text`` (a rendering of them
    and that turn, which may write them otherwise): after the longest end of ``context`` that ``text``
    holds, its last place there; None where ``text`` holds none of it."""
    lo, hi = 0, len(context)  # the longest tail of context found in text has lo <= length <= hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if context[len(context) - mid :] in text:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        return 0 if not context else None
    tail = context[len(context) - lo :]
    return text.rfind(tail) + lo


def _common(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


def _turn_in(rendered: str, prompt: str, opening: int, i: int) -> tuple[str, bool]:
    """Turn ``i`` in ``rendered``, a rendering that ends with it: what follows the context
    ``prompt[:opening]`` and as much of the generation prompt ``prompt[opening:]`` as it begins with;
    and whether that is all of it (else the prompt forced text the turn's rendering lacks)."""
    end = _context_end(prompt[:opening], rendered)
    if end is None:
        raise TemplateError(f"turn {i}: the chat template writes the turns before it beyond recognition")
    head = _common(rendered[end:], prompt[opening:])
    return rendered[end + head :], head == len(prompt) - opening


def _unreasoned(message: dict) -> dict:
    """``message`` without its reasoning, given apart or inline before its answer."""
    out = {k: v for k, v in message.items() if k not in REASONING}
    if "</think>" in out.get("content", ""):
        out["content"] = split_think(out["content"])[1]
    return out


@dataclass(frozen=True)
class Generated:
    """An assistant turn in the context it was generated in (``Tokenize.generated``): ``text[:start]``
    is its prompt as served, ``text[start:]`` the turn; ``unforced``: the template writes the turn
    without text its prompt forced after the generation prompt (DeepSeek-R1's ``<think>\n``);
    ``blanks``: the rendering of the conversation up to the turn writes its context with other blanks
    than the served prompt (vLLM's DeepSeek tool templates, Hermes-3 after tool results)."""

    text: str
    start: int
    unforced: bool = False
    blanks: bool = False  # the rendering of the turns up to it writes other blanks than the served prompt


def _agree(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...], n: int) -> bool:
    """Two encodings hold the same first ``n`` tokens, at the same places."""
    return all(np.array_equal(x[:n], y[:n]) for x, y in zip(a, b, strict=True))


def named_templates(tokenizer, template: str | None = None) -> dict | None:
    """The tokenizer's named chat templates (Hermes-3's and Command-R's: ``default`` and ``tool_use``),
    None where it has one; ``template``, the name asked for (--chat-template), refused by name where
    the tokenizer has no template of that name."""
    named = tokenizer.chat_template if isinstance(tokenizer.chat_template, dict) else None
    if template is not None and template not in (named or {}):
        have = f"its named templates are {', '.join(named)}" if named else "it has one, unnamed"
        raise TokenizerError(f"--chat-template {template}: the tokenizer has no chat template of that name ({have})")
    return named


def refuse_broken_template(tokenizer, template: str | None = None) -> None:
    """Refuse, before anything is planned, a chat template that does not compile (a Jinja syntax
    error): every row would be rejected with the same error. Compiled as transformers compiles it
    for rendering (its sandbox and extensions); ``template``: the name asked for, else every
    template a row may be rendered with."""
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    found = tokenizer.chat_template
    named = found if isinstance(found, dict) else {None: found}
    for name, text in named.items():
        if text is None or (template is not None and name != template):
            continue
        try:
            _compile_jinja_template(text)
        except TemplateError as e:
            which = f"chat template {name!r}" if name else "chat template"
            where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
            raise TokenizerError(f"the tokenizer's {which} does not compile: {e}{where}; fix the template") from e


def _as_given(messages: list[dict]) -> list[dict]:
    """as the row has it"""
    return messages


def _text_arguments(messages: list[dict]) -> list[dict] | None:
    """with the calls' arguments as JSON text"""
    out, changed = [], False
    for m in messages:
        calls = m.get("tool_calls") or []
        if any(not isinstance(c["function"].get("arguments"), str) for c in calls):
            changed = True
            m = m | {"tool_calls": [c | {"function": c["function"] | {"arguments": _json_text(c)}} for c in calls]}
        out.append(m)
    return out if changed else None


def _result_names(messages: list[dict]) -> list[dict] | None:
    """with each tool result named by the call it answers"""
    out, names, changed = [], {}, False
    for m in messages:
        names |= {c["id"]: c["function"]["name"] for c in m.get("tool_calls") or [] if c.get("id")}
        if m["role"] == "tool" and not m.get("name") and m.get("tool_call_id") in names:
            changed = True
            m = m | {"name": names[m["tool_call_id"]]}
        out.append(m)
    return out if changed else None


def _named_text(messages: list[dict]) -> list[dict] | None:
    """with the calls' arguments as JSON text and each tool result named"""
    text = _text_arguments(messages)
    return None if text is None else _result_names(text)


# the forms a render tries, in order (``Tokenize.render``): each one's docstring says it in an error
FORMS = (_as_given, _text_arguments, _result_names, _named_text)


def _json_text(call: dict) -> str:
    arguments = call["function"].get("arguments")
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


class Tokenize:
    """Render with the tokenizer's chat template and derive the assistant-token mask."""

    def __init__(self, tokenizer, max_length: int, template_kwargs: dict | None = None, template: str | None = None):
        if not tokenizer.chat_template:
            raise TokenizerError(f"the tokenizer ({type(tokenizer).__name__}) has no chat template")
        self.named = named_templates(tokenizer, template)
        self.forms: set[str] = set()  # the forms of ``FORMS`` the renders since ``pieces`` began took
        self.template = template  # the one asked for (--chat-template), else transformers picks per row
        self.tokenizer = tokenizer
        # a fast (Rust) tokenizer maps tokens to characters by offsets; any other (a slow, Python one such
        # as Kimi's TikTokenTokenizer) by the token boundaries its own encoding proves (``_marks``)
        self.offsets = bool(getattr(tokenizer, "is_fast", False))
        self.max_length = max_length
        self.template_kwargs = dict(template_kwargs or {})  # e.g. enable_thinking, passed to the template

    @property
    def template_choice(self) -> str:
        """Which template renders, as the plan log says it."""
        if self.template is not None:
            return f"the tokenizer's chat template {self.template!r} (--chat-template)"
        if self.named is None:
            return "the tokenizer's chat template"
        pick = "tool_use for rows with tools, else default" if "tool_use" in self.named else "default"
        names = ", ".join(self.named)
        return f"the tokenizer's named chat templates ({names}): {pick}, as transformers and serving engines pick"

    def render(self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None) -> str:
        """The template's text of ``messages``; a turn's reasoning is offered under each name templates
        read (``input.REASONING``: Qwen3's and Kimi's ``reasoning_content``, gpt-oss' ``thinking``...).
        Calls' arguments go to the template as objects, the form serving engines hand it (vLLM parses
        OpenAI's JSON text), and tool results as the row has them (no ``name`` it lacks); a template
        that fails on that is given the other forms (``FORMS``: DeepSeek's official templates concatenate
        the arguments as text, vLLM's Hermes template wants each result's ``name``), which ``forms``
        records for the plan's counts; where every form fails, the error names what each gave."""
        messages = [
            m | {k: m["reasoning_content"] for k in REASONING} if m.get("reasoning_content") else m for m in messages
        ]
        failed: list[tuple[str, Exception]] = []
        for fix in FORMS:
            fixed = fix(messages)
            if fixed is None:
                continue
            try:
                rendered = self._render(fixed, generation_prompt, tools)
            except Exception as e:
                failed.append((fix.__doc__ or "", e))
                continue
            self.forms.add(fix.__name__)
            return rendered
        if len({str(e) for _, e in failed}) == 1:  # not the form: the template's own refusal, in its words
            raise failed[0][1]
        raise TemplateError("; ".join(f"{e} ({form})" for form, e in failed))

    def _render(self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            chat_template=self.template,
            **self.template_kwargs,
        )

    def ids(self, text: str) -> list[int]:
        """A rendered text's token ids, as the plan tokenizes it (the template writes its own specials)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generated(self, messages: list[dict], i: int, tools: list[dict] | None) -> Generated:
        """Turn ``i`` in the context it was generated in: its prompt as the target was served it, then
        the turn as the template writes it when it is the latest turn (what the target generates:
        reasoning, content, calls, end-of-turn marker).

        Where the template writes the conversation up to the turn as the prompt has it, that is its
        rendering. Where it does not (it rewrites earlier turns once this one follows, or the turn does
        not begin with text the prompt forced after the generation prompt), the turn is found in its
        rendering after the prompt's context and the generation prompt; where it conflicts with forced
        text only by its reasoning (a template told not to think), the turn as written without it.
        """
        prompt = self.render(messages[:i], True, tools)
        after = self.render(messages[: i + 1], False, tools)
        if after.startswith(prompt):
            return Generated(after, len(prompt))
        start = _prompt_end(prompt, after)
        if start is not None:  # the rendering writes other blanks before the turn: the served prompt is stored
            return Generated(prompt + after[start:], len(prompt), blanks=True)
        opening = _common(prompt, self.render(messages[:i], False, tools))  # prompt[opening:]: the generation prompt
        turn, whole = _turn_in(after, prompt, opening, i)
        if not whole and _unreasoned(messages[i]) != messages[i]:
            plain, whole = _turn_in(
                self.render([*messages[:i], _unreasoned(messages[i])], False, tools), prompt, opening, i
            )
            turn = plain if whole else turn
        return Generated(prompt + turn, len(prompt), unforced=not whole)

    def encode(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Token ids of ``text`` and each one's character span (starts, ends)."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        starts, ends = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2).T
        return np.asarray(enc["input_ids"], dtype=np.int32), starts, ends

    def head(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``encode`` of ``text`` as far as a sample reaches: all of it, or, where it runs past
        ``max_length`` tokens, its first ``max_length`` + 1 (the one after says it was cut), found
        without tokenizing the rest (a 50 MB row once took 11 GB to tokenize whole). Prefixes of
        growing length are tokenized until two of them agree on those tokens: a prefix's cut
        changes only the tokens at its end."""
        keep = self.max_length + 1
        n, before = 8 * keep, None
        while n < len(text):
            now = self.encode(text[:n])
            if before is not None and len(before[0]) > keep and _agree(now, before, keep):
                return now[0][:keep], now[1][:keep], now[2][:keep]
            before, n = now, 2 * n
        return self.encode(text)

    def pieces(self, conv: Conversation) -> tuple[list[tuple[str, list[tuple[int, int]]]], Counter]:
        """The texts to extract, each with the character spans to mask, and what the template left out.

        Each assistant turn is masked in the context it was generated in (``generated``): in the whole
        conversation where that begins with the turn's prompt and the turn as generated, else in the
        text of a later turn that does (a tool loop's prompts grow turn by turn), else in a text of its
        own. What a turn held but its rendering lacks is counted, never silently dropped.
        """
        messages, tools = [to_message(t) for t in conv.turns], tools_of(conv)
        self.forms = set()
        full = self.render(messages, False, tools)
        found: list[tuple[str, int, int]] = []
        counts: Counter = Counter()
        for i, turn in enumerate(conv.turns):
            if turn.role != "assistant":
                continue
            made = self.generated(messages, i, tools)
            text, lo, hi = made.text, made.start, len(made.text.rstrip())  # trailing newlines are not the turn's
            reasoning, content = _said(turn)
            counts["reasoning_unrendered"] += not _shown(reasoning, text[lo:hi])
            counts["content_unrendered"] += not _shown(content, text[lo:hi])
            counts["calls_unrendered"] += _calls_unshown(turn.tool_calls, text[lo:hi])
            counts["unforced_turns"] += made.unforced
            counts["served_blanks_turns"] += made.blanks
            if hi > lo:
                found.append((text, lo, hi))
        hosts: list[tuple[str, list[tuple[int, int]]]] = [(full, [])]
        for text, lo, hi in reversed(found):  # the latest turns' texts hold the most
            host = next((h for h in hosts if h[0].startswith(text[:hi])), None)
            if host is None:
                host = (text, [])
                hosts.append(host)
            host[1].insert(0, (lo, hi))
        counts["own_sample_turns"] = sum(len(spans) for _, spans in hosts[1:])
        pieces = [(text, spans) for text, spans in [hosts[0], *reversed(hosts[1:])] if spans]
        counts["tool_results_unrendered"] = sum(
            not any(_shown(t.content, text) for text, _ in pieces) for t in conv.turns if t.role == "tool"
        )
        names = [json.loads(t).get("function", {}).get("name", "") for t in conv.tools]
        named = all(any(n in text for text, _ in pieces) for n in names)
        # a call writes its tool's name: a template that renders no tools block (DeepSeek-V3.1's official
        # one) shows only in rendering the conversation alike without them
        counts["tools_unrendered"] = int(bool(names) and (not named or self.render(messages, False, []) == full))
        counts["call_ids_given"] = conv.ids_given
        counts["text_arguments_rows"] = int(bool(self.forms & {"_text_arguments", "_named_text"}))
        counts["result_names_given"] = int(bool(self.forms & {"_result_names", "_named_text"}))
        counts["tool_use_template_rows"] = int(
            self.template is None and bool(tools) and "tool_use" in (self.named or {})
        )
        return pieces, counts

    def marks(self, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Token ids of ``text`` (as far as a sample reaches: ``head``), the mask of every token that
        holds some of a span (one may begin with blanks before it), and each span's first token."""
        if not self.offsets:
            return self._marks(text, spans)
        ids, starts, ends = self.head(text)
        mask = np.zeros(len(ids), dtype=np.int8)
        firsts = []
        for lo, hi in spans:
            mask[(ends > lo) & (starts < hi)] = 1
            firsts.append(int(np.searchsorted(starts, lo)))
        return ids, mask, firsts

    def _marks(self, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """``marks`` for a tokenizer without offsets, as exactly: the text is encoded whole and in the
        pieces the spans cut it into; where the pieces' tokens, concatenated, are the whole's, each cut
        is a token boundary and a span's tokens are its pieces'. Where a token crosses a cut, each cut
        is placed by decoding: ``before(c)`` tokens decode to text ending at or before ``c``."""
        ids = np.asarray(self.ids(text), dtype=np.int32)
        cuts = sorted({c for span in spans for c in span} | {0, len(text)})
        parts = [self.ids(text[a:b]) for a, b in itertools.pairwise(cuts)]
        if [t for p in parts for t in p] == ids.tolist():
            starts = ends = dict(zip(cuts, np.cumsum([0, *map(len, parts)]).tolist(), strict=True))
        else:
            starts, ends = self._decoded_cuts(text, ids, cuts)
        mask = np.zeros(len(ids), dtype=np.int8)
        for lo, hi in spans:  # tokens that end after lo and start before hi
            mask[ends[lo] : starts[hi]] = 1
        return ids[: self.max_length + 1], mask[: self.max_length + 1], [ends[lo] for lo, _ in spans]

    def _decoded_cuts(self, text: str, ids: np.ndarray, cuts: list[int]) -> tuple[dict, dict]:
        """For each cut ``c``: how many tokens end at or before it, and how many start before it, from
        the length of text the first ``k`` tokens decode to (a binary search; the prefix of ``text``
        they decode to, so a character split between tokens counts from its start)."""
        if self.tokenizer.decode(ids.tolist()) != text:
            raise TemplateError(
                f"the tokenizer ({type(self.tokenizer).__name__}) has no offsets, merges tokens across a turn's "
                "boundary and does not decode its tokens back to the rendered text: the turn cannot be masked exactly"
            )
        memo: dict[int, int] = {0: 0}

        def length(k: int) -> int:
            if k not in memo:
                memo[k] = _common(self.tokenizer.decode(ids[:k].tolist()), text)
            return memo[k]

        def last(ok) -> int:  # the largest k in 0..n with ok(length(k)), which holds for k = 0 and up to it
            lo, hi = 0, len(ids)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if ok(length(mid)) else (lo, mid - 1)
            return lo

        ends = {c: last(lambda m, c=c: m <= c) for c in cuts}
        starts = {c: min(len(ids), last(lambda m, c=c: m < c) + 1) if c else 0 for c in cuts}
        return starts, ends

    def __call__(self, conv: Conversation) -> Tokenized:
        pieces, counts = self.pieces(conv)
        src = conv.source
        samples, truncated = [], False
        for text, spans in pieces:
            ids, mask, firsts = self.marks(text, spans)
            counts["past_max_length_turns"] += sum(k >= self.max_length for k in firsts)
            cut = len(ids) > self.max_length
            ids, mask = ids[: self.max_length], mask[: self.max_length]
            truncated |= cut
            if mask.any():
                samples.append(Sample(ids, mask, cut, src.file, src.row, src.id))
        if not samples:
            raise TemplateError(
                f"no assistant token within the first {self.max_length} tokens"
                if truncated
                else "no assistant token after rendering"
            )
        return Tokenized(tuple(samples), Notes({k: v for k, v in counts.items() if v}, conv.ignored))


def tokenize_all(items: Iterable[Conversation | Reject], tokenize: Tokenize) -> Iterator[Sample | Reject | Notes]:
    """Samples (one or more per conversation) and rejects, and each conversation's notes where it has any."""
    for item in items:
        if isinstance(item, Reject):
            yield item
            continue
        try:
            done = tokenize(item)
        except Exception as e:  # a template error on one row must not stop the run
            yield Reject(item.source, f"tokenization failed: {e}")
            continue
        yield from done.samples
        if done.notes.counts or done.notes.ignored:
            yield done.notes


class PlanBuilder:
    """Streams samples into a Parquet file and computes the plan fingerprint on the way (``first_id``:
    the id of the first sample, where the file is a part appended to a plan)."""

    def __init__(self, path: Path, rows_per_group: int = 4096, first_id: int = 0):
        self.path = path
        self.writer = pq.ParquetWriter(path, SCHEMA, compression="zstd")
        self.rows: list[Sample] = []
        self.rows_per_group = rows_per_group
        self.hash = xxhash.xxh3_128()
        self.first_id = first_id
        self.num_samples = 0
        self.num_tokens = 0

    def add(self, sample: Sample) -> None:
        self.hash.update(_sample_digest_input(self.first_id + self.num_samples, sample.input_ids, sample.loss_mask))
        self.num_samples += 1
        self.num_tokens += len(sample.input_ids)
        self.rows.append(sample)
        if len(self.rows) >= self.rows_per_group:
            self._flush()

    def _flush(self) -> None:
        if not self.rows:
            return
        cols = {
            "input_ids": [r.input_ids for r in self.rows],
            "loss_mask": [r.loss_mask for r in self.rows],
            "truncated": [r.truncated for r in self.rows],
            "source_file": [r.source_file for r in self.rows],
            "source_row": [r.source_row for r in self.rows],
            "source_id": [r.source_id for r in self.rows],
        }
        self.writer.write_table(pa.table(cols, schema=SCHEMA))
        self.rows = []

    def close(self) -> str:
        self._flush()
        self.writer.close()
        return self.hash.hexdigest()


def _sample_digest_input(sample_id: int, ids: np.ndarray, mask: np.ndarray) -> bytes:
    ids = np.ascontiguousarray(ids, dtype="<i4")
    mask = np.ascontiguousarray(mask, dtype="i1")
    return sample_id.to_bytes(8, "little") + len(ids).to_bytes(8, "little") + ids.tobytes() + mask.tobytes()


@dataclass(frozen=True)
class PlanInfo:
    fingerprint: str
    num_samples: int
    num_tokens: int
    num_truncated: int
    max_length: int
    # what rendering left out or split, by ``COUNTS`` key (non-zero only); metadata fields -> rows
    # holding them. Plans written before hsx counted these have neither.
    rendering: dict[str, int] = field(default_factory=dict)
    ignored_fields: dict[str, int] = field(default_factory=dict)

    def summary(self) -> list[str]:
        """The plan summary's lines on rendering: nothing a row carried goes without a word."""
        lines = [f"{n} {COUNTS.get(k, k)}" for k, n in self.rendering.items()]
        if self.ignored_fields:
            fields = ", ".join(f"{k} ({n} rows)" for k, n in self.ignored_fields.items())
            lines.append(f"metadata fields no template reads, not rendered: {fields}")
        return lines


class Plan:
    """The frozen plan of a run, held in memory (ids and masks are small next to hidden states):
    ``plan.parquet`` and the ``parts`` appended since (the spec's ``plan.parts``), in order."""

    def __init__(self, run_dir: Path, parts: Iterable[str] = ()):
        self.dir = run_dir / PLAN_DIR
        tables = [pq.read_table(self.dir / name) for name in (PLAN_FILE, *parts)]
        self.info = PlanInfo(**json.loads((self.dir / PLAN_META).read_text()))  # of plan.parquet, as first written
        self.bounds = np.cumsum([0] + [t.num_rows for t in tables])  # part k holds ids bounds[k]..bounds[k+1]-1
        table = pa.concat_tables(tables)
        self._ids = table.column("input_ids").combine_chunks()
        self._mask = table.column("loss_mask").combine_chunks()
        self.truncated = table.column("truncated").to_numpy(zero_copy_only=False)
        self.sources = table.select(["source_file", "source_row", "source_id"])
        self.lengths = np.diff(self._ids.offsets.to_numpy()).astype(np.int64)
        self._ids_flat = self._ids.values.to_numpy()
        self._mask_flat = self._mask.values.to_numpy()
        self._offsets = self._ids.offsets.to_numpy()

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def masked_share(self) -> float:
        """Loss-masked tokens per token, over the whole plan."""
        return float(np.count_nonzero(self._mask_flat)) / max(len(self._mask_flat), 1)

    def input_ids(self, i: int) -> np.ndarray:
        return self._ids_flat[self._offsets[i] : self._offsets[i + 1]]

    def loss_mask(self, i: int) -> np.ndarray:
        return self._mask_flat[self._offsets[i] : self._offsets[i + 1]]

    def fingerprint(self) -> str:
        """Recompute the fingerprint from the stored tokens (detects a tampered or damaged plan)."""
        h = xxhash.xxh3_128()
        for i in range(len(self)):
            h.update(_sample_digest_input(i, self.input_ids(i), self.loss_mask(i)))
        return h.hexdigest()

    def batches(self, ids: Iterable[int], budget: int, packed: bool) -> list[Batch]:
        """``batches_for`` each part's share of ``ids`` (one shard's) apart: a part appended later never
        changes the batches of the samples planned before it."""
        ids = sorted(ids)
        cuts = [0, *np.searchsorted(ids, self.bounds[1:-1]).tolist(), len(ids)]
        return [b for lo, hi in itertools.pairwise(cuts) for b in batches_for(ids[lo:hi], self.lengths, budget, packed)]


@dataclass
class Written:
    """What streaming samples into one Parquet file of a plan gave (``_stream``)."""

    builder: PlanBuilder
    fingerprint: str
    truncated: int
    rejects: list[Reject]
    rendering: Counter
    ignored: Counter


def _stream(path: Path, items: Iterable[Sample | Reject | Notes], first_id: int, allow_empty: bool) -> Written:
    """Write the samples of ``items`` durably to ``path`` (a temp file first: never half a file under
    its name), keeping the rejects and summing the notes; no samples: no file (``allow_empty``) or
    ``NoUsableSamples``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    builder = PlanBuilder(tmp, first_id=first_id)
    out = Written(builder, "", 0, [], Counter(), Counter())
    try:
        for item in items:
            if isinstance(item, Reject):
                out.rejects.append(item)
            elif isinstance(item, Notes):
                out.rendering.update(item.counts)
                out.ignored.update(item.ignored)
            else:
                builder.add(item)
                out.truncated += item.truncated
        out.fingerprint = builder.close()
        if builder.num_samples == 0 and not allow_empty:
            raise NoUsableSamples(out.rejects)
        if builder.num_samples == 0:  # nothing to keep: no file under the name
            tmp.unlink()
            return out
    except BaseException:  # an unreadable file, no usable row, Ctrl-C: no half-written plan stays behind
        builder.writer.close()
        tmp.unlink(missing_ok=True)
        raise
    from hsx.store.durable import durable_rename

    durable_rename(tmp, path)
    return out


def write_plan(
    run_dir: Path, samples: Iterable[Sample | Reject | Notes], max_length: int
) -> tuple[PlanInfo, list[Reject]]:
    """Write the plan once; rejects are returned for the caller to record, notes summed into the info."""
    from hsx.store.durable import write_durable

    w = _stream(run_dir / PLAN_DIR / PLAN_FILE, samples, 0, allow_empty=False)
    info = PlanInfo(
        w.fingerprint,
        w.builder.num_samples,
        w.builder.num_tokens,
        w.truncated,
        max_length,
        {k: w.rendering[k] for k in COUNTS if w.rendering[k]},
        dict(sorted(w.ignored.items())),
    )
    write_durable(run_dir / PLAN_DIR / PLAN_META, json.dumps(info.__dict__, indent=1).encode())
    return info, w.rejects


@dataclass(frozen=True)
class Part:
    """Samples appended to a plan (``write_part``): its file (None when every item was a reject)."""

    name: str | None
    first_id: int
    num_samples: int
    num_tokens: int
    num_truncated: int
    rejects: list[Reject]


def write_part(run_dir: Path, n: int, items: Iterable[Sample | Reject], first_id: int) -> Part:
    """Append the samples of ``items`` to the run's plan as its ``n``-th part, ids from ``first_id``.
    The part counts only once the caller records it (``spec.PlanGrowth``): until then it is a file
    no reader opens, and the next growth writes it again."""
    path = run_dir / PLAN_DIR / part_name(n)
    w = _stream(path, items, first_id, allow_empty=True)
    b = w.builder
    return Part(path.name if b.num_samples else None, first_id, b.num_samples, b.num_tokens, w.truncated, w.rejects)


@dataclass(frozen=True)
class Batch:
    """Sample ids processed by one forward pass, longest first."""

    ids: tuple[int, ...]
    max_len: int
    tokens: int  # real tokens

    @property
    def padded_tokens(self) -> int:
        return len(self.ids) * self.max_len


def batches_for(ids: Iterable[int], lengths: np.ndarray, budget: int, packed: bool = False) -> list[Batch]:
    """Group ids (one shard's) by length, longest first, into batches within ``budget`` tokens.

    The budget counts padded tokens (rows x longest), or real tokens when ``packed``. A sample
    longer than the budget gets a batch of its own. Deterministic in (ids, lengths, budget,
    packed): a resume recomputes a sample in exactly the batch an uninterrupted run would have
    used, so the tensors are bit-identical (invariant 7).
    """
    order = sorted(ids, key=lambda i: (-int(lengths[i]), i))
    out: list[Batch] = []
    cur: list[int] = []
    cur_max = total = 0
    for i in order:
        n = int(lengths[i])
        cost = total + n if packed else (len(cur) + 1) * cur_max
        if cur and cost > budget:
            out.append(Batch(tuple(cur), cur_max, total))
            cur, total = [], 0
        if not cur:
            cur_max = n
        cur.append(i)
        total += n
    if cur:
        out.append(Batch(tuple(cur), cur_max, total))
    return out


def load_plan(run: Path, spec) -> Plan:
    """The run's plan, refused unless it matches the spec's fingerprint (ids and masks come from it)."""
    try:
        plan = Plan(run, spec.plan.parts)
    except (OSError, ValueError) as e:
        raise PlanError(f"the plan in {run / PLAN_DIR} is unreadable ({e})") from e
    if len(plan) != spec.plan.num_samples or plan.fingerprint() != spec.plan.fingerprint:
        raise PlanError(f"the plan in {run / PLAN_DIR} does not match the run spec's fingerprint")
    return plan
